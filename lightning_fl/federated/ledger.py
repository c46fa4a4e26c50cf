"""Byte ledger: every byte each client uploads and downloads, counted from the encoded payloads."""

from __future__ import annotations

import torch


class ByteLedger:
    """Cumulative bytes per client and direction, plus the current round's traffic.

    The paper reports cumulative bytes per client counting both directions (FLITE, arXiv 2607.18343, section 4,
    "Communication accounting"); ``comm/cum_client_bytes`` is that number averaged over clients.
    """

    def __init__(self, num_clients: int) -> None:
        self.num_clients = num_clients
        self.up = torch.zeros(num_clients, dtype=torch.int64)
        self.down = torch.zeros(num_clients, dtype=torch.int64)
        self._round_up: dict[int, int] = {}
        self._round_down: dict[int, int] = {}

    def start_round(self) -> None:
        self._round_up, self._round_down = {}, {}

    def record(self, client: int, direction: str, nbytes: int) -> None:
        if nbytes < 0:
            raise ValueError(f"Expected a non-negative byte count, got {nbytes}")
        if direction not in ("up", "down"):
            raise ValueError(f"Expected direction 'up' or 'down', got {direction!r}")
        table, this_round = (self.up, self._round_up) if direction == "up" else (self.down, self._round_down)
        table[client] += nbytes
        this_round[client] = this_round.get(client, 0) + nbytes

    def metrics(self) -> dict[str, float]:
        """``comm/*`` scalars for this round and cumulatively."""
        total = self.up + self.down
        up_round = list(self._round_up.values())
        down_round = list(self._round_down.values())
        return {
            "comm/round_up_bytes": float(sum(up_round)),
            "comm/round_down_bytes": float(sum(down_round)),
            "comm/client_up_bytes": float(sum(up_round) / len(up_round)) if up_round else 0.0,
            "comm/client_down_bytes": float(sum(down_round) / len(down_round)) if down_round else 0.0,
            "comm/cum_client_up_bytes": float(self.up.double().mean()),
            "comm/cum_client_down_bytes": float(self.down.double().mean()),
            "comm/cum_client_bytes": float(total.double().mean()),
            "comm/cum_client_bytes_max": float(total.max()),
            "comm/cum_total_bytes": float(total.sum()),
        }

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"up": self.up.clone(), "down": self.down.clone()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        if state["up"].shape != self.up.shape:
            raise ValueError(f"ledger for {len(state['up'])} clients cannot resume a run with {self.num_clients}")
        self.up, self.down = state["up"].clone(), state["down"].clone()
