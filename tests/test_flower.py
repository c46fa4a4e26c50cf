"""Flower: the ServerApp's transport and the ClientApp, against the in-process simulation.

Most tests route Flower messages through :class:`LocalGrid`, a ``Grid`` that hands each message to the real
ClientApp in this process (the engines add only transport); the slow tests in test_flower_engines.py run
the simulation and deployment engines themselves.
"""

from __future__ import annotations

import copy
import io
import itertools
import time
import warnings
from collections.abc import Callable, Iterable

import pytest
import torch

flwr = pytest.importorskip("flwr")

from flwr.app import Context, Error, Message, RecordDict  # noqa: E402
from flwr.common.constant import ErrorCode  # noqa: E402
from flwr.serverapp import Grid  # noqa: E402

from conftest import CONFIGS, run_cli  # noqa: E402
from lightning_fl.checkpoint import read_checkpoint  # noqa: E402
from lightning_fl.errors import ConfigError  # noqa: E402
from lightning_fl.federated import UploadRejectedError  # noqa: E402
from lightning_fl.flower import client as flower_client  # noqa: E402
from lightning_fl.flower import messages  # noqa: E402
from lightning_fl.flower import node as flower_node  # noqa: E402
from lightning_fl.flower.server import serve, settings  # noqa: E402

SMALL = [
    "--trainer.rounds",
    "2",
    "--data.num_clients",
    "4",
    "--trainer.enable_progress_bar",
    "false",
    "--trainer.logger",
    "false",
    "--model.init_args.pretraining.epochs",
    "2",
]


@pytest.fixture(autouse=True)
def task_identity(monkeypatch):
    """What Flower's runtime sets in a ServerApp process: messages take their run and node ids from it."""
    from flwr.supercore.task_identity import TaskIdentity

    for attribute, value in (("_run_id", 1), ("_node_id", 0), ("_task_id", 0)):
        monkeypatch.setattr(TaskIdentity, attribute, value)


class LocalGrid(Grid):
    """A Flower ``Grid`` whose nodes are ClientApp calls in this process.

    Args:
        node_configs: One node config per node (node ids 1, 2, ...).
        tamper: ``{node id: f(reply, message) -> reply or None}``: rewrite a node's reply to a train message, or
            drop it (``None``: lost).
    """

    def __init__(self, node_configs: list[dict], tamper: dict[int, Callable] | None = None) -> None:
        self.contexts = {
            i + 1: Context(run_id=1, node_id=i + 1, node_config=dict(c), state=RecordDict(), run_config={})
            for i, c in enumerate(node_configs)
        }
        self.tamper = tamper or {}
        self.sent: list[Message] = []
        self.store: dict[str, Message] = {}  # replies not pulled yet, by the id of the message they answer
        self.pulls = 0
        self._ids = itertools.count()

    def set_run(self, run_id):  # pragma: no cover - not used by our transport
        pass

    @property
    def run(self):  # pragma: no cover
        raise NotImplementedError

    def create_message(self, content, message_type, dst_node_id, group_id, ttl=None):  # pragma: no cover
        return Message(content=content, dst_node_id=dst_node_id, message_type=message_type, group_id=group_id)

    def get_node_ids(self) -> Iterable[int]:
        return list(self.contexts)

    def push_messages(self, messages: Iterable[Message]) -> list[str]:
        """Deliver at once; the replies wait in the SuperLink's store (keyed by the message answered) until pulled."""
        messages = list(messages)
        for message in messages:
            message.metadata.__dict__["_message_id"] = f"m{next(self._ids)}"  # as the SuperLink does on push
        for reply in self.deliver(messages):
            self.store[reply.metadata.reply_to_message_id] = reply
        return [m.metadata.message_id for m in messages]

    def pull_messages(self, message_ids: Iterable[str]) -> list[Message]:
        self.pulls += 1
        return [self.store.pop(i) for i in message_ids if i in self.store]

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> list[Message]:
        return list(self.pull_messages(self.push_messages(messages)))

    def deliver(self, messages: list[Message]) -> list[Message]:
        """Each message to its node's ClientApp; the replies (a node's reply dropped by ``tamper`` never comes)."""
        replies = []
        for message in messages:
            self.sent.append(message)
            node = message.metadata.dst_node_id
            if node not in self.contexts:
                continue
            try:  # (a copy, as the wire delivers it: SecAgg+'s mod edits what it receives, shared by several messages)
                reply = flower_client.app(delivered(message), self.contexts[node])
            except Exception as err:  # as a SuperNode does: the ClientApp's exception becomes an error reply
                reason = f"{type(err)}:<'{err}'>"
                reply = Message(Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason=reason), reply_to=message)
            if node in self.tamper and message.metadata.message_type == messages_train():
                reply = self.tamper[node](reply, message)
            if reply is not None:
                replies.append(reply)
        return replies


def delivered(message: Message) -> Message:
    """``message`` as a node receives it: its config records are its own (the arrays are shared: nobody edits them)."""
    from flwr.app import ConfigRecord

    content = RecordDict(
        {k: ConfigRecord(dict(v)) if isinstance(v, ConfigRecord) else v for k, v in message.content.items()}
    )
    out = Message(content, dst_node_id=message.metadata.dst_node_id, message_type=message.metadata.message_type)
    out.metadata.__dict__.update(copy.deepcopy(message.metadata.__dict__))
    return out


def messages_train() -> str:
    return messages.TRAIN


def nodes(k: int = 4) -> list[dict]:
    return [{"partition-id": i, "num-partitions": k} for i in range(k)]


def final(root, name):
    (path,) = (root / name).glob("*/checkpoints/last.ckpt")  # the run's own folder, logger or not
    return read_checkpoint(path)


def in_process(tmp_path, config, *extra) -> dict:
    args = ["fit", "--config", str(config), *SMALL, "--trainer.default_root_dir", str(tmp_path / "runs")]
    assert run_cli(*args, "--trainer.name", "inproc", *extra) == 0
    return final(tmp_path / "runs", "inproc")


# a LocalGrid answers while it takes the messages, so every reply that comes is there at the first pull: a
# dropped one need not be waited for long
QUICK = {"round_timeout": 0.05, "hello_timeout": 0.05}


def on_flower(tmp_path, config, grid, *extra, name="flower"):
    overrides = [*SMALL, "--trainer.default_root_dir", str(tmp_path / "runs"), "--trainer.name", name, *extra]
    trainer = serve(grid, str(config), overrides, wait_for_nodes=0, **QUICK)
    return trainer, final(tmp_path / "runs", name)


def assert_same_state(a: dict, b: dict) -> None:
    assert sorted(a["global_state"]) == sorted(b["global_state"])
    for name in a["global_state"]:
        assert torch.equal(a["global_state"][name], b["global_state"][name]), name


@pytest.mark.parametrize("config", ["quickstart.yaml", "fedavg_digits.yaml"])
def test_flower_transport_equals_in_process_bitwise(in_tmp, config):
    """Latent and full-weight FedAvg: same config, same seeds, same threads: the same global state, same bytes."""
    reference = in_process(in_tmp, CONFIGS / config)
    grid = LocalGrid(nodes())
    trainer, got = on_flower(in_tmp, CONFIGS / config, grid)
    assert_same_state(got, reference)
    assert torch.equal(got["ledger"]["up"], reference["ledger"]["up"])
    assert torch.equal(got["ledger"]["down"], reference["ledger"]["down"])
    # the transport's messages are logged beside the payloads, and carry them plus an overhead
    last = trainer.history[-1]
    assert last["comm/msg_client_up_bytes"] > last["comm/client_up_bytes"] > 0
    assert last["comm/msg_client_down_bytes"] > last["comm/client_down_bytes"] > 0
    assert torch.equal(got["ledger"]["msg_up"] > got["ledger"]["up"], torch.ones(4, dtype=torch.bool))
    # each node was introduced once (query) and trained twice; nothing else was sent
    types = [m.metadata.message_type for m in grid.sent]
    assert types.count(messages.HELLO) == 4 and types.count(messages.TRAIN) == 8


@pytest.mark.parametrize(
    "privacy",
    [
        pytest.param(["--trainer.privacy", "CentralDP", "--trainer.max_update_norm_ratio", "null"], id="central"),
        pytest.param(["--trainer.privacy", "LocalDP"], id="local"),
    ],
)
def test_private_rounds_on_flower_equal_in_process_bitwise(in_tmp, privacy):
    """Central DP runs in the ServerApp, local DP on each node inside run_client: the same noise, state and budget."""
    extra = [
        *privacy,
        "--trainer.privacy.noise_multiplier",
        "1.0",
        "--trainer.privacy.clip_norm",
        "0.5",
        "--trainer.privacy.noise_seed",
        "0",
    ]
    reference = in_process(in_tmp, CONFIGS / "quickstart.yaml", *extra)
    trainer, got = on_flower(in_tmp, CONFIGS / "quickstart.yaml", LocalGrid(nodes()), *extra)
    assert_same_state(got, reference)
    assert got["privacy"]["noise_multiplier"] == reference["privacy"]["noise_multiplier"] == 1.0
    eps = [h["privacy/epsilon"] for h in trainer.history[1:]]
    assert eps == [h["privacy/epsilon"] for h in reference["history"][1:]] and 0 < eps[0] < eps[1]


def test_record_level_dp_sgd_on_flower_equals_in_process_bitwise(in_tmp):
    """Each node runs DP-SGD inside run_client (built from the run's config): the same state and per-client budget."""
    extra = [
        "--trainer.dp_sgd",
        "lightning_fl.privacy.DPSGD",
        "--trainer.dp_sgd.noise_multiplier",
        "1.0",
        "--trainer.dp_sgd.noise_seed",
        "0",
    ]
    reference = in_process(in_tmp, CONFIGS / "quickstart.yaml", *extra)
    trainer, got = on_flower(in_tmp, CONFIGS / "quickstart.yaml", LocalGrid(nodes()), *extra)
    assert_same_state(got, reference)
    eps = [h["privacy/record_epsilon_max"] for h in trainer.history[1:]]
    assert eps == [h["privacy/record_epsilon_max"] for h in reference["history"][1:]] and 0 < eps[0] < eps[1]
    assert torch.equal(got["dp_sgd"]["participations"], reference["dp_sgd"]["participations"])


def test_nodes_report_their_dp_sgd_plans_to_the_servers_accountant(in_tmp):
    """Every node reports the record count and batch size it trained with; the server's accountant uses them (here
    node 1 reports batch size 16 where the config says 32, as a node with its own data settings would):
    dp-accounting's replace-one PLD accountant on the same numbers; the checkpoint keeps the reports. A report that
    is not two positive integers is named and the server's data module used instead."""
    import dp_accounting as dpa

    def batch(value):
        def tamper(reply, message):
            reply.content[messages.REPLY]["dp-sgd-batch-size"] = value
            return reply

        return tamper

    extra = [
        "--trainer.dp_sgd",
        "lightning_fl.privacy.DPSGD",
        "--trainer.dp_sgd.noise_multiplier",
        "1.0",
        "--trainer.dp_sgd.noise_seed",
        "0",
    ]
    with pytest.warns(UserWarning, match=r"round 1, client 2: its DP-SGD plan \(records \d+, batch size -4\) is not"):
        trainer, got = on_flower(
            in_tmp, CONFIGS / "quickstart.yaml", LocalGrid(nodes(), tamper={1: batch(16), 3: batch(-4)}), *extra
        )
    dp = trainer.local.dp_sgd
    rows = {row["client"]: row for row in dp.report()}
    assert dp.reported[0][1] == 16 and dp.reported[1][1] == 32 and 2 not in dp.reported
    for client, size in ((0, 16), (1, 32), (2, 32)):
        records = rows[client]["records"]
        steps = -(-records // size)  # one local epoch of expected batches
        assert rows[client]["sample_rate"] == size / records and rows[client]["steps_per_round"] == steps
        accountant = dpa.pld.PLDAccountant(neighboring_relation=dpa.NeighboringRelation.REPLACE_ONE)
        step = dpa.PoissonSampledDpEvent(size / records, dpa.GaussianDpEvent(1.0))
        accountant.compose(dpa.SelfComposedDpEvent(step, 2 * steps))
        assert rows[client]["epsilon"] == pytest.approx(accountant.get_epsilon(dp.delta), rel=2e-3)
    assert got["dp_sgd"]["reported"][:, 2].tolist() == [16, 32, 32]


def garbage(reply: Message, message: Message) -> Message:
    """A hostile node: replaces its payload bytes with junk."""
    reply.content[messages.REPLY]["payload"] = b"\x00junk" * 20
    return reply


def test_garbage_reply_is_rejected_and_the_run_goes_on(in_tmp):
    """A node replying junk bytes is named and dropped; the result equals dropping its upload in simulation."""
    # in simulation, NaNUpload makes client 2's upload fail the gate every round: the same as dropping it
    reference = in_process(
        in_tmp, CONFIGS / "quickstart.yaml", "--trainer.attack", "NaNUpload", "--trainer.attack.clients", "[2]"
    )
    grid = LocalGrid(nodes(), tamper={3: garbage})  # node 3 serves client 2
    with pytest.warns(UserWarning, match=r"round 2, client 2: upload rejected: malformed payload: not a lightning_fl"):
        trainer, got = on_flower(in_tmp, CONFIGS / "quickstart.yaml", grid)
    assert_same_state(got, reference)
    assert [h["fed/dropped_clients"] for h in trainer.history[1:]] == [1.0, 1.0]


def test_a_reply_that_makes_any_reader_raise_is_rejected_not_fatal(in_tmp, monkeypatch):
    """Whatever reading one reply raises (here an unexpected RuntimeError) rejects that reply, names it, and the
    run goes on: the same result as dropping client 2's upload."""
    reference = in_process(
        in_tmp, CONFIGS / "quickstart.yaml", "--trainer.attack", "NaNUpload", "--trainer.attack.clients", "[2]"
    )
    read = messages.read_reply

    def fragile(message):
        if message.metadata.src_node_id == 3:
            raise RuntimeError("a reader bug")
        return read(message)

    monkeypatch.setattr(messages, "read_reply", fragile)
    with pytest.warns(UserWarning, match=r"round 1, client 2: upload rejected: malformed reply \(RuntimeError: a"):
        _, got = on_flower(in_tmp, CONFIGS / "quickstart.yaml", LocalGrid(nodes()))
    assert_same_state(got, reference)


def test_a_declared_sample_count_is_capped_by_max_client_weight(in_tmp):
    """Sample-weighted FedAvg on Flower: without a cap the run warns that declared counts are taken as given; with
    ``trainer.max_client_weight`` a node claiming 2**62 samples weighs what a node declaring the cap weighs."""

    def declare(count):
        def tamper(reply, message):
            reply.content[messages.REPLY]["num-samples"] = count
            return reply

        return tamper

    weighted = ["--trainer.strategy.weighted", "true"]
    with pytest.warns(UserWarning, match="takes each node's declared sample count as given"):
        on_flower(in_tmp, CONFIGS / "quickstart.yaml", LocalGrid(nodes()), *weighted, name="uncapped")
    capped = [*weighted, "--trainer.max_client_weight", "1000"]
    with pytest.warns(
        UserWarning,
        match=r"client 2: declared 4611686018427387904 samples; its weight is capped at "
        r"trainer.max_client_weight=1000",
    ):
        _, got = on_flower(
            in_tmp, CONFIGS / "quickstart.yaml", LocalGrid(nodes(), tamper={3: declare(2**62)}), *capped, name="liar"
        )
    _, reference = on_flower(
        in_tmp, CONFIGS / "quickstart.yaml", LocalGrid(nodes(), tamper={3: declare(1000)}), *capped, name="honest"
    )
    assert_same_state(got, reference)


@pytest.mark.parametrize(
    "mutate",
    [
        lambda r: r.content[messages.REPLY].__setitem__("payload", "text, not bytes"),
        lambda r: r.content[messages.REPLY].__setitem__("num-samples", -5),
        lambda r: r.content.__delitem__(messages.REPLY),
        lambda r: r.content[messages.REPLY].__setitem__("failure", 5),
    ],
    ids=["payload-not-bytes", "negative-samples", "no-reply-record", "failure-not-text"],
)
def test_malformed_replies_are_rejected_not_fatal(in_tmp, mutate):
    def tamper(reply, message):
        out = mutate(reply)
        return out if isinstance(out, Message) else reply

    grid = LocalGrid(nodes(), tamper={1: tamper})
    with pytest.warns(UserWarning, match=r"client 0: upload rejected: malformed reply"):
        trainer, got = on_flower(in_tmp, CONFIGS / "quickstart.yaml", grid, "--trainer.rounds", "1")
    assert trainer.history[-1]["fed/dropped_clients"] == 1.0
    assert all(torch.isfinite(t).all() for t in got["global_state"].values())


def test_lost_node_misses_the_round_and_the_run_goes_on(in_tmp, caplog):
    """A node that stops answering in round 2 is counted lost; the other uploads are aggregated; no NaN."""
    calls = {"n": 0}

    def dies_in_round_2(reply, message):
        calls["n"] += 1
        return None if calls["n"] >= 2 else reply

    grid = LocalGrid(nodes(), tamper={2: dies_in_round_2})
    with pytest.warns(UserWarning, match=r"round 2: no reply from client\(s\) \[1\]"):
        trainer, got = on_flower(in_tmp, CONFIGS / "quickstart.yaml", grid)
    assert [h["fed/lost_clients"] for h in trainer.history[1:]] == [0.0, 1.0]
    assert trainer.history[-1]["fed/round_skipped"] == 0.0
    # the ServerApp's log says so, one line per round
    log = caplog.text
    assert "round 1: 4 of 4 sampled clients replied; 0 lost, 0 rejected; val/acc" in log
    assert "round 2: 3 of 4 sampled clients replied; 1 lost, 0 rejected" in log
    assert "upload 768 B payload in a " in log
    assert all(torch.isfinite(t).all() for t in got["global_state"].values())
    # its download was sent and counted, its upload never arrived
    assert got["ledger"]["up"].tolist() == [1536, 768, 1536, 1536]
    assert got["ledger"]["down"].tolist() == [1536, 1536, 1536, 1536]


def test_node_reported_unavailable_is_lost_then_rejoins(in_tmp):
    """The SuperLink answers for a vanished node (error NODE_UNAVAILABLE, sent under its own id): that client is
    lost for the round, and the node is introduced again when it is back."""
    from flwr.app import Error

    def unavailable_once(reply, message):
        if message.metadata.group_id != "1":
            return reply
        error = Message(Error(code=5, reason="Node Unavailable"), reply_to=message)
        error.metadata.__dict__["_src_node_id"] = 1  # the SuperLink's id, not the node's
        return error

    grid = LocalGrid(nodes(), tamper={4: unavailable_once})
    with pytest.warns(UserWarning, match=r"round 1: no reply from client\(s\) \[3\]"):
        trainer, _ = on_flower(in_tmp, CONFIGS / "quickstart.yaml", grid)
    assert [h["fed/lost_clients"] for h in trainer.history[1:]] == [1.0, 0.0]
    hellos = [m.metadata.dst_node_id for m in grid.sent if m.metadata.message_type == messages.HELLO]
    assert sorted(hellos) == [1, 2, 3, 4, 4]  # node 4 was forgotten, then introduced again


def test_node_that_cannot_build_the_run_is_named_once_and_left_out(in_tmp):
    """A node whose own overrides are wrong says why in its hello; the server warns once and never asks again."""
    configs = nodes()
    configs[2]["overrides"] = "--data.batch_sise 3"
    grid = LocalGrid(configs)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer, _ = on_flower(in_tmp, CONFIGS / "quickstart.yaml", grid)
    refusals = [str(w.message) for w in caught if "is not used" in str(w.message)]
    assert len(refusals) == 1 and "SuperNode 3 is not used: could not build the run" in refusals[0]
    assert "data.batch_sise" in refusals[0]
    assert [h["fed/lost_clients"] for h in trainer.history[1:]] == [1.0, 1.0]
    assert [m.metadata.dst_node_id for m in grid.sent].count(3) == 1


def test_node_trains_only_as_its_own_client(in_tmp):
    """A server (or a bug) asking node 1 (client 0) to train client 2 gets a refusal, not another client's update."""

    class Misrouting(LocalGrid):
        def deliver(self, messages_):
            for message in messages_:
                if messages.INSTRUCTIONS in message.content and message.metadata.dst_node_id == 1:
                    message.content[messages.INSTRUCTIONS]["client"] = 2
            return super().deliver(messages_)

    with pytest.warns(UserWarning, match=r"client 0: upload rejected: refused: asked to train client 2, but this node"):
        trainer, _ = on_flower(in_tmp, CONFIGS / "quickstart.yaml", Misrouting(nodes()), "--trainer.rounds", "1")
    assert trainer.history[-1]["fed/dropped_clients"] == 1.0


def test_node_with_other_factors_refuses_to_train(in_tmp):
    """A node whose model differs (factor seed) refuses; the server names it, and stops under upload_policy raise."""
    configs = nodes()
    configs[1]["overrides"] = "--model.init_args.factor_seed 7"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer, _ = on_flower(in_tmp, CONFIGS / "quickstart.yaml", LocalGrid(configs), "--trainer.rounds", "1")
    assert any("client 1: upload rejected: refused: model fingerprint" in str(w.message) for w in caught)
    assert trainer.history[-1]["fed/dropped_clients"] == 1.0
    with pytest.raises(UploadRejectedError, match="client 1"):
        on_flower(
            in_tmp, CONFIGS / "quickstart.yaml", LocalGrid(configs), "--trainer.upload_policy", "raise", name="raise"
        )


def test_server_restart_resumes_from_last_checkpoint(in_tmp):
    """Killed after round 1 and restarted with resume: auto, the run ends where an uninterrupted one does."""
    uninterrupted = in_process(in_tmp, CONFIGS / "quickstart.yaml")
    on_flower(in_tmp, CONFIGS / "quickstart.yaml", LocalGrid(nodes()), "--trainer.rounds", "1", name="restart")
    trainer, got = on_flower(
        in_tmp, CONFIGS / "quickstart.yaml", LocalGrid(nodes()), "--trainer.resume", "auto", name="restart"
    )
    assert [h["round"] for h in trainer.history] == [0, 1, 2]
    assert_same_state(got, uninterrupted)


def test_error_feedback_memory_stays_on_the_node(in_tmp):
    """TopK with error feedback: each node keeps its own residual; the result equals the simulation's."""
    extra = ["--trainer.codec", "TopK", "--trainer.codec.density", "0.25", "--model.init_args.latent_dim", "16"]
    reference = in_process(in_tmp, CONFIGS / "quickstart.yaml", *extra)
    grid = LocalGrid(nodes())
    _, got = on_flower(in_tmp, CONFIGS / "quickstart.yaml", grid, *extra)
    assert_same_state(got, reference)
    for context in grid.contexts.values():  # a node's memory holds its own client's residual, nobody else's
        memory = torch.load(io.BytesIO(context.state["lightning_fl.codec"]["state"]), weights_only=True)
        assert list(memory["residuals"]) == [str(context.node_config["partition-id"])]


def test_run_config_mistakes_get_one_line():
    with pytest.raises(ConfigError, match=r"unknown run config key\(s\) \['rounds'\]"):
        settings({"config": "x.yaml", "rounds": 3})
    with pytest.raises(ConfigError, match="run config 'config' must name a YAML file"):
        settings({})
    with pytest.raises(ConfigError, match="'round-timeout' must be a number of seconds"):
        settings({"config": "x.yaml", "round-timeout": -1})
    for bad in (float("nan"), float("inf")):
        with pytest.raises(ConfigError, match="'wait-for-nodes' must be a number of seconds"):
            settings({"config": "x.yaml", "wait-for-nodes": bad})
    assert settings({"config": "x.yaml", "round-timeout": 30})["round_timeout"] == 30.0


def test_a_run_that_stops_on_our_error_logs_one_line_and_no_traceback():
    """What ``flwr log`` shows when the ServerApp stops on a user error (as a run resumed on a SuperLink restarted
    without its database does, every node gone): our one line, then Flower's report of the exception the ServerApp
    raised (its run_serverapp logs it with ``exc_info``), with no traceback. The run still ends as failed."""
    import io
    import logging

    from flwr.common.logger import FLOWER_LOGGER, log

    from lightning_fl.errors import UserError
    from lightning_fl.flower import server

    why = "no sampled client replied in 2 attempts in a row at round 3; start the SuperNodes, then resume"

    def fit():
        raise UserError(why)

    stream, outcome = io.StringIO(), {}
    handler = logging.StreamHandler(stream)
    FLOWER_LOGGER.addHandler(handler)
    try:
        with pytest.raises(UserError) as raised:
            server._run(None, fit, outcome)
        log(logging.ERROR, "%s raised an exception", "ServerApp", exc_info=raised.value)  # as Flower's runtime does
    finally:
        FLOWER_LOGGER.removeHandler(handler)
    text = stream.getvalue()
    assert "Traceback" not in text and "File " not in text, text
    assert f"error: {why}" in text and str(raised.value) == why and str(outcome["error"]) == why


def test_the_app_declares_every_run_config_key_with_the_servers_default():
    """Flower refuses a `flwr run --run-config` key the app's pyproject.toml does not declare: every key the
    ServerApp reads is declared there, with the default the ServerApp uses when it is absent."""
    import tomllib

    from lightning_fl.flower.server import RUN_CONFIG

    declared = tomllib.loads((CONFIGS.parent / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]
    assert declared == RUN_CONFIG
    assert settings(declared) == settings({"config": RUN_CONFIG["config"]})


def test_every_wait_is_a_validated_run_config_key():
    got = settings({"config": "x.yaml", "hello-timeout": 300, "max-silent-rounds": 0})
    assert (got["hello_timeout"], got["max_silent_rounds"]) == (300.0, None)
    assert settings({"config": "x.yaml"})["max_silent_rounds"] == 3
    for bad in (float("nan"), -1, 0, "60"):
        with pytest.raises(ConfigError, match="'hello-timeout' must be a number of seconds"):
            settings({"config": "x.yaml", "hello-timeout": bad})
    for bad in (-1, 1.5, True):
        with pytest.raises(ConfigError, match="'max-silent-rounds' must be a whole number of rounds >= 0"):
            settings({"config": "x.yaml", "max-silent-rounds": bad})


def test_a_round_without_replies_is_not_done_and_runs_again_until_the_limit(in_tmp):
    """No sampled client replies (SuperNodes gone, e.g. after a SuperLink restart): the round is not done (nothing
    aggregated, released, accounted or saved) and runs again; after ``max-silent-rounds`` silent attempts the run
    stops with one error naming the nodes, its last completed round saved."""
    from lightning_fl.errors import UserError

    mute = dict.fromkeys(range(1, 5), lambda reply, message: None)
    overrides = [*SMALL, "--trainer.rounds", "3", "--trainer.default_root_dir", str(in_tmp / "runs")]
    mute_from_round_2 = {
        n: (lambda reply, message: None if message.metadata.group_id != "1" else reply) for n in range(1, 5)
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        gone = r"no sampled client replied in 2 attempts in a row at round 2 \(SuperNodes known: \[1, 2, 3, 4\]\)"
        with pytest.raises(UserError, match=gone + r".*checkpoint of round 1 is saved.*'max-silent-rounds'"):
            serve(
                LocalGrid(nodes(), tamper=mute_from_round_2),
                str(CONFIGS / "quickstart.yaml"),
                [*overrides, "--trainer.name", "gone"],
                wait_for_nodes=0,
                max_silent_rounds=2,
                **QUICK,
            )
        saved = final(in_tmp / "runs", "gone")
        assert saved["round"] == 1 and [h["round"] for h in saved["history"]] == [0, 1]
        with pytest.raises(UserError, match=r"in 3 attempts in a row at round 1 "):
            serve(
                LocalGrid(nodes(), tamper=mute),
                str(CONFIGS / "quickstart.yaml"),
                [*overrides, "--trainer.name", "never"],
                wait_for_nodes=0,
                max_silent_rounds=3,
                **QUICK,
            )
        assert not list((in_tmp / "runs" / "never").glob("*/checkpoints/last.ckpt"))  # no round was done


def test_nodes_that_come_back_finish_the_run_as_if_they_had_never_left_and_the_silence_spends_nothing(in_tmp):
    """Every node drops its first two train messages (two silent attempts of round 1) and then serves: with
    ``max-silent-rounds`` 0 (keep trying) the run ends with the same global state, history of rounds and epsilon as
    a run in process, bit for bit: the silent attempts released and accounted nothing."""
    seen = dict.fromkeys(range(1, 5), 0)

    def back_after_two(node):
        def tamper(reply, message):
            seen[node] += 1
            return None if seen[node] <= 2 else reply

        return tamper

    extra = [
        "--trainer.rounds",
        "3",
        "--trainer.privacy",
        "CentralDP",
        "--trainer.privacy.noise_multiplier",
        "1.0",
        "--trainer.privacy.noise_seed",
        "0",
        "--trainer.max_update_norm_ratio",
        "null",
    ]
    reference = in_process(in_tmp, CONFIGS / "quickstart.yaml", *extra)
    grid = LocalGrid(nodes(), tamper={n: back_after_two(n) for n in range(1, 5)})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        trainer = serve(
            grid,
            str(CONFIGS / "quickstart.yaml"),
            [*SMALL, *extra, "--trainer.default_root_dir", str(in_tmp / "runs"), "--trainer.name", "back"],
            wait_for_nodes=0,
            max_silent_rounds=None,
            **QUICK,
        )
    got = final(in_tmp / "runs", "back")
    assert_same_state(got, reference) and seen == dict.fromkeys(range(1, 5), 5)  # 2 dropped, then 3 rounds
    assert [h["privacy/epsilon"] for h in trainer.history[1:]] == [
        h["privacy/epsilon"] for h in reference["history"][1:]
    ]
    assert trainer.privacy.accountant.num_rounds == 3
    assert [h["fed/lost_clients"] for h in trainer.history[1:]] == [0] * 3


def test_a_timed_out_round_says_so_and_a_late_reply_is_never_another_rounds(in_tmp):
    """Node 2's round-1 reply is late: round 1 warns that it timed out, and when the stale reply comes back in
    round 2 in place of the real one, it is not taken as round 2's (the client is lost that round too)."""
    kept = {}

    def late(reply, message):
        if message.metadata.group_id == "1":
            kept["stale"] = reply
            return None
        return kept.pop("stale", reply)

    grid = LocalGrid(nodes(), tamper={2: late})
    overrides = [*SMALL, "--trainer.default_root_dir", str(in_tmp / "runs"), "--trainer.name", "late"]
    with pytest.warns(
        UserWarning,
        match=r"round 1: client\(s\) \[1\] did not reply: timed out after 1e-09 s; "
        r"raise run config 'round-timeout'",
    ):
        trainer = serve(grid, str(CONFIGS / "quickstart.yaml"), overrides, round_timeout=1e-9, wait_for_nodes=0)
    assert [h["fed/lost_clients"] for h in trainer.history[1:]] == [1.0, 1.0]


class SlowHello(LocalGrid):
    """Node 1's answer to its hello comes only once the first round's messages are out (after the wait for the
    answers has ended): it is still busy importing, as a ClientApp on a loaded machine is."""

    def __init__(self, node_configs, **kwargs) -> None:
        super().__init__(node_configs, **kwargs)
        self.held: dict[str, Message] = {}

    def push_messages(self, messages_):
        messages_ = list(messages_)
        ids = super().push_messages(messages_)
        if any(m.metadata.message_type == messages.TRAIN for m in messages_):
            self.store.update(self.held)
            self.held.clear()
        for m in messages_:
            if m.metadata.message_type == messages.HELLO and m.metadata.dst_node_id == 1 and not self.hellos(1)[1:]:
                self.held[m.metadata.message_id] = self.store.pop(m.metadata.message_id)
        return ids

    def hellos(self, node: int) -> list[Message]:
        return [m for m in self.sent if m.metadata.message_type == messages.HELLO and m.metadata.dst_node_id == node]


def test_a_node_slow_to_say_hello_is_named_and_joins_when_its_answer_comes_without_being_asked_again(in_tmp):
    """The wait for the nodes' answers ends without node 1's (``hello-timeout`` without progress): the run warns,
    naming the key, starts without client 0, takes node 1's answer when it comes and has client 0 from the next
    round on. Node 1 is asked once: asking again would only queue another ClientApp behind the first."""
    grid = SlowHello(nodes())
    with pytest.warns(
        UserWarning,
        match=r"client\(s\) \[0\] have no SuperNode yet: 1 connected SuperNode\(s\) "
        r"did not say which client they serve within run config 'hello-timeout' \(0.05 s without progress",
    ):
        trainer, _ = on_flower(in_tmp, CONFIGS / "quickstart.yaml", grid)
    assert [h["fed/lost_clients"] for h in trainer.history[1:]] == [1.0, 0.0]
    assert [len(grid.hellos(n)) for n in range(1, 5)] == [1, 1, 1, 1]


def test_server_refuses_a_non_federated_trainer(in_tmp):
    with pytest.raises(ConfigError, match="trainer.devices must be 1 on Flower"):
        serve(LocalGrid(nodes()), str(CONFIGS / "quickstart.yaml"), ["--trainer.devices", "2"])


# ------------------------------------------------------------------------------------------ secure aggregation
SECURE = [
    "--trainer.secure_aggregation",
    "lightning_fl.privacy.secure.SecureAggregation",
    "--trainer.secure_aggregation.clipping_range",
    "1.0",
    "--trainer.secure_aggregation.stage_timeout",
    "0.5",
    "--trainer.secure_aggregation.rounding_seed",
    "0",
    "--trainer.max_update_norm_ratio",
    "null",
]


def secagg_reply(key: str, change: Callable) -> Callable:
    """A node that rewrites (or, returning ``None``, withholds) its reply to the SecAgg+ stage whose reply holds
    ``key``: pk1 (setup), dsts (share keys), masked_params (masked upload), nids (unmask)."""
    from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS

    def tamper(reply: Message, message: Message) -> Message | None:
        if reply.has_content() and RECORD_KEY_CONFIGS in reply.content:
            record = reply.content.config_records[RECORD_KEY_CONFIGS]
            if key in record:
                return change(reply, record)
        return reply

    return tamper


@pytest.mark.parametrize("through", ["clientapp", "warm-workers"])
def test_secure_rounds_on_flower_equal_in_process_bitwise(in_tmp, through, request):
    """Flower's SecAgg+ between 4 nodes: the in-process secure run's state, budget of bytes and logged metrics; no
    upload crosses unmasked (every train reply is a SecAgg+ message with an empty payload). Through warm
    workers too: SecAgg+'s state between its stages lives in the node's context, which the worker sends back."""
    from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS

    reference = in_process(in_tmp, CONFIGS / "quickstart.yaml", *SECURE)
    configs = nodes()
    if through == "warm-workers":
        start = request.getfixturevalue("workers")
        for config in configs:
            config["worker"] = start(f"s{config['partition-id']}").path
    grid = LocalGrid(configs)
    trainer, got = on_flower(in_tmp, CONFIGS / "quickstart.yaml", grid, *SECURE)
    assert_same_state(got, reference)
    assert torch.equal(got["ledger"]["up"], reference["ledger"]["up"])
    assert (got["ledger"]["msg_up"] > got["ledger"]["up"]).all()  # 4 stages of keys, shares and masked vectors
    for key in ("train/loss", "fed/clients", "fed/dropped_clients"):
        assert [h.get(key) for h in trainer.history[1:]] == [h.get(key) for h in reference["history"][1:]], key
    train = [m for m in grid.sent if m.metadata.message_type == messages.TRAIN]
    assert len(train) == 2 * 4 * 4 and all(RECORD_KEY_CONFIGS in m.content for m in train)  # rounds x stages x nodes


def test_distributed_dp_under_secagg_on_flower_equals_in_process_bitwise(in_tmp):
    """Each node clips its update and adds its noise share before SecAgg+ masks it: the in-process run's state and
    budget (the server never sees a single noised update either)."""
    extra = [
        *SECURE,
        "--trainer.privacy",
        "lightning_fl.privacy.DistributedDP",
        "--trainer.privacy.noise_multiplier",
        "1.0",
        "--trainer.privacy.clip_norm",
        "0.5",
        "--trainer.privacy.noise_seed",
        "0",
    ]
    reference = in_process(in_tmp, CONFIGS / "quickstart.yaml", *extra)
    trainer, got = on_flower(in_tmp, CONFIGS / "quickstart.yaml", LocalGrid(nodes()), *extra)
    assert_same_state(got, reference)
    assert not any(k.startswith("train/") for h in trainer.history for k in h)  # the nodes' losses stay with them
    eps = [h["privacy/epsilon"] for h in trainer.history[1:]]
    assert eps == [h["privacy/epsilon"] for h in reference["history"][1:]] and 0 < eps[0] < eps[1]


DISTRIBUTED = [
    *("--trainer.privacy", "lightning_fl.privacy.DistributedDP", "--trainer.privacy.noise_multiplier", "1.0"),
    *("--trainer.privacy.clip_norm", "0.5", "--trainer.privacy.noise_seed", "0"),
    *("--trainer.max_update_norm_ratio", "null"),
]
PINNED = {"require-secure-aggregation": True, "require-privacy": "DistributedDP", "min-noise-multiplier": 1.0}


def noise_shares(monkeypatch) -> list[float]:
    """Record the standard deviation of every DistributedDP noise share a node adds: its update is clipped to
    nothing, so what it adds to the global state is its share, and with the noise seeded the share is
    ``std * g`` for the generator's own draw ``g``: ``std = <share, g> / <g, g>`` (exact up to float32)."""
    from lightning_fl.privacy import distributed
    from lightning_fl.privacy.base import flat_update, randomness
    from lightning_fl.seeding import STREAM_DISTRIBUTED_NOISE

    stds: list[float] = []
    real = distributed.DistributedDP.privatize

    def spy(self, state, global_state, client, round, seed):
        out = real(self, state, global_state, client, round, seed)
        share = flat_update(out, global_state)
        g = randomness(self.noise_seed, seed, round, client, STREAM_DISTRIBUTED_NOISE).randn(share.shape)
        stds.append(float(share @ g / (g @ g)))
        return out

    monkeypatch.setattr(distributed, "clip", lambda delta, bound, layers: (torch.zeros_like(delta), 0.0, 0))
    monkeypatch.setattr(distributed.DistributedDP, "privatize", spy)
    return stds


def announce(monkeypatch, num_clients: int) -> None:
    """A hostile server: every train message it sends states a federation of ``num_clients`` clients."""
    real = messages.train_content

    def hostile(arrays, round, seed, client, fingerprint, honest=0):
        return real(arrays, round, seed, client, fingerprint, num_clients)

    monkeypatch.setattr(messages, "train_content", hostile)


def test_a_server_announcing_a_huge_federation_cannot_shrink_a_pinned_nodes_noise_share(in_tmp, monkeypatch):
    """The red team's attack: a server whose train messages announce 10^8 clients (``num-clients``), to nodes that
    pin secure aggregation, DistributedDP and z >= 1. Each node sees 4 nodes in SecAgg+'s key sharing, so its share
    stays ``z S / sqrt(4) = 0.25`` (it was ``0.5 / sqrt(10^8) = 5e-5``, every pin passing)."""
    announce(monkeypatch, 10**8)
    stds = noise_shares(monkeypatch)
    configs = [{**c, **PINNED} for c in nodes()]
    on_flower(in_tmp, CONFIGS / "quickstart.yaml", LocalGrid(configs), *SECURE, *DISTRIBUTED)
    assert len(stds) == 2 * 4  # every node, every round: none refused, none shrunk
    assert stds == pytest.approx([0.25] * 8, rel=1e-4)


def test_a_nodes_noise_share_is_for_the_cohort_it_sees_in_secagg(in_tmp, monkeypatch):
    """The honest path: each node's share has ``std = z S / sqrt(m)`` for the round's real cohort, ``m = 4`` with
    every client in each round, 2 with ``clients_per_round 2``, and 3 when one of 4 nodes fails at SecAgg+'s
    setup (the protocol runs again with the other three, each adding a third of the noise's variance: the sum
    keeps the central noise, more than the server's accountant counts on)."""
    stds = noise_shares(monkeypatch)
    on_flower(in_tmp, CONFIGS / "quickstart.yaml", LocalGrid(nodes()), *SECURE, *DISTRIBUTED, name="all")
    assert stds == pytest.approx([0.5 / 4**0.5] * 8, rel=1e-4)
    stds.clear()
    two = ["--trainer.clients_per_round", "2"]
    on_flower(in_tmp, CONFIGS / "quickstart.yaml", LocalGrid(nodes()), *SECURE, *DISTRIBUTED, *two, name="two")
    assert stds == pytest.approx([0.5 / 2**0.5] * 4, rel=1e-4)
    stds.clear()
    grid = LocalGrid(nodes(), tamper={3: secagg_reply("pk1", _bad_key)})
    with pytest.warns(UserWarning, match="setup stage: malformed SecAgg"):
        on_flower(in_tmp, CONFIGS / "quickstart.yaml", grid, *SECURE, *DISTRIBUTED, name="three")
    # (each node trains twice a round: the first attempt halts at unmasking, nobody holding the dead node's shares)
    assert len(stds) >= 6 and stds == pytest.approx([0.5 / 3**0.5] * len(stds), rel=1e-4)


def test_a_node_that_pins_its_noise_checks_the_cohort_or_pins_the_largest(in_tmp, monkeypatch):
    """Without secure aggregation a node sees no cohort: one that pins DistributedDP's noise refuses such a run
    unless it pins max-cohort; then a server announcing 10^8 clients is refused, not served with less noise, and
    an honest run draws the share of its real cohort. A malformed max-cohort is named."""
    from lightning_fl.flower.pins import pin_problem

    plain = flower_node.build_node(_yaml(in_tmp, *DISTRIBUTED), {"partition-id": 0}).local
    assert pin_problem(plain, {"require-privacy": "DistributedDP"}) == (
        "this node pins require-privacy DistributedDP, and its DistributedDP share is for the round's cohort, which "
        "a node sees only in secure aggregation: pin max-cohort (the most clients a round) or "
        "require-secure-aggregation"
    )
    assert pin_problem(plain, {"min-noise-multiplier": 1.0}).startswith("this node pins min-noise-multiplier 1, and")
    assert pin_problem(plain, {"require-privacy": "DistributedDP", "max-cohort": 4}) is None
    assert pin_problem(plain, {}) is None  # (a node that pins nothing serves what the server describes)
    for bad in (0, "lots", 2.5, True):
        with pytest.raises(ValueError, match=f"node config max-cohort must be an integer >= 1 .*got {bad!r}"):
            pin_problem(plain, {"max-cohort": bad})
    stds = noise_shares(monkeypatch)
    pinned = [{**c, "require-privacy": "DistributedDP", "min-noise-multiplier": 1.0, "max-cohort": 4} for c in nodes()]
    on_flower(in_tmp, CONFIGS / "quickstart.yaml", LocalGrid(pinned), *DISTRIBUTED, name="honest")
    assert stds == pytest.approx([0.25] * 8, rel=1e-4)
    stds.clear()
    announce(monkeypatch, 10**8)
    hostile = [*DISTRIBUTED, "--trainer.unprotected_statistics", "true"]  # (a private run logs refusals only if asked)
    with pytest.warns(UserWarning, match="refused: this node pins max-cohort 4, and the run plans 100,000,000 clients"):
        trainer, _ = on_flower(in_tmp, CONFIGS / "quickstart.yaml", LocalGrid(pinned), *hostile, name="hostile")
    assert stds == [] and [h["unprotected/fed/dropped_clients"] for h in trainer.history[1:]] == [4.0, 4.0]


def _absent(tmp_path) -> dict:
    """The secure run with client 2's node missing: the sum of the other three (the reference for a dropped node)."""
    grid = LocalGrid([c for c in nodes() if c["partition-id"] != 2])
    with pytest.warns(UserWarning, match=r"client\(s\) \[2\] have no SuperNode yet: no SuperNode answered for them"):
        return on_flower(tmp_path, CONFIGS / "quickstart.yaml", grid, *SECURE, name="absent")[1]


def _junk_vector(reply, record):
    record["masked_params"] = [b"\x93NUMPY junk", b"junk"]
    return reply


def _float_vector(reply, record):
    import numpy as np
    from flwr.common import ndarray_to_bytes

    record["masked_params"] = [ndarray_to_bytes(np.ones(1)), ndarray_to_bytes(np.ones(7))]
    return reply


def _bad_key(reply, record):
    record["pk1"] = b"not a public key"
    return reply


def _uneven_shares(reply, record):
    record["ctxts"] = record["ctxts"][:-1]
    return reply


@pytest.mark.parametrize(
    ("key", "change", "why"),
    [
        pytest.param("pk1", _bad_key, "setup stage: malformed SecAgg\\+ reply: ValueError", id="setup-bad-key"),
        pytest.param(
            "dsts",
            _uneven_shares,
            "share keys stage: malformed SecAgg\\+ reply: dsts and ctxts",
            id="share-keys-uneven",
        ),
        pytest.param("masked_params", _junk_vector, "masked upload stage: malformed SecAgg\\+ reply", id="upload-junk"),
        pytest.param(
            "masked_params",
            _float_vector,
            "masked upload stage: malformed SecAgg\\+ reply: masked weight",
            id="upload-floats",
        ),
        pytest.param("masked_params", lambda reply, record: None, None, id="upload-withheld"),
    ],
)
def test_a_hostile_or_dropped_node_leaves_the_sum_of_the_others(in_tmp, key, change, why):
    """A node whose SecAgg+ reply is malformed (or missing) at setup, key sharing or the masked upload is dropped,
    never crashing the server: the round's sum is the other nodes' exactly (as if its node were absent)."""
    reference = _absent(in_tmp)
    grid = LocalGrid(nodes(), tamper={3: secagg_reply(key, change)})  # node 3 serves client 2
    if why is None:
        trainer, got = on_flower(in_tmp, CONFIGS / "quickstart.yaml", grid, *SECURE)
        assert [h["fed/lost_clients"] for h in trainer.history[1:]] == [1.0, 1.0]
    else:
        with pytest.warns(UserWarning, match=f"round 1, client 2: upload rejected: secure aggregation, {why}"):
            trainer, got = on_flower(in_tmp, CONFIGS / "quickstart.yaml", grid, *SECURE)
        assert [h["fed/dropped_clients"] for h in trainer.history[1:]] == [1.0, 1.0]
    assert_same_state(got, reference)


def test_a_node_that_spoils_every_secure_sum_it_is_in_is_named_and_left_out(in_tmp):
    """Node 3 (client 2) shifts its masked vector by M/2 (well-formed, so SecAgg+ cannot refuse it): each sum it is
    in comes back off the grid and its round keeps the global state; with 2 of 4 clients a round, the server names
    the one client in every invalid sum and in no valid one, leaves it out, and the rounds after aggregate."""
    import numpy as np
    from flwr.common import bytes_to_ndarray, ndarray_to_bytes

    def shifted(reply, record):
        factor, vector = (bytes_to_ndarray(b) for b in record["masked_params"])
        modulus = 2**32  # SecureAggregation's default modulus_range, which SECURE keeps
        vector = np.remainder(vector.astype(np.int64) + modulus // 2, modulus).astype(vector.dtype)
        record["masked_params"] = [ndarray_to_bytes(factor), ndarray_to_bytes(vector)]
        return reply

    grid = LocalGrid(nodes(), tamper={3: secagg_reply("masked_params", shifted)})
    with pytest.warns(UserWarning, match="secure aggregation failed") as caught:
        trainer, _ = on_flower(
            in_tmp,
            CONFIGS / "quickstart.yaml",
            grid,
            *SECURE,
            "--trainer.rounds",
            "10",
            "--trainer.clients_per_round",
            "2",
        )
    said = [str(w.message) for w in caught if "secure aggregation failed" in str(w.message)]
    left = [s for s in said if "client 2 alone was in all" in s and "left out of the secure rounds that follow" in s]
    assert len(left) == 1 and trainer.round_runner.collection.suspects.left_out == {2}
    when = int(left[0].split(":")[0].removeprefix("round "))
    spoiled = [int(s.split(":")[0].removeprefix("round ")) for s in said if "off the quantisation grid" in s]
    assert spoiled and max(spoiled) == when < 10  # no spoiled sum once it is left out
    later = [h for h in trainer.history if h["round"] > when]  # (a cohort of client 2 and one other has no sum:
    assert any(h["fed/round_skipped"] == 0 for h in later)  # SecAgg+ needs two nodes) the others aggregate again


@pytest.mark.parametrize(
    "change",
    [
        pytest.param(lambda reply, record: None, id="withheld"),
        pytest.param(lambda reply, record: record.__setitem__("shares", record["shares"][:-1]) or reply, id="uneven"),
    ],
)
def test_a_node_lost_after_its_masked_upload_still_counts(in_tmp, change):
    """A node that masked its upload and then drops (or sends malformed shares) at the unmask stage: SecAgg+
    rebuilds its mask from the others' shares, and its upload stays in the sum (the undisturbed secure run)."""
    reference = in_process(in_tmp, CONFIGS / "quickstart.yaml", *SECURE)
    grid = LocalGrid(nodes(), tamper={3: secagg_reply("nids", change)})
    trainer, got = on_flower(in_tmp, CONFIGS / "quickstart.yaml", grid, *SECURE)
    assert_same_state(got, reference)
    assert [h["fed/dropped_clients"] + h["fed/lost_clients"] for h in trainer.history[1:]] == [0.0, 0.0]


def test_nodes_refuse_what_their_own_run_does_not_ask_for(in_tmp):
    """A node runs SecAgg+ only with its own quantisation, and never uploads in the clear when its run is secure:
    a server whose setup differs gets no upload from it."""
    from lightning_fl.flower.secure import check_setup
    from lightning_fl.privacy.secure import SecureAggregation

    secure = SecureAggregation(clipping_range=1.0)
    good = {"clipping_range": 1.0, "target_range": 2**22, "mod_range": 2**32, "max_weight": 1.0}
    assert check_setup(good, secure) is None
    assert "clipping_range=8.0 (this node's is 1.0)" in check_setup({**good, "clipping_range": 8.0}, secure)
    # a node whose run is secure, asked for a plain round, refuses (a server may not switch secure aggregation off)
    grid, config = LocalGrid(nodes()), _yaml(in_tmp, *SECURE)
    grid.send_and_receive([Message(messages.hello_content(config), dst_node_id=1, message_type=messages.HELLO)])
    node = flower_node.build_node(config, grid.contexts[1].node_config)
    state = messages.state_to_record(node.model.federated_state())
    train = Message(
        messages.train_content(state, 0, 0, 0, node.fingerprint), dst_node_id=1, message_type=messages.TRAIN
    )
    (reply,) = grid.send_and_receive([train])
    payload, _, failure, _ = messages.read_reply(reply)
    assert payload is None and failure.startswith("refused: this run uploads through secure aggregation only")


def _yaml(tmp_path, *extra) -> str:
    from lightning_fl.cli import build

    args = ["fit", "--config", str(CONFIGS / "quickstart.yaml"), *SMALL, "--trainer.default_root_dir", str(tmp_path)]
    return build([*args, *extra]).config_yaml


@pytest.mark.parametrize(
    ("flag", "value", "why"),
    [
        ("--hello-timeout", "nan", "must be a finite number of seconds"),
        ("--round-timeout", "nan", "must be a finite number of seconds"),
        ("--max-silent-rounds", "-1", "must be a whole number >= 0"),
    ],
)
def test_the_simulation_entry_refuses_a_bad_wait_in_one_line(flag, value, why, capsys):
    from lightning_fl.flower.__main__ import main

    with pytest.raises(SystemExit) as exit_:
        main(["--config", str(CONFIGS / "quickstart.yaml"), flag, value])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"{flag} {why}" in err


def test_silent_attempts_count_in_a_row_and_a_completed_round_ends_the_streak():
    """``max-silent-rounds`` counts silent attempts in a row; any completed round (one where a client replied, or
    where simulated dropout asked nobody) starts the count again."""
    from lightning_fl.errors import UserError
    from lightning_fl.flower.transport import FlowerTransport

    transport = FlowerTransport(LocalGrid(nodes()), "", max_silent_rounds=2)
    nobody_asked = {
        "fed/clients": 4.0,
        "fed/unavailable_clients": 4.0,
        "fed/lost_clients": 0.0,
        "fed/dropped_clients": 0.0,
    }
    transport.silent_round(1, [0, 1, 2, 3])
    transport.finished_round(1, nobody_asked)
    transport.silent_round(2, [0, 1, 2, 3])
    with pytest.raises(UserError, match=r"no sampled client replied in 2 attempts in a row at round 2 "):
        transport.silent_round(2, [0, 1, 2, 3])


# ------------------------------------------------------------------------------------------ pushing and pulling
class Clock:
    """A virtual clock for :func:`exchange`: sleeping moves it, and replies arrive at set times."""

    def __init__(self, arrivals: dict[str, float]) -> None:
        self.now, self.arrivals, self.sleeps, self.pulled = 0.0, arrivals, [], []

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds

    def push_messages(self, out):
        return [m.metadata.message_id or None for m in out]

    def pull_messages(self, ids):
        self.pulled.append(sorted(ids))
        ready = [i for i in ids if self.arrivals.get(i, float("inf")) <= self.now]
        for i in ready:
            del self.arrivals[i]
        return [reply_to(i) for i in ready]


def reply_to(to: str) -> Message:
    reply = Message(RecordDict(), dst_node_id=1, message_type=messages.TRAIN)
    reply.metadata.__dict__["_reply_to_message_id"] = to
    return reply


def sent(*ids: str | None) -> list[Message]:
    out = []
    for i in ids:
        message = Message(RecordDict(), dst_node_id=1, message_type=messages.TRAIN)
        message.metadata.__dict__["_message_id"] = i or ""
        out.append(message)
    return out


@pytest.fixture
def clock(monkeypatch):
    from lightning_fl.flower import transport

    made = Clock({})
    monkeypatch.setattr(transport.time, "sleep", made.sleep)
    monkeypatch.setattr(transport.time, "monotonic", lambda: made.now)
    return made


def test_replies_are_pulled_within_a_fifth_of_a_second_not_flowers_three(clock):
    """The first pull follows the push at once, then every 10 ms doubling to 200 ms; a message the SuperLink did
    not take is not waited for; a round ends when its last reply is in."""
    from lightning_fl.flower.transport import exchange

    clock.arrivals.update({"a": 0.0, "b": 1.0})
    replies = exchange(clock, sent("a", "b", None), timeout=None)
    assert sorted(r.metadata.reply_to_message_id for r in replies) == ["a", "b"]
    assert clock.sleeps[:5] == pytest.approx([0.01, 0.02, 0.04, 0.08, 0.16]) and max(clock.sleeps) == 0.2
    assert clock.pulled[0] == ["a", "b"] and clock.pulled[1:] == [["b"]] * (len(clock.pulled) - 1)
    assert 1.0 <= clock.now < 1.2  # b came at 1 s and was pulled within one longest poll


def test_an_exchange_ends_at_its_timeout_with_what_came(clock):
    from lightning_fl.flower.transport import exchange

    clock.arrivals.update({"a": 0.5})
    replies = exchange(clock, sent("a", "b"), timeout=2.0)
    assert [r.metadata.reply_to_message_id for r in replies] == ["a"]
    assert clock.now == pytest.approx(2.0)  # the last sleep is cut to the deadline
    assert exchange(clock, [], timeout=None) == [] and exchange(clock, sent(None), timeout=None) == []


# ------------------------------------------------------------------------------------------ warm workers
@pytest.fixture
def workers():
    """Start warm workers (threads of this process, on real Unix sockets in a short private folder); stop them."""
    import tempfile
    import threading

    from lightning_fl.flower.worker import Worker

    folder = tempfile.mkdtemp(prefix="lfl-", dir="/tmp")
    started = []

    def start(name: str = "node", **kwargs) -> Worker:
        worker = Worker(f"{folder}/{name}.sock", **kwargs)
        thread = threading.Thread(target=worker.serve_forever, daemon=True)
        thread.start()
        started.append((worker, thread))
        return worker

    yield start
    for worker, thread in started:
        worker.close()
        thread.join(timeout=10)
    import shutil

    shutil.rmtree(folder, ignore_errors=True)


def test_the_proxy_clientapp_imports_no_torch():
    """What Flower starts per message imports Flower and our proxy only: no torch, no Lightning."""
    import subprocess
    import sys

    probe = (
        "import sys, lightning_fl.flower.client, lightning_fl.flower.worker; "
        "print(sorted(m for m in ('torch', 'lightning', 'numpy.linalg', 'lightning_fl.flower.node') "
        "if m in sys.modules and m != 'numpy.linalg'))"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_a_run_through_warm_workers_equals_in_process_bitwise(in_tmp, workers):
    """Each node's messages go through the proxy ClientApp to its own worker (real sockets, Flower's protobuf
    encoding both ways, the context's state sent back): the same global state and bytes as one process."""
    reference = in_process(in_tmp, CONFIGS / "quickstart.yaml")
    configs = nodes()
    served = []
    for config in configs:
        served.append(workers(f"node{config['partition-id']}"))
        config["worker"] = served[-1].path
    _, got = on_flower(in_tmp, CONFIGS / "quickstart.yaml", LocalGrid(configs))
    assert_same_state(reference, got)
    assert torch.equal(reference["ledger"]["up"], got["ledger"]["up"])
    assert [w.served for w in served] == [3, 3, 3, 3]  # a hello and two rounds each


def test_the_codec_memory_lives_in_the_nodes_context_across_workers(in_tmp, workers):
    """Error feedback (top-k's residual) is kept in Flower's context, not in the worker: a node whose worker is
    replaced between rounds ends where a node without a worker does."""
    extra = ["--trainer.codec", "lightning_fl.compress.TopK", "--trainer.codec.density", "0.05"]
    reference = in_process(in_tmp, CONFIGS / "fedavg_digits.yaml", *extra)
    configs = nodes()
    first = {c["partition-id"]: workers(f"a{c['partition-id']}") for c in configs}
    for config in configs:
        config["worker"] = first[config["partition-id"]].path

    class Replaced(LocalGrid):
        def deliver(self, messages_):
            if messages_ and messages_[0].metadata.group_id == "2":  # new workers (empty caches) for round 2
                for context in self.contexts.values():
                    part = context.node_config["partition-id"]
                    context.node_config["worker"] = workers(f"b{part}").path
            return super().deliver(messages_)

    grid = Replaced(configs)
    _, got = on_flower(in_tmp, CONFIGS / "fedavg_digits.yaml", grid, *extra)
    assert_same_state(reference, got)
    assert all(w.served == 2 for w in first.values())  # the hello and round 1; round 2 went to the new ones
    assert any("lightning_fl.codec" in c.state for c in grid.contexts.values())


def test_a_worker_serves_its_own_user_only_and_survives_bad_requests(workers, monkeypatch):
    import os
    import socket
    import stat

    from lightning_fl.flower import worker as w

    calls = []

    def echo(message, context):
        calls.append(message.metadata.message_type)
        context.state["seen"] = flwr.app.ConfigRecord({"n": len(calls)})
        if message.metadata.group_id == "boom":
            raise RuntimeError("refused: not this round")
        return Message(RecordDict({"r": flwr.app.ConfigRecord({"ok": 1})}), reply_to=message)

    worker = workers(app=echo, max_frame=1 << 20)
    assert stat.S_IMODE(os.stat(worker.path).st_mode) == 0o600

    def request(group="1"):
        message = sent("m1")[0]
        message.metadata.__dict__["_group_id"] = group
        context = Context(run_id=1, node_id=1, node_config={"partition-id": 0}, state=RecordDict(), run_config={})
        return message, context

    message, context = request()
    reply = w.forward(worker.path, message, context)
    assert reply.content["r"]["ok"] == 1 and reply.metadata.reply_to_message_id == "m1"
    assert context.state["seen"]["n"] == 1  # the state the app left comes back
    # the app's exception is raised in the proxy (Flower turns it into the node's error reply)
    with pytest.raises(w.WorkerError, match="RuntimeError: refused: not this round"):
        w.forward(worker.path, *request("boom"))
    # garbage, another protocol, an oversized frame, a peer that hangs up: answered or dropped; serving goes on
    for frames in ([b"nope", b"x", b"y"], [w.VERSION, b"\xff\xff", b""], [w.VERSION, b"x" * (2 << 20), b""]):
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.connect(worker.path)
            try:
                w.send_frames(conn, *frames)
                (status,) = w.read_frames(conn, 1)
            except OSError:  # (the oversized frame: the worker answers and closes before reading it all)
                continue
            assert status == w.ERROR
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.connect(worker.path)
        conn.sendall(w.HEADER.pack(100) + b"cut")
    assert w.forward(worker.path, *request()).content["r"]["ok"] == 1
    # another user's process gets nothing
    with monkeypatch.context() as patch:
        patch.setattr(w, "_peer_uid", lambda conn: os.getuid() + 1)
        with pytest.raises(w.WorkerError, match="stopped answering"):
            w.forward(worker.path, *request())
    assert w.forward(worker.path, *request()).content["r"]["ok"] == 1
    deadline = time.monotonic() + 10  # the worker counts a reply after sending it: wait for its thread
    while worker.served < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert worker.served == 3 and calls == ["train"] * 4


def test_the_proxy_talks_only_to_its_own_users_worker_and_says_how_to_start_one(workers, monkeypatch, tmp_path):
    import os

    from lightning_fl.flower import worker as w

    message = sent("m1")[0]
    context = Context(run_id=1, node_id=1, node_config={}, state=RecordDict(), run_config={})
    with pytest.raises(
        w.WorkerError,
        match=r"no worker socket there.*python -m lightning_fl.flower.worker "
        r"--socket /nowhere/x.sock",
    ):
        w.forward("/nowhere/x.sock", message, context)
    worker = workers(app=lambda m, c: Message(RecordDict(), reply_to=m))
    with monkeypatch.context() as patch:
        other = os.getuid() + 1
        patch.setattr(w.os, "getuid", lambda: other)
        with pytest.raises(w.WorkerError, match="not a socket owned by this node's user"):
            w.forward(worker.path, message, context)
    # a live worker's socket is not taken over; a regular file is not replaced
    with pytest.raises(w.WorkerError, match="another worker already serves"):
        w.Worker(worker.path, app=lambda m, c: m)
    (tmp_path / "f.sock").write_text("mine")
    with pytest.raises(w.WorkerError, match="exists and is not a socket"):
        w.Worker(str(tmp_path / "f.sock"), app=lambda m, c: m)


def test_a_node_whose_worker_is_missing_is_named_and_left_out(in_tmp):
    configs = nodes()
    configs[1]["worker"] = "/nowhere/node1.sock"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer, _ = on_flower(in_tmp, CONFIGS / "quickstart.yaml", LocalGrid(configs))
    refusals = [str(w.message) for w in caught if "is not used" in str(w.message)]
    assert len(refusals) == 1 and "SuperNode 2 is not used: it failed to start" in refusals[0]
    assert "node config worker='/nowhere/node1.sock'" in refusals[0]
    assert [h["fed/lost_clients"] for h in trainer.history[1:]] == [1.0, 1.0]


def test_a_node_pins_secure_aggregation_and_its_noise_and_no_server_message_switches_them_off(in_tmp):
    """The red team's move: a node serving a secure run gets a second hello without secure aggregation. A node
    that pins require-secure-aggregation refuses that hello and keeps serving the secure run (a plain train
    message is refused, nothing uploaded in the clear); require-privacy and min-noise-multiplier refuse a run
    without that mechanism or with less noise; a malformed pin is named."""
    from lightning_fl.flower.pins import pin_problem

    secure_yaml, plain_yaml = _yaml(in_tmp, *SECURE), _yaml(in_tmp)
    pinned = {"partition-id": 0, "num-partitions": 4, "require-secure-aggregation": True}
    grid = LocalGrid([pinned])

    def hello(config):
        (reply,) = grid.send_and_receive(
            [Message(messages.hello_content(config), dst_node_id=1, message_type=messages.HELLO)]
        )
        return reply.content[messages.RUN]["refusal"]

    assert hello(secure_yaml) == ""
    assert hello(plain_yaml) == (
        "refused: this node pins require-secure-aggregation, and the run does not set trainer.secure_aggregation"
    )
    assert grid.contexts[1].state[messages.RUN]["config"] == secure_yaml  # the refused hello changed nothing
    node = flower_node.build_node(secure_yaml, pinned)
    state = messages.state_to_record(node.model.federated_state())
    train = Message(
        messages.train_content(state, 0, 0, 0, node.fingerprint), dst_node_id=1, message_type=messages.TRAIN
    )
    (reply,) = grid.send_and_receive([train])
    payload, _, failure, _ = messages.read_reply(reply)
    assert payload is None and failure.startswith("refused: this run uploads through secure aggregation only")
    # the checks themselves, on the runs' client sides
    local_yaml = _yaml(in_tmp, "--trainer.privacy", "LocalDP", "--trainer.privacy.noise_multiplier", "0.5")
    local = flower_node.build_node(local_yaml, {"partition-id": 0}).local
    plain = flower_node.build_node(plain_yaml, {"partition-id": 0}).local
    assert pin_problem(plain, {"require-privacy": "LocalDP"}) == (
        "this node pins require-privacy LocalDP, and the run's client-side trainer.privacy is none"
    )
    assert pin_problem(local, {"require-privacy": "LocalDP"}) is None
    assert pin_problem(local, {"require-privacy": "LocalDP", "min-noise-multiplier": 1.0}) == (
        "this node pins min-noise-multiplier 1, and the run's trainer.privacy noise multiplier is 0.5"
    )
    assert pin_problem(plain, {"min-noise-multiplier": 1.0}).endswith("the run adds no noise on the client")
    assert pin_problem(local, {"require-privacy": "DPSGD"}).endswith("the run does not set trainer.dp_sgd")
    with pytest.raises(ValueError, match="node config require-privacy must be one of LocalDP, DistributedDP, DPSGD"):
        pin_problem(local, {"require-privacy": "CentralDP"})
    bad = LocalGrid([{"partition-id": 0, "min-noise-multiplier": "lots"}])
    (reply,) = bad.send_and_receive(
        [Message(messages.hello_content(plain_yaml), dst_node_id=1, message_type=messages.HELLO)]
    )
    refusal = reply.content[messages.RUN]["refusal"]
    assert "node config min-noise-multiplier must be a number >= 0, got 'lots'" in refusal


def test_the_serverapp_draws_central_dp_cohorts_from_the_os_as_in_process(in_tmp):
    """On Flower the ServerApp samples with the trainer's rule: under CentralDP with noise_seed null (the default)
    its cohorts come from the operating system's secure generator, not from the run's seed."""
    extra = [
        "--trainer.privacy",
        "CentralDP",
        "--trainer.privacy.noise_multiplier",
        "1.0",
        "--trainer.max_update_norm_ratio",
        "null",
        "--trainer.clients_per_round",
        "2",
    ]
    trainer, _ = on_flower(in_tmp, CONFIGS / "quickstart.yaml", LocalGrid(nodes()), *extra)
    assert trainer.round_runner.settings.secret_cohorts and trainer.privacy.noise_seed is None
    seeded, _ = on_flower(
        in_tmp,
        CONFIGS / "quickstart.yaml",
        LocalGrid(nodes()),
        *extra,
        "--trainer.privacy.noise_seed",
        "0",
        name="seeded",
    )
    assert not seeded.round_runner.settings.secret_cohorts
