"""The MNIST and CIFAR FMP configs run end to end when their data are on disk.

The data here are small fake files in the real on-disk layouts (IDX files, CIFAR python batches); the
extractor is shrunk (one epoch, a narrow ResNet) and so are the tasks, but the configs, sources, class
selection, feature cache, generator, meta-training and the one-shot test are the shipped ones.
"""

from __future__ import annotations

import pytest

from conftest import CONFIGS, FMP_SHRINK, capture_test_results, fake_cifar, fake_mnist_folder, run_cli

SMALL = [
    *FMP_SHRINK,
    "--data.num_clients",
    "2",
    "--data.points_per_client",
    "10",
    "--model.summariser.num_points",
    "5",
    "--data.features.init_args.epochs",
    "1",
    "--data.heldout_points",
    "40",
]
NARROW_RESNET = [
    "--data.features.init_args.backbone.init_args.width",
    "8",
    "--data.features.init_args.backbone.init_args.norm_groups",
    "4",
]


def mnist(root):
    fake_mnist_folder(root / "MNIST" / "raw", n_train=300, n_test=60)


def cifar10(root):
    names = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
    fake_cifar(root / "cifar-10-batches-py", names, b"labels", n=60)


def cifar100(root):  # the config keeps classes 0-19: a fifth of these images
    fake_cifar(root / "cifar-100-python", ["train"], b"fine_labels", n=1500, classes=100)
    fake_cifar(root / "cifar-100-python_test", ["test"], b"fine_labels", n=300, classes=100)
    (root / "cifar-100-python_test" / "test").rename(root / "cifar-100-python" / "test")


@pytest.mark.parametrize(
    ("name", "make", "extra", "classes"),
    [
        ("fmp_mnist", mnist, [], 10),
        ("fmp_cifar10", cifar10, NARROW_RESNET, 10),
        ("fmp_cifar100_20", cifar100, NARROW_RESNET, 20),
    ],
)
def test_fmp_vision_config_fits_and_tests_when_the_data_are_present(name, make, extra, classes, in_tmp, monkeypatch):
    monkeypatch.setenv("LIGHTNING_FL_CACHE", str(in_tmp / "cache"))
    make(in_tmp / "data")
    config = str(CONFIGS / f"{name}.yaml")
    args = ["--config", config, *SMALL, *extra, "--data.features.init_args.source.init_args.root", str(in_tmp / "data")]
    assert run_cli("fit", *args) == 0
    ckpt = in_tmp / f"runs/{name}/version_0/checkpoints/last.ckpt"
    captured = capture_test_results(monkeypatch)
    assert run_cli("test", *args, "--ckpt_path", str(ckpt)) == 0
    metrics = captured["out"][0]
    for key in ("test/acc", "test/ece", "test/mp/acc", "test/cann/acc", "comm/kb_per_client"):
        assert key in metrics
    assert 0.0 <= metrics["test/acc"] <= 1.0
    # s points of D + C floats each: CIFAR-100's classes 0-19 are relabelled to 20 classes.
    assert metrics["comm/kb_per_client"] == pytest.approx(5 * (128 + classes) * 4 / 1000)
