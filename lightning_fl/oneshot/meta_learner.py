"""FMP's meta-learner: meta-training the summariser, and the one-shot evaluation of every method.

FMP ("Federated Martingale Posterior Sampling", section IV): clients upload ``s`` summary points ``Z~_m = h_phi(Z_m)``;
the server generates ``Z~' = ISAB(Z~, E)`` with a frozen predictive generator and refits the
model by ERM for each base set ``E``. The summariser is meta-trained on equation (7),
``mean_i ||theta_MP(Z^i, E^i) - theta_FMP(Z^i, E^i)||`` over tasks from a meta-training corpus,
with the same base set on both sides; only ``phi`` trains.

``fit`` prepares the features (datamodule), then the generator (checkpoint, cache or training;
compared with naive resampling), then meta-trains. ``validate`` reports the distance to
centralised MP on held-out tasks for the summariser and for random selection and mean pooling at
the same ``s``. ``test`` runs the one-shot protocol and every method in ``methods`` on target tasks
and reports accuracy, ECE (15 bins), NLL, KB per client, ``||theta_MP - theta_FMP||`` and
Proposition 1's diagnostics ``delta_s = W1(P_Z, P_Z~)`` and ``D = W1(P_Z, P_Z')``.

Kept as one file: it is one LightningModule, :class:`FMPMetaLearner`, whose three stages (meta-training, the
distance to MP on held-out tasks, the one-shot protocol) share the generator and summariser it prepares; the parts
that stand alone already live beside it (``generator_training.py``, ``summarize.py``, ``tasks.py``, ``methods.py``).
"""

from __future__ import annotations

import copy
import logging
import math
import time
from dataclasses import asdict
from pathlib import Path

import lightning as L
import torch
from torch import Tensor

from lightning_fl.checkpoint import (
    atomic_save,
    cache_file,
    checkpoint_name,
    compute_environment,
    digest_tensors,
    read_checkpoint,
    state_mismatch,
    tensor_state,
)
from lightning_fl.compress.base import FP32, Codec
from lightning_fl.errors import CheckpointError, ConfigError
from lightning_fl.metrics import classification_metrics
from lightning_fl.oneshot.base import Context, OneShotMethod, Outcome
from lightning_fl.oneshot.bound import lipschitz_z, proposition1
from lightning_fl.oneshot.distances import wasserstein1
from lightning_fl.oneshot.erm import predict_proba
from lightning_fl.oneshot.generator_training import GeneratorTraining, evaluate_generator, train_generator
from lightning_fl.oneshot.methods import ANN, CANN, FMP, MP
from lightning_fl.oneshot.predictive import Predictive, PredictiveGenerator, refit
from lightning_fl.oneshot.quality import ood_scores, predictive_entropy, theta_spread
from lightning_fl.oneshot.summarize import (
    MeanPooling,
    PMASummariser,
    RandomSelection,
    Summariser,
    chamfer,
    kmeans_centres,
)
from lightning_fl.oneshot.tasks import Task

log = logging.getLogger(__name__)


class FMPMetaLearner(L.LightningModule):
    """Meta-trains FMP's summariser and evaluates the one-shot protocol (run by ``lightning.Trainer``).

    Args:
        summariser: The client embedding function ``h_phi`` (PMA with ``s`` seeds by default).
        generator: The predictive generator's architecture (trained, then frozen).
        generator_training: Recipe for training the generator when no checkpoint is given.
        generator_checkpoint: A file with a trained generator's state dict (skips training).
        l2: ERM penalty lambda in ``mean CE + lambda/2 ||W||^2``.
        num_generated: ``n'``, predictive points drawn per posterior sample.
        train_samples: Posterior samples per task in the meta-training loss.
        test_samples: Posterior samples ``S`` in evaluation (ensemble size).
        lr: Adam learning rate for ``phi``.
        weight_decay: Adam weight decay.
        erm_tol: Stopping tolerance of every ERM solve (max absolute gradient).
        codec: How a client encodes its upload (``FP32`` or ``Quantize``).
        methods: Methods evaluated by ``test`` besides FMP (centralised MP and ANN, one-shot CANN by default).
        cache_dir: Where trained generators are cached (default ``$LIGHTNING_FL_CACHE``).
        warmup_steps: Meta-training steps that first pull each client's summary towards the k-means centres of
            its points (Chamfer distance, label parts weighted by ``sqrt(D)``;
            :func:`~lightning_fl.oneshot.summarize.kmeans_centres`) before the theta distance takes over: a start
            for a read-out that begins as noise (``readout: linear``).
        warmup_label_weight: The warm-up's weight on each summary point's label parts (its features weigh 1);
            ``None``: ``sqrt(D)``, so that a label counts as much as the ``D`` standardised features; ``1.0``:
            unweighted, the ablation in which the linear read-out's labels stay uniform.
    """

    def __init__(
        self,
        summariser: Summariser | None = None,
        generator: Predictive | None = None,
        generator_training: GeneratorTraining | None = None,
        generator_checkpoint: str | None = None,
        l2: float = 1e-2,
        num_generated: int = 200,
        train_samples: int = 2,
        test_samples: int = 10,
        lr: float = 1e-3,
        weight_decay: float = 0.0,
        erm_tol: float = 1e-5,
        codec: Codec | None = None,
        methods: list[OneShotMethod] | None = None,
        cache_dir: str | None = None,
        warmup_steps: int = 0,
        warmup_label_weight: float | None = None,
    ) -> None:
        super().__init__()
        problems = [f"warmup_steps must be >= 0, got {warmup_steps}"] if warmup_steps < 0 else []
        if warmup_label_weight is not None and not warmup_label_weight > 0:
            problems.append(f"warmup_label_weight must be > 0 or null (sqrt(D)), got {warmup_label_weight}")
        problems += [
            f"{k} must be > 0, got {v}" for k, v in [("l2", l2), ("lr", lr), ("erm_tol", erm_tol)] if not v > 0
        ]
        problems += [
            f"{k} must be >= 1, got {v}"
            for k, v in [
                ("num_generated", num_generated),
                ("train_samples", train_samples),
                ("test_samples", test_samples),
            ]
            if v < 1
        ]
        if problems:
            raise ConfigError("model (FMPMetaLearner): " + "; ".join(problems))
        self.summariser = summariser if summariser is not None else PMASummariser()
        self.generator = generator if generator is not None else PredictiveGenerator()
        self.generator.requires_grad_(False)
        self.generator_training = generator_training if generator_training is not None else GeneratorTraining()
        self.generator_checkpoint = generator_checkpoint
        self.l2, self.num_generated = l2, num_generated
        self.train_samples, self.test_samples = train_samples, test_samples
        self.lr, self.weight_decay, self.erm_tol = lr, weight_decay, erm_tol
        self.codec = codec if codec is not None else FP32()
        self.methods = list(methods) if methods is not None else [MP(), ANN(), CANN()]
        self.cache_dir = cache_dir
        self.warmup_steps, self.warmup_label_weight = warmup_steps, warmup_label_weight
        self.register_buffer("generator_ready", torch.zeros((), dtype=torch.bool))
        self.generator_report: dict = {}
        self._configured = False
        # Objects stay out of hparams (checkpoints must load with weights_only=True); the recipe goes in as a dict.
        self.save_hyperparameters(ignore=["summariser", "generator", "generator_training", "codec", "methods"])
        self.hparams["generator_training"] = asdict(self.generator_training)

    # ------------------------------------------------------------------ set-up
    def setup(self, stage: str) -> None:
        if self._configured:
            return
        dm = self.trainer.datamodule
        D, C = dm.feature_dim, dm.num_classes
        self.summariser.configure(D, C)
        self.generator.configure(D, C)
        self.generator.requires_grad_(False)
        # Validation baselines at the same s: the untrained summariser, random selection and mean pooling
        # (kept in a plain dict, out of the state dict).
        s = self.summariser.num_points
        self._val_baselines = {
            "untrained": copy.deepcopy(self.summariser),
            "random": RandomSelection(s),
            "mean": MeanPooling(s),
        }
        for baseline in self._val_baselines.values():
            if not baseline.feature_dim:
                baseline.configure(D, C)
        self._configured = True

    def on_fit_start(self) -> None:
        self._shorten_to(self.trainer)
        self.prepare_generator()

    def _shorten_to(self, trainer: L.Trainer) -> None:
        """Fit a shortened run (``--trainer.max_steps`` below the config's): with ``val_check_interval`` beyond
        ``max_steps`` it would never validate, so it validates at its last step (said in a line), and a line names a
        k-means warm-up that covers every step (the generator's line names its own steps)."""
        steps = trainer.max_steps
        if steps is None or steps < 1:
            return
        interval = trainer.val_check_interval
        lines = []
        if isinstance(interval, int) and not isinstance(interval, bool) and interval > steps:
            trainer.val_check_interval = steps
            lines.append(
                f"trainer.val_check_interval {interval} is beyond trainer.max_steps {steps}: validating at "
                f"step {steps}, the last"
            )
        if self.warmup_steps >= steps:
            lines.append(
                f"model.warmup_steps {self.warmup_steps} covers all {steps} steps, so the summariser trains "
                f"only on the k-means warm-up: add --model.warmup_steps {steps // 2} to leave it half"
            )
        for line in lines:
            log.warning("%s", line)

    def on_validation_start(self) -> None:
        self.prepare_generator()

    def on_test_start(self) -> None:
        self.prepare_generator()

    def generator_cache_key(self) -> dict:
        dm = self.trainer.datamodule
        init = copy.deepcopy(self.generator)
        with torch.random.fork_rng():  # the same draw _train_generator starts from, without touching the run's RNG
            torch.manual_seed(self.generator_training.seed)
            init.configure(dm.feature_dim, dm.num_classes)
        return {
            "format": "lightning_fl.oneshot.generator/2",
            "generator": repr(self.generator),
            "init": digest_tensors(init.state_dict()),
            "features": digest_tensors({"h": dm.meta_pool.h, "y": dm.meta_pool.y.float()}),
            # the held-out report is scored on target tasks: their classes are part of what the file holds
            "tasks": [dm.num_clients, dm.points_per_client, dm.meta_alphas, dm.min_classes, dm.heldout_points, dm.seed]
            + ([dm.target_classes] if dm.target_classes is not None else []),
            "recipe": self.generator_training.key(),
            "l2": self.l2,
            "num_generated": self.num_generated,
            "environment": compute_environment(self.device),  # another thread count trains another generator
        }

    def prepare_generator(self) -> None:
        """Load, restore from cache, or train the generator; it stays frozen afterwards."""
        if bool(self.generator_ready):
            return
        if not self.generator.trainable:  # e.g. the Polya urn: nothing to train, only its held-out scores to log
            if self.generator_checkpoint is not None:
                raise ConfigError(
                    f"model.generator_checkpoint is set but model.generator ({type(self.generator).__name__}) has "
                    "nothing to load; remove the key or choose PredictiveGenerator"
                )
            log.info(
                "%s has nothing to train: model.generator_training is used only for its eval_tasks",
                type(self.generator).__name__,
            )
            self.generator_report = {"heldout": self._score_generator()}
        elif self.generator_checkpoint is not None:
            # A path the user gave: any problem is an error, never replaced by training.
            path = Path(self.generator_checkpoint).expanduser()
            fix = "pass a generator file written by this package (generators/<digest>/generator.pt) or remove the key"
            self.generator_report = self._load_generator(path, "model.generator_checkpoint", fix)
        else:
            key = self.generator_cache_key()
            path = cache_file("generators", key, "generator.pt", self.cache_dir)
            if path.is_dir():
                raise CheckpointError(f"FMP generator cache {path} is a folder, not a file; delete it")
            loaded = False
            if path.exists():
                # A derived file: an unusable one is a cache miss (warned about), retrained and overwritten.
                miss = "treated as a cache miss: the generator is retrained and the file overwritten"
                try:
                    self.generator_report = self._load_generator(path, "FMP generator cache", miss)
                    loaded = True
                    log.info("generator loaded from the cache %s", path)
                except CheckpointError as err:
                    log.warning("%s", err)
            if not loaded:
                self._train_generator(path, key)
        self.generator.to(self.device).eval().requires_grad_(False)
        self.generator_ready.fill_(True)
        for name, value in self.generator_report.get("heldout", {}).items():
            self._log_once(f"generator/{name}", value)

    def _load_generator(self, path: Path, what: str, fix: str) -> dict:
        """Load the generator from ``path`` (read safely; every weight must fit); return the file's report."""
        state = read_checkpoint(path, what, fix=fix)
        name = checkpoint_name(what, path)
        weights = tensor_state(state, name, keys=("generator",), fix=fix)
        if problem := state_mismatch(weights, self.generator.state_dict()):
            raise CheckpointError(f"{name} does not fit the generator: {problem}; {fix}")
        report = state.get("report", {}) if isinstance(state, dict) else {}
        heldout = report.get("heldout", {}) if isinstance(report, dict) else None
        if not isinstance(heldout, dict) or not all(isinstance(v, (int, float)) for v in heldout.values()):
            raise CheckpointError(f"{name} holds a malformed 'report' (not {{'heldout': {{name: number}}}}); {fix}")
        self.generator.load_state_dict(weights)
        return report

    def _train_generator(self, path: Path, key: dict) -> None:
        dm = self.trainer.datamodule
        recipe = self.generator_training
        steps, shorten = self.trainer.max_steps, ""
        if steps is not None and 0 < steps < recipe.steps:  # a shortened run: the generator's steps are its own
            shorten = f"; more than trainer.max_steps {steps}: add --model.generator_training.steps {steps} too"
        log.warning("Training the predictive generator for %d steps (cached as %s)%s", recipe.steps, path, shorten)
        with torch.random.fork_rng():
            torch.manual_seed(recipe.seed)
            self.generator.configure(dm.feature_dim, dm.num_classes)  # the initial weights named in the key
            self.generator.requires_grad_(True)
            samplers = dm.meta_samplers(heldout=True)
            history = train_generator(self.generator, samplers, recipe, self.l2, self.num_generated, 10**7)
            self.generator.requires_grad_(False)
            heldout = self._score_generator()
        self.generator_report = {"heldout": heldout, "final_loss": history[-1] if history else None}
        log.warning("Predictive generator trained: held-out scores %s", {k: round(v, 4) for k, v in heldout.items()})
        atomic_save({"generator": self.generator.state_dict(), "key": key, "report": self.generator_report}, path)

    def _score_generator(self) -> dict[str, float]:
        """Held-out scores of the predictive on target-pool tasks (data it never saw in training)."""
        dm = self.trainer.datamodule
        return evaluate_generator(
            self.generator,
            dm.target_sampler(heldout=True),
            self.generator_training.eval_tasks,
            self.l2,
            self.num_generated,
            num_samples=self.test_samples,
        )

    def _log_once(self, name: str, value: float) -> None:
        for logger in self.loggers:
            logger.log_metrics({name: value}, step=0)

    def configure_optimizers(self):
        params = [p for p in self.summariser.parameters() if p.requires_grad]
        if not params:
            raise ConfigError(
                f"model.summariser ({type(self.summariser).__name__}) has nothing to meta-train; "
                "use PMASummariser for fit, or run test directly"
            )
        return torch.optim.Adam(params, lr=self.lr, weight_decay=self.weight_decay)

    # ------------------------------------------------------------------ sampling
    def _sample(self, z: Tensor, noise: Tensor) -> Tensor:
        """MP on sets ``z`` ``[B, N, P]`` with base sets ``noise`` ``[B, S, n', e]`` -> ``W`` ``[B, S, C, D]``."""
        return refit(z, self.generator(z, noise), self.generator.num_classes, self.l2, self.erm_tol)

    def theta_distance(
        self,
        clients: Tensor,
        summariser: Summariser,
        noise: Tensor,
        target: Tensor | None = None,
        generator: torch.Generator | None = None,
    ) -> Tensor:
        """``||theta_MP - theta_FMP||`` per task and sample: ``clients`` ``[B, M, n, P]`` -> ``[B, S]``."""
        B, M, n, P = clients.shape
        if target is None:
            with torch.no_grad():
                target = self._sample(clients.reshape(B, M * n, P), noise)
        summary = summariser(clients.reshape(B * M, n, P), generator=generator)
        W = self._sample(summary.reshape(B, -1, P), noise)
        return (W - target).flatten(2).norm(dim=-1)

    def on_train_start(self) -> None:
        self._started = time.perf_counter()

    def on_train_batch_end(self, outputs, batch, batch_idx: int) -> None:
        """Without a progress bar, a line every tenth of the meta-training (and at its last step): the step, the
        phase, the loss and the time so far."""
        trainer = self.trainer
        total = trainer.max_steps if trainer.max_steps and trainer.max_steps > 0 else trainer.estimated_stepping_batches
        if trainer.progress_bar_callback is not None or not math.isfinite(total) or not trainer.is_global_zero:
            return
        step, total = self.global_step, int(total)
        if step % max(1, total // 10) and step != total:
            return
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        phase = "k-means warm-up" if step <= self.warmup_steps else "theta distance"
        elapsed = time.perf_counter() - getattr(self, "_started", time.perf_counter())
        log.info("meta-training step %d/%d (%s): loss %.4f, %.0f s", step, total, phase, float(loss), elapsed)

    def training_step(self, batch: Tensor, batch_idx: int) -> Tensor:
        B = batch.shape[0]
        if self.global_step < self.warmup_steps:
            B, M, n, P = batch.shape
            clients = batch.reshape(B * M, n, P)
            g = torch.Generator().manual_seed(int(self.global_step))
            centres = kmeans_centres(clients, self.summariser.num_points, generator=g)
            # label parts weighted by sqrt(D) by default: a label (a unit vector at most) then counts as much as the
            # D standardised features; unweighted, a read-out that keeps its labels uniform loses almost nothing
            label_weight = self.warmup_label_weight
            weight = torch.ones(P, device=batch.device)
            weight[-self.generator.num_classes :] = (
                self.generator.feature_dim**0.5 if label_weight is None else label_weight
            )
            loss = chamfer(self.summariser(clients) * weight, centres * weight)
            self.log("train/warmup_chamfer", loss, prog_bar=True, batch_size=B)
            return loss
        noise = self.generator.noise(B, self.train_samples, self.num_generated, device=batch.device)
        dist = self.theta_distance(batch, self.summariser, noise)
        loss = dist.mean()
        if not torch.isfinite(loss):
            raise FloatingPointError(f"meta-training loss is {loss.item()} at step {self.global_step}; lower model.lr")
        self.log("train/theta_dist", loss, prog_bar=True, batch_size=B)
        return loss

    # ------------------------------------------------------------------ validation
    def validation_step(self, task: Task, batch_idx: int) -> None:
        g = torch.Generator().manual_seed(batch_idx)
        noise = self.generator.noise(1, self.test_samples, self.num_generated, generator=g).to(self.device)
        clients = task.clients.unsqueeze(0).to(self.device)
        B, M, n, P = clients.shape
        with torch.no_grad():
            target = self._sample(clients.reshape(B, M * n, P), noise)
            candidates = {"theta_dist": self.summariser}
            candidates.update({f"theta_dist_{k}": v for k, v in self._val_baselines.items()})
            for name, summariser in candidates.items():
                dist = self.theta_distance(clients, summariser.to(self.device), noise, target, generator=g)
                self.log(f"val/{name}", dist.mean(), batch_size=1, prog_bar=name == "theta_dist")

    # ------------------------------------------------------------------ test
    def test_step(self, task: Task, batch_idx: int) -> None:
        # Lightning tests under inference_mode; some methods optimise (BPC's pseudo-points), so leave it and
        # work on ordinary copies of the inputs. Methods run under no_grad and enable gradients themselves.
        with torch.inference_mode(False):
            task = Task(task.clients.clone(), task.labels.clone(), task.num_classes)
            self._test_methods(task, batch_idx)

    def _test_methods(self, task: Task, batch_idx: int) -> None:
        dm = self.trainer.datamodule
        g = torch.Generator().manual_seed(batch_idx)
        noise = self.generator.noise(self.test_samples, self.num_generated, generator=g)
        ctx = Context(self.generator, self.summariser, self.l2, noise.to(self.device), self.codec, self.erm_tol)
        task = Task(task.clients.to(self.device), task.labels, task.num_classes)
        test_h, test_y = dm.test_features.h.to(self.device).clone(), dm.test_features.y.to(self.device).clone()
        # Test points of the classes the target tasks hold; those of the other classes are out of distribution.
        known = torch.isin(test_y, torch.tensor(dm.in_distribution, device=test_y.device))
        ood_h, test_h, test_y = test_h[~known], test_h[known], test_y[known]
        outcomes: dict[str, Outcome] = {}
        with torch.no_grad():
            for method in [FMP(), *self.methods]:
                out = method.run(task, ctx)
                outcomes[method.name] = out
                # Every method logs test/<name>/<metric>; FMP's are also the headline test/<metric>.
                prefixes = [f"test/{method.name}/"] + (["test/"] if method.name == "fmp" else [])
                for key, value in self._score(out.W, test_h, test_y, ood_h).items():
                    for prefix in prefixes:
                        self.log(prefix + key, value, batch_size=1)
                for key, value in out.extras.items():  # scalar diagnostics, e.g. a Laplace prior precision
                    if value.ndim == 0:
                        self.log(f"test/{method.name}/{key}", value.float(), batch_size=1)
                if out.bytes_per_client is not None:
                    for kb in [f"comm/{method.name}/kb_per_client"] + (
                        ["comm/kb_per_client"] if method.name == "fmp" else []
                    ):
                        self.log(kb, out.bytes_per_client / 1000.0, batch_size=1)
            if "mp" in outcomes:
                mp, fmp = outcomes["mp"], outcomes["fmp"]
                self.log("test/theta_dist", (mp.W - fmp.W).flatten(2).norm(dim=-1).mean(), batch_size=1)
                for method in self.methods:  # FMP variants (other summaries, hard labels): same base set as MP
                    if isinstance(method, FMP) and method.name != "fmp":
                        W = outcomes[method.name].W
                        self.log(
                            f"test/{method.name}/theta_dist", (mp.W - W).flatten(2).norm(dim=-1).mean(), batch_size=1
                        )
                self._log_proposition1(task, mp, fmp)

    def _log_proposition1(self, task: Task, mp: Outcome, fmp: Outcome) -> None:
        """Proposition 1 on this task, term by term (:mod:`.bound`; the first posterior sample's ``Z'``)."""
        pooled, summary = task.pooled.float().cpu(), fmp.extras["summary"].float().cpu()
        generated, generated_fmp = mp.extras["generated"][0].float().cpu(), fmp.extras["generated"][0].float().cpu()
        delta_s, D = wasserstein1(pooled, summary), wasserstein1(pooled, generated)
        C = wasserstein1(generated, generated_fmp) / delta_s if delta_s > 0 else 0.0
        points = torch.cat([pooled, summary, generated, generated_fmp])
        L_z = lipschitz_z(torch.cat([mp.W[0], fmp.W[0]]).cpu(), points, task.num_classes)
        M, n, _ = task.clients.shape
        terms = proposition1(M, n, len(summary) // M, len(generated), self.l2, L_z, C, delta_s, D)
        self.log("test/delta_s", delta_s, batch_size=1)
        self.log("test/D", D, batch_size=1)
        self.log("test/prop1_bound", terms["bound"], batch_size=1)
        for key in ("b_s", "Delta_s", "L_z", "C"):
            self.log(f"test/prop1/{key}", terms[key], batch_size=1)

    def _score(self, W: Tensor, h: Tensor, y: Tensor, ood_h: Tensor) -> dict[str, Tensor]:
        """Accuracy, ECE, NLL and mean entropy of the posterior predictive on ``h``, its mean entropy on the
        out-of-distribution points ``ood_h`` and the AUROC of telling them apart (if there are any), averaged over
        the G models of ``W [G, S, C, D]``; and the spread of the parameter samples (:mod:`.quality`)."""
        totals: dict[str, Tensor] = {"theta_spread": theta_spread(W.float())}
        for Wg in W:
            probs = predict_proba(Wg, h)
            metrics = classification_metrics(probs.shape[-1], "").to(h.device)
            scores = dict(metrics(probs, y))
            scores["nll"] = -probs.clamp_min(1e-12).log().gather(1, y.unsqueeze(1)).mean()
            if len(ood_h):
                scores.update(ood_scores(probs, predict_proba(Wg, ood_h)))
            else:
                scores["entropy"] = predictive_entropy(probs).mean()
            for k, v in scores.items():
                totals[k] = totals.get(k, 0.0) + v.float() / W.shape[0]
        return totals
