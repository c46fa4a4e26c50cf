"""pfl-research's side of benchmarks/pfl_comparison.py: run in pfl's own virtual environment, never imported by ours.

Trains the comparison's CNN with pfl's simulation (``PyTorchModel``, ``FederatedAveraging``, ``SimulatedBackend``) on
the clients and initial weights ``pfl_comparison.py`` wrote to ``DIR``, one torch thread, and takes part in the
alternation through stdin and stdout: after the first (warm-up) round it prints ``ready``; after every later round it
prints that round's CPU seconds (``time.process_time``, from the end of the previous round, outside the wait for the
next ``go``) and, but after the last, waits for a ``go`` line.

    python _pfl_side.py DIR ROUNDS
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np
import torch
from pfl.aggregate.simulate import SimulatedBackend
from pfl.algorithm import FederatedAveraging, NNAlgorithmParams
from pfl.callback.base import TrainingProcessCallback
from pfl.data.federated_dataset import FederatedDataset
from pfl.data.sampling import get_user_sampler
from pfl.hyperparam import NNEvalHyperParams, NNTrainHyperParams
from pfl.metrics import Metrics, Weighted
from pfl.model.pytorch import PyTorchModel
from torch import nn


class PlainCNN(nn.Module):
    """The comparison's network (benchmarks/client_overhead.py's ``PlainCNN`` and its linear head), with the same
    parameter names, so the initial state dict loads strictly; with the ``loss`` and ``metrics`` pfl asks for."""

    def __init__(self, image_size: int = 28, classes: int = 10) -> None:
        super().__init__()
        self.backbone = nn.Module()
        self.backbone.features = nn.Sequential(
            nn.Conv2d(1, 32, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.backbone.fc = nn.Linear(64 * (image_size // 4) ** 2, 128)
        self.head = nn.Linear(128, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        features = torch.relu(self.backbone.fc(torch.flatten(self.backbone.features(x), 1)))
        return self.head(features)

    def loss(self, x: torch.Tensor, y: torch.Tensor, eval: bool = False) -> torch.Tensor:
        self.eval() if eval else self.train()
        return nn.functional.cross_entropy(self(x), y.long())  # (pfl's to_tensor makes the labels float)

    @torch.no_grad()
    def metrics(self, x: torch.Tensor, y: torch.Tensor, eval: bool = True) -> dict:
        self.eval() if eval else self.train()
        logits, y = self(x), y.long()
        loss = nn.functional.cross_entropy(logits, y, reduction="sum").item()
        return {"loss": Weighted(loss, len(y)), "accuracy": Weighted((logits.argmax(1) == y).sum().item(), len(y))}


class Alternate(TrainingProcessCallback):
    """Prints each round's CPU seconds and waits for the next ``go`` (see the module docstring)."""

    def __init__(self, rounds: int) -> None:
        self.rounds, self.mark = rounds, time.process_time()
        self.lines = os.fdopen(os.dup(1), "w", buffering=1)  # the alternation's own channel
        os.dup2(2, 1)  # whatever else writes to stdout goes to stderr
        sys.stdout = sys.stderr

    def after_central_iteration(self, aggregate_metrics, model, *, central_iteration: int):
        elapsed = time.process_time() - self.mark
        print("ready" if central_iteration == 0 else f"{elapsed!r}", file=self.lines, flush=True)
        if central_iteration < self.rounds and sys.stdin.readline().strip() != "go":
            return True, Metrics()  # the parent stopped
        self.mark = time.process_time()
        return False, Metrics()


def main() -> None:
    folder, rounds = sys.argv[1], int(sys.argv[2])
    torch.set_num_threads(1)
    data = torch.load(f"{folder}/clients.pt")
    x, y, clients, settings = data["x"].numpy(), data["y"].numpy(), data["clients"], data["settings"]
    users = {c: [x[idx], y[idx]] for c, idx in enumerate(clients)}
    np.random.seed(0)
    torch.manual_seed(0)
    training = FederatedDataset.from_slices(users, get_user_sampler("minimize_reuse", list(users)))
    validation = FederatedDataset.from_slices(users, get_user_sampler("minimize_reuse", list(users)))
    net = PlainCNN(settings["image_size"])
    net.load_state_dict(torch.load(f"{folder}/init.pt"))
    model = PyTorchModel(
        model=net, local_optimizer_create=torch.optim.Adam, central_optimizer=torch.optim.SGD(net.parameters(), lr=1.0)
    )
    FederatedAveraging().run(
        algorithm_params=NNAlgorithmParams(
            central_num_iterations=rounds + 1,
            evaluation_frequency=10**9,
            train_cohort_size=settings["clients"],
            val_cohort_size=0,
        ),
        backend=SimulatedBackend(training_data=training, val_data=validation),
        model=model,
        model_train_params=NNTrainHyperParams(
            local_learning_rate=settings["lr"], local_num_epochs=1, local_batch_size=settings["batch"]
        ),
        model_eval_params=NNEvalHyperParams(local_batch_size=settings["batch"]),
        callbacks=[Alternate(rounds)],
    )


if __name__ == "__main__":
    main()
