"""The Flower transport: a round's global state goes to SuperNodes as Flower messages, payload bytes come back.

Client ids are the data module's (0..K-1), as in the simulation. Each SuperNode says which client it is
(its node config's ``partition-id``) when the server first sees it, and the server waits for the answers while the
nodes show progress (:mod:`lightning_fl.flower.hello`); nodes that join later are introduced at the start of the
next round, and a node that left is forgotten. A sampled client with no node, or whose
node does not answer within ``round_timeout``, is *lost* for that round (counted, logged, never fatal).

Kept as one file: :class:`FlowerTransport` is one class, whose plain and secure rounds and FedBuff's asynchronous
messages share its map of nodes, its late replies and its count of message bytes.
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from flwr.app import Message
from flwr.common.constant import ErrorCode
from flwr.common.logger import log
from flwr.serverapp import Grid

from lightning_fl.errors import ConfigError, UserError
from lightning_fl.federated.clients.local import ClientJob
from lightning_fl.federated.clients.transport import Reply, SecureRound, Transport
from lightning_fl.flower import messages as wire_msg
from lightning_fl.flower import secure as secagg
from lightning_fl.flower.grid import exchange  # (also lightning_fl.flower.transport.exchange, as before)
from lightning_fl.flower.hello import ENGINES, HELLO_TIMEOUT, WAIT_FOR_NODES, Hellos, setting
from lightning_fl.flower.late import LateReplies

NODE_UNAVAILABLE = ErrorCode.NODE_UNAVAILABLE
ASK_AGAIN = 2  # times a node whose ClientApp Flower reported as stopped responding to its hello is asked again
INFO, WARNING = 20, 30  # logging.INFO, logging.WARNING


class FlowerTransport(Transport):
    """Send rounds over a Flower ``Grid`` (simulation or deployment engine) from the ServerApp.

    Args:
        grid: The ServerApp's grid.
        config_yaml: The run's resolved config, sent once to every node so it builds the same run.
        round_timeout: Seconds to wait for a round's replies (``None``: until every reply arrives). A round whose
            replies do not all arrive in time says so; replies that come later are never matched to another round.
        hello_timeout: Seconds the wait for new nodes to say which client they are may pass without progress (a
            node answering or joining starts it again; :mod:`lightning_fl.flower.hello`).
        wait_for_nodes: Seconds to wait, before the first round, for a node to connect for every client (each node
            that connects starts it again).
        engine: ``"deployment"`` or ``"simulation"``: how the advice names the settings to raise.
        max_silent_rounds: A round in which no sampled client replies is not done (nothing is aggregated,
            released, accounted or saved) and runs again; stop the run with an error after this many silent attempts
            in a row (the last completed round's checkpoint is saved, so it resumes); ``None`` or 0: keep trying.
        late: Run config ``quorum``: rounds proceed at k of n and fold late replies into later rounds
            (:mod:`lightning_fl.flower.late`); ``None``: a round waits for every reply (or ``round_timeout``).
    """

    spreads_over_processes = False
    sums_securely = True
    asynchronous = True  # (FedBuff: :meth:`send`, :meth:`arrived`)

    def __init__(
        self,
        grid: Grid,
        config_yaml: str,
        round_timeout: float | None = None,
        hello_timeout: float = HELLO_TIMEOUT,
        wait_for_nodes: float = WAIT_FOR_NODES,
        max_silent_rounds: int | None = 3,
        late: LateReplies | None = None,
        engine: str = "deployment",
    ) -> None:
        if engine not in ENGINES:
            raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
        self.grid, self.config_yaml, self.late, self.engine = grid, config_yaml, late, engine
        self.round_timeout, self.hello_timeout, self.wait_for_nodes = round_timeout, hello_timeout, wait_for_nodes
        self.max_silent_rounds = max_silent_rounds or None
        self.silent_rounds = 0  # attempts in a row in which no sampled client replied
        self.hellos = Hellos(grid, self._hello)  # nodes asked which client they are that have not answered yet
        self.crashed: dict[int, int] = {}  # node -> hellos Flower answered "ClientApp stopped responding" for
        self.node_of: dict[int, int] = {}  # client id -> node id
        self.client_of: dict[int, int] = {}  # node id -> client id
        self.refused: set[int] = set()  # nodes that could not serve (asked once; a fixed node rejoins under a new id)
        self.num_clients = 0
        self.fingerprint: str | None = None
        self.out: dict[str, tuple[int, int]] = {}  # FedBuff: message id -> (client, bytes of the message)
        self._records: dict[int, tuple[Any, dict[str, int]]] = {}  # version -> (its state's record, sizes)

    # ------------------------------------------------------------------------------------ nodes
    def open(self, *, num_clients: int, fingerprint: str | None, seed: int) -> None:
        """Wait, before the first round, until a node answers for every client: while nodes answer or join (each
        starts ``hello_timeout`` again), or, with nobody to ask, ``wait_for_nodes`` since the last node joined."""
        self.num_clients, self.fingerprint = num_clients, fingerprint
        last = time.monotonic()
        while True:
            known = (len(self.node_of), set(self.hellos.out), set(self.refused))
            self.introduce(wait=True)
            if len(self.node_of) >= num_clients:
                break
            if known != (len(self.node_of), set(self.hellos.out), set(self.refused)):
                last = time.monotonic()
            if self.hellos.overdue or time.monotonic() - last >= self.wait_for_nodes:
                break
            time.sleep(0.5)
        if len(self.node_of) < num_clients:
            missing = sorted(set(range(num_clients)) - set(self.node_of))
            why = (
                f"{len(self.hellos.out)} connected SuperNode(s) did not say which client they serve within "
                f"{self.setting('hello-timeout')} ({self.hello_timeout:g} s without progress; their answers are "
                "taken whenever they come)"
                if self.hellos.out
                else f"no SuperNode answered for them within {self.setting('wait-for-nodes')} "
                f"({self.wait_for_nodes:g} s)"
            )
            warnings.warn(
                f"client(s) {missing} have no SuperNode yet: {why}; until one answers they miss rounds "
                f"(on a busy machine, raise {self.setting('hello-timeout')})",
                stacklevel=2,
            )

    def setting(self, key: str) -> str:
        """How the run sets ``key`` on its engine (:func:`lightning_fl.flower.hello.setting`)."""
        return setting(self.engine, key)

    def _hello(self, node: int) -> Message:
        return Message(content=wire_msg.hello_content(self.config_yaml), dst_node_id=node, message_type=wire_msg.HELLO)

    def introduce(self, wait: bool = True) -> None:
        """Forget nodes that left; ask new ones which client they are (and give them the run's config); take the
        answers in. ``wait``: wait for those asked and not yet overdue while they show progress
        (:meth:`Hellos.collect`); else only take the answers already in."""

        def connected() -> set[int]:
            nodes = set(self.grid.get_node_ids())
            for node in [n for n in self.client_of if n not in nodes]:
                self.node_of.pop(self.client_of.pop(node), None)
            return nodes

        def wanted(node: int) -> bool:
            return node not in self.client_of and node not in self.refused

        self.hellos.ask_new(n for n in connected() if wanted(n))
        self.hellos.collect(self.hello_timeout if wait else 0.0, connected, self._answer, wanted)

    def _answer(self, reply: Message) -> None:
        node = reply.metadata.src_node_id
        if reply.has_error() and reply.error.code == ErrorCode.CLIENT_APP_CRASHED:  # (e.g. its heartbeat lapsed)
            self.crashed[node] = self.crashed.get(node, 0) + 1
            if self.crashed[node] <= ASK_AGAIN:
                why = f"SuperNode {node}'s ClientApp stopped responding to its hello: asked again"
                warnings.warn(why, stacklevel=2)
                return
        client, problem = self._read_hello(reply)
        if problem is not None:
            self.refused.add(node)
            warnings.warn(f"SuperNode {node} is not used: {problem}", stacklevel=2)
            return
        old = self.node_of.get(client)
        if old is not None:  # a node that came back under a new id replaces the one it was
            self.client_of.pop(old, None)
            warnings.warn(f"SuperNode {node} now serves client {client} (was SuperNode {old})", stacklevel=2)
        self.node_of[client], self.client_of[node] = node, client

    def _read_hello(self, reply: Message) -> tuple[int, str | None]:
        if reply.has_error():
            return -1, f"it failed to start: {reply.error.reason}"
        record = reply.content.get(wire_msg.RUN) if wire_msg.RUN in reply.content else None
        client = record.get("partition-id") if record is not None else None
        refusal = record.get("refusal", "") if record is not None else ""
        if refusal:
            return -1, str(refusal)[:500]
        if not isinstance(client, int) or isinstance(client, bool) or not 0 <= client < self.num_clients:
            return -1, f"its partition-id {client!r} is not a client id 0..{self.num_clients - 1}"
        return client, None

    # ------------------------------------------------------------------------------------ rounds
    def finished_round(self, round: int, metrics: dict[str, float]) -> None:
        """One line per round (``round``: 1-based, as logged) in the ServerApp's log (``flwr log``): who answered,
        accuracy, bytes. A completed round ends a streak of silent attempts."""
        if "fed/in_flight" in metrics:  # FedBuff: a server step
            log(
                INFO,
                "step %d: %.0f updates aggregated (staleness up to %.0f), %.0f clients started, %.0f in flight, "
                "%.0f lost%s",
                round,
                metrics.get("fed/aggregated_clients", math.nan),
                metrics["fed/staleness_max"],
                metrics["fed/clients"],
                metrics["fed/in_flight"],
                metrics["fed/lost_clients"],
                f"; val/acc {metrics['val/acc']:.4f}" if "val/acc" in metrics else "",
            )
            self.silent_rounds = 0
            return
        answered = metrics["fed/clients"] - metrics["fed/unavailable_clients"] - metrics["fed/lost_clients"]
        rejected = metrics.get("fed/dropped_clients")  # (a private run keeps it out of its logs)
        parts = [
            f"round {round}: {answered:.0f} of {metrics['fed/clients']:.0f} sampled clients replied",
            f"{metrics['fed/lost_clients']:.0f} lost" + (f", {rejected:.0f} rejected" if rejected is not None else ""),
        ] + ([f"{metrics['fed/stale_replies']:.0f} late replies folded"] if metrics.get("fed/stale_replies") else [])
        if "val/acc" in metrics:
            parts.append(f"val/acc {metrics['val/acc']:.4f}")
        if "comm/msg_client_up_bytes" in metrics:
            payload, message = metrics["comm/client_up_bytes"], metrics["comm/msg_client_up_bytes"]
            parts.append(f"upload {payload:.0f} B payload in a {message:.0f} B message per client")
        log(INFO, "%s", "; ".join(parts))
        self.silent_rounds = 0

    def silent_round(self, round: int, asked: list[int]) -> None:
        """No sampled client of round ``round`` replied: log it and let the round run again, or stop the run once
        ``max_silent_rounds`` attempts in a row were silent."""
        self.silent_rounds += 1
        n, limit = self.silent_rounds, self.max_silent_rounds
        log(
            WARNING,
            "round %d: none of the %d sampled clients replied (attempt %d%s): the round is not done and runs again",
            round,
            len(asked),
            n,
            f" of {limit}" if limit else "",
        )
        self.hellos.overdue.clear()  # (the next attempt waits for the nodes' answers again)
        if limit is not None and n >= limit:
            raise UserError(self._silent_advice(n, round))

    def _silent_advice(self, n: int, round: int) -> str:
        """The one line a run stopped by silent attempts ends with: what to check and which setting to raise, as
        the engine in use spells it."""
        nodes = sorted(self.client_of) or "none"
        saved = f"its checkpoint of round {round - 1} is saved; the silent attempts released and spent nothing"
        attempts = f"{self.setting('max-silent-rounds')} sets how many attempts to allow (0: never stop)"
        head = f"no sampled client replied in {n} attempts in a row at round {round}"
        if self.hellos.out:  # nodes connected that have not said which client they serve
            return (
                f"{head}: {len(self.hellos.out)} SuperNode(s) did not say which client they serve within "
                f"{self.setting('hello-timeout')} ({self.hello_timeout:g} s without progress): on a busy machine "
                f"a ClientApp takes long to start; raise {self.setting('hello-timeout')}, then "
                + ("run again with --trainer.resume auto" if self.engine == "simulation" else "resume the run")
                + f" ({saved}); {attempts}"
            )
        if self.engine == "simulation":
            return (
                f"{head} (virtual SuperNodes serving a client: {nodes}): their ClientApps failed or did not answer "
                f"(see the log above); on a busy machine raise --hello-timeout and --round-timeout, then run again "
                f"with --trainer.resume auto ({saved}); {attempts}"
            )
        return (
            f"{head} (SuperNodes known: {nodes}): check that the SuperNodes run and reach this SuperLink (after a "
            f"SuperLink restart, restart them too), then resume the run ({saved}); {attempts}"
        )

    def replies(self, job: ClientJob, clients: Sequence[int]) -> Iterator[Reply]:
        state, round, seed = job.state, job.round, job.seed
        self.introduce()
        late = self.late
        busy = late.start(round) if late is not None else set()  # (their messages are still out: sent nothing)
        arrays = wire_msg.state_to_record(state)
        sent: dict[int, tuple[int, int]] = {}  # client -> (node, bytes of its message)
        out: list[Message] = []
        targets: list[int] = []
        sizes: dict[str, int] = {}  # serialised size per object id: the shared state is counted once
        for cid in clients:
            node = self.node_of.get(cid)
            if node is None or cid in busy:
                continue
            content = wire_msg.train_content(arrays, round, seed, cid, self.fingerprint, self.num_clients)
            message = Message(content=content, dst_node_id=node, message_type=wire_msg.TRAIN, group_id=str(round + 1))
            out.append(message)
            targets.append(cid)
            sent[cid] = (node, wire_msg.message_bytes(message, sizes))
        answers: dict[int, Any] = {}
        stale: dict[int, tuple[Any, Any]] = {}  # client -> (its message out, the late reply)
        started = time.monotonic()
        pending, need = (late.waiting(), late.quorum) if late is not None else ((), None)
        replies = exchange(self.grid, out, self.round_timeout, pending=pending, need=need)
        # match replies to what was sent; a reply to another round's message is never this round's (the
        # SuperLink answers for a vanished node under its own id, with no message to reply to)
        by_id = {m.metadata.message_id: c for m, c in zip(out, targets, strict=True) if m.metadata.message_id}
        for reply in replies:
            to = reply.metadata.reply_to_message_id or None
            client = by_id.get(to) if to is not None else self.client_of.get(reply.metadata.src_node_id)
            if client is not None and client in sent and client not in answers:
                answers[client] = reply
            elif late is not None and (was := late.match(to, client)) is not None:
                stale[was.client] = (was, reply)
        behind = sorted(set(targets) - set(answers))
        if late is not None and behind:
            late.left(round, state, [(m, c, *sent[c]) for m, c in zip(out, targets, strict=True) if c in behind])
            log(
                INFO,
                "round %d: proceeds with %d of %d replies; client(s) %s are still training: a reply that "
                "arrives within run config 'max-staleness' rounds is folded into the round it arrives in",
                round + 1,
                len(answers),
                len(out),
                behind,
            )
        elif behind and self.round_timeout is not None and time.monotonic() - started >= self.round_timeout:
            warnings.warn(
                f"round {round + 1}: client(s) {behind} did not reply: timed out after "
                f"{self.round_timeout:g} s; raise run config 'round-timeout'",
                stacklevel=2,
            )
        for cid in clients:
            if cid in busy:  # its entry is its late reply, if that came
                was, message = stale.pop(cid, (None, None))
                reply = self._read(cid, message, None)
                yield late.reply(was, reply) if reply is not None else late.lost(cid)
            else:
                down = sent[cid][1] if cid in sent else None
                yield self._read(cid, answers.get(cid), down) or Reply(cid, lost=True, message_down=down)
        for cid in sorted(stale):  # late replies of clients this round did not sample
            if (reply := self._read(cid, stale[cid][1], None)) is not None:
                yield late.reply(stale[cid][0], reply)

    # ------------------------------------------------------------------------------------ FedBuff
    def reachable(self) -> set[int]:
        """The clients a node serves now (new nodes introduced first). With none, the wait for the nodes' answers
        starts again (each time up to ``hello_timeout`` without progress), up to ``max_silent_rounds`` times; then
        the run stops with one line."""
        self.introduce()
        attempt = 0
        while not self.node_of:
            attempt += 1
            if self.max_silent_rounds is not None and attempt > self.max_silent_rounds:
                key = self.setting("hello-timeout")
                raise UserError(
                    f"trainer.buffered: no SuperNode said which client it serves in {attempt - 1} attempts (each "
                    f"waiting {key}, {self.hello_timeout:g} s without progress): check that the SuperNodes run "
                    f"and reach this SuperLink, raise {key} on a busy machine, then resume the run"
                )
            log(WARNING, "trainer.buffered: no SuperNode serves a client yet (attempt %d): waiting again", attempt)
            time.sleep(min(1.0, self.hello_timeout))
            self.hellos.overdue.clear()
            self.introduce()
        return set(self.node_of)

    def send(self, job: ClientJob, client: int) -> tuple[str, int] | None:
        """Push ``client``'s train message of ``job`` (server version ``job.round``) on its own: its message id and
        bytes; ``None`` when no node serves it or the SuperLink did not take it."""
        node = self.node_of.get(client)
        if node is None:
            return None
        if job.round not in self._records:  # (one record and one count of the state's bytes per version)
            self._records = {job.round: (wire_msg.state_to_record(job.state), {})}
        arrays, sizes = self._records[job.round]
        content = wire_msg.train_content(arrays, job.round, job.seed, client, self.fingerprint, self.num_clients)
        message = Message(content=content, dst_node_id=node, message_type=wire_msg.TRAIN, group_id=str(job.round + 1))
        size = wire_msg.message_bytes(message, sizes)
        (message_id,) = self.grid.push_messages([message])
        if not message_id:
            return None
        self.out[message_id] = (client, size)
        return message_id, size

    def arrived(self, tickets: Sequence[str]) -> list[tuple[str, Reply]]:
        """The replies to the messages ``tickets`` pulled as soon as any is in (in the order pulled); a node that
        left answers lost. None within ``round_timeout``: the run stops with a line saying what to do."""
        replies = exchange(self.grid, [], self.round_timeout, pending=tickets)
        if not replies:
            raise UserError(
                f"trainer.buffered: none of the {len(tickets)} clients in flight replied within run config "
                f"'round-timeout' ({self.round_timeout:g} s): check the SuperNodes, raise round-timeout (0 waits "
                "as long as it takes), then resume the run from its last checkpoint"
            )
        out = []
        for message in replies:
            ticket = message.metadata.reply_to_message_id or None
            if ticket is None:  # (the SuperLink answers for a vanished node under its own id: matched by node)
                client = self.client_of.get(message.metadata.src_node_id)
                ticket = next((t for t in tickets if t in self.out and self.out[t][0] == client), None)
            if ticket not in self.out or ticket not in tickets:
                continue
            client, size = self.out.pop(ticket)
            reply = self._read(client, message, size) or Reply(client, lost=True, message_down=size)
            out.append((ticket, reply))
        return out

    def _read(self, cid: int, reply: Message | None, down: int | None) -> Reply | None:
        """A node's reply as the round reads it; ``None`` when it is lost (none, or its node is gone: then forgotten
        until it comes back under a new id)."""
        if reply is None or (reply.has_error() and reply.error.code == NODE_UNAVAILABLE):
            if reply is not None:
                self.client_of.pop(self.node_of.pop(cid, -1), None)
            return None
        try:  # whatever one reply holds, it is that reply's problem, never the server's
            payload, num_samples, failure, logged = wire_msg.read_reply(reply)
            plan = wire_msg.read_dp_sgd_plan(reply)
        except Exception as err:
            payload, num_samples, logged, plan = None, 0, {}, None
            failure = f"malformed reply ({type(err).__name__}: {str(err)[:200]})"
        size = wire_msg.message_bytes(reply) if reply.has_content() else None
        return Reply(cid, num_samples, payload, logged, failure, message_up=size, message_down=down, dp_sgd_plan=plan)

    def round_metrics(self) -> dict[str, float]:
        """With run config ``quorum``: the round's late replies (:meth:`LateReplies.metrics`)."""
        return self.late.metrics() if self.late is not None else {}

    def secure_round(self, job: ClientJob, clients: Sequence[int]) -> SecureRound:
        """A round through Flower's SecAgg+ (:mod:`lightning_fl.flower.secure`): the sampled clients' nodes train
        in its masked-upload stage; the server gets the sum of their quantised updates and their reply metadata.
        Every message of the four stages is counted in the clients' message bytes."""
        state, round, seed, secure = job.state, job.round, job.seed, job.local.secure
        if secure.M > secagg.MAX_MODULUS:
            raise ConfigError(
                f"trainer.secure_aggregation.modulus_range {secure.M} is above 2^48: Flower's server dequantises the "
                "sum in float64, exact only below that; lower modulus_range (the default is 2^32)"
            )
        self.introduce()
        arrays = wire_msg.state_to_record(state)
        contents = {}
        for cid in clients:
            node = self.node_of.get(cid)
            if node is not None:
                contents[node] = wire_msg.train_content(arrays, round, seed, cid, self.fingerprint, self.num_clients)
        size = sum(t.numel() for t in state.values())
        outcome = secagg.SecAggOutcome(problem="no sampled client has a node")
        if contents:
            outcome = secagg.secure_round(
                self.grid, contents, round, secure, size, wire_msg.message_bytes, self.round_timeout
            )
        out = SecureRound(problem=outcome.problem, invalid=outcome.invalid)
        included = set(outcome.included)
        for cid in clients:
            node = self.node_of.get(cid)
            traffic = outcome.traffic.get(node) if node is not None else None
            if traffic is None:
                out.replies.append(Reply(cid, lost=True))
                continue
            down, up = traffic.bytes_down or None, traffic.bytes_up or None
            if traffic.lost and node not in included:
                if traffic.failure == "its node is unavailable":  # gone: forget it until it comes back
                    self.client_of.pop(self.node_of.pop(cid, -1), None)
                out.replies.append(Reply(cid, lost=True, message_up=up, message_down=down))
                continue
            num_samples, logged, plan = 0, {}, None
            if traffic.upload is not None:
                try:  # (its metadata only: the update went into the sum; a broken record costs only the metadata)
                    _, num_samples, _, logged = wire_msg.read_reply(traffic.upload)
                    plan = wire_msg.read_dp_sgd_plan(traffic.upload)
                except Exception:
                    num_samples, logged, plan = 0, {}, None
            failure = None
            if node not in included and traffic.failure is not None:
                failure = f"secure aggregation, {secagg.STAGES[traffic.failed_stage]} stage: {traffic.failure}"
            elif node not in included and outcome.problem is None:
                failure = "secure aggregation left its upload out"
            reply = Reply(
                cid,
                num_samples,
                None,
                logged,
                failure,
                message_up=up,
                message_down=down,
                upload_bytes=8 * size if traffic.upload is not None else 0,
                dp_sgd_plan=plan,
            )
            out.replies.append(reply)
        if outcome.total is not None:
            out.total = torch.remainder(outcome.total, secure.M)
        if outcome.included:
            out.included = sorted(self.client_of[n] for n in outcome.included)
        if outcome.attempts > 1 and outcome.problem is None:
            log(INFO, "round %s: SecAgg+ ran again without the nodes that failed before training", round + 1)
        return out
