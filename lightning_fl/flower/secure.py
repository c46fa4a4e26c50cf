"""Secure aggregation on Flower: one round of our loop as Flower 1.42's SecAgg+ protocol.

Flower's ``SecAggPlusWorkflow`` (server) and ``secaggplus_mod`` (client) do all the cryptography: key agreement,
Shamir shares of every node's secrets, pairwise and private masks modulo ``M``, and the removal of the masks of
nodes that drop after their masked upload. In 1.42 the workflow runs inside a legacy ``Strategy`` round (it
asks ``configure_fit`` for the nodes and hands ``aggregate_fit`` the dequantised weighted mean); this module
drives it from our own round loop:

- the "strategy" (:class:`_Round`) names the round's nodes and keeps what the workflow hands back;
- stage 2 ("collect masked vectors", the only stage that trains) carries our own train message (global state,
  round, seed, client id, fingerprint) instead of legacy fit instructions;
- every reply passes :class:`~lightning_fl.flower.secagg_screen.Screen` first: a reply that does not have the shape
  its stage needs (a hostile or broken node) becomes an error reply, so the protocol treats that node as dropped
  instead of raising out of the workflow; its bytes are counted per node and stage;
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
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from flwr.app import Context, RecordDict
from flwr.common import Code, FitIns, FitRes, Parameters, Status, ndarrays_to_parameters, parameters_to_ndarrays
from flwr.common.secure_aggregation.secaggplus_constants import Key, Stage
from flwr.server.compat.legacy_context import LegacyContext
from flwr.server.strategy import Strategy
from flwr.server.workflow import SecAggPlusWorkflow

from lightning_fl.flower.secagg_screen import NodeTraffic, Screen

STAGES = ("setup", "share keys", "masked upload", "unmask")
MAX_MODULUS = 2**48  # the server dequantises in float64: sums of n T < 2^48 come back exactly (see recover_sum)


# ============================================================================================ the server
@dataclass
class SecAggOutcome:
    """What a secure round on Flower gave back."""

    total: torch.Tensor | None = None  # sum_i q_i mod M (int64), None when the round failed
    included: list[int] = field(default_factory=list)  # nodes whose masked vectors are in the sum
    traffic: dict[int, NodeTraffic] = field(default_factory=dict)
    problem: str | None = None
    invalid: bool = False  # the nodes' sum came back off the grid (``included`` says whose)
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


def recover_sum(aggregate: np.ndarray, n: int, secure: Any) -> tuple[torch.Tensor | None, str | None]:
    """The integer sum ``sum_i q_i`` of ``n`` unweighted uploads from the workflow's float64 result (the mean of
    their dequantised values, ``(sum_i q_i) 2c/(nT) - c``); ``None`` and why when it is not on the grid."""
    x = (aggregate.astype(np.float64) * n + n * secure.c) / secure.step
    total = np.rint(x)
    if aggregate.shape != (aggregate.size,) or not np.isfinite(x).all():
        return None, "the secure sum is not a finite vector"
    if total.size and (np.abs(x - total).max() > 0.25 or total.min() < 0 or total.max() > n * secure.T):
        return None, (
            "the secure sum is off the quantisation grid (a node masked something other than its "
            "quantised update, or another weight)"
        )
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
        screen = Screen(
            grid, nodes, size, secure.M, [secure.stage_timeout] * 2 + [stage2, secure.stage_timeout], count_bytes
        )
        strategy = _Round(nodes)
        context = LegacyContext(
            Context(run_id=0, node_id=0, node_config={}, state=RecordDict(), run_config={}), strategy=strategy
        )
        from flwr.app import ArrayRecord, ConfigRecord

        context.state.config_records["config"] = ConfigRecord({"current_round": round + 1})
        context.state.array_records["parameters"] = ArrayRecord()
        workflow = _Workflow(
            {n: contents[n] for n in nodes},
            num_shares=secure.num_shares,
            reconstruction_threshold=secure.reconstruction_threshold,
            max_weight=1.0,
            clipping_range=secure.c,
            quantization_range=secure.T,
            modulus_range=secure.M,
            timeout=secure.stage_timeout,
        )
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
            outcome.invalid = problem is not None  # a sum came back, but not one of quantised updates
        if problem is None or outcome.invalid:
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
