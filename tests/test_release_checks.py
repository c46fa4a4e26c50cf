"""The release record's checks as units (no training): a private run may resume only from a checkpoint at or past
its last recorded release; a run without privacy may resume earlier, told what it replaces."""

import warnings

import pytest

from lightning_fl.federated import budget


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
def test_a_private_resume_behind_the_last_release_is_refused_even_one_round_behind(tmp_path, behind):
    recorded(tmp_path, 3)
    checkpoint = tmp_path / "checkpoints" / f"round_{3 - behind:04d}.ckpt"
    problem = budget.check_release(tmp_path, 3 - behind, checkpoint, is_private=True)
    assert problem is not None and problem.startswith(
        f"round_{3 - behind:04d}.ckpt holds round {3 - behind} but this run released rounds up to 3"
    )
    assert f"would draw rounds {4 - behind}-3 again with fresh noise" in problem


def test_a_private_resume_at_the_last_release_goes_on(tmp_path):
    recorded(tmp_path, 3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert budget.check_release(tmp_path, 3, tmp_path / "checkpoints" / "last.ckpt", is_private=True) is None


def test_a_resume_without_privacy_behind_its_checkpoints_is_warned_of_what_it_replaces(tmp_path):
    (tmp_path / "checkpoints").mkdir()
    for r in (1, 2, 3):
        (tmp_path / "checkpoints" / f"round_{r:04d}.ckpt").write_bytes(b"")
    with pytest.warns(
        UserWarning,
        match=r"resuming round 2 from round_0001.ckpt: the run's later checkpoints "
        r"\(round_0002.ckpt, round_0003.ckpt\) and its last.ckpt will be replaced",
    ):
        assert budget.check_release(tmp_path, 1, tmp_path / "checkpoints" / "round_0001.ckpt", False) is None
