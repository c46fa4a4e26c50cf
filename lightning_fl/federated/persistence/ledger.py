"""Byte ledger: every byte each client uploads and downloads, counted from the encoded payloads."""

from __future__ import annotations

import torch


class ByteLedger:
    """Cumulative bytes per client and direction, plus the current round's traffic.

    Uploads count under ``up`` only when they were aggregated; an upload the gate refused counts under
    ``rejected`` (``comm/rejected_bytes`` this round, ``comm/cum_rejected_bytes`` in all), so ``comm/cum_*``
    says what the model was built from.

    The paper reports cumulative bytes per client counting both directions (FLITE, arXiv 2607.18343, section 4,
    "Communication accounting"); ``comm/cum_client_bytes`` is that number averaged over clients. It counts the
    codec's payloads, whatever carries them. A network transport (Flower) also reports the size of the messages
    that carried them (:meth:`record_message`), logged as ``comm/msg_*`` so the transport's overhead shows.

    A download is the global state in float32, or with ``trainer.compressed_downloads`` the payloads of the server's
    broadcasts that the client missed (or the float32 state, if fewer bytes): what
    :meth:`~lightning_fl.compress.downlink.Downlink.download` says; each broadcast's size is ``comm/broadcast_bytes``.
    """

    def __init__(self, num_clients: int) -> None:
        self.num_clients = num_clients
        self.up = torch.zeros(num_clients, dtype=torch.int64)
        self.down = torch.zeros(num_clients, dtype=torch.int64)
        self.msg_up = torch.zeros(num_clients, dtype=torch.int64)
        self.msg_down = torch.zeros(num_clients, dtype=torch.int64)
        self.rejected = torch.zeros(num_clients, dtype=torch.int64)  # uploads the gate refused
        self._round_up: dict[int, int] = {}
        self._round_down: dict[int, int] = {}
        self._round_rejected: dict[int, int] = {}
        self._round_msg: dict[str, dict[int, int]] = {"up": {}, "down": {}}

    def start_round(self) -> None:
        self._round_up, self._round_down, self._round_rejected = {}, {}, {}
        self._round_msg = {"up": {}, "down": {}}

    def record_message(self, client: int, direction: str, nbytes: int) -> None:
        """Count the bytes of a transport message that carried ``client``'s payload (or its instructions)."""
        if nbytes < 0:
            raise ValueError(f"Expected a non-negative byte count, got {nbytes}")
        if direction not in ("up", "down"):
            raise ValueError(f"Expected direction 'up' or 'down', got {direction!r}")
        (self.msg_up if direction == "up" else self.msg_down)[client] += nbytes
        this_round = self._round_msg[direction]
        this_round[client] = this_round.get(client, 0) + nbytes

    def record(self, client: int, direction: str, nbytes: int) -> None:
        """Count ``nbytes`` of ``client``'s traffic: ``up`` (aggregated upload), ``down`` or ``rejected`` (upload)."""
        if nbytes < 0:
            raise ValueError(f"Expected a non-negative byte count, got {nbytes}")
        tables = {
            "up": (self.up, self._round_up),
            "down": (self.down, self._round_down),
            "rejected": (self.rejected, self._round_rejected),
        }
        if direction not in tables:
            raise ValueError(f"Expected direction 'up', 'down' or 'rejected', got {direction!r}")
        table, this_round = tables[direction]
        table[client] += nbytes
        this_round[client] = this_round.get(client, 0) + nbytes

    def metrics(self) -> dict[str, float]:
        """``comm/*`` scalars for this round and cumulatively."""
        total = self.up + self.down
        up_round = list(self._round_up.values())
        down_round = list(self._round_down.values())
        messages = {}
        for direction, table in (("up", self.msg_up), ("down", self.msg_down)):
            sizes = list(self._round_msg[direction].values())
            if sizes:
                messages[f"comm/msg_round_{direction}_bytes"] = float(sum(sizes))
                messages[f"comm/msg_client_{direction}_bytes"] = float(sum(sizes) / len(sizes))
            if bool(table.any()):
                messages[f"comm/msg_cum_client_{direction}_bytes"] = float(table.double().mean())
        return messages | {
            "comm/round_up_bytes": float(sum(up_round)),
            "comm/round_down_bytes": float(sum(down_round)),
            "comm/client_up_bytes": float(sum(up_round) / len(up_round)) if up_round else 0.0,
            "comm/client_down_bytes": float(sum(down_round) / len(down_round)) if down_round else 0.0,
            "comm/cum_client_up_bytes": float(self.up.double().mean()),
            "comm/cum_client_down_bytes": float(self.down.double().mean()),
            "comm/cum_client_bytes": float(total.double().mean()),
            "comm/cum_client_bytes_max": float(total.max()),
            "comm/cum_total_bytes": float(total.sum()),
            "comm/rejected_bytes": float(sum(self._round_rejected.values())),
            "comm/cum_rejected_bytes": float(self.rejected.sum()),
        }

    def took_part(self) -> tuple[int, float]:
        """How many clients took part (sampled at least once: a byte of theirs is counted) and their mean bytes,
        uploads and downloads (``comm/cum_client_bytes`` is the mean over every client)."""
        reached = (self.up + self.down + self.rejected) > 0
        count = int(reached.sum())
        return count, float((self.up + self.down)[reached].double().mean()) if count else 0.0

    def state_dict(self) -> dict[str, torch.Tensor]:
        state = {"up": self.up.clone(), "down": self.down.clone(), "rejected": self.rejected.clone()}
        if bool(self.msg_up.any() or self.msg_down.any()):
            state.update(msg_up=self.msg_up.clone(), msg_down=self.msg_down.clone())
        return state

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        if state["up"].shape != self.up.shape:
            raise ValueError(f"ledger for {len(state['up'])} clients cannot resume a run with {self.num_clients}")
        self.up, self.down = state["up"].clone(), state["down"].clone()
        zeros = torch.zeros_like(self.up)
        self.msg_up, self.msg_down = state.get("msg_up", zeros).clone(), state.get("msg_down", zeros).clone()
        self.rejected = state["rejected"].clone()
