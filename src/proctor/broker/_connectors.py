"""The registry of dataset connectors, keyed by a dataset's kind.

The only place that maps a kind (:class:`~proctor.governance.DatasetKind`) to code. Each
connector is imported when first used: the PostgreSQL one loads psycopg, which
a tenant with only SQLite datasets never needs.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from proctor.broker._calls import Acted, Call, Ruling, register
from proctor.broker._datasets import (
    DatasetConnector,
    SqlCall,
    Statement,
    TableShape,
    act,
    event_base,
    parse_request,
    rule,
)
from proctor.broker._http import read_body
from proctor.broker._scope import BadCall, BrokerError, CallDenied, DatasetBinding, RunScope
from proctor.errors import UsageError
from proctor.governance import DatasetKind
from proctor.ledger import Action
from proctor.policy import Decision

MAX_SQL_BODY = 1024 * 1024


def _postgresql() -> DatasetConnector:
    from proctor.broker._pg_sql import POSTGRESQL

    return POSTGRESQL


def _sqlite() -> DatasetConnector:
    from proctor.broker._sql import SQLITE

    return SQLITE


# In the order a location is offered to them: SQLite takes any path, so it is last.
_CONNECTORS: dict[DatasetKind, Callable[[], DatasetConnector]] = {
    DatasetKind.POSTGRESQL: _postgresql,
    DatasetKind.SQLITE: _sqlite,
}


def dataset_connector(kind: DatasetKind) -> DatasetConnector:
    """The connector for datasets of ``kind``; :class:`BadCall` if there is none."""
    load = _CONNECTORS.get(kind)
    if load is None:
        raise BadCall(f"sql: datasets of kind {kind!r} are not supported yet")
    return load()


def locate_dataset(where: Path | str) -> tuple[DatasetKind, str]:
    """(kind, location) of a dataset an operator names (a file path or a DSN),
    checked to be reachable before it is registered."""
    text = str(where)
    for load in _CONNECTORS.values():
        connector = load()
        if connector.recognises(text):
            return connector.kind, connector.locate(text)
    raise AssertionError("the SQLite connector takes any path")  # pragma: no cover


def missing_in_dataset(kind: DatasetKind, location: str, tables: Mapping[str, Any]) -> list[str]:
    """What of a manifest's ``tables`` the dataset at ``location`` lacks (sentences).
    Raises :class:`~proctor.errors.UsageError` if it cannot be read."""
    load = _CONNECTORS.get(kind)
    if load is None:
        return [f"datasets of kind {kind!r} are not supported"]
    return load().missing(location, tables)


def describe_dataset(kind: DatasetKind, location: str) -> list[TableShape]:
    """The tables of the dataset at ``location``, from its catalog; never a row.
    Raises :class:`~proctor.errors.UsageError` if it cannot be read."""
    load = _CONNECTORS.get(kind)
    if load is None:
        raise UsageError(f"datasets of kind {kind!r} cannot be described")
    return load().describe(location)


def revoke_run_grants(
    datasets: Iterable[tuple[DatasetKind, str, str]], tenant: str, run_id: str
) -> None:
    """Take back what a run was granted outside Proctor, for a run whose owner is
    gone (the runtime's sweep of dead owners' runs): ``datasets`` are the
    tenant's (kind, location, name). PostgreSQL: the run's login roles; the
    other kinds grant nothing per run. Raises :class:`~proctor.errors.ProctorError`
    if a database cannot be reached (the sweep tries again at the next opening)."""
    for kind, location, name in datasets:
        load = _CONNECTORS.get(kind)
        if load is not None:
            load().revoke_run(location, tenant, run_id, name)


@dataclass(frozen=True)
class SqlRequest:
    """One statement, checked as far as its engine checks before analysis."""

    connector: DatasetConnector
    binding: DatasetBinding
    dataset: str
    stmt: Statement
    details: dict[str, Any]
    #: The guest's call as checked (its text and parameters: an asked write names them).
    call: SqlCall | None = None


@dataclass(frozen=True)
class SqlRefused:
    """A SQL call refused before its statement is analysed: malformed, on a dataset
    not bound to the run, or a statement its engine refuses. Its ruling is the
    refusal the record stage records as the call's event (nothing is acted)."""

    ruling: Ruling


def _refused(scope: RunScope, resource: str, exc: BrokerError, base: dict[str, Any]) -> SqlRefused:
    denied = Decision(False, (), scope.policies.version)
    return SqlRefused(Ruling(Action.SQL_SELECT, resource, denied, f"refused: {exc.message}",
                             base, refusal=exc))  # fmt: skip


async def prepare(scope: RunScope, request: Mapping[str, Any]) -> SqlRequest | SqlRefused:
    """A guest's ``{"dataset", "sql", "params"}`` made a statement of the dataset's
    engine; a malformed call, one on a dataset not bound to the run, or a statement
    the engine refuses, a refusal for the record stage to record."""
    untrusted: object = request  # decoded JSON from the guest: any shape
    if not isinstance(untrusted, Mapping):
        untrusted = {}
    request = untrusted
    base = event_base(scope, request)
    try:
        call = parse_request(request)
        binding = scope.datasets.get(call.dataset)
        if binding is None:
            raise CallDenied(f"sql: no dataset {call.dataset!r} is bound to this run")
        connector = dataset_connector(binding.kind)
    except BrokerError as exc:
        return _refused(scope, f"dataset/{base['dataset']}", exc, base)
    try:
        stmt, details = await connector.prepare(scope, binding, call, base)
    except (BadCall, CallDenied) as exc:  # the engine's own checks refused it
        return _refused(scope, f"dataset/{call.dataset}", exc, base)
    return SqlRequest(connector, binding, call.dataset, stmt, details, call)


async def handle_sql(scope: RunScope, request: Mapping[str, Any]) -> dict[str, Any]:
    """One SQL call made for ``scope``'s run through the same stages as a guest's:
    ``{"dataset", "sql", "params"}`` in; for a read ``{"columns", "rows",
    "row_count", "truncated"}`` out, for a write ``{"rows_affected"}``. Raises
    :class:`CallDenied` (policy or a refused construct), :class:`BadCall`
    (malformed), :class:`StatementTimeout`, or :class:`CallRefused` (the ledger
    could not record: nothing is answered, a write is rolled back). Every outcome
    is recorded."""
    from proctor.broker._pipeline import perform  # it registers this module's kind

    answer: dict[str, Any] = await perform(scope, SQL, await prepare(scope, request))
    return answer


@dataclass(frozen=True)
class Sql:
    """``POST /v1/sql``: one statement on a dataset bound to the run: analysed and
    decided (one Cedar question per table it reads or writes, one decision), a read
    run and held or a write run in its transaction, recorded, then answered (a
    write committed once its event is durable)."""

    name: str = "sql"
    method: str = "POST"
    path: str = "/v1/sql"
    records_first: bool = False

    async def parse(self, call: Call) -> SqlRequest | SqlRefused:
        assert call.reader is not None and call.head is not None
        body = await read_body(call.reader, call.head, MAX_SQL_BODY)
        try:
            request = json.loads(body)
        except ValueError as exc:
            raise BadCall(f"the body is not JSON: {exc}") from exc
        if not isinstance(request, dict):
            raise BadCall("the body must be a JSON object")
        return await prepare(call.scope, request)

    async def decide(self, call: Call, request: SqlRequest | SqlRefused) -> Ruling:
        if isinstance(request, SqlRefused):
            return request.ruling
        return await rule(call.scope, request.stmt, request.dataset, request.binding,
                          request.details)  # fmt: skip

    async def act(self, call: Call, request: SqlRequest, ruling: Ruling | None) -> Acted:
        assert ruling is not None
        return await act(call.scope, request.stmt, ruling)

    async def done(self, call: Call, request: SqlRequest | SqlRefused) -> None:
        if isinstance(request, SqlRequest):
            await request.connector.close(call.scope, request.stmt)


SQL = register(Sql())
