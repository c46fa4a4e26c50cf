"""The federated core in the loop: strategies, availability, attacks, the client runner and the module protocol."""

import warnings

import lightning as L
import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from conftest import CONFIGS, make_dm, make_model, make_trainer, run_cli
from lightning_fl.compress import FP32, Quantize
from lightning_fl.errors import CheckpointError, ConfigError
from lightning_fl.federated import (
    ALIE,
    ClientJob,
    FedAdagrad,
    FedAdam,
    FedAvg,
    FedAvgM,
    FedYogi,
    GaussianNoise,
    Krum,
    LocalTraining,
    Median,
    NaNUpload,
    Scaling,
    SignFlip,
    TrimmedMean,
    run_client,
)
from lightning_fl.federated.trainer.callbacks import Callback
from lightning_fl.methods import LatentClassifier
from lightning_fl.models import SmallCNN

ALL_STRATEGIES = {
    "FedAvg": lambda: FedAvg(weighted=True),
    "FedAvgM": lambda: FedAvgM(server_lr=0.8, momentum=0.5),
    "FedAdagrad": lambda: FedAdagrad(server_lr=0.05),
    "FedAdam": lambda: FedAdam(server_lr=0.05),
    "FedYogi": lambda: FedYogi(server_lr=0.05),
    "Median": Median,
    "TrimmedMean": lambda: TrimmedMean(beta=0.25),
    "Krum": lambda: Krum(num_malicious=1),
}


def latent(trainer) -> torch.Tensor:
    return trainer.global_state["mapping.latent"].detach().cpu()


def quiet_fit(trainer, model, dm, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        trainer.fit(model, datamodule=dm, **kwargs)
    return trainer


@pytest.mark.parametrize("name", sorted(ALL_STRATEGIES))
def test_resumed_run_equals_uninterrupted_run_with_strategy_state(tmp_path, name):
    make = ALL_STRATEGIES[name]
    full = quiet_fit(make_trainer(tmp_path / "a", rounds=3, strategy=make(), logger=False), make_model(), make_dm())
    first = quiet_fit(make_trainer(tmp_path / "b", rounds=2, strategy=make(), name="s"), make_model(), make_dm())
    ckpt = first.log_dir / "checkpoints" / "last.ckpt"
    saved = torch.load(ckpt, weights_only=True)
    assert saved["strategy_class"] == type(make()).__name__
    if name in ("FedAvgM", "FedAdagrad", "FedAdam", "FedYogi"):  # the server optimiser's state is checkpointed
        assert saved["strategy"] and all(torch.isfinite(t).all() for t in saved["strategy"].values())
    resumed = make_trainer(tmp_path / "b", rounds=3, strategy=make(), name="s")
    quiet_fit(resumed, make_model(), make_dm(), ckpt_path=str(ckpt))
    assert torch.equal(latent(full), latent(resumed))
    assert not torch.equal(latent(full), torch.zeros_like(latent(full)))  # it moved


def test_resume_refuses_another_strategy(tmp_path):
    first = quiet_fit(make_trainer(tmp_path, rounds=1, strategy=FedAdam()), make_model(), make_dm())
    ckpt = str(first.log_dir / "checkpoints" / "last.ckpt")
    with pytest.raises(Exception, match="strategy FedAdam in the checkpoint, Median now"):
        make_trainer(tmp_path, rounds=2, strategy=Median()).fit(make_model(), datamodule=make_dm(), ckpt_path=ckpt)


def test_a_checkpoint_of_another_layout_version_is_refused_with_one_line(tmp_path):
    first = quiet_fit(make_trainer(tmp_path, rounds=1, name="v"), make_model(), make_dm())
    path = first.log_dir / "checkpoints" / "last.ckpt"
    old = torch.load(path, weights_only=True)
    for key in ("strategy", "strategy_class", "content_sha256"):  # an unreleased early layout had none of them
        old.pop(key)
    old["version"] = 1
    torch.save(old, path)
    with pytest.raises(CheckpointError, match="has layout version 1, this lightning_fl reads 3"):
        make_trainer(tmp_path, rounds=2, name="v").fit(make_model(), datamodule=make_dm(), ckpt_path=str(path))


class Recording:
    """Wraps a strategy to keep what it receives: every upload matrix and its clients (robust strategies), or the
    round's mean upload (linear strategies, which the round streams)."""

    def __init__(self, strategy):
        self.seen = []
        if strategy.streams:
            original_step = strategy.step

            def spy_step(round, current, mean):
                self.seen.append((mean.clone().unsqueeze(0), None))
                return original_step(round, current, mean)

            strategy.step = spy_step
            return
        original = strategy.aggregate

        def spy(round, current, uploads, num_samples, clients):
            self.seen.append((uploads.clone(), list(clients)))
            return original(round, current, uploads, num_samples, clients)

        strategy.aggregate = spy


class NaNFromClient1(FP32):
    def decode(self, payload, reference, client):
        out = super().decode(payload, reference, client)
        return {k: v.clone().fill_(float("nan")) for k, v in out.items()} if client == 1 else out


@pytest.mark.parametrize("name", sorted(ALL_STRATEGIES))
def test_a_nan_upload_never_reaches_the_strategy(tmp_path, name):
    strategy = ALL_STRATEGIES[name]()
    spy = Recording(strategy)
    trainer = make_trainer(tmp_path, rounds=1, strategy=strategy, codec=NaNFromClient1(), logger=False)
    with pytest.warns(UserWarning, match="client 1: upload rejected: .*non-finite"):
        trainer.fit(make_model(), datamodule=make_dm(num_clients=5))  # Krum(f=1) needs 4 accepted uploads
    ((uploads, clients),) = spy.seen
    assert clients in ([0, 2, 3, 4], None) and torch.isfinite(uploads).all()  # None: a linear strategy's mean
    assert torch.isfinite(latent(trainer)).all() and trainer.history[-1]["fed/dropped_clients"] == 1
    assert 1 in trainer.round_runner.dropped


def test_a_nan_attack_is_dropped_by_the_gate_before_the_strategy(tmp_path):
    strategy = Median()
    spy = Recording(strategy)
    trainer = make_trainer(tmp_path, rounds=1, strategy=strategy, attack=NaNUpload(clients=[0, 3]), logger=False)
    with pytest.warns(UserWarning, match="client 3: upload rejected: non-finite"):
        trainer.fit(make_model(), datamodule=make_dm())
    ((uploads, clients),) = spy.seen
    assert clients == [1, 2] and torch.isfinite(uploads).all()
    last = trainer.history[-1]
    assert last["fed/attacked_clients"] == 2 and last["fed/dropped_clients"] == 2


def test_dropout_is_seeded_counted_and_resumable(tmp_path):
    dm = make_dm(num_clients=8)
    args = {"dropout": 0.4, "strategy": FedAvg(min_clients=1)}
    full = quiet_fit(make_trainer(tmp_path / "a", rounds=4, name="d", **args), make_model(), dm)
    away = [h["fed/unavailable_clients"] for h in full.history[1:]]
    assert sum(away) > 0 and all(h["fed/clients"] == 8 for h in full.history[1:])
    # an unavailable client downloaded every round but never uploaded in the rounds it was away
    ups, downs = full.ledger.up, full.ledger.down
    assert torch.all(downs == 4 * 24 * 4)  # 24 latent floats broadcast to every sampled client, 4 rounds
    assert torch.all(ups <= downs) and int(ups.sum()) == (32 - sum(away)) * 24 * 4
    first = quiet_fit(make_trainer(tmp_path / "b", rounds=2, name="d", **args), make_model(), dm)
    resumed = make_trainer(tmp_path / "b", rounds=4, name="d", **args)
    quiet_fit(resumed, make_model(), dm, ckpt_path=str(first.log_dir / "checkpoints" / "last.ckpt"))
    assert torch.equal(latent(full), latent(resumed))
    assert torch.equal(full.ledger.up, resumed.ledger.up)
    assert [h.get("fed/unavailable_clients") for h in resumed.history[1:]] == away


def test_a_round_below_min_clients_keeps_the_global_state(tmp_path):
    dm = make_dm(num_clients=8)
    trainer = make_trainer(tmp_path, rounds=6, dropout=0.4, strategy=FedAvg(min_clients=5), logger=False)
    with pytest.warns(UserWarning, match=r"fewer than trainer.strategy.min_clients=5; the global state is unchanged"):
        trainer.fit(make_model(), datamodule=dm)
    skipped = [h for h in trainer.history[1:] if h["fed/round_skipped"] == 1]
    counted = [h for h in trainer.history[1:] if h["fed/round_skipped"] == 0]
    assert skipped and counted
    assert all(8 - h["fed/unavailable_clients"] < 5 for h in skipped)
    assert all(8 - h["fed/unavailable_clients"] >= 5 for h in counted)


def test_identity_error_is_logged_for_linear_strategies_only(tmp_path):
    linear = quiet_fit(make_trainer(tmp_path, rounds=1, strategy=FedAvgM(), logger=False), make_model(), make_dm())
    robust = quiet_fit(make_trainer(tmp_path, rounds=1, strategy=Median(), logger=False), make_model(), make_dm())
    assert 0 <= linear.history[-1]["fed/identity_error"] <= 1e-6
    assert "fed/identity_error" not in robust.history[-1]


class CountingLatent(LatentClassifier):
    """The test's latent classifier: keeps the states each identity check is given."""

    def averaging_identity_error(self, states):
        error = super().averaging_identity_error(states)
        self.checked.append(([s["mapping.latent"].detach().clone() for s in states], error))
        return error


def test_the_identity_error_is_checked_over_every_aggregated_upload_of_the_round(tmp_path):
    """FedAvg, 3 of 4 clients a round, 2 rounds: each round's check is given the 3 distinct uploads the round
    averaged (their mean is the new global state), and the round logs what the check returns for all 3."""
    torch.manual_seed(0)
    model = CountingLatent(
        SmallCNN(image_size=8, channels=[8, 16], norm_groups=4),
        10,
        base="scratch",
        latent_dim=8,
        rank=4,
        layers="conv+linear",
    )
    model.checked = []
    trainer = quiet_fit(
        make_trainer(tmp_path, rounds=2, strategy=FedAvg(), clients_per_round=3, logger=False), model, make_dm()
    )
    rounds = trainer.history[1:]
    assert [h["fed/clients"] - h["fed/dropped_clients"] - h["fed/lost_clients"] for h in rounds] == [3, 3]
    assert [len(states) for states, _ in model.checked] == [3, 3]
    assert [h["fed/identity_error"] for h in rounds] == [error for _, error in model.checked]
    last = model.checked[-1][0]
    assert len({tuple(z.tolist()) for z in last}) == 3
    mean = torch.stack(last).double().mean(0).float()
    torch.testing.assert_close(latent(trainer), mean, rtol=1e-6, atol=1e-7)


def test_attacks_forge_what_they_say():
    current = torch.tensor([1.0, 1.0])
    ups = torch.tensor([[2.0, 0.0], [3.0, 1.0], [1.0, 2.0]])
    out, rows = SignFlip([1], scale=2.0).apply(0, current, ups, [5, 1, 7], seed=0)
    assert rows == [1] and out[1].tolist() == [-3.0, 1.0] and torch.equal(out[[0, 2]], ups[[0, 2]])
    out, _ = Scaling([5, 7], factor=10.0).apply(0, current, ups, [5, 1, 7], seed=0)
    assert out[0].tolist() == [11.0, -9.0] and out[2].tolist() == [1.0, 11.0]
    a, _ = GaussianNoise([1], std=0.5).apply(3, current, ups, [5, 1, 7], seed=0)
    b, _ = GaussianNoise([1], std=0.5).apply(3, current, ups, [5, 1, 7], seed=0)
    c, _ = GaussianNoise([1], std=0.5).apply(4, current, ups, [5, 1, 7], seed=0)
    assert torch.equal(a, b) and not torch.equal(a, c) and not torch.equal(a[1], ups[1])
    # ALIE: n = 10, f = 3 -> s = floor(10/2 + 1) - 3 = 3, z = Phi^-1(0.7) = 0.5244
    assert ALIE.z_max(10, 3) == pytest.approx(0.5244005, abs=1e-6)
    out, rows = ALIE([1, 7], z=1.0).apply(0, current, ups, [5, 1, 7], seed=0)
    expected = ups.double().mean(0) - ups.double().std(0)
    assert torch.allclose(out[1].double(), expected) and torch.allclose(out[2].double(), expected)
    assert torch.isnan(NaNUpload([5]).apply(0, current, ups, [5, 1, 7], seed=0)[0][0]).all()
    with pytest.raises(ConfigError, match="distinct client ids"):
        SignFlip([1, 1])


def test_scaling_attack_breaks_fedavg_and_not_the_median(tmp_path):
    dm = make_dm(num_clients=6)
    clean = quiet_fit(make_trainer(tmp_path, rounds=2, strategy=Median(), logger=False), make_model(), dm)

    def attacked(strategy):
        trainer = make_trainer(
            tmp_path,
            rounds=2,
            strategy=strategy,
            attack=Scaling([0], factor=1000.0),
            logger=False,
            max_update_norm_ratio=None,
        )  # no norm gate: what the strategy alone does
        return latent(quiet_fit(trainer, make_model(), dm))

    drift_avg = (attacked(FedAvg()) - latent(clean)).norm()
    drift_median = (attacked(Median()) - latent(clean)).norm()
    assert drift_avg > 50 * drift_median and drift_avg > 1.0


def test_run_client_runs_without_the_loop():
    torch.manual_seed(0)
    model, dm = make_model(), make_dm()
    dm.prepare_data()
    dm.setup("fit")
    state = model.federated_state()
    first = run_client(ClientJob(model, dm, state, 1, 0, Quantize(8), LocalTraining(steps=3)), 2)
    again = run_client(ClientJob(model, dm, state, 1, 0, Quantize(8), LocalTraining(steps=3)), 2)
    other = run_client(ClientJob(model, dm, state, 2, 0, Quantize(8), LocalTraining(steps=3)), 2)
    assert first.failure is None and first.up_bytes == 24 + 8
    assert first.num_samples == dm.client_num_samples(2) and first.logged["train/loss"][1] == 3 * 16
    packed = [r.payload.tensors["mapping.latent"].parts["packed"] for r in (first, again, other)]
    assert torch.equal(packed[0], packed[1]) and not torch.equal(packed[0], packed[2])


class NotFederated(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(2, 2)


def test_a_module_without_the_protocol_is_named(tmp_path):
    with pytest.raises(ConfigError, match="NotFederated cannot be federated: it lacks federated_state, load_federa"):
        make_trainer(tmp_path, logger=False).fit(NotFederated(), datamodule=make_dm())


class LogsItsOwn(type(make_model())):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        client = getattr(self.trainer, "client_id", None)  # set by the federated client context
        self.log("train/custom", 2.0 + (client or 0), on_step=False, on_epoch=True)
        return loss


def test_self_log_in_training_step_works_under_both_trainers(tmp_path):
    torch.manual_seed(0)
    model = LogsItsOwn(make_model().backbone, 10, base="scratch", latent_dim=8, rank=4, layers="conv+linear")
    trainer = quiet_fit(make_trainer(tmp_path, rounds=1, logger=False), model, make_dm())
    # clients 0..3 have 60 samples each: the sample-weighted mean of 2 + client id
    assert trainer.history[-1]["train/custom"] == pytest.approx(3.5)
    assert model.fabric is None  # the context is detached after the round
    central = L.Trainer(
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
    )
    central.fit(model, datamodule=make_dm())
    assert central.callback_metrics["train/custom"] == pytest.approx(2.0)  # no client: client_id is absent


def test_client_metrics_are_sample_weighted_over_unequal_clients(tmp_path):
    """Clients of unequal sizes (Dirichlet) log 2 + their id at every step: the round's value is the mean weighted
    by each client's samples, neither the mean over clients nor over batches."""
    from lightning_fl.data import Dirichlet

    torch.manual_seed(0)
    model = LogsItsOwn(make_model().backbone, 10, base="scratch", latent_dim=8, rank=4, layers="conv+linear")
    dm = make_dm(partition=Dirichlet(alpha=0.5, min_partition_size=5, balance=False), seed=1)
    trainer = quiet_fit(make_trainer(tmp_path, rounds=1, logger=False), model, dm)
    sizes = [dm.client_num_samples(k) for k in range(4)]
    batches = [-(-n // 16) for n in sizes]
    expected = sum(n * (2 + k) for k, n in enumerate(sizes)) / sum(sizes)
    per_batch = sum(b * (2 + k) for k, b in enumerate(batches)) / sum(batches)
    assert min(abs(expected - 3.5), abs(expected - per_batch)) > 0.01, (sizes, batches)  # the case tells them apart
    assert trainer.history[-1]["train/custom"] == pytest.approx(expected, rel=1e-12)


def test_strategy_and_attack_from_the_command_line(in_tmp, monkeypatch):
    monkeypatch.setenv("LIGHTNING_FL_CACHE", str(in_tmp / "cache"))
    args = ["--config", str(CONFIGS / "quickstart.yaml"), "--trainer.rounds", "2", "--model.pretraining.epochs", "1"]
    args += ["--trainer.enable_progress_bar", "false", "--trainer.strategy", "FedAdam"]
    args += [
        "--trainer.strategy.server_lr",
        "0.01",
        "--trainer.attack",
        "SignFlip",
        "--trainer.attack.clients",
        "[0,1]",
    ]
    args += ["--trainer.dropout", "0.25"]
    assert run_cli("fit", *args) == 0
    run = in_tmp / "runs" / "quickstart" / "version_0"
    config = (run / "config.yaml").read_text()
    assert "class_path: lightning_fl.federated.FedAdam" in config and "server_lr: 0.01" in config
    assert "class_path: lightning_fl.federated.SignFlip" in config and "dropout: 0.25" in config
    tags = EventAccumulator(str(run)).Reload().Tags()["scalars"]
    assert {"strategy/step_norm", "fed/attacked_clients", "fed/unavailable_clients"} <= set(tags)
    assert "fed/identity_error" not in tags  # FedAdam is not a linear aggregator
    assert run_cli("fit", *args[:-2], "--trainer.strategy.tau", "0") == 2


def test_an_unknown_strategy_or_attack_is_named_with_the_choices(in_tmp, capsys):
    base = ["--config", str(CONFIGS / "quickstart.yaml")]
    assert run_cli("fit", *base, "--trainer.strategy", "Medain") == 2
    err = capsys.readouterr().err
    assert "trainer.strategy: unknown class 'Medain'" in err and "Median, TrimmedMean" in err
    assert "LazyInstance" not in err
    assert run_cli("fit", *base, "--trainer.attack", "Signflip") == 2
    assert (
        "trainer.attack: unknown class 'Signflip'. Accepted short names: ALIE, GaussianNoise" in capsys.readouterr().err
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--trainer.attack", "SignFlip", "--trainer.attack.clients", "[3,8]"],
            "error: fit: trainer.attack.clients [8] do not exist: client ids run 0..7\n",
        ),
        (
            ["--trainer.strategy.min_clients", "9"],
            "trainer.strategy cannot aggregate any round: a round samples 8 clients, so at most 8 upload(s) accepted, "
            "fewer than trainer.strategy.min_clients=9\n",
        ),
        (["--trainer.strategy", "Krum", "--trainer.strategy.num_malicious", "6"], "needs at least 9\n"),
        (
            ["--trainer.strategy", "FedAdam", "--trainer.strategy.server_lr", "-1"],
            "error: fit: could not build the config: trainer.strategy.server_lr must be > 0, got -1.0\n",
        ),
        (
            ["--trainer.dropout", "1.5"],
            "error: fit: could not build the config: trainer.dropout must be in [0, 1), got 1.5\n",
        ),
    ],
)
def test_an_impossible_plan_is_refused_in_one_line_before_any_work(in_tmp, capsys, monkeypatch, args, message):
    monkeypatch.setenv("LIGHTNING_FL_CACHE", str(in_tmp / "cache"))
    assert run_cli("fit", "--config", str(CONFIGS / "quickstart.yaml"), *args) == 2
    err = capsys.readouterr().err
    assert message in err
    assert len(err.splitlines()) == 2 and "Given value" not in err  # the reason, then the --help hint
    assert not (in_tmp / "runs").exists() and not (in_tmp / "cache").exists()  # nothing was pretrained or written


def test_fabric_strategy_names_given_as_the_server_strategy_say_where_they_belong(in_tmp, capsys):
    base = ["--config", str(CONFIGS / "quickstart.yaml")]
    assert run_cli("fit", *base, "--trainer.strategy", "ddp") == 2
    err = capsys.readouterr().err
    assert "unknown class 'ddp'. Fabric's strategy is trainer.fabric_strategy; server strategies: FedAdagrad" in err


def test_update_norms_in_chunks_equal_the_float64_norms_of_every_row():
    from lightning_fl.federated.server.uploads import take, update_norms

    g = torch.Generator().manual_seed(0)
    for n, width in ((0, 7), (1, 7), (5, 3), (37, 2**15 + 3)):  # the last spans several chunks of rows
        uploads, current = torch.randn(n, width, generator=g), torch.randn(width, generator=g)
        want = (uploads.double() - current.double().unsqueeze(0)).norm(dim=1)  # all rows at once
        got = update_norms(uploads, current)
        assert got.dtype == torch.float64 and torch.equal(got, want)
    t = torch.arange(12.0).reshape(4, 3)
    assert take(t, [0, 1]).data_ptr() == t.data_ptr() and torch.equal(take(t, [0, 1]), t[:2])
    assert torch.equal(take(t, [1, 3]), t[[1, 3]]) and torch.equal(take(t, [1, 0]), t[[1, 0]])
    assert take(t, []).shape == (0, 3)


def test_a_collapse_under_defaults_is_warned_once_and_repeated_in_the_summary(in_tmp, capsys):
    """The default FedAvg and gate under a strong sign flip from 3 of 4 clients end at chance: one warning names the
    round and the largest updates, and the run summary repeats it (before, the run said nothing)."""
    import warnings

    args = [
        "fit",
        "--config",
        str(CONFIGS / "quickstart.yaml"),
        "--trainer.rounds",
        "2",
        "--data.num_clients",
        "4",
        "--trainer.enable_progress_bar",
        "false",
        "--trainer.logger",
        "false",
        "--model.init_args.pretraining.epochs",
        "2",
        "--trainer.attack",
        "SignFlip",
        "--trainer.attack.clients",
        "[0,1,2]",
        "--trainer.attack.scale",
        "50",
    ]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert run_cli(*args) == 0
    alarms = [str(w.message) for w in caught if "the global model collapsed" in str(w.message)]
    assert len(alarms) == 1 and alarms[0].startswith("round 1: the global model collapsed: ")
    assert "the largest updates aggregated: client " in alarms[0]
    assert f"warning: {alarms[0]}" in capsys.readouterr().out
    clean = [
        a
        for a in args
        if a
        not in ("--trainer.attack", "SignFlip", "--trainer.attack.clients", "[0,1,2]", "--trainer.attack.scale", "50")
    ]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert run_cli(*clean, "--trainer.name", "clean") == 0
    assert not [w for w in caught if "collapsed" in str(w.message)]


def test_the_collapse_alarm_advises_what_the_run_can_use(tmp_path):
    """Under user-level DP the noise is named first and no robust strategy is offered (central DP refuses them);
    under secure aggregation no update is named and the aggregate's norm bound is offered; a plain run keeps the
    robust strategies. A private run at tiny epsilon collapses and says so."""
    import warnings
    from types import SimpleNamespace

    from conftest import make_dm, make_model, make_trainer
    from lightning_fl.federated.trainer.callbacks import collapse_advice
    from lightning_fl.privacy import CentralDP
    from lightning_fl.privacy.secure import SecureAggregation

    trainer = make_trainer(
        tmp_path,
        rounds=2,
        logger=False,
        clients_per_round=4,
        max_update_norm_ratio=None,
        privacy=CentralDP(clip_norm=5.0, noise_multiplier=200.0),
    )
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        trainer.fit(make_model(), datamodule=make_dm(num_clients=4))
    assert "under trainer.privacy the noise (noise multiplier 200) may be" in (trainer.alarm or "")
    assert "Median" not in trainer.alarm and "Krum" not in trainer.alarm
    plain = SimpleNamespace(privacy=None, dp_sgd=None, secure_aggregation=None)
    assert "trainer.strategy Median or Krum" in collapse_advice(plain)
    secure = SimpleNamespace(privacy=None, dp_sgd=None, secure_aggregation=SecureAggregation())
    assert collapse_advice(secure).startswith("trainer.max_update_norm bounds") and "Median" not in collapse_advice(
        secure
    )
    dp_sgd = SimpleNamespace(privacy=None, dp_sgd=object(), secure_aggregation=None)
    assert collapse_advice(dp_sgd).startswith("DP-SGD's noise inside the clients may be what moved it")


class Recorder(Callback):
    """A user's callback: what the trainer told it, in order."""

    def __init__(self, tag: str = "r") -> None:
        self.tag, self.calls = tag, []

    def on_rounds_start(self, trainer, start):
        self.calls.append(("start", start, len(trainer.history)))

    def on_round_end(self, trainer, round, metrics):
        saved = torch.load(trainer.log_dir / "checkpoints" / "last.ckpt", weights_only=True)["round"]
        assert round == metrics["fed/round"]  # 1-based, as logged
        self.calls.append(("round", round, saved, trainer.history[-1]["round"], "val/acc" in metrics))

    def on_rounds_end(self, trainer):
        self.calls.append(("end", len(trainer.history)))


def test_a_users_callbacks_see_every_round_after_it_is_saved_and_a_resume_starts_where_it_left(tmp_path):
    first = Recorder()
    trainer = quiet_fit(make_trainer(tmp_path, rounds=2, name="cb", callbacks=[first]), make_model(), make_dm())
    # round 0 (the base) is evaluated before the rounds start; each round is checkpointed before its hook
    assert first.calls == [("start", 0, 1), ("round", 1, 1, 1, True), ("round", 2, 2, 2, True), ("end", 3)]
    again = Recorder()
    ckpt = str(trainer.log_dir / "checkpoints" / "last.ckpt")
    quiet_fit(make_trainer(tmp_path, rounds=3, name="cb", callbacks=[again]), make_model(), make_dm(), ckpt_path=ckpt)
    assert again.calls == [("start", 2, 3), ("round", 3, 3, 3, True), ("end", 4)]


class ThreadsSeen(Callback):
    """The torch threads the rounds run with."""

    def on_rounds_start(self, trainer, start):
        self.threads = torch.get_num_threads()


def test_a_fit_from_python_runs_with_the_clis_threads_unless_they_were_chosen(tmp_path, monkeypatch):
    """README's Python example ran with torch's default threads (one per core), several times slower than the CLI
    on 2 shared cores: ``FederatedTrainer`` applies the CLI's rule unless the user chose, and ``threads`` says how
    many."""
    from lightning_fl import threads

    before = torch.get_num_threads()
    rule = before + 1  # the CLI's rule on before + 2 cores, never torch's count
    monkeypatch.setattr(threads, "usable_cores", lambda: before + 2)
    monkeypatch.setattr(threads, "_torch_at_import", before)
    monkeypatch.setattr(threads, "_explicit", threads._explicit)

    def fit(chosen=False, environment=None, **kwargs):
        """The threads of a fit (``chosen``: lightning_fl.set_threads or the CLI's key ran before)."""
        monkeypatch.setattr(threads, "_chosen", chosen)
        for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):  # restored after the test
            monkeypatch.setenv(name, "1")
            monkeypatch.delenv(name)
        if environment is not None:  # the user's, or as a process that Fabric starts inherits it
            monkeypatch.setenv("OMP_NUM_THREADS", environment)
        seen = ThreadsSeen()
        quiet_fit(make_trainer(tmp_path, rounds=1, logger=False, callbacks=[seen], **kwargs), make_model(), make_dm())
        return seen.threads

    try:
        assert fit() == rule and threads.os.environ["OMP_NUM_THREADS"] == str(rule)
        assert fit(threads=2) == 2 and threads.os.environ["OMP_NUM_THREADS"] == "2"
        assert fit(chosen=True) == 2 and fit(chosen=True, threads=1) == 1
        torch.set_num_threads(rule + 1)  # the user's own choice is kept
        assert fit() == rule + 1
        torch.set_num_threads(before)
        assert fit(environment=str(before)) == before
        with pytest.raises(ConfigError, match="trainer.threads must be a whole number >= 1 or null, got 0"):
            make_trainer(tmp_path, threads=0)
    finally:
        torch.set_num_threads(before)


def test_callbacks_come_from_the_config_by_class_path(in_tmp, capsys):
    recorder = '[{"class_path": "test_federated_core.Recorder", "init_args": {"tag": "x"}}]'
    args = ["--config", str(CONFIGS / "quickstart.yaml"), "--trainer.rounds", "1", "--trainer.callbacks", recorder]
    assert run_cli("fit", *args, "--print_config") == 0
    assert "test_federated_core.Recorder" in capsys.readouterr().out
    from lightning_fl.cli import build

    trainer = build(["fit", *args]).trainer
    assert [type(c).__name__ for c in trainer.callbacks] == ["Recorder"] and trainer.callbacks[0].tag == "x"


def test_the_transport_is_a_constructor_argument_and_sees_every_round(tmp_path):
    from lightning_fl.federated.clients.transport import InProcess

    class Counting(InProcess):
        def __init__(self):
            super().__init__()
            self.delivered, self.finished = [], []

        def replies(self, job, clients):
            self.delivered.append((job.round, list(clients)))
            yield from super().replies(job, clients)

        def finished_round(self, round, metrics):
            self.finished.append(round)

    transport = Counting()
    trainer = quiet_fit(make_trainer(tmp_path, rounds=2, transport=transport), make_model(), make_dm())
    assert trainer.transport is transport and transport.finished == [1, 2]  # 1-based, as logged
    assert [r for r, _ in transport.delivered] == [0, 1] and all(c == [0, 1, 2, 3] for _, c in transport.delivered)
    with pytest.raises(ConfigError, match="trainer.transport must be a Transport or null, got str"):
        make_trainer(tmp_path, transport="flower")
