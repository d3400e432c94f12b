"""The run history kept in the store: one row per run, from its start to its end.

Below both the lifecycle (which writes the rows as runs start and end) and the
evidence (which reads them for packs, samples and lineage), so that neither
imports the other for it.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Protocol, runtime_checkable

from proctor.errors import RunRefused
from proctor.governance._prefixes import find_by_prefix
from proctor.ledger import utc_now
from proctor.store import Conflict, Conn, Store

#: The states a run can be in ("running" until its run.end is recorded).
RUN_STATUSES = ("running", "succeeded", "failed", "stopped", "interrupted")


@dataclass(frozen=True)
class RunRecord:
    id: str
    tenant: str
    deployment: str
    version: int
    digest: str
    environment: str
    workload: str
    approvals: tuple[str, ...]
    backend: str
    platform: str | None
    status: str  # running | succeeded | failed | stopped | interrupted
    reason: str | None
    exit_code: int | None
    attempt: int
    limits: dict[str, Any]
    output_digest: str | None
    started_at: str
    ended_at: str | None

    def as_json(self) -> dict[str, Any]:
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in self.__dict__.items()}


_COLUMNS = (
    "id, tenant, deployment, version, digest, environment, workload, approvals, backend,"
    " platform, status, reason, exit_code, attempt, limits, output_digest, started_at, ended_at"
)


def _row(r: tuple[Any, ...]) -> RunRecord:
    return RunRecord(
        str(r[0]), str(r[1]), str(r[2]), int(r[3]), str(r[4]), str(r[5]), str(r[6]),
        tuple(json.loads(r[7])), str(r[8]), None if r[9] is None else str(r[9]), str(r[10]),
        None if r[11] is None else str(r[11]), None if r[12] is None else int(r[12]),
        int(r[13]), json.loads(r[14]), None if r[15] is None else str(r[15]), str(r[16]),
        None if r[17] is None else str(r[17]),
    )  # fmt: skip


def _already_running(deployment: str, run_id: str | None) -> RunRefused:
    which = f" ({run_id})" if run_id else ""
    return RunRefused(
        f"deployment {deployment} is running already{which}; a service or a schedule "
        "has one run at a time",
        hint="stop the running one first, or let `proctor serve` keep it up",
    )


@runtime_checkable
class _HasStore(Protocol):
    @property
    def store(self) -> Store: ...


class Runs:
    """The run history kept in the store. Built on the store, or on anything that
    holds one (the runtime)."""

    def __init__(self, source: Store | _HasStore) -> None:
        self._store: Store = source.store if isinstance(source, _HasStore) else source

    @staticmethod
    def insert(
        conn: Conn, values: tuple[Any, ...], supervisor: str, *, exclusive: bool = False
    ) -> None:
        """Write a new run's row: ``values`` in :class:`RunRecord`'s field order, then
        the id of the process that owns it (see ``Runtime.close_orphaned_runs``).

        ``exclusive`` (a service or a schedule): the deployment has at most one run
        'running', enforced by the store (a partial unique index, migration 8), so
        two starts racing on two processes or nodes yield one run; the other is
        refused with :class:`RunRefused`. Call inside the transaction that records
        ``run.start``.
        """
        tenant, deployment = str(values[1]), str(values[2])
        if exclusive:
            row = conn.query_one(
                "SELECT id FROM runs WHERE tenant = ? AND service = ? AND status = 'running'",
                (tenant, deployment),
            )
            if row is not None:
                raise _already_running(deployment, str(row[0]))
        try:
            conn.execute(
                f"INSERT INTO runs ({_COLUMNS}, supervisor, service) VALUES"  # noqa: S608
                " (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (*values, supervisor, deployment if exclusive else None),
            )
        except Conflict:
            # A start on another connection won the race between our look and our
            # insert: the index refuses the second.
            if exclusive:
                raise _already_running(deployment, None) from None
            raise

    def running_one(self, tenant: str, deployment: str) -> str | None:
        """The id of the service's or schedule's run in progress, if any."""
        with self._store.read() as conn:
            row = conn.query_one(
                "SELECT id FROM runs WHERE tenant = ? AND service = ? AND status = 'running'",
                (tenant, deployment),
            )
        return None if row is None else str(row[0])

    def latest(self, tenant: str, deployment: str) -> RunRecord | None:
        """The deployment's most recently started run, on any node."""
        with self._store.read() as conn:
            row = conn.query_one(
                f"SELECT {_COLUMNS} FROM runs WHERE tenant = ? AND deployment = ?"  # noqa: S608
                " ORDER BY started_at DESC, id DESC LIMIT 1",
                (tenant, deployment),
            )
        return None if row is None else _row(row)

    def failed_since(self, tenant: str, deployment: str, since: float) -> int:
        """How many of the deployment's runs failed after ``since`` (epoch seconds)."""
        when = datetime.fromtimestamp(since, UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
        with self._store.read() as conn:
            row = conn.query_one(
                "SELECT COUNT(*) FROM runs WHERE tenant = ? AND deployment = ?"
                " AND status = 'failed' AND ended_at >= ?",
                (tenant, deployment, when),
            )
        return 0 if row is None else int(row[0])

    def get(self, tenant: str, run_id: str) -> RunRecord:
        """The run with this id, or the one run whose id starts with it."""
        with self._store.read() as conn:
            r = find_by_prefix(
                conn, "runs", _COLUMNS, tenant, run_id, noun="run",
                hint="`proctor runs list` shows them",
            )  # fmt: skip
        return _row(r)

    def all(
        self, tenant: str, deployment: str | None = None, status: str | None = None
    ) -> list[RunRecord]:
        clauses, params = ["tenant = ?"], [tenant]
        if deployment is not None:
            clauses.append("deployment = ?")
            params.append(deployment)
        if status is not None:
            clauses.append("status = ?")
            params.append(status)
        with self._store.read() as conn:
            rows = conn.query(
                f"SELECT {_COLUMNS} FROM runs WHERE {' AND '.join(clauses)}"  # noqa: S608
                " ORDER BY started_at",
                params,
            )
        return [_row(r) for r in rows]

    def of_artifact(self, tenant: str, digest: str) -> list[RunRecord]:
        """Every run of one digest: how it behaved in the build loop is part of its review."""
        with self._store.read() as conn:
            rows = conn.query(
                f"SELECT {_COLUMNS} FROM runs WHERE tenant = ? AND digest = ?"  # noqa: S608
                " ORDER BY started_at",
                (tenant, digest),
            )
        return [_row(r) for r in rows]

    def between(self, tenant: str, start: str, end: str) -> list[RunRecord]:
        """Runs that were in progress at some point in [start, end]."""
        with self._store.read() as conn:
            rows = conn.query(
                f"SELECT {_COLUMNS} FROM runs WHERE tenant = ? AND started_at <= ?"  # noqa: S608
                " AND (ended_at IS NULL OR ended_at >= ?) ORDER BY started_at",
                (tenant, end, start),
            )
        return [_row(r) for r in rows]


@dataclass(frozen=True)
class RunStanding:
    """What a run stands on, held against the store at each of its calls.

    Called with the connection of the transaction that appends the call's event
    (see the broker's ``RunScope.standing``), so a ``tenant freeze``, a stopped
    deployment or a revoked approval committed by any process before that event
    is seen by it: no call is allowed after the event that took its footing away.
    Returns why the run no longer stands, or None. Two indexed reads (three for a
    production run); the supervisor's watcher still makes the full quorum check
    (from the signed record) and stops the run.
    """

    tenant: str
    deployment: str
    digest: str
    #: The approvals the run started under (production), and how many independent
    #: voters the quorum then required (0: none, a sandbox run).
    approvals: tuple[str, ...] = ()
    required: int = 0
    #: Set when the run was asked to stop (a signal, ``serve`` ending, the watcher).
    stopped: Callable[[], bool] | None = None

    def __call__(self, conn: Conn) -> str | None:
        # The record's cause first: a watcher that saw a stopped deployment also asks
        # the run to stop, and the refusal should name the stop, not the asking.
        why = self._recorded(conn)
        if why is None and self.stopped is not None and self.stopped():
            return "the run was asked to stop"
        return why

    def _recorded(self, conn: Conn) -> str | None:
        row = conn.query_one(
            "SELECT (SELECT status FROM tenants WHERE name = ?),"
            " (SELECT status FROM deployments WHERE tenant = ? AND name = ?"
            " ORDER BY version DESC LIMIT 1)",
            (self.tenant, self.tenant, self.deployment),
        )
        tenant_status, deployment_status = (None, None) if row is None else row
        if tenant_status is None:
            return "the tenant is gone"
        if tenant_status == "frozen":
            return "the tenant is frozen"
        if deployment_status != "active":
            return f"the deployment is {deployment_status or 'gone'}"
        if self.required <= 0:
            return None
        now = utc_now()
        voters: set[str] = set()
        for ident, principal, decision, expires_at, revoked_at in conn.query(
            "SELECT id, principal, decision, expires_at, revoked_at FROM approvals"
            " WHERE tenant = ? AND digest = ?",
            (self.tenant, self.digest),
        ):
            standing = revoked_at is None and (expires_at is None or str(expires_at) > now)
            if not standing:
                continue
            if decision == "reject":
                return f"the artifact was rejected by {principal}"
            if ident in self.approvals:
                voters.add(str(principal))
        if len(voters) < self.required:
            return (
                f"its approvals no longer make the quorum ({len(voters)} standing of the "
                f"{self.required} required)"
            )
        return None
