"""Training the predictive generator on the meta-training corpus, and checking it against naive resampling.

The generator is trained once per (features, architecture, recipe) and cached; FMP's meta-training
then keeps it frozen. The objective is :func:`lightning_fl.oneshot.predictive.generator_loss`.
:func:`evaluate_generator` scores held-out points of fresh tasks under three posterior predictives,
all refit by the same ERM: the data alone (``erm``), ``Z`` plus a bootstrap resample of ``Z``
(``bootstrap``, naive predictive resampling) and ``Z`` plus generated points (``generator``).
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import asdict, dataclass

import torch

from lightning_fl.oneshot.predictive import (
    Predictive,
    PredictiveGenerator,
    bootstrap,
    generator_loss,
    log_predictive,
    refit,
)
from lightning_fl.oneshot.tasks import TaskSampler

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GeneratorTraining:
    """How the generator is trained when no ``generator_checkpoint`` is given.

    Args:
        steps: Adam steps.
        lr: Adam learning rate (cosine-decayed to 0).
        tasks_per_step: Tasks per step.
        num_samples: Posterior samples S per task in the objective.
        beta: Weight of the energy-distance term.
        gamma: Weight of the pseudo-data term (held-out NLL of the model refit on generated points alone).
        delta: Weight of the spread-matching term: the squared log ratio of the refits' spread to the spread
            of refits on the Polya urn's draws (the Bayesian bootstrap); 0 leaves it out. Needs
            ``num_samples >= 2``.
        min_context: Smallest context size; each step draws a size in ``[min_context, M * n]`` so the
            generator sees both pooled data and pooled summaries.
        eval_tasks: Held-out tasks used to compare against naive resampling after training.
        seed: Seed of the generator's initial weights and of its training tasks.
    """

    steps: int = 300
    lr: float = 1e-3
    tasks_per_step: int = 4
    num_samples: int = 4
    beta: float = 0.1
    gamma: float = 0.0
    delta: float = 0.0
    min_context: int = 50
    eval_tasks: int = 8
    seed: int = 0

    def __post_init__(self) -> None:
        if not (self.delta >= 0 and math.isfinite(self.delta)):
            raise ValueError(f"model.generator_training.delta must be >= 0 (finite), got {self.delta!r}")
        if self.delta > 0 and self.num_samples < 2:
            raise ValueError(
                "model.generator_training.delta > 0 compares the spread of several refits: "
                f"set model.generator_training.num_samples >= 2 (got {self.num_samples})"
            )

    def key(self) -> dict:
        key = asdict(self)
        if not self.delta:  # added later: generators trained without the term keep their cache entries
            del key["delta"]
        return key


def _context(task_clients: torch.Tensor, size: int, g: torch.Generator) -> torch.Tensor:
    pooled = task_clients.reshape(-1, task_clients.shape[-1])
    return pooled[torch.randperm(len(pooled), generator=g)[:size]]


def train_generator(
    generator: PredictiveGenerator,
    samplers: list[TaskSampler],
    recipe: GeneratorTraining,
    l2: float,
    num_generated: int,
    task_seed_offset: int = 0,
) -> list[dict]:
    """Fit ``generator`` in place on tasks from ``samplers`` in turn (each must hold out points); returns history."""
    if any(s.heldout_points < 1 for s in samplers):
        raise ValueError("train_generator needs TaskSamplers with heldout_points >= 1")
    g = torch.Generator().manual_seed(recipe.seed)
    opt = torch.optim.Adam(generator.parameters(), lr=recipe.lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, max(recipe.steps, 1))
    full = samplers[0].num_clients * samplers[0].points_per_client
    history, start = [], time.perf_counter()
    generator.train()
    for step in range(recipe.steps):
        size = int(torch.randint(min(recipe.min_context, full), full + 1, (1,), generator=g))
        sampler = samplers[step % len(samplers)]  # the meta partitions in turn
        tasks = [
            sampler.sample(task_seed_offset + step * recipe.tasks_per_step + i) for i in range(recipe.tasks_per_step)
        ]
        context = torch.stack([_context(t.clients, size, g) for t in tasks])  # (B, size, P)
        heldout = torch.stack([t.heldout for t in tasks])  # (B, T, P)
        loss, terms = generator_loss(
            generator, context, heldout, num_generated, recipe.num_samples, l2, recipe.beta, recipe.gamma, recipe.delta
        )
        if not torch.isfinite(loss):
            raise FloatingPointError(
                f"generator training diverged at step {step} ({terms}); lower model.generator_training.lr"
            )
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(generator.parameters(), 1.0)
        opt.step()
        sched.step()
        history.append({"step": step, "loss": float(loss.detach()), **terms})
        if step % 50 == 0 or step == recipe.steps - 1:
            shown = ", ".join(f"{k} {v:.4f}" for k, v in terms.items())
            elapsed = time.perf_counter() - start
            log.info(
                "generator step %d/%d: loss %.4f (%s), %.0f s",
                step + 1,
                recipe.steps,
                float(loss.detach()),
                shown,
                elapsed,
            )
    generator.eval()
    return history


@torch.no_grad()
def evaluate_generator(
    generator: Predictive,
    sampler: TaskSampler,
    num_tasks: int,
    l2: float,
    num_generated: int,
    num_samples: int = 8,
    task_seed_offset: int = 10**9,
) -> dict[str, float]:
    """Held-out NLL and accuracy of the posterior predictive refit on Z alone, Z + bootstrap, Z + generated."""
    g = torch.Generator().manual_seed(task_seed_offset)
    scores: dict[str, list[float]] = {}
    for i in range(num_tasks):
        task = sampler.sample(task_seed_offset + i)
        z, heldout = task.pooled.unsqueeze(0), task.heldout.unsqueeze(0)
        C = task.num_classes
        generated = generator(z, generator.noise(1, num_samples, num_generated, generator=g))
        labels = generated[..., -C:].clamp_min(1e-12)
        scores.setdefault("generated_label_entropy", []).append(float(-(labels * labels.log()).sum(-1).mean()))
        candidates = {
            "erm": refit(z, None, C, l2),
            "bootstrap": refit(z, bootstrap(z, num_samples, num_generated, g), C, l2),
            "generator": refit(z, generated, C, l2),
        }
        for name, W in candidates.items():
            scores.setdefault(f"{name}_nll", []).append(float(-log_predictive(W, heldout, C).mean()))
            x, t = heldout[0, :, :-C], heldout[0, :, -C:]
            probs = torch.einsum("scd,nd->snc", W[0], x).softmax(-1).mean(0)
            scores.setdefault(f"{name}_acc", []).append(float((probs.argmax(-1) == t.argmax(-1)).float().mean()))
    return {k: sum(v) / len(v) for k, v in scores.items()}
