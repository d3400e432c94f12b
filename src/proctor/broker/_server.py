"""One asyncio server per runtime; one Unix socket per run.

The broker runs its event loop in a thread of its own, so the supervisor (and
the CLI) can open and close runs from ordinary code. A run's socket lives in a
private directory (0700) and is removed when the run closes; once the broker
stops, no socket remains and the sandbox has no way out at all.

Each request is charged to the run's call budget (:class:`RateLimit`) before it
is authenticated: over the limit it is answered 429 and only counted, so a
guest cannot flood the ledger with calls, nor with refusals of calls. Past the
run's bound of calls in all, or its tenant's ledger quota of the day, it is
answered 403, naming the one event that records that refusal.

Every other answer has its event in the run's ledger before it is sent. Each
connection is one call, served by the call pipeline (:mod:`._pipeline`: admit,
parse, decide, act, record, answer); this module owns the sockets, the
connections and their bounds. If an answer's event cannot be recorded, the
answer is 503 ``not_recorded`` instead.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import contextvars
import logging
import os
import shutil
import tempfile
import threading
import time
import uuid
from collections import deque
from collections.abc import Awaitable, Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from proctor.broker._admit import Gate
from proctor.broker._calls import KINDS, Call
from proctor.broker._pipeline import serve
from proctor.broker._scope import (
    DEFAULT_CALL_BOUND,
    BrokerError,
    CallRefused,
    LedgerDay,
    LedgerQuota,
    RateLimit,
    RunScope,
)
from proctor.broker._tokens import RunTokens
from proctor.broker._transparent import TRANSPARENT, TransparentEgress
from proctor.ledger import Action
from proctor.telemetry import metrics

if TYPE_CHECKING:
    from proctor.broker._proxy import EgressProxy
    from proctor.sandbox import GuestNetwork

log = logging.getLogger("proctor.broker")

#: Connections one run's socket holds at once; more are closed unread, and counted.
MAX_CONNECTIONS_PER_RUN = 64
#: A connection that sends no byte for this long is closed, and counted (no event each).
FIRST_BYTE_TIMEOUT = 10.0
#: At most one ``broker.connections.refused`` event per run per this many seconds.
REFUSED_WINDOW = 1.0
#: The rule named in a ``broker.connections.refused`` event.
CONNECTION_LIMIT_RULE = "proctor:broker:connection-limit"
MAX_OBJECT = 64 * 1024 * 1024
#: How long closing a run waits for its cancelled connections to finish writing.
_CLOSE_GRACE = 10.0

ConnectHandler = Callable[
    [RunScope, str, asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]
]
#: What it returns is not used (the proxy's says whether it kept the connection).
ForwardHandler = Callable[
    [RunScope, str, str, list[tuple[str, str]], asyncio.StreamReader, asyncio.StreamWriter],
    Awaitable[object],
]


@dataclass(frozen=True)
class Handlers:
    """What the broker is handed for the kinds of call it cannot make up itself:
    the egress calls (CONNECT, absolute-form HTTP).

    With ``proxy``, an :class:`EgressProxy` (:meth:`for_proxy`), its calls go
    stage by stage, with its resolver, tenant CAs and upstream trust; without
    one, ``connect`` and ``forward`` are a test's own, called as the act of the
    whole call. The SQL and file kinds are the broker's (``_connectors``,
    ``_files``), registered in :data:`._calls.KINDS`."""

    connect: ConnectHandler
    forward: ForwardHandler
    proxy: EgressProxy | None = None

    @classmethod
    def for_proxy(cls, proxy: EgressProxy) -> Handlers:
        """The egress calls served by ``proxy``'s stages."""
        return cls(connect=proxy.handle_connect, forward=proxy.handle_forward, proxy=proxy)


#: The dispatch table: everything the socket answers with 2xx, one registered call
#: kind each (:data:`._calls.KINDS`: method, path, what it does). Anything else is
#: refused (404 no such endpoint, 405 wrong method) and recorded. Transparent egress
#: is a kind too, but only a run's relay serves it: no request on the socket is one.
ENDPOINTS = tuple(k for k in KINDS if k is not TRANSPARENT)


#: How many calls' traces a broker keeps (for tests, benches and a person debugging).
TRACES_KEPT = 1024


@dataclass(frozen=True)
class CallTrace:
    """The stages one call passed, in order, and its kind."""

    run_id: str
    kind: str
    stages: tuple[str, ...]


@dataclass(frozen=True)
class RunChannel:
    """What a run's sandbox gets: the socket to expose, and the token to present."""

    run_id: str
    socket: Path
    token: str


def raise_open_files_limit() -> int:
    """Raise this process's soft limit of open descriptors to its hard limit (a
    server holds a descriptor per connection); returns the soft limit now."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
    return soft if soft != resource.RLIM_INFINITY else 1 << 20


@dataclass
class _Refused:
    """Connections a run's socket closed unread, counted until one event records them."""

    over_run: int = 0
    over_total: int = 0
    idle: int = 0
    total: int = 0
    first: float | None = None
    timer: asyncio.TimerHandle | None = None
    flushing: asyncio.Task[None] | None = None

    @property
    def pending(self) -> int:
        return self.over_run + self.over_total + self.idle


@dataclass
class _Run:
    scope: RunScope
    server: asyncio.AbstractServer
    socket: Path
    connections: set[asyncio.Task[None]]
    opening: str
    refused: _Refused = field(default_factory=_Refused)
    #: The run's transparent egress, once its network is attached.
    transparent: TransparentEgress | None = None


class Broker:
    """The runtime's broker. ``rate_limit`` is the call budget of every run whose
    scope names none of its own, ``call_bound`` its calls in all; they are read
    when a run opens. A tenant's ledger quota is counted once for all its runs."""

    def __init__(
        self,
        handlers: Handlers,
        token_key: bytes,
        socket_root: Path | None = None,
        *,
        rate_limit: RateLimit | None = None,
        call_bound: int = DEFAULT_CALL_BOUND,
        max_connections_per_run: int = MAX_CONNECTIONS_PER_RUN,
        max_connections: int | None = None,
    ):
        self._handlers = handlers
        self.max_connections_per_run = max_connections_per_run
        # Of the process's descriptors, the broker's connections may hold a quarter:
        # the API, the store, the ledger and the sandboxes need the rest.
        self.max_connections = max_connections or max(256, raise_open_files_limit() // 4)
        self._open_connections = 0
        self._tokens = RunTokens(token_key)
        self._gate = Gate(self._tokens)
        self.rate_limit = rate_limit or RateLimit()
        if isinstance(call_bound, bool) or not isinstance(call_bound, int) or call_bound < 1:
            raise BrokerError(f"a run's call bound must be a positive integer, not {call_bound!r}")
        self.call_bound = call_bound
        self._quotas: dict[str, LedgerQuota] = {}
        self._root = Path(tempfile.mkdtemp(prefix="proctor-broker-", dir=socket_root))
        self._root.chmod(0o700)
        self._runs: dict[str, _Run] = {}
        #: The stages the last calls passed, newest last (of every run; bounded).
        self.traces: deque[CallTrace] = deque(maxlen=TRACES_KEPT)
        self._loop = _event_loop()
        self._thread = threading.Thread(target=self._serve, name="proctor-broker", daemon=True)
        self._started = False
        self._stopped = False

    # -- lifecycle (called from any thread) ---------------------------------

    def start(self) -> Broker:
        if not self._started:
            self._started = True
            self._thread.start()
        return self

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_forever()

    def _call(self, coro: Awaitable[Any]) -> Any:
        if not self._started or self._stopped:
            raise BrokerError("the broker is not running")
        fut: Future[Any] = asyncio.run_coroutine_threadsafe(coro, self._loop)  # type: ignore[arg-type]
        return fut.result()

    def open_run(self, scope: RunScope, ttl: float) -> RunChannel:
        """Start serving ``scope``'s run on a socket of its own."""
        # Drawn per opening and forgotten at close: the token dies with its socket.
        opening = base64.urlsafe_b64encode(os.urandom(18)).decode()
        token = self._tokens.issue(scope.run_id, scope.artifact or "", ttl, opening)
        # Read here, off the loop: a run whose tenant's quota cannot be read does not open.
        reading = scope.ledger_quota() if scope.ledger_quota is not None else None
        path: Path = self._call(self._open(scope, opening, reading))
        return RunChannel(scope.run_id, path, token)

    def socket_path(self, run_id: str) -> Path | None:
        """Where ``run_id``'s socket is on the host while the run is open, else None."""
        run = self._runs.get(run_id)
        return run.socket if run is not None else None

    @property
    def serves_networks(self) -> bool:
        """Whether runs may be given a network (it takes the broker's egress proxy)."""
        return self._handlers is not None and self._handlers.proxy is not None

    def attach_network(self, run_id: str, network: GuestNetwork) -> None:
        """Serve the open run's network (:class:`proctor.sandbox.GuestNetwork`): DNS
        answered and every connection the guest opens decided (transparent egress).
        Needs the broker's egress proxy; closed with the run."""
        proxy = self._handlers.proxy if self._handlers is not None else None
        if proxy is None:
            raise BrokerError("transparent egress needs the broker's egress proxy")
        self._call(self._attach(run_id, network, proxy))

    async def _attach(self, run_id: str, network: GuestNetwork, proxy: EgressProxy) -> None:
        run = self._runs.get(run_id)
        if run is None:
            raise BrokerError(f"run {run_id} has no socket open")
        if run.transparent is not None:
            raise BrokerError(f"run {run_id} already has a network")
        egress = TransparentEgress(proxy, run.scope, network, self.max_connections_per_run)
        await egress.start()
        run.transparent = egress

    def close_run(self, run_id: str) -> None:
        if self._started and not self._stopped:
            self._call(self._close(run_id))

    def stop(self) -> None:
        """Close every run's socket; from here on no sandbox has a way out."""
        if self._stopped:
            return
        if self._started:
            for run_id in list(self._runs):
                self._call(self._close(run_id))
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
        self._stopped = True
        self._loop.close()
        shutil.rmtree(self._root, ignore_errors=True)

    def __enter__(self) -> Broker:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- inside the loop -----------------------------------------------------

    async def _open(self, scope: RunScope, opening: str, reading: LedgerDay | None) -> Path:
        if scope.run_id in self._runs:
            raise BrokerError(f"run {scope.run_id} already has a socket")
        if scope.rate_limit is None:
            scope.rate_limit = self.rate_limit
        if scope.call_bound is None:
            scope.call_bound = self.call_bound
        if scope.ledger_quota is not None and reading is not None:
            quota = self._quotas.get(scope.tenant)
            if quota is None:
                quota = LedgerQuota(scope.tenant, scope.ledger_quota, scope.ledger.now)
                self._quotas[scope.tenant] = quota
            quota.read, quota.note = scope.ledger_quota, scope.quota_refused
            quota.apply(reading)
            scope._quota = quota
        path = self._root / f"{uuid.uuid4().hex[:12]}.sock"
        connections: set[asyncio.Task[None]] = set()

        async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            run = self._runs.get(scope.run_id)
            over = None
            if run is None:
                over = "closed"
            elif len(connections) >= self.max_connections_per_run:
                over = "over_run"
            elif self._open_connections >= self.max_connections:
                over = "over_total"
            if over is not None:
                # Closed unread: a connection refused costs neither a read nor an event.
                writer.close()
                if run is not None:
                    self._count_refused(run, over)
                return
            task = asyncio.current_task()
            assert task is not None
            connections.add(task)
            self._open_connections += 1
            gauge = metrics().broker_connections
            gauge.inc()
            try:
                await self._connection(scope, reader, writer)
            finally:
                self._open_connections -= 1
                gauge.dec()
                connections.discard(task)
                writer.close()

        # The backlog is also how many connections asyncio accepts at a time: no more
        # than a run may hold, so refusing a flood never needs more descriptors.
        server = await asyncio.start_unix_server(
            on_connect, path=str(path), limit=64 * 1024, backlog=self.max_connections_per_run
        )
        # The guest's uid differs from ours; the 0700 directory is what guards the socket.
        os.chmod(path, 0o666)  # noqa: S103
        self._runs[scope.run_id] = _Run(scope, server, path, connections, opening)
        self._gate.opened(scope.run_id, scope.artifact or "", opening)
        return path

    async def _close(self, run_id: str) -> None:
        run = self._runs.pop(run_id, None)
        if run is None:
            return
        self._gate.closed(run_id)
        run.server.close()
        if run.transparent is not None:
            await run.transparent.close()
        tasks = list(run.connections)
        for task in tasks:
            task.cancel()
        if tasks:
            # Their finally blocks still write (a tunnel's completion event): wait for
            # them, or a broker stopping next would drop those events with its loop.
            await asyncio.wait(tasks, timeout=_CLOSE_GRACE)
        await run.server.wait_closed()
        run.socket.unlink(missing_ok=True)
        # After the last connection: every refusal counted is in the run's ledger.
        await run.scope.close_rate_limit()
        await run.scope.close_bounds()
        await self._close_refused(run)

    # -- connections refused: counted, recorded once per window ---------------

    def _count_refused(self, run: _Run, why: str) -> None:
        refused = run.refused
        if refused.pending == 0:
            refused.first = time.monotonic()
        setattr(refused, why, getattr(refused, why) + 1)
        refused.total += 1
        metrics().broker_refused.labels(why).inc()
        if refused.timer is None and refused.flushing is None:
            # In a context of its own: the event is no connection's answer.
            refused.timer = self._loop.call_later(
                REFUSED_WINDOW, self._start_refused_flush, run, context=contextvars.Context()
            )

    def _start_refused_flush(self, run: _Run) -> None:
        run.refused.timer = None
        run.refused.flushing = self._loop.create_task(self._flush_refused(run))

    async def _flush_refused(self, run: _Run) -> None:
        try:
            await self._record_refused(run)
        finally:
            run.refused.flushing = None
        if run.refused.pending and run.scope.run_id in self._runs:
            run.refused.timer = self._loop.call_later(
                REFUSED_WINDOW, self._start_refused_flush, run, context=contextvars.Context()
            )

    async def _record_refused(self, run: _Run) -> None:
        refused, scope = run.refused, run.scope
        counts = {"over_run": refused.over_run, "over_total": refused.over_total,
                  "idle": refused.idle}  # fmt: skip
        count = refused.pending
        if count == 0:
            return
        seconds = time.monotonic() - (refused.first or time.monotonic())
        refused.over_run = refused.over_total = refused.idle = 0
        refused.first = None
        why = (
            f"{count} connections closed unread: over the run's {self.max_connections_per_run} "
            f"or the broker's {self.max_connections}, or idle for {FIRST_BYTE_TIMEOUT:g} s"
        )
        try:
            await scope.record_refusal(
                Action.BROKER_CONNECTIONS_REFUSED,
                f"run/{scope.run_id}",
                why,
                policies=(CONNECTION_LIMIT_RULE,),
                details={
                    "refused": count,
                    **counts,
                    "refused_total": refused.total,
                    "seconds": round(seconds, 3),
                    "per_run": self.max_connections_per_run,
                    "total": self.max_connections,
                },
            )
        except CallRefused as exc:
            # Kept for the next event: a count is never dropped for a ledger outage.
            refused.over_run += counts["over_run"]
            refused.over_total += counts["over_total"]
            refused.idle += counts["idle"]
            refused.first = time.monotonic() - seconds
            log.error("broker.connections.refused for run %s not recorded: %s",
                      scope.run_id, exc.message)  # fmt: skip

    async def _close_refused(self, run: _Run) -> None:
        refused = run.refused
        if refused.flushing is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await refused.flushing
        if refused.timer is not None:
            refused.timer.cancel()
            refused.timer = None
        await self._record_refused(run)

    async def _connection(
        self, scope: RunScope, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        follows = False
        while True:
            call = Call(scope, reader, writer, handlers=self._handlers,
                        proxy=self._handlers.proxy, persistent=True, follows=follows)  # fmt: skip
            try:
                await serve(call, self._gate, FIRST_BYTE_TIMEOUT)
            finally:
                if call.kind is not None:
                    self.traces.append(CallTrace(scope.run_id, call.kind.name, call.trace))
            if call.idle and not follows:
                run = self._runs.get(scope.run_id)
                if run is not None:
                    self._count_refused(run, "idle")
            # A kept-alive connection (a plain-HTTP response relayed whole) carries
            # the guest's next request: a call of its own, decided and recorded
            # on its own; silent past the first-byte timeout, it is closed.
            if not call.keep_alive or writer.is_closing() or self._runs.get(scope.run_id) is None:
                return
            follows = True


def _event_loop() -> asyncio.AbstractEventLoop:
    """The broker's loop: uvloop's (libuv) where it is installed. Every call out of
    every sandbox passes through this one loop; on the egress path's own bench it
    took 15-24% off the broker's added latency (README, issue 22)."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - a dependency; asyncio's loop works the same
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def wait_for_socket(path: Path, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise BrokerError(f"broker socket {path} did not appear")
        time.sleep(0.01)
