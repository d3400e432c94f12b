"""What the broker knows about one run, and the one way its handlers decide and record.

Every handler (egress, SQL, files, secrets) goes through :meth:`RunScope.decide`
and :meth:`RunScope.record`: Cedar decides with the run's workload as principal,
and the event is durable in the tenant's ledger before the call is answered. If
the ledger cannot record, :class:`CallRefused` is raised and the call must fail.

Every allowed call is also held to the run's standing in the same transaction
as its event (:attr:`RunScope.standing`, a read of the store): a tenant frozen,
a deployment stopped or an approval revoked by another process is seen by the
very next call, not at the supervisor's next look. The call is then refused,
and its refusal is recorded instead (``refused: why``, rule
:data:`STANDING_RULE`).

Every call is also charged to the run's token bucket (:meth:`RunScope.admit_call`)
before anything else is done with it: a run over its limit is answered 429
and its refusals are counted, not recorded one by one, so that neither the
calls nor their refusals can flood the ledger.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Callable, Mapping
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from proctor.errors import LedgerError, ProctorError, UsageError
from proctor.ledger import (
    Actor,
    Appended,
    EventDraft,
    Ledger,
    LedgerObject,
    bound_details,
    clip,
    keyed_hash,
)
from proctor.policy import (
    CompiledPolicies,
    Decision,
    Entity,
    EntityRef,
    EntitySet,
    Request,
    decide,
)
from proctor.store import Conn

log = logging.getLogger("proctor.broker")

#: Sustained calls per second a run may make, and how many it may make at once.
#: A run of the load test makes 200-400 calls/s; see docs/broker.md for the reasoning.
DEFAULT_CALLS_PER_SECOND = 1000.0
DEFAULT_CALL_BURST = 2000
#: At most one ``broker.rate_limited`` event per run per this many seconds.
RATE_LIMITED_WINDOW = 1.0
#: The rule named in a ``broker.rate_limited`` event.
RATE_LIMIT_RULE = "proctor:broker:rate-limit"
#: The rule named when a call is refused because its run no longer stands.
STANDING_RULE = "proctor:broker:run-standing"
#: Events that record what an admitted call did, not a new call: never refused
#: for the run's standing (the evidence of what already happened must be kept).
_COMPLETIONS = frozenset({"http.request.end"})
#: The rule named in a ``broker.whoami`` event: a run may always ask who it is.
WHOAMI_RULE = "proctor:broker:whoami"


@dataclass
class RequestEvents:
    """How many events :meth:`RunScope.record` made durable for the request being
    answered: the server records a refusal itself only when its handler did not."""

    count: int = 0
    #: The last refusal recorded for this request, (its event's seq, its reason):
    #: the answer to the guest names it, so a person can find it in the ledger.
    refusal: tuple[int, str] | None = None


#: Set by the server for each request (one per connection task; worker threads
#: started with ``asyncio.to_thread`` see the same object).
REQUEST_EVENTS: ContextVar[RequestEvents | None] = ContextVar(
    "proctor_request_events", default=None
)


class BrokerError(ProctorError):
    """A call out of a sandbox that the broker refuses or cannot complete."""

    #: Stable machine-readable code sent to the guest.
    code = "broker_error"
    #: HTTP status the guest sees.
    status = 502

    def __init__(
        self, message: str, *, policies: tuple[str, ...] = (), hint: str | None = None
    ) -> None:
        super().__init__(message, hint=hint)
        self.policies = policies

    def as_json(self) -> dict[str, Any]:
        return {"error": self.code, "message": self.message, "policies": list(self.policies)}


class CallDenied(BrokerError):
    """Policy said no (or nothing said yes)."""

    code = "denied"
    status = 403


class CallRefused(BrokerError):
    """The call could not be recorded, so it is refused (fail closed)."""

    code = "not_recorded"
    status = 503


class _NotStanding(ProctorError):
    """Raised inside the append's transaction: the run no longer stands."""


class BadCall(BrokerError):
    """The guest's request is malformed."""

    code = "bad_request"
    status = 400


class RateLimited(BrokerError):
    """The run is over its call rate; the call was not looked at."""

    code = "rate_limited"
    status = 429


@dataclass(frozen=True)
class RateLimit:
    """A run's call budget: ``per_second`` sustained, up to ``burst`` at once."""

    per_second: float = DEFAULT_CALLS_PER_SECOND
    burst: int = DEFAULT_CALL_BURST

    def __post_init__(self) -> None:
        if not (math.isfinite(self.per_second) and self.per_second > 0):
            raise UsageError(
                f"a run's call rate must be a positive number of calls per second, "
                f"not {self.per_second!r}"
            )
        if isinstance(self.burst, bool) or not isinstance(self.burst, int) or self.burst < 1:
            raise UsageError(f"a run's call burst must be a positive integer, not {self.burst!r}")


class CallLimiter:
    """A token bucket: ``burst`` tokens, refilled at ``per_second``; one call, one token.

    Refused calls are counted (``pending``) until :meth:`take_pending` hands the
    count to whoever records it. Not thread-safe: the broker calls it from its
    one event loop.
    """

    def __init__(self, limit: RateLimit, clock: Callable[[], float] = time.monotonic) -> None:
        self.limit = limit
        self._clock = clock
        self._tokens = float(limit.burst)
        self._last = clock()
        self.pending = 0
        self.refused_total = 0
        self.first_pending: float | None = None

    def take(self) -> bool:
        """Whether one more call may go ahead now; a refusal is counted."""
        now = self._clock()
        elapsed = max(0.0, now - self._last)
        self._last = now
        self._tokens = min(float(self.limit.burst), self._tokens + elapsed * self.limit.per_second)
        if self._tokens >= 1.0:
            self._tokens -= 1.0
            return True
        if self.pending == 0:
            self.first_pending = now
        self.pending += 1
        self.refused_total += 1
        return False

    def take_pending(self) -> tuple[int, float]:
        """(refusals counted since the last call, seconds since the first of them); resets."""
        count, first = self.pending, self.first_pending
        self.pending, self.first_pending = 0, None
        return count, (self._clock() - first if first is not None else 0.0)

    def give_back(self, count: int, seconds: float) -> None:
        """Return a count that could not be recorded, to be recorded with the next."""
        if count:
            first = self._clock() - seconds
            self.pending += count
            self.first_pending = (
                first if self.first_pending is None else min(self.first_pending, first)
            )


@dataclass(frozen=True)
class SecretBinding:
    """A tenant secret the broker injects for its hosts; its value never leaves the broker."""

    name: str
    value: str = field(repr=False)
    hosts: tuple[str, ...]
    header: str = "Authorization"
    template: str = "Bearer {secret}"

    @property
    def placeholder(self) -> str:
        """What the guest may write where the secret would go; replaced only for its hosts."""
        return f"proctor-secret:{self.name}"


@dataclass(frozen=True)
class DatasetBinding:
    name: str
    kind: str  # "sqlite" now, "postgresql" later
    location: str = field(repr=False)  # a path or DSN only the runtime holds
    synthetic: bool = False


@dataclass
class RunScope:
    """One run as the broker sees it. Built by the supervisor, read by handlers."""

    tenant: str
    run_id: str
    workload: str  # SPIFFE id: spiffe://<td>/tenant/<t>/deployment/<d>/run/<r>
    deployment: str
    artifact: str | None
    approvals: tuple[str, ...]
    environment: str  # "sandbox" or "production"
    policies: CompiledPolicies
    ledger: Ledger
    datasets: Mapping[str, DatasetBinding] = field(default_factory=dict)
    secrets: Mapping[str, SecretBinding] = field(default_factory=dict)
    buckets_dir: Path | None = None  # <home>/buckets/<tenant>; bucket = subdirectory
    lineage_key: bytes = field(default=b"", repr=False)  # per-tenant HMAC key
    row_limit: int = 10_000
    statement_timeout: float = 5.0
    # Egress to special-purpose addresses is refused unless a policy names the exact
    # range; tests use this to reach their own loopback servers.
    allowed_ranges: tuple[str, ...] = ()
    extra_entities: tuple[Entity, ...] = ()
    # None: the broker's default (Broker.rate_limit) applies when the run opens.
    rate_limit: RateLimit | None = None
    # Why the run may no longer make calls (None: it may), read in the transaction
    # that appends each allowed call's event; set by the supervisor.
    standing: Callable[[Conn], str | None] | None = field(default=None, repr=False)
    _entities: EntitySet | None = field(default=None, init=False, repr=False)
    _limiter: CallLimiter | None = field(default=None, init=False, repr=False)
    _flush_timer: asyncio.TimerHandle | None = field(default=None, init=False, repr=False)
    _flushing: asyncio.Task[None] | None = field(default=None, init=False, repr=False)

    @property
    def actor(self) -> Actor:
        return Actor("workload", self.workload)

    @property
    def principal(self) -> EntityRef:
        return EntityRef.workload(self.workload)

    def entities(self) -> EntitySet:
        """The run's entities, parsed once and reused for every decision."""
        if self._entities is None:
            base = [
                Entity.workload(
                    self.workload,
                    tenant=self.tenant,
                    deployment=self.deployment,
                    environment=self.environment,
                    artifact=self.artifact,
                    run=self.run_id,
                ),
                Entity.deployment(self.tenant, self.deployment),
                Entity(EntityRef.tenant(self.tenant)),
                *self.extra_entities,
            ]
            self._entities = EntitySet(base)
        return self._entities

    def decide(
        self,
        action: str,
        resource: EntityRef,
        context: Mapping[str, Any],
        entities: tuple[Entity, ...] = (),
    ) -> Decision:
        """Cedar's answer for this run's workload; never raises (errors deny)."""
        base = self.entities()
        ents = base.with_added(entities) if entities else base
        return decide(self.policies, Request(self.principal, action, resource, dict(context)), ents)

    async def record(
        self,
        action: str,
        resource: str,
        decision: Decision | None,
        *,
        reason: str,
        details: Mapping[str, Any],
        objects: tuple[LedgerObject, ...] = (),
    ) -> Appended:
        """Append this call's event (and ``objects``, which ``details`` references);
        raise CallRefused if it cannot be made durable."""
        # A broker event's text comes from the guest or an upstream: fixed budgets,
        # so that no call can make its event outgrow the ledger's bound.
        draft = EventDraft(
            self.actor,
            action,
            clip(resource, 512),
            decision="allow" if decision is None or decision.allowed else "deny",
            policies=decision.policies if decision is not None else (),
            reason=clip(reason, 2048),
            deployment=self.deployment,
            run=self.run_id,
            artifact=self.artifact,
            approvals=self.approvals,
            details=bound_details(
                {
                    **details,
                    **({"policy_version": decision.version} if decision is not None else {}),
                }
            ),
            objects=objects,
        )
        standing = self.standing
        hook = None
        if standing is not None and draft.decision == "allow" and action not in _COMPLETIONS:

            def hook(conn: Conn) -> None:
                why = standing(conn)
                if why is not None:
                    raise _NotStanding(why)

        try:
            appended = await self.ledger.append_async(self.tenant, draft, hook)
        except _NotStanding as exc:
            await self.record_refusal(
                action,
                resource,
                exc.message,
                policies=(STANDING_RULE,),
                details=details,
                objects=objects,
            )
            raise CallDenied(
                f"{action} on {resource} refused: {exc.message}", policies=(STANDING_RULE,)
            ) from None
        except LedgerError as exc:
            raise CallRefused(
                f"the call was refused because the ledger cannot record it: {exc.message}"
            ) from exc
        counter = REQUEST_EVENTS.get()
        if counter is not None:
            counter.count += 1
            if draft.decision == "deny":
                counter.refusal = (appended.seq, reason)
        return appended

    async def record_refusal(
        self,
        action: str,
        resource: str,
        why: str,
        *,
        policies: tuple[str, ...] = (),
        details: Mapping[str, Any],
        objects: tuple[LedgerObject, ...] = (),
    ) -> Appended:
        """Record a call refused before or instead of a policy decision (a malformed
        request, a rule of the broker's own, named in ``policies``), as ``refused: why``;
        raise CallRefused if it cannot be made durable."""
        denied = Decision(False, policies, self.policies.version)
        return await self.record(
            action, resource, denied, reason=f"refused: {why}", details=details, objects=objects
        )

    async def decide_and_record(
        self,
        action: str,
        resource: EntityRef,
        event_resource: str,
        context: Mapping[str, Any],
        *,
        details: Mapping[str, Any],
        entities: tuple[Entity, ...] = (),
    ) -> Decision:
        """Decide, record the decision, and raise CallDenied if it was a deny."""
        decision = self.decide(action, resource, context, entities)
        reason = decision.reason
        await self.record(action, event_resource, decision, reason=reason, details=details)
        if not decision.allowed:
            raise CallDenied(f"{action} on {event_resource} {reason}", policies=decision.policies)
        return decision

    # -- the call rate ---------------------------------------------------------

    @property
    def limiter(self) -> CallLimiter:
        if self._limiter is None:
            self._limiter = CallLimiter(self.rate_limit or RateLimit())
        return self._limiter

    def admit_call(self) -> None:
        """Charge one call to the run's budget; raise :class:`RateLimited` if it is spent.

        Call on the broker's event loop, before the call is authenticated or
        decided. A refusal is not recorded now: one ``broker.rate_limited``
        event per window (at most one per :data:`RATE_LIMITED_WINDOW` seconds)
        carries the count, so refusals cannot flood the ledger either.
        """
        limiter = self.limiter
        if limiter.take():
            return
        self._schedule_flush()
        limit = limiter.limit
        raise RateLimited(
            f"run {self.run_id} is over its limit of {limit.per_second:g} calls per second "
            f"(burst {limit.burst}); slow down",
            policies=(RATE_LIMIT_RULE,),
        )

    def _schedule_flush(self) -> None:
        if self._flush_timer is None and self._flushing is None:
            loop = asyncio.get_running_loop()
            self._flush_timer = loop.call_later(RATE_LIMITED_WINDOW, self._start_flush)

    def _start_flush(self) -> None:
        self._flush_timer = None
        self._flushing = asyncio.get_running_loop().create_task(self._flush())

    async def _flush(self) -> None:
        try:
            await self.record_rate_limited()
        finally:
            self._flushing = None
        if self.limiter.pending:
            # Refused while the event was being written, or not recordable yet.
            self._schedule_flush()

    async def record_rate_limited(self) -> int:
        """Record one ``broker.rate_limited`` event for the refusals counted so far.

        Returns how many it covered (0: none to record, or not recordable now;
        an unrecorded count is kept for the next event).
        """
        limiter = self.limiter
        count, seconds = limiter.take_pending()
        if count == 0:
            return 0
        limit = limiter.limit
        draft = EventDraft(
            self.actor,
            "broker.rate_limited",
            f"run/{self.run_id}",
            decision="deny",
            policies=(RATE_LIMIT_RULE,),
            reason=(
                f"{count} calls refused: over the run's limit of {limit.per_second:g} "
                f"calls per second (burst {limit.burst})"
            ),
            deployment=self.deployment,
            run=self.run_id,
            artifact=self.artifact,
            approvals=self.approvals,
            details={
                "refused": count,
                "refused_total": limiter.refused_total,
                "seconds": round(seconds, 3),
                "per_second": limit.per_second,
                "burst": limit.burst,
            },
        )
        try:
            await self.ledger.append_async(self.tenant, draft)
        except LedgerError as exc:
            limiter.give_back(count, seconds)
            log.error("broker.rate_limited for run %s not recorded: %s", self.run_id, exc)
            return 0
        return count

    async def close_rate_limit(self) -> None:
        """At the run's end: record whatever refusals are still only counted."""
        if self._flushing is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._flushing
        if self._flush_timer is not None:
            self._flush_timer.cancel()
            self._flush_timer = None
        if self._limiter is not None and self._limiter.pending:
            await self.record_rate_limited()

    def key_hmacs(self, keys: list[str]) -> list[str]:
        """Keyed hashes of row keys (HMAC-SHA256 with the tenant's lineage key, first
        16 bytes, sorted): "which runs read customer 42?" is answered later by
        hashing 42 the same way, while the ledger never holds customer identifiers."""
        return sorted({keyed_hash(self.lineage_key, key) for key in keys})
