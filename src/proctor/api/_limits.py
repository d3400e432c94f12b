"""What one principal, or one client address, may hold of the API.

Every request a principal makes is recorded (``api.request``), so a principal
that could ask without limit could grow the ledger without limit. Each
principal therefore has a call budget (a token bucket, like a broker run's):
over it, the request is answered 429 before it is decided, and the refusals
are counted; one ``api.rate_limited`` event per principal per window carries
the count, so the refusals cannot flood the ledger either. A principal may
also hold only so many log follows open at once (each waits for a run that
may take hours).

Below HTTP (and below TLS), :class:`ConnectionGate` bounds the connections the
server holds from their accept, before a byte is read: per client address, in
total, and those not yet authenticated, with the rest kept for connections that
carry a principal; the server closes one that sends nothing before its first-byte
timeout or no whole request head before its head timeout. What is closed is
counted and recorded the same way (``api.connections.refused`` in the system log).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass

from proctor import telemetry
from proctor.api._errors import ApiError
from proctor.errors import LedgerError
from proctor.governance import Principal
from proctor.ledger import SYSTEM_LOG, Action, Actor, EventDraft, Ledger
from proctor.witness import client_key

log = logging.getLogger("proctor.api")

#: At most one summary event per principal (or for the gate) per this many seconds.
WINDOW = 1.0
#: The rule named in the API's refusals of this kind.
RATE_LIMIT_RULE = "proctor:api:rate-limit"
CONNECTION_LIMIT_RULE = "proctor:api:connection-limit"


@dataclass
class _Bucket:
    tokens: float
    last: float
    follows: int = 0
    refused: int = 0
    refused_total: int = 0
    first: float | None = None
    recorded: float = 0.0


class PrincipalLimits:
    """Per-principal request budget and follow bound; thread-safe (the API's sync
    routes run on worker threads)."""

    def __init__(
        self,
        ledger: Callable[[], Ledger],
        per_second: float,
        burst: int,
        follows: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not (math.isfinite(per_second) and per_second > 0) or burst < 1 or follows < 1:
            raise ValueError("API limits must be positive")
        self._ledger = ledger
        self.per_second = per_second
        self.burst = burst
        self.follows = follows
        self._clock = clock
        self._lock = threading.Lock()
        self._buckets: dict[tuple[str, str], _Bucket] = {}
        self._actors: dict[tuple[str, str], Actor] = {}

    def _bucket(self, p: Principal, now: float) -> _Bucket:
        key = (p.tenant, p.id)
        b = self._buckets.get(key)
        if b is None:
            b = self._buckets[key] = _Bucket(float(self.burst), now)
            self._actors[key] = p.actor
        return b

    def admit(self, p: Principal) -> None:
        """Charge one request to ``p``'s budget; 429 ``rate_limited`` if it is spent."""
        now = self._clock()
        with self._lock:
            b = self._bucket(p, now)
            b.tokens = min(float(self.burst), b.tokens + max(0.0, now - b.last) * self.per_second)
            b.last = now
            allowed = b.tokens >= 1.0
            if allowed:
                b.tokens -= 1.0
            else:
                self._count(b, now)
            due = b.refused > 0 and now - b.recorded >= WINDOW
        if due:
            self._record((p.tenant, p.id))
        held = CONNECTION.get()
        if allowed and held is not None:
            # The protocol cannot see who authenticated; this is the one place every
            # authenticated request passes, so the connection is marked here.
            held.gate.protect(held, (p.tenant, p.id))
        if not allowed:
            telemetry.metrics().rate_limited.labels("api", "rate", telemetry.tenant(p.tenant)).inc()
            raise ApiError(
                429,
                "rate_limited",
                f"{p.id} is over its limit of {self.per_second:g} requests per second "
                f"(burst {self.burst}); slow down",
                headers={"Retry-After": "1"},
            )

    @staticmethod
    def _count(b: _Bucket, now: float) -> None:
        if b.refused == 0:
            b.first = now
        b.refused += 1
        b.refused_total += 1

    def follow(self, p: Principal) -> Callable[[], None]:
        """Take one of ``p``'s follows; returns its release (safe to call twice).
        429 if all of them are held."""
        now = self._clock()
        with self._lock:
            b = self._bucket(p, now)
            held = b.follows < self.follows
            if held:
                b.follows += 1
            else:
                self._count(b, now)
        if not held:
            telemetry.metrics().rate_limited.labels(
                "api", "follows", telemetry.tenant(p.tenant)
            ).inc()
            raise ApiError(
                429,
                "rate_limited",
                f"{p.id} already follows {self.follows} logs; close one first",
                headers={"Retry-After": "1"},
            )
        released = False

        def release() -> None:
            nonlocal released
            with self._lock:
                if not released:
                    released = True
                    b.follows -= 1

        return release

    def _record(self, key: tuple[str, str]) -> None:
        with self._lock:
            b = self._buckets[key]
            count, first = b.refused, b.first
            if count == 0:
                return
            b.refused, b.first, b.recorded = 0, None, self._clock()
            total = b.refused_total
        seconds = self._clock() - (first if first is not None else self._clock())
        draft = EventDraft(
            self._actors[key],
            Action.API_RATE_LIMITED,
            f"principal/{key[1]}",
            decision="deny",
            policies=(RATE_LIMIT_RULE,),
            reason=(
                f"{count} requests refused: over the principal's limit of "
                f"{self.per_second:g} requests per second (burst {self.burst}) "
                f"or of {self.follows} follows at once"
            ),
            details={
                "refused": count,
                "refused_total": total,
                "seconds": round(seconds, 3),
                "per_second": self.per_second,
                "burst": self.burst,
                "follows": self.follows,
            },
        )
        try:
            self._ledger().append(key[0], draft)
        except LedgerError as exc:
            with self._lock:
                b.refused += count  # kept for the next event
                b.first = first if b.first is None else min(b.first, first or b.first)
            log.error("api.rate_limited for %s not recorded: %s", key[1], exc.message)

    def flush(self) -> None:
        """Record every count still pending (at shutdown)."""
        with self._lock:
            keys = [k for k, b in self._buckets.items() if b.refused]
        for key in keys:
            self._record(key)


#: The connection a request came on, set by the server around each request, so that
#: :meth:`PrincipalLimits.admit` can tell the gate it carries an authenticated principal.
CONNECTION: ContextVar[Held | None] = ContextVar("proctor_api_connection", default=None)

#: Connections of one principal kept from eviction; more of them are served, but a
#: flood of new connections may close them like any unauthenticated one.
PROTECTED_PER_PRINCIPAL = 16
#: Why the gate closed a connection, as counted in ``api.connections.refused``.
REASONS = ("over_source", "over_total", "idle", "slow_head")


#: What one "address" is for the per-address bound: an IPv4 address, or the /64 of
#: an IPv6 address (one host holds a whole /64; IPv4-mapped ones count as IPv4). The
#: witness server counts its clients the same way.
source_key = client_key


class Held:
    """One connection the gate holds; ``abort`` closes it (on the server's loop)."""

    __slots__ = ("abort", "gate", "key", "open", "principal")

    def __init__(self, gate: ConnectionGate, key: str, abort: Callable[[], None]) -> None:
        self.gate = gate
        self.key = key
        self.abort = abort
        self.open = True
        self.principal: tuple[str, str] | None = None


@dataclass
class _Counts:
    over_source: int = 0
    over_total: int = 0
    idle: int = 0
    slow_head: int = 0
    total: int = 0
    first: float | None = None

    def pending(self) -> int:
        return self.over_source + self.over_total + self.idle + self.slow_head


@dataclass(frozen=True)
class GateBounds:
    """The gate's bounds, derived from the process's descriptor limit at start."""

    per_source: int
    total: int
    unauthenticated: int
    per_principal: int
    first_byte: float
    head: float


def gate_bounds(
    nofile: int,
    per_source: int,
    total: int | None,
    first_byte: float,
    head: float,
) -> GateBounds:
    """Bounds under a descriptor limit of ``nofile``: connections in all at most a
    quarter of it (never over half, whatever is asked: the store, the ledger, the
    broker's sockets and the sandboxes need the rest; the broker takes another
    quarter), of them at most three quarters not yet authenticated (the last quarter
    is kept for connections that carry a principal)."""
    cap = max(4, nofile // 2)
    held = min(total if total is not None else nofile // 4, cap)
    held = max(4, held)
    unauthenticated = max(2, held - held // 4)
    return GateBounds(
        per_source=max(1, min(per_source, unauthenticated)),
        total=held,
        unauthenticated=unauthenticated,
        per_principal=PROTECTED_PER_PRINCIPAL,
        first_byte=first_byte,
        head=max(head, first_byte),
    )


class ConnectionGate:
    """Connections the API server holds, counted from the socket's accept, before a
    byte is read (and before a TLS handshake): at most ``per_source`` from one
    address, ``total`` in all, and of them at most ``unauthenticated`` that have not
    carried an authenticated principal's admitted request.

    A connection over a bound is admitted only by closing, at once, the oldest
    unauthenticated connection of its own address (per-address bound), or of the
    address holding the most unauthenticated connections (total bounds); when there
    is none to close, the new connection is closed unread. So a flood of
    unauthenticated connections, from one address or many, never takes the
    descriptors of connections that authenticated, and a new connection always gets
    in long enough to authenticate unless the flood's addresses each hold as few
    as it does. Thread-safe: admission and release run on the server's loop,
    :meth:`protect` on the worker thread that authenticated the request."""

    def __init__(self, ledger: Ledger, bounds: GateBounds, actor: Actor) -> None:
        self._ledger = ledger
        self.bounds = bounds
        self.per_source = bounds.per_source
        self.total = bounds.total
        self.first_byte = bounds.first_byte
        self.head = bounds.head
        self._actor = actor
        self._lock = threading.Lock()
        self._c = _Counts()
        self._open = 0
        self._per_source: dict[str, int] = {}
        # Unauthenticated connections per address, oldest first, and the addresses by
        # how many they hold (index: count), to find the largest holder quickly.
        self._unauth: dict[str, dict[Held, None]] = {}
        self._by_count: list[dict[str, None]] = [{} for _ in range(bounds.per_source + 1)]
        self._unauth_n = 0
        self._protected: dict[tuple[str, str], int] = {}
        #: A record of what was closed is scheduled (the server's loop sets and clears it).
        self.record_due = False

    # -- the unauthenticated index ---------------------------------------------------

    def _unauth_add(self, h: Held) -> None:
        held = self._unauth.setdefault(h.key, {})
        n = len(held)
        if n:
            del self._by_count[n][h.key]
        held[h] = None
        self._by_count[n + 1][h.key] = None
        self._unauth_n += 1

    def _unauth_remove(self, h: Held) -> None:
        held = self._unauth[h.key]
        n = len(held)
        del held[h]
        del self._by_count[n][h.key]
        if n > 1:
            self._by_count[n - 1][h.key] = None
        else:
            del self._unauth[h.key]
        self._unauth_n -= 1

    def _oldest(self, key: str | None) -> Held | None:
        held = self._unauth.get(key) if key is not None else None
        return next(iter(held)) if held else None

    def _largest_holder(self) -> str | None:
        for n in range(len(self._by_count) - 1, 0, -1):
            if self._by_count[n]:
                return next(iter(self._by_count[n]))
        return None

    def _drop(self, h: Held) -> None:
        h.open = False
        self._open -= 1
        telemetry.metrics().api_connections.set(self._open)
        left = self._per_source[h.key] - 1
        if left:
            self._per_source[h.key] = left
        else:
            del self._per_source[h.key]
        if h.principal is None:
            self._unauth_remove(h)
        else:
            n = self._protected[h.principal] - 1
            if n:
                self._protected[h.principal] = n
            else:
                del self._protected[h.principal]

    # -- the server's calls ----------------------------------------------------------

    def admit(self, source: str, abort: Callable[[], None]) -> Held | None:
        """Hold a new connection from ``source``, or return None: the caller closes it
        unread. A connection the gate closes to make room is aborted here."""
        key = source_key(source)
        closed: list[Held] = []
        with self._lock:
            if self._per_source.get(key, 0) >= self.per_source:
                oldest = self._oldest(key)
                self._count("over_source")
                if oldest is None:
                    return None
                self._drop(oldest)
                closed.append(oldest)
            if self._open >= self.total or self._unauth_n >= self.bounds.unauthenticated:
                oldest = self._oldest(self._largest_holder())
                self._count("over_total")
                if oldest is None:
                    return None
                self._drop(oldest)
                closed.append(oldest)
            h = Held(self, key, abort)
            self._per_source[key] = self._per_source.get(key, 0) + 1
            self._open += 1
            self._unauth_add(h)
            telemetry.metrics().api_connections.set(self._open)
        for old in closed:
            old.abort()
        return h

    def protect(self, h: Held, principal: tuple[str, str]) -> None:
        """``h`` carried an admitted request of ``principal``: no longer closed to make
        room, unless the principal already holds its share of such connections."""
        with self._lock:
            if not h.open or h.principal is not None:
                return
            if self._protected.get(principal, 0) >= self.bounds.per_principal:
                return
            self._unauth_remove(h)
            h.principal = principal
            self._protected[principal] = self._protected.get(principal, 0) + 1

    def release(self, h: Held) -> None:
        """The connection is gone (safe to call more than once)."""
        with self._lock:
            if h.open:
                self._drop(h)

    def closed(self, why: str) -> None:
        """The server closed a connection for ``why`` (``idle``, ``slow_head``)."""
        with self._lock:
            self._count(why)

    def _count(self, why: str) -> None:
        # No tenant: a connection is refused or closed before any principal is known.
        telemetry.metrics().rate_limited.labels("api", why, "").inc()
        c = self._c
        if c.pending() == 0:
            c.first = time.monotonic()
        setattr(c, why, getattr(c, why) + 1)
        c.total += 1

    def pending(self) -> int:
        with self._lock:
            return self._c.pending()

    def held(self) -> int:
        with self._lock:
            return self._open

    def unauthenticated(self) -> int:
        with self._lock:
            return self._unauth_n

    def record(self) -> int:
        """Record one ``api.connections.refused`` event for what was counted; returns
        how many it covered (0: none, or not recordable now and kept)."""
        with self._lock:
            c = self._c
            counts: dict[str, int] = {why: getattr(c, why) for why in REASONS}
            count = sum(counts.values())
            if count == 0:
                return 0
            first = c.first or time.monotonic()
            for why in REASONS:
                setattr(c, why, 0)
            c.first = None
            total = c.total
        b = self.bounds
        draft = EventDraft(
            self._actor,
            Action.API_CONNECTIONS_REFUSED,
            "api/connections",
            decision="deny",
            policies=(CONNECTION_LIMIT_RULE,),
            reason=(
                f"{count} connections closed: over {b.per_source} from one address, "
                f"{b.total} in all or {b.unauthenticated} unauthenticated, silent for "
                f"{b.first_byte:g} s, or no request head within {b.head:g} s"
            ),
            details={
                "refused": count,
                **counts,
                "refused_total": total,
                "seconds": round(time.monotonic() - first, 3),
                "per_source": b.per_source,
                "total": b.total,
                "unauthenticated": b.unauthenticated,
            },
        )
        try:
            self._ledger.append(SYSTEM_LOG, draft)
        except LedgerError as exc:
            with self._lock:
                for why, n in counts.items():
                    setattr(self._c, why, getattr(self._c, why) + n)
                self._c.first = first
            log.error("api.connections.refused not recorded: %s", exc.message)
            return 0
        return count
