"""A run's PostgreSQL calls under load: each read gives its connection back as
soon as its rows are held, not once its event is durable, so a burst of calls
from one run never needs more logins than the run's share of the broker's
workers (and never meets the role's connection limit)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import psycopg
import pytest

from proctor.broker import DatasetBinding, handle_sql
from proctor.broker._fair import PER_RUN
from proctor.broker._pg_sql import (
    ROLE_CONNECTION_LIMIT,
    close_pg_pools,
    grant_deployment_role,
    revoke_deployment_role,
    run_login_role,
)
from proctor.testing import PostgresServer
from tests.conftest import LedgerEnv
from tests.integration.test_broker_sql import DEPLOYMENT, TENANT, default_caps, events, make_scope
from tests.pg.test_pg_datasets import make_pg_dataset

pytestmark = pytest.mark.postgres

CALLS = 4 * ROLE_CONNECTION_LIMIT


@pytest.fixture
def pg_scope(pg_server: PostgresServer, ledger_env: LedgerEnv, tmp_path: Any) -> Iterator[Any]:
    name = f"crm_{abs(hash(str(tmp_path))) % 10**9}"
    dsn = make_pg_dataset(pg_server, name)
    grant_deployment_role(
        dsn, TENANT, DEPLOYMENT, "crm", default_caps()["datasets"]["crm"]["tables"]
    )
    scope = make_scope(ledger_env, tmp_path / "unused.db")
    scope = replace(scope, datasets={"crm": DatasetBinding("crm", "postgresql", dsn)})
    yield scope, dsn
    close_pg_pools(scope)
    revoke_deployment_role(dsn, TENANT, DEPLOYMENT, "crm")
    pg_server.drop_database(name)


def test_a_burst_of_calls_holds_no_more_logins_than_its_workers(
    pg_scope: Any, ledger_env: LedgerEnv
) -> None:
    scope, dsn = pg_scope
    query = "SELECT id, name FROM customers WHERE id = ?"

    async def burst() -> list[Any]:
        calls = [
            handle_sql(scope, {"dataset": "crm", "sql": query, "params": [i % 5 + 1]})
            for i in range(CALLS)
        ]
        return await asyncio.gather(*calls, return_exceptions=True)

    answers = asyncio.run(burst())
    failed = [a for a in answers if isinstance(a, BaseException)]
    assert not failed, failed[:3]
    sql_events = events(ledger_env, "sql.")
    assert len(sql_events) == CALLS
    assert all(e["decision"] == "allow" for e in sql_events)
    login = run_login_role(TENANT, scope.run_id, "crm")
    with psycopg.connect(dsn) as admin:
        row = admin.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE usename = %s", (login,)
        ).fetchone()
    assert row is not None and row[0] <= PER_RUN
