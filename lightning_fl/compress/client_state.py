"""Per-client state of a codec (error-feedback residuals, PowerSGD queries), for populations of any size.

A :class:`ClientStateStore` maps a client id to that client's tensors. Only clients that have been sampled hold
an entry, so the state is O(sampled clients), not O(population). By default every entry lives in memory and is
saved inside each round checkpoint (:meth:`ClientStateStore.state_dict` returns the entries themselves).

With a folder and a memory budget (:meth:`ClientStateStore.attach`, set by ``trainer.client_state_memory_mb``)
the store keeps at most that many bytes in memory; the least recently used entries are written to the folder
and read back when their client is sampled again. A round checkpoint then holds a manifest (which file holds
each client's newest state) instead of the tensors, and writes only the entries that changed since the last
checkpoint: a checkpoint costs O(clients sampled since), not O(clients with state x model).

Files are never overwritten in place: each write of a client's state gets a new serial number, so the files a
saved checkpoint names stay intact until a later checkpoint supersedes them (:meth:`ClientStateStore.committed`
then deletes them, unless a kept ``round_NNNN.ckpt`` still names them). A run that dies between checkpoints
therefore resumes bit for bit from its last one.

Values are treated as immutable once stored: to change a client's state, store a new dict.
"""

from __future__ import annotations

import operator
import os
import shutil
from collections import OrderedDict
from collections.abc import Iterator, MutableMapping
from pathlib import Path
from typing import Any

import torch

from lightning_fl.checkpoint import atomic_save, read_checkpoint
from lightning_fl.errors import CheckpointError

State = dict[str, torch.Tensor]
MANIFEST = "lightning_fl.client_state/1"


def nbytes(state: State) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def file_name(client: int, serial: int) -> str:
    """Where a store keeps version ``serial`` of ``client``'s state, under its folder (1,000 clients a folder)."""
    return f"{client // 1000:06d}/{client}-{serial}.pt"


def import_files(manifest: dict[str, Any], source: Path, folder: Path) -> None:
    """Link (or copy) the files a manifest names from ``source`` into ``folder``: resuming another run folder's
    checkpoint into a new run folder. Nothing happens for entries kept in the checkpoint itself."""
    if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST or Path(source) == Path(folder):
        return
    for client, serial in zip(manifest["clients"].tolist(), manifest["serials"].tolist(), strict=True):
        there, here = Path(source) / file_name(client, serial), Path(folder) / file_name(client, serial)
        if not there.is_file():
            raise CheckpointError(
                f"client {client}'s codec state file {there} is missing; resume from the run folder's "
                "checkpoints/last.ckpt, with its client_state folder beside it"
            )
        here.parent.mkdir(parents=True, exist_ok=True)
        if not here.exists():
            try:
                os.link(there, here)
            except OSError:
                shutil.copy2(there, here)


class ClientStateStore(MutableMapping):
    """``{client id: {name: tensor}}``, in memory up to a budget and in files beyond it (module docstring)."""

    def __init__(self) -> None:
        self._memory: OrderedDict[int, State] = OrderedDict()  # least recently used first
        self._bytes = 0
        self._dirty: set[int] = set()  # in memory and newer than its file (or without one)
        self.folder: Path | None = None
        self.budget: int | None = None
        self._files: dict[int, int] = {}  # client -> serial of its newest file
        self._committed: dict[int, int] = {}  # client -> serial named by the last saved checkpoint
        self._pinned: set[tuple[int, int]] = set()  # (client, serial) named by a kept round_NNNN.ckpt
        self._serial = 0

    # ------------------------------------------------------------------ set-up
    def attach(self, folder: Path, budget_bytes: int) -> None:
        """Keep at most ``budget_bytes`` of state in memory; write the rest under ``folder``."""
        if budget_bytes < 0:
            raise ValueError(f"Expected a memory budget >= 0 bytes, got {budget_bytes}")
        self.folder, self.budget = Path(folder), int(budget_bytes)
        self._evict()

    def detach(self) -> None:
        """Forget the folder and the budget and every entry: an empty store held in memory (a copy of a store that
        must not share its files, such as the server's downlink memory, :mod:`lightning_fl.compress.downlink`)."""
        self.folder, self.budget = None, None
        self.load_state_dict({})
        self._pinned.clear()
        self._serial = 0

    @property
    def file_backed(self) -> bool:
        return self.folder is not None

    def memory_bytes(self) -> int:
        """Bytes of the entries held in memory."""
        return self._bytes

    # ------------------------------------------------------------------ mapping
    def __getitem__(self, client: int) -> State:
        client = int(client)
        if client in self._memory:
            self._memory.move_to_end(client)
            return self._memory[client]
        if client not in self._files:
            raise KeyError(client)
        state = self._read(client, self._files[client])
        self._remember(client, state, dirty=False)
        return state

    def __setitem__(self, client: int, state: State) -> None:
        self._remember(int(client), dict(state), dirty=True)

    def __delitem__(self, client: int) -> None:
        client = int(client)
        if client not in self:
            raise KeyError(client)
        if client in self._memory:
            self._bytes -= nbytes(self._memory.pop(client))
            self._dirty.discard(client)
        serial = self._files.pop(client, None)
        if serial is not None and serial != self._committed.get(client):
            self._delete(client, serial)

    def __contains__(self, client: object) -> bool:
        try:
            client = operator.index(client)  # a Python, NumPy or 0-d torch integer
        except TypeError:
            return False
        return client in self._memory or client in self._files

    def __iter__(self) -> Iterator[int]:
        return iter(sorted(set(self._memory) | set(self._files)))

    def __len__(self) -> int:
        return len(set(self._memory) | set(self._files))

    def retain(self, keep) -> None:
        """Drop every client for which ``keep(client)`` is false (a process keeps the clients it trains)."""
        for client in [c for c in self if not keep(c)]:
            del self[client]

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """In memory: ``{str(client): state}``. File-backed: changed entries are written first, and the result is
        a manifest (``clients`` and ``serials`` as int64 tensors) naming each client's newest file."""
        if self.folder is None:  # everything is in memory
            return {str(c): dict(self._memory[c]) for c in sorted(self._memory)}
        for client in sorted(self._dirty):
            self._write(client, self._memory[client])
        self._dirty.clear()
        clients = sorted(self._files)
        return {
            "format": MANIFEST,
            "clients": torch.tensor(clients, dtype=torch.int64),
            "serials": torch.tensor([self._files[c] for c in clients], dtype=torch.int64),
            "next_serial": self._serial,
        }

    def committed(self, pin: bool = False) -> None:
        """The state returned by the last :meth:`state_dict` is now in a saved checkpoint: delete the files it
        superseded (unless ``pin``-ned by a kept checkpoint). ``pin``: this checkpoint is kept for good."""
        if self.folder is None:
            return
        for client, serial in self._committed.items():
            if self._files.get(client) != serial and (client, serial) not in self._pinned:
                self._delete(client, serial)
        self._committed = dict(self._files)
        if pin:
            self._pinned.update(self._files.items())

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore from :meth:`state_dict`'s output (a manifest's files must be in this store's folder:
        :func:`import_files` brings them from another run's)."""
        self._memory.clear()
        self._dirty.clear()
        self._bytes = 0
        self._files, self._committed = {}, {}
        if state.get("format") != MANIFEST:
            for client, entry in state.items():
                self[int(client)] = dict(entry)
            return
        if self.folder is None:
            raise CheckpointError(
                "the checkpoint keeps per-client codec state in files (trainer.client_state_memory_mb was set); "
                "set trainer.client_state_memory_mb to resume it"
            )
        files = dict(zip(state["clients"].tolist(), state["serials"].tolist(), strict=True))
        for client, serial in files.items():
            if not self._path(client, serial).is_file():
                raise CheckpointError(
                    f"client {client}'s codec state file {self._path(client, serial)} is missing; resume from the "
                    "run folder's checkpoints/last.ckpt, with its client_state folder beside it"
                )
        self._files, self._committed = files, dict(files)
        self._serial = int(state["next_serial"])

    # ------------------------------------------------------------------ files
    def _remember(self, client: int, state: State, dirty: bool) -> None:
        if client in self._memory:
            self._bytes -= nbytes(self._memory[client])
        self._memory[client] = state
        self._memory.move_to_end(client)
        self._bytes += nbytes(state)
        if dirty:
            self._dirty.add(client)
        self._evict()

    def _evict(self) -> None:
        if self.budget is None:
            return
        while self._bytes > self.budget and self._memory:
            client, state = self._memory.popitem(last=False)
            self._bytes -= nbytes(state)
            if client in self._dirty:
                self._write(client, state)
                self._dirty.discard(client)

    def _path(self, client: int, serial: int) -> Path:
        return self.folder / file_name(client, serial)

    def _write(self, client: int, state: State) -> None:
        old = self._files.get(client)
        self._serial += 1
        path = self._path(client, self._serial)
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_save({n: t.detach().cpu() for n, t in state.items()}, path)
        self._files[client] = self._serial
        if old is not None and old != self._committed.get(client) and (client, old) not in self._pinned:
            self._delete(client, old)  # written since the last checkpoint and already superseded

    def _read(self, client: int, serial: int) -> State:
        path = self._path(client, serial)
        state = read_checkpoint(path, f"client {client}'s codec state", fix="resume from the run's last checkpoint")
        if not isinstance(state, dict) or not all(isinstance(t, torch.Tensor) for t in state.values()):
            raise CheckpointError(f"client {client}'s codec state file {path} does not hold tensors")
        return state

    def _delete(self, client: int, serial: int) -> None:
        self._path(client, serial).unlink(missing_ok=True)

    def __repr__(self) -> str:
        where = f", files in {self.folder} beyond {self.budget} bytes" if self.folder else ""
        return f"ClientStateStore({len(self)} clients, {self._bytes} bytes in memory{where})"
