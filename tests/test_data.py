import pickle
import struct

import numpy as np
import pytest
import torch

from conftest import fake_cifar, fake_mnist_folder
from lightning_fl.data import (
    CIFAR10,
    CIFAR100,
    IID,
    Digits,
    Dirichlet,
    FashionMNIST,
    FederatedDataModule,
    ImageTransform,
    Synthetic,
    TinyImageNet,
    read_idx,
)
from lightning_fl.errors import ConfigError, DatasetNotFoundError


@pytest.mark.parametrize("gz", [True, False])
def test_fashion_mnist_reads_idx_files_from_the_given_root(tmp_path, gz):
    train, labels = fake_mnist_folder(tmp_path / "fm", gz=gz)
    source = FashionMNIST(root=str(tmp_path / "fm"), download=False)
    split = source.load("train")
    assert split.images.shape == (40, 1, 28, 28) and split.images.dtype == torch.uint8
    assert np.array_equal(split.images[:, 0].numpy(), train) and np.array_equal(split.targets, labels)
    assert len(source.load("test")) == 20


def test_torchvision_layout_is_found_under_root(tmp_path):
    fake_mnist_folder(tmp_path / "FashionMNIST" / "raw")
    assert FashionMNIST(root=str(tmp_path), download=False).locate() == tmp_path / "FashionMNIST" / "raw"


def test_idx_reader_rejects_truncated_files():
    header = bytes([0, 0, 0x08, 1]) + struct.pack(">I", 10)
    assert read_idx(header + bytes(10)).shape == (10,)
    with pytest.raises(DatasetNotFoundError, match="truncated"):
        read_idx(header + bytes(9), "x.idx")
    with pytest.raises(DatasetNotFoundError, match="not an IDX"):
        read_idx(b"\x01\x02\x03\x04")


def test_missing_data_set_error_names_paths_and_fixes(in_tmp, monkeypatch):
    monkeypatch.setattr("lightning_fl.data.sources.system_data_dirs", lambda: [in_tmp / "system"])
    monkeypatch.setattr(FashionMNIST, "system_paths", (str(in_tmp / "not-installed"),))
    with pytest.raises(DatasetNotFoundError) as info:
        FashionMNIST(download=False).prepare()
    msg = str(info.value)
    assert "Fashion-MNIST was not found" in msg
    assert str(in_tmp / "system") in msg and str(in_tmp / "not-installed") in msg
    assert "apt-get install -y dataset-fashion-mnist" in msg
    assert "--data.source.root" in msg and "download is off" in msg
    (in_tmp / "empty").mkdir()  # a root given is the only place searched, and the only one named
    with pytest.raises(DatasetNotFoundError) as info:
        FashionMNIST(root=str(in_tmp / "empty"), download=False).prepare()
    assert f"{in_tmp / 'empty'} (root given)" in str(info.value) and "not-installed" not in str(info.value)


def test_the_not_found_message_says_what_each_folder_searched_is(in_tmp, monkeypatch):
    """CIFAR-10 not found (download off): each folder searched is labelled for what it is; only a folder under /usr
    is a system location (the cache and ./data were labelled so too)."""
    home = in_tmp / "home"
    monkeypatch.setenv("HOME", str(home))  # (Path.home())
    fake_cifar(in_tmp / "data" / "cifar-10-batches-py", ["data_batch_1"], b"labels")  # ./data holds one batch of six
    with pytest.raises(DatasetNotFoundError) as info:
        CIFAR10(download=False).prepare()
    msg = str(info.value)
    assert msg.startswith("CIFAR-10 was not found. Looked for cifar-10-batches-py/{data_batch_1, ")
    folder = "cifar-10-batches-py"
    assert f"\n  - {in_tmp / 'cache' / folder} ($LIGHTNING_FL_DATA)\n" in msg  # (in_tmp sets it)
    assert f"\n  - {home / '.cache' / 'lightning_fl' / 'data' / folder} (cache)\n" in msg
    assert f"\n  - {in_tmp / 'data' / folder} (working directory)\n" in msg
    assert f"\n  - /usr/share/datasets/{folder} (system location)\n" in msg and msg.count("(system location)") == 1
    monkeypatch.delenv("LIGHTNING_FL_DATA")  # downloads then go to the cache, listed once
    with pytest.raises(DatasetNotFoundError) as info:
        CIFAR10(download=False).prepare()
    assert str(info.value).count(f"{home / '.cache' / 'lightning_fl' / 'data' / folder} (cache)\n") == 1


def test_failed_download_is_reported(in_tmp, monkeypatch):
    def offline(self, target):
        raise OSError("Name or service not known")

    monkeypatch.setattr(CIFAR10, "fetch", offline)
    with pytest.raises(DatasetNotFoundError, match=r"download into .* failed: OSError: Name or service not known"):
        CIFAR10(root=str(in_tmp / "c10")).prepare()


def test_cifar10_and_cifar100_read_python_batches(tmp_path):
    fake_cifar(tmp_path / "cifar-10-batches-py", [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"], b"labels")
    c10 = CIFAR10(root=str(tmp_path), download=False)
    train = c10.load("train")
    assert train.images.shape == (100, 3, 32, 32) and len(c10.load("test")) == 20
    fake_cifar(tmp_path / "cifar-100-python", ["train", "test"], b"fine_labels", classes=100)
    assert len(CIFAR100(root=str(tmp_path), download=False).load("train")) == 20


def test_cifar_reader_refuses_pickled_code(tmp_path):
    folder = tmp_path / "cifar-100-python"
    folder.mkdir()

    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    for name in ("train", "test"):
        (folder / name).write_bytes(pickle.dumps({b"data": Evil()}))
    with pytest.raises(DatasetNotFoundError, match="refusing to load builtins.print"):
        CIFAR100(root=str(tmp_path), download=False).load("train")


def test_tinyimagenet_folder_layout(tmp_path):
    from PIL import Image

    root = tmp_path / "tiny-imagenet-200"
    wnids = ["n01", "n02"]
    (root / "val" / "images").mkdir(parents=True)
    (root / "wnids.txt").write_text("\n".join(wnids))
    lines = []
    for k, w in enumerate(wnids):
        (root / "train" / w / "images").mkdir(parents=True)
        for i in range(3):
            Image.new("RGB", (64, 64), (k * 100, i, 0)).save(root / "train" / w / "images" / f"{w}_{i}.JPEG")
        Image.new("RGB", (64, 64), (k * 100, 0, 0)).save(root / "val" / "images" / f"val_{k}.JPEG")
        lines.append(f"val_{k}.JPEG\t{w}\t0\t0\t63\t63")
    (root / "val" / "val_annotations.txt").write_text("\n".join(lines))
    source = TinyImageNet(root=str(tmp_path), download=False)
    train, test = source.load("train"), source.load("test")
    assert len(train) == 6 and train.targets.tolist() == [0, 0, 0, 1, 1, 1]
    image, label = test[1]
    assert image.shape == (3, 64, 64) and image.dtype == torch.uint8 and label == 1


def test_digits_split_is_fixed_and_stratified():
    a, b = Digits().load("train"), Digits().load("train")
    assert torch.equal(a.images, b.images) and len(a) + len(Digits().load("test")) == 1797
    assert a.images.shape[1:] == (1, 8, 8) and int(a.images.max()) == 255
    counts = np.bincount(Digits().load("test").targets)
    assert counts.min() >= 34 and counts.max() <= 37


@pytest.mark.parametrize("source", [Digits(), pytest.param(FashionMNIST(download=False), id="fashion")])
def test_normalisation_constants_match_the_training_split(source):
    try:
        images = source.load("train").images.float() / 255
    except DatasetNotFoundError:
        pytest.skip("Fashion-MNIST is not installed (apt-get install -y dataset-fashion-mnist)")
    assert abs(images.mean().item() - source.mean[0]) < 1e-3
    assert abs(images.std().item() - source.std[0]) < 1e-3


def test_cifar_transform_crops_with_padding_and_flips():
    source = CIFAR10(download=False)
    train_tf, test_tf = source.transform(train=True), source.transform(train=False)
    assert train_tf.crop_padding == 4 and train_tf.hflip and test_tf.crop_padding == 0 and not test_tf.hflip
    image = torch.full((3, 32, 32), 255, dtype=torch.uint8)
    torch.manual_seed(0)
    outs = [train_tf(image) for _ in range(20)]
    assert all(o.shape == (3, 32, 32) for o in outs)
    white = (1 - torch.tensor(source.mean)) / torch.tensor(source.std)
    black = -torch.tensor(source.mean) / torch.tensor(source.std)
    # some crops show the zero padding (black) at a border; the untouched test transform never does
    assert any(torch.isclose(o[:, 0, 0], black).all() or torch.isclose(o[:, -1, -1], black).all() for o in outs)
    torch.testing.assert_close(test_tf(image)[:, 0, 0], white)
    assert source.transform(train=True, augment=False).crop_padding == 0


def test_image_transform_flip_is_a_mirror():
    tf = ImageTransform((0.0,), (1.0,), hflip=True)
    image = torch.arange(16, dtype=torch.uint8).view(1, 4, 4)
    seen = {tuple(round(v * 255) for v in tf(image)[0, 0].tolist()) for _ in range(50)}
    assert seen == {(0, 1, 2, 3), (3, 2, 1, 0)}


def make_dm(**kwargs) -> FederatedDataModule:
    defaults = {"source": Synthetic(train_size=600, test_size=100), "num_clients": 5, "batch_size": 32}
    dm = FederatedDataModule(**{**defaults, **kwargs})
    dm.prepare_data()
    dm.setup("fit")
    return dm


def test_datamodule_splits_are_disjoint_and_cover_the_training_set():
    dm = make_dm(public_fraction=0.2, val_fraction=0.1, partition=Dirichlet(alpha=0.5))
    clients = [dm.client_indices(c) for c in range(5)]
    parts = [dm.split_indices("val"), dm.split_indices("public"), *clients]
    everything = np.concatenate(parts)
    assert len(everything) == len(np.unique(everything)) == 600
    assert len(dm.split_indices("val")) == 60 and len(dm.split_indices("public")) == 120
    assert sum(dm.client_num_samples(c) for c in range(5)) == 420
    assert dm.label_histograms().sum() == 420 and dm.label_histograms().shape == (5, 10)
    table = dm.partition_table()
    assert (
        "Dirichlet(alpha=0.5" in table and "val: 60, public: 120" in table and table.count("\n| ") == 7
    )  # header, separator, 5 clients


def test_a_large_population_logs_a_summary_of_its_partition_not_a_row_per_client():
    dm = make_dm(num_clients=150)
    table = dm.partition_table()
    assert table.startswith("IID() over 150 clients") and table.count("\n| ") == 7  # 2 tables: 4 + 3 lines
    assert "| samples | 4 | 4 | 4 | 4 | 4 |" in table  # 600 samples dealt to 150 clients: 4 each
    assert "| samples | " + " | ".join(["60"] * 10) + " |" in table  # Synthetic is balanced: 60 per class
    assert make_dm(num_clients=150).partition_table(max_rows=150).count("\n| ") == 152  # header, separator, rows
    assert dm.client_sizes().tolist() == [4] * 150


def test_datamodule_is_deterministic_and_the_public_split_ignores_the_partition():
    a = make_dm(public_fraction=0.25, partition=IID())
    b = make_dm(public_fraction=0.25, partition=Dirichlet(alpha=0.1))
    assert np.array_equal(a.split_indices("public"), b.split_indices("public"))
    assert np.array_equal(a.split_indices("clients"), b.split_indices("clients"))
    c = make_dm(public_fraction=0.25, partition=IID())
    assert all(np.array_equal(a.client_indices(k), c.client_indices(k)) for k in range(5))


def test_loaders_serve_the_right_splits():
    dm = make_dm(public_fraction=0.2, train_split="public")
    assert len(dm.train_dataloader().dataset) == 120
    pooled = make_dm(public_fraction=0.2)
    assert len(pooled.train_dataloader().dataset) == 480
    x, y = next(iter(dm.client_dataloader(2, seed=1)))
    assert x.dtype == torch.float32 and x.shape[1:] == (1, 8, 8) and len(y) <= 32
    first = [b[1].tolist() for b in dm.client_dataloader(2, seed=7)]
    assert first == [b[1].tolist() for b in dm.client_dataloader(2, seed=7)]
    assert len(dm.val_dataloader().dataset) == len(dm.test_dataloader().dataset) == 100  # no val split: test set
    assert len(make_dm(val_fraction=0.1).val_dataloader().dataset) == 60


class AugmentedSynthetic(Synthetic):
    crop_padding = 2
    hflip = True


class PerSample(torch.utils.data.Dataset):
    """A dataset's samples one call each (no ``__getitems__``): what a ``DataLoader`` does without batched reads."""

    def __init__(self, dataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int):
        return self.dataset[i]


@pytest.mark.parametrize("augment", [False, True])
@pytest.mark.parametrize("batch_size", [24, 32, 7, 150])  # 120 samples: a batch size that divides it, two not, one over
def test_in_memory_client_batches_equal_the_data_loader(augment, batch_size):
    """Same batches, same draws from the loader's generator and from the global one (augmentation), over two
    epochs with global draws between batches (as dropout makes)."""
    from torch.utils.data import DataLoader

    from lightning_fl.data.datamodule import InMemoryBatches, TransformedSubset

    source = AugmentedSynthetic(train_size=600, test_size=100)
    dm = make_dm(source=source, batch_size=batch_size, augment=augment)
    fast = dm.client_dataloader(3, seed=11)
    assert dm.client_num_samples(3) == 120
    assert isinstance(fast, InMemoryBatches) and len(fast) == -(-120 // batch_size)
    subset = PerSample(
        TransformedSubset(dm._train, dm.client_indices(3), source.transform(train=True, augment=augment))
    )
    generator = torch.Generator().manual_seed(11)
    slow = DataLoader(subset, batch_size=batch_size, shuffle=True, generator=generator)

    def epochs(loader):
        torch.manual_seed(5)
        out = []
        for _ in range(2):
            for x, y in loader:
                out.append((x, y))
                torch.rand(3)  # the model's own draws between batches
        return out, torch.rand(2)

    (want, want_next), (got, got_next) = epochs(slow), epochs(fast)
    assert len(got) == len(want) == 2 * len(fast)
    for (x1, y1), (x2, y2) in zip(got, want, strict=True):
        assert x1.dtype == x2.dtype and y1.dtype == y2.dtype and torch.equal(y1, y2) and torch.equal(x1, x2)
    assert torch.equal(got_next, want_next)  # the global generator ends where the loader leaves it
    assert torch.equal(fast.generator.get_state(), generator.get_state())
    if augment:  # the augmentation really draws: another seed gives other images for the same labels
        torch.manual_seed(6)
        assert not torch.equal(next(iter(dm.client_dataloader(3, seed=11)))[0], want[0][0])


def test_loaders_with_workers_or_without_a_seed_stay_data_loaders():
    from torch.utils.data import DataLoader

    assert isinstance(make_dm(num_workers=1).client_dataloader(0, seed=1), DataLoader)
    assert isinstance(make_dm().client_dataloader(0), DataLoader)


def test_max_samples_shrink_the_run():
    dm = make_dm(max_train_samples=100, max_eval_samples=30)
    assert len(dm.split_indices("clients")) == 100 and len(dm.test_dataloader().dataset) == 30


def test_datamodule_rejects_bad_settings_with_the_key_names():
    with pytest.raises(ConfigError, match="data.train_split is 'public' but data.public_fraction is 0"):
        FederatedDataModule(Synthetic(), train_split="public")
    with pytest.raises(ConfigError, match=r"data.public_fraction \+ data.val_fraction"):
        FederatedDataModule(Synthetic(), public_fraction=0.6, val_fraction=0.5)
    with pytest.raises(ConfigError, match="left for 500 clients"):
        make_dm(num_clients=500, max_train_samples=100)
    with pytest.raises(IndexError, match=r"client id in \[0, 5\)"):
        make_dm().client_indices(5)


def test_synthetic_images_are_the_same_whatever_the_generation_chunk():
    """Population-scale runs generate millions of images a chunk at a time; the draws must not depend on it."""
    whole, chunked = Synthetic(train_size=50, test_size=9, seed=3), Synthetic(train_size=50, test_size=9, seed=3)
    chunked.chunk = 7
    for split in ("train", "test"):
        assert torch.equal(whole.load(split).images, chunked.load(split).images)
        assert np.array_equal(whole.load(split).targets, chunked.load(split).targets)


def test_public_samples_shrinks_only_the_pretraining_split():
    """Bases of graded strength over the same clients: the first N of the shuffled public split; nothing else moves."""
    whole = make_dm(public_fraction=0.2, train_split="public")
    small = make_dm(public_fraction=0.2, train_split="public", public_samples=7)
    public = whole.split_indices("public")
    assert len(small.split_indices("public")) == 7 and set(small.split_indices("public")) <= set(public)
    order = np.random.default_rng(0).permutation(len(whole._train))
    assert np.array_equal(small.split_indices("public"), np.sort(order[: round(0.2 * len(order))][:7]))
    for part in ("clients", "test"):
        assert np.array_equal(small.split_indices(part), whole.split_indices(part))
    assert [small.client_indices(k).tolist() for k in range(5)] == [whole.client_indices(k).tolist() for k in range(5)]
    assert len(small.train_dataloader().dataset) == 7
    # the rest of the public split is held out: public, yet neither pretraining nor any client reads it
    held_out = small.split_indices("public_held_out")
    assert np.array_equal(np.sort(np.concatenate([small.split_indices("public"), held_out])), public)
    assert not set(held_out) & set(small.split_indices("clients")) and len(whole.split_indices("public_held_out")) == 0
    # the pretrained base's cache key sees it; an unset value leaves older keys as they were
    assert small.describe()["public_samples"] == 7 and "public_samples" not in whole.describe()
    with pytest.raises(ConfigError, match="data.public_samples is 1000 but the public split holds"):
        make_dm(public_fraction=0.2, public_samples=1000).setup()
    with pytest.raises(ConfigError, match="data.public_samples must be >= 1"):
        make_dm(public_fraction=0.2, public_samples=0)


@pytest.mark.parametrize("augment", [False, True])
def test_a_loaders_batch_is_read_and_transformed_at_once_with_the_per_sample_values_and_draws(augment, monkeypatch):
    """``DataLoader(TransformedSubset)`` of a split in memory transforms each batch in one call, and gives the
    batches, labels and global draws (augmentation) of a sample-by-sample read; a transform of another kind and a
    split not in memory are read sample by sample."""
    from torch.utils.data import DataLoader

    from lightning_fl.data.datamodule import TransformedSubset
    from lightning_fl.data.sources import ImageTransform, LabeledImages

    source = AugmentedSynthetic(train_size=300, test_size=100)
    dm = make_dm(source=source, batch_size=16, augment=augment)
    indices = dm.split_indices("clients")[:70]
    transform = source.transform(train=True, augment=augment)
    calls = []
    batch = ImageTransform.batch
    monkeypatch.setattr(ImageTransform, "batch", lambda self, images: calls.append(len(images)) or batch(self, images))

    def read(dataset):
        torch.manual_seed(3)
        return list(DataLoader(dataset, batch_size=16)), torch.rand(2)

    (got, got_next), (want, want_next) = (
        read(TransformedSubset(dm._train, indices, transform)),
        read(PerSample(TransformedSubset(dm._train, indices, transform))),
    )
    assert calls == [16, 16, 16, 16, 6] + [1] * 70  # 5 batches at once, then the 70 images one by one
    assert len(got) == len(want) == 5 and torch.equal(got_next, want_next)
    for (x1, y1), (x2, y2) in zip(got, want, strict=True):
        assert x1.dtype == x2.dtype == torch.float32 and torch.equal(x1, x2) and torch.equal(y1, y2)

    class Other(ImageTransform):
        """A transform of another kind (a subclass may redefine one image's): read sample by sample."""

    class NotInMemory(LabeledImages):
        def __init__(self, images):
            self.images = images

        def __len__(self):
            return len(self.images)

        def __getitem__(self, i):
            return self.images[i]

    for subset in (
        TransformedSubset(
            dm._train, indices, Other(transform.mean.flatten().tolist(), transform.std.flatten().tolist())
        ),
        TransformedSubset(NotInMemory(dm._train), indices, transform),
    ):
        calls.clear()
        assert len(list(DataLoader(subset, batch_size=16))) == 5 and calls == [1] * 70
