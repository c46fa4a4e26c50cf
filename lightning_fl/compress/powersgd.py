"""PowerSGD low-rank compression of the client update, with error feedback and warm-started Q.

Vogels, Karimireddy & Jaggi (2019), "PowerSGD: Practical Low-Rank Gradient Compression for
Distributed Optimization". Each tensor with at least two dimensions is viewed as a matrix ``M``
(``shape[0] x rest``: a conv weight is out x in*kh*kw) and approximated by one power iteration,
``P = M Q``, ``P^ = orth(P)``, ``Q = M^T P^``, ``M ~ P^ Q^T``, with ``Q`` warm-started from the
client's previous round (the first ``Q`` is drawn from the shared seed, identical for every client).
In federated learning the client runs the iteration on its own update and sends both factors
(``4 (n + m) r`` bytes); tensors that low rank would not shrink (1-D tensors: biases, norms) are sent
uncompressed in float32. Error feedback keeps ``M - P^ Q^T`` for the client's next update.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from lightning_fl.compress.base import Encoded, Layout, Payload
from lightning_fl.compress.client_state import ClientStateStore
from lightning_fl.compress.error_feedback import State, UpdateCompressor
from lightning_fl.errors import ConfigError
from lightning_fl.seeding import derive_seed


class PowerSGD(UpdateCompressor):
    """Rank-``rank`` PowerSGD of each matrix-shaped update tensor.

    Args:
        rank: Rank of the approximation (2 and 8 in the FLITE paper).
        error_feedback: Carry the approximation error into the client's next update.
        warm_start: Reuse the client's ``Q`` from its previous upload (else draw it afresh each time).
        seed: Seed of the initial ``Q`` (shared by all clients).
    """

    def __init__(self, rank: int = 2, error_feedback: bool = True, warm_start: bool = True, seed: int = 0) -> None:
        super().__init__(error_feedback)
        if rank < 1:
            raise ConfigError(f"codec.rank must be >= 1, got {rank}")
        self.rank, self.warm_start, self.seed = rank, warm_start, seed
        self.queries = ClientStateStore()  # per client: its last Q of each tensor (warm start)

    def compressible(self, shape: tuple[int, ...]) -> int:
        """The rank used for a tensor of ``shape`` (0: send it uncompressed)."""
        if len(shape) < 2:
            return 0
        n, m = shape[0], int(torch.tensor(shape[1:]).prod())
        r = min(self.rank, n, m)
        return r if (n + m) * r < n * m else 0

    def _initial_query(self, name: str, m: int, r: int) -> torch.Tensor:
        tag = int.from_bytes(name.encode()[:8].ljust(8, b"\0"), "little")
        g = torch.Generator().manual_seed(derive_seed(self.seed, tag, len(name), m, r))
        return torch.randn(m, r, generator=g)

    def compress(self, update: State, client: int) -> tuple[Payload, State]:
        tensors, approx = {}, {}
        previous = self.queries.get(client, {})
        queries = {}
        for name in sorted(update):
            u = update[name]
            r = self.compressible(tuple(u.shape))
            if r == 0:
                tensors[name] = Encoded({"values": u.reshape(-1).contiguous()}, tuple(u.shape))
                approx[name] = u
                continue
            matrix = u.reshape(u.shape[0], -1)  # (n, m)
            q = previous.get(name) if self.warm_start else None
            if q is None:
                q = self._initial_query(name, matrix.shape[1], r)
            p_hat = torch.linalg.qr(matrix @ q, mode="reduced").Q  # (n, r), orthonormal columns
            q = matrix.T @ p_hat  # (m, r)
            queries[name] = q
            tensors[name] = Encoded({"p": p_hat.contiguous(), "q": q.contiguous()}, tuple(u.shape))
            approx[name] = (p_hat @ q.T).view(u.shape)
        self.queries[client] = queries  # stored whole: a store's entries are never changed in place
        return Payload(tensors), approx

    def decompress(self, payload: Payload, reference: State, client: int) -> State:
        out = {}
        for name, enc in payload.tensors.items():
            if "values" in enc.parts:
                out[name] = enc.parts["values"].to(torch.float32).view(enc.shape)
            else:
                p, q = enc.parts["p"], enc.parts["q"]
                # checked before the product: hostile factors could otherwise ask for an enormous matrix
                if p.ndim != 2 or q.ndim != 2 or p.shape[1] != q.shape[1] or len(p) * len(q) != math.prod(enc.shape):
                    raise ValueError(f"{name}: factors {tuple(p.shape)} and {tuple(q.shape)} do not make {enc.shape}")
                out[name] = (p @ q.T).to(torch.float32).view(enc.shape)
        return out

    def layout(self, reference: State) -> dict[str, Layout]:
        """Per state tensor, declaring its shape as float32: factors ``p`` ``(n, r)`` and ``q`` ``(m, r)``
        where :meth:`compressible` gives a rank, else its ``values`` flattened."""
        layout = {}
        for name, t in reference.items():
            shape, r = tuple(t.shape), self.compressible(tuple(t.shape))
            if r == 0:
                parts = {"values": (torch.float32, (t.numel(),))}
            else:
                parts = {"p": (torch.float32, (shape[0], r)), "q": (torch.float32, (t.numel() // shape[0], r))}
            layout[name] = Layout(shape, torch.float32, parts)
        return layout

    def client_stores(self) -> dict[str, ClientStateStore]:
        return {**super().client_stores(), "queries": self.queries}

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "queries": self.queries.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.queries.load_state_dict(state.get("queries", {}))

    def __repr__(self) -> str:
        return f"PowerSGD(rank={self.rank}, error_feedback={self.error_feedback}, warm_start={self.warm_start})"
