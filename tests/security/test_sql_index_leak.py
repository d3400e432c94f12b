"""What a query plan reads without the authorizer being told, and the schema tables.

SQLite's authorizer reports the columns a statement names, not the ones the
plan reads through: with an index on the denied ``email`` column, ``SELECT id
FROM customers`` can be answered by scanning that index, and the ids then come
back in email order (the guest learns each email's rank). A ``WITHOUT ROWID``
table keyed by ``email`` is stored in email order. ``count(*)`` of
``sqlite_master`` is reported as "a table, no column", which the handler took
for a CTE's name and never decided.

Each case runs a real statement on a real SQLite file through the real handler,
Cedar and ledger: it must be refused and recorded (one deny naming the column
and how the plan reads it), or answered in an order that owes nothing to the
denied column. The emails are chosen so that email order differs from rowid
order everywhere.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from proctor.broker import BrokerError, CallDenied
from tests.conftest import LedgerEnv
from tests.integration.test_broker_sql import Env, events, make_scope, row_keys, sql

# (id, name, email, plan): email order is ids 2, 4, 3, 1; rowid order 1, 2, 3, 4;
# among plan 'pro' (1, 2, 3) email order is 2, 3, 1.
ROWS = [
    (1, "n1", "zoe@example.com", "pro"),
    (2, "n2", "amy@example.com", "pro"),
    (3, "n3", "kim@example.com", "pro"),
    (4, "n4", "bob@example.com", "free"),
]
EMAILS = [r[2] for r in ROWS]
ALLOWED = ["id", "name", "plan"]


def make_indexed(path: Path, schema: str) -> Path:
    conn = sqlite3.connect(path)
    conn.executescript(
        "CREATE TABLE customers (id INTEGER PRIMARY KEY, name TEXT, email TEXT, plan TEXT);"
        "CREATE TABLE accounts (email TEXT PRIMARY KEY, id INTEGER, plan TEXT) WITHOUT ROWID;"
        + schema
    )
    conn.executemany("INSERT INTO customers VALUES (?, ?, ?, ?)", ROWS)
    conn.executemany("INSERT INTO accounts VALUES (?, ?, ?)", [(r[2], r[0], r[3]) for r in ROWS])
    conn.commit()
    conn.close()
    return path


def caps(columns: list[str] = ALLOWED) -> dict[str, Any]:
    return {
        "datasets": {
            "crm": {
                "tables": {
                    "customers": {"columns": columns, "access": "read"},
                    "accounts": {"columns": ["id", "plan"], "access": "read"},
                }
            }
        }
    }


@pytest.fixture
def store_engine() -> str:
    """The ledger's engine is not under test here: SQLite only."""
    return "sqlite"


def _env(ledger_env: LedgerEnv, tmp_path: Path, schema: str, **kw: Any) -> Env:
    ds = make_indexed(tmp_path / f"crm-{abs(hash(schema))}.db", schema)
    return Env(ledger_env, ds, make_scope(ledger_env, ds, caps=kw.pop("caps", caps()), **kw))


@pytest.fixture
def unique_email(ledger_env: LedgerEnv, tmp_path: Path) -> Iterator[Env]:
    env = _env(ledger_env, tmp_path, "CREATE UNIQUE INDEX customers_email ON customers(email);")
    yield env
    _no_email_anywhere(env)


@pytest.fixture
def plan_email(ledger_env: LedgerEnv, tmp_path: Path) -> Iterator[Env]:
    env = _env(ledger_env, tmp_path, "CREATE INDEX customers_plan_email ON customers(plan, email);")
    yield env
    _no_email_anywhere(env)


def _no_email_anywhere(env: Env) -> None:
    log = b"".join(env.ledger.ledger.entries("acme"))
    for email in EMAILS:
        assert email.encode() not in log


def refused(env: Env, query: str) -> tuple[BrokerError, dict[str, Any]]:
    before = len(events(env.ledger))
    with pytest.raises(BrokerError) as info:
        sql(env.scope, query)
    after = events(env.ledger)
    assert len(after) == before + 1, "exactly one event per refused call"
    ev = after[-1]
    assert ev["decision"] == "deny"
    assert "row_count" not in ev["details"]
    text = info.value.message + json.dumps(ev)
    for email in EMAILS:
        assert email not in text
    return info.value, ev


def refused_through_the_plan(env: Env, query: str, column: str = "email") -> dict[str, Any]:
    """Refused because the plan reads ``column``, and the event says how."""
    error, ev = refused(env, query)
    assert isinstance(error, CallDenied)
    assert ev["reason"].startswith("denied: ")
    denied = [t for t in ev["details"]["tables"] if t["decision"] == "deny"]
    assert any(column in t["columns"] for t in denied), ev["details"]["tables"]
    plan = ev["details"]["plan"]
    assert any(column in p["columns"] for p in plan), plan
    assert "NOT INDEXED" in error.message or "WITHOUT ROWID" in error.message
    return ev


def rows(env: Env, query: str) -> list[list[Any]]:
    return list(sql(env.scope, query)["rows"])


# -- the rank leak through an index on the denied column ------------------------------------


@pytest.mark.parametrize(
    "query",
    [
        "SELECT id FROM customers",  # a covering scan of the email index: ids in email order
        "SELECT id FROM customers LIMIT 1",  # the id of the first email
        "SELECT group_concat(id) FROM customers",
        "SELECT id FROM (SELECT id FROM customers)",
    ],
)
def test_a_unique_index_on_the_denied_column_does_not_rank_the_rows(
    unique_email: Env, query: str
) -> None:
    refused_through_the_plan(unique_email, query)


@pytest.mark.parametrize(
    "query",
    [
        "SELECT c.id FROM customers AS c WHERE c.id > 0",
        "SELECT id FROM customers WHERE id IN (SELECT id FROM customers)",
        "SELECT id FROM customers ORDER BY id",
        "SELECT id FROM customers WHERE plan = 'pro' OR plan = 'free' ORDER BY id",
    ],
)
def test_plans_that_do_not_use_the_index_are_answered_in_rowid_order(
    unique_email: Env, query: str
) -> None:
    """Refused through the plan, or answered in an order that owes nothing to email
    (which of the two depends on the planner; today these are answered)."""
    before = len(events(unique_email.ledger))
    try:
        got = rows(unique_email, query)
    except CallDenied:
        ev = events(unique_email.ledger)[-1]
        assert "plan" in ev["details"]
        return
    assert got == [[1], [2], [3], [4]]
    assert len(events(unique_email.ledger)) == before + 1


@pytest.mark.parametrize(
    "query",
    [
        "SELECT id FROM customers WHERE plan = 'pro'",  # the index's order within 'pro'
        "SELECT id, plan FROM customers ORDER BY plan",  # ties broken by email
        "SELECT max(plan), id FROM customers",  # the bare column comes from the last email
        "SELECT id FROM customers WHERE plan > 'a' LIMIT 1",
        "SELECT count(*) FROM customers WHERE plan = 'pro'",  # read through it all the same
    ],
)
def test_an_index_ending_in_the_denied_column_does_not_order_ties(
    plan_email: Env, query: str
) -> None:
    refused_through_the_plan(plan_email, query)


@pytest.mark.parametrize(
    "query",
    [
        "SELECT id FROM accounts",
        "SELECT id FROM accounts ORDER BY plan",
        "SELECT id FROM accounts WHERE plan = 'pro'",
        "SELECT group_concat(id) FROM accounts",
    ],
)
def test_a_without_rowid_table_keyed_by_the_denied_column_is_refused(
    ledger_env: LedgerEnv, tmp_path: Path, query: str
) -> None:
    env = _env(ledger_env, tmp_path, "")
    ev = refused_through_the_plan(env, query)
    assert any(p["table"] == "accounts" for p in ev["details"]["plan"])
    _no_email_anywhere(env)


def test_an_index_on_an_expression_of_the_denied_column_counts_as_reading_it(
    ledger_env: LedgerEnv, tmp_path: Path
) -> None:
    env = _env(ledger_env, tmp_path, "CREATE INDEX plan_lower ON customers(plan, lower(email));")
    refused_through_the_plan(env, "SELECT id FROM customers WHERE plan = 'pro'", "email")
    _no_email_anywhere(env)


# -- what still works ------------------------------------------------------------------------


def test_not_indexed_reads_in_rowid_order(unique_email: Env, plan_email: Env) -> None:
    for env in (unique_email, plan_email):
        assert rows(env, "SELECT id FROM customers NOT INDEXED") == [[1], [2], [3], [4]]
        assert rows(env, "SELECT id FROM customers NOT INDEXED WHERE plan = 'pro'") == [
            [1],
            [2],
            [3],
        ]
        assert rows(env, "SELECT c.id FROM customers AS c NOT INDEXED LIMIT 1") == [[1]]
        ev = events(env.ledger)[-1]
        assert ev["decision"] == "allow" and "plan" not in ev["details"]
        # Lineage still finds the rows: the keyed variant keeps NOT INDEXED.
        assert ev["details"]["lineage"] == "rows"
        assert row_keys(env.ledger, ev["details"]) == env.scope.key_hmacs(["1"])


def test_permitted_plans_are_answered(unique_email: Env) -> None:
    env = unique_email
    assert rows(env, "SELECT id FROM customers ORDER BY id") == [[1], [2], [3], [4]]
    assert rows(env, "SELECT id, name FROM customers WHERE id = 3") == [[3, "n3"]]
    # count(*) may read the smallest index: it counts entries, it never orders them.
    assert rows(env, "SELECT count(*) FROM customers") == [[4]]
    ev = events(env.ledger)[-1]
    assert ev["decision"] == "allow" and ev["details"]["tables"][0]["columns"] == []
    assert rows(env, "SELECT count(*) FROM accounts") == [[4]]


def test_a_policy_that_permits_the_indexed_column_permits_the_plan(
    ledger_env: LedgerEnv, tmp_path: Path
) -> None:
    env = _env(
        ledger_env,
        tmp_path,
        "CREATE UNIQUE INDEX customers_email ON customers(email);",
        caps=caps([*ALLOWED, "email"]),
    )
    assert rows(env, "SELECT id FROM customers") == [[2], [4], [3], [1]]
    ev = events(env.ledger)[-1]
    assert ev["decision"] == "allow"
    (table,) = ev["details"]["tables"]
    assert table["columns"] == ["email", "id"]
    assert ev["details"]["plan"] == [
        {"table": "customers", "via": "index customers_email", "columns": ["email"]}
    ]


def test_an_index_on_permitted_columns_changes_nothing(
    ledger_env: LedgerEnv, tmp_path: Path
) -> None:
    env = _env(ledger_env, tmp_path, "CREATE INDEX customers_plan ON customers(plan, name);")
    assert rows(env, "SELECT id FROM customers WHERE plan = 'pro'") == [[1], [2], [3]]
    ev = events(env.ledger)[-1]
    assert ev["decision"] == "allow"
    assert ev["details"]["tables"][0]["columns"] == ["id", "name", "plan"]


# -- schema tables need a decision ----------------------------------------------------------


@pytest.mark.parametrize(
    "query",
    [
        "SELECT (SELECT count(*) FROM sqlite_master), id FROM customers",
        "SELECT count(*) FROM sqlite_master",
        "SELECT count(*) FROM sqlite_schema",
        "SELECT count(*) FROM SQLITE_SCHEMA",
        "SELECT count(*) FROM main.sqlite_master",
        "SELECT id FROM customers WHERE EXISTS (SELECT 1 FROM sqlite_master)",
        "SELECT id FROM customers WHERE (SELECT count(*) FROM sqlite_schema) > 3",
        "WITH x AS (SELECT 1 FROM sqlite_master) SELECT count(*) FROM x",
        "SELECT name FROM sqlite_master",
    ],
)
def test_the_schema_table_is_decided_like_any_table(
    ledger_env: LedgerEnv, tmp_path: Path, query: str
) -> None:
    env = _env(ledger_env, tmp_path, "")
    error, ev = refused(env, query)
    assert isinstance(error, CallDenied)
    denied = [t["table"] for t in ev["details"]["tables"] if t["decision"] == "deny"]
    assert denied == ["sqlite_master"], ev["details"]["tables"]


@pytest.mark.parametrize(
    "query",
    [
        "SELECT count(*) FROM sqlite_temp_master",
        "SELECT count(*) FROM sqlite_temp_schema",
        "SELECT count(*) FROM temp.sqlite_master",
        "SELECT id FROM customers WHERE EXISTS (SELECT 1 FROM sqlite_temp_master)",
    ],
)
def test_the_temp_schema_is_outside_the_dataset(
    ledger_env: LedgerEnv, tmp_path: Path, query: str
) -> None:
    env = _env(ledger_env, tmp_path, "")
    error, ev = refused(env, query)
    assert isinstance(error, CallDenied)
    assert ev["reason"].startswith("refused: ")


@pytest.mark.parametrize(
    "query",
    [
        "SELECT * FROM pragma_table_info('customers')",
        "SELECT name FROM pragma_index_list('customers')",
        "SELECT name FROM pragma_index_info('customers_email')",
        "SELECT count(*) FROM pragma_index_xinfo('customers_email')",
        "SELECT id FROM customers WHERE (SELECT count(*) FROM pragma_table_info('customers')) > 4",
        "SELECT * FROM pragma_database_list",
    ],
)
def test_pragma_functions_are_refused_every_time(unique_email: Env, query: str) -> None:
    # Twice, and after a permitted statement on the same pooled connection (the
    # broker itself runs PRAGMA table_info for lineage on it).
    refused(unique_email, query)
    rows(unique_email, "SELECT id FROM customers WHERE id = 1")
    refused(unique_email, query)


def test_a_policy_can_permit_the_schema_table(ledger_env: LedgerEnv, tmp_path: Path) -> None:
    permit = """
    @id("test:schema")
    permit (principal, action == Proctor::Action::"sql.select",
            resource == Proctor::Table::"acme/crm/sqlite_master");
    """
    env = _env(ledger_env, tmp_path, "", extra_policies=permit)
    assert rows(env, "SELECT count(*) FROM sqlite_schema") == [[2]]
    assert rows(env, "SELECT (SELECT count(*) FROM sqlite_master), id FROM customers") == [
        [2, 1],
        [2, 2],
        [2, 3],
        [2, 4],
    ]
    ev = events(env.ledger)[-1]
    assert ev["decision"] == "allow"
    assert {t["table"] for t in ev["details"]["tables"]} == {"customers", "sqlite_master"}


# -- PostgreSQL: the role's column grants do not cover the planner's choice of index ------


@pytest.mark.postgres
def test_postgres_does_not_rank_rows_by_an_index_on_an_ungranted_column(
    pg_server: Any, ledger_env: LedgerEnv, tmp_path: Path
) -> None:
    """A role granted SELECT (id, name, plan) only: PostgreSQL checks column
    privileges on the columns a query names, not on the index it reads through.
    With an index on (plan, email), a selective WHERE plan = ... LIMIT is an index
    scan of it, and the ids came back in email order. Guest statements now run
    with index scans off (bitmap scans keep the table's physical order)."""
    QUERY = "SELECT id FROM customers WHERE plan = 'pro' LIMIT 100"
    from dataclasses import replace

    import psycopg

    from proctor.broker import DatasetBinding
    from proctor.broker._pg_sql import (
        close_pg_pools,
        grant_deployment_role,
        revoke_deployment_role,
    )

    name = f"idx_{abs(hash(str(tmp_path))) % 10**9}"
    dsn = pg_server.create_database(name)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            "CREATE TABLE customers (id BIGINT, name TEXT, email TEXT, plan TEXT, pad TEXT)"
        )
        conn.execute(
            "INSERT INTO customers SELECT i, 'n' || i, md5(i::text) || '@example.com',"
            " CASE WHEN i % 100 = 0 THEN 'pro' ELSE 'free' END, repeat('x', 200)"
            " FROM generate_series(1, 20000) AS i"
        )
        conn.execute("CREATE INDEX customers_plan_email ON customers (plan, email)")
        conn.execute("VACUUM ANALYZE customers")
        by_email = [
            r[0]
            for r in conn.execute(
                "SELECT id FROM customers WHERE plan = 'pro' ORDER BY email LIMIT 100"
            )
        ]
    tables = {"customers": {"columns": ["id", "name", "plan"], "access": "read"}}
    grant_deployment_role(dsn, "acme", "churn", "crm", tables)
    scope = make_scope(
        ledger_env, tmp_path / "unused.db", caps={"datasets": {"crm": {"tables": tables}}}
    )
    scope = replace(scope, datasets={"crm": DatasetBinding("crm", "postgresql", dsn)})
    try:
        # Answered, from a bitmap scan: the rows come in the table's physical order.
        got = [r[0] for r in sql(scope, QUERY)["rows"]]
        assert len(got) == 100
        assert got != by_email, "the ids came back in email order"
        # Physical order, the order the rows were written in: nothing of email's.
        assert got == list(range(100, 10_001, 100))
    finally:
        close_pg_pools(scope)
        revoke_deployment_role(dsn, "acme", "churn", "crm")
        pg_server.drop_database(name)
