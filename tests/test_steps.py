"""The one step loop (``lightning_fl.steps``): a client's round and a base's pretraining train alike."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_fl.compress import FP32
from lightning_fl.context import StepContext, attached
from lightning_fl.errors import ConfigError
from lightning_fl.federated import LocalTraining, run_client
from lightning_fl.federated.clients.client import ClientJob, _cpu_fabric
from lightning_fl.methods import Classifier, Recipe
from lightning_fl.methods.centralised import train_classifier
from lightning_fl.models import SmallCNN
from lightning_fl.steps import train_steps


def data(n: int = 72, batch: int = 16) -> DataLoader:
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(n, 1, 8, 8, generator=g), torch.randint(0, 10, (n,), generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=batch, shuffle=False)


def classifier(**recipe) -> Classifier:
    torch.manual_seed(0)
    return Classifier(
        SmallCNN(in_channels=1, image_size=8, channels=[8, 16], norm_groups=4),
        num_classes=10,
        recipe=Recipe(warmup_epochs=0, schedule="constant", **recipe),
    )


@pytest.mark.parametrize(
    "recipe",
    [
        {"optimizer": "adam", "lr": 0.01, "grad_clip": 0.05},
        {"optimizer": "sgd", "lr": 0.1, "momentum": 0.9, "weight_decay": 5e-4},
    ],
    ids=["adam-clipped", "sgd"],
)
def test_a_client_round_equals_an_epoch_of_pretraining_bit_for_bit(recipe):
    loader = data()
    dm = SimpleNamespace(
        client_dataloader=lambda client, seed: loader,
        client_num_samples=lambda client: 72,
        train_dataloader=lambda: loader,
        val_dataloader=lambda: loader,
    )
    client, central = classifier(**recipe), classifier(**recipe)
    start = client.federated_state()
    result = run_client(ClientJob(client, dm, start, 0, 0, FP32(), LocalTraining(epochs=2)), 0)
    uploaded = FP32().decode(result.payload, start, 0)
    train_classifier(central, dm, epochs=2, accelerator="cpu")
    trained = central.federated_state()
    assert uploaded.keys() == trained.keys()
    assert all(torch.equal(uploaded[k], trained[k]) for k in trained)
    assert any(not torch.equal(uploaded[k], start[k]) for k in start)  # (it trained)


def test_steps_cycle_the_data_and_stop_at_the_count_and_an_empty_loader_is_refused():
    model = classifier(optimizer="sgd", lr=0.1)
    fabric = _cpu_fabric()
    optimizer = fabric.setup_optimizers(model.make_optimizer(list(model.parameters())))
    context, seen = StepContext(None, sync=False), []
    with attached(model, context):
        taken = train_steps(
            model,
            optimizer,
            None,
            data(),
            fabric,
            context,
            steps=7,
            after_batch=lambda epoch, batch: seen.append((epoch, batch)),
        )
    assert taken == 7 and context.global_step == 7
    assert seen == [(0, b) for b in range(5)] + [(1, 0), (1, 1)]  # 72 samples in batches of 16: 5 a pass
    assert context.weight == 16 and context.weighted("train/loss")[1] == 7 * 16 - 8  # 4 full and one of 8
    with pytest.raises(ConfigError, match="client 4 has no training batches"):
        train_steps(model, optimizer, None, [], fabric, context, steps=3, no_batches="client 4 has no training batches")
