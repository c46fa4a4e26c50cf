"""Bayesian one-shot baselines of the FMP paper: Laplace BNN/LBNN, consensus (CBNN, CFMP)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from conftest import FMP_SHRINK, C, D, context, pool
from lightning_fl.oneshot import FMP, TaskSampler
from lightning_fl.oneshot.baselines.cbnn import CBNN, consensus
from lightning_fl.oneshot.baselines.cfmp import CFMP
from lightning_fl.oneshot.baselines.laplace import (
    BNN,
    LBNN,
    gaussian_samples,
    laplace_fit,
    log_evidence,
    marglik_prior_precision,
    softmax_hessian,
)
from lightning_fl.oneshot.erm import erm_objective, fit_softmax


def test_laplace_precision_is_the_hessian_of_n_times_the_objective():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(30, 3, generator=g, dtype=torch.float64)
    t = torch.nn.functional.one_hot(torch.randint(3, (30,), generator=g), 3).double()
    W = fit_softmax(x, t, 0.1, tol=1e-10)
    hessian = torch.autograd.functional.hessian(lambda w: 30 * erm_objective(w.reshape(3, 3), x, t, 0.1), W.flatten())
    z = torch.cat([x, t], dim=1)
    ctx = SimpleNamespace(num_classes=3, l2=0.1, tol=1e-10)
    W_fit, H, delta = laplace_fit(z, ctx, "erm")
    assert torch.allclose(W_fit.double(), W, atol=1e-6)
    assert torch.allclose(H + delta * torch.eye(9, dtype=H.dtype), hessian, atol=1e-6)


def test_laplace_samples_have_the_posterior_mean_and_covariance():
    W = torch.tensor([[1.0, -2.0], [0.5, 0.0]])
    A = torch.tensor([[2.0, 0.3, 0.0, 0.1], [0.3, 1.0, 0.0, 0.0], [0.0, 0.0, 3.0, 0.2], [0.1, 0.0, 0.2, 1.5]])
    draws = gaussian_samples(W, A.double(), 20000, torch.Generator().manual_seed(0)).reshape(20000, -1).double()
    assert torch.allclose(draws.mean(0), W.flatten().double(), atol=0.03)
    assert torch.allclose(torch.cov(draws.T), torch.linalg.inv(A.double()), atol=0.03)


def test_marglik_prior_precision_hand_computed_one_parameter():
    # P = 1, H = a, ||W||^2 = w2: the root of a / (a + delta) = delta * w2 is
    # delta = (-a w2 + sqrt(a^2 w2^2 + 4 a w2)) / (2 w2); a = 3, w2 = 1 -> 0.79129.
    delta = marglik_prior_precision(torch.tensor([[3.0]]), torch.tensor([[1.0]]))
    assert delta == pytest.approx((-3 + (9 + 12) ** 0.5) / 2, rel=1e-9)


def test_marglik_prior_precision_is_mackays_fixed_point_and_the_evidence_maximum():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(40, 5, generator=g, dtype=torch.float64)
    t = torch.nn.functional.one_hot(torch.randint(3, (40,), generator=g), 3).double()
    W = fit_softmax(x, t, 0.01, tol=1e-10)
    H = softmax_hessian(W, x, torch.ones(40, dtype=torch.float64))
    delta = marglik_prior_precision(H, W)
    lam = torch.linalg.eigvalsh(H).clamp_min(0)
    gamma = (lam / (lam + delta)).sum()  # effective number of parameters
    assert delta == pytest.approx(float(gamma / W.pow(2).sum()), rel=1e-8)
    grid = torch.logspace(-4, 4, 2001, dtype=torch.float64)
    sq = W.pow(2).sum()
    assert log_evidence(torch.tensor(delta), lam, sq) >= log_evidence(grid, lam, sq).max() - 1e-12
    # An unidentifiable direction (the softmax's shared shift) has lambda = 0 and is left to the prior.
    assert lam.min() < 1e-8


def test_prior_precision_options_and_errors():
    task = TaskSampler(*pool(), C, 3, 30).sample(0)
    ctx = context()
    z = task.pooled
    assert laplace_fit(z, ctx, "erm")[2] == pytest.approx(z.shape[0] * ctx.l2)
    assert laplace_fit(z, ctx, 2.5)[2] == 2.5
    W, H, delta = laplace_fit(z, ctx, "marglik")
    assert delta == pytest.approx(marglik_prior_precision(H, W))
    out = BNN().run(task, ctx)
    assert out.extras["prior_precision"] == pytest.approx(delta, rel=1e-6)
    for bad in ("mackay", -1.0, 0, float("nan"), True):
        with pytest.raises(ValueError, match="prior_precision must be 'marglik', 'erm' or a positive number"):
            BNN(prior_precision=bad)
    with pytest.raises(ValueError, match="not finite"):
        marglik_prior_precision(torch.full((4, 4), float("nan")), torch.zeros(2, 2))
    with pytest.raises(ValueError, match="CBNN.prior_precision"):
        CBNN(prior_precision="evidence")


def test_cbnn_fractionates_the_global_prior():
    # "erm": the pooled ERM prior N * l2 over M clients of n points is n * l2 per client, exactly what a
    # global precision of M * n * l2 gives after the 1/M fractionation.
    task = TaskSampler(*pool(), C, 3, 30).sample(0)
    ctx = context()
    z = task.clients[1]
    erm = CBNN(prior_precision="erm").local_samples(z, ctx, 1, 3)
    number = CBNN(prior_precision=3 * z.shape[0] * ctx.l2).local_samples(z, ctx, 1, 3)
    assert torch.allclose(erm, number, atol=1e-5)
    assert not torch.allclose(erm, CBNN(prior_precision=z.shape[0] * ctx.l2).local_samples(z, ctx, 1, 3), atol=1e-3)
    assert CBNN(name="cbnn_marglik", prior_precision="marglik").name == "cbnn_marglik"


def test_consensus_weights_by_inverse_variance_hand_computed():
    # Two clients, one parameter, three paired draws each.
    a = torch.tensor([1.0, 2.0, 3.0])  # sample variance 1
    b = torch.tensor([10.0, 14.0, 18.0])  # sample variance 16
    combined = consensus(torch.stack([a, b]).reshape(2, 3, 1)).flatten()
    expected = (a / 1.0 + b / 16.0) / (1.0 + 1.0 / 16.0)
    assert torch.allclose(combined, expected, atol=1e-6)


def test_full_consensus_is_the_gaussian_product_for_two_clients():
    g = torch.Generator().manual_seed(1)
    samples = torch.randn(2, 50, 2, generator=g, dtype=torch.float64) * torch.tensor(
        [[1.0, 2.0], [3.0, 0.5]]
    ).unsqueeze(1)
    samples[1] += torch.tensor([1.0, -1.0])
    combined = consensus(samples, covariance="full", shrinkage=0.0, eps=0.0)
    covs = [torch.cov(s.T) for s in samples]
    precs = [torch.linalg.inv(c) for c in covs]
    expected = torch.linalg.solve(precs[0] + precs[1], (precs[0] @ samples[0].T + precs[1] @ samples[1].T)).T
    assert torch.allclose(combined, expected, atol=1e-8)


def test_consensus_of_identical_clients_is_the_identity():
    draws = torch.randn(1, 5, 3, 2).expand(3, 5, 3, 2)
    assert torch.allclose(consensus(draws), draws[0], atol=1e-5)


def test_bayesian_baselines_run_with_the_paper_byte_counts():
    task = TaskSampler(*pool(), C, 3, 30).sample(0)
    ctx = context()
    S = ctx.noise.shape[0]
    assert BNN().run(task, ctx).W.shape == (1, S, C, D)
    assert LBNN().run(task, ctx).W.shape == (3, S, C, D)
    for method in (CBNN(), CFMP()):
        out = method.run(task, ctx)
        assert out.W.shape == (1, S, C, D) and torch.isfinite(out.W).all()
        assert out.bytes_per_client == S * C * D * 4  # S local draws of the C x D model
    # Deterministic given the seed.
    assert torch.equal(CBNN(seed=3).run(task, ctx).W, CBNN(seed=3).run(task, ctx).W)
    with pytest.raises(ValueError, match="covariance"):
        CBNN(covariance="dense")


def test_baselines_are_selected_from_the_config(in_tmp, monkeypatch):
    from conftest import CONFIGS, capture_test_results, run_cli

    monkeypatch.setenv("LIGHTNING_FL_CACHE", str(in_tmp / "cache"))
    methods = (
        '[{"class_path": "lightning_fl.oneshot.baselines.cbnn.CBNN"}, '
        '{"class_path": "lightning_fl.oneshot.baselines.cfmp.CFMP"}, '
        '{"class_path": "lightning_fl.oneshot.baselines.laplace.BNN", '
        '"init_args": {"prior_precision": 2.5}}]'
    )
    config = str(CONFIGS / "fmp_digits.yaml")
    assert run_cli("fit", "--config", config, *FMP_SHRINK, "--model.methods", methods) == 0
    captured = capture_test_results(monkeypatch)
    ckpt = in_tmp / "runs/fmp_digits/version_0/checkpoints/last.ckpt"
    assert run_cli("test", "--config", config, *FMP_SHRINK, "--model.methods", methods, "--ckpt_path", str(ckpt)) == 0
    metrics = captured["out"][0]
    for name in ("cbnn", "cfmp", "bnn"):
        assert f"test/{name}/acc" in metrics and f"test/{name}/ece" in metrics
    assert metrics["comm/cbnn/kb_per_client"] == pytest.approx(2 * 10 * 64 * 4 / 1000)
    assert metrics["test/bnn/prior_precision"] == pytest.approx(2.5)  # an option from the config, logged
    assert FMP.name == "fmp"
