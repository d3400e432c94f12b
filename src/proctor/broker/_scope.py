"""What the broker knows about one run, and the one way its calls are decided and recorded.

Every call (egress, SQL, files, secrets) is decided through :meth:`RunScope.decide`
(the decide stage, ``_decide.py``) and recorded through :meth:`RunScope.record`
(the record stage, ``_record.py``): Cedar decides with the run's workload as
principal, and the event is durable in the tenant's ledger before the call is
answered. If the ledger cannot record, :class:`CallRefused` is raised and the
call must fail.

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

The rate bounds events per second, not their total; two bounds hold the total
(:class:`Exhausted`): the run's calls in all (:attr:`RunScope.call_bound`, the
manifest's ``limits.calls``) and the tenant's events per UTC day
(:class:`LedgerQuota`). Past either, every call is refused before it is looked
at, and the refusal is recorded once (once per run, once per tenant and day):
each refused answer names that one event.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import math
import time
from collections.abc import Awaitable, Callable, Mapping
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from proctor.broker._calls import COMPLETE, CURRENT, DECIDE, RECORD, passed
from proctor.errors import LedgerError, ProctorError, UsageError
from proctor.governance import DatasetKind
from proctor.ledger import (
    Action,
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
    EgressRule,
    Entity,
    EntityRef,
    EntitySet,
    Request,
    decide,
)
from proctor.store import Conn
from proctor.telemetry import metrics, tenant

if TYPE_CHECKING:
    from proctor.broker._ask import AskGate

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
_COMPLETIONS = frozenset({Action.HTTP_REQUEST_END})
#: The rule named in a ``broker.whoami`` event: a run may always ask who it is.
WHOAMI_RULE = "proctor:broker:whoami"
#: The most calls a run makes in all, unless its manifest says (``limits.calls``);
#: the same default as the manifest's (``governance._manifest.DEFAULT_CALLS``).
DEFAULT_CALL_BOUND = 10_000
#: The rule named when a run has made all the calls its bound allows.
CALL_BOUND_RULE = "proctor:broker:call-bound"
#: The rule named when a tenant's log has taken its events for the (UTC) day.
LEDGER_QUOTA_RULE = "proctor:broker:ledger-quota"
#: How often, at most, a tenant's quota and day count are read again from the store
#: (a quota an admin changed, events other processes appended, a new day).
QUOTA_REFRESH_SECONDS = 5.0


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


class Exhausted(RateLimited):
    """The run made all its calls (its bound), or its tenant's log took its events of
    the day (the quota): the call was not looked at.

    Handled wherever a :class:`RateLimited` is (never recorded one by one: the
    bound's refusal is recorded once, by :meth:`RunScope.admit_call`), but answered
    403 ``denied``, naming that one event: retrying will not help.
    """

    code = "denied"
    status = 403

    def __init__(
        self, message: str, recorded: asyncio.Future[tuple[int, str]], *, policies: tuple[str, ...]
    ) -> None:
        super().__init__(message, policies=policies)
        #: The refusal's one event: (seq, reason) once durable.
        self.recorded = recorded


class LedgerDay(Protocol):
    """A tenant's ledger quota and its log's count of the day, as read from the store
    (``governance.Tenants.ledger_day``)."""

    @property
    def day(self) -> str: ...  # YYYY-MM-DD, UTC, the ledger's clock
    @property
    def quota(self) -> int: ...  # events a day
    @property
    def first(self) -> int: ...  # the seq of the day's first event (== size: none yet)
    @property
    def size(self) -> int: ...  # the log's size when read
    @property
    def refusal(self) -> tuple[int, str] | None: ...  # the day's refusal event, if any


class LedgerQuota:
    """One tenant's events of the day against its quota, shared by its open runs.

    The count is the log's own: ``size - first``, where ``first`` is the seq of
    the day's first event (read from the store, so a restarted broker counts the
    events of the day before it) and ``size`` grows with every event this broker
    appends; each append's seq also takes in what other processes appended. The
    store is read again at most every :data:`QUOTA_REFRESH_SECONDS` (a quota
    changed, a new day). Its only effect is refusing calls; control-plane events
    are counted but never refused by it. Used on the broker's event loop only.
    """

    def __init__(
        self,
        tenant: str,
        read: Callable[[], LedgerDay],
        now: Callable[[], str],
        clock: Callable[[], float] = time.monotonic,
        note: Callable[[str, int, str], None] | None = None,
    ) -> None:
        self.tenant = tenant
        self.read = read
        #: Keeps the day's refusal event in the store (a broker started later names it).
        self.note = note
        self._now = now
        self._clock = clock
        self.day = ""
        self.quota = 0
        self.first = 0
        self.size = 0
        self.refused = 0
        self.refusal: asyncio.Future[tuple[int, str]] | None = None
        self._read_at = -math.inf
        self._reading: asyncio.Task[None] | None = None

    def apply(self, reading: LedgerDay) -> None:
        """Take a reading of the store (made on another thread or before the run opened);
        on the broker's loop."""
        self._read_at = self._clock()
        self.quota = reading.quota
        if reading.day != self.day:
            if reading.day < self.day:
                return  # read before midnight, applied after: the next reading counts
            self.day, self.refused, self.refusal = reading.day, 0, None
            self.first, self.size = reading.first, reading.size
        else:
            self.first = reading.first
            self.size = max(self.size, reading.size)
        if reading.refusal is not None and (self.refusal is None or _failed(self.refusal)):
            # Recorded today already (by this broker before a restart, or another node's).
            done: asyncio.Future[tuple[int, str]] = asyncio.get_running_loop().create_future()
            done.set_result(reading.refusal)
            self.refusal = done

    async def noted(self, day: str, seq: int, reason: str) -> None:
        """Keep the day's refusal event in the store; a failure costs only a second
        event from a broker started later that day."""
        if self.note is None:
            return
        from proctor.broker._fair import POOL  # it imports this module

        try:
            await POOL.run(self.tenant, f"quota/{self.tenant}", self.note, day, seq, reason)
        except ProctorError as exc:
            log.error("the ledger quota refusal of %s was not kept: %s", self.tenant, exc.message)

    def observe(self, size: int) -> None:
        """An event this broker appended: the log's size after it."""
        self.size = max(self.size, size)

    @property
    def events(self) -> int:
        return max(0, self.size - self.first)

    def exhausted(self) -> bool:
        """Whether the day's events have reached the quota (the store read again when due)."""
        day = self._now()[:10]
        if day > self.day:
            # A new day: nothing of it counted yet, until the store says otherwise.
            self.day, self.refused, self.refusal = day, 0, None
            self.first = self.size
            self._read_at = -math.inf
        if self._clock() - self._read_at >= QUOTA_REFRESH_SECONDS:
            self._refresh()
        return self.events >= self.quota

    def _refresh(self) -> None:
        if self._reading is not None:
            return
        self._read_at = self._clock()
        self._reading = asyncio.get_running_loop().create_task(
            self._read(), context=contextvars.Context()
        )

    async def _read(self) -> None:
        from proctor.broker._fair import POOL  # it imports this module

        try:
            # On the fair pool, as the tenant's job: not the loop's shared executor.
            reading = await POOL.run(self.tenant, f"quota/{self.tenant}", self.read)
        except ProctorError as exc:
            log.error("the ledger quota of %s could not be read: %s", self.tenant, exc.message)
        else:
            self.apply(reading)
        finally:
            self._reading = None


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


@dataclass
class EgressTotals:
    """The body bytes a run's calls under one egress rule sent and received, in all
    (``_rules.Meter`` charges them; the run's rules bound them)."""

    request: int = 0
    response: int = 0


@dataclass(frozen=True)
class DatasetBinding:
    name: str
    kind: DatasetKind
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
    # The approved request rules of egress hosts, keyed by their egress entry
    # (``host:port``, ``*.domain:port``): a host with rules has its TLS ended by the
    # broker and each request checked (``_rules.py``).
    egress_rules: Mapping[str, EgressRule] = field(default_factory=dict)
    # None: the broker's default (Broker.rate_limit) applies when the run opens.
    rate_limit: RateLimit | None = None
    # The most calls the run makes in all (the manifest's limits.calls); None: the
    # broker's default (Broker.call_bound) applies when the run opens.
    call_bound: int | None = None
    # Reads the tenant's ledger quota and its log's count of the day from the store
    # (set by the supervisor); None: no quota. The broker reads it when the run opens.
    ledger_quota: Callable[[], LedgerDay] | None = field(default=None, repr=False)
    # Keeps the day's quota refusal (day, seq, reason) in the store.
    quota_refused: Callable[[str, int, str], None] | None = field(default=None, repr=False)
    #: Calls admitted so far (a malformed or refused one included), and the ones
    #: refused because the bound or the tenant's quota was reached.
    calls: int = field(default=0, init=False)
    refused_over_bound: int = field(default=0, init=False)
    #: Why a call's completion record could not be written (its answer had gone
    #: out already): every later call of the run is refused.
    completion_lost: str | None = field(default=None, init=False)
    refused_over_quota: int = field(default=0, init=False)
    #: Body bytes sent and received under each egress rule so far (by entry): the
    #: rules' totals per run are held against these, across all the run's connections.
    egress_totals: dict[str, EgressTotals] = field(default_factory=dict, init=False)
    # Why the run may no longer make calls (None: it may), read in the transaction
    # that appends each allowed call's event; set by the supervisor.
    standing: Callable[[Conn], str | None] | None = field(default=None, repr=False)
    # The calls that wait for a person's answer (the manifest's ``ask``) and the store
    # their asks are kept in; None: no call of the run asks.
    asks: AskGate | None = field(default=None, repr=False)
    _entities: EntitySet | None = field(default=None, init=False, repr=False)
    _limiter: CallLimiter | None = field(default=None, init=False, repr=False)
    _flush_timer: asyncio.TimerHandle | None = field(default=None, init=False, repr=False)
    _flushing: asyncio.Task[None] | None = field(default=None, init=False, repr=False)
    _quota: LedgerQuota | None = field(default=None, init=False, repr=False)
    _bound_refusal: asyncio.Future[tuple[int, str]] | None = field(
        default=None, init=False, repr=False
    )

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
        passed(DECIDE)
        base = self.entities()
        ents = base.with_added(entities) if entities else base
        return decide(self.policies, Request(self.principal, action, resource, dict(context)), ents)

    def _draft(
        self,
        action: str,
        resource: str,
        decision: Decision | None,
        reason: str,
        details: Mapping[str, Any],
        objects: tuple[LedgerObject, ...] = (),
    ) -> EventDraft:
        # A broker event's text comes from the guest or an upstream: fixed budgets,
        # so that no call can make its event outgrow the ledger's bound.
        return EventDraft(
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
        draft = self._draft(action, resource, decision, reason, details, objects)
        standing = self.standing
        hook = None
        if standing is not None and draft.decision == "allow" and action not in _COMPLETIONS:

            def hook(conn: Conn) -> None:
                why = standing(conn)
                if why is not None:
                    raise _NotStanding(why)

        passed(COMPLETE if action in _COMPLETIONS else RECORD)
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
        if self._quota is not None:
            self._quota.observe(appended.size)
        call = CURRENT.get()
        if call is not None and action not in _COMPLETIONS:
            call.recorded(draft.decision, appended.seq)
        counter = REQUEST_EVENTS.get()
        if counter is not None:
            counter.count += 1
            if draft.decision == "deny":
                counter.refusal = (appended.seq, reason)
        return appended

    def record_later(
        self,
        action: str,
        resource: str,
        decision: Decision | None,
        *,
        reason: str,
        details: Mapping[str, Any],
        lost: str,
    ) -> None:
        """Queue a completion event that nothing waits on (the answer is already
        sent): it commits with the next event anything waits on, so a call costs one
        fsync, not two. If it cannot be made durable, ``lost`` says so and the run's
        next call is refused (:meth:`admit_call`); an event appended after it
        never commits without it."""
        draft = self._draft(action, resource, decision, reason, details)
        passed(COMPLETE)
        try:
            future = self.ledger.append_later(self.tenant, draft)
        except LedgerError as exc:
            self.lose_completion(lost, exc)
            return
        counter = REQUEST_EVENTS.get()
        if counter is not None:
            counter.count += 1

        def settled(done: asyncio.Future[Appended]) -> None:
            exc = None if done.cancelled() else done.exception()
            if done.cancelled() or exc is not None:
                self.lose_completion(lost, exc)
            elif self._quota is not None:
                self._quota.observe(done.result().size)

        future.add_done_callback(settled)

    def lose_completion(self, lost: str, exc: BaseException | None) -> None:
        """A completion record was not written: say so, and refuse the run's next call."""
        why = exc.message if isinstance(exc, ProctorError) else str(exc or "cancelled")
        log.error("%s: %s", lost, why)
        # Fail closed from here on: the run's next call is refused, not one more
        # call made whose end the log may also miss.
        self.completion_lost = lost

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

        Past the run's bound or its tenant's quota of the day it raises
        :class:`Exhausted`, whose one event (per run; per tenant and day) is
        recorded by the first refusal and named by every one.

        After a completion record that could not be written, every call is
        refused (``not_recorded``): the ledger already misses one call's end.
        """
        if self.completion_lost is not None:
            raise CallRefused(f"the run's calls are refused: {self.completion_lost}")
        bound = self.call_bound if self.call_bound is not None else DEFAULT_CALL_BOUND
        if self.calls >= bound:
            self.refused_over_bound += 1
            self._count_limited("calls")
            raise self._over_bound(bound)
        quota = self._quota
        if quota is not None and quota.exhausted():
            self.refused_over_quota += 1
            quota.refused += 1
            self._count_limited("quota")
            raise self._over_quota(quota)
        limiter = self.limiter
        if limiter.take():
            self.calls += 1
            return
        self._count_limited("rate")
        self._schedule_flush()
        limit = limiter.limit
        raise RateLimited(
            f"run {self.run_id} is over its limit of {limit.per_second:g} calls per second "
            f"(burst {limit.burst}); slow down",
            policies=(RATE_LIMIT_RULE,),
        )

    def _count_limited(self, reason: str) -> None:
        metrics().rate_limited.labels("broker", reason, tenant(self.tenant)).inc()

    # -- the bound and the quota: one event each, named by every refusal --------------

    def _over_bound(self, bound: int) -> Exhausted:
        why = (
            f"run {self.run_id} made all of its {bound} calls (limits.calls); every further "
            f"call of the run is refused"
        )
        refusal = self._bound_refusal
        if refusal is None or _failed(refusal):
            refusal = self._bound_refusal = self._record_once(
                Action.BROKER_CALL_BOUND, f"run/{self.run_id}", why, CALL_BOUND_RULE,
                {"bound": bound, "calls": self.calls},
            )  # fmt: skip
        _name(refusal)
        return Exhausted(
            f"run {self.run_id} has made its {bound} calls, the bound its manifest's "
            f"limits.calls sets: every further call is refused",
            refusal,
            policies=(CALL_BOUND_RULE,),
        )

    def _over_quota(self, quota: LedgerQuota) -> Exhausted:
        text = (
            f"tenant {self.tenant}'s log took {quota.events} events on {quota.day} (UTC), "
            f"its ledger quota of {quota.quota} a day"
        )
        refusal = quota.refusal
        if refusal is None or _failed(refusal):
            day = quota.day

            async def keep(seq: int, reason: str) -> None:
                await quota.noted(day, seq, reason)

            refusal = quota.refusal = self._record_once(
                Action.BROKER_LEDGER_QUOTA, f"tenant/{self.tenant}",
                f"{text}; the tenant's runs' calls are refused until 00:00 UTC",
                LEDGER_QUOTA_RULE,
                {"quota": quota.quota, "events": quota.events, "day": day},
                then=keep,
            )  # fmt: skip
        _name(refusal)
        return Exhausted(
            f"{text}: every call of its runs is refused until 00:00 UTC",
            refusal,
            policies=(LEDGER_QUOTA_RULE,),
        )

    def _record_once(
        self, action: str, resource: str, why: str, rule: str, details: dict[str, Any],
        then: Callable[[int, str], Awaitable[None]] | None = None,
    ) -> asyncio.Task[tuple[int, str]]:  # fmt: skip
        async def record() -> tuple[int, str]:
            appended = await self.record_refusal(
                action, resource, why, policies=(rule,), details=details
            )
            if then is not None:
                await then(appended.seq, f"refused: {why}")
            return appended.seq, f"refused: {why}"

        # In a context of its own: the event is no one request's answer.
        task = asyncio.get_running_loop().create_task(record(), context=contextvars.Context())
        task.add_done_callback(_retrieved)
        return task

    async def close_bounds(self) -> None:
        """At the run's end: the bound's or the quota's refusal is durable (tried
        again if the ledger could not take it), or logged as lost."""
        for refusal in (self._bound_refusal, self._quota.refusal if self._quota else None):
            if refusal is not None and not refusal.done():
                with contextlib.suppress(Exception, asyncio.CancelledError):
                    await asyncio.shield(refusal)
        if self._bound_refusal is not None and _failed(self._bound_refusal):
            bound = self.call_bound if self.call_bound is not None else DEFAULT_CALL_BOUND
            try:
                await self._over_bound(bound).recorded
            except BrokerError as exc:
                log.error("broker.call_bound for run %s not recorded: %s", self.run_id,
                          exc.message)  # fmt: skip

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
            Action.BROKER_RATE_LIMITED,
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
            appended = await self.ledger.append_async(self.tenant, draft)
        except LedgerError as exc:
            limiter.give_back(count, seconds)
            log.error("broker.rate_limited for run %s not recorded: %s", self.run_id, exc)
            return 0
        if self._quota is not None:
            self._quota.observe(appended.size)
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


def _failed(refusal: asyncio.Future[tuple[int, str]]) -> bool:
    """Whether a refusal's event could not be recorded (the next refusal tries again)."""
    return refusal.done() and (refusal.cancelled() or refusal.exception() is not None)


def _retrieved(refusal: asyncio.Future[tuple[int, str]]) -> None:
    # Its failure is answered (503) to whoever awaits it, and tried again; not logged
    # as an exception nobody retrieved.
    if not refusal.cancelled():
        refusal.exception()


def _name(refusal: asyncio.Future[tuple[int, str]]) -> None:
    """Let this request's answer name the refusal's event, if it is durable already."""
    counter = REQUEST_EVENTS.get()
    if counter is not None and refusal.done() and not _failed(refusal):
        counter.refusal = refusal.result()
