"""Issue 36: a column that Cedar forbids is never read from a PostgreSQL dataset,
whatever shape the query takes.

The attacker's setting, for real: a real PostgreSQL, a manifest approving
``customers(id, country, plan, mrr)`` and ``invoices``, the tenant's Cedar set
forbidding ``mrr`` and ``invoices``. Every shape the attacker's round got through
(subqueries with ``OFFSET 0``, materialized and recursive CTEs, set operations,
whole-row values, oracles) is tried through the broker's SQL handler, and again
logged in as the run's own login with no broker in the way: PostgreSQL itself
refuses each, because the run's login holds only what Cedar allows.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import psycopg
import pytest

from proctor.broker import CallDenied, DatasetBinding, RunScope, handle_sql
from proctor.broker._pg_sql import (
    _pool,
    close_pg_pools,
    column_grants,
    connect_as_role,
    grant_deployment_role,
    revoke_deployment_role,
    run_login_role,
)
from proctor.testing import PostgresServer
from tests.conftest import LedgerEnv
from tests.integration.test_broker_sql import DEPLOYMENT, TENANT, last_event, make_scope

pytestmark = pytest.mark.postgres

MANIFEST: dict[str, Any] = {
    "datasets": {
        "crm": {
            "tables": {
                "customers": {"columns": ["id", "country", "plan", "mrr"], "access": "read"},
                "invoices": {"columns": ["id", "customer", "amount"], "access": "read"},
            }
        }
    }
}
TENANT_POLICY = f"""
@id("tenant:no-mrr")
forbid (principal, action == Proctor::Action::"sql.select", resource)
when {{ context.columns.contains("mrr") }};
@id("tenant:no-invoices")
forbid (principal, action, resource == Proctor::Table::"{TENANT}/crm/invoices");
"""
CUSTOMERS = [
    (1, "Ada Lovelace", "ada@example.com", "GB", "pro", 31337),
    (2, "Grace Hopper", "grace@example.com", "US", "team", 27183),
    (3, "Alan Turing", "alan@example.com", "GB", "free", 16180),
    (4, "Edsger Dijkstra", "edsger@example.com", "NL", "pro", 14142),
    (42, "Barbara Liskov", "barbara@example.com", "US", "enterprise", 29979),
]
INVOICES = [(1, 1, "7777.77"), (2, 2, "8888.88"), (3, 42, "6666.66")]
#: What must never reach the guest: every mrr, every invoice amount, every e-mail.
FORBIDDEN = [str(c[5]) for c in CUSTOMERS] + [i[2] for i in INVOICES] + [c[2] for c in CUSTOMERS]


@dataclass
class Dataset:
    server: PostgresServer
    dsn: str


@pytest.fixture(scope="module")
def dataset(pg_server: PostgresServer) -> Iterator[Dataset]:
    """One dataset database and deployment role for the module: each test is a run
    of its own (its own login, granted at its first statement)."""
    name = "crm_column_control"
    dsn = pg_server.create_database(name)
    with psycopg.connect(dsn) as conn:
        conn.execute(
            "CREATE TABLE customers (id BIGINT PRIMARY KEY, name TEXT, email TEXT,"
            " country TEXT, plan TEXT, mrr NUMERIC)"
        )
        conn.execute(
            "CREATE TABLE invoices (id BIGINT PRIMARY KEY, customer BIGINT, amount NUMERIC)"
        )
        with conn.cursor() as cur:
            cur.executemany("INSERT INTO customers VALUES (%s, %s, %s, %s, %s, %s)", CUSTOMERS)
            cur.executemany("INSERT INTO invoices VALUES (%s, %s, %s)", INVOICES)
    grant_deployment_role(dsn, TENANT, DEPLOYMENT, "crm", MANIFEST["datasets"]["crm"]["tables"])
    yield Dataset(pg_server, dsn)
    revoke_deployment_role(dsn, TENANT, DEPLOYMENT, "crm")
    pg_server.drop_database(name)


@pytest.fixture
def store_engine() -> str:
    """The dataset's engine is the subject, not the ledger's: SQLite only."""
    return "sqlite"


_runs = iter(range(1, 1 << 30))


def run_scope(ledger_env: LedgerEnv, dataset: Dataset, tmp_path: Path, policy: str) -> RunScope:
    scope = make_scope(
        ledger_env,
        tmp_path / "unused.db",
        caps=MANIFEST,
        extra_policies=policy,
        run_id=f"r-cc-{next(_runs)}",
    )
    return replace(scope, datasets={"crm": DatasetBinding("crm", "postgresql", dataset.dsn)})


@pytest.fixture
def scope(ledger_env: LedgerEnv, dataset: Dataset, tmp_path: Path) -> Iterator[RunScope]:
    """A run under the tenant's set that forbids mrr and invoices."""
    scope = run_scope(ledger_env, dataset, tmp_path, TENANT_POLICY)
    yield scope
    close_pg_pools(scope)


def sql(scope: RunScope, query: str) -> dict[str, Any]:
    return asyncio.run(handle_sql(scope, {"dataset": "crm", "sql": query}))


def login_of(scope: RunScope) -> tuple[str, str]:
    """The run's login role and its password (opened at its first statement)."""
    pool = _pool(scope, scope.datasets["crm"])
    assert pool._password is not None, "no statement opened the run's login yet"
    return pool.login, pool._password


def event_text(ev: dict[str, Any]) -> str:
    """An event without its keyed hashes (hex, which could hold any digits)."""
    details = {k: v for k, v in ev["details"].items() if k not in ("sql_hmac", "lineage_object")}
    return json.dumps([ev["reason"], ev["resource"], details])


def assert_no_forbidden_value(text: str) -> None:
    for value in FORBIDDEN:
        assert value not in text, value


# -- the run's login holds exactly what Cedar allows ---------------------------------


def test_the_runs_login_is_granted_exactly_the_columns_cedar_allows(
    scope: RunScope, dataset: Dataset
) -> None:
    assert sql(scope, "SELECT id FROM customers WHERE id = 1")["rows"] == [[1]]
    login, _ = login_of(scope)
    with psycopg.connect(dataset.dsn, autocommit=True) as conn:
        assert column_grants(conn, login) == {("public", "customers"): ["id", "country", "plan"]}
        # No membership: a member of the deployment's role could SET ROLE to it
        # and read every approved column, mrr and invoices included.
        member_of = conn.execute(
            "SELECT count(*) FROM pg_auth_members m JOIN pg_roles r ON r.oid = m.member"
            " WHERE r.rolname = %s",
            (login,),
        ).fetchone()
        assert member_of == (0,)
        for table, column, granted in (
            ("customers", "id", True),
            ("customers", "plan", True),
            ("customers", "mrr", False),
            ("customers", "email", False),
            ("invoices", "amount", False),
            ("invoices", "id", False),
        ):
            held = conn.execute(
                "SELECT has_column_privilege(%s, %s, %s, 'SELECT')", (login, table, column)
            ).fetchone()
            assert held == (granted,), (table, column)


def test_a_run_under_a_wider_set_is_granted_more_and_runs_are_apart(
    scope: RunScope, ledger_env: LedgerEnv, dataset: Dataset, tmp_path: Path
) -> None:
    """The grant is the run's: a run whose set permits mrr reads it; the other run,
    at the same time, still cannot."""
    wide = run_scope(ledger_env, dataset, tmp_path, "")
    try:
        out = sql(wide, "SELECT id, mrr FROM customers WHERE id = 1")
        assert out["rows"] == [[1, 31337]]
        with pytest.raises(CallDenied, match="permission denied"):
            sql(scope, "SELECT x::text FROM (SELECT mrr AS x FROM customers OFFSET 0) s")
        with psycopg.connect(dataset.dsn, autocommit=True) as conn:
            assert column_grants(conn, login_of(wide)[0]) == {
                ("public", "customers"): ["id", "country", "plan", "mrr"],
                ("public", "invoices"): ["id", "customer", "amount"],
            }
    finally:
        close_pg_pools(wide)


def test_a_regrant_narrows_a_live_runs_login(
    scope: RunScope, dataset: Dataset, ledger_env: LedgerEnv, tmp_path: Path
) -> None:
    wide = run_scope(ledger_env, dataset, tmp_path, "")
    try:
        assert sql(wide, "SELECT mrr FROM customers WHERE id = 1")["rows"] == [[31337]]
        login, password = login_of(wide)
        grant_deployment_role(
            dataset.dsn, TENANT, DEPLOYMENT, "crm", {"customers": {"columns": ["id", "plan"]}}
        )
        with connect_as_role(dataset.dsn, login, password) as conn:
            assert conn.execute("SELECT id, plan FROM customers WHERE id = 1").fetchone() == (
                1,
                "pro",
            )
            for query in ("SELECT mrr FROM customers", "SELECT count(*) FROM invoices"):
                with pytest.raises(psycopg.errors.InsufficientPrivilege):
                    conn.execute(query)
    finally:
        close_pg_pools(wide)
        grant_deployment_role(
            dataset.dsn, TENANT, DEPLOYMENT, "crm", MANIFEST["datasets"]["crm"]["tables"]
        )


def test_undeploy_drops_a_live_runs_login(dataset: Dataset, scope: RunScope) -> None:
    assert sql(scope, "SELECT id FROM customers WHERE id = 1")["rows"] == [[1]]
    login, _ = login_of(scope)
    try:
        assert revoke_deployment_role(dataset.dsn, TENANT, DEPLOYMENT, "crm") is True
        with psycopg.connect(dataset.dsn, autocommit=True) as conn:
            gone = conn.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", (login,)).fetchone()
            assert gone is None
    finally:
        grant_deployment_role(
            dataset.dsn, TENANT, DEPLOYMENT, "crm", MANIFEST["datasets"]["crm"]["tables"]
        )
    assert login == run_login_role(TENANT, scope.run_id, "crm")


# -- every shape of the attacker's round, and of the list --------------------

ATTACKS = {
    # The statements, as the attacker sent them.
    "subquery-offset-0": "SELECT x::text FROM (SELECT mrr AS x FROM customers OFFSET 0) s",
    "materialized-cte": "WITH s AS MATERIALIZED (SELECT id, mrr FROM customers) SELECT * FROM s",
    "union-all": "SELECT id::numeric FROM customers UNION ALL SELECT mrr FROM customers",
    "to-jsonb-of-subquery": "SELECT to_jsonb(s) FROM (SELECT id, mrr FROM customers OFFSET 0) s",
    "jsonb-each": "SELECT j.key, j.value FROM (SELECT id, mrr FROM customers OFFSET 0) s,"
    " jsonb_each(to_jsonb(s)) j",
    "array-agg-of-rows": "SELECT array_agg(s)::text FROM (SELECT id, mrr FROM customers OFFSET 0) s",
    "count-oracle": "SELECT count(*) FROM (SELECT mrr AS x FROM customers OFFSET 0) s"
    " WHERE s.x > 25000",
    "recursive-cte-sub-select": "WITH RECURSIVE r(n, x) AS (SELECT 1, ''::text UNION ALL"
    " SELECT n + 1, (SELECT string_agg(amount::text, ',') FROM invoices WHERE n > 0)"
    " FROM r WHERE n < 2) SELECT c.id, r.x FROM r, customers c",
    # The shapes the "How it is checked" lists.
    "union": "SELECT country FROM customers UNION SELECT mrr::text FROM customers",
    "intersect": "SELECT id FROM customers INTERSECT SELECT id FROM customers WHERE mrr > 25000",
    "except": "SELECT id FROM customers EXCEPT SELECT id FROM customers WHERE mrr > 25000",
    "lateral": "SELECT c.id, l.m FROM customers c,"
    " LATERAL (SELECT c2.mrr AS m FROM customers c2 WHERE c2.id = c.id OFFSET 0) l",
    "recursive-cte-reads-mrr": "WITH RECURSIVE r(n, m) AS (SELECT 1, (SELECT max(mrr) FROM"
    " customers) UNION ALL SELECT n + 1, m FROM r WHERE n < 2) SELECT n, m::text FROM r",
    "row-to-json-whole-row": "SELECT row_to_json(c) FROM customers c",
    "to-jsonb-whole-row": "SELECT to_jsonb(c) FROM customers c",
    "whole-row-as-text": "SELECT id FROM customers c WHERE c::text LIKE '%3%'",
    "array-agg-whole-row": "SELECT array_agg(c)::text FROM customers c",
    "window-order": "SELECT id, rank() OVER (ORDER BY mrr) FROM customers",
    "window-partition": "SELECT id, count(*) OVER (PARTITION BY mrr > 25000) FROM customers",
    "order-by": "SELECT id FROM customers ORDER BY mrr",
    "distinct-on": "SELECT DISTINCT ON (mrr) id FROM customers",
    "group-by": "SELECT count(*) FROM customers GROUP BY mrr",
    "where-oracle": "SELECT id FROM customers WHERE mrr > 25000",
    "having-oracle": "SELECT country FROM customers GROUP BY country HAVING max(mrr) > 25000",
    "case-oracle": "SELECT id, CASE WHEN mrr > 25000 THEN 'rich' ELSE 'poor' END FROM customers",
    "scalar-sub-select": "SELECT id, (SELECT max(mrr) FROM customers) FROM customers",
    "join-on-oracle": "SELECT a.id FROM customers a JOIN customers b ON a.id = b.id"
    " AND b.mrr > 25000",
    "select-star": "SELECT * FROM customers",
    "invoices-count": "SELECT count(*) FROM invoices",
    "invoices-exists-oracle": "SELECT id FROM customers c WHERE EXISTS (SELECT 1 FROM invoices i"
    " WHERE i.customer = c.id AND i.amount > 7000)",
    "invoices-in-cte": "WITH i AS MATERIALIZED (SELECT * FROM invoices) SELECT c.id FROM"
    " customers c, i WHERE i.customer = c.id",
    "email": "SELECT id FROM customers WHERE email LIKE 'ada%'",
}


@pytest.mark.parametrize("query", list(ATTACKS.values()), ids=list(ATTACKS))
def test_postgresql_itself_refuses_a_forbidden_column_in_every_shape(
    scope: RunScope, dataset: Dataset, ledger_env: LedgerEnv, query: str
) -> None:
    assert sql(scope, "SELECT id FROM customers WHERE id = 1")["rows"] == [[1]]
    with pytest.raises(CallDenied) as refused:
        sql(scope, query)
    assert "permission denied" in refused.value.message
    assert_no_forbidden_value(refused.value.message)
    ev = last_event(ledger_env)
    assert (ev["action"], ev["decision"]) == ("sql.select", "deny")
    assert ev["reason"].startswith("refused: the database refused it: permission denied")
    assert_no_forbidden_value(event_text(ev))
    # And with no broker in the way: logged in as the run's own login, the same
    # statement is refused by PostgreSQL, whatever the broker's parse made of it.
    login, password = login_of(scope)
    with (
        connect_as_role(dataset.dsn, login, password) as conn,
        pytest.raises(psycopg.errors.InsufficientPrivilege),
    ):
        conn.execute(query)


PERMITTED = {
    "plain": ("SELECT id, country, plan FROM customers WHERE id = 1", [[1, "GB", "pro"]]),
    "subquery-offset-0": (
        "SELECT x FROM (SELECT plan AS x FROM customers WHERE id = 2 OFFSET 0) s",
        [["team"]],
    ),
    "to-jsonb-of-allowed-subquery": (
        "SELECT to_jsonb(s)::text FROM (SELECT id, country FROM customers WHERE id = 4) s",
        [['{"id": 4, "country": "NL"}']],
    ),
    "count-star": ("SELECT count(*) FROM customers", [[5]]),
    "union-of-allowed": (
        "SELECT country FROM customers WHERE id = 1 UNION SELECT plan FROM customers WHERE id = 1"
        " ORDER BY 1",
        [["GB"], ["pro"]],
    ),
}


@pytest.mark.parametrize("query, rows", list(PERMITTED.values()), ids=list(PERMITTED))
def test_allowed_columns_are_still_answered_in_every_shape(
    scope: RunScope, ledger_env: LedgerEnv, query: str, rows: list[list[Any]]
) -> None:
    out = sql(scope, query)
    assert out["rows"] == rows
    ev = last_event(ledger_env)
    assert (ev["decision"], ev["details"]["outcome"]) == ("allow", "ok")
    assert_no_forbidden_value(json.dumps(out))
