"""A Flower deployment on 127.0.0.1 for tests: a SuperLink, N SuperNodes, ``flwr run``, and a clean teardown.

flwr 1.42's SuperLink serves its Fleet, Control and ServerAppIo APIs over HTTP on one port; each SuperNode
serves its ClientAppIo API on another. Every port is free (bound to 0 first), every wait is bounded (by limits a
loaded machine meets: two minutes for a process to listen), each process gets its own ``FLWR_HOME`` under the
test's folder, and teardown stops every process started here and its descendants by PID (found through /proc;
orphans are reaped, as this process is a subreaper).

Insecure by default; ``tls=make_tls(folder)`` serves the SuperLink over HTTPS (the SuperNodes and the ``flwr``
CLI trust the test's CA) and ``node_auth=True`` adds ``--enable-supernode-auth``: each SuperNode gets an EC key
pair (OpenSSH format, :func:`make_node_key`), registered with ``flwr supernode register`` before it starts.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

BIN = Path(sys.executable).parent  # venv bin: flower-superlink, flwr, flower-superexec...
REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _children_map() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat", encoding="utf-8") as f:
                stat = f.read()
        except OSError:
            continue
        # field 4 (ppid) comes after the ")" that closes comm
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        kids.setdefault(ppid, []).append(int(d))
    return kids


def descendants(pid: int) -> list[int]:
    kids = _children_map()
    out, stack = [], [pid]
    while stack:
        for c in kids.get(stack.pop(), []):
            out.append(c)
            stack.append(c)
    return out


def _starttime(pid: int) -> str | None:
    """Process start time (jiffies since boot) -> guards against PID reuse."""
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


def homed_under(folder: Path) -> list[int]:
    """Live processes (other than this one) whose ``FLWR_HOME`` lies under ``folder``: everything a deployment
    started, its SuperExecs and app processes included, as they inherit the environment."""
    prefix = f"FLWR_HOME={Path(folder)}{os.sep}".encode()
    found = []
    for d in os.listdir("/proc"):
        if not d.isdigit() or int(d) == os.getpid():
            continue
        try:
            with open(f"/proc/{d}/environ", "rb") as f:
                if any(v.startswith(prefix) for v in f.read().split(b"\0")) and _alive(int(d)):
                    found.append(int(d))
        except OSError:
            continue
    return found


def kill_tree(pid: int, grace: float = 5.0) -> None:
    """SIGTERM pid + all descendants (collected first), then SIGKILL survivors."""
    pids = [pid, *descendants(pid)]
    for p in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, signal.SIGTERM)
    deadline = time.time() + grace
    while time.time() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.1)
    pids = pids + descendants(pid)
    for p in pids:
        if _alive(p):
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGKILL)
    deadline = time.time() + 5.0
    while time.time() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.05)


_PR_SET_CHILD_SUBREAPER = 36


def enable_subreaper() -> bool:
    """Make this process adopt orphaned descendants (Linux only).

    flower-supernode starts `flower-superexec` and never wait()s for it; when the
    supernode dies first, the superexec is re-parented to PID 1. If PID 1 does not
    reap (as in some sandboxes/containers), <defunct> entries pile up. As a subreaper
    we adopt them and `reap_orphans()` collects them.
    """
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except Exception:
        return False


def reap_orphans(timeout: float = 3.0) -> None:
    """Reap zombie children adopted via enable_subreaper().

    Loops (bounded): a multi-threaded zombie leader can't be reaped until all its
    threads are gone, so a single WNOHANG pass can miss it.
    """
    deadline = time.time() + timeout
    while True:
        zombies = []
        for pid in _children_map().get(os.getpid(), []):
            try:
                with open(f"/proc/{pid}/stat", encoding="utf-8") as f:
                    if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                        zombies.append(pid)
            except OSError:
                pass
        for pid in list(zombies):
            try:
                if os.waitpid(pid, os.WNOHANG)[0] == pid:
                    zombies.remove(pid)
            except ChildProcessError:
                zombies.remove(pid)
        if not zombies or time.time() > deadline:
            return
        time.sleep(0.05)


@dataclass(frozen=True)
class TLS:
    """PEM files: the CA's certificate, and the SuperLink's certificate (signed by that CA) and private key."""

    ca: Path
    cert: Path
    key: Path


def make_tls(folder: Path, hosts: tuple[str, ...] = ("127.0.0.1", "localhost")) -> TLS:
    """A throwaway CA and a server certificate for ``hosts`` (IP addresses and DNS names in its SAN), EC P-256,
    valid for a day, written under ``folder`` as ``ca.crt``, ``server.pem`` and ``server.key``."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "lightning-fl test CA")])
    ca_usage = x509.KeyUsage(
        digital_signature=True,
        key_cert_sign=True,
        crl_sign=True,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=False,
        encipher_only=False,
        decipher_only=False,
    )
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(ca_usage, critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    names: list[x509.GeneralName] = []
    for host in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hosts[0])]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    tls = TLS(folder / "ca.crt", folder / "server.pem", folder / "server.key")
    tls.ca.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    tls.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    tls.key.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    tls.key.chmod(0o600)
    return tls


def make_node_key(folder: Path, name: str) -> tuple[Path, Path]:
    """A SuperNode's key pair as Flower 1.42 reads it: an EC key on a NIST curve (here P-384, as Flower's docs
    use) in OpenSSH format, the private key unencrypted (``flower-supernode --auth-supernode-private-key``) and
    the public key as one ``ecdsa-sha2-nistp384 ...`` line (``flwr supernode register``). What ``ssh-keygen -t
    ecdsa -b 384 -N '' -f name`` writes."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    key = ec.generate_private_key(ec.SECP384R1())
    private, public = folder / name, folder / f"{name}.pub"
    private.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH, serialization.NoEncryption())
    )
    private.chmod(0o600)
    public.write_bytes(
        key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
        + f" {name}\n".encode()
    )
    return private, public


def wait_http_ok(url: str, timeout: float, cafile: Path | None = None) -> None:
    """Poll ``url`` until it answers 200; an ``https://`` URL is verified against ``cafile``."""
    context = ssl.create_default_context(cafile=str(cafile)) if cafile else None
    deadline = time.time() + timeout
    last = None
    while time.time() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=1.0, context=context) as r:
                if r.status == 200:
                    return
        except Exception as e:
            last = e
        time.sleep(0.2)
    raise TimeoutError(f"{url} not ready after {timeout}s: {last!r}")


@dataclass
class FlowerDeployment:
    workdir: Path
    num_supernodes: int = 2
    extra_env: dict[str, str] = field(default_factory=dict)
    node_env: dict[int, dict[str, str]] = field(default_factory=dict)  # node idx -> more environment for its tree
    workers: bool = False  # a warm worker (python -m lightning_fl.flower.worker) beside each SuperNode
    launcher: bool = False  # start each SuperNode through python -m lightning_fl.flower.supernode
    superlink_args: list[str] = field(default_factory=list)  # more flower-superlink options (e.g. --database)
    superlink_cwd: Path | None = None  # ServerApp inherits this cwd
    tls: TLS | None = None  # HTTPS with these files instead of --insecure (make_tls)
    node_auth: bool = False  # --enable-supernode-auth; each SuperNode's key registered before it starts (needs tls)
    node_ids: dict[int, int] = field(default_factory=dict)  # node idx -> node id given at registration
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    logs: dict[str, Path] = field(default_factory=dict)
    # every PID ever seen in one of our trees (orphans of a killed node live on!)
    seen_pids: dict[int, str | None] = field(default_factory=dict)  # pid -> starttime

    def __post_init__(self) -> None:
        self.workdir = Path(self.workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()  # the only SuperLink port (Fleet+Control+Runtime)
        self.address = f"127.0.0.1:{self.port}"
        self.cli_home = self.workdir / "home-cli"
        self.cli_home.mkdir(exist_ok=True)
        if self.node_auth and self.tls is None:
            raise ValueError("SuperNode authentication needs TLS (Flower refuses a node key over --insecure)")
        # the CLI reads root-certificates relative to its working directory: an absolute path
        trust = f'root-certificates = "{Path(self.tls.ca).resolve()}"' if self.tls else "insecure = true"
        (self.cli_home / "config.toml").write_text(
            f'[superlink]\ndefault = "local-test"\n\n[superlink.local-test]\naddress = "{self.address}"\n{trust}\n',
            encoding="utf-8",
        )

    # ---------------------------------------------------------------- env
    def env(self, home: Path) -> dict[str, str]:
        env = dict(os.environ)
        env.update(
            FLWR_HOME=str(home),
            FLWR_TELEMETRY_ENABLED="0",
            FLWR_DISABLE_UPDATE_CHECK="1",
            # superlink/supernode spawn `flower-superexec`, which spawns
            # `flwr-serverapp` / `flwr-clientapp` BY NAME -> venv bin must be on PATH
            PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}",
            PYTHONUNBUFFERED="1",
            # the SuperExec's poll for tasks (Flower's default 1 s; 0.01-60 allowed): part of every message's wait
            FLWR_SUPEREXEC_TASK_POLL_INTERVAL="0.05",
        )
        # these would re-enable legacy gRPC Fleet/Control servers on FIXED ports 9092/9093
        env.pop("FLWR_INTERNAL_GRPC_FLEET_API", None)
        env.pop("FLWR_INTERNAL_GRPC_CONTROL_API", None)
        env.update(self.extra_env)
        return env

    def _spawn(
        self, name: str, cmd: list[str], home: Path, cwd: Path, env: dict[str, str] | None = None
    ) -> subprocess.Popen:
        home.mkdir(parents=True, exist_ok=True)
        log = self.workdir / f"{name}.log"
        self.logs[name] = log
        fh = open(log, "ab")  # noqa: SIM115  (closed by OS at teardown)
        p = subprocess.Popen(
            cmd,
            cwd=cwd,
            env={**self.env(home), **(env or {})},
            stdout=fh,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
        fh.close()
        self.procs[name] = p
        return p

    # ------------------------------------------------------------ start
    def start_superlink(self, timeout: float = 120.0) -> None:
        if self.tls:
            security = [
                "--ssl-ca-certfile",
                str(self.tls.ca),
                "--ssl-certfile",
                str(self.tls.cert),
                "--ssl-keyfile",
                str(self.tls.key),
            ]
        else:
            security = ["--insecure"]
        if self.node_auth:
            security.append("--enable-supernode-auth")
        self._spawn(
            "superlink",
            [
                str(BIN / "flower-superlink"),
                *security,
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--disable-runtime-dependency-installation",
                *self.superlink_args,
            ],  # else each ServerApp runs `uv sync`
            home=self.workdir / "home-superlink",
            cwd=self.superlink_cwd or self.workdir,
        )
        scheme = "https" if self.tls else "http"
        wait_http_ok(f"{scheme}://{self.address}/health", timeout, cafile=self.tls.ca if self.tls else None)

    def start_worker(self, idx: int, timeout: float = 120.0) -> str:
        """Start node ``idx``'s warm worker; its socket path once it listens (in a short private folder: a Unix
        socket's path has at most 107 bytes)."""
        if not hasattr(self, "socket_dir"):
            self.socket_dir = Path(tempfile.mkdtemp(prefix="lfl-", dir="/tmp"))
        path = self.socket_dir / f"w{idx}.sock"
        self._spawn(
            f"worker{idx}",
            [sys.executable, "-m", "lightning_fl.flower.worker", "--socket", str(path)],
            home=self.workdir / f"home-worker{idx}",
            cwd=self.workdir,
        )
        deadline = time.time() + timeout
        while not path.exists():
            if self.procs[f"worker{idx}"].poll() is not None or time.time() > deadline:
                raise TimeoutError(f"worker {idx} did not listen on {path}: {self.logs[f'worker{idx}'].read_text()}")
            time.sleep(0.1)
        return str(path)

    def node_key(self, idx: int) -> tuple[Path, Path]:
        """Node ``idx``'s key pair (private, public), made on first use."""
        private = self.workdir / "keys" / f"supernode{idx}"
        if not private.exists():
            return make_node_key(private.parent, private.name)
        return private, private.with_name(f"{private.name}.pub")

    def register(self, idx: int) -> int:
        """``flwr supernode register`` node ``idx``'s public key; the node id the SuperLink gave it."""
        cp = self.flwr("supernode", "register", str(self.node_key(idx)[1]), "local-test", "--format", "json")
        try:
            payload = json.loads(cp.stdout[cp.stdout.index("{") :])
        except ValueError:
            payload = {}
        if cp.returncode != 0 or not payload.get("success"):
            raise RuntimeError(f"flwr supernode register failed: {cp.stdout}\n{cp.stderr}")
        self.node_ids[idx] = int(payload["node-id"])
        return self.node_ids[idx]

    def start_supernode(
        self,
        idx: int,
        timeout: float = 120.0,
        register: bool = True,
        key: bool = True,
        trust_ca: bool = True,
        wait: bool = True,
    ) -> int:
        """Start SuperNode ``idx``; its Runtime API port. Under ``node_auth`` its key is registered first unless
        ``register=False``, and it is started with its private key unless ``key=False`` (it then makes a key of its
        own and asks to register it, which ``--enable-supernode-auth`` forbids); ``trust_ca=False`` starts it
        without the test's CA (it then trusts the system's), and ``wait=False`` returns without waiting for its
        Runtime API (a node that is to be refused may exit before that answers)."""
        port = free_port()  # SuperNode Runtime (ClientAppIo) HTTP API
        name = f"supernode{idx}"
        node_config = f"partition-id={idx} num-partitions={self.num_supernodes}"
        if self.workers:
            node_config += f" worker='{self.start_worker(idx)}'"
        security = ["--insecure"]
        if self.tls:
            security = ["--root-certificates", str(self.tls.ca)] if trust_ca else []
        if self.node_auth and key:
            if register and idx not in self.node_ids:
                self.register(idx)
            security += ["--auth-supernode-private-key", str(self.node_key(idx)[0])]
        start, env = [str(BIN / "flower-supernode")], dict(self.node_env.get(idx) or {})
        if self.launcher:  # (this checkout's lightning_fl, whatever the environment has installed)
            start = [sys.executable, "-m", "lightning_fl.flower.supernode"]
            path = env.get("PYTHONPATH", self.env(self.workdir).get("PYTHONPATH", ""))
            env["PYTHONPATH"] = os.pathsep.join([str(REPO), path])
        self._spawn(
            name,
            [
                *start,
                *security,
                "--superlink",
                self.address,
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--node-config",
                node_config,
            ],
            home=self.workdir / f"home-{name}",  # separate FLWR_HOME per node (FAB install race)
            cwd=self.workdir,
            env=env,
        )
        if wait:  # the node's own Runtime API: plain HTTP on 127.0.0.1 (no --ssl-certfile), also under TLS
            wait_http_ok(f"http://127.0.0.1:{port}/health", timeout)
        return port

    def start(self) -> None:
        self.start_superlink()
        for i in range(self.num_supernodes):
            self.start_supernode(i)
        self.wait_nodes(self.num_supernodes)

    # ------------------------------------------------------------- CLI
    def flwr(self, *args: str, timeout: float = 60.0) -> subprocess.CompletedProcess:
        return subprocess.run(
            [str(BIN / "flwr"), *args],
            env=self.env(self.cli_home),
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=self.workdir,
        )

    def run_app(self, app_dir: Path, run_config: str | None = None) -> int:
        args = ["run", str(app_dir), "local-test", "--format", "json"]
        if run_config:
            args += ["--run-config", run_config]
        cp = self.flwr(*args)
        # NB: `flwr run --format json` exits 0 even on failure -> check "success"
        try:
            payload = json.loads(cp.stdout)
        except json.JSONDecodeError:
            payload = {}
        if cp.returncode != 0 or not payload.get("success"):
            raise RuntimeError(f"flwr run failed: {cp.stdout}\n{cp.stderr}")
        return int(payload["run-id"])

    def online_nodes(self) -> list[int]:
        cp = self.flwr("supernode", "ls", "local-test", "--format", "json")
        payload = json.loads(cp.stdout) if cp.stdout.strip() else {}
        return [int(n["node-id"]) for n in payload.get("nodes", []) if n["status"] == "online"]

    def wait_nodes(self, n: int, timeout: float = 120.0) -> list[int]:
        deadline = time.time() + timeout
        nodes: list[int] = []
        while time.time() < deadline:
            nodes = self.online_nodes()
            if len(nodes) >= n:
                return nodes
            time.sleep(0.5)
        raise TimeoutError(f"only {len(nodes)}/{n} SuperNodes online after {timeout}s")

    def run_status(self, run_id: int) -> dict:
        cp = self.flwr("ls", "local-test", "--run-id", str(run_id), "--format", "json")
        if cp.returncode != 0:
            raise RuntimeError(f"flwr ls failed: {cp.stdout}\n{cp.stderr}")
        return json.loads(cp.stdout)["runs"][0]

    def wait_run(self, run_id: int, timeout: float, poll: float = 1.0) -> dict:
        deadline = time.time() + timeout
        st: dict = {}
        while time.time() < deadline:
            st = self.run_status(run_id)
            if st["status"].startswith("finished"):
                return st
            time.sleep(poll)
        raise TimeoutError(f"run {run_id} not finished after {timeout}s: {st}")

    def run_logs(self, run_id: int) -> str:
        cp = self.flwr("log", str(run_id), "local-test", "--show", timeout=30)
        return cp.stdout + cp.stderr

    # ---------------------------------------------------------- teardown
    def _remember(self, pids: list[int]) -> None:
        for pid in pids:
            self.seen_pids.setdefault(pid, _starttime(pid))

    def snapshot(self) -> None:
        for p in self.procs.values():
            self._remember([p.pid, *descendants(p.pid)])

    def crash_supernode(self, idx: int) -> list[int]:
        """SIGKILL only the supernode PID (simulated crash). Returns its tree.

        Its flower-superexec exits within ~0.2 s (parent-pid monitor) but a running
        flwr-clientapp can linger (~1 min of HTTP retries): remember it for stop().
        """
        name = f"supernode{idx}"
        p = self.procs.pop(name)
        tree = [p.pid, *descendants(p.pid)]
        self._remember(tree)
        os.kill(p.pid, signal.SIGKILL)
        p.wait(timeout=5)
        return tree

    def crash_superlink(self) -> list[int]:
        """SIGKILL the SuperLink and everything it started (its ServerApp): a server machine's crash. Returns
        the tree; :meth:`start_superlink` starts it again on the same port."""
        p = self.procs.pop("superlink")
        tree = [p.pid, *descendants(p.pid)]
        self._remember(tree)
        for pid in tree:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        p.wait(timeout=5)
        return tree

    def stop(self) -> None:
        self.snapshot()
        # stop supernodes first, then the superlink (each with its process tree)
        for name in sorted(self.procs, key=lambda n: n == "superlink"):
            p = self.procs[name]
            kill_tree(p.pid)
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=5)
        self.procs.clear()
        for pid, start in self.seen_pids.items():  # orphans (re-parented to PID 1 or to us)
            if _alive(pid) and _starttime(pid) == start:  # same process, not a reused PID
                kill_tree(pid, grace=2.0)
        # a node that exited by itself (e.g. refused by the SuperLink) before any snapshot left its SuperExec
        # without a parent we knew: found by its FLWR_HOME
        for pid in homed_under(self.workdir):
            kill_tree(pid, grace=2.0)
        reap_orphans()
        if hasattr(self, "socket_dir"):
            shutil.rmtree(self.socket_dir, ignore_errors=True)

    def __enter__(self) -> FlowerDeployment:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
