"""Flower rounds that proceed at k of n (run config ``quorum``) and fold late replies into later rounds.

A node is slow on purpose in :class:`DelayedGrid`: its reply to one round's message is held back for a given number
of later rounds' pushes, deterministically and without sleeping. Its uploads, and every other node's, are crafted
(``x + d_c``, codec FP32) so the global state each round should reach is computed here by hand.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch

flwr = pytest.importorskip("flwr")

from flwr.app import Message  # noqa: E402
from test_flower import SMALL, LocalGrid, final, nodes, task_identity  # noqa: E402, F401

from conftest import CONFIGS  # noqa: E402
from lightning_fl.compress import Quantize  # noqa: E402
from lightning_fl.compress.base import FP32  # noqa: E402
from lightning_fl.errors import ConfigError  # noqa: E402
from lightning_fl.flower import messages  # noqa: E402
from lightning_fl.flower.late import quorum_problem  # noqa: E402
from lightning_fl.flower.server import serve, settings  # noqa: E402

STEPS = {1: 0.01, 2: 0.02, 3: 0.03, 4: 0.04}  # node -> what its client adds to every value of the state it got


class DelayedGrid(LocalGrid):
    """A :class:`LocalGrid` with slow nodes: ``hold={node: {round: pushes}}`` keeps that node's reply to its train
    message of ``round`` (1-based) back until that many later pushes of train messages have happened (the next
    rounds'), then puts it in the store to be pulled."""

    def __init__(self, node_configs, hold, **kwargs) -> None:
        super().__init__(node_configs, **kwargs)
        self.hold = hold
        self.held: list[list] = []  # [pushes still to wait, the id answered, the reply]

    def push_messages(self, messages_):
        messages_ = list(messages_)
        if any(m.metadata.message_type == messages.TRAIN for m in messages_):
            for held in self.held:
                held[0] -= 1
            for held in [h for h in self.held if h[0] <= 0]:
                self.held.remove(held)
                self.store[held[1]] = held[2]
        ids = super().push_messages(messages_)
        for m in messages_:
            pushes = self.hold.get(m.metadata.dst_node_id, {}).get(int(m.metadata.group_id or 0))
            if m.metadata.message_type == messages.TRAIN and pushes and m.metadata.message_id in self.store:
                self.held.append([pushes, m.metadata.message_id, self.store.pop(m.metadata.message_id)])
        return ids

    def trains(self, node: int) -> list[int]:
        """The rounds (1-based) in which ``node`` was sent a train message."""
        return [
            int(m.metadata.group_id)
            for m in self.sent
            if m.metadata.message_type == messages.TRAIN and m.metadata.dst_node_id == node
        ]


def crafted(reply: Message, message: Message, codec=None) -> Message:
    """The node's upload replaced by ``x + d`` (``x`` the state its message carried, ``d`` its node's step), encoded
    by ``codec`` (default FP32) against ``x``."""
    state = messages.record_to_state(message.content[messages.STATE])
    step = STEPS[message.metadata.dst_node_id]
    upload = {n: t + step for n, t in state.items()}
    content = messages.reply_content((codec or FP32()).encode(upload, state, -1), 10, None, {})
    return Message(content, reply_to=message)


def int8_update(reply: Message, message: Message) -> Message:
    """:func:`crafted`, quantised to 8 bits as an update from ``x`` (decoded by adding ``x`` back: exact here, as
    the update is one value repeated)."""
    return crafted(reply, message, Quantize(8, target="update"))


def sent_state(grid: DelayedGrid, round: int, node: int = 1) -> dict[str, torch.Tensor]:
    """The global state the train message of ``round`` (1-based) to ``node`` carried."""
    (message,) = [
        m
        for m in grid.sent
        if m.metadata.message_type == messages.TRAIN
        and m.metadata.dst_node_id == node
        and m.metadata.group_id == str(round)
    ]
    return {n: t.double() for n, t in messages.record_to_state(message.content[messages.STATE]).items()}


def run(tmp, grid, *extra, name="quorum", **kwargs):
    overrides = [
        *SMALL,
        "--trainer.default_root_dir",
        str(tmp / "runs"),
        "--trainer.name",
        name,
        "--trainer.check_identity",
        "false",
        *extra,
    ]
    kwargs = {"round_timeout": 10.0, "hello_timeout": 0.05, "wait_for_nodes": 0, **kwargs}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        trainer = serve(grid, str(CONFIGS / "quickstart.yaml"), overrides, **kwargs)
    return trainer, final(tmp / "runs", name)


@pytest.mark.parametrize(
    ("identity", "codec", "tamper"),
    [
        ("false", "FP32", crafted),
        ("true", "FP32", crafted),
        ("false", "Quantize --trainer.codec.target update", int8_update),
    ],
    ids=["streamed", "rows", "int8-update"],
)
def test_a_round_proceeds_at_k_of_n_and_the_next_folds_the_late_reply_discounted(
    in_tmp, identity, codec, tamper, caplog
):
    """k = 3 of 4, node 4 (client 3) one round late: round 1 steps with clients 0-2; round 2 with clients 0-2 and
    client 3's round-1 upload, discounted by s(1) = 1/sqrt(2) and rebased on round 2's state; the node is not sent a
    second message while its first is out; its download counts in round 1, its upload in round 2. Streamed, and with
    the uploads kept as rows (the identity check reads them all), and with a codec that encodes relative to the state
    sent (the late upload is decoded against round 1's state, not round 2's)."""
    grid = DelayedGrid(nodes(), hold={4: {1: 1}}, tamper=dict.fromkeys(STEPS, tamper))
    trainer, got = run(in_tmp, grid, "--trainer.check_identity", identity, "--trainer.codec", *codec.split(), quorum=3)
    x0, x1 = sent_state(grid, 1), sent_state(grid, 2)
    for n in x0:  # round 1: the mean of the three replies in time
        torch.testing.assert_close(x1[n], x0[n] + (0.01 + 0.02 + 0.03) / 3, atol=1e-6, rtol=0)
    for n in x0:  # round 2: its own three and the late one, discounted
        want = x1[n] + (0.01 + 0.02 + 0.03 + 0.04 / math.sqrt(2)) / 4
        torch.testing.assert_close(got["global_state"][n].double(), want, atol=1e-6, rtol=0)
    rounds = trainer.history[1:]
    assert [h["fed/stale_replies"] for h in rounds] == [0.0, 1.0]
    assert [h["fed/staleness_max"] for h in rounds] == [0.0, 1.0]
    assert [h["fed/lost_clients"] for h in rounds] == [1.0, 0.0]
    assert [h["fed/busy_clients"] for h in rounds] == [1.0, 0.0]
    assert grid.trains(4) == [1] and grid.trains(1) == [1, 2]  # busy in round 2: sent nothing
    # the ledger: client 3 downloaded once (round 1) and uploaded once (round 2)
    down, up = int(got["ledger"]["down"][3]), int(got["ledger"]["up"][3])
    assert down == 768 and up == (768 if codec == "FP32" else 192 + 8)  # (int8: a byte per value, scale and zero)
    assert got["ledger"]["down"].tolist() == [2 * down] * 3 + [down]
    assert got["ledger"]["up"].tolist() == [2 * up] * 3 + [up]
    assert [h["comm/round_down_bytes"] for h in rounds] == [4 * down, 3 * down]
    assert [h["comm/round_up_bytes"] for h in rounds] == [3 * up, 4 * up]
    assert "round 1: proceeds with 3 of 4 replies; client(s) [3] are still training" in caplog.text
    assert "round 2: 4 of 4 sampled clients replied; 0 lost, 0 rejected; 1 late replies folded" in caplog.text


@pytest.mark.parametrize("identity", ["false", "true"], ids=["streamed", "rows"])
def test_a_late_reply_of_a_client_the_round_did_not_sample_is_an_extra_upload_of_that_round(in_tmp, identity):
    """Two of four clients a round (seeded: {2, 3} then {0, 2}), k = 1: client 3's round-1 reply is one round late and
    arrives in round 2, which did not sample it: it is folded as a third upload (kept as a row more when the round
    keeps rows), discounted by s(1)."""
    grid = DelayedGrid(nodes(), hold={4: {1: 1}}, tamper=dict.fromkeys(STEPS, crafted))
    trainer, got = run(
        in_tmp,
        grid,
        "--trainer.check_identity",
        identity,
        "--trainer.client_fraction",
        "null",
        "--trainer.clients_per_round",
        "2",
        quorum=1,
    )
    assert [grid.trains(n) for n in STEPS] == [[2], [], [1, 2], [1]]  # (the seeded cohorts, as assumed)
    x0, x1 = sent_state(grid, 1, node=3), sent_state(grid, 2, node=3)
    for n in x0:
        torch.testing.assert_close(x1[n], x0[n] + 0.03, atol=1e-6, rtol=0)
        want = x1[n] + (0.01 + 0.03 + 0.04 / math.sqrt(2)) / 3
        torch.testing.assert_close(got["global_state"][n].double(), want, atol=1e-6, rtol=0)
    rounds = trainer.history[1:]
    assert [(h["fed/clients"], h["fed/lost_clients"], h["fed/stale_replies"]) for h in rounds] == [(2, 1, 0), (2, 0, 1)]
    assert [h["fed/aggregated_clients"] for h in rounds] == [1.0, 3.0]  # fed/clients is the sample; this, the sum's
    assert got["ledger"]["down"].tolist() == [768, 0, 1536, 768] and got["ledger"]["up"].tolist() == [768, 0, 1536, 768]


def test_a_round_whose_own_replies_are_all_late_but_that_folds_an_earlier_one_is_a_round(in_tmp):
    """Cohorts {2, 3} then {0, 2}, k = 1: client 3's round-1 reply arrives in round 2, whose own two replies are both
    held back: round 2 is no silent attempt, it steps from client 3's discounted update alone."""
    grid = DelayedGrid(nodes(), hold={4: {1: 1}, 1: {2: 9}, 3: {2: 9}}, tamper=dict.fromkeys(STEPS, crafted))
    trainer, got = run(
        in_tmp,
        grid,
        "--trainer.client_fraction",
        "null",
        "--trainer.clients_per_round",
        "2",
        quorum=1,
        round_timeout=0.05,
    )
    x1 = sent_state(grid, 2, node=3)
    for n in x1:
        torch.testing.assert_close(got["global_state"][n].double(), x1[n] + 0.04 / math.sqrt(2), atol=1e-6, rtol=0)
    assert [(h["fed/lost_clients"], h["fed/stale_replies"]) for h in trainer.history[1:]] == [(1, 0), (2, 1)]
    assert [grid.trains(n) for n in STEPS] == [[2], [], [1, 2], [1]]  # sent once each: no attempt ran again


def test_a_message_out_longer_than_max_staleness_is_given_up_counted_and_its_client_sampled_again(in_tmp):
    """Node 4's round-1 reply is held for two rounds, one more than ``max-staleness`` 1: in round 2 its client is busy
    (lost, sent nothing); at round 3 the message is given up (``fed/stale_dropped``, warned), its client is sent a new
    message and replies in time; the old reply is never pulled."""
    grid = DelayedGrid(nodes(), hold={4: {1: 2}})
    overrides = [*SMALL, "--trainer.rounds", "3", "--trainer.default_root_dir", str(in_tmp / "runs")]
    with pytest.warns(
        UserWarning,
        match=r"round 3: client\(s\) \[3\] did not reply within run config 'max-staleness' "
        r"\(1 rounds\): their messages are given up",
    ):
        trainer = serve(
            grid,
            str(CONFIGS / "quickstart.yaml"),
            overrides,
            round_timeout=10.0,
            hello_timeout=0.05,
            wait_for_nodes=0,
            quorum=3,
            max_staleness=1,
        )
    rounds = trainer.history[1:]
    assert [h["fed/stale_dropped"] for h in rounds] == [0.0, 0.0, 1.0]
    assert [h["fed/stale_replies"] for h in rounds] == [0.0, 0.0, 0.0]
    assert [h["fed/lost_clients"] for h in rounds] == [1.0, 1.0, 0.0]
    assert grid.trains(4) == [1, 3]
    assert len(grid.store) == 1  # the given-up reply, released by round 3's push and never pulled


class SilentOnce(DelayedGrid):
    """Every node's round-1 reply is held until the server next asks for the node list (after round 1's first
    attempt, which is silent, at the start of its second), but those of ``keep``, held as ``hold`` says."""

    def __init__(self, node_configs, hold, keep=(), **kwargs) -> None:
        super().__init__(node_configs, hold, **kwargs)
        self.keep = set(keep)

    def get_node_ids(self):
        node_of = {m.metadata.message_id: m.metadata.dst_node_id for m in self.sent}
        for held in [h for h in self.held if node_of[h[1]] not in self.keep]:
            self.held.remove(held)
            self.store[held[1]] = held[2]
        return super().get_node_ids()


def test_after_a_silent_attempt_the_round_waits_for_its_messages_and_their_replies_are_its_own(in_tmp, caplog):
    """quorum 4 of 4, no reply within round-timeout in round 1's first attempt: the round runs again without sending
    anything new (every client is busy) and takes the replies to its first messages as its own (staleness 0, their
    downloads counted once): the same global state, bit for bit, and the same bytes as a run where nothing was late."""
    from test_flower import assert_same_state

    grid = SilentOnce(nodes(), hold={node: {1: 99} for node in STEPS})
    trainer, got = run(in_tmp, grid, quorum=4, round_timeout=0.05, name="silent")
    assert "round 1: none of the 4 sampled clients replied (attempt 1 of 3)" in caplog.text
    plain, reference = run(in_tmp, LocalGrid(nodes()), name="plain")
    assert_same_state(got, reference)
    assert [grid.trains(n) for n in STEPS] == [[1, 2]] * 4
    assert [h["fed/stale_replies"] for h in trainer.history[1:]] == [0.0, 0.0]
    for key in ("comm/round_down_bytes", "comm/round_up_bytes", "comm/msg_round_down_bytes", "fed/lost_clients"):
        assert [h[key] for h in trainer.history[1:]] == [h[key] for h in plain.history[1:]], key
    assert torch.equal(got["ledger"]["down"], reference["ledger"]["down"])


def test_a_message_of_a_silent_attempt_still_out_has_its_download_counted_in_its_round(in_tmp):
    """k = 3 of 4; round 1's first attempt is silent; in its second, nodes 1-3's replies come (its own) and node 4's
    is still out: client 4 is lost in round 1 with its download counted there (its message is round 1's), and its
    reply is folded into round 2 as a late one, its upload counted there."""
    hold = {node: {1: 99} for node in (1, 2, 3)} | {4: {1: 1}}
    grid = SilentOnce(nodes(), hold=hold, keep={4})
    trainer, got = run(in_tmp, grid, quorum=3, round_timeout=0.05)
    assert [(h["fed/lost_clients"], h["fed/stale_replies"]) for h in trainer.history[1:]] == [(1, 0), (0, 1)]
    assert [grid.trains(n) for n in STEPS] == [[1, 2], [1, 2], [1, 2], [1]]
    assert got["ledger"]["down"].tolist() == [1536, 1536, 1536, 768]
    assert got["ledger"]["up"].tolist() == [1536, 1536, 1536, 768]
    assert [h["comm/round_down_bytes"] for h in trainer.history[1:]] == [4 * 768.0, 3 * 768.0]


def test_without_a_quorum_a_late_reply_is_never_folded(in_tmp):
    """quorum 0 (the default): the round waits for all (here until round-timeout), and a reply that comes later is
    never pulled: the round's metrics have no late-reply keys."""
    grid = DelayedGrid(nodes(), hold={4: {1: 1}})
    trainer, _ = run(in_tmp, grid, round_timeout=0.05)
    assert [h["fed/lost_clients"] for h in trainer.history[1:]] == [1.0, 0.0]
    assert not any("fed/stale_replies" in h for h in trainer.history)
    assert grid.trains(4) == [1, 2]


VOIDED = [  # run settings a quorum voids, and the words of their refusal
    (["--trainer.strategy", "Median"], "trainer.strategy Median aggregates one cohort's uploads"),
    (["--trainer.attack", "SignFlip", "--trainer.attack.clients", "[2]"], "trainer.attack forges uploads"),
    (
        [
            "--trainer.privacy",
            "CentralDP",
            "--trainer.privacy.noise_multiplier",
            "1.0",
            "--trainer.max_update_norm_ratio",
            "null",
        ],
        "trainer.privacy's accountant and fixed denominator",
    ),
    (
        ["--trainer.dp_sgd", "lightning_fl.privacy.DPSGD", "--trainer.dp_sgd.noise_multiplier", "1.0"],
        "trainer.dp_sgd's per-client accounting",
    ),
    (
        [
            "--trainer.secure_aggregation",
            "lightning_fl.privacy.secure.SecureAggregation",
            "--trainer.secure_aggregation.clipping_range",
            "1.0",
            "--trainer.max_update_norm_ratio",
            "null",
        ],
        "trainer.secure_aggregation sums one cohort's uploads",
    ),
    (
        ["--trainer.codec", "TopK", "--trainer.compressed_downloads", "true"],
        "trainer.compressed_downloads counts each client's catch-up",
    ),
]


@pytest.mark.parametrize(
    ("extra", "line"), VOIDED, ids=["robust", "attack", "central-dp", "dp-sgd", "secure", "compressed-downloads"]
)
def test_what_a_quorum_voids_is_refused_in_one_line_before_any_message(in_tmp, extra, line):
    grid = LocalGrid(nodes())
    with pytest.raises(ConfigError) as refused:
        run(in_tmp, grid, *extra, quorum=3)
    message = str(refused.value)
    assert message.startswith("run config 'quorum' 3: ") and line in message and "\n" not in message
    assert "set run config 'quorum' 0" in message
    assert grid.sent == []


UNMET = [  # a quorum above what a round can send, and the most a round sends
    ([], 5, "4 messages a round sends (data.num_clients=4)"),
    (["--trainer.clients_per_round", "2"], 3, "2 messages a round sends (trainer.clients_per_round=2)"),
    (["--trainer.client_fraction", "0.5"], 3, "2 messages a round sends (trainer.client_fraction=0.5 of 4 clients)"),
]


@pytest.mark.parametrize(("extra", "quorum", "most"), UNMET, ids=["federation", "clients-per-round", "fraction"])
def test_a_quorum_no_round_can_meet_is_refused_in_one_line_before_any_message(in_tmp, extra, quorum, most):
    grid = LocalGrid(nodes())
    with pytest.raises(ConfigError) as refused:
        run(in_tmp, grid, *extra, quorum=quorum)
    message = str(refused.value)
    assert message.startswith(f"run config 'quorum' {quorum} is more than the {most}") and "\n" not in message
    assert message.endswith("set quorum at most that, or 0 to wait for every reply") and grid.sent == []


def test_the_new_run_config_keys_are_checked_one_line_each():
    got = settings(
        {"config": "x.yaml", "quorum": 3, "max-staleness": 2, "staleness": "polynomial", "staleness-exponent": 1.0}
    )
    assert (got["quorum"], got["max_staleness"], got["staleness"], got["staleness_exponent"]) == (3, 2, "polynomial", 1)
    assert settings({"config": "x.yaml"})["quorum"] == 0
    for key, bad, why in [
        ("quorum", -1, "a whole number >= 0"),
        ("quorum", 1.5, "a whole number >= 0"),
        ("max-staleness", True, "a whole number >= 0"),
        ("staleness", "linear", "one of sqrt"),
        ("staleness-exponent", float("nan"), "a finite number >= 0"),
    ]:
        with pytest.raises(ConfigError, match=f"run config '{key}' must be {why}"):
            settings({"config": "x.yaml", key: bad})


def test_a_plain_run_voids_nothing():
    from types import SimpleNamespace

    from lightning_fl.federated import FedAvg

    plain = SimpleNamespace(
        strategy=FedAvg(), secure_aggregation=None, privacy=None, dp_sgd=None, attack=None, compressed_downloads=False
    )
    assert quorum_problem(plain) is None
