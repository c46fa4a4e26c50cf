"""Secure aggregation on Flower: one round of our loop as Flower 1.42's SecAgg+ protocol.

Flower's ``SecAggPlusWorkflow`` (server) and ``secaggplus_mod`` (client) do all the cryptography: key agreement,
Shamir shares of every node's secrets, pairwise and private masks modulo ``M``, and the removal of the masks of
nodes that drop after their masked upload. In 1.42 the workflow runs inside a legacy ``Strategy`` round (it
asks ``configure_fit`` for the nodes and hands ``aggregate_fit`` the dequantised weighted mean); this module
drives it from our own round loop:

- the "strategy" (:class:`_Round`) names the round's nodes and keeps what the workflow hands back;
- stage 2 ("collect masked vectors", the only stage that trains) carries our own train message (global state,
  round, seed, client id, fingerprint) instead of legacy fit instructions;
- every reply passes :class:`_Screen` first: a reply that does not have the shape its stage needs (a hostile or
  broken node) becomes an error reply, so the protocol treats that node as dropped instead of raising out of the
  workflow; its bytes are counted per node and stage;
- the client hands the mod its update already clipped and quantised with our seeded rounding, on Flower's grid
  (:meth:`~lightning_fl.privacy.secure.SecureSum.on_grid`), with weight 1 (``max_weight`` 1): Flower's own
  quantisation then reproduces our integers exactly, and the server recovers the exact integer sum from the
  workflow's float64 mean. A secure round on Flower equals the in-process one bit for bit.

What the server still sees in the clear: which nodes took part and each one's reply metadata (its sample
count and what its ``training_step`` logged, as in the in-process secure round), and the public keys and
encrypted shares SecAgg+ relays. Flower implements the semi-honest protocol: no signatures or consistency
check, so a node that lies inside its masked vector corrupts the sum undetectably (the aggregate's checks, a
finite result on the quantisation grid within ``trainer.max_update_norm``, still apply).
"""

from __future__ import annotations

import random
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from flwr.app import Context, Message, RecordDict
from flwr.common import Code, FitIns, FitRes, Parameters, Status, ndarrays_to_parameters, parameters_to_ndarrays
from flwr.common.constant import ErrorCode
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key, Stage
from flwr.server.compat.legacy_context import LegacyContext
from flwr.server.strategy import Strategy
from flwr.server.workflow import SecAggPlusWorkflow

from lightning_fl.flower.transport import exchange

STAGES = ("setup", "share keys", "masked upload", "unmask")
MAX_MODULUS = 2**48  # the server dequantises in float64: sums of n T < 2^48 come back exactly (see recover_sum)


# ============================================================================================ the server
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


@dataclass
class SecAggOutcome:
    """What a secure round on Flower gave back."""

    total: torch.Tensor | None = None  # sum_i q_i mod M (int64), None when the round failed
    included: list[int] = field(default_factory=list)  # nodes whose masked vectors are in the sum
    traffic: dict[int, NodeTraffic] = field(default_factory=dict)
    problem: str | None = None
    attempts: int = 0


class _Round(Strategy):
    """The legacy strategy SecAgg+ asks for: it names our nodes and keeps the aggregate instead of using it."""

    def __init__(self, nodes: list[int]) -> None:
        self.nodes = nodes
        self.aggregate: np.ndarray | None = None
        self.included: list[int] = []

    def configure_fit(self, server_round, parameters, client_manager):
        return [(_Proxy(n), FitIns(Parameters([], "numpy.ndarray"), {})) for n in self.nodes]

    def aggregate_fit(self, server_round, results, failures):
        arrays = parameters_to_ndarrays(results[0][1].parameters) if results else []
        self.aggregate = arrays[0] if len(arrays) == 1 else None
        self.included = sorted(proxy.node_id for proxy, _ in results)
        return None, {}

    def initialize_parameters(self, client_manager):  # pragma: no cover - not called by the workflow
        return None

    def configure_evaluate(self, server_round, parameters, client_manager):  # pragma: no cover
        return []

    def aggregate_evaluate(self, server_round, results, failures):  # pragma: no cover
        return None, {}

    def evaluate(self, server_round, parameters):  # pragma: no cover
        return None


@dataclass
class _Proxy:
    node_id: int


class _Workflow(SecAggPlusWorkflow):
    """SecAgg+ whose masked-upload stage sends each node our train message (plus the protocol's own record)."""

    def __init__(self, contents: dict[int, RecordDict], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.contents = contents

    def collect_masked_vectors_stage(self, grid, context, state) -> bool:
        state.nid_to_fitins = {node: self.contents[node] for node in state.active_node_ids}
        return super().collect_masked_vectors_stage(grid, context, state)


class _Screen:
    """The grid as the workflow sees it: counts each node's messages and bytes per stage, waits ``timeouts[stage]``
    and turns a reply that lacks what its stage needs into an error reply (the node drops; nothing raises)."""

    def __init__(self, grid: Any, nodes: Iterable[int], size: int, modulus: int, timeouts: list[float],
                 count_bytes: Any) -> None:  # fmt: skip
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


def recover_sum(aggregate: np.ndarray, n: int, secure: Any) -> tuple[torch.Tensor | None, str | None]:
    """The integer sum ``sum_i q_i`` of ``n`` unweighted uploads from the workflow's float64 result (the mean of
    their dequantised values, ``(sum_i q_i) 2c/(nT) - c``); ``None`` and why when it is not on the grid."""
    x = (aggregate.astype(np.float64) * n + n * secure.c) / secure.step
    total = np.rint(x)
    if aggregate.shape != (aggregate.size,) or not np.isfinite(x).all():
        return None, "the secure sum is not a finite vector"
    if total.size and (np.abs(x - total).max() > 0.25 or total.min() < 0 or total.max() > n * secure.T):
        return None, ("the secure sum is off the quantisation grid (a node masked something other than its "
                      "quantised update, or another weight)")  # fmt: skip
    return torch.from_numpy(total.astype(np.int64)), None


def secure_round(
    grid: Any,
    contents: dict[int, RecordDict],
    round: int,
    secure: Any,
    size: int,
    count_bytes: Any,
    train_timeout: float | None = None,
) -> SecAggOutcome:
    """One SecAgg+ round over the nodes in ``contents`` (node -> its train message content): the sum of their
    quantised uploads and each node's part. Nodes that fail before any training (setup or key sharing) are left
    out and the protocol runs once more without them; a failure after that leaves the round without a sum."""
    outcome = SecAggOutcome()
    nodes = sorted(contents)
    failed_early: set[int] = set()
    while True:
        outcome.attempts += 1
        nodes = [n for n in nodes if n not in failed_early]
        if len(nodes) < 2:
            outcome.problem = f"SecAgg+ needs at least 2 nodes, {len(nodes)} left"
            return outcome
        stage2 = max(secure.stage_timeout, train_timeout or 0.0)
        screen = _Screen(grid, nodes, size, secure.M, [secure.stage_timeout] * 2 + [stage2, secure.stage_timeout],
                         count_bytes)  # fmt: skip
        strategy = _Round(nodes)
        context = LegacyContext(Context(run_id=0, node_id=0, node_config={}, state=RecordDict(), run_config={}),
                                strategy=strategy)  # fmt: skip
        from flwr.app import ArrayRecord, ConfigRecord

        context.state.config_records["config"] = ConfigRecord({"current_round": round + 1})
        context.state.array_records["parameters"] = ArrayRecord()
        workflow = _Workflow(
            {n: contents[n] for n in nodes},
            num_shares=secure.num_shares, reconstruction_threshold=secure.reconstruction_threshold, max_weight=1.0,
            clipping_range=secure.c, quantization_range=secure.T, modulus_range=secure.M,
            timeout=secure.stage_timeout,
        )  # fmt: skip
        global_random = random.getstate()  # the workflow shuffles with Python's global generator: keep ours
        try:
            workflow(screen, context)
            problem = None
        except Exception as err:  # what Flower raises on a reply our screen let through
            problem = f"SecAgg+ raised {type(err).__name__}: {str(err)[:300]}"
        finally:
            random.setstate(global_random)
        _merge(outcome.traffic, screen.traffic)
        early = {n for n, t in screen.traffic.items() if t.failed_stage is not None and t.failed_stage < 2}
        if problem is None and strategy.aggregate is None and early and outcome.attempts == 1:
            failed_early = early  # halted because nodes left before training: once more without them
            continue
        if problem is None and strategy.aggregate is None:
            problem = "SecAgg+ halted (too few nodes answered, or too few shares to remove the masks)"
        if problem is None:
            outcome.total, problem = recover_sum(strategy.aggregate, len(strategy.included), secure)
        if problem is None:
            outcome.included = strategy.included
        outcome.problem = problem
        return outcome


def _merge(into: dict[int, NodeTraffic], attempt: dict[int, NodeTraffic]) -> None:
    for node, t in attempt.items():
        old = into.get(node)
        if old is not None:  # a second attempt: counts add up, the last attempt says how it ended
            t.messages_down += old.messages_down
            t.messages_up += old.messages_up
            t.bytes_down += old.bytes_down
            t.bytes_up += old.bytes_up
        into[node] = t


# ============================================================================================ the client
def upload_content(values: np.ndarray, num_samples: int, logged: RecordDict) -> RecordDict:
    """A node's stage-2 reply: its update on Flower's grid as the legacy fit result the mod masks (weight 1),
    and our reply records (its sample count and logged values; no payload: the update travels masked only)."""
    fitres = FitRes(Status(Code.OK, ""), ndarrays_to_parameters([values]), num_examples=1, metrics={})
    from flwr.compat.common.recorddict_compat import fitres_to_recorddict

    content = fitres_to_recorddict(fitres, keep_input=False)
    for name, record in logged.items():
        content[name] = record
    return content


def check_setup(configs: Any, secure: Any) -> str | None:
    """Why a node refuses the server's SecAgg+ setup: its quantisation must be the node's own."""
    wanted = {Key.CLIPPING_RANGE: secure.c, Key.TARGET_RANGE: secure.T, Key.MOD_RANGE: secure.M, Key.MAX_WEIGHT: 1.0}
    wrong = [f"{k}={configs.get(k)!r} (this node's is {v!r})" for k, v in wanted.items() if configs.get(k) != v]
    if wrong:
        return "refused: the server's SecAgg+ setup differs from trainer.secure_aggregation: " + ", ".join(wrong)
    return None


SETUP = Stage.SETUP
