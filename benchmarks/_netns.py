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
PID: SIGTERM, a bounded wait, SIGKILL), then deletes the namespace. :func:`unavailable` says in one line why this
machine cannot do it (not root, no ``ip``, ``ip netns add`` refused).
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
