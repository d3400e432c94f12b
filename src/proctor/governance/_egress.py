"""Special-purpose address ranges a tenant's runs may reach anyway (for services
on the runtime's own loopback, such as the demo's stand-in API): kept in the
store, each change recorded in the tenant's log with its row."""

from __future__ import annotations

import ipaddress
import json

from proctor.errors import UsageError
from proctor.ledger import Action, Actor, EventDraft, Ledger
from proctor.store import Conn, Store


class EgressRanges:
    def __init__(self, store: Store, ledger: Ledger) -> None:
        self._store = store
        self._ledger = ledger

    def get(self, tenant: str) -> tuple[str, ...]:
        with self._store.read() as conn:
            row = conn.query_one(
                "SELECT value FROM meta WHERE key = ?", (f"egress_ranges:{tenant}",)
            )
        return tuple(json.loads(row[0])) if row else ()

    def allow(self, tenant: str, cidr: str, actor: Actor) -> tuple[str, ...]:
        try:
            network = str(ipaddress.ip_network(cidr, strict=True))
        except ValueError as exc:
            raise UsageError(f"{cidr!r} is not an address range: {exc}") from exc
        ranges = tuple(sorted({*self.get(tenant), network}))

        def upsert(conn: Conn) -> None:
            conn.execute(
                "INSERT INTO meta (key, value) VALUES (?, ?) ON CONFLICT (key) DO UPDATE"
                " SET value = excluded.value",
                (f"egress_ranges:{tenant}", json.dumps(list(ranges))),
            )

        self._ledger.append(
            tenant,
            EventDraft(actor, Action.EGRESS_RANGE_ALLOW, f"range/{network}", reason="allowed",
                       details={"ranges": list(ranges)}),
            hook=upsert,
        )  # fmt: skip
        return ranges
