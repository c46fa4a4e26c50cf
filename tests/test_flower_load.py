"""Flower on a busy machine: waits that extend while the nodes show progress, advice that fits the engine and names
the setting to raise, a non-zero exit for a failed run, and no process left behind by a stopped SuperNode.

The waits run on a virtual clock (no sleeping); the commands run against a stand-in ``flwr`` (a script on PATH).
The tests that start Flower's processes (marked slow) are in tests/test_flower_engines.py.
"""

from __future__ import annotations

import contextlib
import os
import stat
import subprocess
import sys
import time
import warnings

import pytest

pytest.importorskip("flwr")

from flwr.app import ConfigRecord, Message, RecordDict
from flwr.app.error import Error
from flwr.common.constant import ErrorCode
from test_flower import task_identity  # noqa: F401

from conftest import REPO
from lightning_fl.errors import UserError
from lightning_fl.flower import messages
from lightning_fl.flower.transport import FlowerTransport


class SlowNodes:
    """A grid whose nodes answer their hello at set (virtual) times: ``answers={node: seconds after it is asked}``
    (absent: never). Node ``n`` serves client ``n - 1``. ``joins={node: time}`` connects a node only then."""

    def __init__(self, answers: dict[int, float], nodes=(1, 2, 3, 4), joins: dict[int, float] | None = None) -> None:
        self.now, self.answers, self.nodes, self.joins = 0.0, answers, list(nodes), joins or {}
        self.out: dict[str, tuple[float, Message]] = {}  # message id -> (when its answer is in, the answer)
        self.asked: list[int] = []
        self.crash: dict[int, int] = {}  # node -> how many of its answers are Flower's "ClientApp stopped responding"
        self.untaken: set[int] = set()  # nodes whose questions the SuperLink does not take (push returns no id)

    def sleep(self, seconds: float) -> None:
        self.now += seconds
        assert self.now < 10_000, "still waiting after 10,000 (virtual) seconds"

    def get_node_ids(self) -> list[int]:
        return [n for n in self.nodes if self.joins.get(n, 0.0) <= self.now]

    def push_messages(self, out):
        ids = []
        for message in out:
            node = message.metadata.dst_node_id
            message.metadata.__dict__["_message_id"] = f"hello-{node}-{len(self.asked)}"
            self.asked.append(node)
            if self.crash.get(node, 0) > 0:
                self.crash[node] -= 1
                answer = Message(Error(ErrorCode.CLIENT_APP_CRASHED, "ClientApp stopped responding."), reply_to=message)
                self.out[message.metadata.message_id] = (self.now + 1.0, answer)
            elif node in self.answers:
                record = ConfigRecord({"partition-id": node - 1, "refusal": ""})
                answer = Message(RecordDict({messages.RUN: record}), reply_to=message)
                self.out[message.metadata.message_id] = (self.now + self.answers[node], answer)
            ids.append("" if node in self.untaken else message.metadata.message_id)
        return ids

    def pull_messages(self, ids):
        ready = [i for i in ids if i in self.out and self.out[i][0] <= self.now]
        return [self.out.pop(i)[1] for i in ready]


@pytest.fixture
def slow(monkeypatch):
    """Install a :class:`SlowNodes`'s clock as ``time.monotonic``/``time.sleep``; returns a maker of grids."""
    made: list[SlowNodes] = []

    def make(*args, **kwargs) -> SlowNodes:
        grid = SlowNodes(*args, **kwargs)
        made.append(grid)
        return grid

    monkeypatch.setattr(time, "sleep", lambda s: made[-1].sleep(s))
    monkeypatch.setattr(time, "monotonic", lambda: made[-1].now)
    return make


def opened(grid, **kwargs) -> FlowerTransport:
    transport = FlowerTransport(grid, "config: x", **{"hello_timeout": 60.0, "wait_for_nodes": 60.0, **kwargs})
    transport.open(num_clients=len(grid.nodes), fingerprint=None, seed=0)
    return transport


def test_the_wait_for_the_nodes_answers_extends_while_they_answer(slow):
    """Four nodes answer 50 s apart (the last after 200 s, far beyond one window of 60 s): each answer starts the
    window again, so all four are introduced, each asked once, and the wait ends with the last answer."""
    grid = slow({1: 50.0, 2: 100.0, 3: 150.0, 4: 200.0})
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (no "have no SuperNode yet")
        transport = opened(grid)
    assert transport.node_of == {0: 1, 1: 2, 2: 3, 3: 4}
    assert sorted(grid.asked) == [1, 2, 3, 4] and 200.0 <= grid.now < 201.0


def test_nodes_that_join_one_by_one_are_progress_too(slow):
    """Nodes 2, 3 and 4 connect 50 s apart (the last 150 s in, beyond one wait-for-nodes of 60 s): each that joins
    and answers starts the wait again, so all four serve before round 1."""
    grid = slow({1: 5.0, 2: 5.0, 3: 5.0, 4: 5.0}, joins={2: 50.0, 3: 100.0, 4: 150.0})
    transport = opened(grid)
    assert sorted(transport.node_of) == [0, 1, 2, 3] and 155.0 <= grid.now < 160.0


def test_a_node_that_never_answers_ends_the_wait_one_window_after_the_last_progress_naming_the_key(slow):
    """Node 4 never answers: the wait ends 60 s (hello-timeout) after the last answer, with one warning naming the
    setting as the engine spells it; the node is not asked again, and its answer is taken whenever it comes."""
    grid = slow({1: 10.0, 2: 20.0, 3: 30.0})
    with pytest.warns(UserWarning, match=r"run config 'hello-timeout' \(60 s without progress") as caught:
        transport = opened(grid)
    assert 90.0 <= grid.now < 91.0 and sorted(transport.node_of) == [0, 1, 2]
    assert "raise run config 'hello-timeout'" in str(caught[0].message)
    grid.answers[4] = 0.0  # (its answer is in now)
    grid.out[f"hello-4-{grid.asked.index(4)}"] = (grid.now, answer_of(grid, 4))
    transport.introduce()
    assert transport.node_of[3] == 4 and grid.asked.count(4) == 1
    grid2 = slow({1: 1.0, 2: 1.0, 3: 1.0})
    with pytest.warns(UserWarning, match=r"within --hello-timeout \(60 s without progress.*raise --hello-timeout"):
        opened(grid2, engine="simulation")


def test_a_question_the_superlink_does_not_take_is_asked_again_but_is_no_progress(slow):
    """Node 4's questions are never taken (no message id) and node 3 never answers: node 4 is asked again at each
    look, yet the wait for node 3 still ends one window (60 s) after the last answer."""
    grid = slow({1: 1.0, 2: 1.0})
    grid.untaken.add(4)
    with pytest.warns(UserWarning, match=r"client\(s\) \[2, 3\] have no SuperNode yet"):
        transport = opened(grid)
    assert sorted(transport.node_of) == [0, 1] and 61.0 <= grid.now < 62.0 and grid.asked.count(4) > 1


def answer_of(grid: SlowNodes, node: int) -> Message:
    question = Message(RecordDict(), dst_node_id=node, message_type=messages.HELLO)
    question.metadata.__dict__["_message_id"] = f"hello-{node}-{grid.asked.index(node)}"
    record = ConfigRecord({"partition-id": node - 1, "refusal": ""})
    return Message(RecordDict({messages.RUN: record}), reply_to=question)


def test_a_clientapp_flower_expired_during_its_hello_is_asked_again_not_refused(slow):
    """Flower answers for a ClientApp whose heartbeat lapsed (``CLIENT_APP_CRASHED``, e.g. a start slower than
    Flower's limits on a busy machine): the node is asked again and serves, never refused; one whose ClientApp
    keeps failing so is asked twice more, then left out with one line (the wait never loops on it)."""
    grid = slow({1: 5.0, 2: 5.0, 3: 5.0, 4: 5.0})
    grid.crash[2] = 1
    with pytest.warns(UserWarning, match="SuperNode 2's ClientApp stopped responding to its hello: asked again"):
        transport = opened(grid)
    assert transport.node_of == {0: 1, 1: 2, 2: 3, 3: 4} and grid.asked.count(2) == 2 and not transport.refused
    grid = slow({1: 5.0, 2: 5.0, 3: 5.0, 4: 5.0})
    grid.crash[2] = 99
    with pytest.warns(UserWarning, match="SuperNode 2 is not used: it failed to start: ClientApp stopped responding"):
        transport = opened(grid)
    assert sorted(transport.node_of) == [0, 2, 3] and grid.asked.count(2) == 3 and transport.refused == {2}


@pytest.mark.parametrize(
    ("engine", "answers", "words"),
    [
        ("deployment", {1: 1.0}, ["within run config 'hello-timeout'", "raise run config 'hello-timeout'"]),
        ("simulation", {1: 1.0}, ["within --hello-timeout", "raise --hello-timeout", "--trainer.resume auto"]),
        ("simulation", {1: 1.0, 2: 1.0, 3: 1.0, 4: 1.0}, ["raise --hello-timeout and --round-timeout"]),
        ("deployment", {1: 1.0, 2: 1.0, 3: 1.0, 4: 1.0}, ["after a SuperLink restart, restart them"]),
    ],
    ids=["deployment-silent-nodes", "simulation-silent-nodes", "simulation", "deployment"],
)
def test_the_line_a_run_stopped_by_silence_ends_with_fits_the_engine_and_names_the_key(slow, engine, answers, words):
    """A run stopped after ``max-silent-rounds`` silent attempts says, in one line, what to raise as the engine in
    use spells it: nodes that never said their client point at hello-timeout; a simulation never at a SuperLink."""
    grid = slow(answers)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        transport = opened(grid, engine=engine, max_silent_rounds=2)
        transport.silent_round(1, [0, 1, 2, 3])
        with pytest.raises(UserError) as stopped:
            transport.silent_round(1, [0, 1, 2, 3])
    line = str(stopped.value)
    assert "\n" not in line and all(w in line for w in words), line
    assert engine == "deployment" or "SuperLink" not in line
    assert ("max-silent-rounds" in line) and (("--max-silent-rounds" in line) == (engine == "simulation"))


# ------------------------------------------------------------------------------------------ python -m ...submit
FAKE_FLWR = """#!{python}
import json, os, sys
args = sys.argv[1:]
with open(os.environ["FAKE_FLWR_CALLS"], "a") as f:
    f.write(" ".join(args) + "\\n")
if args[0] == "run":
    print("Loading project configuration...")
    print(json.dumps({{"success": os.environ["FAKE_START"] == "ok", "run-id": "42"}}))
elif args[0] == "log":
    print("the ServerApp's log")
elif args[0] == "ls":
    print(json.dumps({{"runs": [{{"run-id": "42", "status": os.environ["FAKE_STATUS"], "status-details": "why"}}]}}))
"""


@pytest.mark.parametrize(
    ("start", "final", "code", "line"),
    [
        ("ok", "finished:completed", 0, None),
        ("ok", "finished:failed", 2, "error: run 42 did not complete: its status is finished:failed (why); its log: "),
        ("ok", "finished:stopped", 2, "error: run 42 did not complete: its status is finished:stopped"),
        ("refused", "finished:completed", 2, "error: the run did not start: "),
    ],
    ids=["completed", "failed", "stopped", "not-started"],
)
def test_submit_exits_non_zero_unless_the_run_completed(tmp_path, start, final, code, line):
    """``flwr run --stream`` returns 0 for a run whose ServerApp failed; ``python -m lightning_fl.flower.submit``
    submits, streams the log, reads the final status and exits 2 with one line unless the run completed."""
    folder = tmp_path / "bin"
    folder.mkdir()
    fake = folder / "flwr"
    fake.write_text(FAKE_FLWR.format(python=sys.executable), encoding="utf-8")
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    calls = tmp_path / "calls"
    env = dict(os.environ, PATH=f"{folder}{os.pathsep}{os.environ['PATH']}", FAKE_FLWR_CALLS=str(calls))
    env.update(FAKE_START=start, FAKE_STATUS=final, PYTHONPATH=str(REPO))
    got = subprocess.run(
        [sys.executable, "-m", "lightning_fl.flower.submit", ".", "my-link", "--run-config", "quorum=2"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert got.returncode == code, got.stderr
    errors = got.stderr.strip().splitlines()
    if line is None:
        assert not errors and "run 42 finished:completed" in got.stdout
    else:
        assert len(errors) == 1 and errors[0].startswith(line), got.stderr
    sent = calls.read_text().splitlines()
    assert sent[0] == "run . my-link --run-config quorum=2 --format json"
    if start == "ok":
        assert sent[1:] == ["log 42 my-link --stream", "ls my-link --run-id 42 --format json"]
        assert "the ServerApp's log" in got.stdout


# ------------------------------------------------------------------------------------------ python -m ...supernode
# a process group whose leader exits at once and leaves two processes in it: "a" ignores SIGTERM, "b" does not; the
# driver (its own process, so that what it reaps is its own) stops the group and says how long that took
GROUP = """
import os, pathlib, subprocess, sys, time
from lightning_fl.flower.supernode import stop_group
ready = pathlib.Path(sys.argv[1])
wait = "import pathlib, sys, time; pathlib.Path(sys.argv[1]).touch(); time.sleep(600)"
ignore = "import signal; signal.signal(signal.SIGTERM, signal.SIG_IGN); " + wait
spawn = "; ".join([
    "import subprocess, sys",
    "[subprocess.Popen([sys.executable, '-c', c, sys.argv[3] + n]) for c, n in zip(sys.argv[1:3], 'ab')]",
])
leader = subprocess.Popen([sys.executable, "-c", spawn, ignore, wait, str(ready)], start_new_session=True)
print(leader.pid, flush=True)
leader.wait(timeout=60)
deadline = time.monotonic() + 60
while not all(pathlib.Path(f"{ready}{n}").exists() for n in "ab") and time.monotonic() < deadline:
    time.sleep(0.05)
started = time.monotonic()
stop_group(leader.pid, grace=1.0)
try:
    os.killpg(leader.pid, 0)
    print("left")
except ProcessLookupError:
    print(f"stopped in {time.monotonic() - started:.1f} s")
"""


def test_what_a_stopped_supernode_leaves_in_its_group_is_stopped_sigkill_after_the_grace(tmp_path):
    """A process group whose leader has exited and left two processes (as a SuperNode leaves its SuperExec and a
    busy ClientApp): one ends on SIGTERM, the other ignores it and is killed once the grace (1 s) has passed."""
    import signal

    env = dict(os.environ, PYTHONPATH=str(REPO))
    out = tmp_path / "out"
    with open(out, "w", encoding="utf-8") as sink:
        driver = subprocess.Popen([sys.executable, "-c", GROUP, str(tmp_path / "ready-")], env=env, stdout=sink)
    try:
        driver.wait(timeout=180)
    finally:  # (whatever the driver left: its group, by the id it wrote first)
        if driver.poll() is None:
            driver.kill()
            driver.wait(timeout=30)
        group = out.read_text().split()[:1]
        if group and group[0].isdigit():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(int(group[0]), signal.SIGKILL)
    lines = out.read_text().splitlines()
    assert driver.returncode == 0 and lines[1].startswith("stopped in "), lines
    assert float(lines[1].split()[2]) >= 1.0  # (the one that ignores SIGTERM outlived it)
