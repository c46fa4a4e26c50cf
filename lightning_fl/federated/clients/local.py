"""What every client runner shares: a client's local-training settings and result, its seeded loader, its
optimiser, its clipping norm and the encoding of what it uploads.

:func:`~lightning_fl.federated.clients.client.run_client` (one client at a time),
:func:`~lightning_fl.federated.clients.cohort.run_cohort` (a vectorised cohort) and
:func:`~lightning_fl.federated.clients.dp_cohort.run_cohort_dp_sgd` (a cohort under DP-SGD) stand on this module and
import nothing from each other's files; it imports none of them.
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass, field
from typing import Any

import lightning as L
import torch

from lightning_fl.compress.base import Codec, Payload, non_finite
from lightning_fl.errors import ConfigError
from lightning_fl.federated.server.state import State
from lightning_fl.seeding import STREAM_CLIENT, STREAM_LOADER, derive_seed, seed_everything_quietly


@dataclass(frozen=True)
class LocalTraining:
    """How a client trains in one round.

    Args:
        epochs: Local epochs E (ignored when ``steps`` is set).
        steps: Local optimiser steps instead of epochs (cycling the client's data).
        gradient_clip_val: Clip gradient norms; ``None`` uses the module's ``recipe.grad_clip``, if any.
        upload_stage: What the client does to its trained state before encoding it (local DP: clip its update and
            add noise, :class:`~lightning_fl.privacy.LocalDP`); ``None``: nothing.
        dp_sgd: Record-level DP-SGD on the client's local steps (:class:`~lightning_fl.privacy.DPSGD`); ``None``:
            plain local training.
        secure: Secure aggregation (:class:`~lightning_fl.privacy.secure.SecureAggregation`): the client uploads
            its quantised update for the round's modular sum instead of the codec's payload; ``None``: the codec's.
    """

    epochs: int = 1
    steps: int | None = None
    gradient_clip_val: float | None = None
    upload_stage: Any = None
    dp_sgd: Any = None
    secure: Any = None

    @property
    def withholds_metadata(self) -> bool:
        """Whether the client sends its noised upload alone: under a mechanism that does not trust the server
        (local DP, distributed DP's noise shares, DP-SGD) nothing data-dependent leaves the client un-noised, so
        neither its sample count nor what its ``training_step`` logged does (the server weighs uploads alike)."""
        return self.upload_stage is not None or self.dp_sgd is not None


@dataclass(frozen=True)
class ClientJob:
    """A round's work as its clients receive it, one value: what each trains from and with. The same job runs a client
    alone (:func:`~lightning_fl.federated.clients.client.run_client`), a cohort at once, or on another machine.

    Args:
        module: A :class:`~lightning_fl.federated.FederatedModule` LightningModule, on ``fabric``'s device.
        datamodule: Offers ``client_dataloader(client, seed=...)`` and ``client_num_samples(client)``.
        state: The global state the server broadcast (also the codec's reference).
        round: The round (0-based).
        seed: The run's seed; every random stream derives from ``(seed, round, client)``.
        codec: Encodes the trained federated state into the payload (stateful codecs keep per-client memory).
        local: Local epochs or steps, gradient clipping and the client-side mechanisms.
        fabric: Device placement, precision and backward; ``None``: one CPU process.
    """

    module: L.LightningModule
    datamodule: Any
    state: State
    round: int
    seed: int
    codec: Codec
    local: LocalTraining = field(default_factory=LocalTraining)
    fabric: L.Fabric | None = None


@dataclass
class ClientResult:
    """What one client produced in one round.

    ``payload`` is ``None`` when local training failed (``failure`` says why): nothing is uploaded then.
    ``logged`` holds what the module logged in ``training_step`` (``self.log``): per key, the sum of the
    values weighted by batch size and the total weight, so means over clients weight every sample alike.
    Under a client stage that noises the upload a failed client uploads a noised zero update instead
    (:func:`encode_upload`); ``withheld`` then says why, and stays on the client.
    """

    client: int
    num_samples: int
    payload: Payload | None
    logged: dict[str, tuple[float, float]] = field(default_factory=dict)
    failure: str | None = None
    withheld: str | None = None

    @property
    def up_bytes(self) -> int:
        return self.payload.nbytes if self.payload is not None else 0

    def released(self, local: LocalTraining) -> tuple[int, dict[str, tuple[float, float]], str | None]:
        """What of the result may leave the client besides its payload: its sample count, logged values and
        failure; under ``local.withholds_metadata`` none of them (0, nothing, only that training failed)."""
        if not local.withholds_metadata:
            return self.num_samples, self.logged, self.failure
        return 0, {}, None if self.failure is None else "local training failed (details withheld under local privacy)"


def warn_withheld(result: ClientResult, round: int) -> None:
    """On the client's own side (a Flower node's log), why it uploaded a noised zero update instead of its own
    (``result.withheld``): its reply says nothing of it."""
    if result.withheld is not None:
        why = f"round {round + 1}: local training failed ({result.withheld}); a noised zero update was uploaded"
        warnings.warn(why, stacklevel=2)


@functools.cache
def _cpu_fabric() -> L.Fabric:
    return L.Fabric(accelerator="cpu", devices=1, loggers=[])


def configure_optimizer(module: L.LightningModule) -> tuple[torch.optim.Optimizer, Any]:
    """The module's one optimiser and its per-step scheduler (``None`` if it has none).

    ``configure_optimizers`` is called afresh for every client in every round, so a step-interval scheduler
    runs its clock over that client's local steps in that round. An epoch-interval scheduler has no clock
    here and is refused, never ignored.
    """
    conf = module.configure_optimizers()
    scheduler = None
    if isinstance(conf, dict):
        sched = conf.get("lr_scheduler")
        if sched is not None and not (isinstance(sched, dict) and sched.get("interval", "epoch") == "step"):
            raise ConfigError(
                f"{type(module).__name__}.configure_optimizers returns a learning-rate scheduler stepped per "
                "epoch, which federated clients cannot follow (each trains one round of local steps); return "
                "{'scheduler': ..., 'interval': 'step'} to step it per local step, or no scheduler"
            )
        if sched is not None:
            scheduler = sched["scheduler"]
        conf = conf["optimizer"]
    if isinstance(conf, (list, tuple)):
        if len(conf) != 1:
            raise ConfigError("federated clients support modules with exactly one optimiser")
        conf = conf[0]
    return conf, scheduler


def client_loader(datamodule: Any, client: int, round: int, seed: int):
    """Seed the global generator for ``client`` in ``round`` and return its loader: every draw of its local
    training (shuffling, augmentation) derives from ``(seed, round, client)``."""
    seed_everything_quietly(derive_seed(seed, round, client, STREAM_CLIENT))
    return datamodule.client_dataloader(client, seed=derive_seed(seed, round, client, STREAM_LOADER) % 2**63)


def gradient_clip(module: L.LightningModule, local: LocalTraining) -> float | None:
    """The clipping norm: ``local.gradient_clip_val``, else the module's ``recipe.grad_clip`` (``None``: none)."""
    if local.gradient_clip_val is not None:
        return local.gradient_clip_val
    return getattr(getattr(module, "recipe", None), "grad_clip", None)


def encode_upload(
    result: ClientResult,
    state: State,
    global_state: State,
    codec: Codec,
    local: LocalTraining = LocalTraining(),
    round: int = 0,
    seed: int = 0,
) -> None:
    """Fill ``result.payload`` with the codec's encoding of the trained ``state`` (after ``local.upload_stage``,
    e.g. local DP's clipping and noise), or ``result.failure`` when training failed or the state holds non-finite
    values.

    Under an upload stage (local DP, distributed DP's noise share) a failure must not show: whether a client's
    training failed is a function of its data (one non-finite record), and a reply without an upload would release
    it un-noised. Such a client uploads its update as zero (``state`` replaced by ``global_state``) through the same
    clipping and noise, so its reply looks like any other and is accounted like any other; why stays on the client
    in ``result.withheld``. ``state`` is not read after a failure.
    """
    problem = result.failure
    if problem is None and (bad := non_finite(state)):
        problem = "; ".join(f"{n}: non-finite values" for n in bad)
    if problem is not None:
        if local.upload_stage is None:
            result.failure = problem
            return
        result.failure, result.withheld, state = None, problem, global_state
    if local.upload_stage is not None:
        state = local.upload_stage.privatize(state, global_state, result.client, round, seed)
    if local.secure is not None:
        result.payload = local.secure.encode(state, global_state, result.client, round, seed)
        return
    result.payload = codec.encode(state, global_state, result.client)
