"""On-disk vision data sets: MNIST, Fashion-MNIST, CIFAR-10, CIFAR-100 and TinyImageNet.

Files are read by our own small readers (IDX, CIFAR's python batches through a restricted
unpickler that only rebuilds numpy arrays, TinyImageNet's folder layout), so a folder prepared by
hand, by torchvision, or by Debian's ``dataset-fashion-mnist`` package all work. torchvision is
only used to download.
"""

from __future__ import annotations

import gzip
import io
import pickle
from pathlib import Path
from typing import ClassVar

import numpy as np
import torch

from lightning_fl.data.sources import FileDataSource, LabeledImages, Split, TensorImages
from lightning_fl.errors import DatasetNotFoundError

# --------------------------------------------------------------------------------------------- IDX


def _open_maybe_gz(folder: Path, name: str) -> bytes | None:
    for candidate in (folder / name, folder / f"{name}.gz"):
        if candidate.is_file():
            data = candidate.read_bytes()
            return gzip.decompress(data) if candidate.suffix == ".gz" else data
    return None


def read_idx(data: bytes, source: str = "<bytes>") -> np.ndarray:
    """Parse an IDX file (the MNIST format): 2 zero bytes, dtype code, ndim, then big-endian dims."""
    if len(data) < 4 or data[0] != 0 or data[1] != 0:
        raise DatasetNotFoundError(f"{source} is not an IDX file (bad magic number); re-download it")
    dtypes = {0x08: np.uint8, 0x09: np.int8, 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}
    if data[2] not in dtypes:
        raise DatasetNotFoundError(f"{source} has unknown IDX type code {data[2]:#x}")
    ndim = data[3]
    dims = np.frombuffer(data, dtype=">u4", count=ndim, offset=4).astype(np.int64)
    dtype = np.dtype(dtypes[data[2]])
    expected = int(np.prod(dims)) * dtype.itemsize
    offset = 4 + 4 * ndim
    if len(data) - offset != expected:
        raise DatasetNotFoundError(
            f"{source} is truncated or corrupt: expected {expected} data bytes for shape {tuple(dims)}, "
            f"got {len(data) - offset}; re-download it"
        )
    return np.frombuffer(data, dtype=dtype, offset=offset).reshape(tuple(dims))


class _IDXSource(FileDataSource):
    """Shared reader for MNIST-format sets (28x28 grey images, 10 classes)."""

    num_classes = 10
    input_shape = (1, 28, 28)
    expected_files = (
        "train-images-idx3-ubyte, train-labels-idx1-ubyte, t10k-images-idx3-ubyte, t10k-labels-idx1-ubyte "
        "(optionally .gz)"
    )
    _files: ClassVar[dict[str, tuple[str, str]]] = {
        "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
        "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
    }
    _subdirs: tuple[str, ...] = ()
    _torchvision_class = ""

    def candidates(self, base: Path) -> list[Path]:
        return [base] + [base / s for s in self._subdirs]

    def is_complete(self, folder: Path) -> bool:
        names = [n for pair in self._files.values() for n in pair]
        return all((folder / n).is_file() or (folder / f"{n}.gz").is_file() for n in names)

    def read(self, folder: Path, split: Split) -> LabeledImages:
        img_name, lbl_name = self._files[split]
        images = read_idx(_open_maybe_gz(folder, img_name), str(folder / img_name))
        labels = read_idx(_open_maybe_gz(folder, lbl_name), str(folder / lbl_name))
        if images.ndim != 3 or len(images) != len(labels):
            raise DatasetNotFoundError(
                f"{folder}: {img_name} has shape {images.shape} and {lbl_name} {labels.shape}; expected "
                "(N, 28, 28) images and N labels"
            )
        return TensorImages(torch.from_numpy(images.copy()).unsqueeze(1), labels.astype(np.int64))

    def fetch(self, target: Path) -> None:
        import torchvision.datasets as tvd

        getattr(tvd, self._torchvision_class)(root=str(target), train=True, download=True)
        getattr(tvd, self._torchvision_class)(root=str(target), train=False, download=True)


class MNIST(_IDXSource):
    """MNIST handwritten digits (LeCun et al. 1998): 60k train / 10k test, 28x28 grey, 10 classes."""

    display_name = "MNIST"
    mean = (0.1307,)
    std = (0.3081,)
    _subdirs = ("mnist", "MNIST/raw")
    _torchvision_class = "MNIST"


class FashionMNIST(_IDXSource):
    """Fashion-MNIST (Xiao et al. 2017): 60k train / 10k test, 28x28 grey, 10 classes.

    Offline on Debian: ``apt-get install -y dataset-fashion-mnist`` puts the gzipped IDX files in
    ``/usr/share/datasets/fashion-mnist/``, which is searched automatically.
    """

    display_name = "Fashion-MNIST"
    mean = (0.2860,)
    std = (0.3530,)
    _subdirs = ("fashion-mnist", "fashion_mnist", "FashionMNIST/raw")
    _torchvision_class = "FashionMNIST"
    system_paths = ("/usr/share/datasets/fashion-mnist",)
    install_hints = (
        "apt-get install -y dataset-fashion-mnist   (Debian/Ubuntu; files land in /usr/share/datasets/fashion-mnist)",
    )


# ------------------------------------------------------------------------------------------- CIFAR


class _NumpyOnlyUnpickler(pickle.Unpickler):
    """Unpickler for CIFAR's python batches that refuses anything but numpy arrays and builtins."""

    _allowed: ClassVar[set[tuple[str, str]]] = {
        ("numpy.core.multiarray", "_reconstruct"),
        ("numpy._core.multiarray", "_reconstruct"),
        ("numpy", "ndarray"),
        ("numpy", "dtype"),
        ("numpy.core.multiarray", "scalar"),
        ("numpy._core.multiarray", "scalar"),
        ("_codecs", "encode"),
    }

    def find_class(self, module: str, name: str):
        if (module, name) not in self._allowed:
            raise pickle.UnpicklingError(f"refusing to load {module}.{name} from a CIFAR batch file")
        if module.startswith("numpy.core"):
            module = module.replace("numpy.core", "numpy._core", 1) if hasattr(np, "_core") else module
        return super().find_class(module, name)


def _load_cifar_batch(path: Path) -> dict:
    with path.open("rb") as f:
        try:
            return _NumpyOnlyUnpickler(io.BytesIO(f.read()), encoding="bytes").load()
        except Exception as err:
            raise DatasetNotFoundError(f"{path} could not be read as a CIFAR batch ({err}); re-download it") from err


class _CIFARSource(FileDataSource):
    input_shape = (3, 32, 32)
    crop_padding = 4
    hflip = True
    _folder = ""
    _batches: ClassVar[dict[str, tuple[str, ...]]] = {}
    _label_key = b"labels"
    _torchvision_class = ""

    @property
    def expected_files(self) -> str:  # type: ignore[override]
        names = ", ".join(n for b in self._batches.values() for n in b)
        return f"{self._folder}/{{{names}}}"

    def candidates(self, base: Path) -> list[Path]:
        return [base] if base.name == self._folder else [base / self._folder]

    def is_complete(self, folder: Path) -> bool:
        return all((folder / n).is_file() for b in self._batches.values() for n in b)

    def read(self, folder: Path, split: Split) -> LabeledImages:
        images, labels = [], []
        for name in self._batches[split]:
            batch = _load_cifar_batch(folder / name)
            data = np.asarray(batch[b"data"], dtype=np.uint8)
            images.append(data.reshape(-1, 3, 32, 32))
            labels.append(np.asarray(batch[self._label_key], dtype=np.int64))
        return TensorImages(torch.from_numpy(np.concatenate(images)), np.concatenate(labels))

    def fetch(self, target: Path) -> None:
        import torchvision.datasets as tvd

        getattr(tvd, self._torchvision_class)(root=str(target), train=True, download=True)


class CIFAR10(_CIFARSource):
    """CIFAR-10 (Krizhevsky 2009): 50k train / 10k test, 32x32 RGB, 10 classes; crop(pad 4) + flip."""

    display_name = "CIFAR-10"
    num_classes = 10
    mean = (0.4914, 0.4822, 0.4465)
    std = (0.2470, 0.2435, 0.2616)
    _folder = "cifar-10-batches-py"
    _batches: ClassVar[dict[str, tuple[str, ...]]] = {
        "train": tuple(f"data_batch_{i}" for i in range(1, 6)),
        "test": ("test_batch",),
    }
    _torchvision_class = "CIFAR10"


class CIFAR100(_CIFARSource):
    """CIFAR-100 (Krizhevsky 2009): 50k train / 10k test, 32x32 RGB, 100 fine classes; crop(pad 4) + flip."""

    display_name = "CIFAR-100"
    num_classes = 100
    mean = (0.5071, 0.4865, 0.4409)
    std = (0.2673, 0.2564, 0.2762)
    _folder = "cifar-100-python"
    _batches: ClassVar[dict[str, tuple[str, ...]]] = {"train": ("train",), "test": ("test",)}
    _label_key = b"fine_labels"
    _torchvision_class = "CIFAR100"


# ------------------------------------------------------------------------------------ TinyImageNet


class ImageFiles(LabeledImages):
    """A split read lazily from image files (decoded on access to uint8 ``(3, H, W)``)."""

    def __init__(self, paths: list[Path], targets: np.ndarray, size: int) -> None:
        self.paths = paths
        self.targets = np.asarray(targets, dtype=np.int64)
        self.size = size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        from PIL import Image

        with Image.open(self.paths[index]) as img:
            img = img.convert("RGB")
            if img.size != (self.size, self.size):
                img = img.resize((self.size, self.size))
            array = np.asarray(img, dtype=np.uint8)
        return torch.from_numpy(array.copy()).permute(2, 0, 1), int(self.targets[index])


class TinyImageNet(FileDataSource):
    """TinyImageNet (Le & Yang 2015): 100k train / 10k val, 64x64 RGB, 200 classes; crop(pad 4) + flip.

    Reads the standard ``tiny-imagenet-200`` layout: ``wnids.txt``, ``train/<wnid>/images/*.JPEG``,
    ``val/images/*.JPEG`` with ``val/val_annotations.txt``. The official test split has no labels, so
    our ``test`` split is the labelled validation folder, as in the FLITE paper.
    """

    display_name = "TinyImageNet"
    num_classes = 200
    input_shape = (3, 64, 64)
    mean = (0.4802, 0.4481, 0.3975)
    std = (0.2302, 0.2265, 0.2262)
    crop_padding = 4
    hflip = True
    expected_files = "tiny-imagenet-200/{wnids.txt, train/, val/images/, val/val_annotations.txt}"
    url = "http://cs231n.stanford.edu/tiny-imagenet-200.zip"

    def candidates(self, base: Path) -> list[Path]:
        return [base] if (base / "wnids.txt").is_file() else [base / "tiny-imagenet-200"]

    def is_complete(self, folder: Path) -> bool:
        return (
            (folder / "wnids.txt").is_file()
            and (folder / "train").is_dir()
            and (folder / "val" / "val_annotations.txt").is_file()
        )

    def read(self, folder: Path, split: Split) -> LabeledImages:
        wnids = [w.strip() for w in (folder / "wnids.txt").read_text().split() if w.strip()]
        index = {w: i for i, w in enumerate(wnids)}
        paths: list[Path] = []
        targets: list[int] = []
        if split == "train":
            for wnid in wnids:
                files = sorted((folder / "train" / wnid / "images").glob("*"))
                paths += files
                targets += [index[wnid]] * len(files)
        else:
            for line in (folder / "val" / "val_annotations.txt").read_text().splitlines():
                parts = line.split("\t")
                if len(parts) >= 2 and parts[1] in index:
                    paths.append(folder / "val" / "images" / parts[0])
                    targets.append(index[parts[1]])
        if not paths:
            raise DatasetNotFoundError(f"{folder}: no {split} images found in the tiny-imagenet-200 layout")
        return ImageFiles(paths, np.asarray(targets), size=64)

    def fetch(self, target: Path) -> None:
        from torchvision.datasets.utils import download_and_extract_archive

        download_and_extract_archive(self.url, download_root=str(target))
