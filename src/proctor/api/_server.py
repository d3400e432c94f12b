"""Run the API under uvicorn in a thread, so that ``proctor serve`` (and tests) can
start it beside the supervisor and stop it cleanly."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import uvicorn

from proctor.api._app import create_app
from proctor.api._auth import OIDCIssuer
from proctor.api._context import Limits
from proctor.errors import ProctorError, UsageError
from proctor.runtime import Runtime

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8470


class ApiServer:
    """A running API server. ``url`` is where it listens (the real port when 0 was
    asked); ``stop()`` finishes in-flight requests, then returns."""

    def __init__(self, server: uvicorn.Server, thread: threading.Thread, sock: socket.socket,
                 scheme: str) -> None:  # fmt: skip
        self._server = server
        self._thread = thread
        self._sock = sock
        host, port = sock.getsockname()[:2]
        self.host: str = host
        self.port: int = port
        shown = f"[{host}]" if ":" in host else host
        self.url = f"{scheme}://{shown}:{port}"

    def stop(self, timeout: float = 10.0) -> None:
        self._server.should_exit = True
        self._thread.join(timeout)
        self._sock.close()

    def __enter__(self) -> ApiServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def serve_api(
    rt: Runtime,
    host: str = DEFAULT_HOST,
    port: int = DEFAULT_PORT,
    *,
    certfile: Path | None = None,
    keyfile: Path | None = None,
    oidc: Sequence[OIDCIssuer] = (),
    limits: Limits | None = None,
    supervisor: Any = None,
    backend: str | None = None,
    log_level: str = "warning",
    worker_threads: int = 40,
) -> ApiServer:
    """Start serving the API over ``rt`` in a background thread and return once it
    accepts connections. TLS when ``certfile`` and ``keyfile`` are given (both or
    neither). The socket is bound here, so a port in use fails now, in the caller."""
    if (certfile is None) != (keyfile is None):
        raise UsageError("TLS needs both a certificate and its key")
    app = create_app(
        rt,
        oidc=oidc,
        limits=limits,
        supervisor=supervisor,
        backend=backend,
        worker_threads=worker_threads,
    )
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP named explicitly: asyncio sets TCP_NODELAY on accepted connections
    # only when the socket says so, and without it Nagle's algorithm meets delayed
    # ACKs and every response waits 40 ms.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ProctorError(f"cannot listen on {host}:{port}: {exc.strerror}") from exc
    config = uvicorn.Config(
        app,
        log_level=log_level,
        ssl_certfile=str(certfile) if certfile else None,
        ssl_keyfile=str(keyfile) if keyfile else None,
        access_log=False,
        server_header=False,
        # Enough for 64 clients without queueing in the kernel backlog.
        backlog=512,
        timeout_keep_alive=30,
        # A client that keeps its connection open must not hold up stop() for long.
        timeout_graceful_shutdown=5,
    )
    server = uvicorn.Server(config)
    # In a thread uvicorn leaves signals alone: the caller (``proctor serve``) owns them.
    thread = threading.Thread(
        target=server.run, kwargs={"sockets": [sock]}, name="proctor-api", daemon=True
    )
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            sock.close()
            raise ProctorError("the API server did not start (see the log above)")
        time.sleep(0.01)
    return ApiServer(server, thread, sock, "https" if certfile else "http")
