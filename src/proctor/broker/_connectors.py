"""The registry of dataset connectors, keyed by a dataset's kind.

The only place that maps a kind ("sqlite", "postgresql") to code. Each
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
from proctor.broker._datasets import DatasetConnector, event_base, parse_request
from proctor.broker._http import read_body
from proctor.broker._scope import BadCall, BrokerError, CallDenied, RunScope
from proctor.ledger import Action

MAX_SQL_BODY = 1024 * 1024


def _postgresql() -> DatasetConnector:
    from proctor.broker._pg_sql import POSTGRESQL

    return POSTGRESQL


def _sqlite() -> DatasetConnector:
    from proctor.broker._sql import SQLITE

    return SQLITE


# In the order a location is offered to them: SQLite takes any path, so it is last.
_CONNECTORS: dict[str, Callable[[], DatasetConnector]] = {
    "postgresql": _postgresql,
    "sqlite": _sqlite,
}


def dataset_connector(kind: str) -> DatasetConnector:
    """The connector for datasets of ``kind``; :class:`BadCall` if there is none."""
    load = _CONNECTORS.get(kind)
    if load is None:
        raise BadCall(f"sql: datasets of kind {kind!r} are not supported yet")
    return load()


def locate_dataset(where: Path | str) -> tuple[str, str]:
    """(kind, location) of a dataset an operator names (a file path or a DSN),
    checked to be reachable before it is registered."""
    text = str(where)
    for load in _CONNECTORS.values():
        connector = load()
        if connector.recognises(text):
            return connector.kind, connector.locate(text)
    raise AssertionError("the SQLite connector takes any path")  # pragma: no cover


def missing_in_dataset(kind: str, location: str, tables: Mapping[str, Any]) -> list[str]:
    """What of a manifest's ``tables`` the dataset at ``location`` lacks (sentences).
    Raises :class:`~proctor.errors.UsageError` if it cannot be read."""
    load = _CONNECTORS.get(kind)
    if load is None:
        return [f"datasets of kind {kind!r} are not supported"]
    return load().missing(location, tables)


def revoke_run_grants(datasets: Iterable[tuple[str, str, str]], tenant: str, run_id: str) -> None:
    """Take back what a run was granted outside Proctor, for a run whose owner is
    gone (the runtime's sweep of dead owners' runs): ``datasets`` are the
    tenant's (kind, location, name). PostgreSQL: the run's login roles; the
    other kinds grant nothing per run. Raises :class:`~proctor.errors.ProctorError`
    if a database cannot be reached (the sweep tries again at the next opening)."""
    for kind, location, name in datasets:
        if kind == "postgresql":
            from proctor.broker._pg_sql import drop_run_logins

            drop_run_logins(location, tenant, run_id, name)


async def handle_sql(scope: RunScope, request: Mapping[str, Any]) -> dict[str, Any]:
    """One guest SQL call: ``{"dataset", "sql", "params"}`` in; for a read
    ``{"columns", "rows", "row_count", "truncated"}`` out, for a write
    ``{"rows_affected"}``. Raises :class:`CallDenied` (policy or a refused
    construct), :class:`BadCall` (malformed), :class:`StatementTimeout`, or
    :class:`CallRefused` (the ledger could not record: nothing is answered,
    a write is rolled back). Every outcome is recorded."""
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
        await scope.record_refusal(
            Action.SQL_SELECT, f"dataset/{base['dataset']}", exc.message, details=base
        )
        raise
    return await connector.handle(scope, binding, call, base)


@dataclass(frozen=True)
class Sql:
    """``POST /v1/sql``: one statement on a dataset bound to the run.

    Its decision is not yet a ruling of the decide stage: the connector asks one
    Cedar question per table it reads or writes, and records the call itself
    (``_datasets.answer``), inside the act.
    """

    name: str = "sql"
    method: str = "POST"
    path: str = "/v1/sql"
    records_first: bool = False

    async def parse(self, call: Call) -> dict[str, Any]:
        assert call.reader is not None and call.head is not None
        body = await read_body(call.reader, call.head, MAX_SQL_BODY)
        try:
            request = json.loads(body)
        except ValueError as exc:
            raise BadCall(f"the body is not JSON: {exc}") from exc
        if not isinstance(request, dict):
            raise BadCall("the body must be a JSON object")
        return request

    async def decide(self, call: Call, request: dict[str, Any]) -> Ruling | None:
        return None

    async def act(self, call: Call, request: dict[str, Any], ruling: Ruling | None) -> Acted:
        handler = call.handlers.sql if call.handlers is not None else handle_sql
        return Acted(answer=await handler(call.scope, request))


SQL = register(Sql())
