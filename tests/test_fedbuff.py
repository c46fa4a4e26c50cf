"""FedBuff (``trainer.buffered``): one step against a synchronous FedAvg round, steps computed by hand from crafted
clients (staleness discounts on the right updates, in order of arrival, ties in client order), the byte ledger,
determinism, bitwise resume, the methods and codecs it runs with, and the combinations it refuses."""

import math

import lightning as L
import pytest
import torch

from conftest import CONFIGS, make_dm, make_model, make_trainer, run_cli
from helpers import CraftedClients, Durations, quiet_fit
from lightning_fl.compress import FP32, Quantize, TopK
from lightning_fl.errors import CheckpointError, ConfigError
from lightning_fl.federated import ByteLedger, Clock, FedAvg, FedAvgM, FedBuff, LocalTraining, Median, SignFlip
from lightning_fl.federated.arrivals import Buffered
from lightning_fl.federated.server.collect import Uploads
from lightning_fl.federated.server.round import RoundRunner
from lightning_fl.federated.server.stages import NormGate
from lightning_fl.federated.server.state import flatten
from lightning_fl.methods import Classifier, LoRAClassifier, Recipe
from lightning_fl.models import SmallCNN
from lightning_fl.privacy import DPSGD, CentralDP
from lightning_fl.privacy.secure import SecureAggregation

D = 6  # the crafted state: a (2, 2) and b (2,), float32: 24 bytes down and up
#: Every client's time is its local steps times 0.5 s (no spread; the bytes take picoseconds).
EXACT = {"step_s": 0.5, "device_sigma": 0.0, "link_sigma": 0.0, "latency_s": 0.0, "down_mbps": 1e6, "up_mbps": 1e6}


def u(c: int, r: int) -> torch.Tensor:
    """Client ``c``'s crafted update when it starts at server version ``r`` (exact in binary)."""
    out = torch.zeros(D, dtype=torch.float64)
    out[c] = 0.125 * (r + 1)
    out[c + 3] = 0.0625
    return out


def crafted(buffered, steps, strategy=None, num_samples=None, clock=None):
    fabric = L.Fabric(accelerator="cpu", devices=1, loggers=[])
    strategy = strategy or FedAvg()
    local = LocalTraining(epochs=1)
    arrivals = Buffered(buffered, clock or Clock(**EXACT), local)
    collection = Uploads(CraftedClients(lambda c, r: u(c, r), num_samples), FP32(), local, arrivals=arrivals)
    runner = RoundRunner(fabric, strategy, collection, [NormGate(strategy)], ByteLedger(len(steps)))
    return runner, Durations(steps)


def run_steps(runner, dm, steps):
    state = {"a": torch.zeros(2, 2), "b": torch.ones(2)}
    x0 = flatten(state, ["a", "b"]).double()
    history = []
    for r in range(steps):
        state, metrics = runner.run(None, dm, state, r, 0, 0)
        history.append(metrics)
    return x0, flatten(state, ["a", "b"]).double(), history


# ============================================================================ closed forms
def test_with_every_client_in_every_buffer_a_step_is_a_synchronous_fedavg_round(tmp_path):
    dm = make_dm(num_clients=4)
    clock = Clock(step_s=0.3, device_sigma=0.0, link_sigma=0.0)
    args = {"rounds": 2, "clock": clock, "local_steps": 2, "logger": False}
    sync = quiet_fit(make_trainer(tmp_path / "s", **args), make_model(), dm)
    buffered = quiet_fit(make_trainer(tmp_path / "b", buffered=FedBuff(4, 4), **args), make_model(), dm)
    for name, value in sync.global_state.items():  # x + mean(x_k - x) against mean(x_k): float32 rounding apart
        torch.testing.assert_close(buffered.global_state[name], value, rtol=0, atol=1e-6)
    assert not torch.equal(sync.global_state["mapping.latent"], make_model().federated_state()["mapping.latent"])
    for h in buffered.history[1:]:
        assert h["fed/staleness_max"] == 0 and h["fed/clients"] == 4
    assert [h["time/simulated_round_s"] for h in buffered.history[1:]] == pytest.approx(
        [h["time/simulated_round_s"] for h in sync.history[1:]]
    )
    assert torch.equal(buffered.ledger.up, sync.ledger.up) and torch.equal(buffered.ledger.down, sync.ledger.down)


@pytest.mark.parametrize(
    ("staleness", "s1"),
    [(FedBuff(3, 2), 2**-0.5), (FedBuff(3, 2, "constant"), 1.0), (FedBuff(3, 2, "polynomial", exponent=1.0), 0.5)],
)
def test_a_step_discounts_each_update_by_its_staleness_in_order_of_arrival(staleness, s1):
    # Three clients of 1, 3 and 4.5 s, all in flight (concurrency 3), two updates a step. By hand:
    # t=1 client 0 (version 0) arrives; t=3 client 1 (v0): step 0 from taus 0, 0; clients 0 and 1 restart at v1.
    # t=4 client 0 (v1); t=4.5 client 2 (v0): step 1 from taus 0, 1; clients 0 and 2 restart at v2.
    # t=5.5 client 0 (v2); t=6 client 1 (v1): step 2 from taus 0, 1.
    runner, dm = crafted(staleness, [2, 6, 9])
    x0, x3, history = run_steps(runner, dm, 3)
    expected = x0 + (u(0, 0) + u(1, 0)) / 2 + (u(0, 1) + s1 * u(2, 0)) / 2 + (u(0, 2) + s1 * u(1, 1)) / 2
    torch.testing.assert_close(x3, expected, rtol=0, atol=1e-7)
    assert [h["fed/staleness_max"] for h in history] == [0, 1, 1]
    assert [h["time/simulated_round_s"] for h in history] == pytest.approx([3.0, 1.5, 1.5])
    # the ledger: a download per start (3 at first, then the 2 restarts after each step), an upload per arrival
    assert [h["comm/round_down_bytes"] for h in history] == [3 * 24, 2 * 24, 2 * 24]
    assert [h["comm/round_up_bytes"] for h in history] == [2 * 24] * 3
    assert runner.ledger.down.tolist() == [3 * 24, 2 * 24, 2 * 24] and runner.ledger.up.tolist() == [3 * 24, 2 * 24, 24]


def test_a_weighted_strategy_weighs_each_update_by_its_samples_and_its_staleness():
    runner, dm = crafted(FedBuff(3, 2), [2, 6, 9], strategy=FedAvg(weighted=True), num_samples=lambda c: c + 1)
    x0, x2, _ = run_steps(runner, dm, 2)
    expected = x0 + (1 * u(0, 0) + 2 * u(1, 0)) / 3 + (1 * u(0, 1) + 3 * 2**-0.5 * u(2, 0)) / 4
    torch.testing.assert_close(x2, expected, rtol=0, atol=1e-7)


def test_arrivals_at_the_same_instant_come_in_client_order():
    # Three clients of equal speed finish together; one update a step: the first step has client 0 (tau 0), the
    # second client 1 (tau 1), the third client 2 (tau 2).
    runner, dm = crafted(FedBuff(3, 1), [2, 2, 2])
    x0, x3, history = run_steps(runner, dm, 3)
    torch.testing.assert_close(x3, x0 + u(0, 0) + u(1, 0) / math.sqrt(2) + u(2, 0) / math.sqrt(3), rtol=0, atol=1e-7)
    assert [h["fed/staleness_max"] for h in history] == [0, 1, 2]


def test_a_server_optimiser_steps_from_the_buffers_update():
    runner, dm = crafted(FedBuff(3, 2), [2, 6, 9], strategy=FedAvgM(server_lr=1.0, momentum=0.5))
    x0, x2, _ = run_steps(runner, dm, 2)
    d0, d1 = (u(0, 0) + u(1, 0)) / 2, (u(0, 1) + 2**-0.5 * u(2, 0)) / 2
    torch.testing.assert_close(x2, x0 + d0 + (0.5 * d0 + d1), rtol=0, atol=1e-7)  # momentum 0.5: v = 0.5 v + Delta


# ============================================================================ runs
ARGS = {"buffered": FedBuff(4, 2), "clock": Clock(step_s=0.5), "local_steps": 2, "logger": False}
WALL = ("time/round_s", "time/elapsed_s", "time/clients_and_server_s")


def simulated(history):
    return [{k: v for k, v in h.items() if k not in WALL} for h in history]


@pytest.mark.parametrize(
    "codec", [FP32, lambda: Quantize(bits=8), lambda: TopK(density=0.25)], ids=["fp32", "int8", "topk"]
)
def test_a_run_is_deterministic_and_resumes_bit_for_bit(tmp_path, codec):
    dm = make_dm(num_clients=8)

    def trainer(folder, rounds):  # a codec of its own: error feedback keeps each client's residual
        return make_trainer(tmp_path / folder, rounds=rounds, **{**ARGS, "codec": codec()})

    full = quiet_fit(trainer("a", 4), make_model(), dm)
    again = quiet_fit(trainer("c", 4), make_model(), dm)
    first = quiet_fit(trainer("b", 2), make_model(), dm)
    resumed = trainer("b", 4)
    quiet_fit(resumed, make_model(), dm, ckpt_path=str(first.log_dir / "checkpoints" / "last.ckpt"))
    for other in (again, resumed):
        assert all(torch.equal(full.global_state[n], other.global_state[n]) for n in full.global_state)
        assert simulated(other.history) == simulated(full.history)
        assert torch.equal(other.ledger.up, full.ledger.up) and torch.equal(other.ledger.down, full.ledger.down)
    steps = full.history[1:]
    assert max(h["fed/staleness_max"] for h in steps) > 0 and all(h["fed/aggregated_clients"] == 2 for h in steps)
    # fed/clients: those drawn into a free slot (4 at first and one after the step's first arrival, then the two
    # freed slots of each step); three in flight as a step ends (the last arrival's slot fills at the next)
    assert [h["fed/clients"] for h in steps] == [5, 2, 2, 2] and all(h["fed/in_flight"] == 3 for h in steps)
    assert [h["time/simulated_elapsed_s"] for h in steps] == pytest.approx(
        torch.tensor([h["time/simulated_round_s"] for h in steps]).cumsum(0).tolist()
    )


def small_cnn():
    torch.manual_seed(0)
    return SmallCNN(image_size=8, channels=[8, 16], norm_groups=4)


@pytest.mark.parametrize(
    "model",
    [
        lambda: Classifier(small_cnn(), 10, recipe=Recipe(lr=0.05, warmup_epochs=0, schedule="constant")),
        lambda: LoRAClassifier(small_cnn(), 10, base="scratch", rank=2),
    ],
    ids=["full-weights", "lora"],
)
def test_full_weights_and_lora_train_under_fedbuff(tmp_path, model):
    trainer = quiet_fit(make_trainer(tmp_path, rounds=2, **ARGS), net := model(), make_dm(num_clients=6))
    start = model().federated_state()
    assert any(not torch.equal(start[n], t) for n, t in trainer.global_state.items())
    assert all(bool(torch.isfinite(t).all()) for t in trainer.global_state.values())
    size = sum(t.numel() * 4 for t in net.federated_state().values())
    assert int(trainer.ledger.up.sum()) == 2 * 2 * size  # two steps of two float32 uploads


def test_resuming_across_kinds_of_run_is_one_line(tmp_path):
    dm = make_dm(num_clients=6)
    buffered = quiet_fit(make_trainer(tmp_path / "b", rounds=1, **ARGS), make_model(), dm)
    sync = quiet_fit(make_trainer(tmp_path / "s", rounds=1, clock=Clock(), logger=False), make_model(), dm)
    cases = [
        (buffered, {"clock": Clock()}, "it was written with trainer.buffered"),
        (sync, ARGS, "it was written with synchronous rounds"),
        (buffered, {**ARGS, "buffered": FedBuff(3, 2)}, "set the same, or start afresh"),
    ]
    for done, args, message in cases:
        again = make_trainer(done.log_dir.parent.parent, rounds=2, **args)
        with pytest.raises(CheckpointError, match=message) as err:
            quiet_fit(again, make_model(), dm, ckpt_path=str(done.log_dir / "checkpoints" / "last.ckpt"))
        assert "\n" not in str(err.value)


# ============================================================================ refusals
@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"transport": CraftedClients(None)}, "trainer.transport CraftedClients runs synchronous rounds"),
        (
            {"secure_aggregation": SecureAggregation(), "max_update_norm_ratio": None},
            "trainer.secure_aggregation sums one cohort's uploads",
        ),
        ({"privacy": CentralDP(clip_norm=1.0, noise_multiplier=1.0)}, "trainer.privacy's accountant"),
        ({"dp_sgd": DPSGD(noise_multiplier=1.0, max_grad_norm=1.0)}, "trainer.dp_sgd's per-client accounting"),
        ({"attack": SignFlip(clients=[0])}, "trainer.attack forges uploads"),
        ({"strategy": Median()}, "trainer.strategy Median aggregates one cohort's uploads"),
        ({"compressed_downloads": True, "codec": TopK()}, "trainer.compressed_downloads counts each client's catch-up"),
        ({"client_batching": "vmap"}, "trainer.client_batching vmap trains a cohort at once"),
        ({"sampling": "poisson"}, "trainer.sampling and trainer.dropout pick"),
        ({"clock": Clock(deadline_s=3.0)}, "trainer.clock.deadline_s and over_selection close synchronous rounds"),
    ],
    ids=[
        "flower",
        "secure",
        "privacy",
        "dp-sgd",
        "attack",
        "robust",
        "downlink",
        "vmap",
        "poisson",
        "deadline",
    ],
)
def test_combinations_fedbuff_cannot_serve_are_refused_in_one_line(tmp_path, kwargs, message):
    with pytest.raises(ConfigError, match=message) as err:
        make_trainer(tmp_path, **{"buffered": FedBuff(2, 2), "clock": Clock(), **kwargs})
    assert "\n" not in str(err.value) and str(err.value).count("; trainer.") == 0


def test_fedbuff_in_process_without_a_clock_stops_before_any_work_in_one_line(tmp_path):
    """The clock is asked for when the fit starts (a Flower ServerApp sets the transport, which needs none, after the
    config has built the trainer); the command line exits with code 2."""
    trainer = make_trainer(tmp_path, buffered=FedBuff(2, 2))  # (made: the transport may still come)
    with pytest.raises(ConfigError, match="trainer.buffered needs trainer.clock in process") as err:
        trainer.fit(make_model(), datamodule=make_dm())
    assert "\n" not in str(err.value) and trainer.fabric is None  # nothing launched
    args = ["fit", "--config", str(CONFIGS / "quickstart.yaml"), "--trainer.buffered", "FedBuff"]
    buffered = ["--trainer.buffered.concurrency", "2", "--trainer.buffered.buffer_size", "2"]
    assert run_cli(*args, *buffered, "--trainer.default_root_dir", str(tmp_path / "runs")) == 2


def test_impossible_settings_name_the_key(tmp_path):
    with pytest.raises(ConfigError, match="trainer.buffered.buffer_size must be a whole number >= 1, got 0"):
        FedBuff(2, 0)
    with pytest.raises(ConfigError, match="trainer.buffered.staleness must be one of sqrt, constant, polynomial"):
        FedBuff(2, 2, "linear")
    with pytest.raises(ConfigError, match="trainer.buffered.concurrency is 9 but the data has 4 clients"):
        quiet_fit(make_trainer(tmp_path, **{**ARGS, "buffered": FedBuff(9, 2)}), make_model(), make_dm())
    assert [FedBuff(1, 1, "polynomial", exponent=2.0).weight(t) for t in (0, 1, 3)] == [1.0, 0.25, 1 / 16]
