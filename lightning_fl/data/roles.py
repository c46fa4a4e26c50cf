"""A corpus of speaking roles (:class:`TextSource`: Shakespeare's plays, :mod:`lightning_fl.data.shakespeare`) and
how its pool of roles is dealt to clients (:class:`TextPartition`: one client per role as LEAF, per play, or IID
windows), for :class:`~lightning_fl.data.text.FederatedTextDataModule`."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from lightning_fl.errors import ConfigError

__all__ = ["IID", "ByPlay", "ByRole", "Role", "TextPartition", "TextSource"]


@dataclass
class Role:
    """One speaking role: its play, the speaker's normalised name and every line it speaks, in order."""

    play: str
    speaker: str
    lines: list[str]


class TextSource:
    """A corpus of speaking roles: subclasses implement :meth:`roles` (and :meth:`prepare` to fetch files)."""

    _plugin_base = True  # not offered as a choice in CLI messages

    def prepare(self) -> None:
        """Make the files available (look them up, download them); nothing to do by default."""

    def roles(self) -> list[Role]:
        """Every (play, speaker, lines) of the corpus."""
        raise NotImplementedError(f"{type(self).__name__} must define roles")


class TextPartition:
    """Deals the pool (the client plays' roles with ``min_lines`` lines or more: partitions with the same
    ``min_lines`` share vocabulary and windows) to clients, one :meth:`unit` each: role or play."""

    _plugin_base = True  # not offered as a choice in CLI messages

    def __init__(self, min_lines: int = 64) -> None:
        self.min_lines = min_lines

    def keep(self, role: Role) -> bool:
        return len(role.lines) >= self.min_lines

    def unit(self, role: Role) -> str:
        """The client ``role`` belongs to (``ByRole``, ``ByPlay``); ``IID`` overrides :meth:`split` instead."""
        raise NotImplementedError(f"{type(self).__name__} must define unit or override split")

    def split(self, roles: list[Role], owner: np.ndarray, num_clients: int | None, seed: int):
        """``[(name, sorted window indices)]`` per client; ``owner[i]`` is the role of window ``i``."""
        names, code = np.unique([self.unit(r) for r in roles], return_inverse=True)
        code = code.reshape(-1)[owner]
        groups = np.split(np.argsort(code, kind="stable"), np.cumsum(np.bincount(code, minlength=len(names)))[:-1])
        units = [(str(n), g) for n, g in zip(names, groups, strict=True) if len(g)]
        k = len(units) if num_clients is None else num_clients
        if not 1 <= k <= len(units):
            raise ConfigError(f"data.num_clients={k} but {self!r} has {len(units)} units; lower it or use null")
        return [units[i] for i in np.sort(np.random.default_rng(seed).permutation(len(units))[:k])]

    def __repr__(self) -> str:
        return f"{type(self).__name__.removeprefix('LazyInstance_')}(min_lines={self.min_lines})"


class ByRole(TextPartition):
    """One client per speaking role ``play/SPEAKER`` (LEAF)."""

    def unit(self, role: Role) -> str:
        return f"{role.play}/{role.speaker}"


class ByPlay(TextPartition):
    """One client per play, holding the windows of all its pool roles."""

    def unit(self, role: Role) -> str:
        return role.play


class IID(TextPartition):
    """The pool's windows dealt uniformly at random; ``num_clients`` null: as many clients as pool roles."""

    def split(self, roles: list[Role], owner: np.ndarray, num_clients: int | None, seed: int):
        k = len(np.unique(owner)) if num_clients is None else num_clients
        if not 1 <= k <= len(owner):
            raise ConfigError(f"data.num_clients={k} must be between 1 and the {len(owner)} training windows")
        parts = np.array_split(np.random.default_rng(seed).permutation(len(owner)), k)
        return [(f"iid-{i}", np.sort(p)) for i, p in enumerate(parts)]
