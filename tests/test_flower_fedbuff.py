"""FedBuff on Flower (``trainer.buffered`` over the Flower transport): the same buffered policy fed by the nodes'
replies as they come, against the in-process run replaying the same order of arrivals.

:class:`LaggingGrid` answers each train message at once (the real ClientApp, in this process) but keeps the reply
in the SuperLink's store, unseen, for a number of pulls set per node, so replies arrive out of order and updates
grow stale, deterministically. It also fails the test if a node ever has two train messages out.
"""

from __future__ import annotations

import itertools
import warnings

import pytest
import torch

flwr = pytest.importorskip("flwr")

from flwr.app import Error, Message  # noqa: E402
from flwr.common.constant import ErrorCode  # noqa: E402
from test_flower import SMALL, LocalGrid, final, nodes, task_identity  # noqa: E402, F401

from conftest import CONFIGS, run_cli  # noqa: E402
from lightning_fl.errors import UserError  # noqa: E402
from lightning_fl.federated.arrivals import Buffered  # noqa: E402
from lightning_fl.federated.arrivals.sources import Replayed  # noqa: E402
from lightning_fl.flower import messages  # noqa: E402
from lightning_fl.flower.server import serve  # noqa: E402

#: FedBuff with 3 of 4 clients training and a step every 2 updates, 5 steps; the clock is for the in-process side
#: (the ServerApp drops it: the replies arrive when they do).
FEDBUFF = [
    "--trainer.rounds",
    "5",
    "--trainer.buffered",
    "FedBuff",
    "--trainer.buffered.concurrency",
    "3",
    "--trainer.buffered.buffer_size",
    "2",
    "--trainer.clock",
    "Clock",
]
#: Pulls each node's successive replies wait (cycled): node 1 answers at once, node 3 late and later.
LAGS = {1: [0], 2: [2, 0], 3: [4, 6, 1], 4: [1, 3]}


class LaggingGrid(LocalGrid):
    """A :class:`LocalGrid` whose train replies wait ``lags[node]`` pulls (its successive messages cycle through the
    list) before a pull can see them; ``crash_at``: the server version (1-based, as sent) whose first pull raises, as
    a server killed in the middle of that step would stop."""

    def __init__(self, node_configs, lags, crash_at: int | None = None, tamper=None) -> None:
        super().__init__(node_configs, tamper)
        self.lags = {node: itertools.cycle(lag) for node, lag in lags.items()}
        self.crash_at = crash_at
        self.held: dict[str, list] = {}  # message id -> [pulls left, the reply]
        self.out: dict[int, str] = {}  # node -> the id of its train message out
        self.trains: list[tuple[int, int]] = []  # (node, round as sent: the server version + 1)
        self.down_bytes: dict[tuple[int, str], int] = {}  # (node, message id) -> bytes of its train message
        self.up_bytes: dict[tuple[int, str], int] = {}  # the same for each train reply pulled

    def push_messages(self, messages_):
        messages_ = list(messages_)
        for m in messages_:
            if m.metadata.message_type == messages.TRAIN:
                node = m.metadata.dst_node_id
                assert node not in self.out, f"node {node} was sent a second message while one is out"
                self.trains.append((node, int(m.metadata.group_id)))
        ids = super().push_messages(messages_)
        for m in messages_:
            if m.metadata.message_type == messages.TRAIN and m.metadata.message_id in self.store:
                node = m.metadata.dst_node_id
                self.out[node] = m.metadata.message_id
                self.down_bytes[node, m.metadata.message_id] = messages.message_bytes(m)
                self.held[m.metadata.message_id] = [next(self.lags[node]), self.store.pop(m.metadata.message_id)]
        return ids

    def pull_messages(self, message_ids):
        if self.crash_at is not None and any(version >= self.crash_at for _, version in self.trains):
            raise KeyboardInterrupt("the server is killed")
        for message_id, held in list(self.held.items()):
            if held[0] <= 0:
                self.store[message_id] = self.held.pop(message_id)[1]
            held[0] -= 1
        got = super().pull_messages(message_ids)
        for reply in got:
            answered = reply.metadata.reply_to_message_id
            for node in [n for n, i in self.out.items() if i == answered]:
                del self.out[node]
                self.up_bytes[node, answered] = messages.message_bytes(reply)
        return got


def on_flower(tmp, grid, *extra, name="flower", quiet=True):
    overrides = [*SMALL, *FEDBUFF, "--trainer.default_root_dir", str(tmp / "runs"), "--trainer.name", name, *extra]
    with warnings.catch_warnings():
        if quiet:
            warnings.simplefilter("ignore", UserWarning)
        trainer = serve(
            grid, str(CONFIGS / "quickstart.yaml"), overrides, round_timeout=60.0, hello_timeout=5, wait_for_nodes=0
        )
    return trainer, final(tmp / "runs", name)


def replayed(tmp, monkeypatch, order, name="replayed"):
    """The same config in process, its arrivals in ``order`` (:class:`Replayed`)."""
    from lightning_fl.federated.trainer import loop

    def replaying(settings, local, target):
        return Buffered(settings.buffered, settings.clock, local, Replayed(order))

    monkeypatch.setattr(loop, "round_arrivals", replaying)
    args = ["fit", "--config", str(CONFIGS / "quickstart.yaml"), *SMALL, *FEDBUFF]
    assert run_cli(*args, "--trainer.default_root_dir", str(tmp / "runs"), "--trainer.name", name) == 0
    return final(tmp / "runs", name)


def arrived(checkpoint) -> list[tuple[int, int]]:
    return [tuple(row) for row in checkpoint["buffered"]["arrived"].tolist()]


def test_fedbuff_on_flower_equals_the_in_process_run_replaying_its_arrivals(in_tmp, monkeypatch):
    """Five FedBuff steps over four nodes whose replies come out of order: every step folds the first two replies
    pulled, discounted by their staleness; three clients train at every moment, a node never has two messages out.
    The in-process run replaying the recorded order starts the same clients from the same states and ends at the
    same global state, bit for bit (the same float32 training and float64 folds; the test allows float32 rounding,
    1e-6 absolute, which it does not need), with the same payload bytes in the ledger."""
    grid = LaggingGrid(nodes(), LAGS)
    _, got = on_flower(in_tmp, grid)
    order = arrived(got)
    steps = got["history"][1:]
    assert len(order) == 10 and len(steps) == 5
    assert max(h["fed/staleness_max"] for h in steps) >= 2  # the lags made updates stale
    assert [h["fed/aggregated_clients"] for h in steps] == [2.0] * 5
    # every train message is one start (fed/clients), each from the version it names; the one still out at the end
    # is the in-flight count
    assert len(grid.trains) == sum(h["fed/clients"] for h in steps) and steps[-1]["fed/in_flight"] == len(grid.out)
    reference = replayed(in_tmp, monkeypatch, order)
    assert arrived(reference) == order
    for n, value in reference["global_state"].items():
        torch.testing.assert_close(got["global_state"][n], value, rtol=0, atol=1e-6)
        assert torch.equal(got["global_state"][n], value), n
    assert torch.equal(got["ledger"]["up"], reference["ledger"]["up"])
    assert torch.equal(got["ledger"]["down"], reference["ledger"]["down"])
    assert [h["fed/clients"] for h in steps] == [h["fed/clients"] for h in reference["history"][1:]]
    # every message counted once: each train message sent in the step that sent it, each reply in the step that
    # aggregated it (those pulled but not yet aggregated wait in the checkpoint, with their size)
    waiting = sum(f["message_up"] for f in got["buffered"]["in_flight"] if f["arrived"])
    for direction, sizes in (("msg_down", grid.down_bytes), ("msg_up", grid.up_bytes)):
        assert int(got["ledger"][direction].sum()) == sum(sizes.values()) - (waiting if direction == "msg_up" else 0)
        for client in range(4):
            counted = sum(size for (node, _), size in sizes.items() if node == client + 1)
            assert int(got["ledger"][direction][client]) <= counted and counted > 0


def test_a_node_that_leaves_mid_training_frees_its_slot_and_its_download_is_counted(in_tmp):
    """Node 1's first train reply (it answers at once: in the step that sent it) is the SuperLink's "node
    unavailable": that flight is lost (``fed/lost_clients``), never aggregated; its slot starts another client, the
    node is introduced again and trains later, and the run still steps every two updates. The lost flight's download
    is in the ledger of the step that sent it."""

    def leaves_once(reply, message):
        if not seen:
            seen.append(message.metadata.message_id)
            return Message(Error(code=ErrorCode.NODE_UNAVAILABLE, reason="gone"), reply_to=message)
        return reply

    seen: list[str] = []
    grid = LaggingGrid(nodes(), LAGS, tamper={1: leaves_once})
    with pytest.warns(UserWarning, match=r"step 1: client\(s\) \[0\] left before replying"):
        _, got = on_flower(in_tmp, grid, quiet=False)
    steps = got["history"][1:]
    assert sum(h["fed/lost_clients"] for h in steps) == 1 and [h["fed/aggregated_clients"] for h in steps] == [2] * 5
    assert steps[0]["fed/lost_clients"] == 1 and sum(1 for node, _ in grid.trains if node == 1) >= 2  # (back later)
    assert int(got["ledger"]["msg_down"].sum()) == sum(grid.down_bytes.values())
    # node 1 (client 0): every message it was sent is the lost one, an update aggregated, or still out at the end
    sent = sum(1 for node, _ in grid.trains if node == 1)
    aggregated = sum(1 for client, _ in arrived(got) if client == 0)
    assert sent == 1 + aggregated + sum(1 for f in got["buffered"]["in_flight"] if f["client"] == 0)


def test_a_fedbuff_server_killed_mid_step_resumes_from_its_checkpoint(in_tmp, monkeypatch):
    """The ServerApp dies in the middle of step 3 (a pull raises); a new one resumes from step 2's checkpoint, sends
    the clients that were still out their messages again (the same version's state: the same upload) and finishes.
    The whole run, its order of arrivals read from the last checkpoint, equals the in-process replay of that order."""
    first = LaggingGrid(nodes(), LAGS, crash_at=3)
    with pytest.raises(KeyboardInterrupt):
        on_flower(in_tmp, first, name="killed")
    saved = final(in_tmp / "runs", "killed")
    assert saved["round"] == 2
    out = sorted((f["client"], f["version"]) for f in saved["buffered"]["in_flight"] if not f["arrived"])
    assert out, "no message was out at the checkpoint: nothing to send again"
    second = LaggingGrid(nodes(), LAGS)
    _, got = on_flower(in_tmp, second, "--trainer.resume", "true", name="killed")
    resent = sorted((node - 1, version - 1) for node, version in second.trains if version <= 2)
    assert resent == out  # sent again, each from the version it started from
    assert got["round"] == 5 and arrived(got)[: len(arrived(saved))] == arrived(saved)
    reference = replayed(in_tmp, monkeypatch, arrived(got))
    for n, value in reference["global_state"].items():
        torch.testing.assert_close(got["global_state"][n], value, rtol=0, atol=1e-6)


def test_fedbuff_on_flower_refuses_what_it_cannot_serve_in_one_line(in_tmp):
    """A quorum (synchronous k-of-n rounds) and FedBuff; DP with FedBuff (its accountant's sampling assumption): one
    line each, naming the key and the fix, before any message is sent."""
    grid = LaggingGrid(nodes(), LAGS)
    cases = [
        ({"quorum": 2}, [], "run config 'quorum' 2 closes synchronous rounds at k of n, and trainer.buffered steps"),
        (
            {},
            ["--trainer.privacy", "CentralDP", "--trainer.privacy.noise_multiplier", "1.0"],
            "trainer.privacy's accountant and fixed denominator assume that a round's uploads are that round's own "
            r"sample .*: remove trainer.privacy or trainer.buffered",
        ),
        (
            {},
            ["--trainer.dp_sgd", "DPSGD", "--trainer.dp_sgd.noise_multiplier", "1.0"],
            "trainer.dp_sgd's per-client accounting counts each client in the round",
        ),
    ]
    for kwargs, extra, message in cases:
        overrides = [*SMALL, *FEDBUFF, *extra]
        with pytest.raises(UserError, match=message) as err:  # (a ConfigError, or the build's line: exit code 2)
            serve(grid, str(CONFIGS / "quickstart.yaml"), overrides, wait_for_nodes=0, **kwargs)
        assert "\n" not in str(err.value)
    assert not grid.sent


def test_fedbuff_with_dp_exits_2_with_one_line(in_tmp, capsys):
    """The command line: FedBuff with central DP stops before any work with exit code 2 and one line (then the
    command line's usual hint on --print_config and --help)."""
    args = ["fit", "--config", str(CONFIGS / "quickstart.yaml"), *SMALL, *FEDBUFF]
    privacy = ["--trainer.privacy", "CentralDP", "--trainer.privacy.noise_multiplier", "1.0"]
    assert run_cli(*args, *privacy) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[0].startswith("error: fit: could not build the config: trainer.privacy's accountant"), err
    assert err[0].endswith("remove trainer.privacy or trainer.buffered") and err[1:] == [err[-1]], err  # (+ the hint)


class SlowHello(LaggingGrid):
    """A :class:`LaggingGrid` whose SuperLink lists no node for its first ``after`` calls (nodes still starting)."""

    def __init__(self, node_configs, lags, after: int) -> None:
        super().__init__(node_configs, lags)
        self.after, self.calls = after, 0

    def get_node_ids(self):
        self.calls += 1
        return list(self.contexts) if self.calls > self.after else []


def test_fedbuff_asks_nodes_again_until_one_serves_a_client_and_stops_in_one_line_when_none_does(in_tmp):
    """No node is known when the first step would start: the ServerApp asks again (up to run config
    'max-silent-rounds' times) and runs once they answer; when none ever does it stops with one line."""
    grid = SlowHello(nodes(), LAGS, after=2)
    _, got = on_flower(in_tmp, grid)
    assert got["round"] == 5 and grid.calls > 3
    never = SlowHello(nodes(), LAGS, after=10**9)
    overrides = [*SMALL, *FEDBUFF, "--trainer.default_root_dir", str(in_tmp / "runs"), "--trainer.name", "never"]
    with (
        pytest.warns(UserWarning, match="have no SuperNode yet"),
        pytest.raises(UserError, match="no SuperNode said which client it serves in 2 attempts") as err,
    ):
        serve(
            never,
            str(CONFIGS / "quickstart.yaml"),
            overrides,
            hello_timeout=0.05,
            wait_for_nodes=0,
            max_silent_rounds=2,
        )
    assert "\n" not in str(err.value) and "raise run config 'hello-timeout'" in str(err.value) and not never.sent
