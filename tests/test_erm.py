import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from sklearn.linear_model import LogisticRegression

from lightning_fl.oneshot.erm import ERMNotConverged, erm_objective, fit_softmax, predict_proba


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """These problems are tiny: a second thread only adds synchronisation (a lot of it on a busy machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def problem(S=3, N=40, D=5, C=4, seed=0, dtype=torch.float64, soft=False):
    """Features ``[S, N, D]`` and targets ``[S, N, C]`` (one-hot, or soft rows on the simplex)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(S, N, D, generator=g, dtype=dtype)
    if soft:
        t = torch.softmax(2 * torch.randn(S, N, C, generator=g, dtype=dtype), dim=-1)
    else:
        t = torch.nn.functional.one_hot(torch.randint(0, C, (S, N), generator=g), C).to(dtype)
    return x, t


def max_grad(W, x, t, l2, w=None):
    """``max |grad_W L_s(W)|`` per sample, by plain autograd on the objective."""
    W = W.detach().to(torch.float64).requires_grad_()
    w64 = None if w is None else w.double()
    (grad,) = torch.autograd.grad(erm_objective(W, x.double(), t.double(), l2, w64).sum(), W)
    return grad.abs().flatten(-2).amax(-1)


@pytest.mark.parametrize("weighted", [False, True])
def test_matches_sklearn_logistic_regression(weighted):
    # sklearn minimises sum_i sw_i CE_i / sum(sw) + ||W||^2 / (2 C sum(sw)): ours with l2 = 1 / (C sum(sw)).
    x, t = problem(S=1, N=60, D=5, C=4, seed=1)
    x, t, y = x[0], t[0], t[0].argmax(-1)
    w = torch.rand(60, generator=torch.Generator().manual_seed(2), dtype=torch.float64) + 0.5 if weighted else None
    l2 = 0.05
    W = fit_softmax(x, t, l2, w, tol=1e-10)
    sw = None if w is None else w.numpy()
    total = 60 if w is None else float(w.sum())
    sk = LogisticRegression(fit_intercept=False, C=1 / (l2 * total), tol=1e-12, max_iter=10_000)
    sk.fit(x.numpy(), y.numpy(), sample_weight=sw)
    assert sk.coef_.shape == (4, 5) == tuple(W.shape)
    np.testing.assert_allclose(W.numpy(), sk.coef_, atol=1e-6, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_solution_is_stationary_to_tol(dtype):
    x, t = problem(S=4, N=300, D=16, C=6, seed=3, dtype=dtype, soft=True)
    x = 3 * x  # confident predictions: a harder, worse-conditioned problem
    w = torch.rand(4, 300, generator=torch.Generator().manual_seed(4), dtype=dtype)
    for tol in (1e-5, 1e-8 if dtype == torch.float64 else 3e-6):
        W = fit_softmax(x, t, 1e-3, w, tol=tol)
        assert W.dtype == dtype and W.shape == (4, 6, 16)
        # float32: the solver's own gradient and this float64 one differ by float32 rounding (~1e-7)
        assert (max_grad(W, x, t, 1e-3, w) <= tol + (1e-6 if dtype == torch.float32 else 0)).all()


@settings(max_examples=25, deadline=None)
@given(
    S=st.integers(1, 3),
    N=st.integers(1, 50),
    D=st.integers(1, 6),
    C=st.integers(1, 5),
    log_l2=st.floats(-4, 1),
    scale=st.floats(0.1, 10),
    seed=st.integers(0, 2**16),
)
def test_stationary_on_random_problems(S, N, D, C, log_l2, scale, seed):
    x, t = problem(S, N, D, C, seed=seed, soft=seed % 2 == 0)
    # float64 rounding in the gradient grows with the features' scale (e.g. S=2, N=9, D=6, C=2, l2=0.02,
    # scale=9.27, seed=789 stalls at 1.27e-9 however many Newton steps it gets): ask for 1e-9 relative to it
    tol = 1e-9 * max(1.0, scale) ** 2
    W = fit_softmax(scale * x, t, 10**log_l2, tol=tol)
    assert (max_grad(W, scale * x, t, 10**log_l2) <= tol).all()


def test_batched_equals_one_problem_at_a_time():
    x, t = problem(S=4, N=50, D=6, C=3, seed=5, soft=True)
    w = torch.rand(4, 50, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    W = fit_softmax(x, t, 0.01, w, tol=1e-10)
    for s in range(4):
        torch.testing.assert_close(W[s], fit_softmax(x[s], t[s], 0.01, w[s], tol=1e-10), atol=1e-9, rtol=0)


def test_converged_samples_stop_changing():
    x, t = problem(S=3, N=50, D=6, C=3, seed=7)
    W = fit_softmax(x, t, 0.01, tol=1e-10)
    init = torch.zeros_like(W)
    init[1] = W[1]  # sample 1 starts at its solution: it must not move while the others iterate
    W2 = fit_softmax(x, t, 0.01, tol=1e-10, init=init)
    assert torch.equal(W2[1], W[1])
    torch.testing.assert_close(W2, W, atol=1e-9, rtol=0)


def test_soft_targets_equal_duplicated_points_weighted_by_the_targets():
    # A point with target t counts like C copies of it with one-hot labels c and weights t_c.
    x, t = problem(S=1, N=30, D=4, C=3, seed=8, soft=True)
    x, t = x[0], t[0]
    w = torch.rand(30, generator=torch.Generator().manual_seed(9), dtype=torch.float64) + 0.1
    W = fit_softmax(x, t, 0.02, w, tol=1e-10)
    eye = torch.eye(3, dtype=torch.float64)
    x_dup = x.repeat_interleave(3, dim=0)  # (3N, D): point i, labels 0, 1, 2
    t_dup = eye.repeat(30, 1)
    w_dup = (w[:, None] * t).reshape(-1)
    torch.testing.assert_close(W, fit_softmax(x_dup, t_dup, 0.02, w_dup, tol=1e-10), atol=1e-8, rtol=0)


def test_implicit_gradients_match_finite_differences():
    x, t = problem(S=2, N=7, D=3, C=3, seed=10, soft=True)
    w = torch.rand(2, 7, generator=torch.Generator().manual_seed(11), dtype=torch.float64) + 0.5
    x.requires_grad_(), t.requires_grad_(), w.requires_grad_()
    assert torch.autograd.gradcheck(lambda x, t, w: fit_softmax(x, t, 0.1, w, tol=1e-12), (x, t, w))
    # one input at a time (only the ones that need gradients are computed) and the unweighted mean
    x2 = x.detach().requires_grad_()
    assert torch.autograd.gradcheck(lambda x: fit_softmax(x, t.detach(), 0.1, tol=1e-12), (x2,))


def test_float32_backward_agrees_with_float64():
    x, t = problem(S=2, N=40, D=5, C=4, seed=12, soft=True)
    probe = torch.randn(2, 4, 5, generator=torch.Generator().manual_seed(13), dtype=torch.float64)
    grads = []
    for dtype in (torch.float32, torch.float64):
        xd = x.to(dtype).requires_grad_()
        (
            fit_softmax(xd, t.to(dtype), 0.01, tol=1e-6 if dtype == torch.float32 else 1e-10) * probe.to(dtype)
        ).sum().backward()
        grads.append(xd.grad.double())
    torch.testing.assert_close(grads[0], grads[1], atol=1e-4, rtol=1e-3)


def test_no_graph_without_inputs_that_need_gradients():
    x, t = problem(S=1, N=20, D=3, C=3)
    assert fit_softmax(x, t, 0.1).grad_fn is None
    assert fit_softmax(x.requires_grad_(), t, 0.1).grad_fn is not None


def test_autocast_region_gives_the_same_solution():
    x, t = problem(S=2, N=100, D=8, C=5, seed=14, dtype=torch.float32, soft=True)
    W = fit_softmax(x, t, 0.01)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        W_autocast = fit_softmax(x, t, 0.01)
    assert W_autocast.dtype == torch.float32
    assert torch.equal(W_autocast, W)
    # half-precision inputs are promoted to float32 (the input is already rounded, so the solution moves)
    W_bf16 = fit_softmax(x.bfloat16(), t, 0.01)
    assert W_bf16.dtype == torch.float32
    torch.testing.assert_close(W_bf16, fit_softmax(x.bfloat16().float(), t, 0.01), atol=0, rtol=0)


def test_unbatched_inputs_and_warm_start():
    x, t = problem(S=1, N=50, D=4, C=3, seed=15)
    W = fit_softmax(x[0], t[0], 0.01, tol=1e-10)
    assert W.shape == (3, 4)
    # started at its solution, one Newton step is more than it needs
    torch.testing.assert_close(fit_softmax(x[0], t[0], 0.01, tol=1e-8, init=W, max_iter=1), W, atol=0, rtol=0)
    torch.testing.assert_close(fit_softmax(x[0], t[0], 0.01, tol=1e-10, init=W + 0.1), W, atol=1e-9, rtol=0)


def test_non_convergence_raises_with_the_gradient_and_the_fix():
    x, t = problem(S=2, N=200, D=10, C=5, seed=16)
    with pytest.raises(ERMNotConverged, match=r"max \|grad\| = .* > tol = 1e-10.*raise max_iter.*l2") as info:
        fit_softmax(5 * x, t, 1e-4, tol=1e-10, max_iter=2)
    assert isinstance(info.value, RuntimeError) and info.value.max_grad > 1e-10


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"x": torch.randn(5)}, r"Expected x of .*\[S, N, D\] or \[N, D\], got torch.float32 \[5\]"),
        ({"x": torch.randn(2, 5, 3, 1)}, r"Expected x"),
        ({"targets": torch.ones(2, 6, 3)}, r"Expected targets of shape \[2, 5, C\]"),
        ({"targets": torch.ones(2, 5, 3, dtype=torch.long)}, r"Expected floating-point targets"),
        ({"weights": torch.ones(2, 4)}, r"Expected weights of shape \[2, 5\]"),
        ({"init": torch.zeros(2, 4, 3)}, r"Expected init of shape \[2, 3, 3\]"),
        ({"l2": 0.0}, r"Expected l2 > 0"),
        ({"l2": float("nan")}, r"Expected l2 > 0"),
        ({"tol": -1.0}, r"Expected tol > 0"),
        ({"max_iter": 0}, r"Expected max_iter >= 1"),
        ({"x": torch.full((2, 5, 3), float("nan"))}, r"Expected finite x, got 30 non-finite values"),
        ({"targets": torch.full((2, 5, 3), -0.5)}, r"Expected non-negative targets"),
        ({"weights": -torch.ones(2, 5)}, r"Expected non-negative weights"),
        ({"weights": torch.zeros(2, 5)}, r"positive sum"),
    ],
)
def test_invalid_inputs_raise_value_errors(kwargs, match):
    args = {"x": torch.randn(2, 5, 3), "targets": torch.full((2, 5, 3), 1 / 3), "l2": 0.1, "weights": None}
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        fit_softmax(**args)


def test_invalid_inputs_are_reported_together():
    with pytest.raises(ValueError, match=r"Expected l2 > 0.*; Expected tol > 0.*; Expected weights"):
        fit_softmax(torch.randn(4, 3), torch.ones(4, 2) / 2, -1.0, torch.ones(5), tol=0.0)


def test_predict_proba_is_the_mean_softmax_over_samples():
    g = torch.Generator().manual_seed(17)
    W, x = torch.randn(5, 3, 4, generator=g), torch.randn(8, 4, generator=g)
    probs = predict_proba(W, x)  # (M, C)
    assert probs.shape == (8, 3)
    torch.testing.assert_close(probs, torch.stack([torch.softmax(x @ W_s.T, -1) for W_s in W]).mean(0))
    torch.testing.assert_close(probs.sum(-1), torch.ones(8))
    torch.testing.assert_close(predict_proba(W[0], x), torch.softmax(x @ W[0].T, -1))
    with pytest.raises(ValueError, match=r"Expected W \[S, C, D\]"):
        predict_proba(W, torch.randn(8, 5))


def test_float32_stall_falls_back_to_float64():
    # A tolerance below what float32 can resolve: the float32 line search stalls, the float64 solve finishes.
    x, t = problem(S=2, N=300, D=12, C=4, seed=3)
    x32, t32 = (3 * x).float(), t.float()
    W = fit_softmax(x32, t32, 1e-3, tol=1e-9)
    assert W.dtype == torch.float32
    W64 = fit_softmax(x32.double(), t32.double(), 1e-3, tol=1e-9)
    torch.testing.assert_close(W.double(), W64, atol=1e-6, rtol=0)
