"""SQL through the broker on a real PostgreSQL dataset: a role per deployment with
column-level grants, queries under it in read-only transactions, Cedar first."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

import psycopg
import pytest

from proctor.broker import (
    BadCall,
    CallDenied,
    DatasetBinding,
    RunScope,
    StatementTimeout,
    handle_sql,
)
from proctor.broker._pg_sql import (
    close_pg_pools,
    connect_as_role,
    create_run_login,
    grant_deployment_role,
    revoke_deployment_role,
    run_login_role,
)
from proctor.policy import compile_policies
from proctor.testing import PostgresServer
from tests.conftest import LedgerEnv
from tests.integration.test_broker_sql import (
    ALLOWED,
    CUSTOMERS,
    DEPLOYMENT,
    SECRET_VALUES,
    TENANT,
    default_caps,
    events,
    last_event,
    make_scope,
    row_keys,
)

pytestmark = pytest.mark.postgres


def make_pg_dataset(server: PostgresServer, name: str) -> str:
    dsn = server.create_database(name)
    with psycopg.connect(dsn) as conn:
        conn.execute(
            "CREATE TABLE customers (id BIGINT PRIMARY KEY, name TEXT, email TEXT,"
            " country TEXT, plan TEXT, mrr NUMERIC)"
        )
        conn.execute("CREATE TABLE events (customer BIGINT, kind TEXT)")
        with conn.cursor() as cur:
            cur.executemany("INSERT INTO customers VALUES (%s, %s, %s, %s, %s, %s)", CUSTOMERS)
            cur.executemany(
                "INSERT INTO events VALUES (%s, %s)", [(1, "login"), (2, "login"), (42, "churn")]
            )
    return dsn


@dataclass
class PgEnv:
    ledger: LedgerEnv
    dsn: str
    scope: RunScope
    role: str
    # A login of the deployment's role outside any broker run: what a guest's
    # statements run as, for checks of what the database itself refuses.
    login: str
    password: str


@pytest.fixture
def pg(pg_server: PostgresServer, ledger_env: LedgerEnv, tmp_path: Any) -> Iterator[PgEnv]:
    name = f"crm_{abs(hash(str(tmp_path))) % 10**9}"
    dsn = make_pg_dataset(pg_server, name)
    tables = default_caps()["datasets"]["crm"]["tables"]
    role = grant_deployment_role(dsn, TENANT, DEPLOYMENT, "crm", tables)
    login = run_login_role(TENANT, "direct", "crm")
    password = create_run_login(dsn, role, login, allow=lambda table, column: True)
    scope = make_scope(ledger_env, tmp_path / "unused.db")
    scope = replace(scope, datasets={"crm": DatasetBinding("crm", "postgresql", dsn)})
    yield PgEnv(ledger_env, dsn, scope, role, login, password)
    close_pg_pools(scope)
    revoke_deployment_role(dsn, TENANT, DEPLOYMENT, "crm")
    pg_server.drop_database(name)


def sql(scope: RunScope, query: str, params: Any = None) -> dict[str, Any]:
    request: dict[str, Any] = {"dataset": "crm", "sql": query}
    if params is not None:
        request["params"] = params
    return asyncio.run(handle_sql(scope, request))


def test_permitted_columns_are_read_and_recorded_with_lineage(pg: PgEnv) -> None:
    out = sql(
        pg.scope, "SELECT id, name, plan FROM customers WHERE country = ? ORDER BY id", ["GB"]
    )
    assert out == {
        "columns": ["id", "name", "plan"],
        "rows": [[1, "Ada Lovelace", "pro"], [3, "Alan Turing", "free"]],
        "row_count": 2,
        "truncated": False,
    }
    ev = last_event(pg.ledger)
    assert (ev["action"], ev["decision"]) == ("sql.select", "allow")
    assert ev["policies"] == ["deploy:churn:sql:crm.customers"]
    assert ev["resource"] == "dataset/crm/table/customers"
    d = ev["details"]
    assert d["outcome"] == "ok" and d["row_count"] == 2 and d["lineage"] == "rows"
    assert d["tables"][0]["columns"] == ["country", "id", "name", "plan"]
    # The same keyed hashes as for a SQLite dataset: "which runs read customer 1?"
    assert row_keys(pg.ledger, d) == pg.scope.key_hmacs(["1", "3"])
    assert not any(s in str(ev) for s in SECRET_VALUES)


def test_aggregates_and_joins_fall_back_to_table_lineage(pg: PgEnv) -> None:
    out = sql(
        pg.scope, "SELECT country, count(*), sum(mrr) FROM customers GROUP BY country ORDER BY 1"
    )
    assert out["rows"][0] == ["GB", 2, 120]
    assert last_event(pg.ledger)["details"]["lineage"] == "table"
    out = sql(
        pg.scope,
        "SELECT c.name, e.kind FROM customers c JOIN events e ON e.customer = c.id ORDER BY c.id",
    )
    assert out["rows"] == [
        ["Ada Lovelace", "login"],
        ["Grace Hopper", "login"],
        ["Barbara Liskov", "churn"],
    ]
    ev = last_event(pg.ledger)
    assert ev["resource"] == "dataset/crm"
    assert {t["table"] for t in ev["details"]["tables"]} == {"customers", "events"}


def test_a_column_outside_the_approval_is_denied_by_policy_first(pg: PgEnv) -> None:
    with pytest.raises(CallDenied):
        sql(pg.scope, "SELECT name FROM customers WHERE email LIKE ?", ["%example%"])
    ev = last_event(pg.ledger)
    assert ev["decision"] == "deny"
    assert not any(s in str(ev) for s in SECRET_VALUES)


def test_the_database_refuses_a_column_outside_the_grant_even_if_policy_permits(pg: PgEnv) -> None:
    # A policy that permits every column: the policy layer is out of the way.
    lax = compile_policies(
        '@id("lax") permit (principal, action == Proctor::Action::"sql.select", resource);'
    )
    scope = replace(pg.scope, policies=lax)
    try:
        with pytest.raises(CallDenied, match="permission denied"):
            sql(scope, "SELECT email FROM customers")
        assert last_event(pg.ledger)["reason"].startswith("refused: the database refused it")
    finally:
        close_pg_pools(scope)
    # And with no broker at all: logged in as the role, the database says no.
    with connect_as_role(pg.dsn, pg.login, pg.password) as conn:
        assert conn.execute("SELECT name FROM customers WHERE id = 1").fetchone() == (
            "Ada Lovelace",
        )
        for query in (
            "SELECT email FROM customers",
            "SELECT * FROM customers",
            "UPDATE customers SET plan = 'x' WHERE id = 1",
            "SELECT set_config('role', 'postgres', false)",
        ):
            with pytest.raises(psycopg.Error):
                conn.execute(query)
            conn.rollback() if not conn.autocommit else None


def test_writes_and_several_statements_are_refused(pg: PgEnv) -> None:
    for query in (
        "UPDATE customers SET plan = 'free'",
        "DELETE FROM customers",
        "SELECT 1; DROP TABLE customers",
        "WITH x AS (DELETE FROM customers RETURNING id) SELECT id FROM x",
    ):
        with pytest.raises((CallDenied, BadCall)):
            sql(pg.scope, query)
    with psycopg.connect(pg.dsn) as conn:
        assert conn.execute("SELECT count(*) FROM customers").fetchone() == (len(CUSTOMERS),)
        assert conn.execute("SELECT DISTINCT plan FROM customers WHERE id = 1").fetchone() == (
            "pro",
        )


def test_statement_timeout_stops_a_runaway_query(pg: PgEnv) -> None:
    scope = replace(pg.scope, statement_timeout=0.3)
    try:
        with pytest.raises(StatementTimeout):
            sql(
                scope,
                "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n)"
                " SELECT count(*) FROM n, customers",
            )
    finally:
        close_pg_pools(scope)
    assert any(
        e["details"].get("outcome") == "timeout" or "timeout" in e["reason"]
        for e in events(pg.ledger)
    )


def test_undeploy_drops_the_role(pg: PgEnv) -> None:
    assert sql(pg.scope, "SELECT count(*) FROM customers")["rows"] == [[len(CUSTOMERS)]]
    close_pg_pools(pg.scope)
    assert revoke_deployment_role(pg.dsn, TENANT, DEPLOYMENT, "crm") is True
    with psycopg.connect(pg.dsn) as conn:
        assert (
            conn.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", (pg.role,)).fetchone() is None
        )
    with pytest.raises(psycopg.OperationalError):
        connect_as_role(pg.dsn, pg.login, pg.password)
    assert revoke_deployment_role(pg.dsn, TENANT, DEPLOYMENT, "crm") is False


def test_regrant_matches_the_new_approval_exactly(pg: PgEnv) -> None:
    grant_deployment_role(
        pg.dsn, TENANT, DEPLOYMENT, "crm", {"customers": {"columns": ["id", "plan"]}}
    )
    with connect_as_role(pg.dsn, pg.login, pg.password) as conn:
        assert conn.execute("SELECT id, plan FROM customers WHERE id = 42").fetchone() == (
            42,
            "enterprise",
        )
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            conn.execute("SELECT name FROM customers")
    with (
        connect_as_role(pg.dsn, pg.login, pg.password) as conn,
        pytest.raises(psycopg.errors.InsufficientPrivilege),
    ):
        conn.execute("SELECT kind FROM events")
    assert ALLOWED  # the original grant was wider
