"""A warm worker for a SuperNode: the node's ClientApp kept loaded between messages.

Flower starts a fresh ``flwr-clientapp`` process for every message a SuperNode receives, and our ClientApp
spends seconds of CPU there importing torch and Lightning and rebuilding the run from its config, every
round. A node's operator can instead start one long-lived worker beside ``flower-supernode``::

    python -m lightning_fl.flower.worker --socket /run/user/1000/lfl-node0.sock &
    flower-supernode ... --node-config "partition-id=0 worker='/run/user/1000/lfl-node0.sock'"

The worker keeps torch, Lightning and each run it built (model, data, Fabric; the two most recent runs) in
memory; the ClientApp Flower starts per message (:mod:`lightning_fl.flower.client`) imports no torch and hands
the message and the node's context to the worker, which runs the node's app (:mod:`lightning_fl.flower.node`)
on them exactly as that process would have and sends back the reply and the context's state (the node's
codec memory and SecAgg+ state stay in Flower's context, as without a worker, so a restarted worker loses
nothing).

Safety. The worker listens on a Unix socket only, created owner-only (mode 0600), and serves a connection only
if the peer process runs as the worker's own user (the kernel's ``SO_PEERCRED``; where a platform lacks it, the
socket's folder must be the user's own and closed to others, 0700). The proxy, in turn, talks only to a socket
owned by its own user. A request is three length-prefixed frames (a version tag, a Flower ``Message`` and a
``Context`` in Flower's own protobuf encoding, nothing unpickled), at most ``--max-message-mib`` each, read
with a timeout; whatever a request holds or the app raises is answered with an error and the worker goes on
serving. It trusts what its user's processes send as much as the SuperNode itself does: it is the node's own
ClientApp, moved to a process that stays.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import stat
import struct
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from flwr.app import Context, Message
from flwr.common import serde
from flwr.proto.message_pb2 import Context as ContextProto
from flwr.proto.message_pb2 import Message as MessageProto
from flwr.proto.recorddict_pb2 import RecordDict as RecordDictProto

VERSION = b"lightning_fl.worker/1"
OK, ERROR = b"ok", b"error"
HEADER = struct.Struct(">Q")  # a frame: its length (8 bytes, big-endian), then its bytes
MAX_FRAME = 1024 * 2**20  # bytes of one frame, unless --max-message-mib says otherwise
READ_TIMEOUT = 60.0  # seconds a peer may pause while sending a request
CONNECT_TIMEOUT = 10.0  # seconds the proxy waits to connect


class WorkerError(RuntimeError):
    """The worker could not be reached, or could not serve a message (the reason is the worker's)."""


# ============================================================================================ frames
def send_frames(conn: socket.socket, *frames: bytes) -> None:
    conn.sendall(b"".join(HEADER.pack(len(f)) + f for f in frames))


def read_exactly(conn: socket.socket, size: int) -> bytes:
    chunks, left = [], size
    while left:
        chunk = conn.recv(min(left, 1 << 20))
        if not chunk:
            raise ConnectionError(f"the peer closed the connection with {left} of {size} bytes still to come")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def read_frames(conn: socket.socket, count: int, max_frame: int = MAX_FRAME) -> list[bytes]:
    frames = []
    for _ in range(count):
        (size,) = HEADER.unpack(read_exactly(conn, HEADER.size))
        if size > max_frame:
            raise ValueError(f"a frame of {size} bytes is over the limit of {max_frame} (--max-message-mib)")
        frames.append(read_exactly(conn, size))
    return frames


# ============================================================================================ the proxy's side
def forward(path: str, message: Message, context: Context) -> Message:
    """Have the worker at ``path`` run the node's app on ``message``; its reply, with ``context.state`` updated."""
    sock = Path(path)
    try:
        info = sock.stat()
    except OSError as err:
        raise WorkerError(_unreachable(path, f"no worker socket there ({err.strerror})")) from err
    if not stat.S_ISSOCK(info.st_mode) or info.st_uid != os.getuid():
        raise WorkerError(_unreachable(path, "it is not a socket owned by this node's user"))
    request = serde.message_to_proto(message).SerializeToString()
    state = serde.context_to_proto(context).SerializeToString()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.settimeout(CONNECT_TIMEOUT)
        try:
            conn.connect(path)
        except OSError as err:
            raise WorkerError(_unreachable(path, f"connecting failed ({err})")) from err
        conn.settimeout(None)  # training takes as long as it takes; the server's round-timeout bounds the round
        try:
            send_frames(conn, VERSION, request, state)
            (status,) = read_frames(conn, 1)
            if status != OK:
                (reason,) = read_frames(conn, 1)
                raise WorkerError(reason.decode("utf-8", "replace"))
            reply_bytes, state_bytes = read_frames(conn, 2, max_frame=2**63)
        except (OSError, ConnectionError) as err:
            raise WorkerError(f"the worker at {path} stopped answering ({err}); see its log") from err
    reply = serde.message_from_proto(MessageProto.FromString(reply_bytes))
    for key in list(context.state.keys()):
        del context.state[key]
    for key, value in serde.recorddict_from_proto(RecordDictProto.FromString(state_bytes)).items():
        context.state[key] = value
    return Message(reply.error if reply.has_error() else reply.content, reply_to=message)


def _unreachable(path: str, why: str) -> str:
    return (
        f"node config worker={path!r}: {why}; start `python -m lightning_fl.flower.worker --socket {path}` "
        "beside flower-supernode as this node's user, or drop 'worker' from the node config"
    )


# ============================================================================================ the worker
class Worker:
    """Serve the node's app on a Unix socket; :meth:`serve_one` handles one connection.

    Args:
        path: The socket's path (created owner-only; an existing stale socket is replaced, a live one refused).
        app: What runs a message (default: the node's ClientApp, :data:`lightning_fl.flower.node.app`).
        max_frame: Largest frame accepted, in bytes.
        read_timeout: Seconds a peer may pause while sending its request.
    """

    def __init__(
        self,
        path: str,
        app: Callable[[Message, Context], Message] | None = None,
        max_frame: int = MAX_FRAME,
        read_timeout: float = READ_TIMEOUT,
    ) -> None:
        self.path, self.max_frame, self.read_timeout = str(path), max_frame, read_timeout
        if app is None:
            from lightning_fl.flower.node import app
        self.app = app
        self.served, self.closed = 0, False
        self.sock = self._listen()

    def _listen(self) -> socket.socket:
        path = Path(self.path)
        if not hasattr(socket, "SO_PEERCRED"):  # no peer check: the folder must keep others out
            folder = path.parent.stat()
            if folder.st_uid != os.getuid() or folder.st_mode & 0o077:
                raise WorkerError(f"{path.parent} must be yours and closed to others (chmod 700) on this platform")
        if path.exists() or path.is_symlink():
            if not stat.S_ISSOCK(path.lstat().st_mode):
                raise WorkerError(f"{path} exists and is not a socket; choose another --socket path")
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
                if probe.connect_ex(self.path) == 0:
                    raise WorkerError(f"another worker already serves {path}")
            path.unlink()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)
        try:
            sock.bind(self.path)
        finally:
            os.umask(old)
        os.chmod(self.path, 0o600)
        sock.listen(8)
        return sock

    def close(self) -> None:
        """Stop serving (a :meth:`serve_forever` in another thread returns) and remove the socket."""
        self.closed = True
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes a blocked accept()
        self.sock.close()
        try:
            if stat.S_ISSOCK(os.lstat(self.path).st_mode):
                os.unlink(self.path)
        except FileNotFoundError:
            pass

    def serve_forever(self) -> None:
        """Serve connections one at a time (a SuperNode runs one message at a time) until :meth:`close`."""
        while not self.closed:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                if self.closed:
                    return
                raise
            with conn:
                self.serve_one(conn)

    def serve_one(self, conn: socket.socket) -> None:
        """Answer one request on ``conn``; never raises for what the peer sends or the app does."""
        peer = _peer_uid(conn)
        if peer is not None and peer != os.getuid():
            _log(f"refused a connection from user {peer} (this worker serves user {os.getuid()} only)")
            return
        conn.settimeout(self.read_timeout)
        started = time.monotonic()
        try:
            version, message_bytes, context_bytes = read_frames(conn, 3, self.max_frame)
            if version != VERSION:
                raise ValueError(f"unknown protocol {version[:40]!r} (this worker speaks {VERSION.decode()})")
            message = serde.message_from_proto(MessageProto.FromString(message_bytes))
            context = serde.context_from_proto(ContextProto.FromString(context_bytes))
        except Exception as err:  # a broken request: say why, keep serving
            _log(f"refused a malformed request: {type(err).__name__}: {str(err)[:300]}")
            _answer_error(conn, f"malformed request: {type(err).__name__}: {str(err)[:300]}")
            return
        conn.settimeout(None)
        try:
            reply = self.app(message, context)
            frames = (
                serde.message_to_proto(reply).SerializeToString(),
                serde.recorddict_to_proto(context.state).SerializeToString(),
            )
        except Exception as err:  # the app's exception: the proxy raises it, as the ClientApp would have
            _log(
                f"{message.metadata.message_type} (round {message.metadata.group_id or '-'}): "
                f"{type(err).__name__}: {str(err)[:300]}"
            )
            _answer_error(conn, f"{type(err).__name__}: {err}")
            return
        try:
            send_frames(conn, OK, *frames)
        except OSError as err:
            _log(f"could not send the reply: {err}")
            return
        self.served += 1
        _log(
            f"{message.metadata.message_type} (round {message.metadata.group_id or '-'}) served in "
            f"{time.monotonic() - started:.2f} s"
        )


def _peer_uid(conn: socket.socket) -> int | None:
    if not hasattr(socket, "SO_PEERCRED"):
        return None
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", creds)[1]


def _answer_error(conn: socket.socket, reason: str) -> None:
    with contextlib.suppress(OSError):
        send_frames(conn, ERROR, reason.encode("utf-8", "replace"))


def _log(line: str) -> None:
    print(f"[lightning_fl.flower.worker] {line}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m lightning_fl.flower.worker",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--socket", required=True, help="the Unix socket path the node config's 'worker' names")
    parser.add_argument(
        "--max-message-mib",
        type=float,
        default=MAX_FRAME / 2**20,
        help="largest message accepted, MiB (default: %(default)g)",
    )
    args = parser.parse_args(argv)
    if not args.max_message_mib > 0:
        _fail(f"--max-message-mib must be above 0, got {args.max_message_mib}")
    try:
        worker = Worker(args.socket, max_frame=int(args.max_message_mib * 2**20))
    except (WorkerError, OSError) as err:
        _fail(f"--socket {args.socket}: {err}")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    _log(f"serving {args.socket} (pid {os.getpid()})")
    try:
        worker.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        worker.close()


def _fail(message: str) -> Any:
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


if __name__ == "__main__":
    main()
