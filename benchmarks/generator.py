"""Does the trained predictive generator beat naive resampling? Held-out scores on target tasks.

Trains FMP's predictive generator (``Z' = MAB(E, MAB(g(Z), E))``) on meta-training tasks with the
objective of :func:`lightning_fl.oneshot.predictive.generator_loss`, then scores points held out from
target-pool tasks (data the generator never saw) under three posterior predictives, each the mean
softmax of S models refit by the same ERM: on ``Z`` alone (``erm``), on ``Z`` plus a bootstrap
resample of ``Z`` (``bootstrap``, naive predictive resampling) and on ``Z`` plus generated points
(``generator``). Lower NLL is better.

The training is timed: it runs ``--repeats`` times, each from the same untrained generator and random state
(so each repeat trains the same generator; the last one is scored), and the min and median of its wall time
and of its CPU time (user + system, all threads) are printed, with the torch thread count and the load
average before and after (``--json PATH`` also writes the timings and scores with the machine's state).

    python benchmarks/generator.py --data digits
    python benchmarks/generator.py --data fashion_mnist --gamma 0   # without the pseudo-data term
    python benchmarks/generator.py --data digits --repeats 1 --json generator.json

Fashion-MNIST features come from the extractor of configs/fmp_fashion_mnist.yaml (cached).
"""

from __future__ import annotations

import argparse
import copy

import torch
from _harness import Sample, add_arguments, fmt, machine, measure, report, spread

from lightning_fl.data import Digits, FashionMNIST
from lightning_fl.models import SmallCNN
from lightning_fl.oneshot import (
    ExtractedFeatures,
    FederatedTasks,
    GeneratorTraining,
    PixelFeatures,
    PredictiveGenerator,
)
from lightning_fl.oneshot.generator_training import evaluate_generator, train_generator


def tasks(name: str, seed: int) -> FederatedTasks:
    if name == "digits":
        return FederatedTasks(
            PixelFeatures(Digits()),
            num_clients=4,
            points_per_client=50,
            target_fraction=0.4,
            heldout_points=100,
            min_classes=5,
            seed=seed,
        )
    torch.manual_seed(seed)  # the extractor's initial weights are part of its cache key
    backbone = SmallCNN(in_channels=1, image_size=28, channels=[32, 64], feature_dim=128, norm_groups=8)
    features = ExtractedFeatures(FashionMNIST(), backbone, feature_dim=128, epochs=4, lr=0.05)
    return FederatedTasks(features, num_clients=10, points_per_client=100, min_classes=5, seed=seed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", choices=["digits", "fashion_mnist"], default="digits")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--hidden", type=int, default=None, help="default: 64 (digits), 128 (fashion_mnist)")
    parser.add_argument("--num-generated", type=int, default=None, help="default: 100 (digits), 200")
    parser.add_argument("--l2", type=float, default=0.01)
    parser.add_argument("--beta", type=float, default=0.1)
    parser.add_argument("--gamma", type=float, default=0.0)
    parser.add_argument("--labels", choices=["sampled", "predictive", "learned"], default="learned")
    parser.add_argument("--eval-tasks", type=int, default=16)
    parser.add_argument("--samples", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None)
    add_arguments(parser, repeats=3)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    machine_before = machine()
    dm = tasks(args.data, args.seed)
    dm.prepare_data()
    dm.setup("fit")
    hidden = args.hidden or (64 if args.data == "digits" else 128)
    n_new = args.num_generated or (100 if args.data == "digits" else 200)
    torch.manual_seed(args.seed)
    generator = PredictiveGenerator(hidden, 4, labels=args.labels, label_l2=args.l2)
    generator.configure(dm.feature_dim, dm.num_classes)
    target = dm.target_sampler(heldout=True)
    before = evaluate_generator(generator, target, args.eval_tasks, args.l2, n_new, args.samples)
    recipe = GeneratorTraining(steps=args.steps, beta=args.beta, gamma=args.gamma, seed=args.seed)
    untrained, rng = copy.deepcopy(generator), torch.get_rng_state()
    samples: list[Sample] = []
    trained: list[PredictiveGenerator] = []
    for _ in range(args.repeats):  # each from the same start: the same training, timed again
        generator = copy.deepcopy(untrained)
        torch.set_rng_state(rng)
        samplers = dm.meta_samplers(heldout=True)
        _, sample = measure(
            lambda g=generator, s=samplers: train_generator(g, s, recipe, args.l2, n_new, task_seed_offset=10**7)
        )
        samples.append(sample)
        trained.append(generator)
    same = all(
        torch.equal(a, b)
        for g in trained[1:]
        for a, b in zip(trained[0].state_dict().values(), g.state_dict().values(), strict=True)
    )
    del trained[:-1]
    after = evaluate_generator(generator, target, args.eval_tasks, args.l2, n_new, args.samples)
    timing = {"wall": spread(s.wall for s in samples), "cpu": spread(s.cpu for s in samples)}
    print(
        f"{args.data}: {args.steps} steps (labels {args.labels}, beta {args.beta}, gamma {args.gamma}, l2 {args.l2}, "
        f"n' {n_new}, S {args.samples}, {args.eval_tasks} target tasks x {dm.heldout_points} held-out points)"
    )
    print(
        f"training over {args.repeats} repeat(s): wall {fmt(timing['wall'], digits=1)}; CPU "
        f"{fmt(timing['cpu'], digits=1)}" + ("" if same else " (the repeats trained different generators)")
    )
    print("| predictive | held-out NLL | held-out acc |\n| --- | --- | --- |")
    for name in ("erm", "bootstrap"):
        print(f"| {name} | {after[name + '_nll']:.4f} | {after[name + '_acc']:.4f} |")
    print(f"| generator, untrained | {before['generator_nll']:.4f} | {before['generator_acc']:.4f} |")
    print(f"| generator, trained | {after['generator_nll']:.4f} | {after['generator_acc']:.4f} |")
    print(
        f"generated label entropy: {after['generated_label_entropy']:.3f} nats (uniform: "
        f"{torch.log(torch.tensor(float(dm.num_classes))):.3f})"
    )
    settings = {k: str(v) if k == "json" and v is not None else v for k, v in vars(args).items()}
    results = {**settings, "hidden": hidden, "num_generated": n_new, "training": timing, "repeats_identical": same}
    results.update(untrained={k: float(v) for k, v in before.items()}, trained={k: float(v) for k, v in after.items()})
    report("generator", machine_before, {**results, "raw": samples}, args.json)


if __name__ == "__main__":
    main()
