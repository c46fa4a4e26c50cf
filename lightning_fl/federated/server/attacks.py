"""Hostile clients, for simulation: plug-ins that rewrite what some clients upload.

An :class:`Attack` names its clients (``--trainer.attack SignFlip --trainer.attack.clients [0,1,2]``); when one
of them uploads in a round, the server receives the attack's vector instead of the client's honest one. The
adversary is omniscient and colluding, as in the robustness literature: it sees the global state and every
client's honest upload of the round (ALIE needs their mean and spread). Attacked uploads then pass the gate
again, so a non-finite one (:class:`NaNUpload`) is dropped before any strategy sees it; bytes are counted
from the honest payload, which has the same size for every codec here.

All vectors are flat float32 (one row per upload, see :mod:`lightning_fl.federated.server.strategies.base`).
"""

from __future__ import annotations

import math
from statistics import NormalDist
from typing import ClassVar

import torch

from lightning_fl.errors import ConfigError
from lightning_fl.seeding import STREAM_ATTACK, derive_seed


class Attack:
    """Base class: :meth:`forge` returns the uploads of the attacking rows.

    Args:
        clients: Ids of the hostile clients (they attack whenever they are sampled and their training succeeds).
    """

    _plugin_base = True  # not offered as a choice in CLI messages
    #: A hostile client's upload is forged from its own honest upload alone, so the round can stream; False
    #: when forging needs every upload of the round (the round then keeps them as rows).
    per_client: ClassVar[bool] = True

    def __init__(self, clients: list[int]) -> None:
        if any(int(c) < 0 for c in clients) or len(set(clients)) != len(clients):
            raise ConfigError(f"trainer.attack.clients must be distinct client ids >= 0, got {clients}")
        self.clients = sorted(int(c) for c in clients)

    @staticmethod
    def positive(key: str, value: float) -> float:
        """``value`` if it is > 0, else a :class:`ConfigError` naming ``trainer.attack.<key>``."""
        if not value > 0:
            raise ConfigError(f"trainer.attack.{key} must be > 0, got {value}")
        return value

    def forge(
        self, round: int, current: torch.Tensor, uploads: torch.Tensor, rows: list[int], seed: int, ids: list[int]
    ) -> torch.Tensor:
        """The forged uploads of ``rows`` ``(len(rows), D)``.

        Args:
            round: The round (0-based).
            current: The global state the clients started from, ``(D,)``.
            uploads: Every upload of the round before the attack (honest values), ``(n, D)``.
            rows: Row indices of ``uploads`` that belong to attacking clients.
            seed: The run's seed (randomness derives from ``(seed, round, client)``).
            ids: Client id of each row of ``uploads``.
        """
        raise NotImplementedError

    def apply(
        self, round: int, current: torch.Tensor, uploads: torch.Tensor, ids: list[int], seed: int
    ) -> tuple[torch.Tensor, list[int]]:
        """``uploads`` with the attacking clients' rows forged, and those row indices."""
        hostile = set(self.clients)
        rows = [i for i, c in enumerate(ids) if c in hostile]
        if not rows:
            return uploads, []
        out = uploads.clone()
        out[rows] = self.forge(round, current, uploads, rows, seed, ids).to(out.dtype)
        return out, rows

    def __repr__(self) -> str:
        return f"{type(self).__name__}(clients={self.clients})"


class SignFlip(Attack):
    """Sends the honest update reversed and scaled: ``current - scale * (upload - current)``.

    Args:
        clients: Ids of the hostile clients.
        scale: How far to push against the honest direction.
    """

    def __init__(self, clients: list[int], scale: float = 1.0) -> None:
        super().__init__(clients)
        self.scale = self.positive("scale", scale)

    def forge(self, round, current, uploads, rows, seed, ids) -> torch.Tensor:
        return current - self.scale * (uploads[rows] - current)


class Scaling(Attack):
    """Boosts the honest update (model replacement, Bagdasaryan et al. 2020): ``current + factor * (upload - current)``.

    Args:
        clients: Ids of the hostile clients.
        factor: Boost of the update.
    """

    def __init__(self, clients: list[int], factor: float = 10.0) -> None:
        super().__init__(clients)
        self.factor = self.positive("factor", factor)

    def forge(self, round, current, uploads, rows, seed, ids) -> torch.Tensor:
        return current + self.factor * (uploads[rows] - current)


class GaussianNoise(Attack):
    """Sends a random update: ``current + std * N(0, I)``, drawn per client and round.

    Args:
        clients: Ids of the hostile clients.
        std: Standard deviation of each coordinate of the update.
    """

    def __init__(self, clients: list[int], std: float = 1.0) -> None:
        super().__init__(clients)
        self.std = self.positive("std", std)

    def forge(self, round, current, uploads, rows, seed, ids) -> torch.Tensor:
        out = []
        for i in rows:
            g = torch.Generator().manual_seed(derive_seed(seed, round, ids[i], STREAM_ATTACK) % 2**63)
            out.append(current + self.std * torch.randn(current.shape, generator=g, dtype=current.dtype))
        return torch.stack(out)


class ALIE(Attack):
    """ "A Little Is Enough" (Baruch, Baruch and Goldberg, NeurIPS 2019): every attacker sends ``mean - z * std``.

    ``mean`` and ``std`` are coordinate-wise over the round's honest uploads (attackers' own included, as the
    paper's colluding workers would estimate them). By default ``z`` is the paper's
    ``z_max = Phi^{-1}((n - s) / n)`` with ``s = floor(n / 2 + 1) - f`` for ``n`` uploads of which ``f`` attack:
    the largest shift that keeps the forged vectors inside the spread a majority-based defence accepts.

    Args:
        clients: Ids of the hostile clients.
        z: Shift in standard deviations; ``null``: the paper's ``z_max`` for the round's ``n`` and ``f``
            (its probability capped at 0.99 when ``f`` is a majority).
    """

    per_client = False  # the mean and spread of every upload of the round

    def __init__(self, clients: list[int], z: float | None = None) -> None:
        super().__init__(clients)
        if z is not None and not math.isfinite(z):
            raise ConfigError(f"trainer.attack.z must be a finite number or null, got {z}")
        self.z = z

    @staticmethod
    def z_max(n: int, f: int) -> float:
        """Baruch et al.'s ``z_max`` for ``n`` workers of which ``f`` are corrupted."""
        s = math.floor(n / 2 + 1) - f
        p = min(max((n - s) / n, 0.5), 0.99)
        return NormalDist().inv_cdf(p)

    def forge(self, round, current, uploads, rows, seed, ids) -> torch.Tensor:
        x = uploads.to(torch.float64)
        mean = x.mean(dim=0)
        std = x.std(dim=0) if len(x) > 1 else torch.zeros_like(mean)
        z = self.z if self.z is not None else self.z_max(len(x), len(rows))
        return (mean - z * std).expand(len(rows), -1)


class NaNUpload(Attack):
    """Sends NaN everywhere (a crashed or hostile client): the gate must drop it.

    Args:
        clients: Ids of the hostile clients.
    """

    def forge(self, round, current, uploads, rows, seed, ids) -> torch.Tensor:
        return torch.full((len(rows), uploads.shape[1]), float("nan"), dtype=uploads.dtype)
