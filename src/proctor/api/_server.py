"""Run the API under uvicorn in a thread, so that ``proctor serve`` (and tests) can
start it beside the supervisor and stop it cleanly."""

from __future__ import annotations

import asyncio
import contextlib
import math
import socket
import ssl
import threading
import time
from asyncio.sslproto import SSLProtocol
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from proctor.api._app import create_app
from proctor.api._auth import OIDCIssuer
from proctor.api._context import Limits
from proctor.api._limits import CONNECTION, WINDOW, ConnectionGate, Held, gate_bounds
from proctor.api._metrics_route import read_metrics_token
from proctor.console import ConsoleConfig
from proctor.errors import ProctorError, UsageError
from proctor.ledger import Actor
from proctor.runtime import Runtime

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8470
#: Seconds an idle kept-alive connection is held (uvicorn's default).
KEEP_ALIVE = 5


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


class _Tcp:
    """One TCP connection under the gate, from its accept (before a byte is read, and
    before a TLS handshake) to its close: its place in the gate, and the one timer that
    bounds how long it may wait for a request head. Loop thread only."""

    __slots__ = ("_bytes", "_deadline", "_timer", "held", "loop", "transport")

    def __init__(self, loop: asyncio.AbstractEventLoop, transport: asyncio.Transport) -> None:
        self.loop = loop
        self.transport = transport
        self.held: Held | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._bytes = False
        self._deadline = 0.0

    def admit(self, gate: ConnectionGate) -> bool:
        peer = self.transport.get_extra_info("peername")
        source = str(peer[0]) if isinstance(peer, tuple) and peer else "unknown"
        self.held = gate.admit(source, self._abort)
        if gate.pending():  # this one refused, or an older one closed to make room
            _schedule_record(gate, self.loop)
        if self.held is None:
            self.transport.abort()  # unread: its descriptor is freed at once
            return False
        self.awaiting_head()
        return True

    def _abort(self) -> None:
        self.transport.abort()

    def awaiting_head(self) -> None:
        """A request head is due (the connection opened, or a response ended): it must
        start within the first-byte timeout and be whole within the head timeout."""
        gate = self._gate()
        now = self.loop.time()
        self._bytes = False
        self._deadline = now + gate.head
        self._arm(now + gate.first_byte)

    def saw_bytes(self) -> None:
        self._bytes = True

    def head_complete(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _arm(self, when: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = self.loop.call_at(when, self._expired)

    def _expired(self) -> None:
        self._timer = None
        if self.held is None or not self.held.open:
            return
        if self._bytes and self.loop.time() < self._deadline:
            self._arm(self._deadline)  # bytes came: the head's whole deadline applies
            return
        gate = self._gate()
        gate.closed("slow_head" if self._bytes else "idle")
        _schedule_record(gate, self.loop)
        self.transport.abort()

    def lost(self) -> None:
        self.head_complete()
        if self.held is not None:
            self.held.gate.release(self.held)

    def _gate(self) -> ConnectionGate:
        assert self.held is not None
        return self.held.gate


def _schedule_record(gate: ConnectionGate, loop: asyncio.AbstractEventLoop) -> None:
    """One ``api.connections.refused`` event per window of closes, written off the loop
    (the ledger append fsyncs)."""
    if gate.record_due:
        return
    gate.record_due = True

    def flush() -> None:
        gate.record_due = False
        loop.run_in_executor(None, gate.record)

    loop.call_later(WINDOW, flush)


class _OnConnection:
    """The app as one connection's requests see it: :data:`CONNECTION` names the
    connection while a request runs, so that authenticating a principal on it (in
    ``PrincipalLimits.admit``) can keep it from being closed to make room."""

    __slots__ = ("app", "held")

    def __init__(self, app: Any, held: Held) -> None:
        self.app = app
        self.held = held

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        token = CONNECTION.set(self.held)
        try:
            await self.app(scope, receive, send)
        finally:
            CONNECTION.reset(token)


class _GatedH11(H11Protocol):
    """uvicorn's HTTP/1.1 protocol behind a :class:`ConnectionGate`. Over plain TCP it
    is the socket's protocol and admits the connection itself; under TLS the
    :class:`_GatedTLS` below it has admitted the connection at accept."""

    gate: ConnectionGate
    _tcp: _Tcp | None = None
    _refused = False
    made = False  # connection_made: under TLS, once the handshake is done

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        if self._tcp is None:
            tcp = _Tcp(self.loop, transport)
            if not tcp.admit(self.gate):
                self._refused = True
                return
            self._tcp = tcp
        super().connection_made(transport)
        self.made = True
        assert self._tcp.held is not None
        self.app = _OnConnection(self.app, self._tcp.held)

    def data_received(self, data: bytes) -> None:
        if self._tcp is not None:
            self._tcp.saw_bytes()
        super().data_received(data)

    def handle_events(self) -> None:
        cycle = self.cycle
        super().handle_events()
        if self.cycle is not cycle and self._tcp is not None:
            self._tcp.head_complete()  # a request head was parsed whole

    def on_response_complete(self) -> None:
        if self._tcp is not None and not self.transport.is_closing():
            self._tcp.awaiting_head()  # a kept-alive connection: the next head is due
        super().on_response_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._refused:
            return
        if self._tcp is not None:
            self._tcp.lost()
        super().connection_lost(exc)


class _GatedTLS(SSLProtocol):
    """TLS under the gate: asyncio would hand a connection to the HTTP protocol only
    after its handshake, so a client that never finishes one was held (60 s each,
    without bound) before any gate saw it. This wraps the HTTP protocol at accept."""

    def __init__(self, h11: _GatedH11, context: ssl.SSLContext, loop: asyncio.AbstractEventLoop
                 ) -> None:  # fmt: skip
        gate = h11.gate
        super().__init__(
            loop,
            h11,
            context,
            None,  # type: ignore[arg-type]  # no one waits on the handshake
            server_side=True,
            ssl_handshake_timeout=math.ceil(gate.head),
        )
        self._h11 = h11
        self._gate = gate
        self._tcp: _Tcp | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        tcp = _Tcp(self._h11.loop, cast(asyncio.Transport, transport))
        if not tcp.admit(self._gate):
            return
        self._tcp = self._h11._tcp = tcp
        # uvicorn's shutdown closes what is in this set: a handshake in progress too.
        self._h11.connections.add(cast(Any, self))
        super().connection_made(transport)

    def buffer_updated(self, nbytes: int) -> None:
        if self._tcp is not None:
            self._tcp.saw_bytes()
        super().buffer_updated(nbytes)

    def connection_lost(self, exc: BaseException | None) -> None:
        if self._tcp is None:
            return  # refused at accept
        self._tcp.lost()
        self._h11.connections.discard(cast(Any, self))
        super().connection_lost(exc)

    def shutdown(self) -> None:
        """uvicorn's shutdown: a connection still in its handshake is closed; one past
        it is closed by its HTTP protocol."""
        if self._tcp is not None and not self._h11.made:
            self._tcp.transport.abort()


def _protocol_factory(gate: ConnectionGate, context: ssl.SSLContext | None) -> Any:
    protocol = type("GatedH11", (_GatedH11,), {"gate": gate})

    def make(config: uvicorn.Config, server_state: Any, app_state: dict[str, Any],
             _loop: asyncio.AbstractEventLoop | None = None) -> asyncio.BaseProtocol:  # fmt: skip
        h11: _GatedH11 = protocol(
            config=config, server_state=server_state, app_state=app_state, _loop=_loop
        )
        if context is None:
            return h11
        return _GatedTLS(h11, context, h11.loop)

    return make


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


def _read_pem(path: Path, what: str, flag: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise UsageError(
            f"cannot read the TLS {what} {path}: {exc.strerror or exc}",
            hint=f"give {flag} the path of a readable PEM file",
        ) from None


def check_tls(certfile: Path | None, keyfile: Path | None) -> ssl.SSLContext:
    """The API's server-side TLS context from a PEM certificate (its chain may
    follow it) and its unencrypted PEM key. What cannot be used is one
    :class:`UsageError` that names the file and what is wrong with it, never
    OpenSSL's "PEM lib"; an encrypted key is refused rather than prompted for."""
    from cryptography import x509
    from cryptography.exceptions import UnsupportedAlgorithm
    from cryptography.hazmat.primitives import serialization

    if certfile is None or keyfile is None:
        raise UsageError("TLS needs both a certificate and its key",
                         hint="give --tls-cert and --tls-key together")  # fmt: skip
    cert_pem = _read_pem(certfile, "certificate", "--tls-cert")
    key_pem = _read_pem(keyfile, "key", "--tls-key")
    try:
        x509.load_pem_x509_certificates(cert_pem)
    except ValueError:
        raise UsageError(f"{certfile} is not a PEM certificate",
                         hint="--tls-cert takes a PEM file with a "
                              "-----BEGIN CERTIFICATE----- block") from None  # fmt: skip
    try:
        serialization.load_pem_private_key(key_pem, password=None)
    except TypeError:  # cryptography: "Password was not given but private key is encrypted"
        raise UsageError(f"{keyfile} is an encrypted private key",
                         hint="give the key unencrypted (e.g. `openssl pkey -in KEY -out "
                              "KEY.plain`), readable by the serve user only") from None  # fmt: skip
    except (ValueError, UnsupportedAlgorithm):
        raise UsageError(f"{keyfile} is not a PEM private key",
                         hint="--tls-key takes a PEM file with a "
                              "-----BEGIN PRIVATE KEY----- (or RSA/EC PRIVATE KEY) block"
                         ) from None  # fmt: skip
    context = ssl.SSLContext(uvicorn.config.SSL_PROTOCOL_VERSION)
    try:
        # No password callback would make OpenSSL prompt on the terminal; the key
        # is known unencrypted by now, so this one is never asked.
        context.load_cert_chain(certfile, keyfile, password=lambda: b"")
    except ssl.SSLError as exc:
        if "KEY_VALUES_MISMATCH" in str(exc) or exc.reason == "KEY_VALUES_MISMATCH":
            raise UsageError(f"the key {keyfile} is not the key of the certificate {certfile}",
                             hint="give the private key the certificate was issued for"
                             ) from None  # fmt: skip
        raise UsageError(f"cannot use the TLS certificate {certfile} with the key {keyfile}: "
                         f"{exc.reason or exc}") from None  # fmt: skip
    except OSError as exc:
        raise UsageError(f"cannot read {certfile} or {keyfile}: {exc.strerror or exc}") from None
    context.verify_mode = ssl.CERT_NONE
    return context


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
    console: ConsoleConfig | None = None,
    metrics_token_file: Path | None = None,
) -> ApiServer:
    """Start serving the API over ``rt`` in a background thread and return once it
    accepts connections. TLS when ``certfile`` and ``keyfile`` are given (both or
    neither). The socket is bound here, so a port in use fails now, in the caller.
    ``json_log``: uvicorn keeps the log handlers ``proctor serve`` set up (JSON lines)
    instead of installing its own. ``public_logs``: tenants whose tlog-tiles read paths
    are served without a token. ``console``: serve the web console at ``/ui/``.
    ``metrics_token_file``: serve ``/metrics`` to the bearer of the token it holds."""
    # TLS is done under the gate (see _GatedTLS), not by uvicorn's listener. Made
    # first: a file that cannot be used fails before anything else is started.
    context = check_tls(certfile, keyfile) if certfile is not None or keyfile is not None else None
    metrics_token = read_metrics_token(metrics_token_file) if metrics_token_file else None
    app = create_app(
        rt,
        oidc=oidc,
        limits=limits,
        supervisor=supervisor,
        backend=backend,
        worker_threads=worker_threads,
        public_logs=public_logs,
        console=console,
        metrics_token=metrics_token,
    )
    limits = limits or Limits()
    # A connection is a descriptor: raise the soft limit, bound connections below it.
    nofile = raise_open_files_limit()
    bounds = gate_bounds(
        nofile,
        limits.connections_per_source,
        limits.connections_total,
        limits.first_byte_timeout,
        limits.head_timeout,
    )
    gate = ConnectionGate(rt.ledger, bounds, Actor("runtime", "proctor-api"))
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
        access_log=False,
        http=_protocol_factory(gate, context),
        # asyncio's own loop, not uvloop's (which uvicorn would pick, being installed
        # for the broker): the gate's bounds below are tuned to how it accepts.
        loop="asyncio",
        # No WebSocket route: an upgrade would leave the gate's head timer behind.
        ws="none",
        server_header=False,
        # Enough for 64 clients without queueing in the kernel backlog, and also how
        # many connections asyncio accepts at a time before the gate sees them: a
        # flood holds about three batches at once beyond the gate's bound (accepted,
        # being admitted, being closed), so an eighth of the limit at most each.
        backlog=max(16, min(128, nofile // 8)),
        # An idle kept-alive connection: uvicorn closes it quietly after 5 s (the head
        # timer would close it, counted, at the first-byte timeout).
        timeout_keep_alive=KEEP_ALIVE,
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
    api = ApiServer(server, thread, sock, "https" if context is not None else "http")
    api.gate = gate
    return api
