"""The client runner: one client's round, from the global state it receives to the payload it sends.

:func:`run_client` is a pure function of its inputs (module, data, global state, client id, round and the
run's seed): every random stream it uses derives from ``(seed, round, client)``. The federated loop calls it
for each sampled client on whichever process holds that client, and a remote client (e.g. a Flower
ClientApp) calls the same function with the state it received; it needs no loop, no server and no
checkpoint. What it returns is what would go on the wire (the codec's encoded payload) plus statistics.

It trains plainly (:func:`~lightning_fl.steps.train_steps`) or under record-level DP-SGD
(:func:`~lightning_fl.federated.clients.dp_client.train_dp_sgd`). What it shares with the vectorised cohorts
(:class:`LocalTraining`, :class:`ClientResult`, the seeded loader, the optimiser, the upload) is in
:mod:`lightning_fl.federated.clients.local`; the transport chooses between one client at a time and a cohort.
"""

from __future__ import annotations

from lightning_fl.context import StepContext, attached
from lightning_fl.errors import ConfigError, UserError
from lightning_fl.federated.clients.dp_client import choose_engine, train_dp_sgd
from lightning_fl.federated.clients.local import (
    ClientJob,
    ClientResult,
    LocalTraining,
    _cpu_fabric,
    client_loader,
    configure_optimizer,
    encode_upload,
    gradient_clip,
    warn_withheld,
)
from lightning_fl.steps import train_steps

# The shared pieces live in lightning_fl.federated.clients.local; importing them from here keeps working.
__all__ = [
    "ClientJob",
    "ClientResult",
    "LocalTraining",
    "client_loader",
    "configure_optimizer",
    "encode_upload",
    "gradient_clip",
    "run_client",
    "warn_withheld",
]


def run_client(job: ClientJob, client: int) -> ClientResult:
    """Train ``client`` for one round of ``job`` from its global state and encode what it uploads (``job.fabric``
    ``None``: one CPU process).

    Local training that diverges (``FloatingPointError`` or a non-finite state) is reported in ``failure``
    and uploads nothing, except under an upload stage (local DP, distributed DP), where the client uploads a noised
    zero update instead (:func:`~lightning_fl.federated.clients.local.encode_upload`); under DP-SGD a record's
    non-finite gradient is zeroed and training goes on. A configuration problem (e.g. a client without batches) raises.
    """
    module, datamodule, global_state, round, seed = job.module, job.datamodule, job.state, job.round, job.seed
    codec, local, fabric = job.codec, job.local, job.fabric
    fabric = fabric if fabric is not None else _cpu_fabric()
    loader = client_loader(datamodule, client, round, seed)
    module.load_federated_state(global_state)
    optimizer, scheduler = configure_optimizer(module)
    dp = local.dp_sgd
    if dp is None:
        optimizer = fabric.setup_optimizers(optimizer)
    else:  # DP-SGD steps the optimiser itself, through Opacus' DPOptimizer (either engine)
        engine, plan = choose_engine(module, dp), dp.client_plan(datamodule, client, local)
    clip = gradient_clip(module, local)
    result = ClientResult(client=client, num_samples=int(datamodule.client_num_samples(client)), payload=None)
    context = StepContext(fabric, client=client, round=round)
    if not all(m.training for m in module.modules()):  # train() sets a flag on every submodule: skip a no-op
        module.train()
    try:
        with attached(module, context):
            if dp is None:
                train_steps(
                    module,
                    optimizer,
                    scheduler,
                    loader,
                    fabric,
                    context,
                    epochs=local.epochs,
                    steps=local.steps,
                    clip=clip,
                    no_batches=f"client {client} has no training batches",
                )
            else:
                train_dp_sgd(
                    module,
                    optimizer,
                    scheduler,
                    loader,
                    fabric,
                    context,
                    plan,
                    dp,
                    dp.generators(seed, round, client, fabric.device),
                    engine,
                )
    except (UserError, FloatingPointError) as err:
        if isinstance(err, ConfigError):
            raise
        result.failure = f"local training failed: {err}"
    result.logged = context.step_values()
    encode_upload(result, module.federated_state(), global_state, codec, local, round, seed)
    return result
