"""What our Flower messages hold, and how each side reads them without trusting the other.

Server to client (``query``, once per node): the run's resolved YAML config, so every node builds the same
module, codec and local training as the server. Server to client (``train``, per round): the global state as
an ``ArrayRecord`` of float32 arrays and a ``ConfigRecord`` with the round, the run's seed, the client id and
the model fingerprint. Client to server: the codec's payload as one ``bytes`` value in our wire format
(:mod:`lightning_fl.compress.wire`), its sample count, an optional failure, and what ``training_step`` logged.

Every reader checks keys and types and returns a problem string instead of raising, so a malformed or
hostile reply becomes a rejected upload named by client and round, never a crashed server.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict

from lightning_fl.compress import wire
from lightning_fl.compress.base import Payload
from lightning_fl.federated.server.state import State

HELLO, TRAIN = "query", "train"  # Flower message types
STATE, INSTRUCTIONS, REPLY, LOGGED, RUN = "global", "instructions", "reply", "logged", "run"


def state_to_record(state: State) -> ArrayRecord:
    """The global state as float32 numpy arrays (exact: the state is float32)."""
    return ArrayRecord({name: Array(state[name].detach().cpu().contiguous().numpy()) for name in sorted(state)})


def record_to_state(record: ArrayRecord) -> State:
    return {name: torch.from_numpy(np.array(array.numpy(), copy=True)) for name, array in record.items()}


def hello_content(config_yaml: str) -> RecordDict:
    return RecordDict({RUN: ConfigRecord({"config": config_yaml})})


def train_content(
    arrays: ArrayRecord, round: int, seed: int, client: int, fingerprint: str | None, num_clients: int = 0
) -> RecordDict:
    instructions = {"round": round, "seed": seed, "client": client, "fingerprint": fingerprint or ""}
    if num_clients:  # the federation's size: a client stage that adds a share of the round's noise needs it
        instructions["num-clients"] = num_clients
    return RecordDict({STATE: arrays, INSTRUCTIONS: ConfigRecord(instructions)})


def reply_content(
    payload: Payload | None,
    num_samples: int,
    failure: str | None,
    logged: dict[str, tuple[float, float]],
    dp_sgd_plan: tuple[int, int] | None = None,
) -> RecordDict:
    reply: dict[str, Any] = {"num-samples": int(num_samples), "failure": failure or ""}
    if dp_sgd_plan is not None:  # the node's records and batch size: the server's DP-SGD accountant needs them
        reply["dp-sgd-records"], reply["dp-sgd-batch-size"] = int(dp_sgd_plan[0]), int(dp_sgd_plan[1])
    reply["payload"] = wire.dumps(payload) if payload is not None else b""
    metrics: dict[str, float] = {}
    for key, (total, weight) in logged.items():
        metrics[f"{key}:sum"], metrics[f"{key}:weight"] = float(total), float(weight)
    return RecordDict({REPLY: ConfigRecord(reply), LOGGED: MetricRecord(metrics)})


def read_reply(message: Message) -> tuple[Payload | None, int, str | None, dict[str, tuple[float, float]]]:
    """Payload, sample count, failure and logged values of a client's reply; malformed parts become a failure."""
    if message.has_error():
        return None, 0, f"the client failed: {message.error.reason}", {}
    content = message.content
    reply = content.get(REPLY) if REPLY in content else None
    if not isinstance(reply, ConfigRecord):
        return None, 0, f"malformed reply: no {REPLY!r} config record", {}
    num_samples, failure, data = reply.get("num-samples"), reply.get("failure", ""), reply.get("payload")
    if not isinstance(num_samples, int) or isinstance(num_samples, bool) or num_samples < 0:
        return None, 0, f"malformed reply: num-samples must be a non-negative int, got {num_samples!r}", {}
    if not isinstance(failure, str):
        return None, 0, "malformed reply: failure must be a string", {}
    logged = _read_logged(content.get(LOGGED) if LOGGED in content else None)
    if failure:
        return None, num_samples, failure[:500], logged
    if not isinstance(data, bytes):
        return None, num_samples, f"malformed reply: payload must be bytes, got {type(data).__name__}", logged
    try:
        payload = wire.loads(data)
    except wire.PayloadFormatError as err:
        return None, num_samples, f"malformed payload: {err}", logged
    return payload, num_samples, None, logged


def read_dp_sgd_plan(message: Message) -> tuple[Any, Any] | None:
    """The record count and batch size a node reported for DP-SGD accounting (unchecked), or ``None``."""
    if message.has_error() or REPLY not in message.content:
        return None
    reply = message.content.get(REPLY)
    if not isinstance(reply, ConfigRecord) or "dp-sgd-records" not in reply:
        return None
    return reply.get("dp-sgd-records"), reply.get("dp-sgd-batch-size")


def _read_logged(record: Any) -> dict[str, tuple[float, float]]:
    if not isinstance(record, MetricRecord):
        return {}
    out = {}
    for key, value in record.items():
        if key.endswith(":sum") and isinstance(value, (int, float)):
            name = key[: -len(":sum")]
            weight = record.get(f"{name}:weight")
            if isinstance(weight, (int, float)) and np.isfinite(value) and np.isfinite(weight) and weight >= 0:
                out[name] = (float(value), float(weight))
    return out


def message_bytes(message: Message, sizes: dict[str, int] | None = None) -> int:
    """Bytes of ``message`` as Flower serialises it for the wire: the message and every record, array and chunk.

    ``sizes`` caches each object's size by its content id, so the global state that every message of a round
    shares is serialised for counting once, not once per client.
    """
    from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects

    sizes = {} if sizes is None else sizes
    total = 0
    for object_id, obj in get_all_nested_objects(message).items():
        if object_id not in sizes:
            sizes[object_id] = len(obj.deflate())
        total += sizes[object_id]
    return total
