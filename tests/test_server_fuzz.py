"""Generated replies through the whole server path on Flower: the transport's reader, the gate and the round.

A fake ``Grid`` answers every train message of a round with a generated reply: honest payloads, payloads that
are damaged (bit flips, cuts, trailing bytes, random bytes, forged headers, the crashers that once took a
server down), records of the wrong type or missing, declared sample counts and failures of every type, logged
values that are not numbers, and error replies. ``RoundRunner.run`` with :class:`FlowerTransport` must finish
every round: each reply is accepted or rejected with one line naming its client, and an accepted reply is one
whose structure is honest. The default suite runs a few thousand replies; ``-m slow`` runs 100,000.
"""

from __future__ import annotations

import json
import random
import struct
import types
import warnings

import pytest
import torch

pytest.importorskip("flwr")

from flwr.app import ConfigRecord, Error, Message, MetricRecord, RecordDict
from flwr.common.constant import ErrorCode

from helpers import round_runner
from lightning_fl.compress import FP32, Quantize, wire
from lightning_fl.flower import messages
from lightning_fl.flower.transport import FlowerTransport


@pytest.fixture(autouse=True)
def task_identity(monkeypatch):
    from flwr.supercore.task_identity import TaskIdentity

    for attribute, value in (("_run_id", 1), ("_node_id", 0), ("_task_id", 0)):
        monkeypatch.setattr(TaskIdentity, attribute, value)


def frame(header: bytes, body: bytes = b"") -> bytes:
    return struct.pack("<4sBI", wire.MAGIC, wire.VERSION, len(header)) + header + body


def crafted_header(shape: list) -> bytes:
    part = {"name": "values", "dtype": "float32", "shape": shape}
    return frame(
        json.dumps(
            {"tensors": [{"name": "w", "shape": shape, "dtype": "float32", "info": {}, "parts": [part]}]}
        ).encode()
    )


CRASHERS = [  # replies that crashed a ServerApp before the reader refused them
    frame(b"[" * 100_000 + b"]" * 100_000),
    crafted_header([10**30, 0]),
    crafted_header([2**62, 2**62, 0]),
]


class Replies:
    """Makes one reply per train message: honest, or damaged in one of many ways (seeded)."""

    def __init__(self, seed: int, codec, state: dict[str, torch.Tensor]) -> None:
        self.rng, self.codec, self.state = random.Random(seed), codec, state
        self.kinds: dict[int, str] = {}  # client -> what its last reply was

    def honest_bytes(self, client: int) -> bytes:
        g = torch.Generator().manual_seed(client)
        trained = {n: t + 0.01 * torch.randn(t.shape, generator=g) for n, t in self.state.items()}
        return wire.dumps(self.codec.encode(trained, self.state, client))

    def payload(self, client: int) -> tuple[str, object]:
        rng, data = self.rng, self.honest_bytes(client)
        kind = rng.choice(["honest"] * 3 + ["flip", "cut", "trailing", "random", "forged", "crasher", "not-bytes"])
        if kind == "honest":
            return kind, data
        if kind == "flip":
            flipped = bytearray(data)
            flipped[rng.randrange(len(flipped))] ^= 1 << rng.randrange(8)
            return kind, bytes(flipped)
        if kind == "cut":
            return kind, data[: rng.randrange(len(data))]
        if kind == "trailing":
            return kind, data + rng.randbytes(rng.randint(1, 16))
        if kind == "random":
            return kind, rng.choice([b"", wire.MAGIC, data[:9]]) + rng.randbytes(rng.randint(0, 300))
        if kind == "forged":
            length = struct.unpack_from("<I", data, 5)[0]
            header = json.loads(data[9 : 9 + length])
            entry = rng.choice(header["tensors"])
            target = rng.choice([entry, rng.choice(entry["parts"])])
            key = rng.choice(["name", "shape", "dtype"] + (["info"] if "info" in target else []))
            target[key] = rng.choice([None, 3, -1, "x", [], [-1], [2**40, 2**40], [10**30, 0], {"a": 1}, [True]])
            return kind, frame(json.dumps(header).encode(), data[9 + length :])
        if kind == "crasher":
            return kind, rng.choice(CRASHERS)
        return kind, rng.choice(["text", 3, 1.5, True, [1, 2], None])

    def reply(self, message: Message) -> Message:
        rng = self.rng
        client = message.content[messages.INSTRUCTIONS]["client"]
        if rng.random() < 0.03:
            self.kinds[client] = "error"
            return Message(Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason="boom"), reply_to=message)
        kind, payload = self.payload(client)
        record: dict = {"num-samples": 10, "failure": ""}
        if payload is not None:
            record["payload"] = payload
        if rng.random() < 0.1:  # a declared field of the wrong type or range
            record[rng.choice(["num-samples", "failure"])] = rng.choice([-5, True, 2.5, "many", 2**62, b"x", None])
            kind += "+field"
        record = {k: v for k, v in record.items() if v is not None}
        logged = {
            "train/loss:sum": rng.choice([1.0, float("nan"), float("inf"), -1e308]),
            "train/loss:weight": rng.choice([10.0, -1.0, 0.0, float("nan")]),
        }
        content = RecordDict({messages.REPLY: ConfigRecord(record), messages.LOGGED: MetricRecord(logged)})
        if rng.random() < 0.05:  # the reply's record under the wrong kind, or missing
            content = RecordDict({messages.REPLY: MetricRecord({"num-samples": 10})})
            kind += "+record"
        self.kinds[client] = kind
        return Message(content, reply_to=message)


class FuzzGrid:
    """A Grid whose nodes 1..K answer through :class:`Replies` (node ``i + 1`` serves client ``i``)."""

    def __init__(self, clients: int, replies: Replies) -> None:
        self.clients, self.replies, self.sent = clients, replies, 0
        self.store = {}  # replies not pulled yet, by the id of the message they answer

    def get_node_ids(self):
        return list(range(1, self.clients + 1))

    def push_messages(self, out):
        ids = []
        for message in out:
            self.sent += 1
            ids.append(f"m{self.sent}")
            message.metadata.__dict__["_message_id"] = ids[-1]
            self.store[ids[-1]] = self.replies.reply(message)
        return ids

    def pull_messages(self, ids):
        return [self.store.pop(i) for i in ids if i in self.store]


def fuzz(total: int, clients: int, codec, seed: int = 0) -> dict[str, int]:
    """``total`` generated replies, ``clients`` per round, through ``RoundRunner.run`` with the Flower transport."""
    state = {"w": torch.randn(6, 5, generator=torch.Generator().manual_seed(seed)), "b": torch.zeros(5)}
    replies = Replies(seed, codec, state)
    grid = FuzzGrid(clients, replies)
    transport = FlowerTransport(grid, "config: fuzz", wait_for_nodes=0)
    transport.num_clients = clients
    transport.node_of = {c: c + 1 for c in range(clients)}
    transport.client_of = {c + 1: c for c in range(clients)}
    fabric = types.SimpleNamespace(global_rank=0, world_size=1, is_global_zero=True)
    runner = round_runner(fabric, transport, codec, num_clients=clients)
    data = types.SimpleNamespace(num_clients=clients)
    seen: dict[str, int] = {}
    for r in range(-(-total // clients)):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            new_state, metrics = runner.run(None, data, state, r, seed, clients)
        rejected = [str(w.message) for w in caught if "upload rejected" in str(w.message)]
        assert all(m.startswith(f"round {r + 1}, client ") and "\n" not in m for m in rejected)
        assert metrics["fed/clients"] == clients and metrics["fed/lost_clients"] == 0
        for client, kind in replies.kinds.items():
            seen[kind] = seen.get(kind, 0) + 1
            if kind == "honest":  # an honest reply is never refused
                assert not any(m.startswith(f"round {r + 1}, client {client}:") for m in rejected), [
                    m for m in rejected if m.startswith(f"round {r + 1}, client {client}:")
                ]
            elif kind in ("error", "crasher", "not-bytes", "cut") or kind.endswith("+record"):
                assert any(m.startswith(f"round {r + 1}, client {client}:") for m in rejected), kind
        assert all(torch.isfinite(t).all() for t in new_state.values())
        assert metrics["fed/dropped_clients"] == len(rejected)
    return seen


def test_generated_replies_never_take_the_server_down():
    seen = fuzz(3_000, 300, FP32())
    assert {"honest", "flip", "cut", "crasher", "forged", "error"} <= set(seen)


@pytest.mark.slow
@pytest.mark.parametrize("codec", [FP32(), Quantize(8)], ids=["fp32", "int8"])
def test_a_hundred_thousand_generated_replies_never_take_the_server_down(codec):
    seen = fuzz(50_000, 1_000, codec, seed=1)
    assert sum(seen.values()) >= 50_000 and seen["crasher"] > 1_000
