"""The round's mechanisms as stages: a stage acts through its hooks alone, alike whether the round streams or keeps
rows; the round knows no mechanism by name; a secure round refuses what it cannot serve."""

import ast
import warnings
from types import SimpleNamespace

import pytest
import torch

from conftest import REPO
from helpers import CraftedClients, Population, round_runner
from lightning_fl.compress import FP32
from lightning_fl.errors import ConfigError
from lightning_fl.federated import FedAvg, LocalTraining, Median
from lightning_fl.federated.clients.transport import InProcess
from lightning_fl.federated.persistence.ledger import ByteLedger
from lightning_fl.federated.server.collect import Uploads
from lightning_fl.federated.server.round import RoundRunner
from lightning_fl.federated.server.secure_uploads import SecureUploads
from lightning_fl.federated.server.stages import IdentityCheck, NormGate, Stage
from lightning_fl.privacy.secure import SecureAggregation

D = 6
STATE = {"a": torch.zeros(2, 2), "b": torch.ones(2)}


def update(c, r):
    return torch.full((D,), 0.1 * (c + 1))


class OddOut(Stage):
    """Refuses the uploads of odd clients and keeps a log of every hook it saw."""

    def __init__(self, rows: bool = False) -> None:
        self.needs_rows = rows
        self.seen: list[tuple] = []

    def start(self, rnd):
        self.seen.append(("start", tuple(rnd.sampled)))

    def on_reply(self, rnd, reply, entry):
        self.seen.append(("reply", reply.client))

    def on_upload(self, rnd, entry, row):
        self.seen.append(("upload", entry.client))
        if entry.client % 2:
            rnd.reject(entry, ["odd"])
            return None
        return row

    def on_fold(self, rnd, entry, row):
        self.seen.append(("fold", entry.client))
        return row

    def on_aggregate(self, rnd, total):
        self.seen.append(("aggregate", total.count))
        return total

    def on_step(self, rnd, step):
        self.seen.append(("step", step.accepted))

    def end_round(self, rnd):
        rnd.metrics["odd/refused"] = sum(1 for e in rnd.answered if e.client % 2)


def run(stages, strategy=None, clients=5):
    runner = round_runner(
        SimpleNamespace(world_size=1, global_rank=0, is_global_zero=True),
        CraftedClients(update),
        strategy=strategy,
        num_clients=clients,
    )
    runner.stages = [*runner.stages, *stages]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        state, metrics = runner.run(None, Population(clients), STATE, 0, 0, clients)
    return runner, state, metrics, [str(w.message) for w in caught]


@pytest.mark.parametrize("rows", [False, True], ids=["streamed", "rows"])
def test_a_stage_acts_through_its_hooks_alike_streamed_or_with_rows_kept(rows):
    stage = OddOut(rows)
    runner, state, metrics, messages = run([stage])
    assert runner.kept_rows == (5 if rows else 0)
    assert runner.dropped == [1, 3] and metrics["odd/refused"] == 2 and metrics["fed/dropped_clients"] == 2
    assert sum("client 1: upload rejected: odd; dropped from this round" in m for m in messages) == 1
    flat = torch.cat([state[n].reshape(-1) for n in sorted(state)])
    want = torch.tensor([0.0, 0, 0, 0, 1, 1]) + (update(0, 0) + update(2, 0) + update(4, 0)) / 3
    assert torch.allclose(flat, want, atol=1e-7)
    kinds = [s[0] for s in stage.seen]
    assert stage.seen[0] == ("start", (0, 1, 2, 3, 4)) and kinds.count("reply") == 5 and kinds.count("upload") == 5
    assert [c for k, c in stage.seen if k == "fold"] == [0, 2, 4]  # only what passed, in client order
    assert stage.seen[-2:] == [("aggregate", 3), ("step", True)]


def test_a_robust_strategy_gets_the_rows_that_passed_the_stages():
    _, state, metrics, _ = run([OddOut()], strategy=Median())
    flat = torch.cat([state[n].reshape(-1) for n in sorted(state)])
    assert torch.allclose(flat, torch.tensor([0.0, 0, 0, 0, 1, 1]) + update(2, 0))  # the median of clients 0, 2, 4
    assert metrics["odd/refused"] == 2


def test_a_refused_step_reaches_every_later_stage_and_keeps_the_state():
    class Refuse(Stage):
        def on_step(self, rnd, step):
            step.problem = "refused by the test"

    after = OddOut()
    _, state, metrics, messages = run([Refuse(), after])
    assert metrics["fed/round_skipped"] == 1 and after.seen[-1] == ("step", False)
    assert torch.equal(state["a"], STATE["a"]) and torch.equal(state["b"], STATE["b"])
    assert any("round 1: refused by the test; the global state is unchanged" in m for m in messages)


def test_a_secure_round_refuses_several_processes_and_stages_that_read_single_uploads():
    local = LocalTraining(secure=SecureAggregation())
    one = SimpleNamespace(world_size=1, global_rank=0, is_global_zero=True)
    collection = SecureUploads(InProcess(), FP32(), local)
    with pytest.raises(ConfigError, match="trainer.secure_aggregation runs in one process or on Flower"):
        RoundRunner(SimpleNamespace(world_size=2), FedAvg(), collection, [], ByteLedger(4))
    gate = NormGate(FedAvg(), max_update_norm_ratio=3.0)
    with pytest.raises(ConfigError, match=r"shows the server no single upload, but NormGate\(.*\) reads every upload"):
        RoundRunner(one, FedAvg(), collection, [gate], ByteLedger(4))
    with pytest.raises(ConfigError, match="IdentityCheck"):
        RoundRunner(one, FedAvg(), collection, [IdentityCheck(len, one)], ByteLedger(4))
    RoundRunner(one, FedAvg(), collection, [NormGate(FedAvg(), max_update_norm=1.0)], ByteLedger(4))  # sum-only: fine
    RoundRunner(SimpleNamespace(world_size=2), FedAvg(), Uploads(InProcess(), FP32(), local), [gate], ByteLedger(4))


#: The mechanisms' classes: only the builder (stages/__init__.py) and the modules that define them name them.
MECHANISMS = {
    "WeightCap",
    "SimulatedAttack",
    "NormGate",
    "CentralPrivacy",
    "ClientPrivacy",
    "RecordPrivacy",
    "CentralCanaries",
    "LocalCanaries",
    "RecordCanaryReport",
    "CompressedBroadcast",
    "IdentityCheck",
    "Timed",
    "Buffered",
    "SecureUploads",
    "Downlink",
    "RecordCanaries",
}


def test_no_module_outside_the_stage_builder_names_a_mechanisms_class():
    """The trainer, the checkpoint, the callbacks and the summary iterate the stages: the builder makes them (the
    stages and arrival policies themselves hold the plug-ins they run)."""
    package = REPO / "lightning_fl"
    mechanisms = (package / "federated" / "server" / "stages", package / "federated" / "arrivals")
    naming = {}
    for path in sorted(package.rglob("*.py")):
        tree = ast.parse(path.read_text())
        defined = {n.name for n in ast.walk(tree) if isinstance(n, ast.ClassDef)}
        used = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
        used |= {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
        used |= {a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
        if path.parent not in mechanisms and path.name != "__init__.py" and (named := (used & MECHANISMS) - defined):
            naming[path.relative_to(REPO).as_posix()] = sorted(named)
    assert naming == {}


def test_the_round_knows_no_mechanism_by_name():
    """round.py and collect.py run the stages they are given: they import no mechanism and name none."""
    mechanisms = ("privacy", "downlink", "attack", "identity", "dp_sgd", "NormGate", "broadcast")
    for name in ("round.py", "collect.py"):
        path = REPO / "lightning_fl" / "federated" / "server" / name
        tree = ast.parse(path.read_text())
        imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        assert not {m for m in imported if m.startswith(("lightning_fl.privacy", "lightning_fl.compress.downlink"))}
        code = [n for n in ast.walk(tree) if isinstance(n, (ast.Attribute, ast.Name))]
        named = {getattr(n, "attr", None) or getattr(n, "id", None) for n in code}
        assert not [m for m in mechanisms if any(m.lower() in str(x).lower() for x in named)], name


# ------------------------------------------------------------------------------------------ what the stages decide
def crafted(given, n, **kwargs):
    from helpers import crafted_runner

    runner, population = crafted_runner(lambda c, r: given[c], n, **kwargs)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        state, metrics = runner.run(None, population, STATE, 0, 0, n)
    return runner, state, metrics, [str(w.message) for w in caught]


@pytest.mark.parametrize("ratio", [None, 1e30], ids=["streamed", "rows"])
def test_the_norm_gate_refuses_just_above_its_bound_and_keeps_just_below(ratio):
    given = {c: torch.zeros(D) for c in range(3)}
    given[0][0], given[1][0], given[2][0] = 0.99, 1.01, 0.5  # norms 0.99, 1.01, 0.5 against max_update_norm 1
    runner, state, _, messages = crafted(given, 3, max_update_norm=1.0, max_update_norm_ratio=ratio)
    assert runner.kept_rows == (0 if ratio is None else 3) and runner.dropped == [1]
    assert any("client 1: upload rejected: update norm 1.01 exceeds trainer.max_update_norm=1" in m for m in messages)
    assert float(state["a"].reshape(-1)[0]) == pytest.approx((0.99 + 0.5) / 2)


def test_a_linear_strategys_step_obeys_the_relative_bound_and_a_server_optimisers_step_does_not():
    """Every upload passes a gate of 3 times the median norm, but FedAvgM with server_lr 10 steps 10 times the mean
    update: linear, so its step is refused; FedAdam's step is not bounded by the clients' updates (only the absolute
    bound applies to it)."""
    from lightning_fl.federated import FedAdam, FedAvgM

    given = {c: torch.tensor([0.1, 0, 0, 0, 0, 0]) for c in range(3)}  # norm 0.1 each: the median
    _, state, metrics, messages = crafted(
        given, 3, strategy=FedAvgM(server_lr=10.0, momentum=0.0), max_update_norm_ratio=3.0
    )
    assert metrics["fed/round_skipped"] == 1 and torch.equal(state["a"], STATE["a"])
    assert any(
        "FedAvgM's step has norm 1, which is more than trainer.max_update_norm_ratio=3 times the round's "
        "median update norm 0.1" in m
        for m in messages
    )
    _, state, metrics, _ = crafted(given, 3, strategy=FedAdam(server_lr=10.0), max_update_norm_ratio=3.0)
    assert metrics["fed/round_skipped"] == 0 and float(state["a"].reshape(-1)[0]) > 0.3


def test_local_dp_accounts_every_upload_that_left_a_client_even_one_the_gate_refused():
    from lightning_fl.privacy import LocalDP

    privacy = LocalDP(noise_multiplier=1.0)
    given = {0: torch.full((D,), 0.1), 1: torch.full((D,), 5.0), 2: torch.zeros(D)}  # 1: refused; 2: training fails
    runner, _, metrics, _ = crafted(given, 3, privacy=privacy, max_update_norm=1.0, failing=[2])
    assert runner.dropped == [1, 2] and privacy.uploads == {0: 1, 1: 1}  # client 1's noised upload was released
    assert metrics["privacy/epsilon"] == pytest.approx(privacy.epsilon())


def test_dp_sgd_accounts_every_client_that_trained_even_when_its_upload_is_refused(tmp_path):
    from conftest import make_dm, make_model, make_trainer
    from lightning_fl.privacy import DPSGD

    dp = DPSGD(max_grad_norm=1.0, noise_multiplier=1.0)
    args = {"rounds": 1, "clients_per_round": 2, "dp_sgd": dp, "max_update_norm": 1e-12, "logger": False}
    trainer = make_trainer(tmp_path, **args, unprotected_statistics=True)  # (a private run logs refusals if asked)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        trainer.fit(make_model(), datamodule=make_dm(num_clients=4))
    last = trainer.history[-1]
    assert last["fed/round_skipped"] == 1 and last["unprotected/fed/dropped_clients"] == 2  # none in the aggregate
    assert sorted(trainer.dp_sgd.participations.values()) == [1, 1] and last["privacy/record_epsilon_max"] > 0
