"""Run the API under uvicorn in a thread, so that ``proctor serve`` (and tests) can
start it beside the supervisor and stop it cleanly."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from proctor.api._app import create_app
from proctor.api._auth import OIDCIssuer
from proctor.api._context import Limits
from proctor.api._limits import WINDOW, ConnectionGate
from proctor.errors import ProctorError, UsageError
from proctor.ledger import Actor
from proctor.runtime import Runtime

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8470


def raise_open_files_limit() -> int:
    """Raise this process's soft limit of open descriptors to its hard limit (each
    connection holds one); returns the soft limit now."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
    return soft if soft != resource.RLIM_INFINITY else 1 << 20


class _GatedH11(H11Protocol):
    """uvicorn's HTTP/1.1 protocol behind a :class:`ConnectionGate`: a connection over
    its address's or the server's bound is closed before a byte is read, and one
    that sends nothing before the first-byte timeout is closed; both are counted."""

    gate: ConnectionGate
    _flush: asyncio.TimerHandle | None = None
    _source: str | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        source = self.client[0] if self.client else "unknown"
        if not self.gate.admit(source):
            transport.abort()
            self._schedule_record()
            return
        self._source = source
        # The keep-alive timer doubles as the first-byte timeout: any byte cancels it.
        self.timeout_keep_alive_task = self.loop.call_later(
            self.gate.first_byte, self._first_byte_timeout
        )

    def _first_byte_timeout(self) -> None:
        self.gate.idle()
        self._schedule_record()
        self.timeout_keep_alive_handler()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._source is not None:
            self.gate.release(self._source)
            self._source = None
        super().connection_lost(exc)

    def _schedule_record(self) -> None:
        cls = type(self)
        if cls._flush is None:
            cls._flush = self.loop.call_later(WINDOW, cls._record, self.loop)

    @classmethod
    def _record(cls, loop: asyncio.AbstractEventLoop) -> None:
        cls._flush = None
        # The ledger append blocks (fsync): off the loop.
        loop.run_in_executor(None, cls.gate.record)


class ApiServer:
    """A running API server. ``url`` is where it listens (the real port when 0 was
    asked); ``stop()`` finishes in-flight requests, then returns."""

    def __init__(self, server: uvicorn.Server, thread: threading.Thread, sock: socket.socket,
                 scheme: str) -> None:  # fmt: skip
        self._server = server
        self._thread = thread
        self._sock = sock
        self.gate: ConnectionGate | None = None
        host, port = sock.getsockname()[:2]
        self.host: str = host
        self.port: int = port
        shown = f"[{host}]" if ":" in host else host
        self.url = f"{scheme}://{shown}:{port}"

    def stop(self, timeout: float = 10.0) -> None:
        state = getattr(self._server.config.app, "state", None)
        if state is not None and hasattr(state, "proctor"):
            # Runs first: their streamed answers end, so the graceful shutdown below
            # does not wait out its timeout on them.
            state.proctor.stop_own_runs()
        self._server.should_exit = True
        self._thread.join(timeout)
        self._sock.close()
        if self.gate is not None:
            self.gate.record()  # what is still only counted

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
    json_log: bool = False,
    public_logs: Sequence[str] = (),
) -> ApiServer:
    """Start serving the API over ``rt`` in a background thread and return once it
    accepts connections. TLS when ``certfile`` and ``keyfile`` are given (both or
    neither). The socket is bound here, so a port in use fails now, in the caller.
    ``json_log``: uvicorn keeps the log handlers ``proctor serve`` set up (JSON lines)
    instead of installing its own. ``public_logs``: tenants whose tlog-tiles read paths
    are served without a token."""
    if (certfile is None) != (keyfile is None):
        raise UsageError("TLS needs both a certificate and its key")
    app = create_app(
        rt,
        oidc=oidc,
        limits=limits,
        supervisor=supervisor,
        backend=backend,
        worker_threads=worker_threads,
        public_logs=public_logs,
    )
    limits = limits or Limits()
    # A connection is a descriptor: raise the soft limit, bound connections below it.
    nofile = raise_open_files_limit()
    gate = ConnectionGate(
        rt.ledger,
        limits.connections_per_source,
        limits.connections_total or max(256, nofile // 4),
        limits.first_byte_timeout,
        Actor("runtime", "proctor-api"),
    )
    protocol = type("GatedH11", (_GatedH11,), {"gate": gate})
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
        log_config=None if json_log else uvicorn.config.LOGGING_CONFIG,
        ssl_certfile=str(certfile) if certfile else None,
        ssl_keyfile=str(keyfile) if keyfile else None,
        access_log=False,
        http=protocol,
        server_header=False,
        # Enough for 64 clients without queueing in the kernel backlog, and also how
        # many connections asyncio accepts at a time: a flood refused costs at most
        # that many descriptors at once.
        backlog=128,
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
    api = ApiServer(server, thread, sock, "https" if certfile else "http")
    api.gate = gate
    return api
