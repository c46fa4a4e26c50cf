import itertools
import math

import lightning as L
import pytest
import torch

from lightning_fl.data import FederatedDataModule, Synthetic
from lightning_fl.errors import CheckpointError, ConfigError
from lightning_fl.methods import Classifier, Pretraining, Recipe, TrainingDivergedError, warmup_cosine_factor
from lightning_fl.models import SmallCNN


def make_model(**kwargs) -> Classifier:
    return Classifier(backbone=SmallCNN(image_size=8, channels=[8, 16], norm_groups=4), num_classes=10, **kwargs)


def test_warmup_then_cosine_to_zero():
    f = [warmup_cosine_factor(s, warmup_steps=3, total_steps=13) for s in range(14)]
    assert f[:3] == pytest.approx([1 / 3, 2 / 3, 1.0])
    assert f[3] == pytest.approx(1.0) and f[8] == pytest.approx(0.5) and f[13] == pytest.approx(0.0)
    assert all(a >= b for a, b in itertools.pairwise(f[2:]))
    assert warmup_cosine_factor(10, 3, 13, "constant") == 1.0
    assert warmup_cosine_factor(0, 0, 10) == 1.0


def test_only_trainable_parameters_reach_the_optimiser_and_the_frozen_head_stays_put():
    model = make_model(
        recipe=Recipe(warmup_epochs=0, schedule="constant")
    )  # without a trainer: a federated client's optimiser
    optimizer = model.configure_optimizers()
    params = {id(p) for group in optimizer.param_groups for p in group["params"]}
    assert id(model.head.weight) not in params
    assert params == {id(p) for p in model.backbone.parameters()}
    assert optimizer.defaults["lr"] == 0.05 and optimizer.defaults["momentum"] == 0.9
    assert optimizer.defaults["weight_decay"] == 5e-4
    head_before = model.head.weight.clone()
    loss = torch.nn.functional.cross_entropy(model(torch.randn(4, 1, 8, 8)), torch.tensor([0, 1, 2, 3]))
    loss.backward()
    optimizer.step()
    assert torch.equal(model.head.weight, head_before)


def test_trainable_head_is_optimised():
    model = make_model(
        head="trainable", recipe=Recipe(optimizer="adamw", lr=1e-3, warmup_epochs=0, schedule="constant")
    )
    optimizer = model.configure_optimizers()
    params = {id(p) for group in optimizer.param_groups for p in group["params"]}
    assert id(model.head.weight) in params and isinstance(optimizer, torch.optim.AdamW)


def test_invalid_hyperparameters_are_gathered_into_one_message():
    with pytest.raises(ConfigError) as info:
        make_model(recipe=Recipe(lr=0, momentum=1.5, warmup_epochs=-1))
    assert "model.recipe.lr" in str(info.value) and "model.recipe.momentum" in str(info.value)
    assert "model.recipe.warmup_epochs" in str(info.value)


def test_the_recipe_is_one_value_saved_as_plain_data():
    model = make_model(recipe=Recipe(optimizer="adamw", lr=1e-3, warmup_epochs=0, schedule="constant", grad_clip=2.0))
    assert model.hparams["recipe"] == {
        "optimizer": "adamw",
        "lr": 1e-3,
        "momentum": 0.9,
        "weight_decay": 5e-4,
        "nesterov": False,
        "warmup_epochs": 0,
        "schedule": "constant",
        "grad_clip": 2.0,
    }
    assert not {"lr", "optimizer", "grad_clip"} & set(model.hparams)  # one value, not eight keys
    group = model.configure_optimizers().param_groups[0]
    assert (group["lr"], group["weight_decay"]) == (1e-3, 5e-4)
    with pytest.raises(ConfigError, match="model.recipe must be a lightning_fl.Recipe, got dict"):
        make_model(recipe={"lr": 0.1})


def test_the_pretraining_recipe_is_checked_and_named_under_its_own_key():
    with pytest.raises(ConfigError, match=r"model.pretraining.epochs must be >= 1, got 0; model.pretraining.lr must"):
        Pretraining(epochs=0, lr=-1.0)
    pretraining = Pretraining(epochs=2, optimizer="adam", lr=0.02, weight_decay=0.0, warmup_epochs=0.5)
    module = make_model(pretraining=pretraining).pretraining_module()
    assert module.recipe == Recipe("adam", 0.02, 0.9, 0.0, False, 0.5, "cosine", None) == pretraining.recipe()


def test_nan_loss_stops_training_with_a_clear_error():
    model = make_model()
    with torch.no_grad():
        model.backbone.fc.weight.fill_(float("nan"))
    with pytest.raises(TrainingDivergedError, match="Lower model.recipe.lr"):
        model.training_step((torch.randn(4, 1, 8, 8), torch.tensor([0, 1, 2, 3])), 0)


def test_data_mismatch_names_the_keys():
    model = make_model()
    dm = FederatedDataModule(Synthetic(num_classes=5, image_size=8), num_clients=1)
    with pytest.raises(ConfigError, match="model.num_classes=10 but the data has 5 classes"):
        model.check_data(dm)
    dm = FederatedDataModule(Synthetic(channels=3, image_size=16), num_clients=1)
    with pytest.raises(ConfigError, match="in_channels=1 but the data has 3 channels"):
        model.check_data(dm)


def test_init_from_loads_backbone_and_head(tmp_path):
    source = make_model(head="trainable")
    path = tmp_path / "w.ckpt"
    torch.save({"state_dict": source.state_dict(), "epoch": 3}, path)
    target = make_model(head="trainable", init_from=str(path))
    for key, value in source.state_dict().items():
        assert torch.equal(value, target.state_dict()[key]), key
    torch.save({"state_dict": make_model(head="orthogonal").state_dict()}, path)
    with pytest.raises(CheckpointError, match="missing 1 weights"):
        make_model(head="trainable", init_from=str(path))
    with pytest.raises(CheckpointError, match="does not exist"):
        make_model(init_from=str(tmp_path / "nope.ckpt"))


def test_init_from_refuses_pickled_code(tmp_path):
    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    path = tmp_path / "evil.ckpt"
    torch.save({"state_dict": Evil()}, path)
    with pytest.raises(CheckpointError, match="weights_only=True"):
        make_model(init_from=str(path))


def test_trainer_schedule_warms_up_over_three_epochs(tmp_path):
    L.seed_everything(0)
    dm = FederatedDataModule(Synthetic(train_size=320, test_size=64), num_clients=1, batch_size=32)
    model = make_model()
    lrs = []

    class Record(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            lrs.append(trainer.optimizers[0].param_groups[0]["lr"])

    trainer = L.Trainer(
        max_epochs=5,
        default_root_dir=tmp_path,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[Record()],
    )
    trainer.fit(model, datamodule=dm)
    assert len(lrs) == 50  # 10 steps per epoch
    assert lrs[0] == pytest.approx(0.05 / 30) and lrs[29] == pytest.approx(0.05)
    assert lrs[30] == pytest.approx(0.05) and lrs[-1] == pytest.approx(0.05 * 0.5 * (1 + math.cos(math.pi * 19 / 20)))
    metrics = trainer.validate(model, datamodule=dm, verbose=False)[0]
    assert {"val/acc", "val/ece", "val/loss"} <= set(metrics)
    assert metrics["val/acc"] > 0.5
