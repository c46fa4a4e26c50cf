"""Tasks for FMP's meta-training and one-shot evaluation, served as a LightningDataModule.

The training split of the features is divided per class into a meta-training pool and a target
pool (``target_fraction``). Meta-training tasks (train loader) and the generator's training tasks
come from the meta pool with varied label subsets, label orders and partitions (``meta_alphas``);
validation and test tasks come from the target pool with the configured partition (``alpha``) and
the identity labelling, so "clients hold training features not used in meta-training" and the
refit models are scored on the test split.
"""

from __future__ import annotations

import lightning as L
import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

from lightning_fl.errors import ConfigError
from lightning_fl.oneshot.features import FeatureData, FeatureSet, PixelFeatures
from lightning_fl.oneshot.tasks import Task, TaskSampler


class _Tasks(Dataset):
    """Task ``i`` of a sampler family; task seeds are ``offset + i`` (deterministic, drawn on demand)."""

    def __init__(self, samplers: list[TaskSampler], length: int, offset: int) -> None:
        self.samplers, self.length, self.offset = samplers, length, offset

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> Tensor | Task:
        seed = self.offset + i
        return self.samplers[seed % len(self.samplers)].sample(seed)


def _stack(tasks: list[Task]) -> Tensor:
    return torch.stack([t.clients for t in tasks])  # (B, M, n, P)


def _single(tasks: list[Task]) -> Task:
    return tasks[0]


class FederatedTasks(L.LightningDataModule):
    """M clients with n feature points each, drawn from a frozen-feature data set.

    Args:
        features: Where the features come from (pixels or a trained extractor).
        num_clients: M, clients per task.
        points_per_client: n, points each client holds.
        alpha: Label skew of validation and test tasks: ``null`` for IID, else the Dirichlet concentration.
        meta_alphas: Partitions mixed in meta-training (``null`` = IID), one per task in turn.
        min_classes: Smallest label subset of a meta-training task (default: all classes, permuted).
        target_classes: Target (validation and test) tasks hold only the classes ``0 .. target_classes - 1``; test
            points of the other classes are then out of distribution for them, and ``test`` scores how uncertain
            each method's predictive is there (``test/<method>/ood_entropy``, ``ood_auroc``). Default: all classes.
        target_fraction: Share of each class's training points reserved for target (val/test) tasks.
        meta_tasks: Size of the meta-training corpus (tasks per epoch).
        tasks_per_step: Tasks per meta-training step.
        val_tasks: Held-out tasks for validation (distance to centralised MP).
        test_tasks: Target tasks evaluated by ``test``.
        heldout_points: Points per meta task kept from the clients for training the generator.
        seed: Seed of the pool split and of every task.
    """

    def __init__(
        self,
        features: FeatureData | None = None,
        num_clients: int = 10,
        points_per_client: int = 100,
        alpha: float | None = None,
        meta_alphas: list[float | None] | None = None,
        min_classes: int | None = None,
        target_classes: int | None = None,
        target_fraction: float = 0.2,
        meta_tasks: int = 2000,
        tasks_per_step: int = 4,
        val_tasks: int = 8,
        test_tasks: int = 3,
        heldout_points: int = 200,
        seed: int = 0,
    ) -> None:
        super().__init__()
        problems = []
        if target_classes is not None and target_classes < 2:
            problems.append(f"target_classes must be >= 2 or null (all classes), got {target_classes}")
        if not 0 < target_fraction < 1:
            problems.append(f"target_fraction must be in (0, 1), got {target_fraction}")
        for key, value in [
            ("num_clients", num_clients),
            ("points_per_client", points_per_client),
            ("meta_tasks", meta_tasks),
            ("tasks_per_step", tasks_per_step),
            ("val_tasks", val_tasks),
            ("test_tasks", test_tasks),
        ]:
            if value < 1:
                problems.append(f"{key} must be >= 1, got {value}")
        for a in [alpha, *(meta_alphas or [])]:
            if a is not None and not a > 0:
                problems.append(f"Dirichlet alphas must be > 0 or null (IID), got {a}")
        if problems:
            raise ConfigError("data (FederatedTasks): " + "; ".join(problems))
        self.features = features if features is not None else PixelFeatures()
        self.num_clients, self.points_per_client = num_clients, points_per_client
        self.alpha = alpha
        self.meta_alphas = list(meta_alphas) if meta_alphas is not None else [None, 1.0, 0.1]
        self.min_classes, self.target_fraction = min_classes, target_fraction
        self.target_classes = target_classes
        self.meta_tasks, self.tasks_per_step = meta_tasks, tasks_per_step
        self.val_tasks, self.test_tasks, self.heldout_points = val_tasks, test_tasks, heldout_points
        self.seed = seed
        self.train_features: FeatureSet | None = None

    @property
    def num_classes(self) -> int:
        return self.features.num_classes

    @property
    def feature_dim(self) -> int:
        return self.features.feature_dim

    def prepare_data(self) -> None:
        self.features.prepare()

    @property
    def in_distribution(self) -> list[int]:
        """The classes the target tasks hold (all, unless ``target_classes`` leaves some out)."""
        return list(range(self.target_classes if self.target_classes is not None else self.num_classes))

    def setup(self, stage: str | None = None) -> None:
        if self.train_features is not None:
            return
        if self.target_classes is not None and self.target_classes >= self.num_classes:
            raise ConfigError(
                f"data.target_classes ({self.target_classes}) must leave a class out of the {self.num_classes}: lower "
                "it, or set it to null to use every class"
            )
        train, self.test_features = self.features.load("train"), self.features.load("test")
        g = torch.Generator().manual_seed(self.seed)
        meta_idx, target_idx = [], []
        for c in range(train.num_classes):
            idx = torch.nonzero(train.y == c).flatten()
            idx = idx[torch.randperm(len(idx), generator=g)]
            k = round(len(idx) * self.target_fraction)
            target_idx.append(idx[:k])
            meta_idx.append(idx[k:])
        self.train_features = train
        self.meta_pool = train.subset(torch.cat(meta_idx))
        self.target_pool = train.subset(torch.cat(target_idx))

    def _sampler(self, pool: FeatureSet, alpha: float | None, meta: bool, heldout: int = 0) -> TaskSampler:
        try:
            return TaskSampler(
                pool.h,
                pool.y,
                pool.num_classes,
                self.num_clients,
                self.points_per_client,
                alpha=alpha,
                vary_labels=meta,
                min_classes=self.min_classes if meta else None,
                heldout_points=heldout,
                classes=None if meta else self.in_distribution,
            )
        except ValueError as err:
            which = "meta-training" if meta else "target"
            raise ConfigError(f"data: the {which} pool ({len(pool)} points) cannot hold these tasks: {err}") from err

    def meta_samplers(self, heldout: bool = False) -> list[TaskSampler]:
        """One sampler per meta-training partition (tasks alternate between them)."""
        return [self._sampler(self.meta_pool, a, True, self.heldout_points if heldout else 0) for a in self.meta_alphas]

    def target_sampler(self, heldout: bool = False) -> TaskSampler:
        """Target tasks (validation, test; with ``heldout``: also points kept aside, to score the generator)."""
        return self._sampler(self.target_pool, self.alpha, False, self.heldout_points if heldout else 0)

    def train_dataloader(self) -> DataLoader:
        tasks = _Tasks(self.meta_samplers(), self.meta_tasks, offset=0)
        g = torch.Generator().manual_seed(self.seed)
        return DataLoader(tasks, batch_size=self.tasks_per_step, shuffle=True, collate_fn=_stack, generator=g)

    def val_dataloader(self) -> DataLoader:
        # Target-pool tasks with seeds disjoint from the test tasks.
        tasks = _Tasks([self.target_sampler()], self.val_tasks, offset=10**6)
        return DataLoader(tasks, batch_size=1, collate_fn=_single)

    def test_dataloader(self) -> DataLoader:
        tasks = _Tasks([self.target_sampler()], self.test_tasks, offset=2 * 10**6)
        return DataLoader(tasks, batch_size=1, collate_fn=_single)

    def describe(self) -> str:
        return (
            f"{self.features!r}: {len(self.meta_pool)} meta-training / {len(self.target_pool)} target points, "
            f"M={self.num_clients} clients x n={self.points_per_client}, alpha={self.alpha}, "
            f"meta alphas {self.meta_alphas}"
            + (f", target classes 0..{self.target_classes - 1}" if self.target_classes is not None else "")
        )
