"""Retention per tenant, legal holds, and pruning past the period.

A tenant's rule is a period in days. Past it, an event's payload is pruned: its
stored bytes become a marker that keeps the leaf hash (``proctor.ledger``'s
``_prune``), so every proof and checkpoint still verifies. Nothing under a legal
hold is pruned (a hold on the tenant suspends pruning of the whole log; on a
deployment or a run, of the events that name it). Events that back the store's
governance rows (approvals, deployments, principals, quorum, policies, and the
retention record itself) are kept for the tenant's life: ``audit verify`` holds
the rows to them.

An event is past the period by its own signed ``time`` (in the bytes its leaf hash
commits to, held to the tree's level-0 tile), never by the ``ledger_entries.time``
column, which a store writer can back-date. A hold names a run or deployment that
exists, resolved from a unique prefix like every id a person types, and stores the
full id; a hold stored before that (a prefix as typed) keeps all it starts.

The EU AI Act (Art. 19(1), 26(6)) asks for at least six months: a period under
:data:`LEGAL_MINIMUM_DAYS` is refused unless the operator gives a reason, which
is recorded in the ``retention.set`` event.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from proctor import telemetry
from proctor.errors import NotFound, UsageError
from proctor.governance._prefixes import find_by_prefix, resolve_prefix
from proctor.ledger import (
    MAX_PRUNE_RANGES,
    MAX_PRUNED_PER_EVENT,
    Action,
    Actor,
    EventDraft,
    Ledger,
    PrunePlan,
    is_pruned_marker,
    kept_keys,
    leaf_hash,
    prune_draft,
    read_objects,
)
from proctor.store import Conn, Store

#: Six months and a few days: EU AI Act Art. 19(1) and 26(6) ("at least six months").
LEGAL_MINIMUM_DAYS = 183
MAX_DAYS = 36_500
HOLD_SCOPES = ("tenant", "deployment", "run")
MAX_REASON = 512

#: Events never pruned: they back the store's rows (governance/_backing.py) or are
#: the record of retention itself.
KEPT_ACTIONS = frozenset(
    {
        Action.TENANT_CREATE,
        Action.TENANT_FREEZE,
        Action.TENANT_UNFREEZE,
        Action.ARTIFACT_SUBMIT,
        Action.APPROVAL_GRANT,
        Action.APPROVAL_REJECT,
        Action.APPROVAL_REVOKE,
        Action.DEPLOYMENT_CREATE,
        Action.DEPLOYMENT_ROLLBACK,
        Action.DEPLOYMENT_STOPPED,
        Action.PRINCIPAL_CREATE,
        Action.PRINCIPAL_DISABLE,
        Action.PRINCIPAL_ENABLE,
        Action.TOKEN_ISSUE,
        Action.QUORUM_SET,
        Action.POLICY_SET,
    }
)
KEPT_PREFIXES = ("retention.", "hold.", "erasure.", "ledger.", "subprocessor.", "witness.")


def kept(action: str) -> bool:
    return action in KEPT_ACTIONS or action.startswith(KEPT_PREFIXES)


def _parse_time(value: str) -> datetime:
    return datetime.strptime(value, "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=UTC)


def _format_time(value: datetime) -> str:
    return value.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


@dataclass(frozen=True)
class RetentionRule:
    tenant: str
    days: int
    below_minimum_reason: str | None
    set_by: str
    set_at: str

    @property
    def name(self) -> str:
        return f"retention/{self.days}d"

    def as_json(self) -> dict[str, Any]:
        return {
            "tenant": self.tenant,
            "days": self.days,
            "rule": self.name,
            "below_legal_minimum": self.below_minimum_reason,
            "set_by": self.set_by,
            "set_at": self.set_at,
        }


@dataclass(frozen=True)
class Hold:
    id: str
    tenant: str
    scope: str
    target: str
    reason: str
    created_by: str
    created_at: str
    removed_by: str | None
    removed_at: str | None

    @property
    def active(self) -> bool:
        return self.removed_at is None

    def as_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "tenant": self.tenant,
            "scope": self.scope,
            "target": self.target,
            "reason": self.reason,
            "created_by": self.created_by,
            "created_at": self.created_at,
            "removed_by": self.removed_by,
            "removed_at": self.removed_at,
            "active": self.active,
        }


@dataclass(frozen=True)
class PruneResult:
    tenant: str
    rule: str | None
    cutoff: str | None
    pruned: int
    held: int
    events: tuple[int, ...]  # the seqs of the retention.prune events written
    why_none: str | None = None
    #: Entries whose ``time`` column disagrees with the time their bytes carry (the
    #: column was altered: pruning goes by the signed time, so it changed nothing).
    misdated: tuple[int, ...] = ()
    #: Entries whose bytes do not hash to the log's tree: not pruned (``audit verify``).
    unverified: tuple[int, ...] = ()

    def as_json(self) -> dict[str, Any]:
        return {
            "tenant": self.tenant,
            "rule": self.rule,
            "cutoff": self.cutoff,
            "pruned": self.pruned,
            "held": self.held,
            "prune_events": list(self.events),
            "why_none": self.why_none,
            "misdated": list(self.misdated[:_SHOWN_SEQS]),
            "misdated_count": len(self.misdated),
            "unverified": list(self.unverified[:_SHOWN_SEQS]),
            "unverified_count": len(self.unverified),
        }


#: At most this many seqs of a kind listed in a prune's result.
_SHOWN_SEQS = 20
#: At most this many misdated entries past the walk are looked up (they are only told).
_MAX_MISDATED = 1000
#: Leaves per level-0 tile (C2SP tlog-tiles), 32 bytes each.
_TILE_WIDTH = 256


_HOLD_COLS = "id, tenant, scope, target, reason, created_by, created_at, removed_by, removed_at"


def _hold(row: Any) -> Hold:
    def opt(v: Any) -> str | None:
        return None if v is None else str(v)

    a, b, c, d, e, f, g = (str(v) for v in row[:7])
    return Hold(a, b, c, d, e, f, g, opt(row[7]), opt(row[8]))


def _resolve(conn: Conn, tenant: str, scope: str, given: str) -> str:
    """The run id or deployment name ``given`` (or a unique prefix of it) names; one
    that does not exist is refused, so a hold always covers something real."""
    if scope == "run":
        return resolve_prefix(conn, "runs", "id", tenant, given, noun="run",
                              hint=f"`proctor runs list -t {tenant}` shows them")  # fmt: skip
    return resolve_prefix(
        conn, "deployments", "name", tenant, given, noun="deployment", what="name",
        hint=f"`proctor deployment list -t {tenant}` shows them",
    )  # fmt: skip


def _held(
    conn: Conn, tenant: str, holds: list[Hold], scope: str
) -> tuple[set[str], tuple[str, ...]]:
    """What the active holds of ``scope`` keep: the ids that exist, and, for a target
    stored before holds were resolved (a prefix a person typed, or an id no longer in
    the store), everything it starts (so such a hold keeps more, never less)."""
    table, column = ("runs", "id") if scope == "run" else ("deployments", "name")
    exact: set[str] = set()
    prefixes: list[str] = []
    for h in holds:
        if h.scope != scope:
            continue
        row = conn.query_one(
            f"SELECT 1 FROM {table} WHERE tenant = ? AND {column} = ? LIMIT 1",  # noqa: S608
            (tenant, h.target),
        )
        if row is not None:
            exact.add(h.target)
        else:
            prefixes.append(h.target.strip())
    return exact, tuple(prefixes)


def _reason(reason: str, what: str) -> str:
    reason = reason.strip()
    if not reason:
        raise UsageError(f"{what} needs a reason", hint="--reason 'TEXT'")
    if len(reason) > MAX_REASON:
        raise UsageError(f"{what}'s reason is over {MAX_REASON} characters")
    return reason


class Retention:
    """A tenant's retention rule, its legal holds, and pruning."""

    def __init__(self, store: Store, ledger: Ledger) -> None:
        self._store = store
        self._ledger = ledger

    def _tenant(self, conn: Conn, tenant: str) -> None:
        if conn.query_one("SELECT 1 FROM tenants WHERE name = ?", (tenant,)) is None:
            raise NotFound(f"no tenant {tenant!r}")

    # -- the rule -----------------------------------------------------------

    def rule(self, tenant: str) -> RetentionRule | None:
        with self._store.read() as conn:
            self._tenant(conn, tenant)
            row = conn.query_one(
                "SELECT tenant, days, below_minimum_reason, set_by, set_at"
                " FROM retention_rules WHERE tenant = ?",
                (tenant,),
            )
        if row is None:
            return None
        return RetentionRule(
            str(row[0]), int(row[1]), None if row[2] is None else str(row[2]),
            str(row[3]), str(row[4]),
        )  # fmt: skip

    def set(
        self, tenant: str, days: int, actor: Actor, *, below_legal_minimum: str | None = None
    ) -> RetentionRule:
        if not 1 <= days <= MAX_DAYS:
            raise UsageError(f"a retention period is 1 to {MAX_DAYS} days, not {days}")
        reason = None
        if days < LEGAL_MINIMUM_DAYS:
            if below_legal_minimum is None:
                raise UsageError(
                    f"{days} days is under the legal minimum of {LEGAL_MINIMUM_DAYS} days"
                    " (EU AI Act Art. 19(1) and 26(6): logs kept at least six months)",
                    hint="give --below-legal-minimum 'REASON' if another law allows it;"
                    " the reason is recorded",
                )
            reason = _reason(below_legal_minimum, "a period under the legal minimum")
        previous = self.rule(tenant)
        now = self._ledger.now()
        details: dict[str, Any] = {
            "days": days,
            "rule": f"retention/{days}d",
            "previous_days": previous.days if previous else None,
        }
        if reason is not None:
            details["below_legal_minimum"] = reason

        def write(conn: Conn) -> None:
            conn.execute("DELETE FROM retention_rules WHERE tenant = ?", (tenant,))
            conn.execute(
                "INSERT INTO retention_rules (tenant, days, below_minimum_reason, set_by, set_at)"
                " VALUES (?, ?, ?, ?, ?)",
                (tenant, days, reason, actor.id, now),
            )

        self._ledger.append(
            tenant,
            EventDraft(actor, Action.RETENTION_SET, f"tenant/{tenant}",
                       reason=f"retention set to {days} days", details=details),
            hook=write,
        )  # fmt: skip
        rule = self.rule(tenant)
        assert rule is not None
        return rule

    # -- holds --------------------------------------------------------------

    def holds(self, tenant: str, *, all_: bool = False) -> list[Hold]:
        with self._store.read() as conn:
            self._tenant(conn, tenant)
            rows = conn.query(
                f"SELECT {_HOLD_COLS} FROM legal_holds WHERE tenant = ?"  # noqa: S608 - fixed columns
                + ("" if all_ else " AND removed_at IS NULL")
                + " ORDER BY created_at, id",
                (tenant,),
            )
        return [_hold(r) for r in rows]

    def add_hold(
        self, tenant: str, scope: str, target: str | None, reason: str, actor: Actor
    ) -> Hold:
        if scope not in HOLD_SCOPES:
            raise UsageError(f"a hold is on one of {', '.join(HOLD_SCOPES)}, not {scope!r}")
        if scope != "tenant" and not (target or "").strip():
            raise UsageError(f"a hold on a {scope} names it", hint=f"--{scope} ID")
        reason = _reason(reason, "a legal hold")
        with self._store.read() as conn:
            self._tenant(conn, tenant)
            # The full id, resolved as everywhere else (an exact id, or the one id a
            # unique prefix names): prune compares the events' ids with it.
            target = tenant if scope == "tenant" else _resolve(conn, tenant, scope, str(target))
        hold_id = "hold-" + secrets.token_hex(6)
        now = self._ledger.now()

        def write(conn: Conn) -> None:
            conn.execute(
                f"INSERT INTO legal_holds ({_HOLD_COLS})"  # noqa: S608 - fixed columns
                " VALUES (?, ?, ?, ?, ?, ?, ?, NULL, NULL)",
                (hold_id, tenant, scope, target, reason, actor.id, now),
            )

        self._ledger.append(
            tenant,
            EventDraft(
                actor, Action.HOLD_ADD, f"hold/{hold_id}",
                reason=f"legal hold on {scope} {target}",
                deployment=target if scope == "deployment" else None,
                run=target if scope == "run" else None,
                details={"hold": hold_id, "scope": scope, "target": target, "reason": reason},
            ),
            hook=write,
        )  # fmt: skip
        return self.hold(tenant, hold_id)

    def hold(self, tenant: str, hold_id: str) -> Hold:
        """The hold whose id is ``hold_id`` or the one id starting with it."""
        with self._store.read() as conn:
            row = find_by_prefix(
                conn, "legal_holds", _HOLD_COLS, tenant, hold_id,
                noun="legal hold", hint=f"proctor hold list -t {tenant}",
            )  # fmt: skip
        return _hold(row)

    def remove_hold(self, tenant: str, hold_id: str, actor: Actor) -> Hold:
        held = self.hold(tenant, hold_id)
        hold_id = held.id
        if not held.active:
            raise UsageError(f"legal hold {hold_id} was removed already ({held.removed_at})")
        now = self._ledger.now()

        def write(conn: Conn) -> None:
            conn.execute(
                "UPDATE legal_holds SET removed_by = ?, removed_at = ? WHERE id = ?",
                (actor.id, now, hold_id),
            )

        self._ledger.append(
            tenant,
            EventDraft(
                actor, Action.HOLD_REMOVE, f"hold/{hold_id}",
                reason=f"legal hold on {held.scope} {held.target} removed",
                details={"hold": hold_id, "scope": held.scope, "target": held.target},
            ),
            hook=write,
        )  # fmt: skip
        return self.hold(tenant, hold_id)

    # -- pruning ------------------------------------------------------------

    def prune(self, tenant: str, actor: Actor) -> PruneResult:
        """Prune the tenant's events past its period, save what a hold covers or
        what backs the store; one ``retention.prune`` event per batch of markers."""
        rule = self.rule(tenant)
        if rule is None:
            return PruneResult(tenant, None, None, 0, 0, (), "no retention rule: kept forever")
        holds = self.holds(tenant)
        if any(h.scope == "tenant" for h in holds):
            return PruneResult(tenant, rule.name, None, 0, 0, (), "the tenant is under legal hold")
        at = self._ledger.now()
        cutoff = _format_time(_parse_time(at) - timedelta(days=rule.days))
        chosen: list[tuple[int, bytes]] = []
        digests: dict[int, str] = {}  # seq -> its lineage object, whose keys index it
        held = 0
        misdated: list[int] = []
        unverified: list[int] = []
        with self._store.read() as conn:
            runs, run_prefixes = _held(conn, tenant, holds, "run")
            deps, dep_prefixes = _held(conn, tenant, holds, "deployment")
            # By each event's own signed time, never the time column (a copy nobody
            # signed, which a store writer can back-date). A log's times never go back,
            # so the first event signed at or after the cut-off ends the walk; only an
            # event whose bytes hash to the tree's leaf is believed, so altered bytes
            # can neither be pruned nor end the walk early.
            tile = (-1, b"")
            stop: int | None = None
            for seq_, column, raw in conn.iterate(
                "SELECT seq, time, data FROM ledger_entries WHERE log = ? ORDER BY seq",
                (tenant,),
            ):
                seq, data = int(seq_), bytes(raw)
                ev = json.loads(data)
                if is_pruned_marker(ev):
                    continue
                at_tile, offset = divmod(seq, _TILE_WIDTH)
                if tile[0] != at_tile:
                    row = conn.query_one(
                        "SELECT hashes FROM ledger_tiles WHERE log = ? AND level = 0 AND idx = ?",
                        (tenant, at_tile),
                    )
                    tile = (at_tile, b"" if row is None else bytes(row[0]))
                time = ev.get("time")
                if tile[1][offset * 32 : offset * 32 + 32] != leaf_hash(data) or not isinstance(
                    time, str
                ):
                    unverified.append(seq)
                    continue
                if column != time:
                    misdated.append(seq)
                if time >= cutoff:
                    stop = seq
                    break
                if kept(str(ev.get("action", ""))):
                    continue
                run, dep = ev.get("run"), ev.get("deployment")
                if (
                    run in runs
                    or dep in deps
                    or (run_prefixes and isinstance(run, str) and run.startswith(run_prefixes))
                    or (dep_prefixes and isinstance(dep, str) and dep.startswith(dep_prefixes))
                ):
                    held += 1
                    continue
                chosen.append((seq, data))
                ref = (ev.get("details") or {}).get("lineage_object")
                if isinstance(ref, dict) and isinstance(ref.get("digest"), str):
                    digests[seq] = ref["digest"]
            if stop is not None:
                # Past the walk, a time column before the cut-off was back-dated: say so.
                # Through the time index (what the prune used to read), not the rest of
                # the log: `seq + 0` and no ORDER BY keep both engines off the key.
                misdated += sorted(
                    int(r[0])
                    for r in conn.query(
                        "SELECT seq FROM ledger_entries WHERE log = ? AND time < ?"
                        " AND seq + 0 > ? LIMIT ?",
                        (tenant, cutoff, stop, _MAX_MISDATED),
                    )
                )
        objects = read_objects(self._store, tenant, set(digests.values()))
        written: list[int] = []
        extra = {"days": rule.days, "holds": [h.id for h in holds][:64], "held": held}
        for part in _chunks(chosen):
            draft, markers = prune_draft(
                PrunePlan(tenant, tuple(part), rule.name, at, cutoff, extra), actor
            )

            # A pruned event's lineage index rows go with it: nothing finds it by key.
            # Deleted by their primary key (log, key, seq), read off the event's object:
            # by seq alone each delete would scan the log's whole index.
            index = [
                (tenant, bytes.fromhex(k), seq)
                for seq, _ in part
                if seq in digests
                for k in _object_keys(objects.get(digests[seq]))
            ]

            def write(
                conn: Conn,
                markers: list[tuple[bytes, str, int]] = markers,
                index: list[tuple[str, bytes, int]] = index,
            ) -> None:
                conn.executemany(
                    "UPDATE ledger_entries SET data = ? WHERE log = ? AND seq = ?", markers
                )
                conn.executemany(
                    "DELETE FROM ledger_lineage WHERE log = ? AND key = ? AND seq = ?", index
                )

            written.append(self._ledger.append(tenant, draft, hook=write).seq)
            telemetry.metrics().pruned.labels(telemetry.tenant(tenant)).inc(len(part))
        return PruneResult(
            tenant, rule.name, cutoff, len(chosen), held, tuple(written),
            misdated=tuple(misdated), unverified=tuple(unverified),
        )  # fmt: skip

    def history(self, tenant: str) -> list[dict[str, Any]]:
        """The retention record of the tenant's log: rule changes, holds, prunes and
        erasures, oldest first (what the evidence pack and report show)."""
        out: list[dict[str, Any]] = []
        with self._store.read() as conn:
            for seq, raw in conn.iterate(
                "SELECT seq, data FROM ledger_entries WHERE log = ? ORDER BY seq", (tenant,)
            ):
                ev = json.loads(bytes(raw))
                action = str(ev.get("action", ""))
                if action.startswith(("retention.", "hold.", "erasure.")):
                    out.append(
                        {"seq": int(seq), "time": ev.get("time"), "action": action,
                         "actor": ev.get("actor", {}).get("id"), "decision": ev.get("decision"),
                         "details": ev.get("details", {})}
                    )  # fmt: skip
        return out


def _chunks(chosen: list[tuple[int, bytes]]) -> list[list[tuple[int, bytes]]]:
    """Split into parts of at most MAX_PRUNED_PER_EVENT entries and MAX_PRUNE_RANGES seq ranges."""
    parts: list[list[tuple[int, bytes]]] = []
    cur: list[tuple[int, bytes]] = []
    runs = 0
    for item in chosen:
        gap = not cur or cur[-1][0] + 1 != item[0]
        if cur and (len(cur) >= MAX_PRUNED_PER_EVENT or (gap and runs >= MAX_PRUNE_RANGES)):
            parts.append(cur)
            cur, runs, gap = [], 0, True
        runs += gap
        cur.append(item)
    if cur:
        parts.append(cur)
    return parts


def _object_keys(data: bytes | None) -> list[str]:
    """The 32-hex keys a lineage object (plain or erased) still holds."""
    return kept_keys(data)
