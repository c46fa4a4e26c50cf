"""The simulated clock: each client's speeds, a round's time in closed form, deadlines and over-selection (who is
left out, what the ledger counts, what central DP divides by), and runs that resume with their time."""

import csv
import math
import warnings

import lightning as L
import numpy as np
import pytest
import torch

from conftest import make_dm, make_model, make_trainer
from helpers import CraftedClients, Population, round_runner
from lightning_fl.errors import ConfigError
from lightning_fl.federated import FedAvg, LocalTraining
from lightning_fl.federated.arrivals.clock import Clock, Links
from lightning_fl.privacy import CentralDP, Plan

D = 6  # the crafted rounds' state: a (2, 2) and b (2,), float32: 24 bytes down and up


def quiet_fit(trainer, model, dm, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model, datamodule=dm, **kwargs)
    return trainer


def crafted(update, n, clock, steps=3, privacy=None, count=None):
    fabric = L.Fabric(accelerator="cpu", devices=1, loggers=[])
    runner = round_runner(
        fabric, CraftedClients(update), local=LocalTraining(steps=steps), num_clients=n, clock=clock, privacy=privacy
    )
    if privacy is not None:
        privacy.setup(Plan(n, float(count or n), "fixed", 1, 0, FedAvg(), None))
    return runner


def run_round(runner, n, count=None, seed=0):
    state = {"a": torch.zeros(2, 2), "b": torch.ones(2)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return runner.run(None, Population(n), state, 0, seed, count or n)


# ============================================================================ the model
def test_a_round_takes_download_steps_and_upload_in_closed_form():
    clock = Clock(step_s=0.5, device_sigma=0.0, down_mbps=2.0, up_mbps=0.5, link_sigma=0.0, latency_s=0.1)
    t = clock.timing(
        0, [3, 1], steps=np.array([4, 2]), down_bytes=np.array([10**6, 10**6]), up_bytes=np.array([1000, 250_000])
    )
    # client 3: 0.1 + 8e6 / 2e6 = 4.1 s down, 4 * 0.5 = 2 s of steps, 0.1 + 8000 / 5e5 = 0.116 s up
    assert t.finish_s.tolist() == pytest.approx([4.1 + 2.0 + 0.116, 4.1 + 1.0 + 0.1 + 4.0])
    assert t.close_s == pytest.approx(9.2) and t.on_time.tolist() == [True, True]


def test_given_links_replace_the_drawn_ones():
    clock = Clock(latency_s=0.5)
    links = Links(step_s=np.array([1.0, 3.0]), down_bps=np.array([1e6, np.inf]), up_bps=np.array([2e6, 8e6]))
    t = clock.timing(0, [0, 1], np.array([2, 1]), np.array([250_000, 10**6]), np.array([500_000, 10**6]), links=links)
    # client 0: 0.5 + 2 s down, 2 s of steps, 0.5 + 2 s up; client 1: 0.5 + 0 s down, 3 s, 0.5 + 1 s up
    assert t.finish_s.tolist() == pytest.approx([7.0, 5.0])
    assert t.close_s == pytest.approx(7.0)
    assert clock.timing(0, [0, 1], np.array([2, 1]), np.zeros(2), np.zeros(2)).compute_s.tolist() != [2.0, 3.0]


def test_a_setup_runs_while_the_client_downloads_and_its_compute_starts_when_both_are_done():
    kwargs = {"step_s": 1.0, "device_sigma": 0.0, "down_mbps": 1.0, "up_mbps": 1.0, "link_sigma": 0.0}
    clock = Clock(**kwargs, latency_s=0.5, setup_s=2.0)
    steps, down, up = np.array([1, 1]), np.array([125_000, 500_000]), np.zeros(2)
    t = clock.timing(0, [0, 1], steps, down, up)
    # client 0: 0.5 + max(1 s download, 2 s setup) + 1 s + 0.5; client 1: 0.5 + max(4 s download, 2 s) + 1 s + 0.5
    assert t.download_s.tolist() == pytest.approx([1.5, 4.5]) and t.ready_s.tolist() == pytest.approx([2.5, 4.5])
    assert t.finish_s.tolist() == pytest.approx([4.0, 6.0]) and t.close_s == pytest.approx(6.0)
    plain = Clock(**kwargs, latency_s=0.5).timing(0, [0, 1], steps, down, up)  # no setup: the download alone
    assert plain.finish_s.tolist() == pytest.approx([3.0, 6.0])
    links = Links(np.ones(2), np.full(2, 1e6), np.full(2, 1e6), setup_s=np.array([0.0, 6.0]))  # per client
    assert clock.timing(0, [0, 1], steps, down, up, links=links).ready_s.tolist() == pytest.approx([1.5, 6.5])
    late = Clock(**kwargs, latency_s=0.5, setup_s=2.0, deadline_s=3.0).timing(0, [0, 1], steps, down, up)
    assert late.on_time.tolist() == [False, False] and late.spent_s.tolist() == pytest.approx([0.5, 0.0])
    with pytest.raises(ConfigError, match="setup_s"):
        Clock(setup_s=-1.0)


def test_each_client_keeps_its_speeds_whoever_it_is_sampled_with_and_the_seed_changes_them():
    clock = Clock()
    alone = clock.links(7, [5])
    together = clock.links(7, [2, 5, 9])
    assert together.step_s[1] == alone.step_s[0] and together.up_bps[1] == alone.up_bps[0]
    assert clock.links(8, [5]).step_s[0] != alone.step_s[0]
    many = clock.links(0, list(range(4000)))  # log-normal around the medians, with the spreads asked for
    assert np.median(many.up_bps) == pytest.approx(11e6, rel=0.08)
    assert np.std(np.log(many.step_s)) == pytest.approx(0.6, rel=0.05)
    assert np.std(np.log(many.down_bps)) == pytest.approx(1.0, rel=0.05)


def test_a_deadline_closes_the_round_and_over_selection_closes_it_at_the_target_th_report():
    clock = Clock(step_s=1.0, device_sigma=0.0, link_sigma=0.0, latency_s=0.0, deadline_s=3.5)
    steps = np.array([1, 5, 3, 2, 4])  # finishes after (about) 1, 5, 3, 2, 4 s: the bytes are a few microseconds
    t = clock.timing(0, [0, 1, 2, 3, 4], steps, np.zeros(5), np.zeros(5))
    assert t.close_s == 3.5 and t.on_time.tolist() == [True, False, True, True, False]
    over = Clock(step_s=1.0, device_sigma=0.0, link_sigma=0.0, latency_s=0.0, over_selection=0.5)
    t = over.timing(0, [0, 1, 2, 3, 4], steps, np.zeros(5), np.zeros(5), target=2)
    assert t.close_s == 2.0 and t.on_time.tolist() == [True, False, False, True, False]
    tied = over.timing(0, [0, 1, 2, 3], np.array([2, 1, 2, 2]), np.zeros(4), np.zeros(4), target=2)
    assert tied.on_time.tolist() == [True, True, False, False]  # a tie at the closing report: client order
    assert over.sampled_count(4, 100) == 6 and over.sampled_count(4, 5) == 5 and Clock().sampled_count(4, 9) == 4


# ============================================================================ in a round
def test_late_clients_downloaded_never_upload_and_are_counted():
    clock = Clock(step_s=1.0, device_sigma=1.0, deadline_s=3.0)
    runner = crafted(lambda c, r: torch.ones(D), 8, clock)
    _, metrics = run_round(runner, 8)
    timing = clock.timing(0, list(range(8)), np.full(8, 3), np.full(8, 24), np.full(8, 24))
    late = [c for c in range(8) if not timing.on_time[c]]
    assert 0 < len(late) < 8  # the seed gives both
    assert metrics["fed/late_clients"] == len(late) and metrics["time/simulated_round_s"] == pytest.approx(
        min(3.0, timing.finish_s.max())
    )
    ledger = runner.ledger
    assert ledger.down.tolist() == [24] * 8
    assert ledger.up.tolist() == [0 if c in late else 24 for c in range(8)]


def test_under_central_dp_a_late_client_adds_zero_and_the_denominator_stays_m():
    clock = Clock(step_s=1.0, device_sigma=1.0, deadline_s=3.0)
    privacy = CentralDP(clip_norm=1.0, noise_multiplier=0.0)
    update = {c: torch.tensor([0.0, 0, 0, 0, 0.1 * (c + 1), 0]) for c in range(8)}  # norms below the bound
    runner = crafted(lambda c, r: update[c], 8, clock, privacy=privacy)
    state, metrics = run_round(runner, 8)
    on_time = clock.timing(0, list(range(8)), np.full(8, 3), np.full(8, 24), np.full(8, 24)).on_time
    expected = 1.0 + sum(0.1 * (c + 1) for c in range(8) if on_time[c]) / 8  # divided by m = 8, not the arrivals
    assert metrics["fed/late_clients"] > 0
    assert state["b"][0].item() == pytest.approx(expected, abs=1e-6)


# ============================================================================ in a run
def test_a_run_logs_its_simulated_time_and_resumes_it_bit_for_bit(tmp_path):
    dm = make_dm(num_clients=8)
    clock = Clock(step_s=0.5, device_sigma=0.8, deadline_s=2.0)
    args = {"strategy": FedAvg(min_clients=1), "clock": clock, "local_steps": 3, "name": "c", "logger": False}
    full = quiet_fit(make_trainer(tmp_path / "a", rounds=4, **args), make_model(), dm)
    rounds = full.history[1:]
    assert all(0 < h["time/simulated_round_s"] <= 2.0 for h in rounds)
    assert [h["time/simulated_elapsed_s"] for h in rounds] == pytest.approx(
        np.cumsum([h["time/simulated_round_s"] for h in rounds]).tolist()
    )
    late = sum(h["fed/late_clients"] for h in rounds)
    assert late > 0 and int(full.ledger.up.sum()) == (32 - late) * 24 * 4  # 24 latent floats per upload
    first = quiet_fit(make_trainer(tmp_path / "b", rounds=2, **args), make_model(), dm)
    resumed = make_trainer(tmp_path / "b", rounds=4, **args)
    quiet_fit(resumed, make_model(), dm, ckpt_path=str(first.log_dir / "checkpoints" / "last.ckpt"))
    assert torch.equal(full.global_state["mapping.latent"], resumed.global_state["mapping.latent"])
    assert [h["time/simulated_elapsed_s"] for h in resumed.history[1:]] == [
        h["time/simulated_elapsed_s"] for h in rounds
    ]


def test_over_selection_samples_more_and_aggregates_the_target(tmp_path):
    clock = Clock(step_s=0.2, over_selection=0.5)
    args = {"strategy": FedAvg(), "clock": clock, "clients_per_round": 4, "logger": False}
    trainer = quiet_fit(make_trainer(tmp_path, rounds=2, **args), make_model(), make_dm(num_clients=8))
    for h in trainer.history[1:]:
        assert h["fed/clients"] == 6 and h["fed/late_clients"] == 2
    assert int((trainer.ledger.up > 0).sum()) <= 8 and int(trainer.ledger.up.sum()) == 2 * 4 * 24 * 4


def test_local_epochs_time_each_client_by_its_batches(tmp_path):
    clock = Clock(step_s=1.0, device_sigma=0.0, down_mbps=1e6, up_mbps=1e6, link_sigma=0.0, latency_s=0.0)
    trainer = quiet_fit(
        make_trainer(tmp_path, rounds=1, clock=clock, local_epochs=2, logger=False),
        make_model(),
        make_dm(num_clients=4),
    )
    # 60 images each, batches of 16: 4 batches an epoch, 2 epochs, 1 s a step (the bytes take nanoseconds)
    assert trainer.history[-1]["time/simulated_round_s"] == pytest.approx(8.0, abs=1e-3)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"clock": Clock(over_selection=0.3), "privacy": CentralDP(clip_norm=1.0, noise_multiplier=1.0)},
            "trainer.clock.over_selection 0.3 samples more clients than trainer.privacy's accountant",
        ),
        (
            {"clock": Clock(), "transport": CraftedClients(None)},
            "trainer.clock simulates the time of rounds run in process",
        ),
    ],
    ids=["over-selection-under-dp", "flower"],
)
def test_combinations_the_clock_cannot_serve_are_refused(tmp_path, kwargs, message):
    with pytest.raises(ConfigError, match=message):
        make_trainer(tmp_path, **kwargs)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"step_s": 0}, "trainer.clock.step_s must be a finite number > 0, got 0"),
        ({"link_sigma": -1}, "trainer.clock.link_sigma must be a finite number >= 0, got -1"),
        ({"deadline_s": math.inf}, "trainer.clock.deadline_s must be a number of seconds > 0 or null, got inf"),
    ],
)
def test_impossible_clock_settings_name_the_key(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        Clock(**kwargs)


# ============================================================================ the time-to-accuracy tool
def test_time_to_accuracy_counts_simulated_time_and_updates_to_the_first_round_at_the_target(tmp_path):
    from conftest import tool_module

    tta = tool_module("time_to_accuracy")
    columns = [
        "sweep",
        "label",
        "seed",
        "method",
        "close",
        "round",
        "final",
        "val/acc",
        "fed/clients",
        "fed/late_clients",
        "fed/unavailable_clients",
        "fed/dropped_clients",
        "fed/staleness_max",
        "time/simulated_elapsed_s",
        "comm/cum_client_bytes",
        "time/simulated_round_s",
        "time/client_compute_s",
    ]
    rows = [  # over-selection: 13 of 13 sampled, 3 late a round; FedBuff: steps of 10, staleness logged
        ["s", "a", 0, "flite", "over-selection", 0, 0, 0.80, "", "", "", "", "", "", "", "", ""],
        ["s", "a", 0, "flite", "over-selection", 1, 0, 0.84, 13, 3, 0, 0, "", 60.0, 100, 60.0, 0.2],
        ["s", "a", 0, "flite", "over-selection", 2, 1, 0.90, 13, 3, 1, 0, "", 150.0, 200, 90.0, 0.4],
        ["s", "b", 0, "flite", "fedbuff", 0, 0, 0.80, "", "", "", "", "", "", "", "", ""],
        ["s", "b", 0, "flite", "fedbuff", 1, 0, "", 10, "", "", "", 1, 6.0, 50, 6.0, ""],
        ["s", "b", 0, "flite", "fedbuff", 2, 1, 0.88, 9, "", "", 1, 2, 12.0, 90, 6.0, ""],
    ]
    path = tmp_path / "r.csv"
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(columns)
        writer.writerows(rows)
    runs = tta.read(path)
    over = tta.curve(runs[("flite", "over-selection")][0])
    assert over == [(0.0, 0.0, 0.80, 0), (60.0, 10.0, 0.84, 1), (150.0, 19.0, 0.90, 2)]
    buff = tta.curve(runs[("flite", "fedbuff")][0])
    assert buff == [(0.0, 0.0, 0.80, 0), (12.0, 19.0, 0.88, 2)]  # (the unevaluated step still counts its updates)
    assert tta.reach(over, 0.85) == (150.0, 19.0, 2) and tta.reach(buff, 0.89) is None
    assert tta.reach(over, 0.84) == (60.0, 10.0, 1)
    text = tta.table(runs, [0.84, 0.85])
    assert "| flite | over-selection | 1 | 0.9000 | 2.50 | 1.00 | 1.0 | 10 | 2.50 | 2.0 | 19 | 200 |" in text
    assert "| flite | FedBuff | 1 | 0.8800 | 0.20 | 0.20 | 2.0 | 19 | 0.20 | 2.0 | 19 | 90 |" in text
    # a gain over each run's own base (0.80 here): base + 0.04 is the absolute 0.84
    assert tta.table(runs, [0.04], gain=True).splitlines()[2:] == tta.table(runs, [0.84]).splitlines()[2:]
    assert "minutes to base + 0.0400" in tta.table(runs, [0.04], gain=True)
    where = tta.parts(runs)  # medians over rounds 1 and up; what was not logged is "-"
    assert "| flite | over-selection | 75.000 | - | 0.300 | - |" in where
    assert "| flite | FedBuff | 6.000 | - | - | - |" in where
