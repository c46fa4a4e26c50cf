import pytest
import torch
from torch import nn

from lightning_fl.models import ClassifierHead, ResNet18, ResNet34, SmallCNN


def conv_weights(model: nn.Module) -> list[torch.Tensor]:
    return [m.weight for m in model.modules() if isinstance(m, nn.Conv2d)]


def test_resnet18_cifar_has_20_convs_with_11159232_weights():
    convs = conv_weights(ResNet18())
    assert len(convs) == 20
    assert sum(w.numel() for w in convs) == 11_159_232


def test_resnet34_has_36_convs_and_the_same_weights_for_both_small_stems():
    cifar, tiny = ResNet34(stem="cifar"), ResNet34(stem="tinyimagenet")
    assert len(conv_weights(cifar)) == len(conv_weights(tiny)) == 36
    assert sum(w.numel() for w in conv_weights(tiny)) == sum(w.numel() for w in conv_weights(cifar)) == 21_259_968


def test_resnets_use_groupnorm_32_and_carry_no_buffers():
    model = ResNet18()
    norms = [m for m in model.modules() if isinstance(m, nn.GroupNorm)]
    assert norms and all(m.num_groups == 32 for m in norms)
    assert not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())
    assert list(model.buffers()) == []


@pytest.mark.parametrize(
    ("factory", "shape"),
    [
        (lambda: ResNet18(width=8, norm_groups=4), (2, 3, 32, 32)),
        (lambda: ResNet34(width=8, norm_groups=4, stem="tinyimagenet"), (2, 3, 64, 64)),
        (lambda: ResNet18(width=8, norm_groups=4, stem="imagenet", in_channels=1), (1, 1, 64, 64)),
    ],
)
def test_resnet_feature_shapes_on_tiny_variants(factory, shape):
    model = factory()
    assert model(torch.randn(*shape)).shape == (shape[0], model.out_features) == (shape[0], 64)


def test_full_size_resnet18_forward_and_backward_on_a_tiny_batch():
    model = ResNet18()
    feats = model(torch.randn(2, 3, 32, 32))
    assert feats.shape == (2, 512)
    feats.sum().backward()
    assert all(p.grad is not None for p in model.parameters())


def test_tinyimagenet_stem_halves_the_resolution_before_the_stages():
    model = ResNet34(width=8, norm_groups=4, stem="tinyimagenet")
    assert model.stem(torch.randn(1, 3, 64, 64)).shape == (1, 8, 32, 32)
    assert ResNet18(width=8, norm_groups=4).stem(torch.randn(1, 3, 32, 32)).shape == (1, 8, 32, 32)


@pytest.mark.parametrize(("size", "flat"), [(28, 64 * 7 * 7), (8, 64 * 2 * 2)])
def test_small_cnn_shapes(size, flat):
    model = SmallCNN(image_size=size)
    assert model.fc.in_features == flat
    assert model(torch.randn(3, 1, size, size)).shape == (3, 128)


def test_small_cnn_rejects_wrong_input_size_and_bad_groups():
    with pytest.raises(ValueError, match="image_size"):
        SmallCNN(image_size=28)(torch.randn(1, 1, 8, 8))
    with pytest.raises(ValueError, match="norm_groups=5"):
        SmallCNN(norm_groups=5)
    with pytest.raises(ValueError, match="norm_groups=32"):
        ResNet18(width=16, norm_groups=32)


def test_orthogonal_head_is_frozen_and_orthonormal():
    head = ClassifierHead(128, 10, "orthogonal")
    w = head.weight
    assert not w.requires_grad and head.bias is None
    torch.testing.assert_close(w @ w.T, torch.eye(10), atol=1e-5, rtol=0)


def test_orthogonal_head_with_more_classes_than_features_has_orthonormal_columns():
    w = ClassifierHead(16, 40, "orthogonal").weight
    torch.testing.assert_close(w.T @ w, torch.eye(16), atol=1e-5, rtol=0)


def test_kaiming_head_frozen_and_trainable_head_has_bias():
    frozen = ClassifierHead(64, 10, "kaiming")
    assert not frozen.weight.requires_grad and frozen.bias is None
    bound = 1 / 64**0.5
    assert frozen.weight.abs().max() <= bound
    trainable = ClassifierHead(64, 10, "trainable")
    assert trainable.weight.requires_grad and trainable.bias is not None and trainable.bias.requires_grad
    with pytest.raises(ValueError, match="model.head"):
        ClassifierHead(64, 10, "cosine")
