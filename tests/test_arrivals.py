"""Arrivals as a policy of the collection: wait for all, a deadline with over-selection, k of n (late replies folded
with their staleness) and FedBuff's buffer all run through the one round runner, and every stage's hooks run under
every policy (the identity check and the aggregate's check under FedBuff too)."""

import warnings
from dataclasses import replace

import lightning as L
import pytest
import torch

from helpers import CraftedClients, Population
from lightning_fl.compress import FP32
from lightning_fl.federated import ByteLedger, Clock, FedAvg, FedAvgM, FedBuff, LocalTraining
from lightning_fl.federated.arrivals import Buffered, Timed, WaitForAll, layout_bytes
from lightning_fl.federated.arrivals.fedbuff import discount
from lightning_fl.federated.server.collect import Uploads
from lightning_fl.federated.server.round import RoundRunner
from lightning_fl.federated.server.stages import IdentityCheck, NormGate, Stage, WeightCap
from lightning_fl.federated.server.state import flatten

D = 6  # the crafted state: a (2, 2) and b (2,), float32
CLIENTS = 6
HOOKS = ("start", "on_reply", "on_upload", "on_rows", "on_fold", "on_aggregate", "on_step", "end_round")
#: Every client's time is its local steps times 0.5 s (no spread).
EXACT = {"step_s": 0.5, "device_sigma": 0.0, "link_sigma": 0.0, "latency_s": 0.0, "down_mbps": 1e6, "up_mbps": 1e6}


def update(c: int, r: int) -> torch.Tensor:
    return torch.full((D,), 0.01 * (c + 1) * (r + 1))


class Recorder(Stage):
    """Counts every hook it is called at (``rows``: it reads the round's uploads at once)."""

    def __init__(self, rows: bool = False) -> None:
        self.needs_rows = rows
        self.calls = dict.fromkeys(HOOKS, 0)

    def _count(self, hook):
        self.calls[hook] += 1

    def start(self, rnd):
        self._count("start")

    def on_reply(self, rnd, reply, entry):
        self._count("on_reply")

    def on_upload(self, rnd, entry, row):
        self._count("on_upload")
        return row

    def on_rows(self, rnd, rows):
        self._count("on_rows")
        super().on_rows(rnd, rows)  # (on_upload per row)

    def on_fold(self, rnd, entry, row):
        self._count("on_fold")
        return row

    def on_aggregate(self, rnd, total):
        self._count("on_aggregate")
        return total

    def on_step(self, rnd, step):
        self._count("on_step")

    def end_round(self, rnd):
        self._count("end_round")


class LateOnFlower(CraftedClients):
    """k of n as Flower's rounds at ``quorum`` run it: the last client of each round replies a round late, with the
    state it was trained from and its staleness discount (:mod:`lightning_fl.flower.late`)."""

    def __init__(self, update) -> None:
        super().__init__(update)
        self.left: tuple | None = None  # (reply, the state it was trained from) a round proceeded without

    def replies(self, job, clients):
        state = job.state
        *now, last = clients
        if self.left is not None:  # a busy client is sent nothing new: its late reply is its entry
            reply, then = self.left
            now = [c for c in now if c != reply.client]
            yield replace(reply, staleness=1, reference=then, discount=discount("sqrt", 0.5, 1), downloaded=False)
        yield from super().replies(job, now)
        trained = next(super().replies(job, [last]))
        self.left = (trained, {n: t.clone() for n, t in state.items()})


class Steps(Population):
    """Clients of ``2 + c % 3`` local steps each (their finish times differ)."""

    def client_dataloader(self, client: int, seed: int = 0):
        return range(2 + client % 3)


def policies():
    local = LocalTraining(epochs=1)
    deadline = Clock(**{**EXACT, "deadline_s": 1.7, "over_selection": 0.5})
    return {
        "wait-for-all": (WaitForAll(), CraftedClients(update), 4),
        "deadline-over-selection": (Timed(deadline, local, layout_bytes(FP32()), target=3), CraftedClients(update), 5),
        "k-of-n": (WaitForAll(), LateOnFlower(update), 4),
        "fedbuff": (Buffered(FedBuff(4, 3), Clock(**EXACT), local), CraftedClients(update), 0),
    }


def run_rounds(arrivals, transport, count, stages, rounds=3, strategy=None, clients=CLIENTS):
    strategy = strategy or FedAvg()
    fabric = L.Fabric(accelerator="cpu", devices=1, loggers=[])
    collection = Uploads(transport, FP32(), LocalTraining(epochs=1), arrivals=arrivals)
    runner = RoundRunner(fabric, strategy, collection, stages, ByteLedger(clients))
    state, history = {"a": torch.zeros(2, 2), "b": torch.ones(2)}, []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for r in range(rounds):
            state, metrics = runner.run(None, Steps(clients), state, r, 0, count)
            history.append(metrics)
    return state, history, [str(w.message) for w in caught]


@pytest.mark.parametrize("rows", [False, True], ids=["streamed", "rows"])
@pytest.mark.parametrize("policy", list(policies()))
def test_every_stage_hook_runs_under_every_arrival_policy(policy, rows):
    """A stage sees every hook under every policy: streamed (``on_upload`` per upload) or, with a stage that reads
    every upload at once (here the recorder itself and the identity check), ``on_rows``."""
    arrivals, transport, count = policies()[policy]
    recorder = Recorder(rows)
    identity = IdentityCheck(lambda uploads: float(len(uploads)), L.Fabric(accelerator="cpu", devices=1))
    stages = [WeightCap(1e9), recorder, NormGate(FedAvg(), max_update_norm=1e3), *([identity] if rows else [])]
    _, history, _ = run_rounds(arrivals, transport, count, stages)
    assert all(n > 0 for hook, n in recorder.calls.items() if rows or hook != "on_rows"), recorder.calls
    assert rows or recorder.calls["on_rows"] == 0  # a stream's uploads pass on_upload one by one
    assert all(h["fed/round_skipped"] == 0 and h["fed/dropped_clients"] == 0 for h in history)
    assert any(h.get("fed/late_clients", 0) > 0 for h in history) == policy.startswith("deadline")
    if rows:  # the identity check saw every upload the round aggregated (24 bytes each)
        assert [h["fed/identity_error"] for h in history] == [h["comm/round_up_bytes"] / 24 for h in history]
        assert all(h["fed/identity_error"] >= 2 for h in history)


def test_the_identity_check_runs_under_fedbuff_on_the_buffers_uploads():
    seen = []
    identity = IdentityCheck(lambda uploads: seen.append(len(uploads)) or 0.25, L.Fabric(accelerator="cpu", devices=1))
    arrivals, transport, count = policies()["fedbuff"]
    _, history, _ = run_rounds(arrivals, transport, count, [NormGate(FedAvg()), identity])
    assert seen == [3, 3, 3] and [h["fed/identity_error"] for h in history] == [0.25] * 3


def test_fedbuff_refuses_an_aggregate_whose_step_is_beyond_the_norm_bound():
    """The aggregate's check (the norm gate's ``on_step``) runs under FedBuff as in any round: FedAvgM at server
    learning rate 100 steps 100 times the buffer's mean update, beyond ``max_update_norm`` though every update is
    within it; the state stays as it was."""
    gate = NormGate(FedAvgM(server_lr=100.0), max_update_norm=0.5)
    arrivals = Buffered(FedBuff(4, 3), Clock(**EXACT), LocalTraining(epochs=1))
    start = flatten({"a": torch.zeros(2, 2), "b": torch.ones(2)}, ["a", "b"])
    state, history, messages = run_rounds(arrivals, CraftedClients(update), 0, [gate], 1, FedAvgM(server_lr=100.0))
    assert any("aggregate refused: FedAvgM's step has norm" in m and "exceeds" in m for m in messages), messages
    assert history[0]["fed/round_skipped"] == 1.0 and torch.equal(flatten(state, ["a", "b"]), start)


def test_a_late_reply_on_flower_is_folded_with_its_staleness_discount():
    """k of n: round 2 takes client 3's round-1 reply at ``s(1) = 1/sqrt(2)`` times its update, with the round's own
    three."""
    arrivals, transport, _ = policies()["k-of-n"]
    state, history, _ = run_rounds(arrivals, transport, 4, [NormGate(FedAvg())], rounds=2, clients=4)
    x = torch.tensor([0.0] * 4 + [1.0] * 2, dtype=torch.float64)
    first = sum(update(c, 0).double() for c in range(3)) / 3
    second = (sum(update(c, 1).double() for c in range(3)) + 2**-0.5 * update(3, 0).double()) / 4
    torch.testing.assert_close(flatten(state, ["a", "b"]).double(), x + first + second, rtol=0, atol=1e-6)
    assert [h["fed/clients"] for h in history] == [4, 4]
