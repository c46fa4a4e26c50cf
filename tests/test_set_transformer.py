import math

import pytest
import torch
from torch import nn

from lightning_fl.models.set_transformer import ISAB, MAB, PMA, SAB

B, N, M, D_IN, DIM, HEADS = 3, 7, 5, 6, 8, 2


def make(kind: str) -> nn.Module:
    torch.manual_seed(0)
    factories = {
        "mab": lambda: MAB(D_IN, D_IN + 1, DIM, HEADS),
        "sab": lambda: SAB(D_IN, DIM, HEADS),
        "isab": lambda: ISAB(D_IN, DIM, HEADS, num_inducing=4),
        "pma": lambda: PMA(DIM, num_seeds=3, num_heads=HEADS, dim_in=D_IN),
        "pma_no_ff": lambda: PMA(DIM, num_seeds=3, num_heads=HEADS, input_ff=False, dim_in=D_IN),
    }
    return factories[kind]().double()


CONTEXT = torch.randn(B, M, D_IN + 1, dtype=torch.float64, generator=torch.Generator().manual_seed(1))


def call(model: nn.Module, x: torch.Tensor, item: int | None = None) -> torch.Tensor:
    """Apply ``model``; a MAB attends to ``CONTEXT`` (or its set ``item``), a second set of another size and width."""
    if isinstance(model, MAB):
        context = (CONTEXT if item is None else CONTEXT[item]).to(x.dtype)
        return model(x, context)
    return model(x)


def test_mab_matches_hand_written_multihead_attention_with_head_dim_scale():
    mab = make("mab")
    q, c = torch.randn(N, D_IN, dtype=torch.float64), torch.randn(M, D_IN + 1, dtype=torch.float64)
    qp, k, v = mab.fc_q(q), mab.fc_k(c), mab.fc_v(c)
    d_head = DIM // HEADS
    heads = []
    for j in range(HEADS):
        cols = slice(j * d_head, (j + 1) * d_head)
        weights = torch.softmax(qp[:, cols] @ k[:, cols].T / math.sqrt(d_head), dim=-1)  # (N, M)
        heads.append(weights @ v[:, cols])
    h = mab.norm0(qp + mab.fc_o(torch.cat(heads, dim=-1)))
    expected = mab.norm1(h + mab.ff(h))
    torch.testing.assert_close(mab(q, c), expected)


def test_mab_is_equivariant_in_queries_and_invariant_in_keys():
    mab = make("mab")
    q, c = torch.randn(B, N, D_IN, dtype=torch.float64), torch.randn(B, M, D_IN + 1, dtype=torch.float64)
    out = mab(q, c)
    for seed in range(5):
        g = torch.Generator().manual_seed(seed)
        pq, pc = torch.randperm(N, generator=g), torch.randperm(M, generator=g)
        torch.testing.assert_close(mab(q[:, pq], c), out[:, pq])
        torch.testing.assert_close(mab(q, c[:, pc]), out)


@pytest.mark.parametrize("kind", ["sab", "isab"])
def test_sab_and_isab_are_permutation_equivariant(kind):
    model, x = make(kind), torch.randn(B, N, D_IN, dtype=torch.float64)
    out = model(x)
    for seed in range(5):
        perm = torch.randperm(N, generator=torch.Generator().manual_seed(seed))
        torch.testing.assert_close(model(x[:, perm]), out[:, perm])


@pytest.mark.parametrize("kind", ["pma", "pma_no_ff"])
def test_pma_is_permutation_invariant(kind):
    model, z = make(kind), torch.randn(B, N, D_IN, dtype=torch.float64)
    out = model(z)
    for seed in range(5):
        perm = torch.randperm(N, generator=torch.Generator().manual_seed(seed))
        torch.testing.assert_close(model(z[:, perm]), out)


@pytest.mark.parametrize(("kind", "n_out"), [("mab", N), ("sab", N), ("isab", N), ("pma", 3), ("pma_no_ff", 3)])
def test_shapes_and_batched_equals_unbatched(kind, n_out):
    model, x = make(kind), torch.randn(B, N, D_IN, dtype=torch.float64)
    batched = call(model, x)
    assert batched.shape == (B, n_out, DIM)
    for i in range(B):
        single = call(model, x[i], item=i)
        assert single.shape == (n_out, DIM)
        torch.testing.assert_close(single, batched[i])


def test_mab_broadcasts_an_unbatched_query_over_a_batch_of_contexts():
    mab = make("mab")
    q, c = torch.randn(N, D_IN, dtype=torch.float64), torch.randn(B, M, D_IN + 1, dtype=torch.float64)
    out = mab(q, c)
    assert out.shape == (B, N, DIM)
    torch.testing.assert_close(out[1], mab(q, c[1]))


@pytest.mark.parametrize("kind", ["mab", "sab", "isab", "pma", "pma_no_ff"])
def test_runs_under_cpu_bf16_autocast(kind):
    model = make(kind).float()
    x = torch.randn(B, N, D_IN)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = call(model, x)
    assert out.dtype in (torch.bfloat16, torch.float32)
    assert torch.isfinite(out.float()).all()
    torch.testing.assert_close(out.float(), call(model, x), atol=0.1, rtol=0.1)


@pytest.mark.parametrize("kind", ["mab", "sab", "isab", "pma", "pma_no_ff"])
def test_gradients_reach_every_parameter(kind):
    model = make(kind)
    x = torch.randn(B, N, D_IN, dtype=torch.float64, requires_grad=True)
    out = call(model, x)
    (out * torch.randn_like(out)).sum().backward()
    missing = [name for name, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert not missing
    assert x.grad is not None and x.grad.abs().sum() > 0


def test_layer_norm_off_leaves_no_norm_parameters():
    mab = MAB(4, 4, 4, 2, layer_norm=False)
    assert not [name for name, _ in mab.named_parameters() if "norm" in name]


def test_ff_hidden_sets_the_row_wise_feed_forward_width():
    mab = MAB(4, 4, 8, 2, ff_hidden=32)
    assert mab.ff[0].out_features == 32 and mab.ff[2].in_features == 32


@pytest.mark.parametrize(
    ("factory", "words"),
    [
        (lambda: MAB(4, 4, 6, 4), ["dim=6", "num_heads=4"]),
        (lambda: SAB(4, 10, 3), ["dim=10", "num_heads=3"]),
        (lambda: ISAB(4, 8, 3, num_inducing=2), ["dim=8", "num_heads=3"]),
        (lambda: PMA(9, num_seeds=2, num_heads=2), ["dim=9", "num_heads=2"]),
        (lambda: MAB(0, 4, 4, 2), ["dim_q"]),
        (lambda: MAB(4, 4, 4, 0), ["num_heads"]),
        (lambda: ISAB(4, 8, 2, num_inducing=0), ["num_inducing"]),
        (lambda: PMA(8, num_seeds=0, num_heads=2, ff_hidden=0), ["num_seeds", "ff_hidden"]),
    ],
)
def test_bad_arguments_raise_value_error_naming_them(factory, words):
    with pytest.raises(ValueError, match="must") as info:
        factory()
    for word in words:
        assert word in str(info.value)


def test_wrong_input_rank_or_width_raises():
    mab = MAB(4, 5, 8, 2)
    with pytest.raises(ValueError, match="Expected query"):
        mab(torch.randn(2, 3, 4, 4), torch.randn(3, 5))
    with pytest.raises(ValueError, match="context width 5"):
        mab(torch.randn(3, 4), torch.randn(3, 4))
