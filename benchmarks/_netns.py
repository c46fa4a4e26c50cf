"""A rate-limited network on one machine: a fresh Linux network namespace whose loopback is shaped by ``tbf``.

Inside the namespace everything talks over its own ``lo`` (127.0.0.1), and every byte that crosses it, in either
direction and between any two processes, passes one token bucket (``tc qdisc ... tbf rate R``): the namespace is a
single bottleneck of R bit/s shared by all its connections. ``netem`` (delay, loss) is not needed and often not
built; latency is what TCP and the token bucket's queue make of it.

Setup, as :class:`Namespace` does it (root, and the ``ip`` and ``tc`` tools, are needed)::

    ip netns add NAME
    ip netns exec NAME ip link set lo mtu 1500 up
    ip netns exec NAME tc qdisc add dev lo root tbf rate R burst B latency L

The MTU matters: loopback's default MTU (65,536) makes packets larger than a small bucket, which ``tbf`` drops, and
connections then time out. With MTU 1500 the bucket (:func:`tbf_settings`: at least 32 KiB, or 4 ms of the rate)
holds many packets, and the queue holds 200 ms of the rate (at least 64 KiB): a single TCP transfer reaches about
90% of the rate at 1, 10 and 100 Mbit/s (:func:`transfer_seconds` measures it).

Use::

    with Namespace(rate_mbit=8) as ns:
        ns.run(["python", "-c", "..."], timeout=30)   # runs inside (ip netns exec)
        p = ns.popen([...])                           # started inside, stopped on exit
        ns.set_rate(None)                             # no limit (the tbf removed), or another rate

On exit (also when the body raises) it stops every process it started and every process left in the namespace (by
PID: SIGTERM, a bounded wait, SIGKILL), then deletes the namespace.

:class:`Star` is the other topology: a server namespace and one namespace per client, each client joined to the
server by a veth pair of its own shaped at both ends, so every client has a link of its own and nothing is shared
(``benchmarks/shaped_links.py``); :func:`link_seconds` times one TCP transfer over a client's link.

:func:`unavailable` says in one line why this machine cannot do it (not root, no ``ip``, ``ip netns add`` refused).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any


def tbf_settings(rate_mbit: float) -> dict[str, str]:
    """``tc ... tbf`` arguments for ``rate_mbit`` Mbit/s: the bucket holds 4 ms of the rate (at least 32 KiB, many
    1500-byte packets) and the queue 200 ms of it (at least 64 KiB)."""
    rate_bytes = rate_mbit * 1e6 / 8
    burst = max(32 * 1024, int(rate_bytes * 0.004))
    limit = max(64 * 1024, int(rate_bytes * 0.2)) + burst
    return {"rate": f"{rate_mbit * 1e6:.0f}bit", "burst": str(burst), "limit": str(limit)}


def _run(cmd: list[str], timeout: float = 10.0) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)


def unavailable() -> str | None:
    """Why rate-limited namespaces cannot be made here (one line), or ``None`` when they can (tried for real)."""
    if sys.platform != "linux":
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "ip netns needs root"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "the ip and tc tools (iproute2) are not installed"
    name = f"lfl-probe-{uuid.uuid4().hex[:8]}"
    try:
        made = _run(["ip", "netns", "add", name])
        if made.returncode != 0:
            return f"ip netns add refused: {made.stderr.strip()}"
        shaped = _run(
            [
                "ip",
                "netns",
                "exec",
                name,
                "tc",
                "qdisc",
                "add",
                "dev",
                "lo",
                "root",
                "tbf",
                "rate",
                "8mbit",
                "burst",
                "32k",
                "limit",
                "64k",
            ]
        )
        if shaped.returncode != 0:
            return f"tc tbf refused: {shaped.stderr.strip()}"
        return None
    except (OSError, subprocess.SubprocessError) as e:
        return f"ip netns failed: {e}"
    finally:
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            _run(["ip", "netns", "del", name])


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


def stop_pids(pids: list[int], grace: float = 5.0) -> None:
    """SIGTERM ``pids``, wait up to ``grace`` seconds, SIGKILL the survivors, wait up to 5 s more."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.05)
    for pid in pids:
        if _alive(pid):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.05)


class Namespace:
    """A uniquely named network namespace with ``lo`` up (MTU 1500) and shaped to ``rate_mbit`` (``None``: no limit).

    Args:
        rate_mbit: The token bucket's rate in Mbit/s (10**6 bit/s), or ``None`` for an unshaped loopback.
        prefix: The namespace's name starts with this (a random suffix follows).
    """

    def __init__(self, rate_mbit: float | None = None, prefix: str = "lfl") -> None:
        self.name = f"{prefix}-{uuid.uuid4().hex[:10]}"
        self.rate_mbit = rate_mbit
        self.procs: list[subprocess.Popen] = []
        self.created = False

    # ------------------------------------------------------------------ set-up
    def __enter__(self) -> Namespace:
        try:
            self._check(["ip", "netns", "add", self.name])
            self.created = True
            self._check(self.inside(["ip", "link", "set", "lo", "mtu", "1500", "up"]))
            self.set_rate(self.rate_mbit)
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _check(self, cmd: list[str]) -> None:
        done = _run(cmd)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed: {done.stderr.strip()}")

    def inside(self, cmd: list[str]) -> list[str]:
        """``cmd`` as a command line that runs it in the namespace."""
        return ["ip", "netns", "exec", self.name, *cmd]

    def set_rate(self, rate_mbit: float | None) -> None:
        """Shape ``lo`` to ``rate_mbit`` Mbit/s (replacing any earlier limit), or remove the limit (``None``)."""
        if rate_mbit is None:
            _run(self.inside(["tc", "qdisc", "del", "dev", "lo", "root"]))  # fails harmlessly when there is none
        else:
            settings = tbf_settings(rate_mbit)
            self._check(
                self.inside(
                    ["tc", "qdisc", "replace", "dev", "lo", "root", "tbf", *(x for kv in settings.items() for x in kv)]
                )
            )
        self.rate_mbit = rate_mbit

    # ------------------------------------------------------------------ processes
    def popen(self, cmd: list[str], **kwargs) -> subprocess.Popen:
        """Start ``cmd`` in the namespace (``ip netns exec`` execs it: the Popen's PID is the command's)."""
        p = subprocess.Popen(self.inside(cmd), **kwargs)
        self.procs.append(p)
        return p

    def run(self, cmd: list[str], timeout: float, **kwargs) -> subprocess.CompletedProcess:
        """Run ``cmd`` in the namespace to completion, at most ``timeout`` seconds (then it and what it started in
        the namespace are stopped, and ``subprocess.TimeoutExpired`` raised)."""
        kwargs.setdefault("capture_output", True)
        kwargs.setdefault("text", True)
        capture = kwargs.pop("capture_output")
        if capture:
            kwargs.setdefault("stdout", subprocess.PIPE)
            kwargs.setdefault("stderr", subprocess.PIPE)
        p = self.popen(cmd, **kwargs)
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            stop_pids([p.pid, *self.pids()])
            p.communicate(timeout=10)
            raise
        return subprocess.CompletedProcess(p.args, p.returncode, out, err)

    def pids(self) -> list[int]:
        """Every process in the namespace (``ip netns pids``)."""
        done = _run(["ip", "netns", "pids", self.name])
        return [int(x) for x in done.stdout.split() if x.isdigit()] if done.returncode == 0 else []

    # ------------------------------------------------------------------ counters
    def lo_bytes(self) -> int:
        """Bytes sent over the namespace's ``lo`` so far (each byte crosses it once: sent = received)."""
        done = _run(self.inside(["cat", "/sys/class/net/lo/statistics/tx_bytes"]))
        return int(done.stdout.strip())

    def qdisc(self) -> str:
        """``tc -s qdisc show dev lo`` in the namespace: the bucket's settings, bytes sent, drops, overlimits."""
        return _run(self.inside(["tc", "-s", "qdisc", "show", "dev", "lo"])).stdout

    # ------------------------------------------------------------------ tear-down
    def close(self) -> None:
        """Stop what was started (and anything else in the namespace), then delete the namespace. Idempotent."""
        for p in self.procs:
            if p.poll() is None:
                stop_pids([p.pid])
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=5)
        self.procs.clear()
        if self.created:
            left = self.pids()
            if left:
                stop_pids(left)
            done = _run(["ip", "netns", "del", self.name])
            if done.returncode != 0 and self.exists():
                raise RuntimeError(f"ip netns del {self.name} failed: {done.stderr.strip()}")
            self.created = False

    def exists(self) -> bool:
        return Path("/run/netns", self.name).exists() or self.name in _run(["ip", "netns", "list"]).stdout.split()


MTU_BYTES = 1514  # an Ethernet frame of a 1500-byte MTU, as tbf counts it


def link_tbf_settings(rate_mbit: float, burst_packets: int = 2) -> dict[str, str]:
    """``tc ... tbf`` arguments for a client's own link at ``rate_mbit`` Mbit/s: a bucket of ``burst_packets`` full
    frames (3,028 bytes by default: smaller than any message but FLITE's, so a message meets the rate instead of
    crossing at once), and a queue of 200 ms of the rate (at least 64 KiB) so that TCP's window, not drops, fills it."""
    rate_bytes = rate_mbit * 1e6 / 8
    burst = burst_packets * MTU_BYTES
    limit = max(64 * 1024, int(rate_bytes * 0.2)) + burst
    return {"rate": f"{rate_mbit * 1e6:.0f}bit", "burst": str(burst), "limit": str(limit)}


class Star:
    """A server namespace and one namespace per client, each client joined to the server by a veth pair of its
    own, shaped at both ends: the server's end (what the client downloads) and the client's end (what it uploads)
    each get a ``tbf`` (:func:`link_tbf_settings`), so every client has a link of its own and nothing is shared.

    Client ``i``'s pair is ``10.77.i.1/24`` (the server's end, in the server namespace) and ``10.77.i.2/24`` (its end,
    in its namespace); every namespace has its own ``lo`` up, so the processes of one side talk to each other off
    the shaped links. As root::

        ip netns add S; ip netns add Ci
        ip link add sI netns S type veth peer name cI netns Ci
        ip -n S addr add 10.77.i.1/24 dev sI; ip -n S link set sI up   (and the client's end, and lo, likewise)
        ip -n S tc qdisc replace dev sI root tbf rate DOWN burst B limit L
        ip -n Ci tc qdisc replace dev cI root tbf rate UP burst B limit L

    On exit (also when the body raises) it stops every process left in its namespaces and deletes them, which
    deletes their veths too.

    Args:
        clients: How many client namespaces (and links).
        prefix: The namespaces' names start with this (a random tag follows).
    """

    def __init__(self, clients: int, prefix: str = "lfl") -> None:
        tag = uuid.uuid4().hex[:6]
        self.server = Namespace(prefix=f"{prefix}-s{tag}")
        self.clients = [Namespace(prefix=f"{prefix}-c{i}{tag}") for i in range(clients)]
        self.server_dev = [f"ls{tag}{i}" for i in range(clients)]  # at most 15 characters
        self.client_dev = [f"lc{tag}{i}" for i in range(clients)]
        self.rates: list[tuple[float | None, float | None]] = [(None, None)] * clients

    def describe(self) -> dict[str, Any]:
        """The names of its namespaces and devices, for :meth:`attach` in another process."""
        return {
            "server": self.server.name,
            "clients": [ns.name for ns in self.clients],
            "server_dev": self.server_dev,
            "client_dev": self.client_dev,
        }

    @classmethod
    def attach(cls, desc: dict[str, Any]) -> Star:
        """A handle on a star another process made (:meth:`describe`): it runs commands in its namespaces and sets
        its rates, and never deletes them (:meth:`close` stops nothing and deletes nothing)."""
        star = cls.__new__(cls)
        star.server = Namespace()
        star.server.name = desc["server"]
        star.clients = []
        for name in desc["clients"]:
            star.clients.append(Namespace())
            star.clients[-1].name = name
        star.server_dev, star.client_dev = list(desc["server_dev"]), list(desc["client_dev"])
        star.rates = [(None, None)] * len(star.clients)
        return star

    @staticmethod
    def server_ip(i: int) -> str:
        return f"10.77.{i}.1"

    @staticmethod
    def client_ip(i: int) -> str:
        return f"10.77.{i}.2"

    def __enter__(self) -> Star:
        try:
            for ns in (self.server, *self.clients):
                ns.__enter__()
            for i, ns in enumerate(self.clients):
                s, c = self.server_dev[i], self.client_dev[i]
                self.server._check(
                    [
                        "ip",
                        "link",
                        "add",
                        s,
                        "netns",
                        self.server.name,
                        "type",
                        "veth",
                        "peer",
                        "name",
                        c,
                        "netns",
                        ns.name,
                    ]
                )
                for space, dev, ip in ((self.server, s, self.server_ip(i)), (ns, c, self.client_ip(i))):
                    space._check(["ip", "-n", space.name, "addr", "add", f"{ip}/24", "dev", dev])
                    space._check(["ip", "-n", space.name, "link", "set", dev, "up"])
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def set_rates(self, i: int, down_mbit: float | None, up_mbit: float | None) -> None:
        """Shape client ``i``'s link: ``down_mbit`` Mbit/s from the server, ``up_mbit`` to it (``None``: no limit)."""
        for space, dev, rate in (
            (self.server, self.server_dev[i], down_mbit),
            (self.clients[i], self.client_dev[i], up_mbit),
        ):
            if rate is None:
                _run(space.inside(["tc", "qdisc", "del", "dev", dev, "root"]))  # harmless when none
            else:
                kv = [x for pair in link_tbf_settings(rate).items() for x in pair]
                space._check(space.inside(["tc", "qdisc", "replace", "dev", dev, "root", "tbf", *kv]))
        self.rates[i] = (down_mbit, up_mbit)

    def qdiscs(self) -> dict[str, str]:
        """``tc -s qdisc show`` of each shaped end, by device name: the settings, bytes sent, drops, overlimits."""
        out = {}
        for i, ns in enumerate(self.clients):
            for space, dev in ((self.server, self.server_dev[i]), (ns, self.client_dev[i])):
                out[dev] = _run(space.inside(["tc", "-s", "qdisc", "show", "dev", dev])).stdout
        return out

    def close(self) -> None:
        """Stop what runs in the namespaces and delete them (the clients' first, then the server's). Idempotent;
        raises at the end if a namespace could not be deleted."""
        errors = []
        for ns in (*self.clients, self.server):
            try:
                ns.close()
            except RuntimeError as err:
                errors.append(str(err))
        if errors:
            raise RuntimeError("; ".join(errors))


TRANSFER = r"""
import socket, sys, threading, time
n = int(sys.argv[1])
server = socket.create_server(("127.0.0.1", 0))
port = server.getsockname()[1]
def serve():
    conn, _ = server.accept()
    got = 0
    while got < n:
        chunk = conn.recv(1 << 16)
        if not chunk:
            break
        got += len(chunk)
    conn.sendall(b"k")
    conn.close()
threading.Thread(target=serve, daemon=True).start()
data = bytes(n)
t0 = time.perf_counter()
with socket.create_connection(("127.0.0.1", port)) as c:
    c.sendall(data)
    c.recv(1)
print(time.perf_counter() - t0)
"""


def transfer_seconds(ns: Namespace, nbytes: int, timeout: float = 60.0) -> float:
    """Seconds a TCP transfer of ``nbytes`` over 127.0.0.1 takes inside ``ns`` (connect to the receiver's ack)."""
    done = ns.run([sys.executable, "-c", TRANSFER, str(nbytes)], timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"transfer failed: {done.stderr.strip()}")
    return float(done.stdout.strip().splitlines()[-1])


RECEIVE = r"""
import socket, sys
host, port, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
server = socket.create_server((host, port))
print("listening", flush=True)
conn, _ = server.accept()
got = 0
while got < n:
    chunk = conn.recv(1 << 16)
    if not chunk:
        break
    got += len(chunk)
conn.sendall(b"k")
conn.close()
"""

SEND = r"""
import socket, sys, time
host, port, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
data = bytes(n)
t0 = time.perf_counter()
with socket.create_connection((host, port)) as c:
    c.sendall(data)
    c.recv(1)
print(time.perf_counter() - t0)
"""


def link_seconds(star: Star, i: int, nbytes: int, up: bool, port: int = 47000, timeout: float = 120.0) -> float:
    """Seconds one TCP transfer of ``nbytes`` over client ``i``'s link takes (connect to the receiver's ack): from
    the server to the client (``up=False``) or from the client to the server."""
    sender, receiver = (star.clients[i], star.server) if up else (star.server, star.clients[i])
    host = star.server_ip(i) if up else star.client_ip(i)
    recv = receiver.popen(
        [sys.executable, "-c", RECEIVE, host, str(port), str(nbytes)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert recv.stdout is not None
        if recv.stdout.readline().strip() != "listening":
            raise RuntimeError("the receiver did not start")
        done = sender.run([sys.executable, "-c", SEND, host, str(port), str(nbytes)], timeout=timeout)
        if done.returncode != 0:
            raise RuntimeError(f"transfer failed: {done.stderr.strip()}")
        return float(done.stdout.strip().splitlines()[-1])
    finally:
        stop_pids([recv.pid], grace=2.0)
        recv.wait(timeout=5)


if __name__ == "__main__":  # python benchmarks/_netns.py: each rate's transfer time against bytes / rate
    if reason := unavailable():
        sys.exit(f"skipped: {reason}")
    for rate in (1, 10, 100):
        size = int(rate * 1e6 / 8 * 2)  # two seconds' worth
        with Namespace(rate) as ns:
            took = transfer_seconds(ns, size)
            ideal = 8 * size / (rate * 1e6)
            print(
                f"{rate:>5} Mbit/s: {size:,} bytes in {took:.2f} s (bytes / rate {ideal:.2f} s: "
                f"{8 * size / took / 1e6:.2f} Mbit/s achieved)"
            )
