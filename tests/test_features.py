from pathlib import Path

import pytest
import torch

from lightning_fl.data import Digits, FashionMNIST
from lightning_fl.errors import CheckpointError, ConfigError, DatasetNotFoundError
from lightning_fl.methods import Classifier
from lightning_fl.models import SmallCNN
from lightning_fl.oneshot.features import ExtractedFeatures, FeatureSet, PixelFeatures, check_classes

TINY = {"epochs": 2, "batch_size": 64, "warmup_epochs": 0.5, "accelerator": "cpu"}


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny CNNs run faster on one thread, and far faster when other jobs share the cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def digits_cnn(seed: int = 0) -> SmallCNN:
    torch.manual_seed(seed)  # the initial weights are part of the cache key
    return SmallCNN(in_channels=1, image_size=8, channels=[32, 64], feature_dim=128, norm_groups=8)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """One extractor trained for 2 epochs on digits, shared by the tests that need trained weights."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    cache = tmp_path_factory.mktemp("cache")
    features = ExtractedFeatures(Digits(), digits_cnn(), cache_dir=str(cache), **TINY)
    features.prepare()
    torch.set_num_threads(threads)
    return features, cache


def test_pixel_features_are_standardised_digits():
    features = PixelFeatures()
    train, test = features.load("train"), features.load("test")
    assert (features.num_classes, features.feature_dim) == (10, 64)
    assert train.h.shape == (1437, 64) and test.h.shape == (360, 64)
    assert train.h.dtype == torch.float32 and train.y.dtype == torch.int64
    assert train.h.mean(0).abs().max() < 1e-4
    std = train.h.std(0, unbiased=False)
    assert torch.allclose(std[std > 0], torch.ones_like(std[std > 0]), atol=1e-4)  # constant border pixels stay 0
    raw = PixelFeatures(standardize=False)
    assert torch.allclose(test.h, (raw.load("test").h - features.mean) / features.std)  # train statistics


def test_class_subset_is_relabelled_in_the_given_order():
    full = PixelFeatures(standardize=False).load("train")
    sub = PixelFeatures(standardize=False, classes=[7, 2, 5])
    train = sub.load("train")
    assert sub.num_classes == 3 and train.num_classes == 3
    assert sorted(train.y.unique().tolist()) == [0, 1, 2]
    for new, old in enumerate([7, 2, 5]):
        assert torch.equal(train.h[train.y == new], full.h[full.y == old])
    picked = full.select_classes([7, 2, 5])
    assert torch.equal(picked.h, train.h) and torch.equal(picked.y, train.y)


@pytest.mark.parametrize(("classes", "words"), [([1, 1, 2], "duplicates [1]"), ([0, 10], "out-of-range ids [10]")])
def test_bad_class_subsets_name_the_key_and_range(classes, words):
    with pytest.raises(ConfigError, match=r"data\.features\.classes must list .* in \[0, 10\)") as info:
        PixelFeatures(classes=classes)
    assert words in str(info.value)
    assert check_classes(None, 10) is None
    with pytest.raises(ValueError, match="at least two"):
        check_classes([3], 10)


def test_feature_set_checks_and_subsets():
    h, y = torch.randn(5, 3), torch.tensor([0, 1, 2, 1, 0])
    fs = FeatureSet(h, y, 3)
    assert len(fs) == 5 and fs.feature_dim == 3
    part = fs.subset([4, 1])
    assert torch.equal(part.h, h[[4, 1]]) and part.y.tolist() == [0, 1]
    with pytest.raises(ValueError, match="labels in"):
        FeatureSet(h, y, 2)
    with pytest.raises(ValueError, match="float32"):
        FeatureSet(h.double(), y, 3)


def test_extracted_features_train_once_then_load_from_cache(trained, monkeypatch):
    features, cache = trained
    train, test = features.load("train"), features.load("test")
    assert train.h.shape == (1437, 128) and test.h.shape == (360, 128)
    assert features.feature_dim == 128 and features.num_classes == 10
    assert features.info["extractor"] == "trained" and not features.info["cached"]
    assert features.info["extractor_test_acc"] > 0.6  # chance is 0.1
    assert features.info["extractor_train_acc"] > 0.6
    assert train.h.mean(0).abs().max() < 1e-4  # standardised with train statistics

    def no_training(*args, **kwargs):
        raise AssertionError("the cache should have been used")

    monkeypatch.setattr(ExtractedFeatures, "_train", no_training)
    again = ExtractedFeatures(Digits(), digits_cnn(), cache_dir=str(cache), **TINY)
    assert again.info == {} and torch.equal(again.load("train").h, train.h)
    assert again.info["cached"] and again.info["extractor_test_acc"] == features.info["extractor_test_acc"]
    # the extractor's trained weights come back with the features
    pairs = zip(again.extractor.parameters(), features.extractor.parameters(), strict=True)
    assert all(torch.equal(a, b) for a, b in pairs)


def test_training_the_extractor_shows_progress(tmp_path, monkeypatch, caplog):
    """Epoch lines name the extractor; long epochs and extractions print lines (every batch with a zero interval)."""
    import logging

    from lightning_fl.methods import centralised

    monkeypatch.setattr(centralised, "HEARTBEAT_SECONDS", 0.0)
    features = ExtractedFeatures(Digits(), digits_cnn(), cache_dir=str(tmp_path), max_train_samples=128, **TINY)
    with caplog.at_level(logging.INFO, logger="lightning_fl"):
        features.prepare()
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    batches = [line for line in lines if ": batch " in line]
    epochs = [line.split(":")[0] for line in lines if "val/acc " in line]
    assert batches[:2] == ["feature extractor epoch 1/2: batch 1/2", "feature extractor epoch 1/2: batch 2/2"]
    assert epochs == ["feature extractor epoch 1/2", "feature extractor epoch 2/2"]
    extracting = [line for line in lines if line.startswith("extracting ")]
    assert extracting == [  # a line when each split starts, then its progress
        "extracting train features: 128 images through FeatureExtractor",
        "extracting train features: 128/128 images",
        "extracting test features: 360 images through FeatureExtractor",
        "extracting test features: 360/360 images",
    ]


def test_cache_key_follows_seed_classes_and_initial_weights(tmp_path):
    def path(backbone_seed=0, **kwargs):
        f = ExtractedFeatures(Digits(), digits_cnn(backbone_seed), cache_dir=str(tmp_path), **{**TINY, **kwargs})
        return f.cache_path(f.cache_key())

    base = path()
    assert path() == base
    assert len({base, path(seed=1), path(classes=[0, 1]), path(backbone_seed=1), path(lr=0.1)}) == 5
    assert path(standardize=False) == base  # applied after loading
    assert base.is_relative_to(tmp_path / "features")


def test_cache_key_follows_the_threads_that_train_the_extractor(tmp_path):
    """A CPU kernel adds its threads' partial sums in an order that depends on their number: the same extractor
    trained with 1 and with 2 threads gives other features (two trainings of Fashion-MNIST's under one key moved FMP
    0.44 pp, docs/results-fmp.md). A cache written with one count is not served to a run with another."""

    def path():
        f = ExtractedFeatures(Digits(), digits_cnn(), cache_dir=str(tmp_path), **TINY)
        return f.cache_path(f.cache_key())

    one = path()  # one thread (the autouse fixture)
    torch.set_num_threads(2)
    two = path()
    torch.set_num_threads(1)
    assert two != one and path() == one
    key = ExtractedFeatures(Digits(), digits_cnn(), cache_dir=str(tmp_path), **TINY).cache_key()
    assert key["environment"] == {
        "torch": torch.__version__,
        "device": "cpu",
        "cpu": torch.backends.cpu.get_cpu_capability(),
        "threads": 1,
    }


def test_checkpoint_replaces_training(trained, tmp_path, monkeypatch):
    features, _ = trained
    monkeypatch.setattr(ExtractedFeatures, "_train", lambda *a, **k: pytest.fail("should not train"))
    ckpt = features.info["cache_path"]  # a features file holds its extractor's weights
    loaded = ExtractedFeatures(Digits(), digits_cnn(5), checkpoint=ckpt, cache_dir=str(tmp_path), **TINY)
    assert torch.allclose(loaded.load("test").h, features.load("test").h, atol=1e-5)
    assert loaded.info["extractor_test_acc"] == features.info["extractor_test_acc"]
    capped = ExtractedFeatures(
        Digits(), digits_cnn(), checkpoint=ckpt, cache_dir=str(tmp_path), max_train_samples=100, **TINY
    )
    assert len(capped.load("train")) == 100 and len(capped.load("test")) == 360


def test_checkpoint_errors_name_the_path_and_the_keys(trained, tmp_path):
    features, _ = trained
    missing = tmp_path / "nope.pt"
    with pytest.raises(CheckpointError, match=f"checkpoint={missing} does not exist"):
        ExtractedFeatures(Digits(), digits_cnn(), checkpoint=str(missing), **TINY)
    narrow = ExtractedFeatures(
        Digits(), digits_cnn(), feature_dim=32, checkpoint=features.info["cache_path"], cache_dir=str(tmp_path)
    )
    with pytest.raises(CheckpointError, match=r"does not fit .*backbone\.proj\.0\.weight \(128, 128\) vs \(32, 128\)"):
        narrow.prepare()


def test_classifier_checkpoint_without_projection(tmp_path):
    # A pretrain_*.yaml run saves backbone.* and a frozen head without bias: usable with feature_dim null.
    model = Classifier(digits_cnn(3), num_classes=10)
    torch.save({"state_dict": model.state_dict()}, tmp_path / "last.ckpt")
    features = ExtractedFeatures(
        Digits(), digits_cnn(), feature_dim=None, checkpoint=str(tmp_path / "last.ckpt"), cache_dir=str(tmp_path)
    )
    assert features.load("train").h.shape == (1437, 128)
    assert features.info["extractor"].startswith("checkpoint") and features.info["extractor_test_acc"] is not None


def test_bad_arguments_are_gathered_into_one_message(tmp_path):
    with pytest.raises(ConfigError) as info:
        ExtractedFeatures(Digits(), SmallCNN(image_size=28), lr=0.0, optimizer="lbfgs", max_train_samples=0)
    msg = str(info.value)
    for part in ("data.features.backbone.image_size=28", "data.features.lr", "'lbfgs'", "max_train_samples"):
        assert part in msg
    untrained = ExtractedFeatures(Digits(), digits_cnn(), cache_dir=str(tmp_path), **TINY)
    with pytest.raises(CheckpointError, match="should have been prepared first"):
        untrained.prepare(allow_training=False)


def test_unreadable_cache_is_recomputed(trained, tmp_path, monkeypatch):
    features, _ = trained
    monkeypatch.setattr(ExtractedFeatures, "_train", lambda *a, **k: pytest.fail("should not train"))

    def build():
        return ExtractedFeatures(
            Digits(), digits_cnn(), checkpoint=features.info["cache_path"], cache_dir=str(tmp_path)
        )

    first = build()
    first.prepare()
    Path(first.info["cache_path"]).write_bytes(b"not a torch file")
    again = build()
    assert torch.equal(again.load("test").h, first.load("test").h) and not again.info["cached"]
    assert build().load("train") is not None and Path(first.info["cache_path"]).stat().st_size > 1000


def test_missing_data_set_propagates_its_own_error(tmp_path, monkeypatch):
    monkeypatch.setattr("lightning_fl.data.sources.system_data_dirs", lambda: [tmp_path / "system"])
    (tmp_path / "empty").mkdir()
    source = FashionMNIST(root=str(tmp_path / "empty"), download=False)
    source.system_paths = ()
    features = ExtractedFeatures(source, SmallCNN(image_size=28), cache_dir=str(tmp_path), **TINY)
    with pytest.raises(DatasetNotFoundError, match="Fashion-MNIST was not found"):
        features.prepare()
