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

After one warm-up call of ours per dtype, the three sides (sklearn, ours in float32, ours in float64) take
turns ``--repeats`` times. It prints, per side, the min and median of the wall time and of the CPU time
(user + system, all threads), per dtype the min and median of the per-repeat ratio ours / sklearn (wall and
CPU), the torch thread count and the load average before and after, and last its results as one JSON line
(``--json PATH`` also writes them with the machine's state to a file).

    python benchmarks/erm.py                      # n=5000 (+500 per sample), d=128, C=10, S=10, l2=1e-3
    python benchmarks/erm.py --threads 1 --l2 1e-4
    python benchmarks/erm.py --threads 1 --repeats 5 --json erm.json

Goal: ours / sklearn <= 0.3 in wall-clock time (the median of the per-repeat ratios).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import numpy as np
import torch
from _harness import add_arguments, alternate, fmt, machine, ratios, report, summarise
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


def fit_sklearn(x: np.ndarray, y: np.ndarray, l2: float, tol: float) -> list[LogisticRegression]:
    """One sklearn fit per sample, one after another."""
    return [
        LogisticRegression(fit_intercept=False, C=1 / (l2 * len(ys)), tol=tol, max_iter=10_000).fit(xs, ys)
        for xs, ys in zip(x, y, strict=True)
    ]


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
    add_arguments(parser, repeats=3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    before = machine()

    x, y = make_data(args.n, args.extra, args.d, args.classes, args.samples, args.sep, args.seed)
    xt = torch.from_numpy(x)
    onehot = torch.nn.functional.one_hot(torch.from_numpy(y), args.classes).double()
    W_ref = fit_softmax(xt, onehot, args.l2, tol=1e-10)

    dtypes = {"float32": torch.float32, "float64": torch.float64}
    inputs = {name: (xt.to(dtype), onehot.to(dtype)) for name, dtype in dtypes.items()}
    last: dict[str, object] = {}

    def sklearn() -> None:
        last["sklearn"] = fit_sklearn(x, y, args.l2, args.tol)

    def ours(name: str):
        def run() -> None:
            last[name] = fit_softmax(*inputs[name], args.l2, tol=args.tol)

        return run

    sides = {"sklearn": sklearn, **{f"ours {name}": ours(name) for name in dtypes}}
    with threadpool_limits(args.threads):  # sklearn's BLAS (and OpenMP, as torch's) get args.threads threads
        for name in dtypes:
            ours(name)()  # warm-up (allocator, kernels)
        samples = alternate(sides, args.repeats)
    summary = summarise(samples)

    fits = last["sklearn"]
    W_sk = torch.from_numpy(np.stack([m.coef_ for m in fits]))
    sk_iter = float(np.mean([m.n_iter_[0] for m in fits]))
    rows = []
    for name in dtypes:
        W = last[name].double()
        per_repeat = ratios(samples, f"ours {name}", "sklearn")
        rows.append(
            {
                "dtype": name,
                "ours_s": summary[f"ours {name}"]["wall"]["median"],
                "sklearn_s": summary["sklearn"]["wall"]["median"],
                "ratio": per_repeat["wall"]["median"],
                "ours": summary[f"ours {name}"],
                "sklearn": summary["sklearn"],
                "ratio_per_repeat": per_repeat,
                "max_abs_W_ours_minus_sklearn": float((W - W_sk).abs().max()),
                "max_abs_W_ours_minus_ref": float((W - W_ref).abs().max()),
                "max_abs_W_sklearn_minus_ref": float((W_sk - W_ref).abs().max()),
            }
        )

    N = args.n + args.extra
    print(
        f"S={args.samples} samples x N={N} points ({args.n} shared), D={args.d}, C={args.classes}, l2={args.l2:g}, "
        f"tol={args.tol:g} on max |grad|, {args.threads} thread(s); sklearn lbfgs: {sk_iter:.0f} iterations per fit; "
        f"{args.repeats} repeats, alternated"
    )
    for side in sides:
        print(f"{side:<14} wall {fmt(summary[side]['wall'])}; CPU {fmt(summary[side]['cpu'])}")
    print("ours in   ratio wall (min, median)  ratio CPU (min, median)  |W-W_sk|  |W-W_ref|  |W_sk-W_ref|")
    for r in rows:
        keys = ("max_abs_W_ours_minus_sklearn", "max_abs_W_ours_minus_ref", "max_abs_W_sklearn_minus_ref")
        errors = "  ".join(f"{r[k]:9.2e}" for k in keys)
        wall, cpu = r["ratio_per_repeat"]["wall"], r["ratio_per_repeat"]["cpu"]
        print(
            f"{r['dtype']:8s} {wall['min']:9.3f} {wall['median']:9.3f}        {cpu['min']:9.3f} {cpu['median']:9.3f}"
            f"       {errors}"
        )
    settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    results = {**settings, "sklearn_iterations": sk_iter, "rows": rows}
    report("erm", before, {**results, "raw": samples}, args.json)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
