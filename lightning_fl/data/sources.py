"""Data sources: labelled image sets with a train and a test split, found offline first.

A :class:`DataSource` is the plug-in a user subclasses to bring a new data set: it says how many
classes there are, the input shape, the normalisation constants and the augmentation the papers
use, and it loads each split as uint8 images. :class:`FileDataSource` adds the lookup every
on-disk data set shares: the ``root`` given, then well-known folders (``$LIGHTNING_FL_DATA``, the
cache, ``./data``, ``/usr/share/datasets``), then a download when online; when all fail,
:class:`~lightning_fl.errors.DatasetNotFoundError` names the paths tried, what each is, and the fixes.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

import numpy as np
import torch
from torch.utils.data import Dataset

from lightning_fl.errors import DatasetNotFoundError

Split = Literal["train", "test"]


class LabeledImages(Dataset):
    """Base for a split: ``images[i]`` is a uint8 tensor ``(C, H, W)`` and ``targets`` a numpy int64 array."""

    targets: np.ndarray

    def __len__(self) -> int:
        return len(self.targets)


class TensorImages(LabeledImages):
    """A split held in memory as one uint8 tensor ``(N, C, H, W)``."""

    def __init__(self, images: torch.Tensor, targets: np.ndarray | Sequence[int]) -> None:
        targets = np.asarray(targets, dtype=np.int64)
        if images.dtype != torch.uint8 or images.ndim != 4:
            raise ValueError(f"Expected uint8 images of shape (N, C, H, W), got {images.dtype} {tuple(images.shape)}")
        if len(images) != len(targets):
            raise ValueError(f"Expected as many targets as images, got {len(targets)} and {len(images)}")
        self.images = images
        self.targets = targets

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return self.images[index], int(self.targets[index])


class ImageTransform:
    """uint8 ``(C, H, W)`` -> normalised float32, with optional random crop (zero padding) and horizontal flip.

    Padding is applied in pixel space before normalisation, so padded pixels are black as in
    torchvision's ``RandomCrop(padding=...)`` on PIL images.
    """

    def __init__(self, mean: Sequence[float], std: Sequence[float], crop_padding: int = 0, hflip: bool = False) -> None:
        self.mean = torch.tensor(mean, dtype=torch.float32).view(-1, 1, 1)
        self.std = torch.tensor(std, dtype=torch.float32).view(-1, 1, 1)
        self.crop_padding = crop_padding
        self.hflip = hflip

    def __call__(self, image: torch.Tensor) -> torch.Tensor:
        return self.batch(image.unsqueeze(0))[0]  # (C, H, W)

    def batch(self, images: torch.Tensor) -> torch.Tensor:
        """uint8 ``(B, C, H, W)`` -> what calling the transform on each image in turn gives, stacked.

        Per image, in order, augmentation draws from the global generator: the crop offsets, then the flip; the
        arithmetic is done once for the whole batch. Calling the transform on one image is this with ``B = 1``.
        """
        x = images.to(torch.float32).div_(255.0)  # (B, C, H, W)
        if self.crop_padding > 0 or self.hflip:
            p = self.crop_padding
            h, w = x.shape[-2:]
            padded = torch.nn.functional.pad(x, (p, p, p, p)) if p > 0 else x
            out = torch.empty_like(x)
            for k in range(len(x)):
                image = x[k]
                if p > 0:
                    i, j = torch.randint(0, 2 * p + 1, (2,)).tolist()
                    image = padded[k, :, i : i + h, j : j + w]
                if self.hflip and torch.rand(()) < 0.5:
                    image = image.flip(-1)
                out[k] = image
            x = out
        return (x - self.mean) / self.std

    def __repr__(self) -> str:
        return f"ImageTransform(crop_padding={self.crop_padding}, hflip={self.hflip})"


class DataSource:
    """A labelled image data set with ``train`` and ``test`` splits.

    Subclasses set the class attributes and implement :meth:`load`; on-disk sets derive from
    :class:`FileDataSource` instead. Constructor arguments are config keys (``--data.source.root``).
    """

    _plugin_base = True  # not offered as a choice in CLI messages

    #: Human-readable name used in messages.
    display_name: str = "data set"
    #: Where the source sits in the config, for messages (``data.source``; FMP's feature pipelines set
    #: ``data.features.source``), so a suggested fix names the key that works for the config in use.
    config_key: str = "data.source"
    num_classes: int
    #: ``(channels, height, width)`` of one image.
    input_shape: tuple[int, int, int]
    mean: tuple[float, ...]
    std: tuple[float, ...]
    #: Training augmentation the papers use for this set: zero padding for a random crop, and horizontal flip.
    crop_padding: int = 0
    hflip: bool = False

    def prepare(self) -> None:
        """Make the files available (locate or download). Runs once per machine before :meth:`load`."""

    def load(self, split: Split) -> LabeledImages:
        """Return the split as uint8 images and integer targets."""
        raise NotImplementedError

    def transform(self, train: bool, augment: bool = True) -> ImageTransform:
        """Per-sample transform: augmentation (only for ``train`` with ``augment``) and normalisation."""
        aug = train and augment
        return ImageTransform(
            self.mean, self.std, crop_padding=self.crop_padding if aug else 0, hflip=self.hflip and aug
        )

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


def default_data_dir() -> Path:
    """Where downloads go when no ``root`` is given: ``$LIGHTNING_FL_DATA`` or ``~/.cache/lightning_fl/data``."""
    env = os.environ.get("LIGHTNING_FL_DATA")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "lightning_fl" / "data"


def system_data_dirs() -> list[Path]:
    """Well-known places a data set may already live, searched after the ``root`` given."""
    dirs = [
        default_data_dir(),
        Path.home() / ".cache" / "lightning_fl" / "data",
        Path.cwd() / "data",
        Path("/usr/share/datasets"),
    ]
    out: list[Path] = []
    for d in dirs:
        d = d.expanduser()
        if d not in out:
            out.append(d)
    return out


# Folders an administrator or a system package fills (``/usr/share/datasets``), as opposed to the user's own.
SYSTEM_ROOTS = (Path("/usr"), Path("/opt"), Path("/srv"), Path("/var"))


def place(folder: Path) -> str:
    """What a searched folder is, as the not-found message labels it: ``$LIGHTNING_FL_DATA``, the cache (where
    downloads go without it), the working directory, a system location (``/usr/share/...``), else a data folder."""
    folder = folder.expanduser()
    env = os.environ.get("LIGHTNING_FL_DATA")
    if env and folder.is_relative_to(Path(env).expanduser()):
        return "$LIGHTNING_FL_DATA"
    if folder.is_relative_to(Path.home() / ".cache"):
        return "cache"
    if folder.is_relative_to(Path.cwd() / "data"):
        return "working directory"
    if any(folder.is_relative_to(root) for root in SYSTEM_ROOTS):
        return "system location"
    return "working directory" if folder.is_relative_to(Path.cwd()) else "data folder"


class FileDataSource(DataSource):
    """A data set read from files: in ``root`` when one is given (only there), else well-known folders; then download.

    Subclasses implement :meth:`candidates` (folders under a base directory that may hold the
    files), :meth:`is_complete` (the folder holds every file needed), :meth:`read` and, when the
    set can be downloaded, :meth:`fetch`.

    Args:
        root: Folder holding the data set (or its parent). When given it is the only place searched (with
            download off it must exist) and downloads go there.
        download: Download into ``root`` (or ``$LIGHTNING_FL_DATA``, default ``~/.cache/lightning_fl/data``)
            when the files are not found locally.
    """

    _plugin_base = True  # not offered as a choice in CLI messages

    #: Folders outside any base dir to search, e.g. where a Debian package installs the files.
    system_paths: tuple[str, ...] = ()
    #: One line describing the files that must be present.
    expected_files: str = ""
    #: Extra ways to get the files, shown in the error message.
    install_hints: tuple[str, ...] = ()

    def __init__(self, root: str | None = None, download: bool = True) -> None:
        self.root = root
        self.download = download
        self._located: Path | None = None

    def candidates(self, base: Path) -> list[Path]:
        return [base]

    def is_complete(self, folder: Path) -> bool:
        raise NotImplementedError

    def read(self, folder: Path, split: Split) -> LabeledImages:
        raise NotImplementedError

    def fetch(self, target: Path) -> None:
        """Download the files into ``target``; raise on failure."""
        raise RuntimeError(f"{self.display_name} cannot be downloaded automatically")

    def search_paths(self) -> list[tuple[Path, str]]:
        """Every folder looked at, in order, with a note saying why."""
        out: list[tuple[Path, str]] = []
        if self.root is not None:  # an explicit root is authoritative: nothing else is searched
            out += [(p, "root given") for p in self.candidates(Path(self.root).expanduser())]
            return list(dict.fromkeys(out))
        out += [(Path(p), place(Path(p))) for p in self.system_paths]
        for base in system_data_dirs():
            out += [(p, place(base)) for p in self.candidates(base)]
        seen: set[Path] = set()
        unique = []
        for p, why in out:
            if p not in seen:
                seen.add(p)
                unique.append((p, why))
        return unique

    def locate(self, allow_download: bool | None = None) -> Path:
        """Return the folder holding the data set, downloading it if allowed; raise a clear error otherwise."""
        if self._located is not None:
            return self._located
        allow = self.download if allow_download is None else allow_download
        if self.root is not None and not allow and not Path(self.root).expanduser().is_dir():
            raise DatasetNotFoundError(
                f"{self.display_name}: the root given ({self.root}) does not exist and download is off; fix the "
                "path, or turn download on to fetch the data into it"
            )
        tried = self.search_paths()
        for folder, _ in tried:
            if self.is_complete(folder):
                self._located = folder
                return folder
        target = Path(self.root).expanduser() if self.root is not None else default_data_dir()
        if allow:
            try:
                self.fetch(target)
            except Exception as err:  # any network or archive failure becomes part of the message
                download_note = f"download into {target} failed: {type(err).__name__}: {err}"
            else:
                for folder in self.candidates(target):
                    if self.is_complete(folder):
                        self._located = folder
                        return folder
                download_note = f"download into {target} finished but the expected files are still missing"
        else:
            download_note = "download is off (download: false)"
        raise DatasetNotFoundError(self._not_found_message(tried, download_note, target))

    def _not_found_message(self, tried: list[tuple[Path, str]], download_note: str, target: Path) -> str:
        lines = [f"{self.display_name} was not found. Looked for {self.expected_files} in:"]
        lines += [f"  - {p} ({why})" for p, why in tried]
        lines.append(f"Download: {download_note}.")
        lines.append("Fix it with one of:")
        lines += [f"  - {hint}" for hint in self.install_hints]
        lines.append(f"  - put the files in a folder and pass it with --{self.config_key}.root DIR")
        lines.append(f"  - go online and keep --{self.config_key}.download true (files go to {target})")
        return "\n".join(lines)

    def prepare(self) -> None:
        self.locate()

    def load(self, split: Split) -> LabeledImages:
        if split not in ("train", "test"):
            raise ValueError(f"Expected split 'train' or 'test', got {split!r}")
        return self.read(self.locate(allow_download=False), split)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(root={self.root!r}, download={self.download})"
