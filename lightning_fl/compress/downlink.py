"""Compressed downloads: the server broadcasts its step compressed, with its own error feedback, and clients apply it.

Without ``trainer.compressed_downloads`` every sampled client downloads the global state in float32 each round.
With it the server sends only what changed, compressed by a copy of the upload codec's compressor (top-k or
PowerSGD, the same settings, its own memory), and carries what that compression left out into its next broadcast:
error feedback on the downlink as well as on the uplink, the double compression of Tang, Yu, Lian, Zhang and Liu
(2019), "DoubleSqueeze: Parallel Stochastic Gradient Descent with Double-pass Error-Compensated Compression" (ICML).
PowerSGD's broadcast is again a pair of low-rank factors per matrix (Vogels et al. 2019 exchange only factors). In
round ``t``::

    v_t     = (x*_{t+1} - x_t) + e_t      x*_{t+1}: the strategy's next state; e_t the server's memory (e_0 = 0)
    b_t     = C(v_t)                       the broadcast payload: its bytes are what a client downloads
    x_{t+1} = x_t + D(b_t)                 the new global state, on the server and on every client
    e_{t+1} = v_t - D(b_t)

The server computes ``x_{t+1}`` with :func:`apply_broadcast`, the function a client applies to the state it holds,
on the same bytes, so every client holds the server's state bit for bit. The strategy steps from that state (its
own state, such as server momentum, follows the uncompressed step it computed); a round whose aggregate is refused
broadcasts nothing. ``e_t`` (and PowerSGD's warm-started ``Q``) live in :meth:`Downlink.state_dict`, saved in
every round checkpoint.

Clients not sampled in a round do not receive its broadcast. A sampled client that holds the state of an earlier
round catches up with the broadcasts it missed, applied in order (each exact, so it reaches the same state), or
with the full float32 state when that is fewer bytes; a client that never held a state receives the full state.
:meth:`Downlink.download` charges exactly that (a deployment would keep the recent broadcasts to send them).
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from lightning_fl.compress.base import Payload, PayloadError, non_finite_parts
from lightning_fl.compress.error_feedback import State, UpdateCompressor

#: The key of the server's own memory in the downlink compressor's stores.
SERVER = -1


def apply_broadcast(codec: UpdateCompressor, held: State, payload: Payload) -> State:
    """The global state after ``payload``, from ``held``, the state before it (CPU tensors typed like ``held``).

    What a client computes on receiving a broadcast, and what the server itself computes, so both hold the same
    state bit for bit. A payload that is not what ``codec`` sends for a state like ``held`` raises
    :class:`~lightning_fl.compress.base.PayloadError`.
    """
    problems = codec.check_payload(payload, held)
    problems = problems or non_finite_parts(payload)
    if problems:
        raise PayloadError(f"broadcast refused: {'; '.join(problems)}")
    return codec.decode(payload, held, SERVER)


class Downlink:
    """The server's side of compressed downloads (module docstring): its compressor and memory, and which round's
    state each client holds (for the bytes it downloads).

    Args:
        codec: The upload codec; the downlink compresses with a copy of it (same settings, empty memory).
    """

    def __init__(self, codec: UpdateCompressor) -> None:
        if not isinstance(codec, UpdateCompressor):
            raise TypeError(f"compressed downloads need an update compressor (TopK, PowerSGD), got {codec!r}")
        self.codec = copy.deepcopy(codec)
        for store in self.codec.client_stores().values():  # the server's memory is never in the clients' files
            store.detach()
        self.codec.load_state_dict({})
        self.held = torch.zeros(0, dtype=torch.int64)  # per client: the round whose state it holds (-1: none)
        self.sizes: list[int] = []  # per completed round: the bytes of its broadcast (0: none)
        self._before: list[int] = [0]  # _before[t]: the bytes of every broadcast before round t
        #: The last round's broadcast (``None``: it had none).
        self.last: Payload | None = None

    def start(self, num_clients: int) -> None:
        """A fresh run of ``num_clients`` clients: no memory, no client holds a state."""
        self.codec.load_state_dict({})
        self.held = torch.full((num_clients,), -1, dtype=torch.int64)
        self.sizes, self._before, self.last = [], [0], None

    def download(self, client: int, round: int, full: int) -> int:
        """The bytes ``client`` downloads to hold round ``round``'s global state (``full``: the float32 state's),
        and it holds it from now on: the broadcasts since the round whose state it held, or ``full`` if fewer (or
        if it held none)."""
        if len(self.sizes) != round:
            raise RuntimeError(f"round {round + 1} starts after {len(self.sizes)} broadcasts")
        held, self.held[client] = int(self.held[client]), round
        return full if held < 0 else min(full, self._before[round] - self._before[held])

    def broadcast(self, step: State, state: State) -> tuple[State, Payload]:
        """Compress the server's ``step`` (``x* - x_t``, float32 CPU tensors) with its error feedback; the new
        global state (from ``state``, the current one, by :func:`apply_broadcast`) and the broadcast payload."""
        payload = self.codec.encode_update(step, SERVER)
        new = apply_broadcast(self.codec, state, payload)
        self._sent(payload.nbytes)
        self.last = payload
        return new, payload

    def skip(self) -> None:
        """A round without a new global state (its aggregate was refused): nothing is broadcast."""
        self._sent(0)
        self.last = None

    def _sent(self, nbytes: int) -> None:
        self.sizes.append(nbytes)
        self._before.append(self._before[-1] + nbytes)

    def state_dict(self) -> dict[str, Any]:
        return {
            "codec": self.codec.state_dict(),
            "held": self.held.clone(),
            "sizes": torch.tensor(self.sizes, dtype=torch.int64),
        }

    def load_state_dict(self, state: dict[str, Any], rounds_done: int) -> None:
        """Restore from :meth:`state_dict` after ``rounds_done`` rounds (its shapes are checked: ``ValueError``)."""
        held, sizes = state.get("held"), state.get("sizes")
        if not isinstance(held, torch.Tensor) or held.shape != self.held.shape:
            raise ValueError(f"its downlink state does not hold one entry per client ({len(self.held)})")
        if not isinstance(sizes, torch.Tensor) or sizes.shape != (rounds_done,):
            raise ValueError(f"its downlink state does not hold one broadcast per round ({rounds_done})")
        self.codec.load_state_dict(state.get("codec", {}))
        self.held = held.to(torch.int64).clone()
        self.sizes, self._before, self.last = [], [0], None
        for nbytes in sizes.tolist():
            self._sent(int(nbytes))

    def __repr__(self) -> str:
        return f"Downlink({self.codec!r})"
