"""A budget that cannot be un-spent: the release record, the checks a resume passes, the keyed digest."""

import shutil
import warnings
from collections import Counter

import pytest
import torch

from conftest import make_dm, make_model, make_trainer
from lightning_fl.checkpoint import content_digest
from lightning_fl.errors import CheckpointError, ConfigError
from lightning_fl.federated.persistence import checkpoint as round_ckpt
from lightning_fl.federated.persistence.checkpoint import DIGEST, KEY_ENV, KEYED
from lightning_fl.privacy import CentralDP, DistributedDP, LocalDP
from lightning_fl.privacy.accountant import Accountant, RoundEvent

DP_ARGS = {"max_update_norm_ratio": None, "clients_per_round": 4, "save_every_n_rounds": 1}


def fit(trainer, quiet=True, **kwargs):
    with warnings.catch_warnings():
        if quiet:
            warnings.simplefilter("ignore", UserWarning)
        trainer.fit(make_model(), datamodule=make_dm(num_clients=8), **kwargs)
    return trainer


def private_run(tmp_path, rounds, privacy=None, **kwargs):
    privacy = privacy or CentralDP(clip_norm=0.5, noise_multiplier=1.0)  # noise and cohorts from the OS
    args = {"rounds": rounds, "name": "dp", "logger": False, "privacy": privacy, **DP_ARGS, **kwargs}
    return make_trainer(tmp_path, **args)


@pytest.fixture(scope="module")
def four_rounds(tmp_path_factory):
    """One private 4-round run, trained once for the tests that only edit its checkpoint: each edits a copy (its
    ledger its own, not the per-test one: a module fixture runs before it is set)."""
    root = tmp_path_factory.mktemp("four_rounds")
    fit(private_run(root, 4, privacy_ledger=str(root / "ledger")))
    return root


def run_copy(root, tmp_path):
    """A copy of the run under ``root`` in ``tmp_path``; its run folder."""
    shutil.copytree(root, tmp_path, dirs_exist_ok=True)
    return tmp_path / "runs" / "dp" / "version_0"


def edited(path, edit):
    """The checkpoint at ``path`` edited by ``edit`` and its plain digest recomputed, as an editor would."""
    ckpt = torch.load(path, weights_only=True)
    edit(ckpt)
    ckpt[DIGEST] = content_digest({k: v for k, v in ckpt.items() if k not in (DIGEST, KEYED)})
    torch.save(ckpt, path)


def test_every_released_round_is_recorded_and_a_resume_behind_the_last_release_is_charged_again(tmp_path):
    """Under OS noise, resuming round_0002.ckpt of a run that reached round 4 releases rounds 3-4 again with fresh
    noise: said in a warning and charged to the population's ledger (6 released rounds), while the run's own
    epsilon is its checkpoint's lineage; the run's record only grows."""
    run = fit(private_run(tmp_path, 4))
    record = (run.log_dir / "releases.csv").read_text().splitlines()
    assert record[0].startswith("round,epsilon,delta") and [line.split(",")[0] for line in record[1:]] == list("1234")
    assert float(record[-1].split(",")[1]) == pytest.approx(run.history[-1]["privacy/epsilon"], rel=1e-15)
    assert run.history[-1]["privacy/population_epsilon"] == run.history[-1]["privacy/epsilon"]
    behind = run.log_dir / "checkpoints" / "round_0002.ckpt"
    with pytest.warns(UserWarning, match=r"this run released rounds up to 4 already \(releases.csv\); they are drawn"):
        again = fit(private_run(tmp_path, 4), ckpt_path=str(behind), quiet=False)
    rounds = [line.split(",")[0] for line in (run.log_dir / "releases.csv").read_text().splitlines()[1:]]
    assert again.log_dir == run.log_dir and rounds == list("123434")
    assert again.history[-1]["privacy/epsilon"] == pytest.approx(run.history[-1]["privacy/epsilon"], rel=1e-12)
    assert again.history[-1]["privacy/population_rounds"] == 6
    assert again.history[-1]["privacy/population_epsilon"] == pytest.approx(central_epsilon(6), rel=1e-12)


def central_epsilon(rounds, clients=8, per_round=4, z=1.0):
    """What ``rounds`` rounds of CentralDP (fixed-size sampling, delta 1e-5) spend, from the accountant alone."""
    accountant = Accountant(clients, per_round, "fixed")
    accountant.compose(RoundEvent(z), rounds)
    return accountant.epsilon(1e-5)


def copied(tmp_path, how):
    """Round 2's checkpoint of a 4-round private run, copied as an operator might; the trainer arguments that resume
    it (a name, ``resume`` or ``ckpt_path``)."""
    run = fit(private_run(tmp_path, 4))
    source = run.log_dir / "checkpoints" / "round_0002.ckpt"
    if how == "another folder":
        (tmp_path / "elsewhere").mkdir()
        target = shutil.copy(source, tmp_path / "elsewhere" / "round_0002.ckpt")
        return run, {"name": "dp"}, {"ckpt_path": str(target)}
    if how == "a new run name":
        (tmp_path / "runs" / "copy" / "version_0" / "checkpoints").mkdir(parents=True)
        shutil.copy(source, tmp_path / "runs" / "copy" / "version_0" / "checkpoints" / "last.ckpt")
        return run, {"name": "copy", "resume": True}, {}
    (run.log_dir / "releases.csv").unlink()  # over last.ckpt, the run's record deleted
    shutil.copy(source, run.log_dir / "checkpoints" / "last.ckpt")
    return run, {"name": "dp", "resume": True}, {}


@pytest.mark.parametrize("how", ["another folder", "a new run name", "over last.ckpt"])
def test_a_copied_checkpoint_is_charged_to_the_population_and_max_epsilon_reads_its_total(tmp_path, how):
    """Issue 72, item 2, the accident: round_0002.ckpt of a run that released 4 rounds, copied to another folder, to
    a new run name, or over last.ckpt after deleting releases.csv, resumed without a word, drew rounds 3-4 again
    and printed the first run's epsilon. Now every released round is in the population's ledger: with max_epsilon
    at what the first run spent, the copy stops before its round 3 (the population's fifth), naming the ledger."""
    run, names, resume = copied(tmp_path, how)
    spent = run.history[-1]["privacy/epsilon"]
    privacy = CentralDP(clip_norm=0.5, noise_multiplier=1.0, max_epsilon=spent)
    args = {"rounds": 4, "logger": False, "privacy": privacy, **DP_ARGS, **names}
    copy = fit(make_trainer(tmp_path, **args), **resume)
    assert [h["round"] for h in copy.history] == [0, 1, 2]  # nothing drawn again
    said = "stopped before round 3: the population's round 5 (counting every run that drew on it) would spend epsilon"
    assert copy.stopped.startswith(f"{said} {central_epsilon(5):.4g}")
    assert "privacy ledger" in copy.stopped
    unbounded = {**args, "privacy": CentralDP(clip_norm=0.5, noise_multiplier=1.0)}
    unbounded = fit(make_trainer(tmp_path, **unbounded), **resume)
    last = unbounded.history[-1]
    assert last["privacy/population_epsilon"] == pytest.approx(central_epsilon(6), rel=1e-12)
    assert last["privacy/epsilon"] == pytest.approx(spent, rel=1e-12)  # the copy's own lineage, as printed before
    assert last["privacy/population_rounds"] == 6


def test_a_kill_between_the_release_and_the_checkpoint_resumes_with_the_lost_round_counted(tmp_path, monkeypatch):
    """Issue 72, item 3: killed after round 3 was released (in the ledger and releases.csv) but before its
    checkpoint, the run could never resume (its last.ckpt, round 2, was refused by the message that named it). Now it
    resumes from round 2, and the lost release counts: 5 rounds charged for a 4-round run."""

    class Killed(BaseException):
        pass

    save_round = round_ckpt.save_round

    def killed_at_round_3(state, folder, completed, every):
        if completed == 3:
            raise Killed
        save_round(state, folder, completed, every)

    monkeypatch.setattr(round_ckpt, "save_round", killed_at_round_3)
    with pytest.raises(Killed):
        fit(private_run(tmp_path, 4))
    monkeypatch.setattr(round_ckpt, "save_round", save_round)
    folder = tmp_path / "runs" / "dp" / "version_0"
    assert torch.load(folder / "checkpoints" / "last.ckpt", weights_only=True)["round"] == 2
    with pytest.warns(UserWarning, match=r"resuming round 3 from last.ckpt: this run released rounds up to 3"):
        resumed = fit(private_run(tmp_path, 4, resume=True), quiet=False)
    assert resumed.log_dir == folder and [h["round"] for h in resumed.history] == [0, 1, 2, 3, 4]
    assert resumed.history[-1]["privacy/epsilon"] == pytest.approx(central_epsilon(4), rel=1e-12)
    assert resumed.history[-1]["privacy/population_epsilon"] == pytest.approx(central_epsilon(5), rel=1e-12)


@pytest.mark.parametrize("mechanism", ["LocalDP", "DistributedDP", "DPSGD"])
def test_two_runs_on_one_population_are_charged_together(tmp_path, mechanism):
    """Every run that draws on a population is charged, fresh or resumed: after two 2-round runs the population's
    epsilon is the worst client's over both runs' releases, by the mechanism's own accounting."""
    from lightning_fl.privacy.accountant import gaussian_epsilon_closed_form
    from lightning_fl.privacy.dpsgd import DPSGD, epsilon

    def run(name):
        kinds = {
            "LocalDP": {"privacy": LocalDP(clip_norm=0.5, noise_multiplier=2.0)},
            "DistributedDP": {"privacy": DistributedDP(clip_norm=0.5, noise_multiplier=2.0)},
            "DPSGD": {"dp_sgd": DPSGD(max_grad_norm=1.0, noise_multiplier=1.0), "local_steps": 2},
        }
        return fit(make_trainer(tmp_path, rounds=2, name=name, logger=False, **DP_ARGS, **kinds[mechanism]))

    first, second = run("first"), run("second")
    if mechanism == "DPSGD":
        plans, taken = second.dp_sgd.plans, Counter(first.dp_sgd.participations) + Counter(second.dp_sgd.participations)
        want = max(epsilon(plans[c].q, plans[c].steps * k, plans[c].z, 1e-5) for c, k in taken.items())
        assert second.history[-1]["privacy/record_population_epsilon_max"] == pytest.approx(want, rel=1e-12)
        assert want > second.history[-1]["privacy/record_epsilon_max"]
        return
    if mechanism == "LocalDP":
        uploads = Counter(first.privacy.uploads) + Counter(second.privacy.uploads)
        want = gaussian_epsilon_closed_form(2.0 / 2 / max(uploads.values()) ** 0.5, 1e-5)
    else:
        precision = Counter(first.privacy.precision) + Counter(second.privacy.precision)
        want = second.privacy.client_epsilon(max(precision.values()))
    assert second.history[-1]["privacy/population_epsilon"] == pytest.approx(want, rel=1e-9)
    assert want > second.history[-1]["privacy/epsilon"]


def test_a_population_charged_by_another_mechanism_is_refused_in_one_line(tmp_path):
    fit(private_run(tmp_path, 1))
    said = r"under trainer.privacy CentralDP, this run uses LocalDP: their budgets do not add up to one epsilon here"
    with pytest.raises(ConfigError, match=said + r"; use the same mechanism, or set trainer.population"):
        fit(private_run(tmp_path, 1, LocalDP(clip_norm=0.5, noise_multiplier=2.0)))


def test_a_new_population_is_started_deliberately_and_bad_ledger_keys_are_one_line(tmp_path):
    """trainer.population starts an empty ledger (a claim the data is new); trainer.privacy_ledger moves the
    ledgers; a label that is not one line, a ledger without a private run, an unwritable folder: one line each."""
    first = fit(private_run(tmp_path, 2, privacy_ledger=str(tmp_path / "ledgers")))
    assert len(list((tmp_path / "ledgers").glob("*.jsonl"))) == 1
    again = fit(private_run(tmp_path, 2, privacy_ledger=str(tmp_path / "ledgers")))
    assert again.history[-1]["privacy/population_epsilon"] == pytest.approx(central_epsilon(4), rel=1e-12)
    fresh = fit(private_run(tmp_path, 2, privacy_ledger=str(tmp_path / "ledgers"), population="collected anew"))
    assert fresh.history[-1]["privacy/population_epsilon"] == first.history[-1]["privacy/epsilon"]
    assert len(list((tmp_path / "ledgers").glob("*.jsonl"))) == 2
    with pytest.raises(ConfigError, match=r"trainer.population must be a label \(a non-empty string on one line\)"):
        private_run(tmp_path, 2, population=" ")
    with pytest.raises(ConfigError, match="trainer.privacy_ledger names the ledger of a private run.*remove the key"):
        make_trainer(tmp_path, privacy_ledger=str(tmp_path))
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match="trainer.privacy_ledger: cannot write the population's privacy ledger in"):
        fit(private_run(tmp_path, 2, privacy_ledger=str(tmp_path / "file" / "ledgers")))


def test_a_run_without_privacy_may_resume_an_earlier_checkpoint_and_is_told_what_it_replaces(tmp_path):
    plain = fit(make_trainer(tmp_path, rounds=4, name="plain", logger=False, **DP_ARGS))
    assert not (plain.log_dir / "releases.csv").exists()
    with pytest.warns(
        UserWarning,
        match=r"resuming round 3 from round_0002.ckpt: the run's later checkpoints "
        r"\(round_0003.ckpt, round_0004.ckpt\) and its last.ckpt will be replaced",
    ):
        make_trainer(tmp_path, rounds=4, name="plain", logger=False, **DP_ARGS).fit(
            make_model(),
            datamodule=make_dm(num_clients=8),
            ckpt_path=str(plain.log_dir / "checkpoints" / "round_0002.ckpt"),
        )


@pytest.mark.parametrize(
    ("what", "edit", "message"),
    [
        (
            "forgotten rounds",
            lambda c: c["privacy"]["accountant"].update(rounds=[[1.0, 0.0, 2]]),
            "its privacy accountant holds 2 rounds, the checkpoint 4",
        ),
        (
            "a lower epsilon",
            lambda c: c["privacy"]["accountant"].update(rounds=[[1.5, 0.0, 4]]),
            r"its budget gives epsilon [\d.]+ after round 4, the run logged [\d.]+",
        ),
    ],
)
def test_an_accountant_edited_with_its_digest_recomputed_is_refused(four_rounds, tmp_path, what, edit, message):
    """The red team's edit: fewer rounds in the accountant (epsilon 41.6 -> 25.9 in their run), the plain digest
    recomputed; the resume compares the budget with the round count and with what the run logged."""
    last = run_copy(four_rounds, tmp_path) / "checkpoints" / "last.ckpt"
    edited(last, edit)
    with pytest.raises(CheckpointError, match=message + r".*the checkpoint was edited after it was written"):
        fit(private_run(tmp_path, 6), ckpt_path=str(last))


@pytest.mark.parametrize("kind", [CentralDP, DistributedDP])
def test_a_checkpoints_delta_and_noise_never_replace_the_runs(tmp_path, kind):
    run = fit(private_run(tmp_path, 2, kind(clip_norm=0.5, noise_multiplier=1.0)))
    last = str(run.log_dir / "checkpoints" / "last.ckpt")
    with pytest.raises(ConfigError, match=r"checkpoint's delta is 1e-05, this run's trainer.privacy.delta is 0.001"):
        fit(private_run(tmp_path, 3, kind(clip_norm=0.5, noise_multiplier=1.0, delta=1e-3)), ckpt_path=last)
    with pytest.raises(ConfigError, match=r"checkpoint's noise multiplier is 1, trainer.privacy.noise_multiplier is 2"):
        fit(private_run(tmp_path, 3, kind(clip_norm=0.5, noise_multiplier=2.0)), ckpt_path=last)
    fit(private_run(tmp_path, 3, kind(clip_norm=0.5, noise_multiplier=1.0)), ckpt_path=last)  # the same: resumes


def test_local_dp_uploads_beyond_the_rounds_run_are_refused(tmp_path):
    run = fit(private_run(tmp_path, 2, LocalDP(clip_norm=0.5, noise_multiplier=1.0)))
    last = run.log_dir / "checkpoints" / "last.ckpt"
    edited(last, lambda c: c["privacy"].update(uploads=torch.tensor([[0, 5]])))
    with pytest.raises(CheckpointError, match="a client uploaded 5 times in 2 rounds"):
        fit(private_run(tmp_path, 3, LocalDP(clip_norm=0.5, noise_multiplier=1.0)), ckpt_path=str(last))


def test_with_a_key_in_the_environment_an_edit_is_caught_whatever_it_edits(tmp_path, monkeypatch):
    """LIGHTNING_FL_CHECKPOINT_KEY: every checkpoint carries an HMAC of its digest; an edit with the plain digest
    recomputed (here the history and the accountant together, which the budget checks cannot see) is refused, as is
    a file without the HMAC, one read without the key, or under another key; an intact one resumes."""
    monkeypatch.setenv(KEY_ENV, "operator secret")
    run = fit(private_run(tmp_path, 2))
    last = run.log_dir / "checkpoints" / "last.ckpt"
    assert KEYED in torch.load(last, weights_only=True)
    pristine = last.read_bytes()

    def consistent_edit(ckpt):
        ckpt["privacy"]["accountant"]["rounds"] = [[2.0, 0.0, 2]]
        for h in ckpt["history"][1:]:
            h["privacy/epsilon"] = 0.5

    def rehash(ckpt):
        ckpt[DIGEST] = content_digest({k: v for k, v in ckpt.items() if k not in (DIGEST, KEYED)})

    edited(last, consistent_edit)
    with pytest.raises(CheckpointError, match=rf"keyed digest does not match {KEY_ENV}: it was edited"):
        fit(private_run(tmp_path, 3), ckpt_path=str(last))
    last.write_bytes(pristine)
    monkeypatch.setenv(KEY_ENV, "another key")
    with pytest.raises(CheckpointError, match="written under another key"):
        fit(private_run(tmp_path, 3), ckpt_path=str(last))
    monkeypatch.delenv(KEY_ENV)
    with pytest.raises(CheckpointError, match=rf"it carries a keyed digest: set {KEY_ENV}"):
        fit(private_run(tmp_path, 3), ckpt_path=str(last))
    ckpt = torch.load(last, weights_only=True)
    del ckpt[KEYED]
    rehash(ckpt)
    torch.save(ckpt, last)
    monkeypatch.setenv(KEY_ENV, "operator secret")
    with pytest.raises(CheckpointError, match="has no keyed digest"):
        fit(private_run(tmp_path, 3), ckpt_path=str(last))
    last.write_bytes(pristine)
    resumed = fit(private_run(tmp_path, 3), ckpt_path=str(last))  # intact, under its key: resumes
    assert [h["round"] for h in resumed.history] == [0, 1, 2, 3]
