"""Seeded orthonormal projection factors, identical on every client and process.

All randomness comes from one 64-bit seed. A counter-based derivation (SplitMix64) turns
``(seed, layer, stream, chunk)`` into the seed of a CPU ``torch.Generator``, so every process on
every machine regenerates the same numbers without communicating. Factors are always drawn on the
CPU (GPU generators give other streams) and moved afterwards.

The family: a ``(rows, r)`` Gaussian matrix ``G`` (float32 draws, widened to float64) drawn in fixed chunks of
``CHUNK_ROWS`` rows, made orthonormal as ``U = G R^{-1}``, where ``R`` is the upper-triangular
Cholesky factor of the ``r x r`` Gram matrix ``G^T G`` (Cholesky-QR; equal to Householder QR with a
positive diagonal in exact arithmetic). Because ``R`` needs only one pass over the chunks, ``U``
can be produced chunk by chunk: the ``stored`` mode concatenates the chunks once, ``regenerate``
rebuilds the whole ``U_l`` for each use, and ``streamed`` never holds more than one chunk. All three
give the same factor values. A tall Gaussian matrix is well conditioned (cond ~ 1 + 2 sqrt(r/rows)),
so Cholesky-QR is accurate to float64 round-off; matrices of at most one chunk use Householder QR
directly. Results are rounded to float32.
"""

from __future__ import annotations

import math

import torch

from lightning_fl.seeding import STREAM_KRON_A, STREAM_KRON_B, STREAM_KRON_SIGNS, derive_seed

#: Rows per generated chunk. Part of the factor definition (chunk seeds depend on it), so not configurable.
CHUNK_ROWS = 8192


def chunk_bounds(rows: int) -> list[tuple[int, int]]:
    return [(s, min(s + CHUNK_ROWS, rows)) for s in range(0, rows, CHUNK_ROWS)]


def gaussian_chunk(
    start: int, stop: int, rank: int, seed: int, layer: int, stream: int, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Rows ``start:stop`` (one aligned chunk) of the Gaussian draw ``G``, float32 (written into ``out`` if given).

    Drawn in float32 (twice as fast as float64); later steps widen it, so they are exact float64 arithmetic
    on these values.
    """
    g = torch.Generator(device="cpu").manual_seed(derive_seed(seed, layer, stream, start // CHUNK_ROWS))
    if out is None:
        return torch.randn(stop - start, rank, generator=g, dtype=torch.float32)
    return torch.randn(stop - start, rank, generator=g, out=out[: stop - start])


_WORKSPACES: dict[int, tuple[torch.Tensor, ...]] = {}


def _workspace(rank: int) -> tuple[torch.Tensor, ...]:
    """Chunk buffers shared by every factor of this rank in the process (float32 draw, float64 copy and
    product, float32 result: about 3 MB at r=32), so streaming allocates nothing per chunk and does not
    fragment the heap. Single-threaded use: a chunk is consumed before the next one is produced."""
    if rank not in _WORKSPACES:
        _WORKSPACES[rank] = (
            torch.empty(CHUNK_ROWS, rank),
            torch.empty(CHUNK_ROWS, rank, dtype=torch.float64),
            torch.empty(CHUNK_ROWS, rank, dtype=torch.float64),
            torch.empty(CHUNK_ROWS, rank),
        )
    return _WORKSPACES[rank]


class OrthonormalFactor:
    """The ``(rows, rank)`` factor of one layer and stream, producible whole or chunk by chunk.

    The first use makes one pass over the Gaussian chunks to get ``R^{-1}`` (``rank x rank``), the only
    state kept; :meth:`chunk` and :meth:`full` regenerate values on demand.
    """

    def __init__(self, rows: int, rank: int, seed: int, layer: int, stream: int) -> None:
        if not 1 <= rank <= rows:
            raise ValueError(f"Expected 1 <= rank <= rows, got rank={rank}, rows={rows}")
        self.rows, self.rank, self.seed, self.layer, self.stream = rows, rank, seed, layer, stream
        self.bounds = chunk_bounds(rows)
        self._small: torch.Tensor | None = None
        self._r_inv: torch.Tensor | None = None

    def _prepare(self) -> None:
        """Compute the orthonormalisation once, on first use (one pass over the draw for tall factors)."""
        if self._small is not None or self._r_inv is not None:
            return
        if len(self.bounds) == 1:  # small: Householder QR with a positive diagonal
            q, r = torch.linalg.qr(self._draw(0, self.rows), mode="reduced")
            signs = torch.sign(torch.diagonal(r))
            signs[signs == 0] = 1.0
            self._small = (q * signs).to(torch.float32)
            return
        gram = torch.zeros(self.rank, self.rank, dtype=torch.float64)
        draw, wide = _workspace(self.rank)[:2]
        for a, b in self.bounds:
            gaussian_chunk(a, b, self.rank, self.seed, self.layer, self.stream, out=draw)
            g = wide[: b - a].copy_(draw[: b - a])
            gram.addmm_(g.T, g)
        upper = torch.linalg.cholesky(gram).T  # G^T G = R^T R
        eye = torch.eye(self.rank, dtype=torch.float64)
        self._r_inv = torch.linalg.solve_triangular(upper, eye, upper=True)

    def _draw(self, start: int, stop: int) -> torch.Tensor:
        return gaussian_chunk(start, stop, self.rank, self.seed, self.layer, self.stream).to(torch.float64)

    def chunk(self, start: int, stop: int) -> torch.Tensor:
        """Rows ``start:stop`` of U (an aligned chunk), float32.

        For tall factors the result is a view of a workspace reused by the next call (no allocation per
        chunk, so streaming does not fragment the heap): consume or copy it before asking for another.
        """
        self._prepare()
        if self._small is not None:
            return self._small[start:stop]
        draw, wide, prod, result = (t[: stop - start] for t in _workspace(self.rank))
        gaussian_chunk(start, stop, self.rank, self.seed, self.layer, self.stream, out=draw)
        wide.copy_(draw)
        torch.mm(wide, self._r_inv, out=prod)
        return result.copy_(prod)

    def full(self) -> torch.Tensor:
        """The whole ``(rows, rank)`` float32 factor."""
        self._prepare()
        if self._small is not None:
            return self._small
        out = torch.empty(self.rows, self.rank, dtype=torch.float32)
        for a, b in self.bounds:
            out[a:b] = self.chunk(a, b)
        return out


def kronecker_shape(rows: int, rank: int) -> tuple[int, int, int, int]:
    """``(a, b, p, q)`` of a Kronecker factor: ``rows = a b`` with ``a`` the largest divisor of ``rows`` at most
    its square root, and a ``p x q`` grid of column pairs (``p q >= rank``, ``p <= a``, ``q <= b``) as square as
    those allow. A prime ``rows`` gives ``a = 1``, ``p = 1``, ``q = rank``: a Gaussian factor of the whole layer."""
    if not 1 <= rank <= rows:
        raise ValueError(f"Expected 1 <= rank <= rows, got rank={rank}, rows={rows}")
    a = next(x for x in range(math.isqrt(rows), 0, -1) if rows % x == 0)
    b = rows // a
    p = min(a, math.isqrt(rank - 1) + 1)  # ceil(sqrt(rank)), at most a
    q = -(-rank // p)  # <= b: either p = a and rank <= a b, or p >= sqrt(rank) >= q and b >= a >= p
    return a, b, p, q


class KroneckerFactor:
    """A ``(rows, rank)`` factor with exactly orthonormal columns and ``O(rows)`` memory.

    ``U = diag(s) (A kron B) S``: ``A`` (``a x p``) and ``B`` (``b x q``) have orthonormal columns (seeded
    Gaussian draws made orthonormal like :class:`OrthonormalFactor`), ``S`` keeps the first ``rank`` of the
    ``p q`` column pairs (row-major), and ``s`` is a seeded vector of random signs. Column ``j = i q + t`` of
    ``A kron B`` is ``A[:, i] kron B[:, t]``; distinct pairs are orthonormal because ``A`` and ``B`` are, and
    the signs keep them so. Applied without forming ``U``: reshaping a flat ``(a b,)`` vector row-major to
    ``(a, b)``, ``U c = s * vec(A C B^T)`` with ``C`` the ``p x q`` grid holding ``c``, so a product costs
    ``2 rows min(p, q)`` flops and reads only ``A``, ``B`` and ``s`` (about ``sqrt(rank)`` times fewer
    flops than a stored ``U`` and none of its ``4 rows rank`` bytes of memory traffic); autograd's backward is
    the adjoint ``U^T g``. A structured random subspace in the spirit of the Fastfood and Kronecker
    projections of intrinsic-dimension work; not the Gaussian family, so its fingerprint differs.
    """

    def __init__(self, rows: int, rank: int, seed: int, layer: int) -> None:
        self.rows, self.rank, self.seed, self.layer = rows, rank, seed, layer
        self.a, self.b, self.p, self.q = kronecker_shape(rows, rank)

    def parts(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(A, B, s)``: float32 ``(a, p)``, ``(b, q)`` and ``(rows,)`` signs in {-1, +1}."""
        left = OrthonormalFactor(self.a, self.p, self.seed, self.layer, STREAM_KRON_A).full()
        right = OrthonormalFactor(self.b, self.q, self.seed, self.layer, STREAM_KRON_B).full()
        g = torch.Generator(device="cpu").manual_seed(derive_seed(self.seed, self.layer, STREAM_KRON_SIGNS, 0))
        signs = torch.randint(0, 2, (self.rows,), generator=g, dtype=torch.int64).to(torch.float32).mul_(2).sub_(1)
        return left, right, signs

    def full(self) -> torch.Tensor:
        """The whole ``(rows, rank)`` float32 factor (for tests and fingerprints; the mapping never forms it)."""
        left, right, signs = self.parts()
        u = torch.einsum("ip,kq->ikpq", left, right).reshape(self.rows, self.p * self.q)[:, : self.rank]
        return u * signs[:, None]


def kronecker_projection(
    base: torch.Tensor, coeff: torch.Tensor, left: torch.Tensor, right: torch.Tensor, signs: torch.Tensor
) -> torch.Tensor:
    """``base + U @ coeff`` (flat) for a :class:`KroneckerFactor` given by its parts, without forming ``U``."""
    p, q = left.shape[1], right.shape[1]
    grid = torch.nn.functional.pad(coeff, (0, p * q - coeff.shape[-1])).reshape(p, q)
    # the cheaper order: (a, p) @ (p, b) costs 2 a b p flops, (a, q) @ (q, b) costs 2 a b q
    delta = left @ (grid @ right.T) if p <= q else (left @ grid) @ right.T
    return torch.addcmul(base, delta.reshape(-1), signs)


def orthonormal_factor(rows: int, rank: int, seed: int, layer: int, stream: int) -> torch.Tensor:
    """``(rows, rank)`` float32 matrix with orthonormal columns, a pure function of its arguments."""
    return OrthonormalFactor(rows, rank, seed, layer, stream).full()


class _RegeneratedProjection(torch.autograd.Function):
    """``base + U @ c`` with the whole U rebuilt for forward and again for backward; never kept between uses."""

    @staticmethod
    def forward(ctx, base: torch.Tensor, coeff: torch.Tensor, factor: OrthonormalFactor) -> torch.Tensor:
        ctx.factor = factor
        return torch.addmv(base, factor.full().to(coeff.device, coeff.dtype), coeff)  # (rows,)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad_coeff = None
        if ctx.needs_input_grad[1]:
            grad_coeff = ctx.factor.full().to(grad.device, grad.dtype).T @ grad
        return (grad if ctx.needs_input_grad[0] else None), grad_coeff, None


class _StreamedProjection(torch.autograd.Function):
    """``base + U @ c`` with U's rows produced one chunk at a time in forward and backward; never materialised.

    The output is written in place chunk by chunk, so no weight-sized temporary exists besides the result.
    """

    @staticmethod
    def forward(ctx, base: torch.Tensor, coeff: torch.Tensor, factor: OrthonormalFactor) -> torch.Tensor:
        ctx.factor = factor
        out = base.clone()
        for a, b in factor.bounds:
            out[a:b].addmv_(factor.chunk(a, b).to(coeff.device, coeff.dtype), coeff)
        return out  # (rows,)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        factor = ctx.factor
        grad_coeff = None
        if ctx.needs_input_grad[1]:
            grad_coeff = grad.new_zeros(factor.rank)
            for a, b in factor.bounds:
                grad_coeff.addmv_(factor.chunk(a, b).to(grad.device, grad.dtype).T, grad[a:b])
        return (grad if ctx.needs_input_grad[0] else None), grad_coeff, None


def regenerated_projection(base: torch.Tensor, coeff: torch.Tensor, factor: OrthonormalFactor) -> torch.Tensor:
    """``base + U @ coeff`` (flat), rebuilding U for backward instead of saving it."""
    return _RegeneratedProjection.apply(base, coeff, factor)


def streamed_projection(base: torch.Tensor, coeff: torch.Tensor, factor: OrthonormalFactor) -> torch.Tensor:
    """``base + U @ coeff`` (flat), producing U chunk by chunk in forward and backward."""
    return _StreamedProjection.apply(base, coeff, factor)
