"""Batched ERM for S posterior samples (lightning_fl.oneshot.fit_softmax) against S scikit-learn fits.

FMP refits a bias-free linear softmax classifier (C x D) once per martingale-posterior sample. This
times one batched ``fit_softmax`` call for S samples against S sequential
``sklearn.linear_model.LogisticRegression(solver="lbfgs", fit_intercept=False)`` fits of the same
objectives, ``mean CE + (l2 / 2) ||W||^2`` (sklearn's ``C = 1 / (l2 * n)``), at the same tolerance:
both stop when the largest absolute entry of the gradient of that objective is ``<= tol`` (sklearn's
lbfgs passes ``tol`` to L-BFGS-B as ``gtol``, the max-norm of the projected gradient of this very
objective; without bounds that is the gradient). Parameter errors are reported against a float64
solve to ``tol = 1e-10``; the data: a 10-class Gaussian mixture in 128 dimensions with correlated,
standardised features. Every sample has the same ``n`` base points plus ``extra`` points of its own,
drawn afresh from the mixture (as an exact predictive would draw them), so the samples differ the way
martingale-posterior samples do. Both sides get the same number of CPU threads.

    python benchmarks/erm.py                      # n=5000 (+500 per sample), d=128, C=10, S=10, l2=1e-3
    python benchmarks/erm.py --threads 1 --l2 1e-4

Goal: ours / sklearn <= 0.3 in wall-clock time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import numpy as np
import torch
from sklearn.linear_model import LogisticRegression
from threadpoolctl import threadpool_limits

from lightning_fl.oneshot import fit_softmax


def make_data(n: int, extra: int, d: int, classes: int, samples: int, sep: float, seed: int):
    """Features ``[S, n + extra, d]`` (float64, standardised by the base points) and labels ``[S, n + extra]``."""
    rng = np.random.default_rng(seed)
    means = rng.normal(size=(classes, d)) * 3 * sep / np.sqrt(d)
    mixing = rng.normal(size=(d, d)) / np.sqrt(d) + np.eye(d)  # correlated features

    def draw(m: int) -> tuple[np.ndarray, np.ndarray]:
        y = rng.integers(0, classes, size=m)
        return (means[y] + rng.normal(size=(m, d))) @ mixing, y

    xb, yb = draw(n)
    mu, sd = xb.mean(0), xb.std(0)
    parts = [draw(extra) for _ in range(samples)]
    x = np.stack([np.concatenate([xb, xe]) for xe, _ in parts])
    y = np.stack([np.concatenate([yb, ye]) for _, ye in parts])
    return (x - mu) / sd, y


def time_ours(x: torch.Tensor, t: torch.Tensor, l2: float, tol: float, repeats: int) -> tuple[float, torch.Tensor]:
    fit_softmax(x, t, l2, tol=tol)  # warm-up (allocator, kernels)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        W = fit_softmax(x, t, l2, tol=tol)
        times.append(time.perf_counter() - t0)
    return statistics.median(times), W


def time_sklearn(x: np.ndarray, y: np.ndarray, l2: float, tol: float, repeats: int) -> tuple[float, np.ndarray, float]:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fits = [
            LogisticRegression(fit_intercept=False, C=1 / (l2 * len(ys)), tol=tol, max_iter=10_000).fit(xs, ys)
            for xs, ys in zip(x, y, strict=True)
        ]
        times.append(time.perf_counter() - t0)
    return statistics.median(times), np.stack([m.coef_ for m in fits]), float(np.mean([m.n_iter_[0] for m in fits]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=5000, help="base points shared by all samples")
    parser.add_argument("--extra", type=int, default=500, help="points of each sample's own")
    parser.add_argument("--d", type=int, default=128)
    parser.add_argument("--classes", type=int, default=10)
    parser.add_argument("--samples", type=int, default=10, help="posterior samples S")
    parser.add_argument("--l2", type=float, default=1e-3)
    parser.add_argument("--tol", type=float, default=1e-5, help="max |gradient| at which both solvers stop")
    parser.add_argument("--sep", type=float, default=1.0, help="class separation (1: ~90%% train accuracy)")
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="CPU threads for torch and sklearn's BLAS")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs; the median is reported")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    x, y = make_data(args.n, args.extra, args.d, args.classes, args.samples, args.sep, args.seed)
    xt = torch.from_numpy(x)
    onehot = torch.nn.functional.one_hot(torch.from_numpy(y), args.classes).double()
    W_ref = fit_softmax(xt, onehot, args.l2, tol=1e-10)

    with threadpool_limits(args.threads):
        sk_s, W_sk, sk_iter = time_sklearn(x, y, args.l2, args.tol, args.repeats)
    W_sk = torch.from_numpy(W_sk)
    rows = []
    for dtype in (torch.float32, torch.float64):
        ours_s, W = time_ours(xt.to(dtype), onehot.to(dtype), args.l2, args.tol, args.repeats)
        W = W.double()
        rows.append(
            {
                "dtype": str(dtype).removeprefix("torch."),
                "ours_s": ours_s,
                "sklearn_s": sk_s,
                "ratio": ours_s / sk_s,
                "max_abs_W_ours_minus_sklearn": float((W - W_sk).abs().max()),
                "max_abs_W_ours_minus_ref": float((W - W_ref).abs().max()),
                "max_abs_W_sklearn_minus_ref": float((W_sk - W_ref).abs().max()),
            }
        )

    N = args.n + args.extra
    print(
        f"S={args.samples} samples x N={N} points ({args.n} shared), D={args.d}, C={args.classes}, l2={args.l2:g}, "
        f"tol={args.tol:g} on max |grad|, {args.threads} thread(s); sklearn lbfgs: {sk_iter:.0f} iterations per fit"
    )
    print("ours in    ours s  sklearn s  ratio  |W-W_sk|  |W-W_ref|  |W_sk-W_ref|")
    for r in rows:
        keys = ("max_abs_W_ours_minus_sklearn", "max_abs_W_ours_minus_ref", "max_abs_W_sklearn_minus_ref")
        errors = "  ".join(f"{r[k]:9.2e}" for k in keys)
        print(f"{r['dtype']:8s} {r['ours_s']:8.3f} {r['sklearn_s']:10.3f} {r['ratio']:6.2f}  {errors}")
    print(json.dumps({**vars(args), "sklearn_iterations": sk_iter, "rows": rows}))


if __name__ == "__main__":
    main()
