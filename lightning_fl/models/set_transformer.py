"""Set Transformer: A Framework for Attention-based Permutation-Invariant Neural Networks
(Lee, Lee, Kim, Kosiorek, Choi, Teh; ICML 2019).

The blocks follow the paper's equations, not the reference code (juho-lee/set_transformer):

    Multihead(Q, K, V) = concat(O_1, ..., O_h) W_O,  O_j = softmax(Q_j K_j^T / sqrt(d_head)) V_j
    H         = LayerNorm(Q' + Multihead(Q', K, V))
    MAB(Q, C) = LayerNorm(H + rFF(H))
    SAB(X)    = MAB(X, X)
    ISAB(X)   = MAB(X, MAB(I, X))        I: learned inducing points
    PMA(Z)    = MAB(S, rFF(Z))           S: learned seed vectors

Where the paper and the reference code differ we take the paper (separate output projection
``W_O``; two-layer rFF; LayerNorm on by default) except for one thing the paper leaves implicit:
the first residual adds the *projected* queries ``Q' = fc_q(Q)``, which is what makes the sum
well-typed when the query width differs from ``dim``.

Every block takes a batch of sets ``(B, N, d)`` or a single set ``(N, d)``. A block whose two
inputs differ in batching (learned seeds against a batch of sets) broadcasts the unbatched one.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F


def _check_dims(owner: str, dims: dict[str, int], num_heads: int | None = None, dim: int | None = None) -> None:
    """Raise one ValueError listing every non-positive size and a ``dim`` that ``num_heads`` does not divide."""
    problems = [f"{name} must be a positive int, got {value!r}" for name, value in dims.items() if value < 1]
    if num_heads is not None and dim is not None and num_heads >= 1 and dim >= 1 and dim % num_heads:
        problems.append(f"dim={dim} must be divisible by num_heads={num_heads}")
    if problems:
        raise ValueError(f"{owner}: " + "; ".join(problems))


def _row_ff(dim_in: int, hidden: int, dim_out: int) -> nn.Sequential:
    """Row-wise feed-forward (the paper's rFF): the same two-layer MLP applied to every element of a set."""
    return nn.Sequential(nn.Linear(dim_in, hidden), nn.ReLU(), nn.Linear(hidden, dim_out))


def _as_batched(x: torch.Tensor, name: str) -> torch.Tensor:
    if x.dim() == 2:
        return x.unsqueeze(0)
    if x.dim() == 3:
        return x
    raise ValueError(f"Expected {name} of shape (N, d) or (B, N, d), got {tuple(x.shape)}")


class MAB(nn.Module):
    """Multihead Attention Block: every query element attends to the context set ``C``.

    ``MAB(Q, C)`` is permutation-equivariant in ``Q`` and permutation-invariant in ``C``.
    """

    def __init__(
        self,
        dim_q: int,
        dim_k: int,
        dim: int,
        num_heads: int,
        layer_norm: bool = True,
        ff_hidden: int | None = None,
    ) -> None:
        """
        Args:
            dim_q: width of the query elements.
            dim_k: width of the context (key/value) elements.
            dim: width of the output and of the attention; split into ``num_heads`` heads.
            num_heads: number of attention heads; must divide ``dim``.
            layer_norm: apply the paper's two post-residual LayerNorms (the reference code defaults to off).
            ff_hidden: hidden width of the row-wise feed-forward; ``None`` means ``dim``.
        """
        super().__init__()
        hidden = dim if ff_hidden is None else ff_hidden
        _check_dims(
            "MAB",
            {"dim_q": dim_q, "dim_k": dim_k, "dim": dim, "num_heads": num_heads, "ff_hidden": hidden},
            num_heads,
            dim,
        )
        self.dim_q, self.dim_k, self.dim, self.num_heads = dim_q, dim_k, dim, num_heads
        self.head_dim = dim // num_heads
        self.fc_q = nn.Linear(dim_q, dim)
        self.fc_k = nn.Linear(dim_k, dim)
        self.fc_v = nn.Linear(dim_k, dim)
        self.fc_o = nn.Linear(dim, dim)  # W_O of Multihead; the reference code has none
        self.ff = _row_ff(dim, hidden, dim)
        self.norm0: nn.Module = nn.LayerNorm(dim) if layer_norm else nn.Identity()
        self.norm1: nn.Module = nn.LayerNorm(dim) if layer_norm else nn.Identity()

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        return x.view(b, n, self.num_heads, self.head_dim).transpose(1, 2)  # (B, h, N, d_head)

    def forward(self, query: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        """``query`` (B, Nq, dim_q) or (Nq, dim_q); ``context`` (B, Nk, dim_k) or (Nk, dim_k) -> (B, Nq, dim).

        The output is unbatched ``(Nq, dim)`` only when both inputs are.
        """
        unbatched = query.dim() == 2 and context.dim() == 2
        q_in, c_in = _as_batched(query, "query"), _as_batched(context, "context")
        if q_in.shape[-1] != self.dim_q or c_in.shape[-1] != self.dim_k:
            raise ValueError(
                f"Expected query width {self.dim_q} and context width {self.dim_k}, "
                f"got {q_in.shape[-1]} and {c_in.shape[-1]}"
            )
        batch = torch.broadcast_shapes(q_in.shape[:1], c_in.shape[:1])[0]
        q_in = q_in.expand(batch, -1, -1)  # (B, Nq, dim_q)
        c_in = c_in.expand(batch, -1, -1)  # (B, Nk, dim_k)

        q = self.fc_q(q_in)  # (B, Nq, dim)
        k, v = self.fc_k(c_in), self.fc_v(c_in)  # (B, Nk, dim) each
        # Scale 1/sqrt(d_head) as in the paper and Vaswani et al.; the reference code divides by sqrt(dim).
        o = F.scaled_dot_product_attention(
            self._heads(q), self._heads(k), self._heads(v), scale=1.0 / math.sqrt(self.head_dim)
        )  # (B, h, Nq, d_head)
        o = o.transpose(1, 2).reshape(batch, -1, self.dim)  # (B, Nq, dim): concat(O_1..O_h)
        h = self.norm0(q + self.fc_o(o))  # (B, Nq, dim)
        out = self.norm1(h + self.ff(h))  # (B, Nq, dim)
        return out.squeeze(0) if unbatched else out

    def extra_repr(self) -> str:
        return f"dim_q={self.dim_q}, dim_k={self.dim_k}, dim={self.dim}, num_heads={self.num_heads}"


class SAB(nn.Module):
    """Set Attention Block ``SAB(X) = MAB(X, X)``: self-attention, permutation-equivariant, O(N^2)."""

    def __init__(
        self, dim_in: int, dim: int, num_heads: int, layer_norm: bool = True, ff_hidden: int | None = None
    ) -> None:
        """
        Args:
            dim_in: width of the input elements.
            dim: width of the output elements; split into ``num_heads`` heads.
            num_heads: number of attention heads; must divide ``dim``.
            layer_norm: apply the MAB's post-residual LayerNorms.
            ff_hidden: hidden width of the MAB's row-wise feed-forward; ``None`` means ``dim``.
        """
        super().__init__()
        _check_dims("SAB", {"dim_in": dim_in, "dim": dim, "num_heads": num_heads}, num_heads, dim)
        self.mab = MAB(dim_in, dim_in, dim, num_heads, layer_norm=layer_norm, ff_hidden=ff_hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` (B, N, dim_in) or (N, dim_in) -> (B, N, dim) or (N, dim)."""
        return self.mab(x, x)


class ISAB(nn.Module):
    """Induced Set Attention Block ``ISAB(X) = MAB(X, MAB(I, X))`` with ``m`` learned inducing points ``I``.

    Permutation-equivariant like SAB at O(N m) cost instead of O(N^2).
    """

    def __init__(
        self,
        dim_in: int,
        dim: int,
        num_heads: int,
        num_inducing: int,
        layer_norm: bool = True,
        ff_hidden: int | None = None,
    ) -> None:
        """
        Args:
            dim_in: width of the input elements.
            dim: width of the inducing points and of the output elements; split into ``num_heads`` heads.
            num_heads: number of attention heads; must divide ``dim``.
            num_inducing: number ``m`` of learned inducing points.
            layer_norm: apply the MABs' post-residual LayerNorms.
            ff_hidden: hidden width of the MABs' row-wise feed-forwards; ``None`` means ``dim``.
        """
        super().__init__()
        _check_dims(
            "ISAB",
            {"dim_in": dim_in, "dim": dim, "num_heads": num_heads, "num_inducing": num_inducing},
            num_heads,
            dim,
        )
        self.inducing = nn.Parameter(torch.empty(num_inducing, dim))  # (m, dim)
        nn.init.xavier_uniform_(self.inducing)
        self.mab0 = MAB(dim, dim_in, dim, num_heads, layer_norm=layer_norm, ff_hidden=ff_hidden)
        self.mab1 = MAB(dim_in, dim, dim, num_heads, layer_norm=layer_norm, ff_hidden=ff_hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` (B, N, dim_in) or (N, dim_in) -> (B, N, dim) or (N, dim)."""
        h = self.mab0(self.inducing, x)  # (B, m, dim) or (m, dim)
        return self.mab1(x, h)


class PMA(nn.Module):
    """Pooling by Multihead Attention ``PMA(Z) = MAB(S, rFF(Z))`` with ``k`` learned seed vectors ``S``.

    Maps a set of any size to ``k`` elements, invariantly to the order of ``Z``.
    """

    def __init__(
        self,
        dim: int,
        num_seeds: int,
        num_heads: int,
        input_ff: bool = True,
        layer_norm: bool = True,
        ff_hidden: int | None = None,
        dim_in: int | None = None,
    ) -> None:
        """
        Args:
            dim: width of the seeds and of the output elements; split into ``num_heads`` heads.
            num_seeds: number ``k`` of learned seed vectors, i.e. of output elements.
            num_heads: number of attention heads; must divide ``dim``.
            input_ff: apply the paper's row-wise feed-forward to ``Z`` before attention (the reference code does not).
            layer_norm: apply the MAB's post-residual LayerNorms.
            ff_hidden: hidden width of the row-wise feed-forwards; ``None`` means ``dim``.
            dim_in: width of the input elements; ``None`` means ``dim``.
        """
        super().__init__()
        dim_in = dim if dim_in is None else dim_in
        hidden = dim if ff_hidden is None else ff_hidden
        _check_dims(
            "PMA",
            {"dim": dim, "num_seeds": num_seeds, "num_heads": num_heads, "ff_hidden": hidden, "dim_in": dim_in},
            num_heads,
            dim,
        )
        self.seeds = nn.Parameter(torch.empty(num_seeds, dim))  # (k, dim)
        nn.init.xavier_uniform_(self.seeds)
        self.input_ff: nn.Module = _row_ff(dim_in, hidden, dim) if input_ff else nn.Identity()
        self.mab = MAB(dim, dim if input_ff else dim_in, dim, num_heads, layer_norm=layer_norm, ff_hidden=ff_hidden)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        """``z`` (B, N, dim_in) or (N, dim_in) -> (B, k, dim) or (k, dim)."""
        return self.mab(self.seeds, self.input_ff(z))
