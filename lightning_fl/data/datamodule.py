"""The federated data module: one training set split into a public part, a validation part and clients.

Kept as one file: it is one class, :class:`FederatedDataModule`, whose splits (public, validation, clients),
partition and loaders all read the indices its ``setup`` draws; the two datasets beside it
(:class:`TransformedSubset`, :class:`InMemoryBatches`) are what those loaders serve.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Literal

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from lightning_fl.data.partition import IID, ClientPartition, Partitioner, label_histograms
from lightning_fl.data.sources import DataSource, ImageTransform, LabeledImages, TensorImages
from lightning_fl.errors import ConfigError
from lightning_fl.trainer_api import lazy_instance


class TransformedSubset(Dataset):
    """``base[indices[i]]`` with a per-sample transform applied to the image.

    A ``DataLoader`` asks for a batch's samples at once (:meth:`__getitems__`): from a split held in memory and with
    exactly our transform, they are gathered and transformed as one batch, with the values and global draws of the
    per-sample path (:meth:`ImageTransform.batch`). An evaluation then makes a few tensor operations per batch, not
    a few per image.
    """

    def __init__(self, base: LabeledImages, indices: np.ndarray, transform: ImageTransform) -> None:
        self.base = base
        self.indices = np.asarray(indices, dtype=np.int64)
        self.transform = transform

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        image, label = self.base[int(self.indices[i])]
        return self.transform(image), label

    def __getitems__(self, batch: list[int]) -> list[tuple[torch.Tensor, int]]:
        """The samples at positions ``batch``, as ``[self[i] for i in batch]`` gives them."""
        # Exactly our transform: a subclass may redefine what it does to one image.
        if not isinstance(self.base, TensorImages) or type(self.transform) is not ImageTransform:
            return [self[i] for i in batch]
        picked = torch.from_numpy(self.indices[np.asarray(batch, dtype=np.int64)])
        images = self.transform.batch(self.base.images.index_select(0, picked))
        return list(zip(images.unbind(0), self.base.targets[picked.numpy()].tolist(), strict=True))


class InMemoryBatches:
    """A client's shuffled training batches, sliced from an in-memory split and transformed a batch at a time.

    Yields what ``DataLoader(TransformedSubset(images, indices, transform), batch_size, shuffle=True,
    generator=generator)`` yields, value for value: it draws from ``generator`` what the loader draws (its
    workers' base seed, then a permutation per epoch, and the permutation its sampler draws as it runs out),
    and from the global generator what the per-sample transform draws, in the same order
    (:meth:`ImageTransform.batch`). It only skips the Python call per sample that a loader makes.

    What that buys (``python benchmarks/in_memory_batches.py --workload quickstart --round``, docs/results-systems.md,
    "Per-client overhead and start-up"): a client's batches in 0.08 ms instead of 1.1-1.3 ms for 64 8x8 images,
    1.07-1.20x a federated round of such clients (medians of two runs), but 1.02-1.04x where a client trains for
    tens of milliseconds or more (``--workload cross_device``, and Fashion-MNIST's clients of 6,750 images, the
    default workload). ``tests/test_data.py`` checks it against the DataLoader itself, so a torch release that draws
    differently fails there.
    """

    def __init__(
        self,
        images: TensorImages,
        indices: np.ndarray,
        transform: ImageTransform,
        batch_size: int,
        generator: torch.Generator,
    ) -> None:
        self.images = images.images
        self.positions = torch.tensor(np.asarray(indices, dtype=np.int64))  # a copy: partitions are read-only
        self.targets = torch.from_numpy(np.asarray(images.targets, dtype=np.int64))
        self.transform, self.batch_size, self.generator = transform, batch_size, generator

    def __len__(self) -> int:
        return -(-len(self.positions) // self.batch_size)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        n = len(self.positions)
        torch.empty((), dtype=torch.int64).random_(generator=self.generator)  # the loader's base seed
        order = torch.randperm(n, generator=self.generator)
        for start in range(0, n, self.batch_size):
            if start + self.batch_size >= n:
                torch.randperm(n, generator=self.generator)  # the sampler's next (unused) permutation
            picked = self.positions.index_select(0, order[start : start + self.batch_size])
            # index_select: the rows advanced indexing would give, without its general machinery (5x faster here)
            yield self.transform.batch(self.images.index_select(0, picked)), self.targets.index_select(0, picked)


def partition_summary(hist: np.ndarray) -> str:
    """Markdown summary of a partition's ``(num_clients, num_classes)`` label histogram: quantiles over clients
    of their sizes and of the classes they hold, and every class's total."""
    q = (0.0, 0.1, 0.5, 0.9, 1.0)
    rows = ["| per client | min | 10% | median | 90% | max |", "| --- | --- | --- | --- | --- | --- |"]
    for name, values in (("samples", hist.sum(1)), ("classes held", (hist > 0).sum(1))):
        rows.append(f"| {name} | " + " | ".join(f"{v:g}" for v in np.quantile(values, q)) + " |")
    totals = hist.sum(0)
    rows += ["", "| class | " + " | ".join(map(str, range(len(totals)))) + " |", "|" + " --- |" * (len(totals) + 1)]
    rows.append("| samples | " + " | ".join(map(str, totals)) + " |")
    return "\n".join(rows)


class FederatedDataModule(L.LightningDataModule):
    """A data source split for federated and centralised training.

    The training split is shuffled once with ``seed`` and cut, in order, into a validation part
    (``val_fraction``), a public part (``public_fraction``, for centralised pretraining disjoint from
    the clients) and the client pool, which ``partition`` divides among ``num_clients`` clients.
    The same ``seed``, fractions and partition always give the same split, so a pretraining run on
    ``train_split: public`` and a federated run on the clients never share a sample.

    Args:
        source: The data set (``FashionMNIST``, ``CIFAR10``, ``Digits``, ...).
        num_clients: Number of clients the client pool is divided among.
        partition: How the client pool is divided (``IID``, ``Dirichlet``, ``Shards``).
        public_fraction: Share of the training split held out as the public (server-side) split.
        public_samples: Pretrain on only the first this many samples of the public split (a seeded random
            subset; the rest, ``split_indices("public_held_out")``, is used by no run, the client pool is
            unchanged): bases of graded strength over the same clients. ``None`` = the whole public split.
        val_fraction: Share of the training split held out for validation. With 0, ``val_dataloader``
            serves the test split, which is how the papers report accuracy per epoch/round.
        train_split: What ``train_dataloader`` (centralised training) serves: ``clients`` = the pooled
            client data, ``public`` = the public split.
        batch_size: Training batch size (centralised and per client).
        eval_batch_size: Batch size for validation and test.
        num_workers: DataLoader worker processes.
        augment: Apply the data set's standard training augmentation (e.g. crop + flip on CIFAR).
        max_train_samples: Use only this many training samples (a seeded random subset) for quick runs.
        max_eval_samples: Use only this many test (and validation) samples for quick runs.
        seed: Seed of the split and the partition.
    """

    def __init__(
        self,
        source: DataSource,
        num_clients: int = 8,
        partition: Partitioner = lazy_instance(IID),
        public_fraction: float = 0.0,
        public_samples: int | None = None,
        val_fraction: float = 0.0,
        train_split: Literal["clients", "public"] = "clients",
        batch_size: int = 128,
        eval_batch_size: int = 512,
        num_workers: int = 0,
        augment: bool = True,
        max_train_samples: int | None = None,
        max_eval_samples: int | None = None,
        seed: int = 0,
    ) -> None:
        super().__init__()
        problems = []
        if num_clients < 1:
            problems.append(f"data.num_clients must be >= 1, got {num_clients}")
        for key, value in (("public_fraction", public_fraction), ("val_fraction", val_fraction)):
            if not 0.0 <= value < 1.0:
                problems.append(f"data.{key} must be in [0, 1), got {value}")
        if public_fraction + val_fraction >= 1.0:
            problems.append(
                f"data.public_fraction + data.val_fraction must leave data for the clients, got "
                f"{public_fraction} + {val_fraction}"
            )
        if train_split == "public" and public_fraction == 0:
            problems.append(
                "data.train_split is 'public' but data.public_fraction is 0; set e.g. --data.public_fraction 0.2"
            )
        if batch_size < 1 or eval_batch_size < 1:
            problems.append(
                f"data.batch_size and data.eval_batch_size must be >= 1, got {batch_size}, {eval_batch_size}"
            )
        if num_workers < 0:
            problems.append(f"data.num_workers must be >= 0, got {num_workers}")
        for key, value in (
            ("max_train_samples", max_train_samples),
            ("max_eval_samples", max_eval_samples),
            ("public_samples", public_samples),
        ):
            if value is not None and value < 1:
                problems.append(f"data.{key} must be >= 1 or null, got {value}")
        if problems:
            raise ConfigError("; ".join(problems))
        self.source = source
        self.num_clients = num_clients
        self.partition = partition
        self.public_fraction = public_fraction
        self.public_samples = public_samples
        self.val_fraction = val_fraction
        self.train_split = train_split
        self.batch_size = batch_size
        self.eval_batch_size = eval_batch_size
        self.num_workers = num_workers
        self.augment = augment
        self.max_train_samples = max_train_samples
        self.max_eval_samples = max_eval_samples
        self.seed = seed
        self._train: LabeledImages | None = None
        self._test: LabeledImages | None = None
        self._splits: dict[str, np.ndarray] = {}
        self._clients: ClientPartition | None = None
        self._client_transform: ImageTransform | None = None

    # ------------------------------------------------------------------------------ properties
    @property
    def num_classes(self) -> int:
        return self.source.num_classes

    @property
    def input_shape(self) -> tuple[int, int, int]:
        return tuple(self.source.input_shape)

    def describe(self) -> dict[str, object]:
        """Everything that determines the centralised training data and its batches (cache keys use it)."""
        return {
            "source": repr(self.source),
            "seed": self.seed,
            "public_fraction": self.public_fraction,
            "val_fraction": self.val_fraction,
            "train_split": self.train_split,
            "max_train_samples": self.max_train_samples,
            "batch_size": self.batch_size,
            "augment": self.augment,
            # only when set: a key without it names a base pretrained on the whole public fraction
            **({"public_samples": self.public_samples} if self.public_samples is not None else {}),
        }

    # ------------------------------------------------------------------------------ set-up
    def prepare_data(self) -> None:
        self.source.prepare()

    def setup(self, stage: str | None = None) -> None:
        if self._train is not None:
            return
        train, test = self.source.load("train"), self.source.load("test")
        rng = np.random.default_rng(self.seed)
        order = rng.permutation(len(train))
        if self.max_train_samples is not None:
            order = order[: self.max_train_samples]
        n = len(order)
        n_val, n_public = round(self.val_fraction * n), round(self.public_fraction * n)
        if n - n_val - n_public < self.num_clients:
            raise ConfigError(
                f"Only {n - n_val - n_public} training samples are left for {self.num_clients} clients after "
                f"val_fraction={self.val_fraction} and public_fraction={self.public_fraction}; lower data.num_clients "
                "or the fractions, or raise data.max_train_samples"
            )
        val, public, pool = np.split(order, [n_val, n_val + n_public])
        held_out = public[len(public) :]
        if self.public_samples is not None:
            if self.public_samples > len(public):
                raise ConfigError(
                    f"data.public_samples is {self.public_samples} but the public split holds {len(public)} samples "
                    "(data.public_fraction of the training split); lower data.public_samples or raise "
                    "data.public_fraction"
                )
            public, held_out = public[: self.public_samples], public[self.public_samples :]
        test_idx = np.arange(len(test))
        if self.max_eval_samples is not None and self.max_eval_samples < len(test):
            test_idx = np.sort(np.random.default_rng(self.seed + 1).permutation(len(test))[: self.max_eval_samples])
            val = val[: self.max_eval_samples]
        parts = self.partition(train.targets[pool], self.num_clients, self.seed)
        self._clients = parts.take(pool)  # flat: two arrays, however many clients
        self._splits = {"val": np.sort(val), "public": np.sort(public), "clients": np.sort(pool), "test": test_idx}
        self._splits["public_held_out"] = np.sort(held_out)  # public, yet no pretraining saw it
        self._train, self._test = train, test
        self._log_partition()

    def _log_partition(self) -> None:
        """Write the split sizes and per-client label histograms to the trainer's TensorBoard, if any."""
        trainer = getattr(self, "trainer", None)
        if trainer is None or not getattr(trainer, "is_global_zero", True):
            return
        for logger in getattr(trainer, "loggers", []):
            experiment = getattr(logger, "experiment", None)
            if hasattr(experiment, "add_text"):
                experiment.add_text("data/partition", self.partition_table())

    def _require_setup(self) -> None:
        if self._train is None:
            self.setup()

    # ------------------------------------------------------------------------------ indices and stats
    def split_indices(self, name: Literal["val", "public", "public_held_out", "clients", "test"]) -> np.ndarray:
        """Indices (into the source's train split, or its test split for ``test``) of a split. ``public`` is what
        pretraining serves; ``public_held_out`` the public samples beyond ``public_samples`` (empty without)."""
        self._require_setup()
        return self._splits[name]

    def client_indices(self, cid: int) -> np.ndarray:
        """Indices into the source's training split held by client ``cid``."""
        self._require_setup()
        if not 0 <= cid < self.num_clients:
            raise IndexError(f"Expected a client id in [0, {self.num_clients}), got {cid}")
        return self._clients[cid]

    def client_num_samples(self, cid: int) -> int:
        return len(self.client_indices(cid))

    def client_sizes(self) -> np.ndarray:
        """Samples per client, ``(num_clients,)``."""
        self._require_setup()
        return self._clients.sizes()

    def label_histograms(self) -> np.ndarray:
        """Samples per client and class, shape ``(num_clients, num_classes)``, for logging partitions."""
        self._require_setup()
        return label_histograms(self._clients, self._train.targets, self.num_classes)

    def partition_table(self, max_rows: int = 100) -> str:
        """Markdown: sizes of the val/public splits and each client's label histogram, one row per client up to
        ``max_rows`` clients; beyond that a summary (quantiles of client sizes and of classes held per client,
        and the label counts summed over clients), so a population of a million clients logs a few lines."""
        hist = self.label_histograms()
        sizes = (
            f"val: {len(self._splits['val'])}, public: {len(self._splits['public'])}, test: {len(self._splits['test'])}"
        )
        head = f"{self.partition!r} over {self.num_clients} clients; {sizes}\n\n"
        if self.num_clients > max_rows:
            return head + partition_summary(hist)
        header = "| client | samples | " + " | ".join(str(c) for c in range(self.num_classes)) + " |"
        rows = [header, "|" + " --- |" * (self.num_classes + 2)]
        rows += [f"| {k} | {row.sum()} | " + " | ".join(map(str, row)) + " |" for k, row in enumerate(hist)]
        return head + "\n".join(rows)

    # ------------------------------------------------------------------------------ loaders
    def _loader(
        self, dataset: Dataset, train: bool, generator: torch.Generator | None = None, persistent: bool = True
    ) -> DataLoader:
        return DataLoader(
            dataset,
            batch_size=self.batch_size if train else self.eval_batch_size,
            shuffle=train,
            generator=generator,
            num_workers=self.num_workers,
            persistent_workers=persistent and self.num_workers > 0,
        )

    def _train_subset(self, indices: np.ndarray) -> TransformedSubset:
        return TransformedSubset(self._train, indices, self.source.transform(train=True, augment=self.augment))

    def client_dataloader(self, cid: int, seed: int | None = None) -> DataLoader | InMemoryBatches:
        """Shuffled training batches of client ``cid``'s data; ``seed`` fixes the shuffling order.

        A split held in memory, without loader workers and with a seed, is served by :class:`InMemoryBatches`
        (the same batches as the ``DataLoader`` otherwise used, without its per-sample cost).
        """
        return self.indices_dataloader(self.client_indices(cid), seed)

    def indices_dataloader(self, indices: np.ndarray, seed: int | None = None) -> DataLoader | InMemoryBatches:
        """Batches of the training split's ``indices`` served as a client's are (:meth:`client_dataloader`): e.g.
        a public pseudo-client's, drawn from :meth:`split_indices` ``("public")``."""
        self._require_setup()
        generator = torch.Generator().manual_seed(seed) if seed is not None else None
        if self._client_transform is None:  # one per run: it holds the normalisation's tensors
            self._client_transform = self.source.transform(train=True, augment=self.augment)
        transform = self._client_transform
        # Exactly our transform: a subclass may redefine what it does to one image.
        in_memory = isinstance(self._train, TensorImages) and type(transform) is ImageTransform
        if in_memory and generator is not None and self.num_workers == 0:
            return InMemoryBatches(self._train, indices, transform, self.batch_size, generator)
        # A client's loader lives for one round: workers that outlive it would only pile up.
        subset = TransformedSubset(self._train, indices, transform)
        return self._loader(subset, train=True, generator=generator, persistent=False)

    def train_dataloader(self) -> DataLoader:
        """Centralised training loader: pooled client data, or the public split (``train_split``)."""
        self._require_setup()
        return self._loader(self._train_subset(self._splits[self.train_split]), train=True)

    @property
    def val_is_test(self) -> bool:
        """Whether ``val_dataloader`` serves the test split (``val_fraction`` 0): ``val/*`` is then test data."""
        return self.val_fraction == 0

    def val_dataloader(self) -> DataLoader:
        self._require_setup()
        if self.val_is_test:
            return self.test_dataloader()
        transform = self.source.transform(train=False)
        return self._loader(TransformedSubset(self._train, self._splits["val"], transform), train=False)

    def test_dataloader(self) -> DataLoader:
        self._require_setup()
        transform = self.source.transform(train=False)
        return self._loader(TransformedSubset(self._test, self._splits["test"], transform), train=False)

    def __repr__(self) -> str:
        return (
            f"FederatedDataModule(source={self.source!r}, num_clients={self.num_clients}, "
            f"partition={self.partition!r}, public_fraction={self.public_fraction}, "
            f"val_fraction={self.val_fraction}, train_split={self.train_split!r})"
        )
