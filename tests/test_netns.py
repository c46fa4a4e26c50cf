"""The rate-limited namespace harness (benchmarks/_netns.py): it starts, applies its limit and always cleans up.

Not a timing test of our code: the bounds are generous, and only check that the token bucket is in place (a transfer
takes at least 70% of its bytes over the rate) and gone when removed. Needs root and iproute2 (``ip netns``);
skipped otherwise. Each namespace gets a unique name and is deleted afterwards, also when the body raises; every
process started in it is stopped by PID.
"""

from __future__ import annotations

import importlib.util
import subprocess
import time

import pytest

from conftest import REPO

_spec = importlib.util.spec_from_file_location("_netns", REPO / "benchmarks" / "_netns.py")
_netns = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_netns)  # imported from its file: benchmarks/ stays off sys.path

if (_reason := _netns.unavailable()) is not None:
    pytest.skip(f"rate-limited namespaces unavailable: {_reason}", allow_module_level=True)


def test_the_limit_is_applied_and_removed():
    size, rate = 400_000, 8.0  # 0.4 s at 8 Mbit/s
    ideal = 8 * size / (rate * 1e6)
    with _netns.Namespace(rate) as ns:
        assert ns.exists()
        before = ns.lo_bytes()
        took = _netns.transfer_seconds(ns, size, timeout=30)
        assert took >= 0.7 * ideal, f"{size:,} bytes at {rate} Mbit/s took {took:.3f} s, under 70% of {ideal:.3f} s"
        assert took < 20 * ideal, f"{size:,} bytes at {rate} Mbit/s took {took:.3f} s: the bucket stalls"
        assert ns.lo_bytes() - before >= size  # the bytes crossed the namespace's lo (headers on top)
        assert "tbf" in ns.qdisc()
        ns.set_rate(None)
        assert "tbf" not in ns.qdisc()
        assert _netns.transfer_seconds(ns, size, timeout=30) < 0.7 * ideal  # unshaped loopback: far faster
    assert not ns.exists()


def test_the_namespace_and_its_processes_go_also_when_the_body_raises():
    seen: dict = {}

    def body() -> None:
        with _netns.Namespace(1.0) as ns:
            seen["ns"], seen["sleeper"] = ns, ns.popen(["sleep", "60"])
            deadline = time.monotonic() + 10
            while seen["sleeper"].pid not in ns.pids() and time.monotonic() < deadline:
                time.sleep(0.05)
            seen["inside"] = seen["sleeper"].pid in ns.pids()
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        body()
    ns, sleeper = seen["ns"], seen["sleeper"]
    assert seen["inside"]
    assert not ns.exists()
    assert sleeper.poll() is not None  # stopped by PID and waited for
    assert ns.name not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=10).stdout


def test_a_command_past_its_timeout_is_stopped():
    with _netns.Namespace(None) as ns:
        with pytest.raises(subprocess.TimeoutExpired):
            ns.run(["sleep", "60"], timeout=0.5)
        assert ns.pids() == []
    assert not ns.exists()


def test_a_star_gives_each_client_a_shaped_link_of_its_own_and_goes_also_when_the_body_raises():
    size, rate = 400_000, 8.0  # 0.4 s at 8 Mbit/s
    ideal = 8 * size / (rate * 1e6)
    seen: dict = {}

    def body() -> None:
        with _netns.Star(2) as star:
            seen["star"] = star
            star.set_rates(0, rate, None)  # client 0: shaped down, not up; client 1: not at all
            down = _netns.link_seconds(star, 0, size, up=False, timeout=30)
            assert ideal * 0.7 <= down < 20 * ideal, f"{size:,} bytes at {rate} Mbit/s took {down:.3f} s"
            assert _netns.link_seconds(star, 0, size, up=True, timeout=30) < 0.7 * ideal
            assert _netns.link_seconds(star, 1, size, up=False, timeout=30) < 0.7 * ideal
            assert "tbf" in star.qdiscs()[star.server_dev[0]] and "tbf" not in star.qdiscs()[star.client_dev[0]]
            attached = _netns.Star.attach(star.describe())  # another process's handle: sets rates, deletes nothing
            attached.set_rates(1, None, rate)
            assert "tbf" in star.qdiscs()[star.client_dev[1]]
            attached.close()
            assert star.server.exists() and all(ns.exists() for ns in star.clients)
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        body()
    star = seen["star"]
    assert not star.server.exists() and not any(ns.exists() for ns in star.clients)
    links = subprocess.run(["ip", "link"], capture_output=True, text=True, timeout=10).stdout
    assert not any(dev in links for dev in star.server_dev + star.client_dev)  # the veths went with them
