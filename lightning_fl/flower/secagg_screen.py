"""The grid as Flower's SecAgg+ workflow sees it in a secure round (:mod:`lightning_fl.flower.secure`): every
message of the four stages is counted per node, and every reply is screened before the workflow reads it.

A reply that lacks what its stage needs (public keys that parse, encrypted shares addressed to nodes of the round,
a masked vector of integers of the right shape below the modulus, the shares of nodes of the round) becomes an
error reply: the protocol then treats its node as dropped instead of raising out of the workflow. Only shapes
are checked; the values are keys, ciphertexts or masked.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
from flwr.app import Message, RecordDict
from flwr.common.constant import ErrorCode
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key

from lightning_fl.flower.grid import exchange


@dataclass
class NodeTraffic:
    """One node's part in a secure round: its messages and bytes in each direction, the stage it failed at
    (and why), its stage-2 reply."""

    messages_down: int = 0
    messages_up: int = 0
    bytes_down: int = 0
    bytes_up: int = 0
    failed_stage: int | None = None
    failure: str | None = None
    lost: bool = False
    upload: Message | None = None


class Screen:
    """The grid as the workflow sees it: counts each node's messages and bytes per stage, waits ``timeouts[stage]``
    and turns a reply that lacks what its stage needs into an error reply (the node drops; nothing raises)."""

    def __init__(
        self, grid: Any, nodes: Iterable[int], size: int, modulus: int, timeouts: list[float], count_bytes: Any
    ) -> None:
        self.grid, self.size, self.modulus, self.timeouts = grid, size, modulus, timeouts
        self.nodes = set(nodes)
        self.count_bytes = count_bytes
        self.traffic = {n: NodeTraffic() for n in self.nodes}
        self.stage = 0

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> list[Message]:
        stage, self.stage = self.stage, self.stage + 1
        messages = list(messages)
        sent = {m.metadata.dst_node_id: m for m in messages}
        sizes: dict[str, int] = {}
        for node, message in sent.items():
            self.traffic[node].messages_down += 1
            self.traffic[node].bytes_down += self.count_bytes(message, sizes)
        replies, seen = [], set()
        for reply in exchange(self.grid, messages, self.timeouts[min(stage, 3)]):
            node = reply.metadata.src_node_id
            if node not in sent or node in seen:  # not asked in this stage, or a second answer
                continue
            seen.add(node)
            traffic = self.traffic[node]
            traffic.messages_up += 1
            traffic.bytes_up += self.count_bytes(reply) if reply.has_content() else 0
            problem = None
            if reply.has_error():
                lost = reply.error.code == ErrorCode.NODE_UNAVAILABLE
                problem = "its node is unavailable" if lost else f"the node failed: {reply.error.reason[:300]}"
                traffic.lost = lost
            else:
                problem = self.problem(stage, reply)
                if problem is not None:
                    problem = f"malformed SecAgg+ reply: {problem}"
                    reply = Message(_error(problem), reply_to=sent[node])
            if problem is not None:
                traffic.failed_stage, traffic.failure = stage, problem
            elif stage == 2:
                traffic.upload = reply
            replies.append(reply)
        for node in set(sent) - seen:
            self.traffic[node].failed_stage, self.traffic[node].lost = stage, True
            self.traffic[node].failure = "no reply in time"
        return replies

    def problem(self, stage: int, reply: Message) -> str | None:
        """Why ``reply`` cannot be used at ``stage`` (its shape only: the values are keys, ciphertexts or masked)."""
        content = reply.content
        record = content.config_records.get(RECORD_KEY_CONFIGS) if RECORD_KEY_CONFIGS in content else None
        if record is None:
            return f"no {RECORD_KEY_CONFIGS!r} record"
        try:
            if stage == 0:
                from flwr.supercore.primitives.asymmetric import bytes_to_public_key

                for key in (Key.PUBLIC_KEY_1, Key.PUBLIC_KEY_2):
                    value = record.get(key)
                    if not isinstance(value, bytes):
                        return f"{key} must be bytes"
                    bytes_to_public_key(value)  # (a key its neighbours could not use would fail them all)
            elif stage == 1:  # encrypted shares, each addressed to a node of the round
                return self._pairs_problem(record, Key.DESTINATION_LIST, Key.CIPHERTEXT_LIST)
            elif stage == 2:
                return self._upload_problem(content, record)
            elif stage == 3:  # the shares it holds, each of a node of the round
                return self._pairs_problem(record, Key.NODE_ID_LIST, Key.SHARE_LIST)
        except Exception as err:  # whatever a hostile reply makes a reader raise
            return f"{type(err).__name__}: {str(err)[:200]}"
        return None

    def _pairs_problem(self, record: Any, ids_key: str, values_key: str) -> str | None:
        """Node ids and bytes, equally many, every id a node of the round."""
        ids, values = record.get(ids_key), record.get(values_key)
        if not _list_of(ids, int) or not _list_of(values, bytes) or len(ids) != len(values):
            return f"{ids_key} and {values_key} must be equally long lists of ids/bytes"
        if not set(ids) <= self.nodes:
            return f"{ids_key} names nodes outside the round"
        return None

    def _upload_problem(self, content: RecordDict, record: Any) -> str | None:
        from flwr.common import bytes_to_ndarray
        from flwr.compat.common.recorddict_compat import recorddict_to_fitres

        arrays = record.get(Key.MASKED_PARAMETERS)
        if not _list_of(arrays, bytes) or len(arrays) != 2:
            return f"{Key.MASKED_PARAMETERS} must be two arrays (weight factor, vector)"
        factor, vector = (bytes_to_ndarray(b) for b in arrays)  # (numpy's format, never a pickle)
        for name, array, shape in (("weight factor", factor, (1,)), ("vector", vector, (self.size,))):
            if not np.issubdtype(array.dtype, np.integer) or array.shape != shape:
                return f"masked {name} must be integers of shape {shape}, got {array.dtype} {array.shape}"
            if array.size and (int(array.min()) < 0 or int(array.max()) >= self.modulus):
                return f"masked {name} has values outside [0, modulus_range)"
        recorddict_to_fitres(content, keep_input=True)  # the legacy records the workflow reads
        return None


def _list_of(value: Any, kind: type) -> bool:
    return isinstance(value, list) and all(isinstance(v, kind) and not isinstance(v, bool) for v in value)


def _error(reason: str) -> Any:
    from flwr.app import Error

    return Error(code=ErrorCode.UNKNOWN, reason=reason)
