"""Tasks for one-shot federated learning on frozen features: M clients with n labelled points each.

A point is ``z = [h, p]``: the feature vector ``h`` (D floats) followed by a label distribution
``p`` over the C classes (one-hot for real data, soft for generated and summary points). Every
client of a task holds the same number of points, so a task is one tensor ``[M, n, D + C]``.

Label skew is Hsu et al. (2019)'s client-wise Dirichlet split, the variant that keeps client
sizes equal (as FMP's setting has, "each client holding a private dataset of size n"): client m
draws class proportions ``q_m ~ Dirichlet(alpha * 1)`` over the task's classes and then
``n * q_m`` points (multinomial counts) from those classes, without replacement across clients.

Meta-training tasks vary the label set and its order (FMP section IV-3): a task keeps a random
subset of ``min_classes..C`` classes and relabels them by a random permutation of the C label
slots; target tasks use every class with the identity labelling, so models refit on them can be
scored on the test split directly.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor


@dataclass
class Task:
    """One task. ``clients``: ``[M, n, D + C]`` points; ``labels``: ``[C]`` task label of each original class
    (``-1`` for classes the task leaves out); ``heldout``: ``[n_ho, D + C]`` extra points of the same task
    (same classes and labelling) not held by any client, or ``None``."""

    clients: Tensor
    labels: Tensor
    num_classes: int
    heldout: Tensor | None = None

    @property
    def feature_dim(self) -> int:
        return self.clients.shape[-1] - self.num_classes

    @property
    def pooled(self) -> Tensor:
        """All clients' points as one set, ``[M * n, D + C]``."""
        return self.clients.reshape(-1, self.clients.shape[-1])


def split_points(z: Tensor, num_classes: int) -> tuple[Tensor, Tensor]:
    """``[..., D + C]`` points -> (features ``[..., D]``, label distributions ``[..., C]``)."""
    return z[..., :-num_classes], z[..., -num_classes:]


def project_labels(z: Tensor, num_classes: int) -> Tensor:
    """Put the label parts of points back on the simplex (clamp at 0, renormalise; uniform if all zero),
    e.g. after a lossy codec moved them slightly off it."""
    h, p = split_points(z, num_classes)
    p = p.clamp(min=0)
    total = p.sum(-1, keepdim=True)
    p = torch.where(total > 0, p / total.clamp_min(1e-12), torch.full_like(p, 1.0 / num_classes))
    return torch.cat([h, p], dim=-1)


def make_points(h: Tensor, y: Tensor, num_classes: int) -> Tensor:
    """Features ``[N, D]`` and integer labels ``[N]`` -> points ``[N, D + C]`` with one-hot label parts."""
    return torch.cat([h, torch.nn.functional.one_hot(y, num_classes).to(h.dtype)], dim=-1)


class TaskSampler:
    """Draws tasks from a pool of features ``h [N, D]`` with labels ``y [N]``.

    Args:
        h: Pool features.
        y: Pool labels in ``0..num_classes-1``.
        num_classes: C.
        num_clients: M.
        points_per_client: n.
        alpha: Dirichlet concentration of the label skew; ``None`` for IID clients.
        vary_labels: Meta-training tasks: a random class subset and a random labelling.
        min_classes: Smallest class subset when ``vary_labels`` (default: C, i.e. permutations only).
        heldout_points: Points of the same task kept aside from the clients (for training the generator).
        classes: Without ``vary_labels``, the classes every task draws from, keeping their labels (default: all).
    """

    def __init__(
        self,
        h: Tensor,
        y: Tensor,
        num_classes: int,
        num_clients: int,
        points_per_client: int,
        alpha: float | None = None,
        vary_labels: bool = False,
        min_classes: int | None = None,
        heldout_points: int = 0,
        classes: list[int] | None = None,
    ) -> None:
        if h.ndim != 2 or y.shape != h.shape[:1]:
            raise ValueError(f"Expected features [N, D] and labels [N], got {tuple(h.shape)} and {tuple(y.shape)}")
        if num_clients < 1 or points_per_client < 1:
            raise ValueError(
                f"Expected num_clients >= 1 and points_per_client >= 1, got {num_clients}, {points_per_client}"
            )
        if alpha is not None and not alpha > 0:
            raise ValueError(f"Expected alpha > 0 or None (IID), got {alpha}")
        min_classes = num_classes if min_classes is None else min_classes
        if not 1 <= min_classes <= num_classes:
            raise ValueError(f"Expected 1 <= min_classes <= {num_classes}, got {min_classes}")
        self.h, self.y = h, y
        self.num_classes = num_classes
        self.num_clients, self.points_per_client = num_clients, points_per_client
        self.alpha, self.vary_labels, self.min_classes = alpha, vary_labels, min_classes
        self.heldout_points = heldout_points
        self.classes = torch.arange(num_classes) if classes is None else torch.tensor(sorted(set(classes)))
        if classes is not None and (vary_labels or not classes or min(classes) < 0 or max(classes) >= num_classes):
            raise ValueError(
                f"Expected a fixed class subset of 0..{num_classes - 1} (without vary_labels), got {classes}"
            )
        self.by_class = [torch.nonzero(y == c).flatten() for c in range(num_classes)]
        need = num_clients * points_per_client + heldout_points
        if vary_labels:  # worst case class subset
            fewest = sum(sorted(len(idx) for idx in self.by_class)[: self.min_classes])
        else:
            fewest = sum(len(self.by_class[int(c)]) for c in self.classes)
        if need > fewest:
            raise ValueError(
                f"A task needs {need} points (clients x points_per_client + heldout) but the smallest class subset a "
                f"task may draw holds {fewest}: lower points_per_client or num_clients, or raise min_classes"
            )

    def _classes(self, g: torch.Generator) -> tuple[Tensor, Tensor]:
        """(original classes in the task, their task labels)."""
        C = self.num_classes
        if not self.vary_labels:
            return self.classes, self.classes
        k = int(torch.randint(self.min_classes, C + 1, (1,), generator=g))
        classes = torch.randperm(C, generator=g)[:k].sort().values
        return classes, torch.randperm(C, generator=g)[:k]

    @staticmethod
    def _fit_counts(counts: Tensor, q: Tensor, classes: Tensor, order: dict, taken: dict, g: torch.Generator) -> Tensor:
        """Cap each class's count at the points it has left; redraw the excess from classes with room
        (weighted by the client's proportions), so strong skew never asks a class for more than it holds."""
        room = torch.tensor([len(order[int(c)]) - taken[int(c)] for c in classes])
        if int(room.sum()) < int(counts.sum()):
            raise ValueError(
                f"The task's classes have {int(room.sum())} points left but a client needs {int(counts.sum())}"
            )
        while bool((counts > room).any()):
            excess = int((counts - room).clamp(min=0).sum())
            counts = torch.minimum(counts, room)
            weights = (q + 1e-3) * (counts < room)
            extra = torch.multinomial(weights, excess, replacement=True, generator=g)
            counts = counts + torch.bincount(extra, minlength=len(classes))
        return counts

    def sample(self, seed: int) -> Task:
        """The task numbered ``seed`` (deterministic)."""
        g = torch.Generator().manual_seed(int(seed))
        classes, labels = self._classes(g)
        M, n, C = self.num_clients, self.points_per_client, self.num_classes
        # A fresh random order of every class pool; clients take consecutive chunks, so they are disjoint.
        order = {int(c): self.by_class[c][torch.randperm(len(self.by_class[c]), generator=g)] for c in classes}
        taken = {int(c): 0 for c in classes}

        def take(c: int, k: int) -> Tensor:
            if taken[c] + k > len(order[c]):
                raise ValueError(
                    f"Class {c} has {len(order[c])} pool points but the task needs more: lower data.points_per_client "
                    "or data.num_clients"
                )
            out = order[c][taken[c] : taken[c] + k]
            taken[c] += k
            return out

        if self.alpha is None:
            # IID over the task's classes: one shuffled pool, chunks of n.
            pool = torch.cat([order[int(c)] for c in classes])
            pool = pool[torch.randperm(len(pool), generator=g)]
            need = M * n + self.heldout_points
            if need > len(pool):
                raise ValueError(
                    f"A task needs {need} points but its classes hold {len(pool)}: lower data.points_per_client"
                )
            client_idx = pool[: M * n].reshape(M, n)
            heldout_idx = pool[M * n : need]
        else:
            # torch.distributions takes no generator; numpy's Dirichlet, seeded from the task, keeps it deterministic.
            rng = np.random.default_rng(int(torch.randint(2**62, (1,), generator=g)))
            q = torch.from_numpy(rng.dirichlet(np.full(len(classes), float(self.alpha)), size=M)).float()
            rows = []
            for m in range(M):
                draws = torch.multinomial(q[m], n, replacement=True, generator=g)
                counts = self._fit_counts(torch.bincount(draws, minlength=len(classes)), q[m], classes, order, taken, g)
                rows.append(torch.cat([take(int(c), int(k)) for c, k in zip(classes, counts, strict=False) if k > 0]))
            client_idx = torch.stack(rows)
            heldout_idx = torch.zeros(0, dtype=torch.long)
            if self.heldout_points:
                rest = torch.cat([order[int(c)][taken[int(c)] :] for c in classes])
                heldout_idx = rest[torch.randperm(len(rest), generator=g)[: self.heldout_points]]
        relabel = torch.full((C,), -1, dtype=torch.long)
        relabel[classes] = labels

        def points(idx: Tensor) -> Tensor:
            return make_points(self.h[idx], relabel[self.y[idx]], C)

        clients = points(client_idx.flatten()).reshape(M, n, -1)  # (M, n, D + C)
        heldout = points(heldout_idx) if self.heldout_points else None
        return Task(clients=clients, labels=relabel, num_classes=C, heldout=heldout)
