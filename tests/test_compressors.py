import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_fl.compress import FP32, PowerSGD, Quantize, TopK
from lightning_fl.errors import ConfigError


def state_pair(seed=0):
    g = torch.Generator().manual_seed(seed)
    reference = {
        "conv.weight": torch.randn(8, 4, 3, 3, generator=g),
        "fc.weight": torch.randn(10, 16, generator=g),
        "fc.bias": torch.randn(10, generator=g),
    }
    state = {n: t + 0.1 * torch.randn(t.shape, generator=g) for n, t in reference.items()}
    return state, reference


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 400), density=st.floats(0.001, 1.0), seed=st.integers(0, 2**16))
def test_topk_keeps_exactly_the_largest_entries(n, density, seed):
    x = torch.randn(n, generator=torch.Generator().manual_seed(seed))
    k = max(1, math.ceil(density * n))
    chosen = set(TopK.select(x, k).tolist())
    by_sort = set(torch.argsort(x.abs(), descending=True, stable=True)[:k].tolist())
    assert len(chosen) == k
    # equal up to ties at the threshold: the kept magnitudes are the k largest
    assert sorted(x.abs()[list(chosen)].tolist()) == sorted(x.abs()[list(by_sort)].tolist())


@pytest.mark.parametrize("codec", [TopK(0.1), TopK(0.05, scope="tensor"), PowerSGD(2), PowerSGD(8, warm_start=False)])
def test_error_feedback_invariant_sent_plus_residual_equals_input_plus_old_residual(codec):
    state, reference = state_pair()
    for round_ in range(3):
        old = {
            n: r.clone() for n, r in codec.residuals.get(0, {n: torch.zeros_like(t) for n, t in state.items()}).items()
        }
        payload = codec.encode(state, reference, client=0)
        sent = codec.decompress(payload, reference, client=0)
        new = codec.residuals[0]
        for n in state:
            torch.testing.assert_close(sent[n] + new[n], (state[n] - reference[n]) + old[n], atol=1e-6, rtol=0)
        state = {n: t + 0.05 * (round_ + 1) for n, t in state.items()}


def test_byte_counts_equal_the_encoded_payload():
    state, reference = state_pair()
    numel = sum(t.numel() for t in state.values())  # 288 + 160 + 10 = 458
    k = math.ceil(0.1 * numel)
    assert TopK(0.1).encode(state, reference, 0).nbytes == 8 * k  # float32 value + int32 index
    p2 = PowerSGD(2).encode(state, reference, 0)
    # conv 8 x 36 and fc 10 x 16 compressed at rank 2; the bias goes uncompressed
    assert p2.nbytes == 4 * ((8 + 36) * 2 + (10 + 16) * 2 + 10)
    assert p2.nbytes == sum(t.numel() * t.element_size() for e in p2.tensors.values() for t in e.parts.values())
    assert FP32().encode(state, reference, 0).nbytes == 4 * numel
    assert Quantize(4).encode(state, reference, 0).nbytes == sum(math.ceil(t.numel() / 2) + 8 for t in state.values())


def test_powersgd_is_exact_on_rank_one_updates():
    u, v = torch.randn(12, 1), torch.randn(1, 20)
    reference = {"w": torch.zeros(12, 20)}
    codec = PowerSGD(rank=2, error_feedback=False)
    decoded = codec.decode(codec.encode({"w": u @ v}, reference, 0), reference, 0)
    torch.testing.assert_close(decoded["w"], u @ v, atol=1e-5, rtol=1e-5)


def test_powersgd_with_warm_start_approaches_the_truncated_svd():
    g = torch.Generator().manual_seed(1)
    a, _ = torch.linalg.qr(torch.randn(40, 40, generator=g))
    b, _ = torch.linalg.qr(torch.randn(30, 30, generator=g))
    s = torch.tensor([10.0, 6.0, 3.0, 1.0] + [0.1] * 26)
    m = (a[:, :30] * s) @ b.T  # (40, 30) with a decaying spectrum
    reference = {"w": torch.zeros_like(m)}
    codec = PowerSGD(rank=2, error_feedback=False)
    for _ in range(30):  # the same update each round: warm-started power iterations converge
        approx = codec.decode(codec.encode({"w": m}, reference, 0), reference, 0)["w"]
    svd_error = torch.linalg.norm(s[2:])
    assert torch.linalg.norm(m - approx) <= 1.01 * svd_error


def test_quantised_full_weight_round_trip():
    state, reference = state_pair()
    for bits in (8, 4):
        codec = Quantize(bits)
        decoded = codec.decode(codec.encode(state, reference, 0), reference, 0)
        for n, t in state.items():
            step = (t.max() - t.min()) / (2**bits - 1)
            assert (decoded[n] - t).abs().max() <= step / 2 + 1e-6


def test_compressor_state_round_trips_through_a_checkpoint(tmp_path):
    state, reference = state_pair()
    codec = PowerSGD(2)
    codec.encode(state, reference, 3)
    path = tmp_path / "c.pt"
    torch.save(codec.state_dict(), path)
    restored = PowerSGD(2)
    restored.load_state_dict(torch.load(path, weights_only=True))
    assert restored.residuals.keys() == {3} and restored.queries.keys() == {3}
    a = codec.encode(state, reference, 3)
    b = restored.encode(state, reference, 3)
    for n in a.tensors:
        for part in a.tensors[n].parts:
            assert torch.equal(a.tensors[n].parts[part], b.tensors[n].parts[part])


def test_bad_arguments():
    with pytest.raises(ConfigError, match="codec.density"):
        TopK(0)
    with pytest.raises(ConfigError, match="codec.rank"):
        PowerSGD(0)


@pytest.mark.filterwarnings(r"ignore:You are trying to `self.log\(\)`")
def test_fedprox_pulls_the_client_towards_the_global_state():
    from lightning_fl.methods import Classifier, FedProx
    from lightning_fl.models import SmallCNN

    def make(cls, **kw):
        torch.manual_seed(0)
        return cls(SmallCNN(image_size=8, channels=[8, 16], norm_groups=4), 10, **kw)

    x, y = torch.randn(16, 1, 8, 8), torch.randint(0, 10, (16,))
    plain, prox0, prox = make(Classifier), make(FedProx, mu=0.0), make(FedProx, mu=10.0)
    for m in (plain, prox0, prox):
        m.load_federated_state(m.federated_state())
    # at the anchor the proximal term and its gradient vanish
    assert prox.proximal_term().item() == 0.0
    assert torch.equal(plain.training_step((x, y), 0), prox.training_step((x, y), 0))
    with torch.no_grad():
        for p in prox.parameters():
            if p.requires_grad:
                p.add_(0.1)
    n = sum(p.numel() for p in prox.parameters() if p.requires_grad)
    torch.testing.assert_close(prox.proximal_term(), torch.tensor(0.5 * 10.0 * n * 0.01), rtol=1e-4, atol=0)
    assert torch.equal(plain.training_step((x, y), 0), prox0.training_step((x, y), 0))
