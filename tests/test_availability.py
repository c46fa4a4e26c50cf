"""Clients that come and go (``trainer.clock.availability``): the patterns against their closed forms, a trace file
honoured to the second, rounds that sample only available clients and lose those that go offline, FedBuff drawing
among the available, the work thrown away, bitwise resume, and the inputs refused in one line."""

import itertools
import math
import warnings

import lightning as L
import numpy as np
import pytest
import torch

from conftest import CONFIGS, make_dm, make_model, make_trainer, run_cli
from helpers import CraftedClients, Durations, quiet_fit, round_runner
from lightning_fl.compress import FP32
from lightning_fl.errors import CheckpointError, ConfigError
from lightning_fl.federated import (
    AvailabilityTrace,
    ByteLedger,
    Clock,
    Diurnal,
    FedAvg,
    FedBuff,
    LocalTraining,
    OnOff,
)
from lightning_fl.federated.arrivals import Buffered
from lightning_fl.federated.arrivals.work import work_summary
from lightning_fl.federated.server.collect import Uploads
from lightning_fl.federated.server.round import RoundRunner
from lightning_fl.federated.server.state import flatten
from lightning_fl.privacy import CentralDP

D = 6  # the crafted state: a (2, 2) and b (2,), float32: 24 bytes down and up
#: A client's time is its local steps times ``step_s`` (no spread, no latency; the bytes take picoseconds).
EXACT = {"device_sigma": 0.0, "link_sigma": 0.0, "latency_s": 0.0, "down_mbps": 1e6, "up_mbps": 1e6}


def trace(tmp_path, rows, name="trace.csv"):
    path = tmp_path / name
    path.write_text("client,start_s,end_s\n" + "".join(f"{r}\n" for r in rows))
    return path


def u(c, r):
    """Client ``c``'s crafted update from server version ``r`` (exact in binary)."""
    out = torch.zeros(D)
    out[c % D] = 0.125 * (r + 1)
    return out


# ============================================================================ the patterns
def test_on_off_clients_are_available_the_chains_stationary_fraction_of_the_time():
    pattern = OnOff(mean_on_s=60.0, mean_off_s=120.0)  # on mu_on / (mu_on + mu_off) = 1/3 of the time
    n = 3000
    for t in (0.0, 1000.0):  # at any time, over the clients: within 4 standard errors of 1/3
        share = np.mean([pattern.available(0, c, t) for c in range(n)])
        assert share == pytest.approx(1 / 3, abs=4 * math.sqrt(2 / 9 / n))
    spells = pattern.intervals(0, 7, 2e6)  # one client over time: about 11,000 spells
    on = np.array([e - s for s, e in spells])
    assert np.mean(on) == pytest.approx(60.0, rel=0.05)
    assert sum(min(e, 2e6) - s for s, e in spells) / 2e6 == pytest.approx(1 / 3, rel=0.05)
    assert all(b[0] > a[1] for a, b in itertools.pairwise(spells))  # an off spell between two on spells
    assert pattern.intervals(0, 7, 1e3) == spells[: len(pattern.intervals(0, 7, 1e3))]  # a longer horizon extends
    assert pattern.intervals(1, 7, 1e3) != pattern.intervals(0, 7, 1e3)  # the seed changes them


def test_diurnal_clients_are_available_in_one_window_a_period_from_their_phase():
    pattern = Diurnal(period_s=100.0, on_fraction=0.25)
    for c in range(20):
        phase = pattern.phase(0, c)
        windows = pattern.intervals(0, c, 300.0)
        assert [s for s, _ in windows] == pytest.approx([(k - 1 + phase) * 100 for k in range(4)])
        assert [e - s for s, e in windows] == pytest.approx([25.0] * 4)
        start = windows[2][0]
        assert pattern.available(0, c, start) and pattern.until(0, c, start + 10) == pytest.approx(start + 25)
        assert not pattern.available(0, c, windows[2][1])  # (the end is not in the window)
        assert pattern.next_on(0, c, start + 30) == pytest.approx(start + 100)
    share = np.mean([pattern.available(0, c, 37.0) for c in range(4000)])
    assert share == pytest.approx(0.25, abs=4 * math.sqrt(0.25 * 0.75 / 4000))


def test_a_trace_file_is_honoured_to_the_second(tmp_path):
    path = trace(tmp_path, ["0,0,10", "0,5,20", "2,30,40", "0,25,26"])  # 0's first two overlap: [0, 20)
    pattern = AvailabilityTrace(path)
    assert pattern.intervals(0, 0, 1e9) == [(0.0, 20.0), (25.0, 26.0)]
    assert pattern.available(0, 0, 0.0) and pattern.available(0, 0, 19.999) and not pattern.available(0, 0, 20.0)
    assert pattern.until(0, 0, 3.0) == 20.0 and pattern.next_on(0, 0, 20.0) == 25.0
    assert pattern.next_on(0, 2, 0.0) == 30.0 and pattern.until(0, 2, 35.0) == 40.0
    assert not pattern.available(0, 2, 40.0) and pattern.next_on(0, 2, 40.0) == math.inf  # the trace has ended
    assert pattern.next_on(0, 1, 0.0) == math.inf  # a client no row names: never
    assert pattern.available_clients(0, [0, 1, 2], 30.0) == [2] and pattern.first_on(0, [1, 2], 0.0) == 30.0
    daily = AvailabilityTrace(path, repeat_s=50.0)  # the same intervals every 50 s
    assert daily.next_on(0, 2, 41.0) == 80.0 and daily.available(0, 0, 55.0) and not daily.available(0, 0, 71.0)
    assert daily.until(0, 0, 1e6 + 1) == 1e6 + 20  # (20,000 periods on)


# ============================================================================ in a round
def timed_runner(pattern, steps, *, failing=(), power_w=3.0, **clock):
    fabric = L.Fabric(accelerator="cpu", devices=1, loggers=[])
    clock = Clock(**{"step_s": 1.0, **EXACT, **clock}, availability=pattern, power_w=power_w)
    transport = CraftedClients(lambda c, r: u(c, r), failing=failing)
    runner = round_runner(fabric, transport, local=LocalTraining(epochs=1), num_clients=len(steps), clock=clock)
    return runner, Durations(steps)


def run_rounds(runner, dm, rounds, count, start=0):
    state, out = {"a": torch.zeros(2, 2), "b": torch.ones(2)}, []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        for r in range(start, start + rounds):
            state, metrics = runner.run(None, dm, state, r, 0, count)
            out.append(metrics)
    return out


def test_rounds_sample_the_available_clients_and_lose_those_that_go_offline(tmp_path):
    # Clients of 2, 3, 4, 1 and 3 s; 1 leaves at 2.5 s, 3 is never on, 4's training fails (refused). Round 1 at
    # t=0 samples 0, 1, 2 and 4 (5 asked, 4 available), closes at 4 s when everyone has reported or left.
    path = trace(tmp_path, ["0,0,100", "1,0,2.5", "2,0,100", "4,0,100"])
    runner, dm = timed_runner(AvailabilityTrace(path), [2, 3, 4, 1, 3], failing=[4], power_w=2.0)
    first, second = run_rounds(runner, dm, 2, count=5)
    assert first["fed/clients"] == 4 and first["fed/available_clients"] == 4
    assert first["fed/offline_clients"] == 1 and first["fed/late_clients"] == 0
    assert first["time/simulated_round_s"] == pytest.approx(4.0) and first["time/availability_wait_s"] == 0.0
    # work: 2 + 2.5 (until it left) + 4 + 3 s; thrown away: client 1's 2.5 s and refused client 4's 3 s
    assert first["work/compute_s"] == pytest.approx(11.5) and first["work/wasted_compute_s"] == pytest.approx(5.5)
    assert first["work/energy_j"] == pytest.approx(23.0) and first["work/wasted_energy_j"] == pytest.approx(11.0)
    assert first["work/wasted_bytes"] == 2 * 24  # their downloads (4's failure uploaded nothing)
    # round 2 starts at 4 s: client 1 is gone, so 0, 2 and 4 are sampled; it closes 4 s later
    assert second["fed/clients"] == 3 and second["fed/available_clients"] == 3
    assert second["time/simulated_round_s"] == pytest.approx(4.0) and second["fed/offline_clients"] == 0
    assert runner.ledger.down.tolist() == [48, 24, 48, 0, 48] and runner.ledger.up.tolist() == [48, 0, 48, 0, 0]


def test_poisson_sampling_draws_the_available_clients_at_the_runs_rate(tmp_path):
    # 8 clients, 4 of them never on; rate 4 / 8 = 0.5 each: 2 of the 4 available a round on average
    path = trace(tmp_path, [f"{c},0,1e9" for c in range(4)])
    fabric = L.Fabric(accelerator="cpu", devices=1, loggers=[])
    clock = Clock(step_s=1.0, **EXACT, availability=AvailabilityTrace(path))
    transport = CraftedClients(lambda c, r: u(c, r))
    runner = round_runner(
        fabric, transport, local=LocalTraining(epochs=1), num_clients=8, clock=clock, sampling="poisson"
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        sizes = [
            runner.run(None, Durations([1] * 8), {"a": torch.zeros(2, 2), "b": torch.ones(2)}, r, 0, 4)[1]
            for r in range(200)
        ]
    assert max(runner.ledger.down[4:].tolist()) == 0  # never sampled
    assert np.mean([m["fed/clients"] for m in sizes]) == pytest.approx(2.0, abs=4 * math.sqrt(4 * 0.25 / 200))


def test_a_deadline_wastes_what_late_clients_computed_until_it():
    runner, dm = timed_runner(None, [1, 3, 5], deadline_s=2.0)  # (no availability: every client always on)
    (metrics,) = run_rounds(runner, dm, 1, count=3)
    assert metrics["fed/late_clients"] == 2 and "fed/offline_clients" not in metrics
    assert metrics["work/compute_s"] == pytest.approx(1 + 2 + 2) and metrics["work/wasted_compute_s"] == pytest.approx(
        4
    )


def test_a_round_waits_for_the_first_client_to_come_online_and_a_run_with_none_left_stops(tmp_path):
    runner, dm = timed_runner(AvailabilityTrace(trace(tmp_path, ["0,50,51", "1,55,58"])), [2, 2])
    first, second, third = run_rounds(runner, dm, 3, count=2)
    # round 1 waits 50 s for client 0, which leaves after 1 s; round 2 starts at 51 s and waits 4 s for client 1,
    # which reports at 57 s; in round 3 client 1 leaves at 58 s, and then no client is ever on again
    assert first["time/availability_wait_s"] == 50.0 and first["time/simulated_round_s"] == pytest.approx(51.0)
    assert first["fed/clients"] == 1 and first["fed/offline_clients"] == 1
    assert second["time/availability_wait_s"] == pytest.approx(4.0) and second["fed/clients"] == 1
    assert second["time/simulated_round_s"] == pytest.approx(6.0) and second["fed/offline_clients"] == 0
    assert third["time/simulated_round_s"] == pytest.approx(1.0) and third["fed/offline_clients"] == 1
    with pytest.raises(ConfigError, match=r"no client is available at or after 58.0 simulated seconds \(round 4\)"):
        run_rounds(runner, dm, 1, count=2, start=3)


# ============================================================================ FedBuff
def test_fedbuff_draws_among_the_available_and_frees_a_lost_clients_slot_when_it_leaves(tmp_path):
    # Four clients of 1 s (2 steps of 0.5 s); two in flight, one update a step. Client 1 leaves at 0.5 s (before its
    # steps end: never trained), 2 comes online at 1.5 s, 3 never. By hand:
    # t=0 clients 0 and 1 start (v0); t=0.5 1 is lost; t=1 client 0 arrives: step 1 (0 from v0).
    # t=1 client 0 restarts (v1); t=1.5 client 2 starts (v1); t=2 client 0 arrives: step 2 (0 from v1).
    # t=2 client 0 restarts (v2); t=2.5 client 2 arrives: step 3 (2 from v1, staleness 1).
    path = trace(tmp_path, ["0,0,100", "1,0,0.5", "2,1.5,100"])
    clock = Clock(step_s=0.5, **EXACT, availability=AvailabilityTrace(path), power_w=1.0)
    local = LocalTraining(epochs=1)
    trained = []
    crafted = CraftedClients(lambda c, r: trained.append((c, r)) or u(c, r))
    collection = Uploads(crafted, FP32(), local, arrivals=Buffered(FedBuff(2, 1), clock, local))
    runner = RoundRunner(L.Fabric(accelerator="cpu", devices=1, loggers=[]), FedAvg(), collection, [], ByteLedger(4))
    state = {"a": torch.zeros(2, 2), "b": torch.ones(2)}
    x0, history = flatten(state, ["a", "b"]), []
    for r in range(3):
        state, metrics = runner.run(None, Durations([2, 2, 2, 2]), state, r, 0, 0)
        history.append(metrics)
    assert sorted(trained) == [(0, 0), (0, 1), (0, 2), (2, 1)]  # (client 1 left before its steps ended)
    expected = x0 + u(0, 0) + u(0, 1) + u(2, 1) / math.sqrt(2)
    torch.testing.assert_close(flatten(state, ["a", "b"]), expected, rtol=0, atol=1e-7)
    assert [h["fed/offline_clients"] for h in history] == [1, 0, 0]
    assert [h["fed/staleness_max"] for h in history] == [0, 0, 1]
    assert [h["time/simulated_round_s"] for h in history] == pytest.approx([1.0, 1.0, 0.5])
    assert [h["work/compute_s"] for h in history] == pytest.approx([1.5, 1.0, 1.0])
    assert [h["work/wasted_compute_s"] for h in history] == pytest.approx([0.5, 0.0, 0.0])
    assert history[0]["work/wasted_bytes"] == 24
    assert runner.ledger.down.tolist() == [72, 24, 24, 0] and runner.ledger.up.tolist() == [48, 0, 24, 0]


# ============================================================================ in a run
WALL = ("time/round_s", "time/elapsed_s", "time/clients_and_server_s")


def simulated(history):
    return [{k: v for k, v in h.items() if k not in WALL} for h in history]


@pytest.mark.parametrize("buffered", [None, FedBuff(3, 2)], ids=["rounds", "fedbuff"])
def test_a_run_with_availability_resumes_bit_for_bit_and_says_what_it_threw_away(tmp_path, buffered, capsys):
    dm = make_dm(num_clients=8)
    clock = Clock(step_s=1.0, availability=OnOff(mean_on_s=3.0, mean_off_s=3.0))
    args = {"clock": clock, "buffered": buffered, "local_steps": 2, "clients_per_round": 4, "logger": False}
    full = quiet_fit(make_trainer(tmp_path / "a", rounds=4, **args), make_model(), dm)
    said = capsys.readouterr().out
    assert "work thrown away (late, offline, unavailable or refused clients)" in said
    assert sum(h["fed/offline_clients"] for h in full.history[1:]) > 0  # (this seed loses some)
    assert all(h["work/wasted_compute_s"] <= h["work/compute_s"] for h in full.history[1:])
    first = quiet_fit(make_trainer(tmp_path / "b", rounds=2, **args), make_model(), dm)
    resumed = make_trainer(tmp_path / "b", rounds=4, **args)
    quiet_fit(resumed, make_model(), dm, ckpt_path=str(first.log_dir / "checkpoints" / "last.ckpt"))
    assert torch.equal(full.global_state["mapping.latent"], resumed.global_state["mapping.latent"])
    assert simulated(resumed.history) == simulated(full.history)
    other = make_trainer(tmp_path / "c", rounds=4, **{**args, "clock": Clock(step_s=1.0, availability=OnOff(3.0))})
    with pytest.raises(CheckpointError, match="it was written with trainer.clock.availability OnOff"):
        quiet_fit(other, make_model(), dm, ckpt_path=str(first.log_dir / "checkpoints" / "last.ckpt"))


def test_the_summary_adds_the_work_thrown_away_over_the_rounds():
    history = [
        {"round": 0},
        {"work/compute_s": 10.0, "work/wasted_compute_s": 1.0, "work/energy_j": 30.0, "work/wasted_energy_j": 3.0},
        {"work/compute_s": 30.0, "work/wasted_compute_s": 9.0, "work/energy_j": 90.0, "work/wasted_energy_j": 27.0},
    ]
    history[1]["work/wasted_bytes"], history[2]["work/wasted_bytes"] = 1000.0, 2000.0
    assert work_summary(history, 3.0) == [
        "work thrown away (late, offline, unavailable or refused clients): 10.0 of 40.0 device seconds of training "
        "(25.0%), 30.0 of 120.0 J at 3 W a device (a model), 3,000 bytes"
    ]
    assert work_summary([{"round": 0}], 3.0) == []


# ============================================================================ refused
@pytest.mark.parametrize(
    ("rows", "message"),
    [
        (["0,5,2"], "line 2 must be a client id >= 0 and 0 <= start_s < end_s (finite seconds), got '0,5,2'"),
        (["0,0,1", "x,0,1"], "line 3 must be a client id >= 0"),
        (["0,0,inf"], "line 2 must be a client id >= 0"),
        (["-1,0,1"], "line 2 must be a client id >= 0"),
        (["0,0,1,4"], "line 2 must be"),
    ],
    ids=["backwards", "not-a-number", "infinite", "negative-client", "four-columns"],
)
def test_a_malformed_trace_is_refused_naming_the_key_the_line_and_the_fix(tmp_path, rows, message):
    with pytest.raises(ConfigError, match=r"trainer\.clock\.availability\.path .*trace\.csv: ") as err:
        AvailabilityTrace(trace(tmp_path, rows))
    assert message in str(err.value) and str(err.value).endswith("fix that row")


def test_other_bad_traces_and_patterns_are_refused_in_one_line(tmp_path):
    (tmp_path / "bad.csv").write_text("id,from,to\n0,0,1\n")
    with pytest.raises(ConfigError, match="line 1 must be the header client,start_s,end_s, got 'id,from,to'"):
        AvailabilityTrace(tmp_path / "bad.csv")
    with pytest.raises(ConfigError, match="gone.csv does not exist: give a CSV file with the header"):
        AvailabilityTrace(tmp_path / "gone.csv")
    with pytest.raises(ConfigError, match="line 2 must be .* <= repeat_s 10"):
        AvailabilityTrace(trace(tmp_path, ["0,5,20"]), repeat_s=10)
    with pytest.raises(ConfigError, match=r"trainer.clock.availability.mean_off_s must be a finite number > 0, got 0"):
        OnOff(mean_off_s=0)
    with pytest.raises(ConfigError, match=r"trainer.clock.availability.on_fraction must be in \(0, 1\], got 1.5"):
        Diurnal(on_fraction=1.5)
    pattern = AvailabilityTrace(trace(tmp_path, ["9,0,10"]))
    with pytest.raises(ConfigError, match="names client 9 but the data has 4 clients .*: fix the trace or data"):
        quiet_fit(make_trainer(tmp_path, clock=Clock(availability=pattern), logger=False), make_model(), make_dm())
    private = {"clock": Clock(availability=OnOff()), "privacy": CentralDP(clip_norm=1.0, noise_multiplier=1.0)}
    with pytest.raises(ConfigError, match="trainer.clock.availability samples only the clients available .* remove"):
        make_trainer(tmp_path, **private)


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (
            ["--trainer.clock.availability.mean_on_z", "3"],
            [
                "unknown key 'trainer.clock.availability.mean_on_z'",
                "Did you mean 'trainer.clock.availability.mean_on_s'?",
            ],
        ),
        (
            ["--trainer.clock.availability", "AvailabilityTrace", "--trainer.clock.availability.path", "t.csv"],
            ["trainer.clock.availability.path t.csv: line 2 must be a client id >= 0", "fix that row"],
        ),
    ],
    ids=["misspelt-key", "malformed-trace"],
)
def test_bad_availability_input_exits_2_with_one_line(in_tmp, capsys, args, expected):
    (in_tmp / "t.csv").write_text("client,start_s,end_s\n0,10,5\n")
    clock = ["--trainer.clock", "Clock", "--trainer.clock.availability", "OnOff"]
    assert run_cli("fit", "--config", str(CONFIGS / "quickstart.yaml"), *clock, *args) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "Traceback" not in err
    line = err.splitlines()[0]  # (the next says how to see every key)
    for text in expected:
        assert text in line


# ============================================================================ the time-to-accuracy tool
def test_time_to_accuracy_counts_offline_clients_out_of_the_updates_and_tables_the_work_thrown_away():
    from conftest import tool_module

    tta = tool_module("time_to_accuracy")

    def row(r, acc, offline, compute, wasted, seed=0):
        out = {"round": r, "val/acc": acc, "fed/clients": 10.0, "fed/offline_clients": offline}
        out.update({"time/simulated_elapsed_s": 6.0 * r, "work/compute_s": compute, "work/wasted_compute_s": wasted})
        return {**out, "work/wasted_energy_j": 3.0 * wasted}

    seeds = {0: [{"round": 0, "val/acc": 0.5}, row(1, 0.6, 2, 20.0, 5.0), row(2, 0.7, 1, 20.0, 3.0)]}
    seeds[1] = [{"round": 0, "val/acc": 0.5}, row(1, 0.6, 0, 20.0, 1.0), row(2, 0.7, 0, 20.0, 1.0)]
    assert tta.curve(seeds[0]) == [(0.0, 0.0, 0.5, 0), (6.0, 8.0, 0.6, 1), (12.0, 17.0, 0.7, 2)]
    runs = {("flite", "over-selection-onoff"): seeds, ("flite", "sync"): {0: [{"round": 0, "val/acc": 0.5}]}}
    assert tta.work(runs).splitlines()[2:] == [  # means over seeds of sums over rounds: 40 s, 5 s thrown away
        "| flite | over-selection, clients on/off | 40.0 | 12.5% | 15.0 | 2 |"
    ]
    assert tta.work({("flite", "sync"): runs[("flite", "sync")]}) is None  # (runs without work/*: no table)


def test_time_to_accuracy_reads_a_sweep_csv_with_its_environment_column(tmp_path):
    from conftest import tool_module

    path = tmp_path / "r.csv"
    path.write_text(
        "sweep,label,seed,environment,method,close,round,final,val/acc\n"
        "s,a,0,torch=2.14.1 device=cpu,flite,over-selection-onoff,0,0,0.5\n"
    )
    rows = tool_module("time_to_accuracy").read(path)[("flite", "over-selection-onoff")][0]
    assert rows == [
        {"sweep": "s", "label": "a", "seed": 0.0, "environment": "torch=2.14.1 device=cpu", "method": "flite"}
        | {"close": "over-selection-onoff", "round": 0.0, "final": 0.0, "val/acc": 0.5}
    ]


def test_the_time_to_accuracy_studys_availability_case_parses_as_the_sweep_runs_it(in_tmp, capsys):
    import yaml

    spec = yaml.safe_load((CONFIGS.parent / "tools" / "sweeps" / "time_to_accuracy_fashion_mnist.yaml").read_text())
    (case,) = [r for r in spec["runs"] if r["tags"]["close"] == "over-selection-onoff"]
    config = str(CONFIGS.parent / case["config"].format(method="flite"))
    assert run_cli("fit", "--config", config, *spec["common"], *case["args"], "--print_config") == 0
    clock = yaml.safe_load(capsys.readouterr().out)["trainer"]["init_args"]["clock"]
    assert clock["init_args"]["over_selection"] == 0.3
    assert clock["init_args"]["availability"] == {
        "class_path": "lightning_fl.federated.OnOff",
        "init_args": {"mean_on_s": 10.0, "mean_off_s": 20.0},
    }
