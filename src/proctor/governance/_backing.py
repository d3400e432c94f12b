"""The record, not the store, says what was submitted, approved and deployed.

Someone who can write the store file but not sign can change any row: swap a
file of an approved artifact, widen its stored manifest, forge an approval,
clear a revocation, delete a rejection, rename an author. Everything that makes
code runnable in production is therefore derived from, or held to, the tenant's
signed log:

- an artifact's digest is recomputed from the files and manifest that will run,
  and its capabilities and author are those of its ``artifact.submit`` event;
- approvals, rejections and revocations are read from the ``approval.*``
  events; a store row counts for nothing by itself;
- the quorum rule is the last ``quorum.set``; a deployment version is the one
  its ``deployment.create``/``rollback`` event recorded;
- who holds a principal's token (its creator, whoever issued it a token) comes
  from ``principal.create``/``token.issue`` events.

Events are found by resource through ``ledger_entries.ref`` and its index
(migration 13: the ledger writes each governance event's resource there), so a
check costs a few index lookups, never a scan of the log. ``ref`` is a column a
store writer can edit: nothing is believed because of it. Each event found is
read again from its own bytes (its resource and its action must be the ones
asked for) and proven included under the log's signed checkpoint. What the
lookup cannot prove at run time is that no event is missing from it (deleted
from the log, or its ``ref`` cleared or moved): ``proctor audit verify``
recomputes the whole tree and holds every row's ``ref`` to its event for that,
and reports every store row the record does not back (:func:`unbacked_rows`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any

from proctor.errors import ProctorError, VerificationFailed
from proctor.ledger import (
    INDEXED_ACTIONS,
    Action,
    Checkpoint,
    Ledger,
    Verifier,
    leaf_hash,
    open_checkpoint,
    parse_canonical,
    verify_inclusion,
)
from proctor.store import Store

if TYPE_CHECKING:
    from proctor.governance._approvals import Approvals
    from proctor.governance._artifacts import Artifacts
    from proctor.governance._deployments import Deployment, Deployments


def _by_resource(store: Store) -> str:
    """The query of one resource's governance events, by ``ref`` (migration 13's
    partial index on ``(ref, log)``); the log is compared unindexed, or SQLite could
    walk the whole log by its primary key (log, seq), which also serves the ORDER BY."""
    return (
        "SELECT seq, data FROM ledger_entries"  # noqa: S608 - fixed text, no input
        f" WHERE ref = ? AND {store.unindexed('log')} = ? ORDER BY seq"
    )


# A store row's timestamp is taken just before (or, for principals, inside) the
# transaction that records its event.
CLOCK_SLACK = 60.0

Event = dict[str, Any]


class Unbacked(VerificationFailed):
    """A store row the signed record does not back (exit 3, like a tampered log)."""


@dataclass(frozen=True)
class RowProblem:
    """One store row, and why the record does not back it."""

    kind: str  # artifact | approval | deployment | quorum
    key: str
    problem: str

    def __str__(self) -> str:
        return f"{self.kind} {self.key}: {self.problem}"


def _ts(value: str) -> float:
    return datetime.strptime(value, "%Y-%m-%dT%H:%M:%S.%fZ").timestamp()


def close_in_time(row_time: object, event_time: object) -> bool:
    """The row was dated when its event was recorded (within the slack)."""
    try:
        return abs(_ts(str(event_time)) - _ts(str(row_time))) <= CLOCK_SLACK
    except ValueError:
        return False


class Record:
    """A tenant log read as the authority over governance rows.

    Short-lived (one check): the signed checkpoint is opened once and every
    event returned is proven included under it.
    """

    def __init__(self, store: Store, ledger: Ledger) -> None:
        self._store = store
        self._sql = _by_resource(store)
        self._ledger = ledger
        self._heads: dict[str, Checkpoint] = {}
        self._cache: dict[tuple[str, str], list[Event]] = {}

    def _head(self, tenant: str) -> Checkpoint:
        cp = self._heads.get(tenant)
        if cp is None:
            head = self._ledger.head(tenant)
            cp = open_checkpoint(head.checkpoint, Verifier.parse(self._ledger.vkey()), head.origin)
            self._heads[tenant] = cp
        return cp

    def events(self, tenant: str, resource: str) -> list[Event]:
        """The governance events about ``resource``, oldest first, each proven."""
        key = (tenant, resource)
        cached = self._cache.get(key)
        if cached is not None:
            return cached
        cp = self._head(tenant)
        with self._store.read() as conn:
            rows = conn.query(self._sql, (resource, tenant))
        out: list[Event] = []
        for seq_value, raw in rows:
            seq, data = int(seq_value), bytes(raw)
            if seq >= cp.size:
                continue  # appended after the checkpoint this check reads
            # Its ``ref`` found it; its own bytes must say the same.
            ev = _parse(data, tenant, seq)
            if ev.get("resource") != resource:
                raise VerificationFailed(
                    f"event seq {seq} of {tenant!r}: indexed under another resource",
                    hint=f"proctor audit verify --tenant {tenant}",
                )
            action = ev.get("action")
            if not isinstance(action, str) or action not in INDEXED_ACTIONS:
                raise VerificationFailed(
                    f"event seq {seq} of {tenant!r}: indexed, but not a governance event",
                    hint=f"proctor audit verify --tenant {tenant}",
                )
            proof = self._ledger.inclusion_proof(tenant, seq, cp.size)
            try:
                verify_inclusion(seq, cp.size, leaf_hash(data), list(proof.hashes), cp.root)
            except VerificationFailed as exc:
                raise VerificationFailed(
                    f"event seq {seq} of {tenant!r} is not in the signed log ({exc.message}):"
                    " the ledger was tampered with",
                    hint=f"proctor audit verify --tenant {tenant}",
                ) from exc
            out.append(ev)
        self._cache[key] = out
        return out

    def allowed(self, tenant: str, resource: str, *actions: str) -> list[Event]:
        return [
            e
            for e in self.events(tenant, resource)
            if e["action"] in actions and e["decision"] == "allow"
        ]

    # -- what the record says -----------------------------------------------------

    def submission(self, tenant: str, digest: str) -> Event | None:
        found = self.allowed(tenant, f"artifact/{digest}", Action.ARTIFACT_SUBMIT)
        return found[0] if found else None

    def decisions(self, tenant: str, digest: str) -> list[Event]:
        """The artifact's ``approval.grant`` and ``approval.reject`` events."""
        return self.allowed(
            tenant, f"artifact/{digest}", Action.APPROVAL_GRANT, Action.APPROVAL_REJECT
        )

    def revocation(self, tenant: str, approval_id: str) -> Event | None:
        found = self.allowed(tenant, f"approval/{approval_id}", Action.APPROVAL_REVOKE)
        return found[0] if found else None

    def quorum(self, tenant: str) -> tuple[int, tuple[str, ...]] | None:
        """The last recorded quorum rule, or None if the tenant never set one."""
        found = self.allowed(tenant, f"tenant/{tenant}", Action.QUORUM_SET)
        if not found:
            return None
        d = found[-1].get("details") or {}
        return int(d.get("required", 0)), tuple(str(r) for r in d.get("roles") or [])

    def deployment_versions(self, tenant: str, name: str) -> list[Event]:
        """Version N of a deployment is its Nth create or rollback event."""
        return self.allowed(
            tenant, f"deployment/{name}", Action.DEPLOYMENT_CREATE, Action.DEPLOYMENT_ROLLBACK
        )

    def holders(self, tenant: str, principal: str, also: Iterable[str] = ()) -> set[str]:
        """Every tenant principal that held ``principal``'s token, transitively.

        A principal's token is shown to whoever created it or issued it a new one;
        whoever held that creator's token held this one too. The local operator
        (root on the host) is outside: the rule cannot bind it. ``also`` adds the
        store's own ``created_by`` (more holders, never fewer).
        """
        seen: set[str] = set()
        todo = [principal]
        extra = dict.fromkeys(also)
        while todo:
            p = todo.pop()
            found = {
                str(e["actor"]["id"])
                for e in self.allowed(
                    tenant, f"principal/{p}", Action.PRINCIPAL_CREATE, Action.TOKEN_ISSUE
                )
                if e["actor"]["type"] in ("user", "service")
            }
            if p == principal:
                found |= set(extra)
            for holder in found:
                if holder != p and holder.startswith(f"{tenant}/") and holder not in seen:
                    seen.add(holder)
                    todo.append(holder)
        seen.discard(principal)
        return seen


def _parse(data: bytes, tenant: str, seq: int) -> Event:
    try:
        ev, _ = parse_canonical(data)
    except (ValueError, UnicodeDecodeError, ProctorError) as exc:
        raise VerificationFailed(f"event seq {seq} of {tenant!r} is not valid JSON") from exc
    if not isinstance(ev, dict) or ev.get("seq") != seq or ev.get("tenant") != tenant:
        raise VerificationFailed(f"event seq {seq} of {tenant!r} is not the event at that place")
    return ev


# -- rows held to their events (shared with evidence verification) -------------------


def submission_problems(artifact: Mapping[str, Any], ev: Mapping[str, Any] | None) -> list[str]:
    """How an artifact row (``Artifact.to_json()``) differs from its submit event."""
    if ev is None:
        return ["no artifact.submit event records it"]
    d = ev.get("details") or {}
    out = []
    if ev.get("artifact") != artifact.get("digest"):
        out.append("its submit event names another digest")
    if d.get("capabilities_hash") != artifact.get("capabilities_hash"):
        out.append(
            f"capabilities hash {str(artifact.get('capabilities_hash'))[:19]}… differs from the"
            f" one submitted ({str(d.get('capabilities_hash'))[:19]}…, seq {ev.get('seq')})"
        )
    if (ev.get("actor") or {}).get("id") != artifact.get("author"):
        out.append(
            f"author {artifact.get('author')} differs from the submitter "
            f"{(ev.get('actor') or {}).get('id')} (seq {ev.get('seq')})"
        )
    if d.get("purpose") != artifact.get("purpose"):
        out.append(f"purpose differs from the one submitted (seq {ev.get('seq')})")
    return out


def decision_problems(approval: Mapping[str, Any], ev: Mapping[str, Any] | None) -> list[str]:
    """How an approvals row (``Approval.as_json()``) differs from its grant/reject event."""
    decision = approval.get("decision")
    action = Action.APPROVAL_GRANT if decision == "approve" else Action.APPROVAL_REJECT
    if ev is None:
        return [f"no {action} event records it"]
    d = ev.get("details") or {}
    where = f"its {action} event (seq {ev.get('seq')})"
    diffs = []
    if ev.get("action") != action:
        diffs.append("decision")
    if (ev.get("actor") or {}).get("id") != approval.get("principal"):
        diffs.append("principal")
    if ev.get("artifact") != approval.get("digest"):
        diffs.append("artifact")
    for field in ("capabilities_hash", "purpose", "expires_at"):
        if d.get(field) != approval.get(field):
            diffs.append(field)
    if list(d.get("roles") or []) != list(approval.get("roles") or []):
        diffs.append("roles")
    if not close_in_time(approval.get("created_at"), ev.get("time")):
        diffs.append("created_at")
    return [f"{', '.join(diffs)} differ from {where}"] if diffs else []


def deployment_problems(dep: Mapping[str, Any], ev: Mapping[str, Any] | None) -> list[str]:
    """How a deployment version row (``Deployment.as_json()``) differs from its event."""
    if ev is None:
        return [f"no deployment.create event records version {dep.get('version')}"]
    d = ev.get("details") or {}
    diffs = []
    if ev.get("artifact") != dep.get("digest"):
        diffs.append("artifact")
    if list(ev.get("approvals") or []) != list(dep.get("approvals") or []):
        diffs.append("approvals")
    if (ev.get("actor") or {}).get("id") != dep.get("created_by"):
        diffs.append("created_by")
    for field in ("environment", "instruction", "mode"):
        if field in d and d.get(field) != dep.get(field):
            diffs.append(field)
    if "every_seconds" in d:
        every = dep.get("every_seconds")
        if d.get("every_seconds") != (None if every is None else str(every)):
            diffs.append("every_seconds")
    if not close_in_time(dep.get("created_at"), ev.get("time")):
        diffs.append("created_at")
    return [f"{', '.join(diffs)} differ from its event (seq {ev.get('seq')})"] if diffs else []


def first_problem(problems: list[RowProblem]) -> None:
    """Raise :class:`Unbacked` naming the first problem (a run needs all backed)."""
    if problems:
        p = problems[0]
        raise Unbacked(
            f"the store's {p.kind} {p.key} is not backed by the signed record: {p.problem}",
            hint="someone changed the store file; `proctor audit verify` lists every such row",
        )


# -- the checks ------------------------------------------------------------------------


def artifact_problems(record: Record, artifacts: Artifacts, tenant: str, digest: str) -> list[str]:
    """Why the stored artifact is not the one its digest and submit event name."""
    from proctor.governance._artifacts import artifact_digest

    art = artifacts.find(tenant, digest)
    if art is None:
        return ["no such artifact in the store"]
    out = []
    recomputed = artifact_digest(artifacts.stored_files(digest), art.manifest)
    if recomputed != digest:
        out.append(
            f"its stored files and manifest hash to {recomputed[:19]}…, not to its digest:"
            " the code or manifest that would run is not what was submitted and approved"
        )
    if art.manifest.capabilities_hash != art.capabilities_hash:
        out.append("its stored manifest does not hash to its capabilities_hash")
    return out + submission_problems(art.to_json(), record.submission(tenant, digest))


def deployment_row_problems(record: Record, dep: Deployment) -> list[str]:
    versions = record.deployment_versions(dep.tenant, dep.name)
    ev = versions[dep.version - 1] if 0 < dep.version <= len(versions) else None
    out = deployment_problems(dep.as_json(), ev)
    if ev is not None and dep.status == "active":
        later = [
            e
            for e in record.allowed(dep.tenant, f"deployment/{dep.name}", Action.DEPLOYMENT_STOPPED)
            if int(e["seq"]) > int(ev["seq"])
        ]
        if later:
            out.append(f"active in the store, stopped in the record (seq {later[0]['seq']})")
    return out


def require_backed(store: Store, ledger: Ledger, artifacts: Artifacts, dep: Deployment) -> None:
    """Refuse (:class:`Unbacked`) to run ``dep`` unless the record backs what would run:
    the artifact's recomputed digest, its submit event, the deployment version's event.
    Approvals and the quorum rule are read from the record by ``require_quorum``."""
    record = Record(store, ledger)
    problems = [
        RowProblem("artifact", dep.digest, p)
        for p in artifact_problems(record, artifacts, dep.tenant, dep.digest)
    ]
    problems += [
        RowProblem("deployment", f"{dep.name} v{dep.version}", p)
        for p in deployment_row_problems(record, dep)
    ]
    first_problem(problems)


def unbacked_rows(
    store: Store, ledger: Ledger, artifacts: Artifacts, approvals: Approvals,
    deployments: Deployments, tenant: str,
) -> tuple[list[RowProblem], dict[str, int]]:  # fmt: skip
    """Every store row of ``tenant`` the record does not back, and how many were checked."""
    from proctor.governance._approvals import ledger_approvals

    record = Record(store, ledger)
    problems: list[RowProblem] = []
    counts = {"artifacts": 0, "approvals": 0, "deployments": 0, "principals": 0}
    for art in artifacts.list(tenant):
        counts["artifacts"] += 1
        problems += [
            RowProblem("artifact", art.digest, p)
            for p in artifact_problems(record, artifacts, tenant, art.digest)
        ]
        rows = {a.id: a for a in approvals.for_artifact(tenant, art.digest)}
        recorded = {a.id: a for a in ledger_approvals(record, tenant, art.digest)}
        events = {
            str((e.get("details") or {}).get("approval")): e
            for e in record.decisions(tenant, art.digest)
        }
        for aid, row in rows.items():
            counts["approvals"] += 1
            problems += [
                RowProblem("approval", aid, p)
                for p in decision_problems(row.as_json(), events.get(aid))
            ]
            rec = recorded.get(aid)
            if rec is not None and (rec.revoked_at is None) != (row.revoked_at is None):
                said = "revoked" if rec.revoked_at else "standing"
                problems.append(
                    RowProblem("approval", aid, f"{said} in the record, not in the store")
                )
        for aid, rec in recorded.items():
            if aid not in rows:
                what = (
                    Action.APPROVAL_GRANT if rec.decision == "approve" else Action.APPROVAL_REJECT
                )
                problems.append(
                    RowProblem("approval", aid, f"its {what} event has no row: the store lost it")
                )
    with store.read() as conn:
        names = [str(r[0]) for r in conn.query(
            "SELECT DISTINCT name FROM deployments WHERE tenant = ? ORDER BY name", (tenant,)
        )]  # fmt: skip
        principals = conn.query(
            "SELECT name, roles FROM principals WHERE tenant = ? ORDER BY name", (tenant,)
        )
    for name in names:
        for dep in deployments.versions(tenant, name):
            counts["deployments"] += 1
            problems += [
                RowProblem("deployment", f"{name} v{dep.version}", p)
                for p in deployment_row_problems(record, dep)
            ]
    for name, roles in principals:
        counts["principals"] += 1
        pid = f"{tenant}/{name}"
        created = record.allowed(tenant, f"principal/{pid}", Action.PRINCIPAL_CREATE)
        if not created:
            problems.append(RowProblem("principal", pid, "no principal.create event records it"))
        elif sorted(str(roles).split(",")) != sorted(
            (created[0].get("details") or {}).get("roles") or []
        ):
            problems.append(
                RowProblem(
                    "principal", pid, f"roles {roles} differ from its principal.create event"
                )
            )
    rule = record.quorum(tenant)
    stored = approvals.stored_quorum(tenant)
    if stored is not None and rule != stored:
        problems.append(
            RowProblem("quorum", tenant, "the rule differs from the last quorum.set event")
        )
    return problems, counts
