"""Compressed downloads, the server's side (:class:`~lightning_fl.compress.Downlink`): its broadcast is the step
compressed with its own error feedback, clients rebuild its state from the payload, each client is charged the
broadcasts it missed, and its memory round-trips through a state dict."""

from __future__ import annotations

import pytest
import torch

from lightning_fl.compress import Downlink, PayloadError, PowerSGD, TopK, apply_broadcast, wire
from lightning_fl.compress.downlink import SERVER


def test_the_server_keeps_what_compression_left_out_and_sends_it_later():
    """``e_{t+1} = (step + e_t) - D(b_t)`` with ``e_0 = 0``: the broadcasts plus the memory add up to the steps; the
    memory is the downlink's own (the upload codec's clients are untouched); a copy restored from the state dict
    continues identically."""
    g = torch.Generator().manual_seed(0)
    state = {"fc.weight": torch.randn(6, 5, generator=g), "fc.bias": torch.randn(6, generator=g)}
    codec = PowerSGD(rank=1)
    downlink = Downlink(codec)
    downlink.start(num_clients=3)
    steps = [{n: 0.1 * torch.randn(t.shape, generator=g) for n, t in state.items()} for _ in range(3)]
    sent = {n: torch.zeros_like(t) for n, t in state.items()}
    start, copy = state, None
    for i, step in enumerate(steps):
        if i == 1:  # a resumed server from here on
            copy = Downlink(codec)
            copy.start(num_clients=3)
            copy.load_state_dict(downlink.state_dict(), rounds_done=1)
            twin_state = state
        state, payload = downlink.broadcast(step, state)
        if copy is not None:
            twin_state, twin = copy.broadcast(step, twin_state)
            assert wire.dumps(twin) == wire.dumps(payload)
            assert all(torch.equal(twin_state[n], state[n]) for n in state)
        sent = {n: sent[n] + codec.decompress(payload, state, SERVER)[n] for n in state}
    memory = downlink.codec.residuals[SERVER]
    assert any(float(m.abs().max()) > 1e-4 for m in memory.values())  # rank 1 left something out
    for n in state:
        total = sum(step[n] for step in steps)
        torch.testing.assert_close(sent[n] + memory[n], total, atol=1e-6, rtol=0)
        torch.testing.assert_close(state[n] - start[n], sent[n], atol=1e-6, rtol=0)
    assert len(codec.residuals) == 0 and len(codec.queries) == 0
    assert downlink.sizes == [payload.nbytes] * 3 and payload.nbytes == 4 * (6 + 5 + 6)  # p, q and the bias


def test_a_client_refuses_a_broadcast_that_does_not_fit_its_state():
    downlink = Downlink(TopK(density=0.5))
    downlink.start(num_clients=1)
    state = {"w": torch.zeros(4)}
    _, payload = downlink.broadcast({"w": torch.tensor([1.0, -2.0, 0.5, 0.0])}, state)
    with pytest.raises(PayloadError, match="broadcast refused"):
        apply_broadcast(TopK(density=0.5), {"w": torch.zeros(5)}, payload)


def test_downloads_are_charged_by_the_broadcasts_a_client_missed_or_the_full_state():
    downlink = Downlink(TopK(density=0.5))
    downlink.start(num_clients=3)
    assert downlink.download(0, 0, full=100) == 100  # never held a state
    downlink.broadcast({"w": torch.ones(4)}, {"w": torch.zeros(4)})  # 2 entries: 16 bytes
    assert downlink.download(0, 1, full=100) == 16
    for _ in range(6):
        downlink.skip()  # refused aggregates: nothing sent
    downlink.broadcast({"w": torch.ones(4)}, {"w": torch.zeros(4)})
    assert downlink.sizes == [16, 0, 0, 0, 0, 0, 0, 16]
    assert downlink.download(0, 8, full=100) == 16  # it held round 1's state: six empty broadcasts and one of 16
    assert downlink.download(1, 8, full=100) == 100
    held = Downlink(TopK(density=0.5))
    held.start(num_clients=3)
    held.load_state_dict(downlink.state_dict(), rounds_done=8)
    for _ in range(7):
        held.broadcast({"w": torch.ones(4)}, {"w": torch.zeros(4)})
    assert held.download(0, 15, full=100) == 100  # seven broadcasts (112 bytes) cost more than the state
    with pytest.raises(ValueError, match="one broadcast per round"):
        held.load_state_dict(downlink.state_dict(), rounds_done=7)
