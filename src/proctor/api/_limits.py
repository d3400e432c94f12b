"""What one principal, or one client address, may hold of the API.

Every request a principal makes is recorded (``api.request``), so a principal
that could ask without limit could grow the ledger without limit. Each
principal therefore has a call budget (a token bucket, like a broker run's):
over it, the request is answered 429 before it is decided, and the refusals
are counted; one ``api.rate_limited`` event per principal per window carries
the count, so the refusals cannot flood the ledger either. A principal may
also hold only so many log follows open at once (each waits for a run that
may take hours).

Below HTTP, :class:`ConnectionGate` bounds the connections the server holds,
per client address and in total, and closes a connection that sends nothing
before its first-byte timeout; what it closes is counted and recorded the
same way (``api.connections.refused`` in the system log).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from proctor.api._errors import ApiError
from proctor.errors import LedgerError
from proctor.governance import Principal
from proctor.ledger import SYSTEM_LOG, Actor, EventDraft, Ledger

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
        if not allowed:
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
            "api.rate_limited",
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


@dataclass
class _Gate:
    per_source: dict[str, int] = field(default_factory=dict)
    open: int = 0
    over_source: int = 0
    over_total: int = 0
    idle: int = 0
    total: int = 0
    first: float | None = None


class ConnectionGate:
    """Connections the API server holds: at most ``per_source`` from one client
    address and ``total`` in all. Called on the server's event loop only."""

    def __init__(
        self, ledger: Ledger, per_source: int, total: int, first_byte: float, actor: Actor
    ) -> None:
        self._ledger = ledger
        self.per_source = per_source
        self.total = total
        self.first_byte = first_byte
        self._actor = actor
        self._g = _Gate()
        self._lock = threading.Lock()

    def admit(self, source: str) -> bool:
        with self._lock:
            g = self._g
            if g.per_source.get(source, 0) >= self.per_source:
                self._count("over_source")
                return False
            if g.open >= self.total:
                self._count("over_total")
                return False
            g.per_source[source] = g.per_source.get(source, 0) + 1
            g.open += 1
            return True

    def release(self, source: str) -> None:
        with self._lock:
            g = self._g
            g.open -= 1
            g.per_source[source] -= 1
            if not g.per_source[source]:
                del g.per_source[source]

    def idle(self) -> None:
        with self._lock:
            self._count("idle")

    def _count(self, why: str) -> None:
        g = self._g
        if g.over_source + g.over_total + g.idle == 0:
            g.first = time.monotonic()
        setattr(g, why, getattr(g, why) + 1)
        g.total += 1

    def pending(self) -> int:
        with self._lock:
            return self._g.over_source + self._g.over_total + self._g.idle

    def held(self) -> int:
        with self._lock:
            return self._g.open

    def record(self) -> int:
        """Record one ``api.connections.refused`` event for what was counted; returns
        how many it covered (0: none, or not recordable now and kept)."""
        with self._lock:
            g = self._g
            counts = {"over_source": g.over_source, "over_total": g.over_total, "idle": g.idle}
            count = sum(counts.values())
            if count == 0:
                return 0
            first = g.first or time.monotonic()
            g.over_source = g.over_total = g.idle = 0
            g.first = None
            total = g.total
        draft = EventDraft(
            self._actor,
            "api.connections.refused",
            "api/connections",
            decision="deny",
            policies=(CONNECTION_LIMIT_RULE,),
            reason=(
                f"{count} connections closed unread: over {self.per_source} from one address "
                f"or {self.total} in all, or silent for {self.first_byte:g} s"
            ),
            details={
                "refused": count,
                **counts,
                "refused_total": total,
                "seconds": round(time.monotonic() - first, 3),
                "per_source": self.per_source,
                "total": self.total,
            },
        )
        try:
            self._ledger.append(SYSTEM_LOG, draft)
        except LedgerError as exc:
            with self._lock:
                for name, n in counts.items():
                    setattr(self._g, name, getattr(self._g, name) + n)
                self._g.first = first
            log.error("api.connections.refused not recorded: %s", exc.message)
            return 0
        return count
