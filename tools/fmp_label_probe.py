"""How much a summary's labels matter to FMP: the distance to centralised MP with several summaries of the same
held-out tasks (docs/results-fmp.md, "The paper's linear read-out").

For each validation task of the config (the tasks ``validate`` scores), with the run's predictive and base sets as
in validation, the mean ``||theta_MP - theta_FMP||`` when every client uploads

* ``summariser``: the checkpoint's meta-trained summariser;
* ``kmeans``: the k-means centres of its points (features and the clusters' label distributions);
* ``kmeans_uniform_labels``: the same centres with uniform labels;
* ``random``: s of its points chosen at random;
* ``summariser_features_kmeans_labels``: the summariser's features, each with the label of its nearest centre;

and the mean entropy of the summariser's labels (``log C`` = uniform).

    python tools/fmp_label_probe.py fit --config configs/fmp_digits.yaml --model.summariser.readout linear \\
        --ckpt_path runs/fmp_digits/version_0/checkpoints/last.ckpt
"""

from __future__ import annotations

import argparse
import math
import sys

import torch

from lightning_fl.checkpoint import read_checkpoint
from lightning_fl.cli import build
from lightning_fl.oneshot import KMeans, RandomSelection, Summariser
from lightning_fl.oneshot.tasks import split_points


class _Relabelled(Summariser):
    """Another summariser's points with labels taken from the k-means centres: uniform, or the nearest centre's."""

    def __init__(self, features: Summariser, labels: str) -> None:
        super().__init__(features.num_points)
        self.features, self.labels = features, labels

    def forward(self, z, generator=None):
        C = self.num_classes
        h, _ = split_points(self.features(z, generator), C)
        centres = KMeans(self.num_points)(z, generator)
        hk, pk = split_points(centres, C)
        if self.labels == "uniform":
            return torch.cat([hk, torch.full_like(pk, 1.0 / C)], -1)
        nearest = torch.cdist(h.float(), hk.float()).argmin(-1)
        return torch.cat([h, torch.gather(pk, 1, nearest.unsqueeze(-1).expand(-1, -1, C))], -1)


def probe(model, datamodule) -> dict[str, float]:
    datamodule.prepare_data()
    datamodule.setup("validate")
    D, C = datamodule.feature_dim, datamodule.num_classes
    s = model.summariser.num_points
    candidates: dict[str, Summariser] = {
        "summariser": model.summariser,
        "kmeans": KMeans(s),
        "kmeans_uniform_labels": _Relabelled(KMeans(s), "uniform"),
        "random": RandomSelection(s),
        "summariser_features_kmeans_labels": _Relabelled(model.summariser, "nearest"),
    }
    for candidate in candidates.values():
        if not candidate.feature_dim:
            candidate.configure(D, C)
    sampler = datamodule.target_sampler()
    totals = dict.fromkeys(candidates, 0.0)
    entropy = 0.0
    with torch.no_grad():
        for i in range(datamodule.val_tasks):  # the validation tasks and base sets of FMPMetaLearner
            task = sampler.sample(10**6 + i)
            noise = model.generator.noise(
                1, model.test_samples, model.num_generated, generator=torch.Generator().manual_seed(i)
            )
            clients = task.clients.unsqueeze(0)
            B, M, n, P = clients.shape
            target = model._sample(clients.reshape(B, M * n, P), noise)
            for name, candidate in candidates.items():
                g = torch.Generator().manual_seed(i)
                totals[name] += float(model.theta_distance(clients, candidate, noise, target, generator=g).mean())
            p = split_points(model.summariser(task.clients), C)[1]
            entropy += float(-(p * p.clamp_min(1e-12).log()).sum(-1).mean())
    out = {name: total / datamodule.val_tasks for name, total in totals.items()}
    out["summariser_label_entropy"] = entropy / datamodule.val_tasks
    out["uniform_label_entropy"] = math.log(C)
    return out


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ckpt_path", required=True)
    known, rest = parser.parse_known_args(argv)
    run = build(rest)
    ckpt = read_checkpoint(known.ckpt_path, "--ckpt_path")
    model, datamodule = run.model, run.data
    model.trainer = None
    model.summariser.configure(datamodule.feature_dim, datamodule.num_classes)
    model.generator.configure(datamodule.feature_dim, datamodule.num_classes)
    model.load_state_dict(ckpt["state_dict"])
    model.eval()
    for name, value in probe(model, datamodule).items():
        print(f"{name:36s} {value:.4f}")


if __name__ == "__main__":
    main()
