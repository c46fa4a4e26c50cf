"""FedLPA and Bayesian pseudocoreset baselines: K-FAC aggregation against a dense Laplace, pseudocoreset learning."""

from __future__ import annotations

import pytest
import torch

from conftest import C, D, pool
from lightning_fl.oneshot import Context, Identity, PredictiveGenerator, RandomSelection, TaskSampler
from lightning_fl.oneshot.base import upload
from lightning_fl.oneshot.baselines.bpc import BPC, softmax_hessian
from lightning_fl.oneshot.baselines.fedlpa import (
    FedLPA,
    from_upper,
    gaussian_samples,
    kfac_aggregate,
    kfac_factors,
    upper,
)
from lightning_fl.oneshot.erm import erm_objective, fit_softmax
from lightning_fl.oneshot.tasks import Task, split_points


def context(summariser=None, samples: int = 3) -> Context:
    torch.manual_seed(0)
    gen = PredictiveGenerator(hidden=16, num_heads=2)
    gen.configure(D, C)
    noise = gen.noise(samples, 16, generator=torch.Generator().manual_seed(2))
    return Context(gen.eval().requires_grad_(False), summariser or RandomSelection(5), l2=0.05, noise=noise)


def spd(k: int, g: torch.Generator) -> torch.Tensor:
    B = torch.randn(k, k, generator=g, dtype=torch.float64)
    return B @ B.T + 0.5 * torch.eye(k, dtype=torch.float64)


# ------------------------------------------------------------------------- FedLPA
def test_kfac_aggregate_matches_dense_gaussian_product():
    """Hand-built reference in the column-major convention: P_k = A_k kron G_k acts on vec(W) = W^T.flatten()."""
    g = torch.Generator().manual_seed(0)
    c, d = 3, 3
    W = torch.randn(2, c, d, generator=g, dtype=torch.float64)
    A = torch.stack([spd(d, g), spd(d, g)])
    G = torch.stack([spd(c, g), spd(c, g)])
    w = torch.tensor([0.3, 0.7], dtype=torch.float64)
    M, P = kfac_aggregate(W, A, G, w)

    def vec(X):  # column-major
        return X.T.reshape(-1)

    prec = [w[k] * torch.kron(A[k], G[k]) for k in range(2)]
    ref = torch.linalg.solve(sum(prec), sum(p @ vec(W[k]) for k, p in enumerate(prec)))
    assert torch.allclose(vec(M), ref, atol=1e-10)
    # The returned precision is the same operator in the row-major convention.
    assert torch.allclose(P, sum(w[k] * torch.kron(G[k], A[k]) for k in range(2)), atol=1e-12)


def test_kfac_factors_are_the_hessian_for_one_point():
    """For a single point K-FAC is exact: G kron A equals the autograd Hessian of the cross-entropy."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, D, generator=g, dtype=torch.float64)
    W = torch.randn(C, D, generator=g, dtype=torch.float64)
    t = torch.nn.functional.one_hot(torch.tensor([2]), C).double()
    A, G = kfac_factors(x, W)
    H = torch.autograd.functional.hessian(lambda V: erm_objective(V.reshape(C, D), x, t, 0.0), W.reshape(-1))
    assert torch.allclose(torch.kron(G, A), H, atol=1e-10)
    assert torch.allclose(softmax_hessian(W, x, torch.ones(1, dtype=torch.float64)), H, atol=1e-10)


def test_fedlpa_with_identical_clients_returns_the_client_solution_and_counts_bytes():
    task = TaskSampler(*pool(), C, 1, 40).sample(0)
    twins = Task(task.clients.expand(3, -1, -1).clone(), task.labels, C)
    ctx = context()
    out = FedLPA().run(twins, ctx)
    x, t = split_points(task.clients[0], C)
    assert torch.allclose(out.extras["mean"], fit_softmax(x, t, ctx.l2, tol=ctx.tol), atol=1e-5)
    assert out.W.shape == (1, 3, C, D) and torch.isfinite(out.W).all()
    assert out.bytes_per_client == (C * D + D * (D + 1) // 2 + C * (C + 1) // 2) * 4  # triangles of A and G
    assert torch.equal(FedLPA(seed=3).run(twins, ctx).W, FedLPA(seed=3).run(twins, ctx).W)
    assert FedLPA(sample=False).run(twins, ctx).W.shape == (1, 1, C, D)


def test_fedlpa_uploads_upper_triangles_the_papers_38364_bytes_and_the_server_rebuilds_the_factors():
    g = torch.Generator().manual_seed(4)
    x, W = torch.randn(50, 128, generator=g), torch.randn(10, 128, generator=g)
    A, G = kfac_factors(x, W)
    A, G = (A + A.T) / 2, (G + G.T) / 2  # exactly symmetric, so the round trip is exact
    decoded, nbytes = upload(context(), {"W": W, "A": upper(A), "G": upper(G)}, client=0)
    assert nbytes == (1280 + 8256 + 55) * 4 == 38_364  # the paper's 38.36 KB for C = 10, D = 128
    assert torch.equal(from_upper(decoded["A"], 128), A) and torch.equal(from_upper(decoded["G"], 10), G)
    assert torch.equal(decoded["W"], W)
    # row by row, diagonal included; a batch of triangles rebuilds a batch of matrices
    assert upper(torch.tensor([[1.0, 2.0], [2.0, 3.0]])).tolist() == [1.0, 2.0, 3.0]
    assert torch.equal(from_upper(torch.stack([upper(G), upper(2 * G)]), 10), torch.stack([G, 2 * G]))
    with pytest.raises(ValueError, match="has 55 values, got 54"):
        from_upper(upper(G)[:-1], 10)


def test_gaussian_samples_have_the_right_mean_and_covariance():
    g = torch.Generator().manual_seed(0)
    mean = torch.randn(2, 3, generator=g, dtype=torch.float64)
    P = spd(6, g)
    x = gaussian_samples(mean, P, 20000, torch.Generator().manual_seed(1))  # (S, 2, 3)
    assert torch.allclose(x.mean(0), mean, atol=0.05)
    flat = x.reshape(len(x), -1)
    assert torch.allclose(torch.cov(flat.T), torch.linalg.inv(P), atol=0.05)


def test_fedlpa_rejects_bad_arguments():
    with pytest.raises(ValueError, match="damping"):
        FedLPA(damping=0.0)


# ------------------------------------------------------------------------- BPC
def test_bpc_objective_decreases_and_run_is_deterministic():
    task = TaskSampler(*pool(), C, 3, 40, alpha=0.5).sample(0)
    ctx = context(RandomSelection(6))
    method = BPC(steps=30, lr=0.1)
    out = method.run(task, ctx)
    history = out.extras["history"]  # (steps + 1, M)
    assert history.shape == (31, 3)
    assert float(history[-1].sum()) < 0.5 * float(history[0].sum()), history[[0, -1]]
    assert out.W.shape == (1, 3, C, D) and torch.isfinite(out.W).all()
    assert out.extras["pseudocoreset"].shape == (3 * 6, D + C)
    assert out.bytes_per_client == 6 * (D + C) * 4
    assert torch.equal(BPC(steps=30, lr=0.1).run(task, ctx).W, out.W)


def test_bpc_weight_space_objective_decreases():
    task = TaskSampler(*pool(), C, 2, 40).sample(1)
    out = BPC(num_points=8, steps=30, lr=0.1, divergence="weights").run(task, context())
    history = out.extras["history"]
    assert float(history[-1].sum()) < 0.5 * float(history[0].sum())
    assert out.bytes_per_client == 8 * (D + C) * 4


def test_bpc_labels_are_class_balanced_over_the_client_classes():
    task = TaskSampler(*pool(), C, 2, 40).sample(0)
    init = BPC().initial_points(task.clients, C, 8, torch.Generator().manual_seed(0))
    labels = split_points(init, C)[1]
    assert torch.equal(labels.sum(1), torch.full((2, C), 2.0))
    # Features are real points of the label's class.
    x, t = split_points(task.clients, C)
    for m in range(2):
        idx = torch.cdist(split_points(init[m], C)[0], x[m]).argmin(-1)
        assert torch.equal(t[m, idx], labels[m])


def test_bpc_end_to_end_with_identity_summariser_size_and_zero_steps():
    task = TaskSampler(*pool(), C, 2, 12).sample(0)
    out = BPC(steps=0).run(task, context(Identity()))
    assert out.bytes_per_client == 12 * (D + C) * 4 and torch.isfinite(out.W).all()


def test_bpc_rejects_bad_arguments():
    with pytest.raises(ValueError, match="divergence") as err:
        BPC(divergence="l1", lr=-1.0)
    assert "lr" in str(err.value)
