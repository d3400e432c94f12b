"""Approvals bound to the exact artifact digest, its capabilities and its purpose.

An approval counts only once its ledger event is durable (the row is written in
the same transaction as the event), and what counts is read from the events, not
the rows (see _backing.py): a forged row, a cleared revocation or a deleted
rejection changes nothing. A quorum is N valid approvals, from principals
independent of the author, holding one of some roles; any standing rejection
blocks it. Changing one byte of code changes the digest, and so needs new
approvals.

Independent: not the author, and neither holds the other's token. Whoever
creates a principal, or issues it a token, is shown that token; so is whoever
holds the creator's. An approval from a principal the author (transitively)
made or re-keyed is the author's own, and so is the author's code when the
approver made the author. The ``approve`` command refuses such a principal up
front (recorded); the quorum does not count it, should the relation arise later.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, Protocol

from proctor.errors import ApprovalRequired, ControlDenied, UsageError
from proctor.governance._backing import Record
from proctor.governance._control import ControlPlane
from proctor.governance._prefixes import find_by_prefix
from proctor.governance._principals import AGENT_ROLE, ROLES, Principal
from proctor.ledger import Action, Actor, EventDraft, Ledger, canonical_json, utc_now
from proctor.policy import EntityRef
from proctor.store import Conn, Store

DEFAULT_EXPIRY = timedelta(days=30)
_INDEPENDENCE = "control:independent-approver"


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
class ApprovalRequest:
    """Someone (an agent, a developer) asking the approvers for a digest."""

    id: str
    tenant: str
    digest: str
    principal: str
    comment: str
    created_at: str
    seq: int

    def as_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass(frozen=True)
class ApprovalState:
    """Where an artifact's approval stands: who asked, who approved or rejected, the
    quorum the tenant needs, and whether it is met now (as production would decide)."""

    digest: str
    requests: tuple[ApprovalRequest, ...]
    approvals: tuple[Approval, ...]
    rejections: tuple[Approval, ...]
    counted: tuple[str, ...]
    required: int
    roles: tuple[str, ...]
    approved: bool
    why: str | None

    def as_json(self) -> dict[str, Any]:
        return {
            "digest": self.digest,
            "requests": [r.as_json() for r in self.requests],
            "approvals": [a.as_json() for a in self.approvals],
            "rejections": [a.as_json() for a in self.rejections],
            "counted": list(self.counted),
            "quorum": {"required": self.required, "roles": list(self.roles)},
            "approved": self.approved,
            "why": self.why,
        }


_COMMENT_MAX = 2048


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


def ledger_approvals(record: Record, tenant: str, digest: str) -> list[Approval]:
    """The artifact's approvals and rejections as the record has them, revocations applied."""
    out = []
    for ev in record.decisions(tenant, digest):
        d = ev.get("details") or {}
        aid = str(d.get("approval"))
        revoke = record.revocation(tenant, aid)
        out.append(
            Approval(
                id=aid,
                tenant=tenant,
                digest=str(ev.get("artifact")),
                capabilities_hash=str(d.get("capabilities_hash")),
                purpose=str(d.get("purpose")),
                principal=str(ev["actor"]["id"]),
                roles=tuple(str(r) for r in d.get("roles") or []),
                decision="approve" if ev["action"] == Action.APPROVAL_GRANT else "reject",
                comment=str(d.get("comment") or ""),
                created_at=str(ev["time"]),
                expires_at=None if d.get("expires_at") is None else str(d["expires_at"]),
                revoked_at=None if revoke is None else str(revoke["time"]),
                revoked_by=None if revoke is None else str(revoke["actor"]["id"]),
            )
        )
    return out


def not_independent(record: Record, tenant: str, approver: str, author: str) -> str | None:
    """Why ``approver``'s approval of ``author``'s code would be the author's own, or None."""
    if approver == author:
        return f"{approver} is the artifact's author"
    if author in record.holders(tenant, approver):
        return (
            f"{approver} is not independent of the author {author}: {author} created it or"
            " issued it a token (directly or through principals it made), so holds its token"
        )
    if approver in record.holders(tenant, author):
        return (
            f"{approver} is not independent of the author {author}: it created {author} or"
            " issued it a token (directly or through principals it made), so holds its token"
        )
    return None


def recorded_roles(record: Record, tenant: str, principal: str) -> tuple[str, ...]:
    """The roles the record gave ``principal`` when it was created (none if unrecorded)."""
    found = record.allowed(tenant, f"principal/{principal}", Action.PRINCIPAL_CREATE)
    if not found:
        return ()
    return tuple(str(r) for r in (found[0].get("details") or {}).get("roles") or [])


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
        action = Action.APPROVAL_GRANT if decision == "approve" else Action.APPROVAL_REJECT
        record = self._record()
        submitted = record.submission(tenant, artifact.digest)
        # The author is whoever the record says submitted it, not the row.
        author = artifact.author if submitted is None else str(submitted["actor"]["id"])
        is_author = principal.id in (author, artifact.author)
        # Recorded whole in the approval's event, which has a fixed bound.
        if len(canonical_json(comment)) > 2048:
            raise UsageError("the comment takes more than 2048 bytes as the audit log records it")
        allowed = self._control.authorize(
            principal,
            action,
            EntityRef.artifact(tenant, artifact.digest),
            tenant,
            event_resource=f"artifact/{artifact.digest}",
            context={"principal_is_author": is_author},
        )
        if decision == "approve":
            why = not_independent(record, tenant, principal.id, author)
            if why is not None:
                self._ledger.append(
                    tenant,
                    EventDraft(
                        principal.actor, action, f"artifact/{artifact.digest}", decision="deny",
                        policies=(_INDEPENDENCE,), reason=why, artifact=artifact.digest,
                    ),
                )  # fmt: skip
                raise ControlDenied(
                    f"{principal.id} may not approve {artifact.digest[:19]}…: {why}",
                    (_INDEPENDENCE,),
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
                # What allowed it: the role policy's permits and the version of its
                # text, stored with the event, as a refusal of the same action has.
                policies=allowed.policies,
                artifact=artifact.digest,
                approvals=(approval.id,),
                details={
                    "approval": approval.id,
                    "capabilities_hash": approval.capabilities_hash,
                    "purpose": approval.purpose,
                    "roles": list(approval.roles),
                    "expires_at": approval.expires_at,
                    "comment": comment,
                    "policy_version": allowed.version,
                },
                objects=(self._control.role_policy_object(principal.tenant),),
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
        """The approval with this id, or the one approval whose id starts with it."""
        with self._store.read() as conn:
            r = find_by_prefix(
                conn, "approvals", _COLUMNS, tenant, approval_id, noun="approval",
                hint="`proctor approval list` shows them",
            )  # fmt: skip
        return _row(r)

    def revoke(
        self, tenant: str, approval_id: str, actor: Actor, principal: Principal | None = None
    ) -> Approval:
        approval = self.get(tenant, approval_id)
        # From here on the full id: what was given may be a prefix of it.
        approval_id = approval.id
        if approval.revoked_at is not None:
            raise UsageError(f"approval {approval_id} was revoked already")
        if principal is not None:
            self._control.authorize(
                principal,
                Action.APPROVAL_REVOKE,
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
                actor, Action.APPROVAL_REVOKE, f"approval/{approval_id}", reason="revoked",
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

    def _record(self) -> Record:
        return Record(self._store, self._ledger)

    def stored_quorum(self, tenant: str) -> tuple[int, tuple[str, ...]] | None:
        """The quorum_rules row as stored, or None."""
        with self._store.read() as conn:
            row = conn.query_one(
                "SELECT required, roles FROM quorum_rules WHERE tenant = ?", (tenant,)
            )
        if row is None:
            return None
        return int(row[0]), tuple(r for r in str(row[1]).split(",") if r)

    def quorum(self, tenant: str, record: Record | None = None) -> QuorumRule:
        """The rule in force: the last ``quorum.set`` the record holds."""
        rule = (record or self._record()).quorum(tenant)
        return QuorumRule() if rule is None else QuorumRule(*rule)

    def set_quorum(self, tenant: str, required: int, roles: list[str], actor: Actor) -> QuorumRule:
        if required < 1:
            raise UsageError("a quorum needs at least one approval")
        if AGENT_ROLE in roles:
            raise UsageError(
                "the agent role cannot approve: a person approves (GDPR Art. 28(3)(a))"
            )
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
            EventDraft(actor, Action.QUORUM_SET, f"tenant/{tenant}", reason="quorum rule set",
                       details={"required": rule.required, "roles": list(rule.roles)}),
            hook=upsert,
        )  # fmt: skip
        return rule

    def valid(self, tenant: str, artifact: ArtifactInfo, at: str | None = None) -> list[Approval]:
        """The approvals of ``artifact`` that count at time ``at`` (default: now), as the
        record has them: the store's rows are not consulted."""
        return self._valid(self._record(), tenant, artifact, at or utc_now())

    def _valid(
        self, record: Record, tenant: str, artifact: ArtifactInfo, at: str
    ) -> list[Approval]:
        submitted = record.submission(tenant, artifact.digest)
        if (
            submitted is None
            or (submitted.get("details") or {}).get("capabilities_hash")
            != artifact.capabilities_hash
        ):
            return []  # not the artifact that was submitted: nothing approved it
        author = str(submitted["actor"]["id"])
        rule = self.quorum(tenant, record)
        out = []
        for a in ledger_approvals(record, tenant, artifact.digest):
            if not (
                a.decision == "approve"
                and a.standing(at)
                and a.capabilities_hash == artifact.capabilities_hash
                and a.purpose == artifact.purpose
                and a.principal.startswith(f"{tenant}/")
                and any(r in rule.roles for r in a.roles)
                and any(r in rule.roles for r in recorded_roles(record, tenant, a.principal))
                # An agent's approval never counts, whatever roles were recorded for it
                # (the role policy refuses it one; this holds should one appear).
                and AGENT_ROLE not in a.roles
                and AGENT_ROLE not in recorded_roles(record, tenant, a.principal)
            ):
                continue
            if not_independent(record, tenant, a.principal, author) is None:
                out.append(a)
        return out

    def require_quorum(
        self, tenant: str, artifact: ArtifactInfo, at: str | None = None
    ) -> list[Approval]:
        at = at or utc_now()
        record = self._record()
        rejections = [
            a
            for a in ledger_approvals(record, tenant, artifact.digest)
            if a.decision == "reject" and a.standing(at)
        ]
        if rejections:
            raise ApprovalRequired(
                f"artifact {artifact.digest[:19]} was rejected by {rejections[0].principal}",
                hint="the rejection must be revoked before it can run in production",
            )
        valid = self._valid(record, tenant, artifact, at)
        # One vote per principal, however often they approved.
        voters: dict[str, Approval] = {}
        for a in valid:
            voters.setdefault(a.principal, a)
        rule = self.quorum(tenant, record)
        if len(voters) < rule.required:
            raise ApprovalRequired(
                f"artifact {artifact.digest[:19]} has {len(voters)} valid approval(s) of the "
                f"{rule.required} required (from {' or '.join(rule.roles)}, independent of"
                " its author)",
                hint=f"proctor approve {artifact.digest} --tenant {tenant}",
            )
        return list(voters.values())

    # -- requests for approval (issue 35) ------------------------------------------

    def request(
        self, tenant: str, digest: str, actor: Actor, comment: str = "",
        principal: Principal | None = None, details: dict[str, Any] | None = None,
    ) -> ApprovalRequest:  # fmt: skip
        """Ask the approvers for ``digest`` (a unique prefix too), recorded as an
        ``approval.request`` event and a row. ``principal``: decided by the role policy
        first (the local operator's is not decided); ``details``: added to the event
        (the API's request id and client)."""
        artifact = self._artifacts(tenant, digest)
        if len(canonical_json(comment)) > _COMMENT_MAX:
            raise UsageError(
                f"the comment takes more than {_COMMENT_MAX} bytes as the audit log records it"
            )
        if principal is not None:
            self._control.authorize(
                principal, Action.APPROVAL_REQUEST, EntityRef.artifact(tenant, artifact.digest),
                tenant, event_resource=f"artifact/{artifact.digest}",
            )  # fmt: skip
        req_id = "arq_" + os.urandom(8).hex()
        at = utc_now()
        seq: list[int] = []

        def insert(conn: Conn) -> None:
            row = conn.query_one("SELECT size FROM ledger_logs WHERE log = ?", (tenant,))
            seq.append(int(row[0]) if row else 0)
            conn.execute(
                "INSERT INTO approval_requests (id, tenant, digest, principal, comment,"
                " created_at, seq) VALUES (?, ?, ?, ?, ?, ?, ?)",
                (req_id, tenant, artifact.digest, actor.id, comment, at, seq[0]),
            )

        self._ledger.append(
            tenant,
            EventDraft(
                actor, Action.APPROVAL_REQUEST, f"artifact/{artifact.digest}",
                reason="approval requested", artifact=artifact.digest,
                details={"request": req_id, "comment": comment, "purpose": artifact.purpose,
                         "capabilities_hash": artifact.capabilities_hash, **(details or {})},
            ),
            hook=insert,
        )  # fmt: skip
        return ApprovalRequest(req_id, tenant, artifact.digest, actor.id, comment, at, seq[0])

    def requests(self, tenant: str, digest: str) -> list[ApprovalRequest]:
        with self._store.read() as conn:
            rows = conn.query(
                "SELECT id, tenant, digest, principal, comment, created_at, seq"
                " FROM approval_requests WHERE tenant = ? AND digest = ? ORDER BY created_at",
                (tenant, digest),
            )
        return [
            ApprovalRequest(str(r[0]), str(r[1]), str(r[2]), str(r[3]), str(r[4]), str(r[5]),
                            int(r[6]))
            for r in rows
        ]  # fmt: skip

    def state(self, tenant: str, digest: str, at: str | None = None) -> ApprovalState:
        """Where ``digest``'s approval stands at ``at`` (default: now), read from the
        record as production's quorum check reads it."""
        artifact = self._artifacts(tenant, digest)
        at = at or utc_now()
        record = self._record()
        decided = ledger_approvals(record, tenant, artifact.digest)
        standing = [a for a in decided if a.standing(at)]
        rule = self.quorum(tenant, record)
        counted = dict.fromkeys(a.principal for a in self._valid(record, tenant, artifact, at))
        why: str | None = None
        try:
            self.require_quorum(tenant, artifact, at)
        except ApprovalRequired as exc:
            why = exc.message
        return ApprovalState(
            digest=artifact.digest,
            requests=tuple(self.requests(tenant, artifact.digest)),
            approvals=tuple(a for a in standing if a.decision == "approve"),
            rejections=tuple(a for a in standing if a.decision == "reject"),
            counted=tuple(counted),
            required=rule.required,
            roles=rule.roles,
            approved=why is None,
            why=why,
        )
