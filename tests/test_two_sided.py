"""FLITE's two-sided factor family: ``U = A kron B`` on a linear layer's rows and columns, applied to activations."""

import pytest
import torch
from torch import nn
from torch.func import functional_call

from lightning_fl.errors import ConfigError
from lightning_fl.mapping import LatentMapping, memory_report
from lightning_fl.mapping.two_sided import TwoSidedFactor, two_sided_shape
from lightning_fl.methods import LanguageModel, LatentLanguageModel
from lightning_fl.models import SmallCNN, TinyGPT


@pytest.mark.parametrize(
    ("m", "n", "rank", "shape"),
    [(576, 1536, 32, (8, 4)), (576, 192, 64, (8, 8)), (2, 100, 32, (2, 16)), (100, 3, 12, (4, 3)), (9, 9, 7, (7, 1))],
)
def test_the_rank_splits_as_square_as_the_matrix_allows(m, n, rank, shape):
    assert two_sided_shape(m, n, rank) == shape
    p, q = shape
    assert p * q == rank and p <= m and q <= n


def test_a_rank_that_cannot_split_is_refused():
    with pytest.raises(ValueError, match="lower the rank"):
        two_sided_shape(2, 3, 32)


@pytest.mark.parametrize(("m", "n", "rank"), [(24, 40, 6), (9000, 3, 12)])
def test_the_factor_is_orthonormal_and_maps_to_a_c_b_transposed(m, n, rank):
    factor = TwoSidedFactor(m, n, rank, seed=5, layer=2)
    u = factor.full().double()
    assert u.shape == (m * n, rank)
    torch.testing.assert_close(u.T @ u, torch.eye(rank, dtype=torch.float64), atol=1e-6, rtol=0)
    a, b = (part.double() for part in factor.parts())
    c = torch.randn(rank, dtype=torch.float64)
    expected = a @ c.reshape(factor.p, factor.q) @ b.T  # the delta the layer applies
    torch.testing.assert_close((u @ c).reshape(m, n), expected, atol=1e-6, rtol=0)  # U rounded to float32
    assert torch.equal(factor.full(), TwoSidedFactor(m, n, rank, seed=5, layer=2).full())
    assert not torch.equal(factor.full(), TwoSidedFactor(m, n, rank, seed=5, layer=3).full())


def small_gpt(seed: int = 0) -> TinyGPT:
    torch.manual_seed(seed)
    return TinyGPT(vocab_size=11, n_layer=2, n_embd=16, n_head=2, context=8).double()


def test_the_hooked_forward_equals_the_forward_with_mapped_weights_and_so_do_gradients():
    net = small_gpt()
    mapping = LatentMapping(net, latent_dim=[5, 7, 6, 4, 9, 8] * 2, rank=4, layers="linear", mode="two_sided", seed=3)
    mapping.double()
    assert len(mapping.layers) == 12  # six projections per block, every one mapped
    x = torch.randint(0, 11, (3, 8))
    z = (0.3 * torch.randn(mapping.latent_size, dtype=torch.float64)).requires_grad_(True)
    base = dict(net.named_parameters())
    with mapping.applied(net, z):
        hooked = net(x)
    materialised = functional_call(net, mapping.weights(base, z), (x,), strict=False)
    torch.testing.assert_close(hooked, materialised, atol=1e-12, rtol=0)
    (g_hooked,) = torch.autograd.grad((hooked**2).sum(), z)
    (g_materialised,) = torch.autograd.grad((materialised**2).sum(), z)
    torch.testing.assert_close(g_hooked, g_materialised, atol=1e-10, rtol=1e-10)
    assert g_hooked.abs().min() > 0  # every coordinate of z reaches the loss
    assert torch.equal(net(x), functional_call(net, base, (x,)))  # the hooks are gone after the block


def test_the_hooked_gradient_matches_finite_differences():
    net = small_gpt(1)
    mapping = LatentMapping(
        net, latent_dim=6, rank=4, layers=["blocks.0.attn.*.weight", "blocks.0.mlp.*.weight"], mode="two_sided", seed=1
    ).double()
    x = torch.randint(0, 11, (2, 8))

    def loss(z):
        with mapping.applied(net, z):
            return (net(x) ** 2).sum()

    z = (0.1 * torch.randn(mapping.latent_size, dtype=torch.float64)).requires_grad_(True)
    assert torch.autograd.gradcheck(loss, (z,), eps=1e-6, atol=1e-6, rtol=1e-4)


def test_only_linear_weights_can_be_mapped_two_sided():
    with pytest.raises(
        ConfigError, match=r"weights of linear layers \(nn.Linear, GPT-2.s Conv1D\) only.*features.0.weight.*Conv2d"
    ) as err:
        LatentMapping(SmallCNN(image_size=8, channels=[4, 8], norm_groups=2), 8, 4, "conv+linear", "two_sided")
    assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="model.rank=5"):
        LatentMapping(nn.Sequential(nn.Linear(3, 2)), 8, 5, "linear", "two_sided")  # 5 = p q with p <= 2, q <= 3?


def test_memory_is_the_small_parts_and_v_in_closed_form():
    net = small_gpt().float()
    report = memory_report(net, latent_dim=64, rank=32, layers="linear")
    mapping = LatentMapping(net, 64, 32, "linear", "two_sided")
    expected = sum(lay.latent_dim * lay.rank for lay in mapping.layers)
    for lay in mapping.layers:
        p, q = two_sided_shape(*lay.shape, lay.rank)
        expected += lay.shape[0] * p + lay.shape[1] * q
    assert report.two_sided_bytes == 4 * expected
    mapping.materialise()
    kept = sum(b.numel() * b.element_size() for b in mapping.buffers())
    assert kept == report.two_sided_bytes
    assert memory_report(SmallCNN(), 64, 32, "conv").two_sided_bytes is None  # conv weights: not this family
    assert "two-sided" in report.as_table()


def test_the_fingerprint_names_the_family_seed_and_parts():
    net = small_gpt().float()
    first = LatentMapping(net, 8, 4, "linear", "two_sided", seed=7).fingerprint()
    assert first == LatentMapping(net, 8, 4, "linear", "two_sided", seed=7).fingerprint()
    assert first != LatentMapping(net, 8, 4, "linear", "two_sided", seed=8).fingerprint()
    assert first != LatentMapping(net, 8, 4, "linear", "kronecker", seed=7).fingerprint()


def test_a_latent_language_model_starts_exactly_at_its_base_and_averages_exactly():
    net = small_gpt().float()
    plain = LanguageModel(net, sample_tokens=0)
    latent = LatentLanguageModel(
        small_gpt().float(), base="scratch", latent_dim=16, rank=8, factors="two_sided", sample_tokens=0
    )
    latent.network.load_state_dict(net.state_dict())
    x = torch.randint(0, 11, (4, 8))
    assert torch.equal(plain(x), latent(x))  # z = 0: the hooks add exact zeros
    torch.manual_seed(1)
    states = [{"mapping.latent": torch.randn(latent.mapping.latent_size)} for _ in range(6)]
    assert 0 <= latent.averaging_identity_error(states) <= 1e-6
    with torch.no_grad():
        latent.mapping.latent.copy_(states[0]["mapping.latent"])
    assert not torch.allclose(plain(x), latent(x))
    weights = latent.mapping.weights(latent.mapped_base())
    torch.testing.assert_close(
        latent(x), functional_call(latent.network, weights, (x,), strict=False), atol=1e-5, rtol=0
    )
    text = latent.logits_function()(x)
    torch.testing.assert_close(text, latent(x), atol=0, rtol=0)


def test_with_rank_equal_to_the_latent_v_is_the_identity_and_is_not_kept():
    net = small_gpt()
    mapping = LatentMapping(net, latent_dim=16, rank=16, layers="linear", mode="two_sided", seed=2).double()
    mapping.materialise()
    assert not any(name.startswith("v_") for name, _ in mapping.named_buffers())
    lay = mapping.layers[0]
    assert torch.equal(mapping.v_factor(lay), torch.eye(16))
    z = torch.randn(mapping.latent_size, dtype=torch.float64)
    left, right = (getattr(mapping, f"t{part}_0") for part in ("a", "b"))
    expected = left.double() @ z[:16].reshape(left.shape[1], right.shape[1]) @ right.double().T  # C is z_l itself
    base = dict(net.named_parameters())
    torch.testing.assert_close(mapping.weights(base, z)[lay.name] - base[lay.name], expected, atol=1e-12, rtol=0)
    x = torch.randint(0, 11, (2, 8))
    with mapping.applied(net, z):
        hooked = net(x)
    torch.testing.assert_close(hooked, functional_call(net, mapping.weights(base, z), (x,)), atol=1e-12, rtol=0)
    report = memory_report(net, 16, 16, "linear")
    assert report.two_sided_bytes == sum(b.numel() * 4 for b in mapping.buffers())  # A and B only
    assert mapping.fingerprint() != LatentMapping(net, 16, 8, "linear", "two_sided", seed=2).fingerprint()


def test_a_linear_selection_that_reaches_a_tied_weight_is_refused_by_name():
    net = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 4), nn.Linear(4, 10, bias=False))
    net[2].weight = net[0].weight  # tied: one tensor, listed once by named_parameters
    with pytest.raises(ConfigError, match=r"selects 2.weight, which is tied to 0.weight"):
        LatentMapping(net, 4, 2, "linear", "two_sided")
    assert [lay.name for lay in LatentMapping(net, 4, 2, ["1.weight"], "two_sided").layers] == ["1.weight"]
