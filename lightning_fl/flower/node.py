"""The node's app: a SuperNode trains its client with :func:`~lightning_fl.federated.clients.client.run_client`.

Flower runs it through the ClientApp :mod:`lightning_fl.flower.client`, in the process Flower starts for each
message or in the node's warm worker (:mod:`lightning_fl.flower.worker`). A node's ``--node-config`` says who it
is and where its data lives:

- ``partition-id`` (required): its client id in the federation (0..K-1); the simulation engine sets it.
- ``data-root`` (optional): a local folder for ``data.source.root`` (a silo's own data).
- ``data-partition`` (optional): which client of the *local* data module to train (default ``partition-id``);
  a silo that holds exactly its own data sets ``overrides="--data.num_clients 1"`` and ``data-partition=0``.
- ``overrides`` (optional): more dotted overrides applied on this node only (e.g. ``--data.batch_size 16``).
- ``worker`` (optional): the Unix socket of this node's warm worker (see :mod:`lightning_fl.flower.worker`).
- ``require-secure-aggregation``, ``require-privacy``, ``min-noise-multiplier``, ``max-cohort`` (optional): what
  no server message can switch off or shrink (:mod:`lightning_fl.flower.pins`). A DistributedDP noise share is
  drawn for the cohort the node checks (the nodes of its SecAgg+ round, ``max-cohort``), never for a federation
  size the server states.

The node builds the run from the YAML the server sends (so model, codec and local training match the
server's), plus the node's own data settings, refuses to train when its model fingerprint differs from the
server's, and replies with the payload encoded in our wire format. Nothing it receives is unpickled.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import io
import shlex
import threading
from dataclasses import dataclass
from typing import Any

import lightning as L
import numpy as np
import torch
from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.clientapp import ClientApp

from lightning_fl.checkpoint import read_checkpoint
from lightning_fl.errors import UserError
from lightning_fl.federated import FederatedTrainer
from lightning_fl.federated.clients.client import ClientJob, run_client, warn_withheld
from lightning_fl.federated.trainer.setup import prepare
from lightning_fl.flower import messages as wire_msg
from lightning_fl.flower.pins import noise_cohort, pin_problem


def _secure_aggregation_if_asked(message: Message, context: Context, call_next):
    """Flower's ``secaggplus_mod`` for the train messages of a SecAgg+ round (they carry its config record), our
    app for the rest. The node takes part only if its own run asks for secure aggregation with the same
    quantisation as the server's setup, and NumPy's global generator (which Flower's rounding draws from)
    comes out as it went in."""
    from flwr.client.mod import secaggplus_mod
    from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key, Stage

    if message.metadata.message_type != wire_msg.TRAIN or RECORD_KEY_CONFIGS not in message.content:
        return call_next(message, context)
    run_record = context.state.get(wire_msg.RUN) if wire_msg.RUN in context.state else None
    if run_record is None:
        raise RuntimeError("refused: the node was not introduced to this run")
    node = build_node(run_record["config"], dict(context.node_config))
    if node.local.secure is None:
        raise RuntimeError(
            "refused: the server asks for secure aggregation, which this run does not set (trainer.secure_aggregation)"
        )
    configs = message.content.config_records[RECORD_KEY_CONFIGS]
    if configs.get(Key.STAGE) == Stage.SETUP:
        from lightning_fl.flower.secure import check_setup

        if (refusal := check_setup(configs, node.local.secure)) is not None:
            raise RuntimeError(refusal)
    generator = np.random.get_state()
    try:
        return secaggplus_mod(message, context, call_next)
    finally:
        np.random.set_state(generator)


app = ClientApp(mods=[_secure_aggregation_if_asked])

_CODEC_STATE = "lightning_fl.codec"  # context.state key: this node's codec memory (error feedback), local only


@dataclass
class NodeRun:
    """What a node built from the server's config: module, data, codec, local training, Fabric."""

    model: L.LightningModule
    datamodule: Any
    codec: Any
    local: Any
    fabric: L.Fabric
    fingerprint: str | None
    data_partition: int | None
    trainer: FederatedTrainer | None = None  # the run's trainer as configured (its plan for a noise share)


_built: dict[str, NodeRun] = {}  # the runs this process built, least recently used first
KEEP_BUILT = 2  # runs kept (a warm worker serves run after run; one clientapp process builds one)
_lock = threading.Lock()


class LocalClient:
    """The node's data module seen as the federation's client ``client``: its ``data_partition`` trains."""

    def __init__(self, datamodule: Any, data_partition: int) -> None:
        self.datamodule, self.data_partition = datamodule, data_partition

    def client_dataloader(self, client: int, seed: int | None = None):
        return self.datamodule.client_dataloader(self.data_partition, seed=seed)

    def client_num_samples(self, client: int) -> int:
        return self.datamodule.client_num_samples(self.data_partition)

    @property
    def batch_size(self) -> Any:
        """The node's batch size (DP-SGD's expected Poisson batch)."""
        return getattr(self.datamodule, "batch_size", None)


def node_arguments(node_config: dict[str, Any]) -> tuple[list[str], int | None]:
    """CLI arguments a node adds to the server's config, and its local data partition (``None``: its client id)."""
    args: list[str] = []
    if (root := node_config.get("data-root")) not in (None, ""):
        args += ["--data.source.root", str(root)]
    if (more := node_config.get("overrides")) not in (None, ""):
        args += shlex.split(str(more))
    partition = node_config.get("data-partition")
    if partition is not None and (not isinstance(partition, int) or isinstance(partition, bool) or partition < 0):
        raise UserError(f"node config data-partition must be a non-negative integer, got {partition!r}")
    return args, partition


def build_node(config_yaml: str, node_config: dict[str, Any]) -> NodeRun:
    """Build (once per process) the run a node trains: the server's config plus the node's data settings."""
    from lightning_fl.cli import build

    extra, partition = node_arguments(node_config)
    key = hashlib.sha256("\0".join([config_yaml, *extra, str(partition)]).encode()).hexdigest()
    with _lock:
        if key in _built:
            _built[key] = _built.pop(key)  # most recently used last
            return _built[key]
        run = build(["fit", "--config", config_yaml, *extra])
        trainer = run.trainer
        args = trainer.fabric_args
        fabric = L.Fabric(accelerator=args["accelerator"], devices=1, precision=args["precision"], loggers=[])
        model, hooks = prepare(fabric, run.model, run.data, "fit")
        fingerprint = hooks.factor_fingerprint() if hooks.factor_fingerprint is not None else None
        node = NodeRun(model, run.data, trainer.codec, trainer.local, fabric, fingerprint, partition, trainer)
        _built[key] = node
        while len(_built) > KEEP_BUILT:
            del _built[next(iter(_built))]
        return node


@app.query()
def hello(message: Message, context: Context) -> Message:
    """The server introduces the run: keep its config; answer with this node's client id (or why it cannot)."""
    record = message.content.get(wire_msg.RUN) if wire_msg.RUN in message.content else None
    config_yaml = record.get("config") if record is not None else None
    partition = context.node_config.get("partition-id")
    refusal = ""
    if not isinstance(config_yaml, str):
        refusal = "the server's hello holds no config"
    elif not isinstance(partition, int) or isinstance(partition, bool):
        refusal = f"node config partition-id must be an integer, got {partition!r}"
    else:
        try:
            node = build_node(config_yaml, dict(context.node_config))
            refusal = f"refused: {why}" if (why := pin_problem(node.local, dict(context.node_config))) else ""
        except (UserError, ValueError, TypeError, OSError) as err:
            refusal = f"could not build the run on this node: {err}"
        if not refusal:  # (a refused hello leaves the run this node serves as it was)
            context.state[wire_msg.RUN] = ConfigRecord({"config": config_yaml})
    answer = {"partition-id": partition if isinstance(partition, int) else -1, "refusal": refusal}
    return Message(RecordDict({wire_msg.RUN: ConfigRecord(answer)}), reply_to=message)


@app.train()
def train(message: Message, context: Context) -> Message:
    """One round: load the global state, check the fingerprint, train, reply with the encoded payload."""
    from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS

    secure = RECORD_KEY_CONFIGS in message.content  # (stage 2 of SecAgg+: the mod masks what this returns)
    failure, payload, num_samples, logged, plan = None, None, 0, {}, None
    run_record = context.state.get(wire_msg.RUN) if wire_msg.RUN in context.state else None
    instructions = message.content.get(wire_msg.INSTRUCTIONS) if wire_msg.INSTRUCTIONS in message.content else None
    if run_record is None or instructions is None or wire_msg.STATE not in message.content:
        failure = "refused: the node was not introduced to this run, or the message lacks state or instructions"
    else:
        node = build_node(run_record["config"], dict(context.node_config))
        expected = instructions["fingerprint"] or None
        mine = context.node_config.get("partition-id")
        if instructions["client"] != mine:  # a node trains as its own client only, never on another's behalf
            failure = f"refused: asked to train client {instructions['client']!r}, but this node is client {mine!r}"
        elif node.fingerprint != expected:
            failure = (
                f"refused: model fingerprint {node.fingerprint} differs from the server's {expected} (projection "
                "factors or pretrained base differ); use the server's model.factor_seed, layers, latent_dim, rank "
                "and base on this node"
            )
        elif node.local.secure is not None and not secure:
            failure = "refused: this run uploads through secure aggregation only (trainer.secure_aggregation)"
        elif (failure := _plan_noise_share(node, instructions)) is not None:
            pass
        elif (why := pin_problem(node.local, dict(context.node_config))) is not None:
            failure = f"refused: {why}"
        else:
            local = _checked_share(node.local, dict(context.node_config), _secagg_cohort(message) if secure else None)
            client = int(instructions["client"])
            data = node.datamodule
            if node.data_partition is not None:
                data = LocalClient(node.datamodule, node.data_partition)
            received = wire_msg.record_to_state(message.content[wire_msg.STATE])
            state = {n: t.to(node.fabric.device) for n, t in received.items()}
            codec = copy.deepcopy(node.codec)  # this node's own codec memory only, even if nodes share a process
            _load_codec_state(codec, context)
            round_, seed = int(instructions["round"]), int(instructions["seed"])
            result = run_client(ClientJob(node.model, data, state, round_, seed, codec, local, node.fabric), client)
            _save_codec_state(codec, context)
            warn_withheld(result, int(instructions["round"]))  # (this node's own log: its reply shows nothing)
            payload = result.payload
            num_samples, logged, failure = result.released(node.local)  # (nothing data-dependent under local DP)
            if (dp := node.local.dp_sgd) is not None and client in dp.plans:
                plan = (dp.plans[client].records, dp.plans[client].batch_size)
                if (why := pin_problem(node.local, dict(context.node_config), dp.plans[client].z)) is not None:
                    failure, payload, num_samples, logged, plan = f"refused: {why}", None, 0, {}, None
    if secure:
        if failure is not None:  # raising drops this node from the round; SecAgg+ removes its masks
            raise RuntimeError(failure)
        from lightning_fl.flower.secure import upload_content

        values = node.local.secure.on_grid(payload.tensors["secure"].parts["q"]).numpy()
        records = wire_msg.reply_content(None, num_samples, None, logged, plan)
        return Message(upload_content(values, num_samples, records), reply_to=message)
    content = wire_msg.reply_content(payload, num_samples, failure, logged, plan)
    return Message(content, reply_to=message)


def _plan_noise_share(node: NodeRun, instructions: Any) -> str | None:
    """Set up a client stage whose noise share depends on the round's plan (DistributedDP: ``1 / m`` of the
    central variance, ``m`` the expected clients of a federation of the server's size); why not, if it cannot."""
    stage = node.local.upload_stage
    if stage is None or not stage.central:
        return None
    num_clients = instructions.get("num-clients")
    if not isinstance(num_clients, int) or isinstance(num_clients, bool) or num_clients < 1:
        return f"refused: {type(stage).__name__} needs the federation's size, and the message has {num_clients!r}"
    trainer = node.trainer
    with _lock:
        if getattr(stage, "plan", None) is None or stage.plan.num_clients != num_clients:
            count = min(trainer._clients_per_round(num_clients), num_clients)
            try:
                stage.setup(trainer._privacy_plan(num_clients, count, int(instructions["seed"])))
            except UserError as err:
                return f"refused: {err}"
    return None


def _secagg_cohort(message: Message) -> int:
    """The nodes this node sees in its SecAgg+ round, itself included: those whose key shares the server forwards
    to it with the masked-upload stage (``srcs``), the nodes of the key sharing it will be summed with. A node it
    exchanged no keys with cannot be among them (Flower's mod finds no shared key for it and masks nothing), so a
    server can shrink this count but not inflate it beyond the public keys it relayed at key sharing."""
    from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key

    sources = message.content.config_records[RECORD_KEY_CONFIGS].get(Key.SOURCE_LIST)
    others = set(sources) if isinstance(sources, list) else set()
    return len(others - {message.metadata.dst_node_id}) + 1


def _checked_share(local: Any, node_config: dict[str, Any], seen: int | None) -> Any:
    """``local`` with a DistributedDP share drawn for the cohort this node checked (:func:`noise_cohort`): never
    for more clients than it saw in SecAgg+ or pinned as ``max-cohort``, whatever the server's messages say."""
    cohort = noise_cohort(local, node_config, seen)
    if cohort is None:
        return local
    return dataclasses.replace(local, upload_stage=local.upload_stage.for_cohort(cohort))


def _load_codec_state(codec: Any, context: Context) -> None:
    """Restore this node's codec memory (error-feedback residuals); it never leaves the node."""
    record = context.state.get(_CODEC_STATE) if _CODEC_STATE in context.state else None
    if record is None:
        return
    what = f"this node's codec memory (context.state[{_CODEC_STATE!r}])"
    state = read_checkpoint(record["state"], what, fix="restart the node to start its codec memory afresh")
    codec.load_state_dict(state)


def _save_codec_state(codec: Any, context: Context) -> None:
    state = codec.state_dict()
    if not state:
        return
    buffer = io.BytesIO()
    torch.save(state, buffer)
    context.state[_CODEC_STATE] = ConfigRecord({"state": buffer.getvalue()})
