"""FMP: tasks, generator, summarisers, the one-shot protocol and meta-training."""

from __future__ import annotations

import math

import pytest
import torch

from conftest import FMP_SHRINK, C, D, context, generator, pool
from lightning_fl.compress import FP32, Quantize
from lightning_fl.errors import ConfigError
from lightning_fl.federated.server.gate import UploadRejectedError
from lightning_fl.oneshot import (
    ANN,
    CANN,
    FMP,
    LANN,
    LMP,
    MP,
    FederatedTasks,
    FMPMetaLearner,
    GeneratorTraining,
    Identity,
    KMeans,
    MeanPooling,
    PixelFeatures,
    PMASummariser,
    PolyaUrn,
    PredictiveGenerator,
    RandomSelection,
    TaskSampler,
)
from lightning_fl.oneshot.predictive import refit
from lightning_fl.oneshot.tasks import Task, make_points, split_points


# ------------------------------------------------------------------------- tasks
@pytest.mark.parametrize("alpha", [None, 0.1])
def test_tasks_are_deterministic_disjoint_and_sized(alpha):
    h, y = pool()
    sampler = TaskSampler(h, y, C, num_clients=3, points_per_client=40, alpha=alpha, heldout_points=20)
    a, b = sampler.sample(7), sampler.sample(7)
    assert torch.equal(a.clients, b.clients) and torch.equal(a.heldout, b.heldout)
    assert a.clients.shape == (3, 40, D + C) and a.heldout.shape == (20, D + C)
    # Points are rows of the pool; no row is used twice within a task.
    rows = torch.cat([a.pooled, a.heldout])[:, :D]
    assert len(torch.unique(rows, dim=0)) == len(rows)
    _, labels = split_points(a.clients, C)
    assert torch.equal(labels.sum(-1), torch.ones(3, 40))
    assert not torch.equal(a.clients, sampler.sample(8).clients)


def test_dirichlet_skew_concentrates_labels():
    h, y = pool(4000)
    skewed = TaskSampler(h, y, C, 5, 100, alpha=0.05).sample(0)
    iid = TaskSampler(h, y, C, 5, 100).sample(0)

    def top_share(task):  # mean share of each client's most common label
        return float(split_points(task.clients, C)[1].sum(1).max(-1).values.mean() / 100)

    assert top_share(skewed) > 0.8 > 0.45 > top_share(iid)


def test_meta_tasks_relabel_and_subset_classes():
    h, y = pool(2000)
    sampler = TaskSampler(h, y, C, 2, 50, vary_labels=True, min_classes=2)
    seen = set()
    for seed in range(20):
        task = sampler.sample(seed)
        kept = task.labels[task.labels >= 0]
        assert len(torch.unique(kept)) == len(kept) >= 2
        # Every point's label is the task label of its original class.
        original = task.pooled[:, :D]
        orig_class = torch.cdist(original, h).argmin(-1)
        assert torch.equal(split_points(task.pooled, C)[1].argmax(-1), task.labels[y[orig_class]])
        seen.add(tuple(task.labels.tolist()))
    assert len(seen) > 5


def test_task_sampler_rejects_tasks_the_pool_cannot_hold():
    h, y = pool(100)
    with pytest.raises(ValueError, match="lower points_per_client"):
        TaskSampler(h, y, C, 5, 30)
    with pytest.raises(ValueError, match="min_classes"):
        TaskSampler(h, y, C, 2, 20, vary_labels=True, min_classes=1)


@pytest.mark.parametrize("alpha", [None, 0.5])
def test_target_tasks_can_keep_a_fixed_class_subset_with_its_labels(alpha):
    h, y = pool(2000)
    sampler = TaskSampler(h, y, C, 2, 50, alpha=alpha, classes=[0, 2], heldout_points=10)
    task = sampler.sample(3)
    assert task.labels.tolist() == [0, -1, 2, -1]
    assert set(split_points(torch.cat([task.pooled, task.heldout]), C)[1].argmax(-1).tolist()) == {0, 2}
    for bad in ([], [0, C], [-1]):
        with pytest.raises(ValueError, match="fixed class subset"):
            TaskSampler(h, y, C, 2, 50, classes=bad)
    with pytest.raises(ValueError, match="lower points_per_client"):
        TaskSampler(h, y, C, 10, 100, classes=[1])  # one class cannot hold 1,000 points


def test_proposition1_terms_by_hand_and_the_lipschitz_estimate_is_the_largest_gradient():
    from lightning_fl.oneshot.bound import lipschitz_z, proposition1

    # M = 2, n = 10, s = 5, n' = 10: b_s = 10/20, Delta_s = 20/30 - 1/2 = 1/6
    out = proposition1(2, 10, 5, 10, mu=0.5, L_z=2.0, C=3.0, delta_s=0.1, D=0.6)
    assert out["b_s"] == pytest.approx(0.5) and out["Delta_s"] == pytest.approx(1 / 6)
    assert out["bound"] == pytest.approx(2 * math.sqrt(4 * ((0.5 + 0.5 * 3) * 0.1 + 0.6 / 6)))
    assert proposition1(2, 10, 10, 10, 0.5, 2.0, 3.0, 0.0, 0.6)["bound"] == 0.0  # s = n, Z~ = Z: both terms vanish
    g = torch.Generator().manual_seed(0)
    W = torch.randn(3, C, D, generator=g, dtype=torch.float64)
    points = make_points(torch.randn(5, D, generator=g, dtype=torch.float64), torch.tensor([0, 1, 2, 3, 0]), C)
    points[0, D:] = torch.tensor([0.2, 0.3, 0.5, 0.0], dtype=torch.float64)  # a soft label too
    norms = []
    for Wk in W:
        for z in points:
            z = z.clone().requires_grad_(True)
            x, t = split_points(z, C)
            loss = -(t * (Wk @ x).log_softmax(-1)).sum()
            norms.append(float(torch.autograd.grad(loss, z)[0].norm()))
    assert lipschitz_z(W, points, C) == pytest.approx(max(norms), rel=1e-12)


def test_posterior_quality_by_hand():
    from lightning_fl.oneshot.quality import ood_scores, predictive_entropy, theta_spread

    W = torch.zeros(2, 3, 1, 2)
    W[0, :, 0, 0] = torch.tensor([1.0, 2.0, 3.0])  # model 0: samples 1, 2, 3 in one coordinate: mean distance 2/3
    assert float(theta_spread(W)) == pytest.approx((2 / 3 + 0) / 2)
    assert float(theta_spread(W[:, :1])) == 0.0
    uniform, sure = torch.full((1, 4), 0.25), torch.tensor([[1.0, 0.0, 0.0, 0.0]])
    assert torch.allclose(predictive_entropy(torch.cat([uniform, sure])), torch.tensor([math.log(4), 0.0]))
    half = torch.tensor([[0.5, 0.5, 0.0, 0.0]])
    scores = ood_scores(torch.cat([sure, half]), torch.cat([uniform, half]))
    # OOD uniform beats both in-distribution points, OOD half ties with one and beats one: (2 + 1.5) / 4
    assert float(scores["ood_auroc"]) == pytest.approx(3.5 / 4)
    assert float(scores["entropy"]) == pytest.approx(math.log(2) / 2)
    assert float(scores["ood_entropy"]) == pytest.approx((math.log(4) + math.log(2)) / 2)


# ------------------------------------------------------------------------- generator and summarisers
def test_generator_is_conditionally_exchangeable():
    gen = generator()
    z = make_points(*pool(30), C).unsqueeze(0)
    noise = gen.noise(1, 2, 12, generator=torch.Generator().manual_seed(1))
    out = gen(z, noise)
    assert out.shape == (1, 2, 12, D + C)
    assert torch.allclose(split_points(out, C)[1].sum(-1), torch.ones(1, 2, 12))
    # Permuting the observed set changes nothing; permuting the base set permutes the output.
    assert torch.allclose(gen(z[:, torch.randperm(30)], noise), out, atol=1e-5)
    perm = torch.randperm(12)
    assert torch.allclose(gen(z, noise[:, :, perm]), out[:, :, perm], atol=1e-5)


@pytest.mark.parametrize(
    "summariser",
    [
        PMASummariser(5, hidden=16, num_heads=2),
        PMASummariser(5, hidden=16, num_heads=2, readout="linear", layer_norm=False),
        RandomSelection(5),
        MeanPooling(5),
        KMeans(5),
    ],
)
def test_summarisers_upload_s_points_of_the_data_layout(summariser):
    summariser.configure(D, C)
    z = make_points(*pool(40), C).reshape(2, 20, D + C)
    out = summariser(z, generator=torch.Generator().manual_seed(0))
    assert out.shape == (2, 5, D + C)
    assert torch.allclose(split_points(out, C)[1].sum(-1), torch.ones(2, 5), atol=1e-5)


def test_kmeans_finds_separated_clusters_and_chamfer_by_hand():
    from lightning_fl.oneshot.summarize import chamfer, kmeans_centres

    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(20, 3, generator=g) * 0.1, torch.randn(30, 3, generator=g) * 0.1 + 10
    z = torch.cat([a, b])[torch.randperm(50, generator=g)].unsqueeze(0)
    centres = kmeans_centres(z, 2, generator=torch.Generator().manual_seed(1))[0]
    centres = centres[centres[:, 0].argsort()]
    assert torch.allclose(centres, torch.stack([a.mean(0), b.mean(0)]), atol=1e-5)
    x, y = torch.tensor([[[0.0, 0.0], [2.0, 0.0]]]), torch.tensor([[[0.0, 1.0]]])
    assert float(chamfer(x, y)) == pytest.approx((1 + 5) / 2 + 1)  # x -> y: 1 and 5; y -> x: 1
    with pytest.raises(ValueError, match="1 <= k <= n"):
        kmeans_centres(z, 51)
    summariser = KMeans(2)
    summariser.configure(2, 1)
    assert torch.equal(
        summariser(z, torch.Generator().manual_seed(1)), kmeans_centres(z, 2, 10, torch.Generator().manual_seed(1))
    )


def test_pma_summary_is_permutation_invariant():
    pma = PMASummariser(4, hidden=16, num_heads=2)
    pma.configure(D, C)
    z = make_points(*pool(20), C).unsqueeze(0)
    assert torch.allclose(pma(z), pma(z[:, torch.randperm(20)]), atol=1e-5)


def test_mean_pooling_keeps_the_client_mean():
    pooling = MeanPooling(5)
    z = make_points(*pool(20), C).unsqueeze(0)
    assert torch.allclose(pooling(z).mean(1), z.mean(1), atol=1e-5)


# ------------------------------------------------------------------------- protocol
def test_fmp_with_identity_summariser_is_exactly_mp():
    task = TaskSampler(*pool(), C, 3, 30).sample(0)
    ctx = context(Identity())
    assert torch.equal(FMP().run(task, ctx).W, MP().run(task, ctx).W)
    # ... and a lossy summary moves it away.
    lossy = context(RandomSelection(5))
    assert (FMP().run(task, lossy).W - MP().run(task, lossy).W).norm() > 1e-3


def test_baseline_shapes_bytes_and_cann_is_the_mean_of_local_solutions():
    task = TaskSampler(*pool(), C, 3, 30).sample(0)
    ctx = context(RandomSelection(5))
    fmp = FMP().run(task, ctx)
    assert fmp.W.shape == (1, 3, C, D) and fmp.bytes_per_client == 5 * (D + C) * 4
    local = LANN().run(task, ctx).W
    assert local.shape == (3, 1, C, D)
    cann = CANN().run(task, ctx)
    assert torch.allclose(cann.W[0, 0], local[:, 0].mean(0)) and cann.bytes_per_client == C * D * 4
    assert LMP().run(task, ctx).W.shape == (3, 3, C, D)
    assert ANN().run(task, ctx).W.shape == (1, 1, C, D)
    int8 = FMP().run(task, context(RandomSelection(5), Quantize(bits=8)))
    assert int8.bytes_per_client < fmp.bytes_per_client / 3


def test_polya_urn_draws_by_hand():
    """N = 2 observed points, u = (0.6, 0.1, 0.9): draw 1 picks floor(0.6 x 2) = 1 (z1), draw 2 floor(0.1 x 3) = 0
    (z0), draw 3 floor(0.9 x 4) = 3, the urn's fourth point: draw 2's copy of z0."""
    z = torch.tensor([[[1.0, 2.0, 1.0, 0.0], [3.0, 4.0, 0.0, 1.0]]], dtype=torch.float64)  # D = 2, C = 2
    u = torch.tensor([0.6, 0.1, 0.9], dtype=torch.float64)
    eps = torch.tensor([[0.5, -1.0], [2.0, 0.0], [1.0, 1.0]], dtype=torch.float64)
    noise = torch.cat([torch.special.ndtri(u)[:, None], eps], -1)[None, None]  # (1, 1, 3, 1 + D)
    urn = PolyaUrn()
    urn.configure(2, 2)
    assert urn.noise(1, 3).shape == (1, 3, 1)
    assert urn(z, noise[..., :1])[0, 0].tolist() == [z[0, 1].tolist(), z[0, 0].tolist(), z[0, 0].tolist()]
    smooth = PolyaUrn(bandwidth=0.1)
    smooth.configure(2, 2)
    assert smooth.noise(1, 3).shape == (1, 3, 3)
    want = [[3.05, 3.9, 0, 1], [1.2, 2.0, 1, 0], [1.3, 2.1, 1, 0]]  # draw 3 moves draw 2's point again
    assert torch.allclose(smooth(z, noise)[0, 0], torch.tensor(want, dtype=torch.float64))
    with pytest.raises(ValueError, match="bandwidth must be >= 0"):
        PolyaUrn(bandwidth=-1.0)
    # Gradients reach the observed points (FMP meta-trains through the urn): each is used as often as it is copied.
    leaf = z.clone().requires_grad_(True)
    smooth(leaf, noise).sum().backward()
    assert leaf.grad.tolist() == [[[2.0] * 4, [1.0] * 4]]


def test_polya_urn_weights_the_observed_points_like_the_bayesian_bootstrap():
    """With many draws the share of copies of z0 among N = 2 points is Beta(1, 1): mean 1/2, variance 1/12."""
    z = torch.tensor([[[0.0, 1.0, 0.0], [1.0, 0.0, 1.0]]])
    urn = PolyaUrn()
    urn.configure(1, 2)
    drawn = urn(z, urn.noise(1, 4000, 300, generator=torch.Generator().manual_seed(0)))  # (1, S, n', P)
    share = (drawn[0, :, :, 0] == 0).double().mean(1)  # (S,)
    assert abs(float(share.mean()) - 0.5) < 0.02
    assert abs(float(share.var()) - 1 / 12) < 0.01  # the plain bootstrap's would be 1 / (4 x 300)


def test_refit_matches_sequential_solves():
    gen = generator()
    z = make_points(*pool(40), C).reshape(2, 20, D + C)
    generated = gen(z, gen.noise(2, 2, 8))
    W = refit(z, generated, C, l2=0.1)
    x, t = split_points(torch.cat([z[1], generated[1, 0]]), C)
    from lightning_fl.oneshot import fit_softmax

    assert torch.allclose(W[1, 0], fit_softmax(x, t, 0.1), atol=1e-4)


def test_the_spread_term_compares_the_refits_with_the_polya_urns_by_hand():
    """``delta * mean_b (log spread(W_b) - log spread(W^urn_b))^2``: the urn's draws come right after the generator's
    from the global generator, so the term can be rebuilt from the same seed."""
    from lightning_fl.oneshot.predictive import generator_loss
    from lightning_fl.oneshot.quality import sample_spread

    gen = generator().requires_grad_(True)
    z = make_points(*pool(60), C).reshape(3, 20, D + C)
    ctx, heldout = z[:2], z[2:].expand(2, 20, D + C)
    torch.manual_seed(5)
    base, base_terms = generator_loss(gen, ctx, heldout, 12, 3, l2=0.1, beta=0.1)
    torch.manual_seed(5)
    loss, terms = generator_loss(gen, ctx, heldout, 12, 3, l2=0.1, beta=0.1, delta=2.0)
    torch.manual_seed(5)
    with torch.no_grad():
        W = refit(ctx, gen(ctx, gen.noise(2, 3, 12)), C, 0.1)
        urn = PolyaUrn()
        urn.configure(D, C)
        W_urn = refit(ctx, urn(ctx, urn.noise(2, 3, 12)), C, 0.1)
    ratio = sample_spread(W) / sample_spread(W_urn)
    assert terms["spread_mismatch"] == pytest.approx(float(ratio.log().pow(2).mean()), rel=1e-4)
    assert terms["spread_ratio"] == pytest.approx(float(ratio.mean()), rel=1e-4)
    assert terms["nll"] == base_terms["nll"] and "spread_ratio" not in base_terms
    assert float(loss.detach()) == pytest.approx(float(base.detach()) + 2.0 * terms["spread_mismatch"], rel=1e-5)
    # the term trains the generator: its gradient is not the one of the loss without it
    grad = torch.autograd.grad(loss - base, list(gen.parameters()), allow_unused=True)
    assert any(g is not None and g.abs().sum() > 0 for g in grad)
    with pytest.raises(ValueError, match="num_samples >= 2"):
        generator_loss(gen, ctx, heldout, 12, 1, l2=0.1, delta=1.0)


def test_spread_recipe_is_checked_and_named_in_the_cache_key_only_when_used():
    assert "delta" not in GeneratorTraining().key()  # generators cached before the term existed stay valid
    assert GeneratorTraining(delta=0.5).key()["delta"] == 0.5
    with pytest.raises(ValueError, match="num_samples >= 2"):
        GeneratorTraining(delta=0.5, num_samples=1)
    with pytest.raises(ValueError, match="delta must be >= 0"):
        GeneratorTraining(delta=-1.0)


# ------------------------------------------------------------------------- meta-training
def small_tasks(**kw) -> FederatedTasks:
    args = {
        "num_clients": 3,
        "points_per_client": 30,
        "target_fraction": 0.4,
        "meta_tasks": 400,
        "tasks_per_step": 4,
        "val_tasks": 4,
        "test_tasks": 2,
        "heldout_points": 30,
        "min_classes": 6,
    }
    args.update(kw)
    return FederatedTasks(PixelFeatures(), **args)


def learner(**kw) -> FMPMetaLearner:
    args = {
        "summariser": PMASummariser(6, hidden=32, num_heads=2),
        "generator": PredictiveGenerator(32, 2),
        "generator_training": GeneratorTraining(steps=6, tasks_per_step=2, num_samples=2, eval_tasks=2),
        "num_generated": 30,
        "train_samples": 2,
        "test_samples": 4,
        "lr": 3e-3,
    }
    args.update(kw)
    return FMPMetaLearner(**args)


def test_meta_training_beats_untrained_random_and_mean_pooling(tmp_path):
    import lightning as L

    torch.manual_seed(0)
    model = learner(cache_dir=str(tmp_path))
    trainer = L.Trainer(
        max_steps=150,
        val_check_interval=150,
        check_val_every_n_epoch=None,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    data = small_tasks()
    trainer.fit(model, datamodule=data)
    val = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val/")}
    assert val["val/theta_dist"] < min(
        val["val/theta_dist_untrained"], val["val/theta_dist_random"], val["val/theta_dist_mean"]
    ), val
    # The cached generator is reused by a second run (no training: patch it to fail).
    model2 = learner(cache_dir=str(tmp_path))
    model2._train_generator = lambda *a: pytest.fail("generator retrained despite the cache")
    trainer2 = L.Trainer(
        max_steps=1,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    trainer2.fit(model2, datamodule=small_tasks())
    assert torch.equal(
        next(iter(model2.generator.state_dict().values())), next(iter(model.generator.state_dict().values()))
    )


def test_meta_training_does_not_depend_on_the_target_tasks_partition(tmp_path):
    """What tools/sweep.py's fit_from relies on: runs differing only in data.alpha (the target and validation
    tasks' partition) meta-train the same summariser bit for bit, validation included, so one fit serves them."""
    import lightning as L

    weights = []
    for alpha in (None, 0.1):
        torch.manual_seed(0)
        model = learner(cache_dir=str(tmp_path))
        trainer = L.Trainer(
            max_steps=6,
            val_check_interval=2,
            check_val_every_n_epoch=None,
            num_sanity_val_steps=0,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            default_root_dir=tmp_path,
        )
        trainer.fit(model, datamodule=small_tasks(alpha=alpha))
        weights.append(model.summariser.state_dict())
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])


def test_the_generator_cache_key_names_the_target_classes_its_report_was_scored_on(monkeypatch):
    from types import SimpleNamespace

    keys = []
    for target_classes in (None, 7, 8):
        dm = small_tasks(target_classes=target_classes)
        dm.setup()
        model = learner()
        monkeypatch.setattr(FMPMetaLearner, "trainer", property(lambda self, dm=dm: SimpleNamespace(datamodule=dm)))
        keys.append(model.generator_cache_key()["tasks"])
    assert keys[0] == [3, 30, [None, 1.0, 0.1], 6, 30, 0]  # as before target_classes existed
    assert keys[1] == [*keys[0], 7] and keys[2] == [*keys[0], 8]


@pytest.mark.parametrize("setting", [{"labels": "sampled"}, {"label_l2": 0.1}, {"hidden": 16}, {"layer_norm": False}])
def test_every_generator_setting_is_in_its_cache_key(monkeypatch, setting):
    """A generator trained with other settings is never served from the cache (``labels`` once was not in the key)."""
    from types import SimpleNamespace

    dm = small_tasks()
    dm.setup()
    monkeypatch.setattr(FMPMetaLearner, "trainer", property(lambda self: SimpleNamespace(datamodule=dm)))
    base = {"hidden": 32, "num_heads": 2}
    default = learner(generator=PredictiveGenerator(**base)).generator_cache_key()
    other = learner(generator=PredictiveGenerator(**{**base, **setting})).generator_cache_key()
    assert other["generator"] != default["generator"]


def test_the_generator_cache_key_names_the_threads_that_train_it(monkeypatch):
    """Another thread count trains another generator (sums added in another order): never served from the cache."""
    from types import SimpleNamespace

    dm = small_tasks()
    dm.setup()
    monkeypatch.setattr(FMPMetaLearner, "trainer", property(lambda self: SimpleNamespace(datamodule=dm)))
    threads = torch.get_num_threads()
    keys = []
    try:
        for n in (1, 2, 1):
            torch.set_num_threads(n)
            keys.append(learner().generator_cache_key())
    finally:
        torch.set_num_threads(threads)
    assert keys[0] == keys[2] and keys[1] != keys[0]
    assert (keys[0]["environment"]["threads"], keys[1]["environment"]["threads"]) == (1, 2)
    assert type(keys[0]["environment"]["torch"]) is str  # the file keeps its key, read back with weights_only


def quiet_trainer(tmp_path, **kwargs):
    """A ``lightning.Trainer`` without validation, logger, checkpoints, progress bar or summary."""
    import lightning as L

    quiet = {"limit_val_batches": 0, "logger": False, "enable_checkpointing": False, "enable_progress_bar": False}
    return L.Trainer(**quiet, enable_model_summary=False, default_root_dir=tmp_path, **kwargs)


def test_warmup_steps_match_k_means_centres_before_the_theta_distance(tmp_path):
    def fit(steps):
        model = learner(cache_dir=str(tmp_path), warmup_steps=3)
        trainer = quiet_trainer(tmp_path, max_steps=steps)
        trainer.fit(model, datamodule=small_tasks())
        return trainer.callback_metrics

    warm = fit(3)
    assert "train/warmup_chamfer" in warm and "train/theta_dist" not in warm
    assert "train/theta_dist" in fit(4)


@pytest.mark.parametrize("label_weight", [None, 1.0, 2.5])
def test_warmup_weighs_the_label_parts_as_set(tmp_path, monkeypatch, label_weight):
    """The warm-up's Chamfer distance compares the k-means centres with their D features at weight 1 and their C
    label parts at ``warmup_label_weight`` (``None``: sqrt(D))."""
    import lightning_fl.oneshot.meta_learner as meta

    seen = {}
    kmeans, chamfer = meta.kmeans_centres, meta.chamfer
    monkeypatch.setattr(meta, "kmeans_centres", lambda *a, **k: seen.setdefault("centres", kmeans(*a, **k)))
    monkeypatch.setattr(meta, "chamfer", lambda a, b: seen.setdefault("weighted", b) is b and chamfer(a, b))
    model = learner(cache_dir=str(tmp_path), warmup_steps=1, warmup_label_weight=label_weight)
    quiet_trainer(tmp_path, max_steps=1).fit(model, datamodule=small_tasks())
    D, C = model.generator.feature_dim, model.generator.num_classes
    centres, weighted = seen["centres"], seen["weighted"]
    assert centres.shape[-1] == D + C
    torch.testing.assert_close(weighted[..., :D], centres[..., :D], rtol=0, atol=0)
    w = D**0.5 if label_weight is None else label_weight
    torch.testing.assert_close(weighted[..., D:], centres[..., D:] * w)
    with pytest.raises(ConfigError, match="warmup_label_weight must be > 0 or null"):
        learner(warmup_label_weight=0.0)


@pytest.mark.parametrize(
    ("precision", "accelerator", "dtype"),
    [
        ("bf16-mixed", "cpu", torch.bfloat16),
        # Lightning runs fp16 AMP on a CPU as bf16: this case only checks that substitution, nothing more.
        ("16-mixed", "cpu", torch.bfloat16),
        pytest.param(
            "16-mixed",
            "cuda",
            torch.float16,
            marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="GPU")],
        ),
    ],
    ids=["bf16-cpu", "16-on-cpu-is-bf16", "16-gpu"],
)
def test_mixed_precision_meta_training_runs_the_summariser_under_autocast(tmp_path, precision, accelerator, dtype):
    """The meta-training step runs the summariser under autocast in ``dtype`` and its loss stays finite."""
    model = learner(cache_dir=str(tmp_path))
    device = "cuda" if accelerator == "cuda" else "cpu"
    seen = []
    model.summariser.register_forward_hook(
        lambda *_: seen.append((torch.is_autocast_enabled(device), torch.get_autocast_dtype(device)))
    )
    trainer = quiet_trainer(tmp_path, max_steps=2, accelerator=accelerator, devices=1, precision=precision)
    trainer.fit(model, datamodule=small_tasks())
    assert torch.isfinite(trainer.callback_metrics["train/theta_dist"])
    assert seen and all(state == (True, dtype) for state in seen), seen


# ------------------------------------------------------------------------- CLI end to end
def test_fmp_digits_config_fits_then_tests_from_its_checkpoint(in_tmp, monkeypatch):
    from conftest import CONFIGS, capture_test_results, run_cli

    monkeypatch.setenv("LIGHTNING_FL_CACHE", str(in_tmp / "cache"))
    config = str(CONFIGS / "fmp_digits.yaml")
    assert run_cli("fit", "--config", config, *FMP_SHRINK) == 0
    ckpt = in_tmp / "runs/fmp_digits/version_0/checkpoints/last.ckpt"
    assert ckpt.is_file()
    captured = capture_test_results(monkeypatch)
    # The generator comes from the checkpoint: clearing the cache must not trigger training.
    monkeypatch.setattr(FMPMetaLearner, "_train_generator", lambda *a: pytest.fail("generator retrained"))
    monkeypatch.setenv("LIGHTNING_FL_CACHE", str(in_tmp / "empty_cache"))
    assert run_cli("test", "--config", config, *FMP_SHRINK, "--ckpt_path", str(ckpt)) == 0
    metrics = captured["out"][0]
    for key in [
        "test/acc",
        "test/ece",
        "test/nll",
        "comm/kb_per_client",
        "test/theta_dist",
        "test/delta_s",
        "test/D",
        "test/prop1_bound",
        "test/prop1/L_z",
        "test/prop1/C",
        "test/mp/acc",
        "test/ann/acc",
        "test/cann/acc",
        "comm/cann/kb_per_client",
    ]:
        assert key in metrics, key
    assert metrics["comm/kb_per_client"] == pytest.approx(10 * (64 + 10) * 4 / 1000)
    # 4 steps leave the config's linear read-out at its random start (it trains after a 600-step warm-up), so
    # FMP's accuracy here says nothing; MP's, on the same tasks and features, checks the pipeline
    assert 0.0 <= metrics["test/acc"] <= 1.0 and 0.3 < metrics["test/mp/acc"] <= 1.0


def test_a_shortened_run_validates_at_its_last_step_and_names_what_its_steps_leave_long(
    in_tmp, monkeypatch, capsys, caplog
):
    """``--trainer.max_steps`` below the config's ``val_check_interval`` (300) validates at the run's last step; lines
    name the generator's own steps and a k-means warm-up that covers every step; without a progress bar the
    meta-training reports its steps."""
    from conftest import CONFIGS, run_cli

    monkeypatch.setenv("LIGHTNING_FL_CACHE", str(in_tmp / "cache"))
    shrink = dict(zip(FMP_SHRINK[::2], FMP_SHRINK[1::2], strict=True))
    del shrink["--trainer.val_check_interval"]  # the config's 300
    shrink["--model.generator_training.steps"] = "5"  # more than the run's 4 steps
    assert run_cli("fit", "--config", str(CONFIGS / "fmp_digits.yaml"), *(a for kv in shrink.items() for a in kv)) == 0
    assert "val/theta_dist: " in capsys.readouterr().out  # it validated
    assert "trainer.val_check_interval 300 is beyond trainer.max_steps 4: validating at step 4, the last" in caplog.text
    assert "Training the predictive generator for 5 steps" in caplog.text
    assert "more than trainer.max_steps 4: add --model.generator_training.steps 4 too" in caplog.text
    assert "model.warmup_steps 600 covers all 4 steps" in caplog.text and "--model.warmup_steps 2" in caplog.text
    assert "meta-training step 4/4 (k-means warm-up): loss " in caplog.text


def test_the_polya_urn_is_selected_by_class_path_and_needs_no_training(in_tmp, monkeypatch):
    from conftest import CONFIGS, capture_test_results, run_cli

    monkeypatch.setenv("LIGHTNING_FL_CACHE", str(in_tmp / "cache"))
    monkeypatch.setattr(FMPMetaLearner, "_train_generator", lambda *a: pytest.fail("the urn has nothing to train"))
    captured = capture_test_results(monkeypatch)
    config = str(CONFIGS / "fmp_digits.yaml")
    assert run_cli("fit", "--config", config, *FMP_SHRINK, "--model.generator", "PolyaUrn") == 0  # through the urn
    kmeans = '{"class_path": "KMeans", "init_args": {"num_points": 10}}'
    methods = (
        f'[{{"class_path": "MP"}}, {{"class_path": "FMP", "init_args": {{"name": "fmp_km", "summariser": {kmeans}}}}}]'
    )
    assert (
        run_cli("test", "--config", config, *FMP_SHRINK, "--model.generator", "PolyaUrn", "--model.methods", methods)
        == 0
    )
    metrics = captured["out"][0]
    assert 0.3 < metrics["test/mp/acc"] <= 1.0
    assert metrics["test/fmp_km/theta_dist"] > 0 and "test/mp/theta_dist" not in metrics
    assert not (in_tmp / "cache" / "generators").exists()
    assert (
        run_cli(
            "test",
            "--config",
            config,
            *FMP_SHRINK,
            "--model.generator",
            "PolyaUrn",
            "--model.generator_checkpoint",
            "x.pt",
        )
        == 2
    )


def test_target_classes_score_each_method_on_the_classes_the_tasks_leave_out(in_tmp, monkeypatch):
    from conftest import CONFIGS, capture_test_results, run_cli

    monkeypatch.setenv("LIGHTNING_FL_CACHE", str(in_tmp / "cache"))
    captured = capture_test_results(monkeypatch)
    config = str(CONFIGS / "fmp_digits.yaml")
    # the data read-out: 4 steps leave the config's linear one at its random start (near-uniform predictions)
    args = [
        *FMP_SHRINK,
        "--model.generator",
        "PolyaUrn",
        "--data.points_per_client",
        "30",
        "--model.summariser.readout",
        "data",
        "--model.warmup_steps",
        "0",
    ]
    assert run_cli("test", "--config", config, *args, "--data.target_classes", "6") == 0
    metrics = captured["out"][0]
    for method in ("mp", "ann", "cann", "fmp"):
        assert 0 < metrics[f"test/{method}/entropy"] < math.log(10)
        assert metrics[f"test/{method}/ood_entropy"] > metrics[f"test/{method}/entropy"]  # unseen classes: less sure
        assert 0.5 < metrics[f"test/{method}/ood_auroc"] <= 1
    assert metrics["test/mp/theta_spread"] > 0 == metrics["test/ann/theta_spread"]  # a posterior vs a point estimate
    assert run_cli("test", "--config", config, *args) == 0  # every class: no OOD points, entropy only
    assert "test/mp/ood_auroc" not in captured["out"][0] and "test/mp/entropy" in captured["out"][0]
    assert run_cli("test", "--config", config, *args, "--data.target_classes", "10") == 2


@pytest.mark.parametrize(
    ("override", "named"),
    [
        (["--model.l2", "0"], r"model \(FMPMetaLearner\): l2 must be > 0, got 0"),
        (
            ["--data.points_per_client", "5000", *FMP_SHRINK],
            r"data: the meta-training pool \(\d+ points\) cannot hold these tasks: .*points_per_client.*"
            r": lower points_per_client or num_clients, or raise min_classes",
        ),
        (["--model.generator_training.delta", "-1"], r"model\.generator_training\.delta must be >= 0"),
        (
            ["--model.generator_training.delta", "1", "--model.generator_training.num_samples", "1"],
            r"set model\.generator_training\.num_samples >= 2 \(got 1\)",
        ),
    ],
    ids=["l2", "points_per_client", "delta", "delta_samples"],
)
def test_config_mistakes_are_named(in_tmp, monkeypatch, capsys, override, named):
    """Exit code 2 and one ``error:`` line that names the key and says what to change."""
    import re

    from conftest import CONFIGS, run_cli

    monkeypatch.setenv("LIGHTNING_FL_CACHE", str(in_tmp / "cache"))
    capsys.readouterr()
    assert run_cli("fit", "--config", str(CONFIGS / "fmp_digits.yaml"), *override) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, errors
    assert re.search(named, errors[0]), errors[0]


def test_a_malformed_summary_upload_is_refused_with_the_client_named():
    task = TaskSampler(*pool(), C, 3, 30).sample(0)

    class Broken(RandomSelection):
        def forward(self, z, generator=None):
            out = super().forward(z, generator).clone()
            out[1, 0, 0] = float("nan")
            return out

    with pytest.raises(UploadRejectedError, match=r"upload of client 1 refused: summary\S*: 1 non-finite"):
        FMP().run(task, context(Broken(5)))


def test_hard_label_uploads_send_one_label_per_point_and_refit_on_it_one_hot():
    task = TaskSampler(*pool(), C, 3, 30).sample(0)
    ctx = context(RandomSelection(5))
    hard = FMP(labels="hard").run(task, ctx)
    assert hard.bytes_per_client == 5 * (D + 1) * 4  # the paper's s (D + 1) floats: 30 x 129 x 4 at D = 128
    soft_points = RandomSelection(5)(task.clients, generator=torch.Generator().manual_seed(0))
    h, p = split_points(soft_points.reshape(-1, D + C), C)
    assert torch.equal(hard.extras["summary"], make_points(h, p.argmax(-1), C))
    assert torch.equal(hard.W, MP().run(Task(hard.extras["summary"].reshape(3, 5, D + C), task.labels, C), ctx).W)
    # a lossy codec moves the label values; the server rounds them back to the same classes
    int4 = FMP(labels="hard").run(task, context(RandomSelection(5), Quantize(bits=4)))
    assert torch.equal(split_points(int4.extras["summary"], C)[1], split_points(hard.extras["summary"], C)[1])
    with pytest.raises(ValueError, match="labels must be 'soft' or 'hard'"):
        FMP(labels="one")


def test_a_hard_label_outside_the_classes_is_refused_with_the_client_named():
    task = TaskSampler(*pool(), C, 3, 30).sample(0)

    class Shift(FP32):  # a client whose labels arrive as class C (one past the last)
        def encode(self, state, reference, client):
            if client == 2:
                state = {**state, "labels": state["labels"] * 0 + C}
            return super().encode(state, reference, client)

    with pytest.raises(UploadRejectedError, match=r"upload of client 2 refused: labels: 5 value\(s\) outside"):
        FMP(labels="hard").run(task, context(RandomSelection(5), Shift()))


def test_bf16_autocast_theta_distance_is_close_to_fp32():
    """The set transformers run in bf16 under autocast, ERM stays in fp32: the loss moves by under 5%."""
    gen = generator()
    summariser = PMASummariser(5, hidden=16, num_heads=2)
    summariser.configure(D, C)
    model = FMPMetaLearner(summariser=summariser, generator=gen, l2=0.05)
    model.generator = gen  # configured and frozen
    clients = TaskSampler(*pool(), C, 3, 20).sample(0).clients.unsqueeze(0)
    noise = gen.noise(1, 2, 16, generator=torch.Generator().manual_seed(0))
    fp32 = model.theta_distance(clients, summariser, noise)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        bf16 = model.theta_distance(clients, summariser, noise)
    assert bf16.dtype == torch.float32
    assert torch.allclose(bf16, fp32, rtol=0.05), (bf16, fp32)
