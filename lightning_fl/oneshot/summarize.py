"""Client summarisers: compress a client's ``n`` points to ``s`` points of the same dimension (FMP IV-1, IV-2).

* :class:`PMASummariser` is FMP's embedding function ``h_phi``: Pooling by Multihead Attention,
  ``Z~_m = MAB(S_phi, f_phi(Z_m))`` with ``s`` learnable seed vectors ``S_phi`` (Lee et al. 2019),
  followed by a linear read-out to ``[h~, p~]`` (features and a softmax label distribution), since
  a summary point must be a data point the server can refit on.
* :class:`RandomSelection` and :class:`MeanPooling` are the paper's non-learned compressions at the
  same budget (section V-4), :class:`KMeans` a third; :class:`Identity` sends everything (``s = n``: FMP is
  then exactly MP).

Add a summariser by subclassing :class:`Summariser` (``configure`` to build layers once the point
dimension is known, ``forward`` to compress) and selecting it with ``model.summariser.class_path``.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from lightning_fl.models.set_transformer import PMA
from lightning_fl.oneshot.tasks import split_points


def kmeans_centres(z: Tensor, k: int, iterations: int = 10, generator: torch.Generator | None = None) -> Tensor:
    """``k`` centres of each set in ``z`` ``[B, n, P]`` by Lloyd's algorithm (started from ``k`` distinct points
    chosen at random; a cluster that empties keeps its centre) -> ``[B, k, P]``. Label parts are averaged like
    the features, so a centre carries its cluster's label distribution."""
    B, n, P = z.shape
    if not 1 <= k <= n:
        raise ValueError(f"k-means needs 1 <= k <= n points per set, got k = {k}, n = {n}")
    z = z.detach()
    start = torch.stack([torch.randperm(n, generator=generator)[:k] for _ in range(B)]).to(z.device)
    centres = torch.gather(z, 1, start.unsqueeze(-1).expand(-1, -1, P))
    for _ in range(iterations):
        assign = torch.cdist(z.float(), centres.float()).argmin(-1)  # (B, n)
        one_hot = torch.nn.functional.one_hot(assign, k).to(z.dtype)  # (B, n, k)
        counts = one_hot.sum(1).unsqueeze(-1)  # (B, k, 1)
        means = one_hot.transpose(1, 2).matmul(z) / counts.clamp_min(1)
        centres = torch.where(counts > 0, means, centres)
    return centres


def chamfer(a: Tensor, b: Tensor) -> Tensor:
    """Symmetric Chamfer distance between the sets ``a`` ``[B, s, P]`` and ``b`` ``[B, k, P]``: the mean squared
    distance from each point to the nearest point of the other set, both ways, averaged over ``B`` -> scalar."""
    d = torch.cdist(a.float(), b.float()).pow(2)  # (B, s, k)
    return d.min(-1).values.mean() + d.min(-2).values.mean()


class Summariser(nn.Module):
    """Base: ``forward(z [B, n, D + C]) -> [B, s, D + C]``, one row per client.

    Args:
        num_points: ``s``, the summary size (points uploaded per client).
    """

    _plugin_base = True  # not offered as a choice in CLI messages
    trainable = False  # whether meta-training has parameters to fit

    def __init__(self, num_points: int = 30) -> None:
        super().__init__()
        if num_points < 1:
            raise ValueError(f"model.summariser.num_points must be >= 1, got {num_points}")
        self.num_points = num_points
        self.feature_dim = self.num_classes = 0

    def configure(self, feature_dim: int, num_classes: int) -> None:
        """Called once the point layout is known (before any forward or checkpoint load)."""
        self.feature_dim, self.num_classes = feature_dim, num_classes

    def forward(self, z: Tensor, generator: torch.Generator | None = None) -> Tensor:
        raise NotImplementedError

    def extra_repr(self) -> str:
        return f"num_points={self.num_points}"


class PMASummariser(Summariser):
    """FMP's ``h_phi``: ``MAB(S_phi, f_phi(Z))`` read out as data points ``[h~, p~]``.

    The paper's MAB output lives in the block's hidden space; a summary must be a point the server
    can refit on, so it is read out. ``readout="linear"`` maps it with one linear layer (features and
    label logits). ``readout="data"`` (default) anchors it in data space: each seed ``j`` also attends
    to the client's raw points with weights ``a_j = softmax(q(S_j) . k(f_phi(Z_i)))`` and the summary
    is ``sum_i a_ji z_i`` plus a linear correction of the MAB output (initialised at zero) to the
    features and to the label log-probabilities. Summaries then start as soft cluster means of real
    points, which meta-training refines; with a linear read-out they start as noise and training is
    far slower (measured in docs/results-fmp.md).

    Args:
        num_points: ``s`` seed vectors, i.e. summary points per client.
        hidden: Width of ``f_phi`` and the attention block.
        num_heads: Attention heads.
        readout: ``data`` (attention-weighted real points + correction) or ``linear``.
        layer_norm: The PMA's post-residual LayerNorms (the set-transformer paper's equations; with them a
            linear read-out starts from vectors of one fixed norm whatever the client's data).
    """

    trainable = True

    def __init__(
        self,
        num_points: int = 30,
        hidden: int = 128,
        num_heads: int = 4,
        readout: str = "data",
        layer_norm: bool = True,
    ) -> None:
        super().__init__(num_points)
        if hidden % num_heads:
            raise ValueError(f"model.summariser: hidden ({hidden}) must be divisible by num_heads ({num_heads})")
        if readout not in ("data", "linear"):
            raise ValueError(f"model.summariser.readout must be 'data' or 'linear', got {readout!r}")
        self.hidden, self.num_heads, self.readout, self.layer_norm = hidden, num_heads, readout, layer_norm

    def configure(self, feature_dim: int, num_classes: int) -> None:
        super().configure(feature_dim, num_classes)
        point_dim = feature_dim + num_classes
        self.embed = nn.Linear(point_dim, self.hidden)
        # PMA applies the row-wise f_phi itself (input_ff) before the seeds attend to the set.
        self.pool = PMA(self.hidden, self.num_points, self.num_heads, layer_norm=self.layer_norm)
        self.out = nn.Linear(self.hidden, point_dim)
        if self.readout == "data":
            self.query = nn.Linear(self.hidden, self.hidden)
            self.key = nn.Linear(self.hidden, self.hidden)
            nn.init.zeros_(self.out.weight)
            nn.init.zeros_(self.out.bias)

    def forward(self, z: Tensor, generator: torch.Generator | None = None) -> Tensor:
        e = self.embed(z)  # (B, n, hidden)
        pooled = self.pool(e)  # (B, s, hidden)
        dh, dlogits = split_points(self.out(pooled), self.num_classes)
        if self.readout == "linear":
            return torch.cat([dh, dlogits.float().softmax(-1).to(dh.dtype)], dim=-1)
        keys = self.key(e)  # (B, n, hidden)
        scores = self.query(self.pool.seeds).matmul(keys.transpose(-1, -2)) / self.hidden**0.5  # (B, s, n)
        anchor = scores.float().softmax(-1).matmul(z.float())  # (B, s, D + C): soft cluster means of real points
        h, p = split_points(anchor, self.num_classes)
        logits = p.clamp_min(1e-6).log() + dlogits.float()
        return torch.cat([h + dh.float(), logits.softmax(-1)], dim=-1).to(z.dtype)


class RandomSelection(Summariser):
    """Upload ``s`` of the client's points chosen uniformly at random (without replacement)."""

    def forward(self, z: Tensor, generator: torch.Generator | None = None) -> Tensor:
        B, n, P = z.shape
        if self.num_points > n:
            raise ValueError(f"RandomSelection: num_points ({self.num_points}) exceeds the client's {n} points")
        idx = torch.stack([torch.randperm(n, generator=generator)[: self.num_points] for _ in range(B)])
        return torch.gather(z, 1, idx.to(z.device).unsqueeze(-1).expand(-1, -1, P))


class MeanPooling(Summariser):
    """Split the client's points at random into ``s`` near-equal groups and upload each group's mean
    (features and label distribution averaged alike)."""

    def forward(self, z: Tensor, generator: torch.Generator | None = None) -> Tensor:
        B, n, P = z.shape
        if self.num_points > n:
            raise ValueError(f"MeanPooling: num_points ({self.num_points}) exceeds the client's {n} points")
        group = torch.arange(n) % self.num_points  # (n,) group of each position
        out = z.new_zeros(B, self.num_points, P)
        for b in range(B):
            perm = torch.randperm(n, generator=generator).to(z.device)
            out[b].index_add_(0, group.to(z.device), z[b, perm])
        return out / torch.bincount(group, minlength=self.num_points).to(z).unsqueeze(-1)


class KMeans(Summariser):
    """Upload the ``s`` centres of k-means on the client's points (features and label distributions averaged
    over each cluster): a non-learned compression beside random selection and mean pooling."""

    def __init__(self, num_points: int = 30, iterations: int = 10) -> None:
        super().__init__(num_points)
        if iterations < 1:
            raise ValueError(f"model.summariser.iterations must be >= 1, got {iterations}")
        self.iterations = iterations

    def forward(self, z: Tensor, generator: torch.Generator | None = None) -> Tensor:
        if self.num_points > z.shape[1]:
            raise ValueError(f"KMeans: num_points ({self.num_points}) exceeds the client's {z.shape[1]} points")
        return kmeans_centres(z, self.num_points, self.iterations, generator)


class Identity(Summariser):
    """Upload every point (``s = n``): with it FMP reproduces centralised MP exactly on the same base set."""

    def __init__(self) -> None:
        super().__init__(num_points=1)

    def forward(self, z: Tensor, generator: torch.Generator | None = None) -> Tensor:
        return z

    def extra_repr(self) -> str:
        return "num_points=n"
