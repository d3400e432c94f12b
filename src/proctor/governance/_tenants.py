from __future__ import annotations

import re
from dataclasses import dataclass

from proctor.errors import AlreadyExists, NotFound, UsageError
from proctor.ledger import SYSTEM_LOG, Actor, EventDraft, Ledger, utc_now
from proctor.store import Conn, Store

_NAME_RE = re.compile(r"^[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?$")
_RESERVED = frozenset({SYSTEM_LOG})


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
                "tenant.create",
                f"tenant/{name}",
                reason="created",
                details={"origin": self._ledger.origin(name), "first_leaf": first_leaf.hex()},
            )

        # The tenant's row, its log's event 0 and the system log's record of it
        # commit together: a refused creation leaves no tenant behind.
        self._ledger.create_log(
            name,
            EventDraft(actor, "tenant.create", f"tenant/{name}", reason="created"),
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

        action = "tenant.freeze" if frozen else "tenant.unfreeze"
        draft = EventDraft(actor, action, f"tenant/{name}", reason=reason or status)
        self._ledger.append(name, draft, hook=update, then=(SYSTEM_LOG, lambda _: draft))
        return self.get(name)

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
