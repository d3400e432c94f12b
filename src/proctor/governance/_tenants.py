"""Tenants: the boundary of data, policy and logs; freezing one; its ledger quota."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import NamedTuple

from proctor.errors import AlreadyExists, NotFound, UsageError
from proctor.ledger import SYSTEM_LOG, Action, Actor, EventDraft, Ledger, utc_now
from proctor.store import Conn, Store

_NAME_RE = re.compile(r"^[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?$")
_RESERVED = frozenset({SYSTEM_LOG})

#: Events a tenant's log takes a (UTC) day before the broker refuses its runs'
#: calls, unless an admin sets another quota: ~115 events/s all day, or some 300
#: runs at their default bound of 10,000 calls (one to three events each).
DEFAULT_LEDGER_QUOTA = 10_000_000
#: The largest quota an admin may set (well inside the integers JSON carries exactly).
MAX_LEDGER_QUOTA = 10**12


class LedgerDay(NamedTuple):
    """A tenant's ledger quota and what its log took of it on ``day`` (UTC, the
    ledger's clock): the events ``first`` .. ``size - 1``; and the day's refusal
    event (seq, reason), if the quota was reached already."""

    day: str
    quota: int
    first: int
    size: int
    refusal: tuple[int, str] | None = None

    @property
    def events(self) -> int:
        return self.size - self.first


@dataclass(frozen=True)
class LedgerQuotaSetting:
    tenant: str
    events_per_day: int
    set_by: str | None  # None: the default, never set
    set_at: str | None


def validate_tenant_name(name: str) -> str:
    if not _NAME_RE.match(name):
        raise UsageError(
            f"invalid tenant name {name!r}",
            hint="use 1 to 63 lowercase letters, digits and inner hyphens",
        )
    if name in _RESERVED:
        raise UsageError(f"the tenant name {name!r} is reserved")
    return name


@dataclass(frozen=True)
class Tenant:
    name: str
    created_at: str
    created_by: str
    status: str


class Tenants:
    def __init__(self, store: Store, ledger: Ledger) -> None:
        self._store = store
        self._ledger = ledger

    def create(self, name: str, actor: Actor) -> Tenant:
        """Create a tenant and its log; its creation is event 0 of that log and is
        also recorded in the system log."""
        validate_tenant_name(name)
        if self.find(name) is not None:
            raise AlreadyExists(f"tenant {name!r} exists already")
        created_at = utc_now()

        def insert(conn: Conn) -> None:
            if conn.query_one("SELECT 1 FROM tenants WHERE name = ?", (name,)):
                raise AlreadyExists(f"tenant {name!r} exists already")
            conn.execute(
                "INSERT INTO tenants (name, created_at, created_by, status)"
                " VALUES (?, ?, ?, 'active')",
                (name, created_at, actor.id),
            )

        def system_event(first_leaf: bytes) -> EventDraft:
            return EventDraft(
                actor,
                Action.TENANT_CREATE,
                f"tenant/{name}",
                reason="created",
                details={"origin": self._ledger.origin(name), "first_leaf": first_leaf.hex()},
            )

        # The tenant's row, its log's event 0 and the system log's record of it
        # commit together: a refused creation leaves no tenant behind.
        self._ledger.create_log(
            name,
            EventDraft(actor, Action.TENANT_CREATE, f"tenant/{name}", reason="created"),
            hook=insert,
            then=(SYSTEM_LOG, system_event),
        )
        return Tenant(name, created_at, actor.id, "active")

    def set_frozen(self, name: str, frozen: bool, actor: Actor, reason: str = "") -> Tenant:
        """Freeze (every run stopped, every call refused) or unfreeze a tenant."""
        tenant = self.get(name)
        status = "frozen" if frozen else "active"
        if tenant.status == status:
            raise UsageError(f"tenant {name!r} is {status} already")

        def update(conn: Conn) -> None:
            conn.execute("UPDATE tenants SET status = ? WHERE name = ?", (status, name))

        action = Action.TENANT_FREEZE if frozen else Action.TENANT_UNFREEZE
        draft = EventDraft(actor, action, f"tenant/{name}", reason=reason or status)
        self._ledger.append(name, draft, hook=update, then=(SYSTEM_LOG, lambda _: draft))
        return self.get(name)

    def ledger_quota(self, name: str) -> LedgerQuotaSetting:
        """The tenant's ledger quota (events a UTC day), or the default."""
        self.get(name)
        with self._store.read() as conn:
            row = conn.query_one(
                "SELECT events_per_day, set_by, set_at FROM tenant_quotas WHERE tenant = ?",
                (name,),
            )
        if row is None:
            return LedgerQuotaSetting(name, DEFAULT_LEDGER_QUOTA, None, None)
        return LedgerQuotaSetting(name, int(row[0]), str(row[1]), str(row[2]))

    def set_ledger_quota(self, name: str, events_per_day: int, actor: Actor) -> LedgerQuotaSetting:
        """Set how many events the tenant's log takes a day before its runs' calls are
        refused (control-plane actions are never refused by it); recorded."""
        if (
            isinstance(events_per_day, bool)
            or not isinstance(events_per_day, int)
            or not 1 <= events_per_day <= MAX_LEDGER_QUOTA
        ):
            raise UsageError(
                f"a ledger quota is a number of events a day from 1 to {MAX_LEDGER_QUOTA},"
                f" not {events_per_day!r}"
            )
        previous = self.ledger_quota(name)
        now = self._ledger.now()

        def write(conn: Conn) -> None:
            conn.execute("DELETE FROM tenant_quotas WHERE tenant = ?", (name,))
            conn.execute(
                "INSERT INTO tenant_quotas (tenant, events_per_day, set_by, set_at)"
                " VALUES (?, ?, ?, ?)",
                (name, events_per_day, actor.id, now),
            )

        self._ledger.append(
            name,
            EventDraft(
                actor,
                Action.TENANT_QUOTA,
                f"tenant/{name}",
                reason=f"ledger quota set to {events_per_day} events a day",
                details={"events_per_day": events_per_day, "previous": previous.events_per_day},
            ),
            hook=write,
        )
        return self.ledger_quota(name)

    def ledger_day(self, name: str) -> LedgerDay:
        """The tenant's quota and its log's events of today (UTC, the ledger's clock),
        read from the store: what a restarted broker counts from."""
        day = self._ledger.now()[:10]
        with self._store.read() as conn:
            quota = conn.query_one(
                "SELECT events_per_day FROM tenant_quotas WHERE tenant = ?", (name,)
            )
            head = conn.query_one("SELECT size FROM ledger_logs WHERE log = ?", (name,))
            if head is None:
                raise NotFound(f"unknown tenant {name!r}", hint="`proctor tenant list` shows them")
            # The day's first event by the (log, time) index: one lookup, however many
            # events the day holds. Times are fixed-width, so '<day>' sorts before them.
            first = conn.query_one(
                "SELECT seq FROM ledger_entries WHERE log = ? AND time >= ? ORDER BY time LIMIT 1",
                (name, day),
            )
            refused = conn.query_one(
                "SELECT seq, reason FROM ledger_quota_refusals WHERE tenant = ? AND day = ?",
                (name, day),
            )
        size = int(head[0])
        return LedgerDay(
            day,
            int(quota[0]) if quota is not None else DEFAULT_LEDGER_QUOTA,
            int(first[0]) if first is not None else size,
            size,
            (int(refused[0]), str(refused[1])) if refused is not None else None,
        )

    def ledger_quota_refused(self, name: str, day: str, seq: int, reason: str) -> None:
        """Note the day's refusal event (already in the tenant's log), so that a broker
        started later that day names it instead of recording another."""
        with self._store.write() as conn:
            conn.execute(
                "INSERT INTO ledger_quota_refusals (tenant, day, seq, reason) VALUES (?, ?, ?, ?)"
                " ON CONFLICT (tenant, day) DO NOTHING",
                (name, day, seq, reason),
            )

    def find(self, name: str) -> Tenant | None:
        with self._store.read() as conn:
            row = conn.query_one(
                "SELECT name, created_at, created_by, status FROM tenants WHERE name = ?",
                (name,),
            )
        return Tenant(*map(str, row)) if row else None

    def get(self, name: str) -> Tenant:
        tenant = self.find(name)
        if tenant is None:
            raise NotFound(f"unknown tenant {name!r}", hint="`proctor tenant list` shows them")
        return tenant

    def list(self) -> list[Tenant]:
        with self._store.read() as conn:
            rows = conn.query(
                "SELECT name, created_at, created_by, status FROM tenants ORDER BY name"
            )
        return [Tenant(*map(str, r)) for r in rows]
