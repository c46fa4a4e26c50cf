"""A budget that cannot be un-spent: the release record, the checks a resume passes, the keyed digest. (The release
checks as units, without training: test_release_checks.py.)"""

import shutil
import warnings

import pytest
import torch

from conftest import make_dm, make_model, make_trainer
from lightning_fl.checkpoint import content_digest
from lightning_fl.errors import CheckpointError, ConfigError
from lightning_fl.federated.checkpoint import DIGEST, KEY_ENV, KEYED
from lightning_fl.privacy import CentralDP, DistributedDP, LocalDP

DP_ARGS = {"max_update_norm_ratio": None, "clients_per_round": 4, "save_every_n_rounds": 1}


def fit(trainer, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        trainer.fit(make_model(), datamodule=make_dm(num_clients=8), **kwargs)
    return trainer


def private_run(tmp_path, rounds, privacy=None, **kwargs):
    privacy = privacy or CentralDP(clip_norm=0.5, noise_multiplier=1.0)  # noise and cohorts from the OS
    return make_trainer(tmp_path, rounds=rounds, name="dp", logger=False, privacy=privacy, **DP_ARGS, **kwargs)


@pytest.fixture(scope="module")
def four_rounds(tmp_path_factory):
    """One private run of 4 rounds, trained once for the tests that resume or edit it: each works on a copy."""
    root = tmp_path_factory.mktemp("four_rounds")
    fit(private_run(root, 4))
    return root


def copied(root, tmp_path):
    """A copy of the run under ``root`` in ``tmp_path`` (its folder: ``tmp_path/runs/dp/version_0``)."""
    shutil.copytree(root, tmp_path, dirs_exist_ok=True)
    return tmp_path / "runs" / "dp" / "version_0"


def edited(path, edit):
    """The checkpoint at ``path`` edited by ``edit`` and its plain digest recomputed, as an editor would."""
    ckpt = torch.load(path, weights_only=True)
    edit(ckpt)
    ckpt[DIGEST] = content_digest({k: v for k, v in ckpt.items() if k not in (DIGEST, KEYED)})
    torch.save(ckpt, path)


def test_every_released_round_is_recorded_and_a_resume_behind_the_last_release_is_refused(four_rounds, tmp_path):
    """Under OS noise, resuming round_0002.ckpt of a run that reached round 4 would release rounds 3-4 again with
    fresh noise while the budget restarts from round 2: refused, naming the record; last.ckpt resumes and the record
    goes on."""
    folder = copied(four_rounds, tmp_path)
    record = (folder / "releases.csv").read_text().splitlines()
    assert record[0].startswith("round,epsilon,delta") and [line.split(",")[0] for line in record[1:]] == list("1234")
    last = torch.load(folder / "checkpoints" / "last.ckpt", weights_only=True)
    assert float(record[-1].split(",")[1]) == pytest.approx(last["history"][-1]["privacy/epsilon"], rel=1e-15)
    behind = folder / "checkpoints" / "round_0002.ckpt"
    with pytest.raises(CheckpointError, match=r"holds round 2 but this run released rounds up to 4 \(releases.csv"):
        fit(private_run(tmp_path, 4), ckpt_path=str(behind))
    assert len((folder / "releases.csv").read_text().splitlines()) == 5  # nothing rewound, nothing appended
    longer = fit(private_run(tmp_path, 6), ckpt_path=str(folder / "checkpoints" / "last.ckpt"))
    rounds = [line.split(",")[0] for line in (longer.log_dir / "releases.csv").read_text().splitlines()[1:]]
    assert longer.log_dir == folder and rounds == list("123456")


def test_a_run_without_privacy_may_resume_an_earlier_checkpoint_and_is_told_what_it_replaces(tmp_path):
    plain = fit(make_trainer(tmp_path, rounds=4, name="plain", logger=False, **DP_ARGS))
    assert not (plain.log_dir / "releases.csv").exists()
    with pytest.warns(
        UserWarning,
        match=r"resuming round 3 from round_0002.ckpt: the run's later checkpoints "
        r"\(round_0003.ckpt, round_0004.ckpt\) and its last.ckpt will be replaced",
    ):
        make_trainer(tmp_path, rounds=4, name="plain", logger=False, **DP_ARGS).fit(
            make_model(), datamodule=make_dm(num_clients=8),
            ckpt_path=str(plain.log_dir / "checkpoints" / "round_0002.ckpt"))  # fmt: skip


@pytest.mark.parametrize(
    ("what", "edit", "message"),
    [
        ("forgotten rounds", lambda c: c["privacy"]["accountant"].update(rounds=[[1.0, 0.0, 2]]),
         "its privacy accountant holds 2 rounds, the checkpoint 4"),
        ("a lower epsilon", lambda c: c["privacy"]["accountant"].update(rounds=[[1.5, 0.0, 4]]),
         r"its budget gives epsilon [\d.]+ after round 4, the run logged [\d.]+"),
    ],
)  # fmt: skip
def test_an_accountant_edited_with_its_digest_recomputed_is_refused(four_rounds, tmp_path, what, edit, message):
    """The red team's edit: fewer rounds in the accountant (epsilon 41.6 -> 25.9 in their run), the plain digest
    recomputed; the resume compares the budget with the round count and with what the run logged."""
    last = copied(four_rounds, tmp_path) / "checkpoints" / "last.ckpt"
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
