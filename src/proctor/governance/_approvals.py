"""Approvals bound to the exact artifact digest, its capabilities and its purpose.

An approval counts only once its ledger event is durable (the row is written in
the same transaction as the event). A quorum is N valid approvals, from
principals other than the author, optionally holding one of some roles; any
standing rejection blocks it. Changing one byte of code changes the digest, and
so needs new approvals.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, Protocol

from proctor.errors import NotFound, ProctorError, UsageError
from proctor.governance._control import ControlPlane
from proctor.governance._principals import ROLES, Principal
from proctor.ledger import Actor, EventDraft, Ledger, utc_now
from proctor.policy import EntityRef
from proctor.store import Conn, Store

DEFAULT_EXPIRY = timedelta(days=30)


class ArtifactInfo(Protocol):
    """What approvals need of an artifact (the artifacts module's ``Artifact``)."""

    @property
    def digest(self) -> str: ...
    @property
    def capabilities_hash(self) -> str: ...
    @property
    def purpose(self) -> str: ...
    @property
    def author(self) -> str: ...


ArtifactLookup = Callable[[str, str], ArtifactInfo]


class ApprovalRequired(ProctorError):
    """The artifact lacks the quorum of valid approvals this needs."""

    exit_code = 5


@dataclass(frozen=True)
class Approval:
    id: str
    tenant: str
    digest: str
    capabilities_hash: str
    purpose: str
    principal: str
    roles: tuple[str, ...]
    decision: str  # "approve" | "reject"
    comment: str
    created_at: str
    expires_at: str | None
    revoked_at: str | None
    revoked_by: str | None

    def standing(self, at: str) -> bool:
        """In force at ``at``: made before, not yet expired, not revoked by then."""
        if self.created_at > at:
            return False
        if self.expires_at is not None and self.expires_at <= at:
            return False
        return self.revoked_at is None or self.revoked_at > at

    def as_json(self) -> dict[str, Any]:
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in self.__dict__.items()}


@dataclass(frozen=True)
class QuorumRule:
    required: int = 1
    roles: tuple[str, ...] = ("approver", "admin")


def _fmt(dt: datetime) -> str:
    return dt.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


_COLUMNS = (
    "id, tenant, digest, capabilities_hash, purpose, principal, roles, decision, comment,"
    " created_at, expires_at, revoked_at, revoked_by"
)


def _row(r: tuple[Any, ...]) -> Approval:
    return Approval(
        str(r[0]), str(r[1]), str(r[2]), str(r[3]), str(r[4]), str(r[5]),
        tuple(str(r[6]).split(",")), str(r[7]), str(r[8]), str(r[9]),
        None if r[10] is None else str(r[10]), None if r[11] is None else str(r[11]),
        None if r[12] is None else str(r[12]),
    )  # fmt: skip


class Approvals:
    def __init__(
        self, store: Store, ledger: Ledger, control: ControlPlane, artifacts: ArtifactLookup
    ) -> None:
        self._store = store
        self._ledger = ledger
        self._control = control
        self._artifacts = artifacts

    def _decide(
        self, tenant: str, digest: str, principal: Principal, decision: str,
        expires: timedelta | None, comment: str,
    ) -> Approval:  # fmt: skip
        artifact = self._artifacts(tenant, digest)
        action = "approval.grant" if decision == "approve" else "approval.reject"
        is_author = principal.id == artifact.author
        self._control.authorize(
            principal,
            action,
            EntityRef.artifact(tenant, artifact.digest),
            tenant,
            event_resource=f"artifact/{artifact.digest}",
            context={"principal_is_author": is_author},
        )
        now = datetime.now(UTC)
        if expires is not None and expires <= timedelta(0):
            raise UsageError("an approval's lifetime must be positive")
        approval = Approval(
            id="apr_" + os.urandom(8).hex(),
            tenant=tenant,
            digest=artifact.digest,
            capabilities_hash=artifact.capabilities_hash,
            purpose=artifact.purpose,
            principal=principal.id,
            roles=principal.roles,
            decision=decision,
            comment=comment,
            created_at=_fmt(now),
            expires_at=_fmt(now + expires) if expires is not None else None,
            revoked_at=None,
            revoked_by=None,
        )

        def insert(conn: Conn) -> None:
            row = conn.query_one("SELECT size FROM ledger_logs WHERE log = ?", (tenant,))
            conn.execute(
                f"INSERT INTO approvals ({_COLUMNS}, seq) VALUES"  # noqa: S608 - fixed columns
                " (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    approval.id, tenant, approval.digest, approval.capabilities_hash,
                    approval.purpose, approval.principal, ",".join(approval.roles), decision,
                    comment, approval.created_at, approval.expires_at, None, None,
                    int(row[0]) if row else 0,
                ),
            )  # fmt: skip

        self._ledger.append(
            tenant,
            EventDraft(
                principal.actor,
                action,
                f"artifact/{artifact.digest}",
                reason="approved" if decision == "approve" else "rejected",
                artifact=artifact.digest,
                approvals=(approval.id,),
                details={
                    "approval": approval.id,
                    "capabilities_hash": approval.capabilities_hash,
                    "purpose": approval.purpose,
                    "roles": list(approval.roles),
                    "expires_at": approval.expires_at,
                    "comment": comment,
                },
            ),
            hook=insert,
        )
        return approval

    def grant(
        self, tenant: str, digest: str, principal: Principal, *,
        expires: timedelta | None = DEFAULT_EXPIRY, comment: str = "",
    ) -> Approval:  # fmt: skip
        return self._decide(tenant, digest, principal, "approve", expires, comment)

    def reject(self, tenant: str, digest: str, principal: Principal, comment: str = "") -> Approval:
        return self._decide(tenant, digest, principal, "reject", None, comment)

    def get(self, tenant: str, approval_id: str) -> Approval:
        with self._store.read() as conn:
            r = conn.query_one(
                f"SELECT {_COLUMNS} FROM approvals WHERE id = ? AND tenant = ?",  # noqa: S608
                (approval_id, tenant),
            )
        if r is None:
            raise NotFound(f"no approval {approval_id!r} in tenant {tenant!r}")
        return _row(r)

    def revoke(
        self, tenant: str, approval_id: str, actor: Actor, principal: Principal | None = None
    ) -> Approval:
        approval = self.get(tenant, approval_id)
        if approval.revoked_at is not None:
            raise UsageError(f"approval {approval_id} was revoked already")
        if principal is not None:
            self._control.authorize(
                principal,
                "approval.revoke",
                EntityRef.artifact(tenant, approval.digest),
                tenant,
                event_resource=f"approval/{approval_id}",
            )
        at = utc_now()

        def update(conn: Conn) -> None:
            conn.execute(
                "UPDATE approvals SET revoked_at = ?, revoked_by = ? WHERE id = ?",
                (at, actor.id, approval_id),
            )

        self._ledger.append(
            tenant,
            EventDraft(
                actor, "approval.revoke", f"approval/{approval_id}", reason="revoked",
                artifact=approval.digest, approvals=(approval_id,),
            ),
            hook=update,
        )  # fmt: skip
        return self.get(tenant, approval_id)

    def for_artifact(self, tenant: str, digest: str) -> list[Approval]:
        with self._store.read() as conn:
            rows = conn.query(
                f"SELECT {_COLUMNS} FROM approvals WHERE tenant = ? AND digest = ?"  # noqa: S608
                " ORDER BY created_at",
                (tenant, digest),
            )
        return [_row(r) for r in rows]

    def quorum(self, tenant: str) -> QuorumRule:
        with self._store.read() as conn:
            row = conn.query_one(
                "SELECT required, roles FROM quorum_rules WHERE tenant = ?", (tenant,)
            )
        if row is None:
            return QuorumRule()
        return QuorumRule(int(row[0]), tuple(r for r in str(row[1]).split(",") if r))

    def set_quorum(self, tenant: str, required: int, roles: list[str], actor: Actor) -> QuorumRule:
        if required < 1:
            raise UsageError("a quorum needs at least one approval")
        bad = [r for r in roles if r not in ROLES]
        if bad:
            raise UsageError(f"unknown roles: {', '.join(bad)}")
        rule = QuorumRule(required, tuple(sorted(set(roles))) or QuorumRule().roles)

        def upsert(conn: Conn) -> None:
            conn.execute(
                "INSERT INTO quorum_rules (tenant, required, roles) VALUES (?, ?, ?)"
                " ON CONFLICT (tenant) DO UPDATE SET required = excluded.required,"
                " roles = excluded.roles",
                (tenant, rule.required, ",".join(rule.roles)),
            )

        self._ledger.append(
            tenant,
            EventDraft(actor, "quorum.set", f"tenant/{tenant}", reason="quorum rule set",
                       details={"required": rule.required, "roles": list(rule.roles)}),
            hook=upsert,
        )  # fmt: skip
        return rule

    def valid(self, tenant: str, artifact: ArtifactInfo, at: str | None = None) -> list[Approval]:
        """The approvals of ``artifact`` that count at time ``at`` (default: now)."""
        at = at or utc_now()
        rule = self.quorum(tenant)
        return [
            a
            for a in self.for_artifact(tenant, artifact.digest)
            if a.decision == "approve"
            and a.standing(at)
            and a.capabilities_hash == artifact.capabilities_hash
            and a.purpose == artifact.purpose
            and a.principal != artifact.author
            and a.principal.startswith(f"{tenant}/")
            and any(r in rule.roles for r in a.roles)
        ]

    def require_quorum(
        self, tenant: str, artifact: ArtifactInfo, at: str | None = None
    ) -> list[Approval]:
        at = at or utc_now()
        rejections = [
            a
            for a in self.for_artifact(tenant, artifact.digest)
            if a.decision == "reject" and a.standing(at)
        ]
        if rejections:
            raise ApprovalRequired(
                f"artifact {artifact.digest[:19]} was rejected by {rejections[0].principal}",
                hint="the rejection must be revoked before it can run in production",
            )
        valid = self.valid(tenant, artifact, at)
        # One vote per principal, however often they approved.
        voters: dict[str, Approval] = {}
        for a in valid:
            voters.setdefault(a.principal, a)
        rule = self.quorum(tenant)
        if len(voters) < rule.required:
            raise ApprovalRequired(
                f"artifact {artifact.digest[:19]} has {len(voters)} valid approval(s) of the "
                f"{rule.required} required (from {' or '.join(rule.roles)}, not its author)",
                hint=f"proctor approve {artifact.digest} --tenant {tenant}",
            )
        return list(voters.values())
