import subprocess
import sys

import pytest
import torch
from torch import nn

from conftest import REPO
from lightning_fl.compress import FP32, Quantize
from lightning_fl.errors import ConfigError
from lightning_fl.mapping import (
    CHUNK_ROWS,
    LatentMapping,
    memory_report,
    orthonormal_factor,
    plan_layers,
)
from lightning_fl.mapping.factors import KroneckerFactor, kronecker_shape
from lightning_fl.methods import Classifier, LatentClassifier
from lightning_fl.models import ResNet18, ResNet34, SmallCNN

MODES = ["stored", "regenerate", "streamed"]


@pytest.mark.parametrize(("rows", "rank"), [(64, 32), (32, 32), (CHUNK_ROWS * 2 + 123, 8), (9, 1)])
def test_factors_have_orthonormal_columns(rows, rank):
    u = orthonormal_factor(rows, rank, seed=3, layer=1, stream=1).double()
    torch.testing.assert_close(u.T @ u, torch.eye(rank, dtype=torch.float64), atol=1e-6, rtol=0)


def test_factors_depend_on_seed_layer_and_stream_only():
    a = orthonormal_factor(100, 4, seed=1, layer=0, stream=1)
    assert torch.equal(a, orthonormal_factor(100, 4, seed=1, layer=0, stream=1))
    for other in [(2, 0, 1), (1, 1, 1), (1, 0, 2)]:
        assert not torch.equal(a, orthonormal_factor(100, 4, *other))


FACTOR_SCRIPT = """
import torch
from lightning_fl.mapping import LatentMapping, orthonormal_factor
from lightning_fl.models import SmallCNN
torch.manual_seed(123)  # global RNG state must not matter
m = LatentMapping(SmallCNN(), latent_dim=64, rank=32, layers="conv+linear", seed=2**63 + 5)
print(m.fingerprint())
"""


def test_factors_are_identical_in_another_process():
    proc = subprocess.run([sys.executable, "-c", FACTOR_SCRIPT], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert proc.returncode == 0, proc.stderr
    here = LatentMapping(SmallCNN(), latent_dim=64, rank=32, layers="conv+linear", seed=2**63 + 5)
    assert proc.stdout.strip() == here.fingerprint()


def test_stored_regenerate_and_streamed_share_factors_and_outputs():
    net = SmallCNN(image_size=28, channels=[8, 16], norm_groups=4)
    base = dict(net.named_parameters())
    maps = {mode: LatentMapping(net, 16, 4, "conv+linear", mode, seed=9) for mode in MODES}
    fingerprints = {mode: m.fingerprint() for mode, m in maps.items()}
    assert len(set(fingerprints.values())) == 1
    big = maps["stored"].layers[-1]
    assert big.numel > CHUNK_ROWS  # the fc weight takes the chunked (Cholesky-QR) path
    for mode in MODES[1:]:
        assert torch.equal(maps[mode].u_factor(big), maps["stored"].u_factor(big))
    z = torch.randn(maps["stored"].latent_size, dtype=torch.float64)
    outs, grads = {}, {}
    for mode, m in maps.items():
        zz = z.clone().requires_grad_(True)
        w = m.weights({k: v.double() for k, v in base.items()}, zz)
        (sum((v**3).sum() for v in w.values())).backward()
        outs[mode], grads[mode] = w, zz.grad
    for mode in MODES[1:]:
        for name in outs["stored"]:
            torch.testing.assert_close(outs[mode][name], outs["stored"][name], atol=1e-12, rtol=1e-12)
        torch.testing.assert_close(grads[mode], grads["stored"], atol=1e-9, rtol=1e-9)
    dense = LatentMapping(net, 16, 4, "conv+linear", "dense", seed=9)
    assert dense.fingerprint() != fingerprints["stored"]


@pytest.mark.parametrize("mode", [*MODES, "dense", "kronecker"])
def test_gradient_wrt_latent_matches_finite_differences(mode):
    torch.manual_seed(0)
    net = SmallCNN(image_size=8, channels=[4, 8], feature_dim=6, norm_groups=2).double()
    mapping = LatentMapping(net, latent_dim=[3, 5, 4], rank=2, layers="conv+linear", mode=mode, seed=1)
    base = dict(net.named_parameters())
    x = torch.randn(2, 1, 8, 8, dtype=torch.float64)

    def loss(z):
        out = torch.func.functional_call(net, mapping.weights(base, z), (x,), strict=False)
        return (out**2).sum()

    z = (0.1 * torch.randn(mapping.latent_size, dtype=torch.float64)).requires_grad_(True)
    assert torch.autograd.gradcheck(loss, (z,), eps=1e-6, atol=1e-6, rtol=1e-4)


GPU = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=GPU)])
@pytest.mark.parametrize("mode", [*MODES, "dense", "kronecker"])
def test_mapped_weights_are_formed_in_float32_under_bf16_autocast(mode, device):
    """Under ``bf16-mixed`` the mapped weights are the float32 ones, bit for bit, and the step backpropagates to the
    latent (on a CPU, ``stored``, ``regenerate`` and ``streamed`` failed: autocast made ``V^T z`` bfloat16 and left
    ``addmv``'s other inputs float32; found by benchmarks/gpu_check.py's FLITE step)."""
    torch.manual_seed(0)
    net = SmallCNN(image_size=8, channels=[4, 8], feature_dim=6, norm_groups=2).to(device)
    mapping = LatentMapping(net, latent_dim=[3, 5, 4], rank=2, layers="conv+linear", mode=mode, seed=1).to(device)
    with torch.no_grad():
        mapping.latent.normal_()
    base = {n: p.detach() for n, p in net.named_parameters()}
    plain = mapping.weights(base)
    with torch.autocast(device, dtype=torch.bfloat16):
        mixed = mapping.weights(base)
        out = torch.func.functional_call(net, mixed, (torch.randn(2, 1, 8, 8, device=device),), strict=False)
    assert out.dtype == torch.bfloat16
    for name, weight in plain.items():
        assert mixed[name].dtype == torch.float32 and torch.equal(mixed[name], weight), name
    out.float().square().sum().backward()
    assert mapping.latent.grad.dtype == torch.float32 and torch.isfinite(mapping.latent.grad).all()


def classifier_pair(factors="stored"):
    torch.manual_seed(0)
    backbone = SmallCNN(image_size=8, channels=[8, 16], norm_groups=4)
    plain = Classifier(backbone, 10)
    latent = LatentClassifier(
        SmallCNN(image_size=8, channels=[8, 16], norm_groups=4),
        10,
        base="scratch",
        latent_dim=8,
        rank=4,
        layers="conv+linear",
        factors=factors,
    )
    latent.load_state_dict({**plain.state_dict(), "mapping.latent": torch.zeros(24)})
    return plain, latent


@pytest.mark.parametrize("factors", [*MODES, "kronecker"])
def test_zero_latent_reproduces_the_pretrained_outputs_exactly(factors):
    plain, latent = classifier_pair(factors)
    x = torch.randn(5, 1, 8, 8)
    assert torch.equal(plain(x), latent(x))
    assert [n for n, p in latent.named_parameters() if p.requires_grad] == ["mapping.latent"]


def test_averaging_identity_error_is_at_float_round_off():
    torch.manual_seed(0)
    model = LatentClassifier(ResNet18(width=8, norm_groups=4), 10, base="scratch", latent_dim=16, rank=8)
    states = [{"mapping.latent": torch.randn(model.mapping.latent_size)} for _ in range(8)]
    error = model.averaging_identity_error(states)
    assert 0 <= error <= 1e-6


def test_averaging_identity_error_measures_a_real_cancellation():
    """Two clients with huge opposite latents: float32 rounding of each client's weights does not cancel, so the
    identity error is positive; it equals the same maximum taken over the forward pass's own weights."""
    torch.manual_seed(0)
    model = LatentClassifier(
        SmallCNN(image_size=8, channels=[8, 16], norm_groups=4), 10, base="scratch", latent_dim=16, rank=8
    )
    big = 1e6 * torch.randn(model.mapping.latent_size)
    z1, z2 = big, -big + torch.randn(model.mapping.latent_size)
    error = model.averaging_identity_error([{"mapping.latent": z1}, {"mapping.latent": z2}])
    base = model.mapped_base()
    w1, w2 = model.mapping.weights(base, z1), model.mapping.weights(base, z2)
    of_mean = model.mapping.weights(base, (z1 + z2) / 2)
    expected = max((((w1[n] + w2[n]) / 2) - of_mean[n]).abs().max().item() for n in of_mean)
    assert expected > 1e-3  # float32 weights of magnitude ~1e6 round at ~0.06
    assert error == expected


def test_averaging_identity_error_is_taken_over_every_state():
    """Four distinct states: a huge latent, its near-opposite and two small ones. The error is the definition's,
    ``max |mean_k theta(z_k) - theta(mean_k z_k)|`` with ``theta`` the forward pass's float32 weights and the mean
    taken in float64 (the method's float32 sum of the first two is exact by Sterbenz's lemma and the rest adds
    about 1e-7); any one state alone, the first or the last, gives exactly 0."""
    torch.manual_seed(1)
    model = LatentClassifier(
        SmallCNN(image_size=8, channels=[8, 16], norm_groups=4), 10, base="scratch", latent_dim=16, rank=8
    )
    size = model.mapping.latent_size
    big = 1e6 * torch.randn(size)
    zs = [big, -big + torch.randn(size), torch.randn(size), 0.5 * torch.randn(size)]
    states = [{"mapping.latent": z} for z in zs]
    base = model.mapped_base()
    weights = [model.mapping.weights(base, z) for z in zs]
    of_mean = model.mapping.weights(base, torch.stack(zs).double().mean(0).float())
    expected = max(
        (sum(w[n].double() for w in weights) / len(zs) - of_mean[n].double()).abs().max().item() for n in of_mean
    )
    assert expected > 1e-3  # the huge pair's float32 rounding does not cancel
    assert model.averaging_identity_error(states) == pytest.approx(expected, abs=1e-6)
    assert model.averaging_identity_error(states[:1]) == model.averaging_identity_error(states[-1:]) == 0.0


def test_memory_report_for_resnet18_r32_d64():
    report = memory_report(ResNet18(), latent_dim=64, rank=32)
    assert (report.layers, report.mapped_weights, report.latent_size) == (20, 11_159_232, 1280)
    assert report.dense_bytes == 11_159_232 * 64 * 4
    assert report.stored_bytes == (32 * 11_159_232 + 20 * 64 * 32) * 4
    assert report.streamed_peak_bytes <= 16 * 2**20
    assert report.regenerate_peak_bytes < report.stored_bytes / 4
    assert "dense projection" in report.as_table()


@pytest.mark.parametrize(
    ("rows", "rank", "shape"),
    [
        (1728, 32, (36, 48, 6, 6)),  # ResNet-18's stem: a 6 x 6 grid, 32 of its pairs used
        (36864, 30, (192, 192, 6, 5)),
        (64, 64, (8, 8, 8, 8)),  # as many columns as rows: U is an orthogonal matrix
        (97, 10, (1, 97, 1, 10)),  # a prime: a Gaussian factor of the whole layer
        (12, 5, (3, 4, 3, 2)),
        (CHUNK_ROWS * 3 + 2, 3, (2, 12289, 2, 2)),  # a = 2: the smaller factor caps p
    ],
)
def test_kronecker_factors_have_orthonormal_columns(rows, rank, shape):
    assert kronecker_shape(rows, rank) == shape
    u = KroneckerFactor(rows, rank, seed=3, layer=1).full().double()
    assert u.shape == (rows, rank)
    torch.testing.assert_close(u.T @ u, torch.eye(rank, dtype=torch.float64), atol=1e-6, rtol=0)
    assert (u.abs().sum(1) > 0).all()  # every weight of the layer can move
    assert not torch.equal(u, KroneckerFactor(rows, rank, seed=4, layer=1).full().double())
    assert torch.equal(u, KroneckerFactor(rows, rank, seed=3, layer=1).full().double())


@pytest.mark.parametrize("rank", [6, 9])  # a 3 x 2 grid (p > q) and a 3 x 3 one: both product orders
def test_kronecker_mapping_applies_its_factor_without_forming_it(rank):
    torch.manual_seed(0)
    net = SmallCNN(image_size=28, channels=[8, 16], norm_groups=4)
    base = {k: v.detach() for k, v in net.named_parameters()}
    mapping = LatentMapping(net, 16, rank, "conv+linear", "kronecker", seed=9)
    z = torch.randn(mapping.latent_size)
    weights = mapping.weights(base, z)
    for lay, z_l in zip(mapping.layers, mapping.split(z), strict=True):
        expected = base[lay.name].reshape(-1) + mapping.u_factor(lay) @ (mapping.v_factor(lay).T @ z_l)
        torch.testing.assert_close(weights[lay.name].reshape(-1), expected, atol=1e-6, rtol=0)
    # what it keeps: V, the signs and the two small factors per layer, nothing of size P x r
    kept = sum(b.numel() for b in mapping.buffers()) * 4
    report = memory_report(net, 16, rank, "conv+linear")
    assert kept == report.kronecker_bytes
    assert all(b.numel() <= max(lay.numel for lay in mapping.layers) for b in mapping.buffers())
    stored = LatentMapping(net, 16, rank, "conv+linear", "stored", seed=9)
    assert mapping.fingerprint() != stored.fingerprint()  # another family
    same = LatentMapping(net, 16, rank, "conv+linear", "kronecker", seed=9)
    assert mapping.fingerprint() == same.fingerprint()
    assert mapping.fingerprint() != LatentMapping(net, 16, rank, "conv+linear", "kronecker", seed=8).fingerprint()


def test_kronecker_memory_for_resnet18_r32_d64():
    report = memory_report(ResNet18(), latent_dim=64, rank=32)
    assert report.kronecker_bytes == 45_350_368  # 43.2 MiB: the signs (11,159,232 floats) and small factors
    assert report.kronecker_bytes < report.stored_bytes / 30


def test_dense_mode_is_refused_for_large_models_without_allocating():
    with pytest.raises(ConfigError, match=r"2,856,763,392 bytes"):
        LatentMapping(ResNet18(), latent_dim=64, rank=32, mode="dense")


def test_payload_sizes_match_the_paper():
    model = LatentClassifier(ResNet18(), 100, base="scratch", latent_dim=64, rank=32, factors="streamed")
    state = model.federated_state()
    assert list(state) == ["mapping.latent"] and state["mapping.latent"].numel() == 1280
    assert FP32().encode(state, state, 0).nbytes == 5120
    assert Quantize(4).encode(state, state, 0).nbytes == 648
    d = sum(lay.latent_dim for lay in plan_layers(ResNet34(stem="tinyimagenet"), 1024, 32, "conv"))
    assert FP32().encode({"z": torch.zeros(d)}, {}, 0).nbytes == 147_456


def test_layer_selection_and_latent_dims():
    net = SmallCNN()
    assert [lay.name for lay in plan_layers(net, 4, 2, "conv")] == ["features.0.weight", "features.4.weight"]
    assert [lay.name for lay in plan_layers(net, 4, 2, "linear")] == ["fc.weight"]
    assert [lay.name for lay in plan_layers(net, 4, 2, ["features.0.*", "fc.w*"])] == ["features.0.weight", "fc.weight"]
    plan = plan_layers(net, [2, 3, 4], 3, "conv+linear")
    assert [(lay.latent_dim, lay.rank, lay.offset) for lay in plan] == [(2, 2, 0), (3, 3, 2), (4, 3, 5)]
    with pytest.raises(ConfigError, match="latent_dim has 2 entries but model.layers selects 3"):
        plan_layers(net, [2, 3], 2, "conv+linear")
    with pytest.raises(ConfigError, match="selects no weight"):
        plan_layers(net, 2, 2, ["nothing*"])


def test_scratch_base_keeps_the_random_initialisation():
    def weights(module):
        return {k: v for k, v in module.state_dict().items() if k.startswith(("backbone.", "head."))}

    def fresh_init(seed):  # the same draws from the global RNG, in the same order, without the latent
        torch.manual_seed(seed)
        return Classifier(SmallCNN(image_size=8), 10)

    torch.manual_seed(1)
    model = LatentClassifier(SmallCNN(image_size=8), 10, base="scratch")
    assert isinstance(model.backbone.features[0], nn.Conv2d)
    assert model._base_ready
    plain = fresh_init(1)
    base, same_seed, other_seed = weights(model), weights(plain), weights(fresh_init(2))
    assert list(base) == list(same_seed) and any(k.startswith("head.") for k in base)
    for name, w in base.items():
        assert torch.equal(w, same_seed[name]), f"{name} is not the seed's initialisation"
    mapped = [k for k, v in base.items() if k.startswith("backbone.") and v.ndim > 1]  # conv and linear weights
    assert len(mapped) >= 3
    for name in mapped:  # random: neither constant (e.g. zeroed) nor what another seed draws
        assert base[name].std() > 0 and not torch.equal(base[name], other_seed[name]), name
    assert not model.mapping.latent.any()  # the latent starts at zero, so the model computes the base's outputs
    x = torch.randn(3, 1, 8, 8)
    torch.testing.assert_close(model(x), plain(x), rtol=1e-5, atol=1e-6)
    with pytest.raises(ConfigError, match="drop one of them"):
        LatentClassifier(SmallCNN(image_size=8), 10, base="scratch", base_checkpoint="x.ckpt")


def test_teacher_warm_start_fits_the_latent_by_least_squares(tmp_path):
    """Appendix E's warm start: a random base, ``z`` at the least-squares fit of a converged teacher's weights."""
    torch.manual_seed(3)
    teacher = Classifier(SmallCNN(image_size=8, channels=[4, 8], feature_dim=16, norm_groups=2), 10)
    for p in teacher.backbone.parameters():
        p.data.normal_()
    torch.save({"state_dict": teacher.state_dict()}, tmp_path / "teacher.ckpt")

    def student(**kwargs):
        torch.manual_seed(5)
        backbone = SmallCNN(image_size=8, channels=[4, 8], feature_dim=16, norm_groups=2)
        return LatentClassifier(backbone, 10, base="scratch", layers="conv+linear", **kwargs)

    plain = student(latent_dim=32, rank=8)
    model = student(latent_dim=32, rank=8, latent_init="teacher", base_checkpoint=str(tmp_path / "teacher.ckpt"))
    # the base stays the random initialisation; only z moved
    for name, w in plain.backbone.state_dict().items():
        assert torch.equal(model.backbone.state_dict()[name], w), name
    assert model.mapping.latent.abs().sum() > 0 and not plain.mapping.latent.any()
    mapped, want = model.mapping.weights(model.mapped_base()), teacher.backbone.state_dict()
    for lay, z_l in zip(model.mapping.layers, model.mapping.split(model.mapping.latent.detach()), strict=True):
        m = (model.mapping.u_factor(lay) @ model.mapping.v_factor(lay).T).double()  # P x d
        delta = (want[lay.name] - model.mapped_base()[lay.name]).reshape(-1).double()
        best = torch.linalg.pinv(m, rtol=1e-6) @ delta  # the minimum-norm least-squares solution
        torch.testing.assert_close(z_l.double(), best, rtol=1e-4, atol=1e-5)
        # no other latent comes closer to the teacher
        err = (mapped[lay.name] - want[lay.name]).norm()
        other = model.mapping.mapped(lay, model.mapped_base()[lay.name], z_l + 0.01 * torch.randn_like(z_l))
        assert err < (other - want[lay.name].reshape(-1)).norm()
    teacher_ckpt = str(tmp_path / "teacher.ckpt")
    dense = student(latent_dim=32, factors="dense", latent_init="teacher", base_checkpoint=teacher_ckpt)
    for lay, z_l in zip(dense.mapping.layers, dense.mapping.split(dense.mapping.latent.detach()), strict=True):
        delta = (want[lay.name] - dense.mapped_base()[lay.name]).reshape(-1).double()
        best = torch.linalg.pinv(dense.mapping.u_factor(lay).double(), rtol=1e-6) @ delta
        torch.testing.assert_close(z_l.double(), best, rtol=1e-4, atol=1e-5)
    # with d and r as large as every layer, the mapped weights are the teacher's exactly
    full = student(latent_dim=2048, rank=2048, latent_init="teacher", base_checkpoint=str(tmp_path / "teacher.ckpt"))
    for name, w in full.mapping.weights(full.mapped_base()).items():
        torch.testing.assert_close(w, want[name], rtol=1e-4, atol=1e-4)
    with pytest.raises(ConfigError, match="set model.base scratch"):
        LatentClassifier(SmallCNN(image_size=8), 10, latent_init="teacher")
    with pytest.raises(ConfigError, match="'scratch' but model.base_checkpoint is set"):
        LatentClassifier(SmallCNN(image_size=8), 10, base="scratch", base_checkpoint="x.ckpt")
    with pytest.raises(ConfigError, match="model.latent_init must be 'zero' or 'teacher'"):
        LatentClassifier(SmallCNN(image_size=8), 10, base="scratch", latent_init="pca")


def test_teacher_warm_start_uses_the_base_the_recipe_pretrains(tmp_path):
    """Without a checkpoint the teacher is the cached base ``base: pretrained`` would get (same initial weights)."""
    from conftest import make_model, public_pretraining
    from lightning_fl.checkpoint import read_checkpoint

    dm, recipe = public_pretraining(tmp_path)
    pretrained = make_model(base="pretrained", pretraining=recipe)
    pretrained.prepare_base(dm)
    scratch = make_model()
    model = make_model(latent_init="teacher", pretraining=recipe)
    assert not model._base_ready and model.base_cache_path(dm) == pretrained.base_cache_path(dm)
    model.prepare_base(dm, allow_training=False)  # read from the cache: the same teacher
    for name, w in scratch.backbone.state_dict().items():
        assert torch.equal(model.backbone.state_dict()[name], w), name
    teacher = read_checkpoint(pretrained.base_cache_path(dm))["state_dict"]
    fit = make_model()
    fit.fit_latent({k.removeprefix("backbone."): v for k, v in teacher.items() if k.startswith("backbone.")})
    assert fit.mapping.latent.any() and torch.equal(model.mapping.latent, fit.mapping.latent)
    model.prepare_base(dm)  # a second call changes nothing
    assert torch.equal(model.mapping.latent, fit.mapping.latent)


def test_a_missing_base_checkpoint_is_named_by_its_own_key(tmp_path):
    """``model.base_checkpoint`` of a file that is not there names that key and says to pass a file (it named
    ``model.init_from`` and advised checking the backbone before)."""
    from lightning_fl.errors import CheckpointError

    missing = tmp_path / "missing.ckpt"
    with pytest.raises(CheckpointError, match=f"^model.base_checkpoint={missing} does not exist; pass the path"):
        LatentClassifier(SmallCNN(image_size=8), 10, base_checkpoint=str(missing))


def test_stored_factors_are_kept_column_major_with_u_s_values_and_fingerprint():
    """``stored`` keeps U column-major (its matrix-vector products stream columns, faster on CPU); the values, and
    so the fingerprint shared with ``regenerate`` and ``streamed``, are U's."""
    from lightning_fl.mapping import LatentMapping

    net = torch.nn.Sequential(torch.nn.Linear(40, 30), torch.nn.Linear(30, 5))
    stored, regenerated = (LatentMapping(net, 8, 4, "linear", mode) for mode in ("stored", "regenerate"))
    stored.materialise()
    for lay in stored.layers:
        u = getattr(stored, f"u_{lay.index}")
        assert u.shape == (lay.numel, lay.rank) and u.stride() == (1, lay.numel)
        assert torch.equal(u, stored.u_factor(lay))
    assert stored.fingerprint() == regenerated.fingerprint()


@pytest.mark.parametrize("factors", ["stored", "dense"])
def test_the_kept_start_trains_clients_bit_for_bit_as_forming_every_step_does(tmp_path, monkeypatch, factors):
    """Every client of a round starts at the global latent: its first mapped weights are formed once per round and
    reused (with addmv's own gradient), and 2 rounds of 4 clients end at the same state, bit for bit, as forming
    them at every step; a latent that moved is formed again."""
    import lightning_fl.mapping.kept as kept
    from conftest import make_dm, make_model, make_trainer
    from lightning_fl.mapping import LatentMapping

    reused = []
    apply = kept._Kept.apply
    monkeypatch.setattr(kept._Kept, "apply", lambda *args: reused.append(1) or apply(*args))
    runs = []
    for name in ("kept", "formed"):
        trainer = make_trainer(tmp_path, rounds=2, name=name, clients_per_round=4, limit_val_batches=0)
        trainer.fit(make_model(factors=factors), datamodule=make_dm())
        runs.append(trainer)
        if name == "kept":
            layers = len(make_model().mapping.layers)
            assert len(reused) == 2 * (4 - 1) * layers  # every client but each round's first, every mapped layer
            monkeypatch.setattr(LatentMapping, "keep_start", lambda self: None)
    a, b = runs
    assert all(torch.equal(a.global_state[n], b.global_state[n]) for n in a.global_state)
    assert [h.get("train/loss") for h in a.history] == [h.get("train/loss") for h in b.history]
