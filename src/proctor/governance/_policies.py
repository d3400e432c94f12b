from __future__ import annotations

import hashlib
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from proctor.errors import NotFound
from proctor.ledger import Action, Actor, EventDraft, Ledger, LedgerObject, bound_details, utc_now
from proctor.policy import (
    CompiledPolicies,
    capability_policies,
    compile_policies,
    policy_version,
)
from proctor.store import Conn, Store

EMPTY = compile_policies("")


@dataclass(frozen=True)
class PolicyVersion:
    tenant: str
    version: str
    text: str
    set_at: str
    set_by: str
    seq: int


class Policies:
    """Each tenant's Cedar policy set, versioned by content hash.

    Setting a policy validates it against the schema first (an invalid one is
    refused with Cedar's message and changes nothing), then records
    ``policy.set`` in the tenant's log in the same transaction as the new row.
    A tenant with no policy has the empty set: everything is denied.
    """

    def __init__(self, store: Store, ledger: Ledger) -> None:
        self._store = store
        self._ledger = ledger
        self._compiled: dict[str, CompiledPolicies] = {EMPTY.version: EMPTY}
        self._lock = threading.Lock()

    def set(self, tenant: str, text: str, actor: Actor) -> PolicyVersion:
        compiled = compile_policies(text)
        set_at = utc_now()
        holder: list[PolicyVersion] = []

        def insert(conn: Conn) -> None:
            row = conn.query_one("SELECT MAX(seq) FROM policies WHERE tenant = ?", (tenant,))
            seq = int(row[0]) + 1 if row and row[0] is not None else 1
            conn.execute(
                "INSERT INTO policies (tenant, version, text, set_at, set_by, seq)"
                " VALUES (?, ?, ?, ?, ?, ?)",
                (tenant, compiled.version, compiled.text, set_at, actor.id, seq),
            )
            holder.append(
                PolicyVersion(tenant, compiled.version, compiled.text, set_at, actor.id, seq)
            )

        previous = self.current(tenant).version
        self._ledger.append(
            tenant,
            EventDraft(
                actor,
                Action.POLICY_SET,
                f"policy/{tenant}",
                reason="policy set",
                # The version pins the text; the ids are for people, cut past 64.
                details=bound_details(
                    {
                        "version": compiled.version,
                        "previous": previous,
                        "policies": list(compiled.policy_ids),
                    }
                ),
            ),
            hook=insert,
        )
        with self._lock:
            self._compiled[compiled.version] = compiled
        return holder[0]

    def current(self, tenant: str) -> PolicyVersion:
        with self._store.read() as conn:
            if conn.query_one("SELECT 1 FROM tenants WHERE name = ?", (tenant,)) is None:
                raise NotFound(f"unknown tenant {tenant!r}")
            row = conn.query_one(
                "SELECT version, text, set_at, set_by, seq FROM policies WHERE tenant = ?"
                " ORDER BY seq DESC LIMIT 1",
                (tenant,),
            )
        if row is None:
            return PolicyVersion(tenant, EMPTY.version, "", "", "", 0)
        return PolicyVersion(
            tenant, str(row[0]), str(row[1]), str(row[2]), str(row[3]), int(row[4])
        )

    def history(self, tenant: str) -> list[PolicyVersion]:
        with self._store.read() as conn:
            rows = conn.query(
                "SELECT version, text, set_at, set_by, seq FROM policies WHERE tenant = ?"
                " ORDER BY seq",
                (tenant,),
            )
        return [
            PolicyVersion(tenant, str(r[0]), str(r[1]), str(r[2]), str(r[3]), int(r[4]))
            for r in rows
        ]

    def compiled(self, tenant: str, extra: str = "") -> CompiledPolicies:
        """The tenant's current set, plus ``extra`` (e.g. a deployment's permits), parsed
        once per distinct text and reused."""
        text = self.current(tenant).text
        if extra:
            text = f"{text}\n{extra}" if text else extra
        version = policy_version(text)
        with self._lock:
            cached = self._compiled.get(version)
        if cached is not None:
            return cached
        compiled = compile_policies(text)
        with self._lock:
            self._compiled[compiled.version] = compiled
        return compiled


def effective_policies(
    policies: Policies,
    tenant: str,
    deployment: str,
    capabilities: Mapping[str, Any],
    forbid: str,
) -> CompiledPolicies:
    """The set a run of ``deployment`` is decided under: the tenant's own set, the
    permits compiled from the deployment's approved capabilities, and its
    environment's forbid (``environment_forbid``). Its version is what every call of
    the run records as ``policy_version``."""
    permits = capability_policies(tenant, deployment, capabilities)
    return policies.compiled(tenant, f"{permits}\n{forbid}")


def policy_object(compiled: CompiledPolicies) -> LedgerObject:
    """The policy text as a ledger object named by its version: the SHA-256 of the
    stored (normalized) text is both the object's digest and the version events cite."""
    data = compiled.text.encode("utf-8")
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    if digest != compiled.version:  # normalized text hashes to its version, always
        raise ValueError("a compiled policy's text does not hash to its version")
    return LedgerObject(digest, data)
