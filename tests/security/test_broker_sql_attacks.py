"""Statements that try to read a column the policy does not permit, or to get
out of the dataset: each refused, recorded as a deny, and nothing leaked.

The deployment may read customers.{id, name, country, plan, mrr} and
events.{customer, kind}; never customers.email (the values in SECRET_VALUES).
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from proctor.broker import BrokerError, CallDenied, handle_sql
from tests.conftest import LedgerEnv
from tests.integration.test_broker_sql import (
    SECRET_VALUES,
    Env,
    default_caps,
    events,
    last_event,
    make_dataset,
    make_scope,
    row_keys,
    sql,
)


@pytest.fixture
def env(ledger_env: LedgerEnv, tmp_path: Path) -> Iterator[Env]:
    ds = make_dataset(tmp_path / "crm.db")
    yield Env(ledger_env, ds, make_scope(ledger_env, ds))
    # Whatever a test did: no email anywhere in the tenant's log.
    log = b"".join(ledger_env.ledger.entries("acme")) if not ledger_env.ledger._closed else b""
    for value in SECRET_VALUES:
        assert value.encode() not in log


def refused(env: Env, query: str, params: object = None) -> tuple[BrokerError, dict[str, Any]]:
    """Run ``query``; it must be refused and recorded as one deny with no row value."""
    before = len(events(env.ledger))
    with pytest.raises(BrokerError) as info:
        sql(env.scope, query, params)
    after = events(env.ledger)
    assert len(after) == before + 1, "exactly one event per refused call"
    ev = after[-1]
    assert ev["decision"] == "deny"
    assert ev["action"] in ("sql.select", "sql.write")
    assert ev["reason"].startswith(("denied: ", "refused: "))
    text = info.value.message + json.dumps(info.value.as_json()) + json.dumps(ev)
    for value in SECRET_VALUES:
        assert value not in text
    # Nothing answered, so no rows counted.
    assert "row_count" not in ev["details"]
    return info.value, ev


# -- a column that is not permitted, every way round -----------------------------


@pytest.mark.parametrize(
    "query",
    [
        "SELECT * FROM customers",
        "SELECT email FROM customers",
        "SELECT EMAIL FROM Customers",
        'SELECT "email" FROM "customers"',
        "SELECT main.customers.email FROM main.customers",
        "SELECT c.email FROM customers AS c",
        "SELECT rowid, * FROM customers",
        "SELECT customers.* FROM customers",
        # read but not returned: still a read
        "SELECT id FROM customers WHERE email = 'ada@example.com'",
        "SELECT id FROM customers WHERE email LIKE 'a%'",
        "SELECT id FROM customers ORDER BY email",
        "SELECT count(*) FROM customers GROUP BY email",
        "SELECT id FROM customers WHERE length(email) > 3",
        # through a subquery, a CTE, a compound, a window
        "SELECT (SELECT email FROM customers LIMIT 1)",
        "SELECT id FROM customers WHERE id IN (SELECT id FROM customers WHERE email > 'b')",
        "SELECT name FROM (SELECT name, email FROM customers)",
        "WITH x AS (SELECT email AS e FROM customers) SELECT e FROM x",
        "WITH x(e) AS (SELECT email FROM customers) SELECT count(*) FROM x WHERE e LIKE 'a%'",
        "SELECT name FROM customers UNION SELECT email FROM customers",
        "SELECT lag(email) OVER (ORDER BY id) FROM customers",
        "SELECT group_concat(email) FROM customers",
        "SELECT name FROM customers WHERE EXISTS (SELECT 1 FROM customers c2 WHERE c2.email = 'x')",
        # through functions: the column read is still reported
        "SELECT json_extract(email, '$') FROM customers",
        "SELECT json_object('e', email) FROM customers",
        "SELECT hex(email) FROM customers",
        "SELECT substr(email, 1, 1) FROM customers",
        "SELECT CAST(email AS BLOB) FROM customers",
        "SELECT coalesce(NULL, email) FROM customers",
        # through the view the dataset defines: the engine reports customers.email
        "SELECT email FROM contacts",
        "SELECT * FROM contacts",
        "SELECT count(*) FROM contacts WHERE email LIKE '%@example.com'",
        # a table nobody permitted at all
        "SELECT json_extract(doc, '$.email') FROM profiles",
        "SELECT count(*) FROM profiles",
        "SELECT sql FROM sqlite_master",
        "SELECT name FROM sqlite_schema",
    ],
)
def test_unpermitted_column_is_denied(env: Env, query: str) -> None:
    error, ev = refused(env, query)
    assert isinstance(error, CallDenied)
    assert ev["reason"].startswith("denied: ")
    assert ev["policies"] == []  # the default deny: no policy permitted it
    denied = [t for t in ev["details"]["tables"] if t["decision"] == "deny"]
    assert denied, "the event names what was denied"


def test_deny_names_the_column_and_table(env: Env) -> None:
    error, ev = refused(env, "SELECT name, email FROM customers WHERE id = 1")
    assert ev["details"]["tables"] == [
        {
            "table": "customers",
            "action": "sql.select",
            "columns": ["email", "id", "name"],
            "decision": "deny",
            "policies": [],
        }
    ]
    assert "customers" in error.message and "email" in error.message


def test_view_reports_the_underlying_table(env: Env) -> None:
    _, ev = refused(env, "SELECT id, name FROM contacts")
    tables = {t["table"]: t for t in ev["details"]["tables"]}
    # The view itself is a table nobody permitted; its base-table reads are
    # reported too (all the view reads, not just the columns selected from
    # it), so permitting the view alone never launders a column.
    assert tables["contacts"]["decision"] == "deny"
    assert tables["customers"]["columns"] == ["email", "id", "name"]
    assert tables["customers"]["decision"] == "deny"


def test_view_cannot_launder_even_when_permitted(ledger_env: LedgerEnv, tmp_path: Path) -> None:
    ds = make_dataset(tmp_path / "crm.db")
    caps = default_caps()
    caps["datasets"]["crm"]["tables"]["contacts"] = {"columns": ["id", "name", "email"]}
    scope = make_scope(ledger_env, ds, caps=caps)
    env = Env(ledger_env, ds, scope)
    _, ev = refused(env, "SELECT email FROM contacts")
    by = {t["table"]: t["decision"] for t in ev["details"]["tables"]}
    assert by == {"contacts": "allow", "customers": "deny"}
    # A view reads all its columns, so even its permitted ones are refused
    # while it reads email: stricter than needed, never looser.
    refused(env, "SELECT name FROM contacts WHERE id = 1")
    with sqlite3.connect(ds) as conn:
        conn.execute("CREATE VIEW plans AS SELECT id, plan FROM customers")
    caps["datasets"]["crm"]["tables"]["plans"] = {"columns": ["id", "plan"]}
    scope = make_scope(ledger_env, ds, caps=caps)
    assert sql(scope, "SELECT plan FROM plans WHERE id = 1")["rows"] == [["pro"]]


def test_a_forbid_wins_and_is_named(ledger_env: LedgerEnv, tmp_path: Path) -> None:
    ds = make_dataset(tmp_path / "crm.db")
    forbid = (
        '@id("tenant:no-mrr")\n'
        "forbid (principal, action, resource)\n"
        'when { context has columns && context.columns.contains("mrr") };\n'
    )
    scope = make_scope(ledger_env, ds, extra_policies=forbid)
    env = Env(ledger_env, ds, scope)
    error, ev = refused(env, "SELECT sum(mrr) FROM customers")
    assert ev["policies"] == ["tenant:no-mrr"]
    assert ev["reason"] == "denied: sql.select on customers (mrr): forbidden by tenant:no-mrr"
    assert error.policies == ("tenant:no-mrr",)


# -- out of the dataset, and out of SQL --------------------------------------------


@pytest.mark.parametrize(
    ("query", "why"),
    [
        ("ATTACH DATABASE '{tmp}/other.db' AS other", "ATTACH"),
        ("ATTACH '{tmp}/other.db' AS other", "ATTACH"),
        ("DETACH other", "DETACH"),
        ("SELECT load_extension('{tmp}/evil.so')", "load_extension"),
        ("SELECT name, load_extension('{tmp}/evil.so') FROM customers", "load_extension"),
        # Not built into this SQLite ("no such function"); refused by the
        # allow-list wherever they are.
        ("SELECT readfile('/etc/passwd')", ""),
        ("SELECT writefile('{tmp}/x', 'y')", ""),
        ("SELECT sqlite_offset(name) FROM customers", ""),
        ("SELECT fts3_tokenizer('simple')", "fts3_tokenizer"),
        ("PRAGMA table_info(customers)", "PRAGMA"),
        ("PRAGMA writable_schema = ON", "PRAGMA"),
        ("PRAGMA query_only = OFF", "PRAGMA"),
        ("PRAGMA main.journal_mode = DELETE", "PRAGMA"),
        ("SELECT * FROM pragma_table_info('customers')", "table-valued"),
        ("SELECT value FROM json_each('[1, 2]')", "table-valued"),
        ("BEGIN", "transaction"),
        ("COMMIT", "transaction"),
        ("SAVEPOINT s1", "transaction"),
        ("CREATE TABLE stolen (e TEXT)", "schema"),
        ("CREATE TEMP TABLE stolen AS SELECT name FROM customers", "schema"),
        ("CREATE VIEW v2 AS SELECT email FROM customers", "schema"),
        ("DROP TABLE customers", "schema"),
        ("ALTER TABLE customers RENAME TO c2", "schema"),
        ("VACUUM INTO '{tmp}/copy.db'", ""),
        ("CREATE TEMP TRIGGER t AFTER INSERT ON events BEGIN SELECT 1; END", "schema"),
    ],
)
def test_escapes_are_refused(env: Env, tmp_path: Path, query: str, why: str) -> None:
    _, ev = refused(env, query.format(tmp=tmp_path))
    assert ev["policies"] == []
    assert why in ev["reason"] or not why
    assert not (tmp_path / "other.db").exists()
    assert not (tmp_path / "copy.db").exists()
    assert not (tmp_path / "x").exists()
    with sqlite3.connect(env.dataset) as conn:
        assert conn.execute("SELECT count(*) FROM customers").fetchone() == (5,)


@pytest.mark.parametrize(
    "query",
    [
        "SELECT id FROM customers; DROP TABLE customers",
        "SELECT id FROM customers; SELECT email FROM customers",
        "SELECT 1; ATTACH 'x.db' AS x",
        "SELECT id FROM customers;\n-- fine\n; UPDATE customers SET plan = 'x'",
    ],
)
def test_multiple_statements_are_refused(env: Env, query: str) -> None:
    _, ev = refused(env, query)
    assert "one statement" in ev["reason"]
    with sqlite3.connect(env.dataset) as conn:
        assert conn.execute("SELECT count(*) FROM customers WHERE plan = 'x'").fetchone() == (0,)


@pytest.mark.parametrize(
    "query",
    [
        "UPDATE customers SET plan = 'free'",
        "UPDATE customers SET plan = 'free' WHERE id = 1",
        "DELETE FROM customers",
        "DELETE FROM events WHERE customer = 1",
        "INSERT INTO events (customer, kind) VALUES (1, 'x')",
        "INSERT INTO events SELECT id, name FROM customers",
        "REPLACE INTO events (customer, kind) VALUES (1, 'x')",
        "INSERT INTO events (customer, kind) VALUES (1, 'x') RETURNING kind",
    ],
)
def test_writes_when_only_reads_are_permitted(env: Env, query: str) -> None:
    error, ev = refused(env, query)
    assert isinstance(error, CallDenied)
    assert ev["action"] == "sql.write"
    assert any(
        t["action"] == "sql.write" and t["decision"] == "deny" for t in ev["details"]["tables"]
    )
    with sqlite3.connect(env.dataset) as conn:
        assert conn.execute("SELECT count(*) FROM customers WHERE plan = 'free'").fetchone() == (1,)
        assert conn.execute("SELECT count(*) FROM events").fetchone() == (3,)


def test_trigger_reads_are_decided_too(ledger_env: LedgerEnv, tmp_path: Path) -> None:
    """A trigger in the dataset that copies emails into a writable table: the
    engine reports the trigger's read of customers.email, so the insert is denied."""
    ds = make_dataset(tmp_path / "crm.db")
    with sqlite3.connect(ds) as conn:
        conn.execute(
            "CREATE TRIGGER copy_email AFTER INSERT ON events BEGIN "
            "UPDATE events SET kind = (SELECT email FROM customers WHERE id = new.customer) "
            "WHERE customer = new.customer AND kind = new.kind; END"
        )
    scope = make_scope(ledger_env, ds, caps=default_caps("read-write"))
    env = Env(ledger_env, ds, scope)
    _, ev = refused(env, "INSERT INTO events (customer, kind) VALUES (1, 'signup')")
    denied = [t for t in ev["details"]["tables"] if t["decision"] == "deny"]
    assert denied == [
        {
            "table": "customers",
            "action": "sql.select",
            "columns": ["email", "id"],
            "decision": "deny",
            "policies": [],
        }
    ]
    with sqlite3.connect(ds) as conn:
        assert conn.execute("SELECT count(*) FROM events").fetchone() == (3,)


def test_schema_change_between_check_and_run_cannot_widen(
    ledger_env: LedgerEnv, tmp_path: Path
) -> None:
    """The run step allows exactly what Cedar permitted: if the view changes
    under the broker after the check, the engine's report at run time differs
    and the enforcing authorizer refuses it."""
    from proctor.broker import _sql

    ds = make_dataset(tmp_path / "crm.db")
    with sqlite3.connect(ds) as conn:
        conn.execute("CREATE VIEW names AS SELECT id, name FROM customers")
    caps = default_caps()
    caps["datasets"]["crm"]["tables"]["names"] = {"columns": ["id", "name"]}
    scope = make_scope(ledger_env, ds, caps=caps)
    original = _sql._Statement.analyse

    def analyse_then_swap(self: _sql._Statement) -> _sql._Accesses:
        accesses = original(self)
        with sqlite3.connect(ds) as conn:
            conn.execute("DROP VIEW names")
            conn.execute("CREATE VIEW names AS SELECT id, email AS name FROM customers")
        return accesses

    _sql._Statement.analyse = analyse_then_swap  # type: ignore[method-assign]
    try:
        with pytest.raises(BrokerError) as info:
            sql(scope, "SELECT name FROM names")
    finally:
        _sql._Statement.analyse = original  # type: ignore[method-assign]
    for value in SECRET_VALUES:
        assert value not in info.value.message
    assert last_event(ledger_env)["details"]["outcome"] == "error"


def test_huge_values_are_capped(env: Env) -> None:
    with pytest.raises(BrokerError):
        sql(env.scope, "SELECT randomblob(1000000000) FROM customers LIMIT 1")
    ev = last_event(env.ledger)
    assert ev["details"]["outcome"] == "error"


def test_lexer_tricks_do_not_confuse_lineage(env: Env) -> None:
    """The keyed variant finds the top-level FROM; FROM in comments, strings and
    quoted names must not move it, and the answer must be the same as direct."""
    query = (
        "SELECT name /* FROM events */, 'FROM' AS \"FROM\", [from].id "
        "FROM customers AS [from] -- FROM events\nWHERE id = 42"
    )
    out = sql(env.scope, query)
    assert out["columns"] == ["name", "FROM", "id"]
    assert out["rows"] == [["Barbara Liskov", "FROM", 42]]
    d = last_event(env.ledger)["details"]
    assert d["lineage"] == "rows"
    assert row_keys(env.ledger, d) == env.scope.key_hmacs(["42"])


def test_params_are_not_recorded(env: Env) -> None:
    sql(env.scope, "SELECT id FROM customers WHERE name = ?", ["Ada Lovelace"])
    assert "Ada" not in json.dumps(last_event(env.ledger))


def test_non_mapping_request_is_refused(env: Env) -> None:
    with pytest.raises(BrokerError):
        asyncio.run(handle_sql(env.scope, ["SELECT email FROM customers"]))  # type: ignore[arg-type]
    assert last_event(env.ledger)["decision"] == "deny"


def test_reused_connections_decide_every_call(env: Env) -> None:
    """Read connections are pooled; each call is still compiled afresh under the
    authorizer and decided, whatever ran on that connection before."""
    for _ in range(3):
        assert sql(env.scope, "SELECT name FROM customers WHERE id = 1")["rows"] == [
            ["Ada Lovelace"]
        ]
        assert last_event(env.ledger)["details"]["tables"][0]["decision"] == "allow"
        refused(env, "SELECT email FROM customers WHERE id = 1")
