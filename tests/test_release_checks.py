"""The release record and the rewind warning as units (no training): a private run resumed behind its last recorded
release, even one round behind, is told that those rounds are drawn again and charged again; a run without privacy
is told which later checkpoints it replaces."""

import warnings

import pytest

from lightning_fl.federated.persistence import budget


def recorded(folder, rounds):
    for r in range(1, rounds + 1):
        budget.record_release(folder, r, {"privacy/epsilon": 0.5 * r, "privacy/delta": 1e-5})
    return folder


def test_the_record_holds_every_release_in_order(tmp_path):
    recorded(tmp_path, 3)
    lines = (tmp_path / budget.RELEASES).read_text().splitlines()
    assert lines[0] == budget.HEADER.strip() and [line.split(",")[0] for line in lines[1:]] == ["1", "2", "3"]
    assert float(lines[-1].split(",")[1]) == 1.5 and budget.last_release(tmp_path) == 3
    assert budget.last_release(tmp_path / "elsewhere") == 0


@pytest.mark.parametrize("behind", [1, 2])
def test_a_private_resume_behind_the_last_release_is_told_even_one_round_behind(tmp_path, behind):
    recorded(tmp_path, 3)
    checkpoint = tmp_path / "checkpoints" / f"round_{3 - behind:04d}.ckpt"
    with pytest.warns(
        UserWarning,
        match=rf"resuming round {4 - behind} from round_{3 - behind:04d}.ckpt: this run "
        r"released rounds up to 3 already \(releases.csv\); they are drawn again with fresh noise and "
        "charged to the population's privacy ledger again",
    ):
        budget.warn_rewind(tmp_path, 3 - behind, checkpoint, is_private=True)


def test_a_private_resume_at_the_last_release_goes_on_in_silence(tmp_path):
    recorded(tmp_path, 3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        budget.warn_rewind(tmp_path, 3, tmp_path / "checkpoints" / "last.ckpt", is_private=True)


def test_a_resume_without_privacy_behind_its_checkpoints_is_warned_of_what_it_replaces(tmp_path):
    (tmp_path / "checkpoints").mkdir()
    for r in (1, 2, 3):
        (tmp_path / "checkpoints" / f"round_{r:04d}.ckpt").write_bytes(b"")
    with pytest.warns(
        UserWarning,
        match=r"resuming round 2 from round_0001.ckpt: the run's later checkpoints "
        r"\(round_0002.ckpt, round_0003.ckpt\) and its last.ckpt will be replaced",
    ):
        budget.warn_rewind(tmp_path, 1, tmp_path / "checkpoints" / "round_0001.ckpt", False)
