"""The guest shim: starts the entrypoint with a local HTTP proxy that leads only
to the broker.

``python3 -m proctor_guest.shim -- ENTRYPOINT...`` listens on 127.0.0.1 (the
sandbox's own loopback, the only network it has), points ``HTTP_PROXY``,
``HTTPS_PROXY`` and ``ALL_PROXY`` at itself, and runs the entrypoint. Each
proxy connection is bridged to the broker's Unix socket with the run's token
added to its request head; the broker decides, records, and answers. The shim
itself decides nothing: everything it could get wrong, the broker checks.
"""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable

from .protocol import SOCKET_ENV, SOCKET_PATH, TOKEN_ENV, TOKEN_HEADER

PORT_ENV = "PROCTOR_PROXY_PORT"
DEFAULT_PORT = 3128
_MAX_HEAD = 64 * 1024
_UNAVAILABLE_BODY = (
    b'{"error": "broker_unavailable", "message": "the broker is gone", "policies": []}'
)
_UNAVAILABLE = (
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
    b"Connection: close\r\nContent-Length: "
    + str(len(_UNAVAILABLE_BODY)).encode()
    + b"\r\n\r\n"
    + _UNAVAILABLE_BODY
)


_CHUNK = 1 << 20


def _pump(src: socket.socket, dst: socket.socket) -> None:
    try:
        if not _spliced(src, dst):
            while data := src.recv(_CHUNK):
                dst.sendall(data)
    except OSError:
        pass
    finally:
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)


def _pump_then(src: socket.socket, dst: socket.socket, done: threading.Event) -> None:
    try:
        _pump(src, dst)
    finally:
        done.set()


def _spliced(src: socket.socket, dst: socket.socket) -> bool:
    """Move ``src``'s bytes to ``dst`` in the kernel (splice through a pipe) until
    ``src`` ends; False, before a byte is moved, where splice cannot be used."""
    splice = getattr(os, "splice", None)
    if splice is None:
        return False
    # The pipe keeps its default size: gVisor (runsc 20221219) corrupts a tunnel's
    # bytes spliced through a pipe grown to 1 MiB (tests/e2e/test_shim_tunnel.py).
    r, w = os.pipe()
    try:
        try:
            n = splice(src.fileno(), w, _CHUNK)
        except OSError:
            return False  # EINVAL where this kernel cannot splice these sockets
        while n:
            left = n
            while left:
                left -= splice(r, dst.fileno(), left)
            n = splice(src.fileno(), w, _CHUNK)
        return True
    finally:
        os.close(r)
        os.close(w)


class _Workers:
    """Threads kept for the next connection: a connection costs a hand-off through
    a queue, not two thread starts (each ~0.1 ms on a busy 2-core host, on a path
    whose whole budget is about a millisecond). A worker idle for ``idle`` seconds
    ends, so a burst of connections does not leave its threads behind."""

    def __init__(self, idle: float = 30.0) -> None:
        self._idle_after = idle
        self._tasks: queue.SimpleQueue[tuple[Callable[..., None], tuple[object, ...]]] = (
            queue.SimpleQueue()
        )
        self._lock = threading.Lock()
        self._idle = 0  # workers waiting on the queue, less the tasks put for them

    def submit(self, fn: Callable[..., None], *args: object) -> None:
        with self._lock:
            if self._idle:
                self._idle -= 1
                # Put under the lock: a worker that timed out takes the lock before
                # it leaves, and finds this task.
                self._tasks.put((fn, args))
                return
        threading.Thread(target=self._work, args=(fn, args), daemon=True).start()

    def _work(self, fn: Callable[..., None], args: tuple[object, ...]) -> None:
        while True:
            with contextlib.suppress(Exception):
                fn(*args)
            with self._lock:
                self._idle += 1
            try:
                fn, args = self._tasks.get(timeout=self._idle_after)
            except queue.Empty:
                with self._lock:
                    try:
                        fn, args = self._tasks.get_nowait()
                    except queue.Empty:
                        self._idle -= 1
                        return


_WORKERS = _Workers()


def _bridge(client: socket.socket, broker_path: str, token: str) -> None:
    with client:
        head = b""
        try:
            while b"\r\n\r\n" not in head:
                chunk = client.recv(65536)
                if not chunk:
                    return
                head += chunk
                if len(head) > _MAX_HEAD:
                    return
        except OSError:
            return
        line_end = head.index(b"\r\n")
        header = f"\r\n{TOKEN_HEADER}: ".encode()
        head = head[:line_end] + header + token.encode() + head[line_end:]
        upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            upstream.connect(broker_path)
        except OSError:
            upstream.close()
            with contextlib.suppress(OSError):
                client.sendall(_UNAVAILABLE)
            return
        with upstream:
            upstream.sendall(head)
            back = threading.Event()
            _WORKERS.submit(_pump_then, upstream, client, back)
            _pump(client, upstream)
            back.wait()


def serve(listener: socket.socket, broker_path: str, token: str) -> None:
    while True:
        try:
            client, _ = listener.accept()
        except OSError:
            return
        # Answers go out as they come (a head, then its body): with Nagle's algorithm
        # the second small write waits for the client's delayed ACK, 40 ms, on every
        # answer of a kept-alive connection.
        with contextlib.suppress(OSError):
            client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        _WORKERS.submit(_bridge, client, broker_path, token)


def main(argv: list[str]) -> int:
    if argv[:1] == ["--"]:
        argv = argv[1:]
    if not argv:
        print("usage: python3 -m proctor_guest.shim -- ENTRYPOINT...", file=sys.stderr)
        return 2
    broker_path = os.environ.get(SOCKET_ENV, SOCKET_PATH)
    token = os.environ.get(TOKEN_ENV, "")
    port = int(os.environ.get(PORT_ENV, str(DEFAULT_PORT)))
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", port))
    listener.listen(64)
    threading.Thread(target=serve, args=(listener, broker_path, token), daemon=True).start()
    proxy = f"http://127.0.0.1:{port}"
    env = dict(os.environ)
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY"):
        env[name] = env[name.lower()] = proxy
    # Nothing bypasses the proxy, loopback included: there is nothing else there.
    env["NO_PROXY"] = env["no_proxy"] = ""
    try:
        child = subprocess.Popen(argv, env=env)
    except OSError as exc:
        print(f"proctor shim: cannot start {argv[0]}: {exc}", file=sys.stderr)
        return 127

    def forward(signum: int, _frame: object) -> None:
        child.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    code = child.wait()
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
