"""pfl-research's side of benchmarks/pfl_comparison.py: run in pfl's own virtual environment, never imported by ours.

Trains the comparison's CNN with pfl's simulation (``PyTorchModel``, ``FederatedAveraging``, ``SimulatedBackend``) on
the clients and initial weights ``pfl_comparison.py`` wrote to ``DIR``, one torch thread, and takes part in the
alternation through stdin and stdout: after the first (warm-up) round it prints ``ready``; after every later round it
prints that round's CPU seconds (``time.process_time``, from the end of the previous round, outside the wait for the
next ``go``) and, but after the last, waits for a ``go`` line. After the last round it writes its global weights to
``DIR/final_<tag>_pfl.pt`` (``pfl_comparison.py`` compares them with ours).

``SETTING`` (JSON, written by ``pfl_comparison.py``) says what to train and how pfl is fed:

- ``model``: ``plain`` or ``groupnorm`` (the networks of benchmarks/client_overhead.py, with their parameter names, so
  the initial state dict ``DIR/init_<model>.pt`` loads strictly);
- ``optimizer``: ``adam`` (``torch.optim.Adam``) or ``sgd-momentum`` (``torch.optim.SGD`` with ``momentum``), at
  ``lr``, no weight decay; the central optimiser is SGD at 1.0 (FedAvg);
- ``evaluate``: pfl's ``CentralEvaluationCallback`` every round on the held-out images (``eval_x``, ``eval_y`` in
  ``DIR/clients.pt``, numpy arrays in a ``Dataset``, as pfl's benchmarks make their central data set), batches of
  ``eval_batch``;
- ``pfl_feed``: ``slices`` (``FederatedDataset.from_slices`` of each user's numpy arrays) or ``dataset`` (pfl's
  documented path for PyTorch: the images held as torch tensors made by pfl's ``to_tensor``, as its PyTorch benchmarks
  hold them, and ``FederatedDataset(make_dataset_fn, user_sampler)`` whose ``make_dataset_fn`` gathers the sampled
  user's rows into a ``PyTorchTensorDataset``).

Either way the user sampler replays our trainer's cohorts: user ``k`` of ``DIR/clients.pt`` is one client in one
round, its images in the order our client's loader serves them in that round, so both sides take the same steps on
the same batches.

    python _pfl_side.py DIR ROUNDS SETTING
"""

from __future__ import annotations

import functools
import json
import os
import sys
import time

import torch
from pfl.aggregate.simulate import SimulatedBackend
from pfl.algorithm import FederatedAveraging, NNAlgorithmParams
from pfl.callback.base import TrainingProcessCallback
from pfl.callback.central_evaluation import CentralEvaluationCallback
from pfl.data.dataset import Dataset
from pfl.data.federated_dataset import FederatedDataset
from pfl.data.pytorch import PyTorchTensorDataset
from pfl.hyperparam import NNEvalHyperParams, NNTrainHyperParams
from pfl.internal.ops.pytorch_ops import to_tensor
from pfl.metrics import Metrics, Weighted
from pfl.model.pytorch import PyTorchModel
from torch import nn


def features(model: str) -> nn.Sequential:
    """The two conv stages: ``plain`` (conv with bias, ReLU, pool) or ``groupnorm`` (conv without bias, GroupNorm of
    8 groups, in-place ReLU, pool: the quickstart's SmallCNN)."""
    if model == "plain":
        return nn.Sequential(
            nn.Conv2d(1, 32, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
    return nn.Sequential(
        nn.Conv2d(1, 32, 3, padding=1, bias=False),
        nn.GroupNorm(8, 32),
        nn.ReLU(True),
        nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1, bias=False),
        nn.GroupNorm(8, 64),
        nn.ReLU(True),
        nn.MaxPool2d(2),
    )


class ComparisonCNN(nn.Module):
    """The comparison's network (benchmarks/client_overhead.py's ``PlainCNN``, or the quickstart's ``SmallCNN``, and
    the trainable linear head), with the same parameter names; with the ``loss`` and ``metrics`` pfl asks for."""

    def __init__(self, model: str = "plain", image_size: int = 28, classes: int = 10) -> None:
        super().__init__()
        self.backbone = nn.Module()
        self.backbone.features = features(model)
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


def replay(count: int):
    """A user sampler returning users ``0, 1, ..., count - 1`` in turn (our cohorts, round after round)."""
    users = iter(range(count))
    return lambda: next(users)


def federated_data(data: dict, feed: str) -> FederatedDataset:
    """The training users of ``data`` (``clients.pt``) as pfl is fed them with ``feed`` (the module docstring)."""
    bounds = data["bounds"]
    if feed == "slices":
        x, y = data["x"].numpy(), data["y"].numpy()
        users = {k: [x[start:stop], y[start:stop]] for k, (start, stop) in enumerate(bounds)}
        return FederatedDataset.from_slices(users, replay(len(bounds)))
    images, labels = to_tensor(data["x"].numpy()), to_tensor(data["y"].numpy())
    rows = [torch.arange(start, stop) for start, stop in bounds]

    def make_dataset_fn(user: int) -> PyTorchTensorDataset:
        return PyTorchTensorDataset((images[rows[user]], labels[rows[user]]), user_id=user)

    return FederatedDataset(make_dataset_fn, replay(len(bounds)))


def main() -> None:
    folder, rounds, setting = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
    torch.set_num_threads(1)
    data = torch.load(f"{folder}/clients.pt")
    settings = data["settings"]
    training = federated_data(data, setting["pfl_feed"])
    unused = FederatedDataset.from_slices({0: [data["x"][:1].numpy(), data["y"][:1].numpy()]}, lambda: 0)
    net = ComparisonCNN(setting["model"], settings["image_size"])
    net.load_state_dict(torch.load(f"{folder}/init_{setting['model']}.pt"))
    if setting["optimizer"] == "adam":
        local = torch.optim.Adam
    else:
        local = functools.partial(torch.optim.SGD, momentum=setting["momentum"])
    model = PyTorchModel(
        model=net, local_optimizer_create=local, central_optimizer=torch.optim.SGD(net.parameters(), lr=1.0)
    )
    callbacks: list[TrainingProcessCallback] = []
    if setting["evaluate"]:
        central = Dataset(raw_data=[data["eval_x"].numpy(), data["eval_y"].numpy()])
        eval_params = NNEvalHyperParams(local_batch_size=settings["eval_batch"])
        callbacks.append(CentralEvaluationCallback(central, model_eval_params=eval_params, frequency=1))
    callbacks.append(Alternate(rounds))  # last: a round's time includes its evaluation
    FederatedAveraging().run(
        algorithm_params=NNAlgorithmParams(
            central_num_iterations=rounds + 1,
            evaluation_frequency=10**9,
            train_cohort_size=settings["clients"],
            val_cohort_size=0,
        ),
        backend=SimulatedBackend(training_data=training, val_data=unused),
        model=model,
        model_train_params=NNTrainHyperParams(
            local_learning_rate=setting["lr"], local_num_epochs=1, local_batch_size=settings["batch"]
        ),
        model_eval_params=NNEvalHyperParams(local_batch_size=settings["batch"]),
        callbacks=callbacks,
    )
    torch.save(net.state_dict(), f"{folder}/final_{setting['tag']}_pfl.pt")


if __name__ == "__main__":
    main()
