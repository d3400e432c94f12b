"""What the broker knows about one run, and the one way its handlers decide and record.

Every handler (egress, SQL, files, secrets) goes through :meth:`RunScope.decide`
and :meth:`RunScope.record`: Cedar decides with the run's workload as principal,
and the event is durable in the tenant's ledger before the call is answered. If
the ledger cannot record, :class:`CallRefused` is raised and the call must fail.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from proctor.errors import LedgerError, ProctorError
from proctor.ledger import Actor, Appended, EventDraft, Ledger
from proctor.policy import (
    CompiledPolicies,
    Decision,
    Entity,
    EntityRef,
    EntitySet,
    Request,
    decide,
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


class BadCall(BrokerError):
    """The guest's request is malformed."""

    code = "bad_request"
    status = 400


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
    _entities: EntitySet | None = field(default=None, init=False, repr=False)

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
    ) -> Appended:
        """Append this call's event; raise CallRefused if it cannot be made durable."""
        draft = EventDraft(
            self.actor,
            action,
            resource,
            decision="allow" if decision is None or decision.allowed else "deny",
            policies=decision.policies if decision is not None else (),
            reason=reason,
            deployment=self.deployment,
            run=self.run_id,
            artifact=self.artifact,
            approvals=self.approvals,
            details={
                **details,
                **({"policy_version": decision.version} if decision is not None else {}),
            },
        )
        try:
            return await self.ledger.append_async(self.tenant, draft)
        except LedgerError as exc:
            raise CallRefused(
                f"the call was refused because the ledger cannot record it: {exc.message}"
            ) from exc

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
        if decision.allowed:
            reason = "permitted by " + ", ".join(decision.policies)
        elif decision.policies and not decision.errors:
            reason = "forbidden by " + ", ".join(decision.policies)
        elif decision.errors:
            reason = "denied: policy evaluation failed"
        else:
            reason = "denied: no policy permits it"
        await self.record(action, event_resource, decision, reason=reason, details=details)
        if not decision.allowed:
            raise CallDenied(f"{action} on {event_resource} {reason}", policies=decision.policies)
        return decision

    def key_hmacs(self, keys: list[str]) -> list[str]:
        """Keyed hashes of row keys (HMAC-SHA256 with the tenant's lineage key, first
        16 bytes, sorted): "which runs read customer 42?" is answered later by
        hashing 42 the same way, while the ledger never holds customer identifiers."""
        return sorted(
            {
                hmac.new(self.lineage_key, key.encode(), hashlib.sha256).hexdigest()[:32]
                for key in keys
            }
        )
