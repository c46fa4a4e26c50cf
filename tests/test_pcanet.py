"""PCANet-initialised bases (FLITE appendix E's third warm start): the filters and the cached base."""

import copy
import json

import pytest
import torch
from lightning.pytorch.utilities.seed import isolate_rng
from torch import nn

from conftest import CONFIGS, make_model, public_pretraining, run_cli
from lightning_fl.errors import ConfigError
from lightning_fl.models import SmallCNN
from lightning_fl.models.pcanet import pcanet_init_


def patches_by_hand(x: torch.Tensor, k: int, pad: int, stride: int) -> torch.Tensor:
    """Every ``k x k`` patch (all channels, zero padding) of ``x`` as a row, by slicing: no ``unfold``."""
    x = nn.functional.pad(x, (pad,) * 4)
    rows = []
    for i in range(0, x.shape[2] - k + 1, stride):
        for j in range(0, x.shape[3] - k + 1, stride):
            rows.append(x[:, :, i : i + k, j : j + k].reshape(len(x), -1))
    return torch.cat(rows).double()


def top_components(patches: torch.Tensor, count: int) -> tuple[torch.Tensor, float]:
    """The ``count`` leading eigenvectors (rows) of the covariance of the mean-removed patches, and their share of
    the variance."""
    p = patches - patches.mean(1, keepdim=True)
    values, vectors = torch.linalg.eigh(p.T @ p)
    return vectors.flip(1)[:, :count].T, (values.flip(0)[:count].sum() / values.sum()).item()


def assert_filters_are(weight: torch.Tensor, want: torch.Tensor, scale: float) -> None:
    """``weight``'s first rows are ``want``'s rows (up to sign), each scaled to ``scale``, signed as documented."""
    got = weight.reshape(len(weight), -1)[: len(want)].double()
    torch.testing.assert_close(got.norm(dim=1), torch.full((len(want),), scale, dtype=torch.float64), rtol=1e-5, atol=0)
    cosines = (got / scale * want).sum(1).abs()
    torch.testing.assert_close(cosines, torch.ones_like(cosines), rtol=0, atol=1e-4)
    largest = got.gather(1, got.abs().argmax(1, keepdim=True))
    assert (largest > 0).all()


def rms_norm(weight: torch.Tensor) -> float:
    return weight.reshape(len(weight), -1).double().norm(dim=1).pow(2).mean().sqrt().item()


def test_every_conv_gets_the_principal_components_of_its_input_patches():
    """Layer by layer in forward order, from the patches the already-set layers produce (padding, stride honoured)."""
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Conv2d(2, 6, 3, padding=1, bias=False),
        nn.ReLU(),
        nn.Conv2d(6, 4, 3, stride=2, padding=1, bias=False),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(4, 3),
    )
    images = torch.rand(40, 2, 7, 7) + torch.linspace(0, 1, 7)  # a horizontal ramp: patches with structure
    before = copy.deepcopy(net.state_dict())
    report = pcanet_init_(net, images, batch_size=16)
    assert [(r.name, r.patch_dim, r.filters, r.pca_filters) for r in report] == [("0", 18, 6, 6), ("2", 54, 4, 4)]
    first, kept = top_components(patches_by_hand(images, 3, 1, 1), 6)
    assert_filters_are(net[0].weight, first, rms_norm(before["0.weight"]))
    assert report[0].variance_kept == pytest.approx(kept) and 0 < kept < 1
    with torch.no_grad():
        hidden = net[1](net[0](images))  # the second layer sees the first layer's new filters
    second, kept = top_components(patches_by_hand(hidden, 3, 1, 2), 4)
    assert_filters_are(net[2].weight, second, rms_norm(before["2.weight"]))
    assert report[1].variance_kept == pytest.approx(kept) and 0 < kept < 1
    # the filters ignore a patch's mean (PCANet removes it), and nothing else changed
    assert net[0].weight.sum((1, 2, 3)).abs().max() < 1e-5
    torch.testing.assert_close(net[6].weight, before["6.weight"], rtol=0, atol=0)
    assert net.training  # the mode it came in with


def test_filters_past_the_patch_rank_keep_their_random_values():
    """One 3x3 channel has 8 directions of non-zero variance once the patch mean is gone: 8 of 12 filters change."""
    torch.manual_seed(1)
    net = nn.Sequential(nn.Conv2d(1, 12, 3, padding=1, bias=True), nn.Flatten())
    before = copy.deepcopy(net.state_dict())
    (layer,) = pcanet_init_(net, torch.rand(30, 1, 6, 6))
    assert (layer.pca_filters, layer.variance_kept) == (8, pytest.approx(1.0))
    assert torch.equal(net[0].weight[8:], before["0.weight"][8:])
    assert not torch.isclose(net[0].weight[:8], before["0.weight"][:8]).any()
    assert torch.equal(net[0].bias, before["0.bias"])


def test_pcanet_refuses_networks_it_cannot_set():
    with pytest.raises(ValueError, match="has no nn.Conv2d"):
        pcanet_init_(nn.Sequential(nn.Flatten(), nn.Linear(16, 2)), torch.rand(4, 1, 4, 4))
    with pytest.raises(ValueError, match="ungrouped, zero-padded convolutions; 0 are not"):
        pcanet_init_(nn.Sequential(nn.Conv2d(2, 4, 3, groups=2)), torch.rand(4, 2, 5, 5))
    with pytest.raises(ValueError, match="non-empty batch of images"):
        pcanet_init_(SmallCNN(image_size=8), torch.rand(0, 1, 8, 8))


def test_pcanet_base_is_made_from_the_public_split_once_and_cached(tmp_path, monkeypatch):
    """``base: pcanet``: the random initialisation with PCANet convs, made on the centralised split, cached apart from
    the pretrained base, read back (not made again) by the next model, the linear layers and head untouched."""
    dm, recipe = public_pretraining(tmp_path)
    model = make_model(base="pcanet", pretraining=recipe)
    random = copy.deepcopy(model.own_weights())
    assert not model._base_ready
    path = model.base_cache_path(dm)
    assert path != make_model(base="pretrained", pretraining=recipe).base_cache_path(dm)
    model.prepare_base(dm)

    with isolate_rng():  # the images the base is made from: the split's loader, under the recipe's seed
        torch.manual_seed(recipe.seed)
        images = torch.cat([x for x, _ in dm.train_dataloader()])
    assert len(images) == 60  # the whole public split (fewer than PCANET_IMAGES)
    want = copy.deepcopy(make_model().backbone)
    pcanet_init_(want, images)
    for name, w in want.state_dict().items():
        assert torch.equal(model.backbone.state_dict()[name], w), name
    assert not torch.equal(model.backbone.features[0].weight, random["backbone.features.0.weight"])
    for name in ("backbone.fc.weight", "head.weight"):
        assert torch.equal(model.own_weights()[name], random[name]), name
    assert not model.mapping.latent.any()  # the latent starts at zero on it

    meta = json.loads((path.parent / "meta.json").read_text())
    assert meta["key"]["loop"] == "lightning_fl.models.pcanet/1" and meta["images"] == 60
    assert [lay["pca_filters"] for lay in meta["layers"]] == [8, 16]

    def never(*args, **kwargs):
        raise AssertionError("the cached PCANet base was made again")

    monkeypatch.setattr("lightning_fl.models.pcanet.pcanet_init_", never)
    again = make_model(base="pcanet", pretraining=recipe)
    again.prepare_base(dm, allow_training=False)
    assert again.factor_fingerprint() == model.factor_fingerprint()


def test_pcanet_base_settings_that_cannot_work_are_config_errors():
    from lightning_fl.methods import LatentLanguageModel
    from lightning_fl.models import TinyGPT

    with pytest.raises(ConfigError, match="model.base is 'pcanet' but model.base_checkpoint is set"):
        make_model(base="pcanet", base_checkpoint="base.ckpt")
    with pytest.raises(
        ConfigError, match="latent_init is 'teacher'.*but model.base is 'pcanet'; set model.base scratch"
    ):
        make_model(base="pcanet", latent_init="teacher")
    with pytest.raises(ConfigError, match="model.base must be one of 'pretrained', 'scratch', got 'pcanet'"):
        LatentLanguageModel(TinyGPT(vocab_size=8, n_layer=1, n_embd=8, n_head=1, context=8), base="pcanet")


def test_pcanet_base_runs_federated_through_the_cli(in_tmp, monkeypatch):
    """One command, as the sweep runs it: the base is made, cached, and federated training starts from it."""
    monkeypatch.setenv("LIGHTNING_FL_CACHE", str(in_tmp / "bases"))
    args = ["fit", "--config", str(CONFIGS / "quickstart.yaml"), "--model.base", "pcanet", "--trainer.rounds", "1"]
    assert run_cli(*args, "--trainer.enable_progress_bar", "false") == 0
    (meta,) = (in_tmp / "bases").rglob("meta.json")
    assert json.loads(meta.read_text())["key"]["loop"] == "lightning_fl.models.pcanet/1"
    assert run_cli(*args, "--model.base_checkpoint", "x.ckpt") == 2
