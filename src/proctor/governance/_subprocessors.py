"""The subprocessor register (GDPR Art. 28(2)/(4)) and the forbid it implies.

A subprocessor is a third party a tenant's data may be sent to: its name, what
for, where it processes, and the hosts it serves. Every change is a control
action in the tenant's log, written in the same transaction as the row. The
register is enforced, not only documented: :func:`subprocessor_forbid` is a
tenant-wide Cedar forbid of ``http.request`` to any host no registered
subprocessor covers, appended to every run's policy set, so no deployment can
reach a host the controller was never told about, whatever its manifest asks.
"""

from __future__ import annotations

import builtins
import json
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from proctor.errors import AlreadyExists, NotFound, UsageError
from proctor.governance._manifest import egress_entry
from proctor.ledger import Action, Actor, EventDraft, Ledger, utc_now
from proctor.store import Conn, Store

FORBID_ID = "tenant:subprocessors"
_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9._-]{0,62}$")
# What a normalized egress entry can contain; anything else never reaches Cedar text.
_ENTRY_RE = re.compile(r"^(\*\.)?(\[[0-9a-f:.]+\]|[a-z0-9.-]+):[0-9]{1,5}$")


@dataclass(frozen=True)
class Subprocessor:
    tenant: str
    name: str
    purpose: str
    location: str
    hosts: tuple[str, ...]
    created_at: str
    created_by: str

    def as_json(self) -> dict[str, Any]:
        return {
            "tenant": self.tenant,
            "name": self.name,
            "purpose": self.purpose,
            "location": self.location,
            "hosts": list(self.hosts),
            "created_at": self.created_at,
            "created_by": self.created_by,
        }


def split_entry(entry: str) -> tuple[str, int]:
    """``host:port`` / ``[v6]:port`` / ``*.domain:port`` (normalized) -> (host, port)."""
    host, _, port = entry.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host, int(port)


def covers(entry: str, host: str, port: int) -> bool:
    """Whether one normalized entry covers ``host`` (normalized) on ``port``.

    The same rule as a capability permit's: ``*.domain`` matches names below
    ``domain``, never ``domain`` itself; the port must be equal.
    """
    name, entry_port = split_entry(entry)
    if entry_port != port:
        return False
    if name.startswith("*."):
        suffix = name[1:]
        return host.endswith(suffix) and len(host) > len(suffix)
    return host == name


def _cedar_host_condition(entry: str) -> str:
    if not _ENTRY_RE.match(entry):
        raise UsageError(f"subprocessor host {entry!r} is not a normalized egress entry")
    name, port = split_entry(entry)
    # Normalized entries hold only [a-z0-9.:*-], so a JSON string is a valid Cedar
    # string; `like` is anchored at both ends, as in the capability permits.
    if name.startswith("*."):
        return f"(resource.name like {json.dumps(name)} && context.port == {port})"
    return f"(resource.name == {json.dumps(name)} && context.port == {port})"


def subprocessor_forbid(tenant: str, subprocessors: list[Subprocessor]) -> str:
    """The tenant-wide forbid: ``http.request`` to a host that no registered
    subprocessor covers is refused, whatever a deployment's permits say.

    With no subprocessor registered, every request is forbidden: an empty
    register means the controller authorised no recipient at all.
    """
    # Normalized again here, so a register row written by other means cannot smuggle
    # text into the policy.
    entries = {h for s in subprocessors if s.tenant == tenant for h in s.hosts}
    return egress_forbid(FORBID_ID, entries)


def egress_forbid(policy_id: str, hosts: Iterable[str]) -> str:
    """A forbid of every ``http.request`` to a host that none of ``hosts`` covers."""
    entries = sorted({egress_entry(h, "host") for h in hosts})
    head = (
        f"@id({json.dumps(policy_id)})\n"
        'forbid (\n  principal,\n  action == Proctor::Action::"http.request",\n  resource\n)'
    )
    if not entries:
        return head + ";\n"
    conditions = " ||\n  ".join(_cedar_host_condition(e) for e in entries)
    return f"{head}\nunless {{\n  {conditions}\n}};\n"


class Subprocessors:
    """The register of one runtime, per tenant, recorded in each tenant's log."""

    def __init__(self, store: Store, ledger: Ledger) -> None:
        self._store = store
        self._ledger = ledger

    def add(
        self,
        tenant: str,
        name: str,
        *,
        purpose: str,
        location: str,
        hosts: list[str],
        actor: Actor,
    ) -> Subprocessor:
        if not _NAME_RE.match(name):
            raise UsageError(
                f"invalid subprocessor name {name!r}",
                hint="lowercase letters, digits, '.', '_' or '-', up to 63 characters",
            )
        if not purpose.strip():
            raise UsageError("a subprocessor needs a --purpose (GDPR Art. 28(3)(d))")
        if not location.strip():
            raise UsageError("a subprocessor needs a --location (where it processes the data)")
        if not hosts:
            raise UsageError("name at least one --host the subprocessor serves")
        norm = tuple(sorted({egress_entry(h, "--host") for h in hosts}))
        created_at = utc_now()

        def insert(conn: Conn) -> None:
            if conn.query_one("SELECT 1 FROM tenants WHERE name = ?", (tenant,)) is None:
                raise NotFound(f"unknown tenant {tenant!r}")
            if conn.query_one(
                "SELECT 1 FROM subprocessors WHERE tenant = ? AND name = ?", (tenant, name)
            ):
                raise AlreadyExists(f"subprocessor {name!r} exists already in tenant {tenant!r}")
            conn.execute(
                "INSERT INTO subprocessors (tenant, name, purpose, location, hosts, created_at,"
                " created_by) VALUES (?, ?, ?, ?, ?, ?, ?)",
                (tenant, name, purpose, location, json.dumps(list(norm)), created_at, actor.id),
            )

        self._ledger.append(
            tenant,
            EventDraft(
                actor,
                Action.SUBPROCESSOR_ADD,
                f"subprocessor/{name}",
                reason="registered",
                details={"purpose": purpose, "location": location, "hosts": list(norm)},
            ),
            hook=insert,
        )
        return Subprocessor(tenant, name, purpose, location, norm, created_at, actor.id)

    def list(self, tenant: str) -> list[Subprocessor]:
        with self._store.read() as conn:
            rows = conn.query(
                "SELECT name, purpose, location, hosts, created_at, created_by FROM subprocessors"
                " WHERE tenant = ? ORDER BY name",
                (tenant,),
            )
        return [
            Subprocessor(tenant, str(r[0]), str(r[1]), str(r[2]),
                         tuple(str(h) for h in json.loads(r[3])), str(r[4]), str(r[5]))
            for r in rows
        ]  # fmt: skip

    def remove(self, tenant: str, name: str, actor: Actor) -> None:
        def delete(conn: Conn) -> None:
            if not conn.query_one(
                "SELECT 1 FROM subprocessors WHERE tenant = ? AND name = ?", (tenant, name)
            ):
                raise NotFound(f"no subprocessor {name!r} in tenant {tenant!r}")
            conn.execute("DELETE FROM subprocessors WHERE tenant = ? AND name = ?", (tenant, name))

        self._ledger.append(
            tenant,
            EventDraft(actor, Action.SUBPROCESSOR_REMOVE, f"subprocessor/{name}", reason="removed"),
            hook=delete,
        )

    def forbid(self, tenant: str) -> str:
        """:func:`subprocessor_forbid` for the tenant's current register."""
        return subprocessor_forbid(tenant, self.list(tenant))

    def covering(self, tenant: str, host: str, port: int) -> builtins.list[Subprocessor]:
        return [s for s in self.list(tenant) if any(covers(h, host, port) for h in s.hosts)]
