"""SQL through the broker on real SQLite datasets, real Cedar, a real ledger.

Also home of the small helpers the other broker SQL/files tests import: a
customers dataset, a RunScope built from real capability permits, and the
tenant's events read back from the ledger.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from proctor.broker import (
    BadCall,
    CallDenied,
    CallRefused,
    DatasetBinding,
    RunScope,
    StatementTimeout,
    handle_sql,
)
from proctor.ledger import Actor, EventDraft, check_lineage_object, lineage_keys, read_objects
from proctor.policy import capability_policies, compile_policies
from tests.conftest import LedgerEnv

TENANT = "acme"
DEPLOYMENT = "churn"
ALLOWED = ["id", "name", "country", "plan", "mrr"]  # not email
CUSTOMERS = [
    (1, "Ada Lovelace", "ada@example.com", "GB", "pro", 120),
    (2, "Grace Hopper", "grace@example.com", "US", "team", 300),
    (3, "Alan Turing", "alan@example.com", "GB", "free", 0),
    (4, "Edsger Dijkstra", "edsger@example.com", "NL", "pro", 120),
    (42, "Barbara Liskov", "barbara@example.com", "US", "enterprise", 900),
]
SECRET_VALUES = [row[2] for row in CUSTOMERS]  # emails: must never leak


def make_dataset(path: Path, *, extra_rows: int = 0) -> Path:
    """The customers table (id, name, email, country, plan, mrr), a view over it,
    a table without a declared primary key, and a JSON column for json_extract."""
    conn = sqlite3.connect(path)
    conn.executescript(
        """
        CREATE TABLE customers (
            id INTEGER PRIMARY KEY, name TEXT, email TEXT, country TEXT,
            plan TEXT, mrr INTEGER
        );
        CREATE VIEW contacts AS SELECT id, name, email FROM customers;
        CREATE TABLE events (customer INTEGER, kind TEXT);
        CREATE TABLE profiles (customer INTEGER PRIMARY KEY, doc TEXT);
        """
    )
    conn.executemany("INSERT INTO customers VALUES (?, ?, ?, ?, ?, ?)", CUSTOMERS)
    conn.executemany(
        "INSERT INTO customers (id, name, email, country, plan, mrr) VALUES (?, ?, ?, ?, ?, ?)",
        [(1000 + i, f"c{i}", f"c{i}@example.com", "FR", "free", i % 7) for i in range(extra_rows)],
    )
    conn.executemany(
        "INSERT INTO events VALUES (?, ?)", [(1, "login"), (2, "login"), (42, "churn")]
    )
    conn.executemany(
        "INSERT INTO profiles VALUES (?, ?)",
        [(r[0], json.dumps({"email": r[2], "plan": r[4]})) for r in CUSTOMERS],
    )
    conn.commit()
    conn.close()
    return path


def default_caps(access: str = "read") -> dict[str, Any]:
    return {
        "datasets": {
            "crm": {
                "tables": {
                    "customers": {"columns": ALLOWED, "access": access},
                    "events": {"columns": ["customer", "kind"], "access": access},
                }
            }
        },
        "buckets": {"reports": "read-write", "inbox": "read"},
    }


def ensure_log(env: LedgerEnv) -> None:
    if TENANT not in env.ledger.logs():
        env.ledger.create_log(
            TENANT, EventDraft(Actor("operator", "test"), "tenant.create", f"tenant/{TENANT}")
        )


def make_scope(
    env: LedgerEnv,
    dataset: Path,
    *,
    caps: Mapping[str, Any] | None = None,
    extra_policies: str = "",
    run_id: str = "r1",
    row_limit: int = 10_000,
    statement_timeout: float = 5.0,
    buckets_dir: Path | None = None,
) -> RunScope:
    ensure_log(env)
    text = capability_policies(TENANT, DEPLOYMENT, caps if caps is not None else default_caps())
    return RunScope(
        tenant=TENANT,
        run_id=run_id,
        workload=f"spiffe://test.local/tenant/{TENANT}/deployment/{DEPLOYMENT}/run/{run_id}",
        deployment=DEPLOYMENT,
        artifact="sha256:" + "ab" * 32,
        approvals=("approval-1",),
        environment="production",
        policies=compile_policies(text + "\n" + extra_policies),
        ledger=env.ledger,
        datasets={"crm": DatasetBinding("crm", "sqlite", str(dataset))},
        buckets_dir=buckets_dir,
        lineage_key=b"k" * 32,
        row_limit=row_limit,
        statement_timeout=statement_timeout,
    )


def events(env: LedgerEnv, action_prefix: str = "") -> list[dict[str, Any]]:
    out = []
    for data in env.ledger.entries(TENANT):
        ev = json.loads(data)
        if ev["action"].startswith(action_prefix) and ev["action"] != "tenant.create":
            out.append(ev)
    return out


def row_keys(env: LedgerEnv, details: Mapping[str, Any]) -> list[str]:
    """The row keys an event's lineage object holds (checked against its reference);
    [] for an event without one (``lineage: "table"``)."""
    ref = details.get("lineage_object")
    if ref is None:
        return []
    data = read_objects(env.store, TENANT, [ref["digest"]]).get(ref["digest"])
    assert check_lineage_object(ref, data) is None
    assert data is not None
    return lineage_keys(data)


def last_event(env: LedgerEnv) -> dict[str, Any]:
    evs = events(env)
    assert evs, "no event recorded"
    return evs[-1]


def sql(scope: RunScope, query: str, params: Any = None, dataset: str = "crm") -> dict[str, Any]:
    request: dict[str, Any] = {"dataset": dataset, "sql": query}
    if params is not None:
        request["params"] = params
    return asyncio.run(handle_sql(scope, request))


@dataclass
class Env:
    ledger: LedgerEnv
    dataset: Path
    scope: RunScope


@pytest.fixture
def env(ledger_env: LedgerEnv, tmp_path: Path) -> Iterator[Env]:
    ds = make_dataset(tmp_path / "crm.db")
    yield Env(ledger_env, ds, make_scope(ledger_env, ds))


# -- allowed calls ----------------------------------------------------------------


def test_permitted_columns_are_answered_and_recorded(env: Env) -> None:
    out = sql(
        env.scope, "SELECT id, name, plan FROM customers WHERE country = ? ORDER BY id", ["GB"]
    )
    assert out == {
        "columns": ["id", "name", "plan"],
        "rows": [[1, "Ada Lovelace", "pro"], [3, "Alan Turing", "free"]],
        "row_count": 2,
        "truncated": False,
    }
    ev = last_event(env.ledger)
    assert ev["action"] == "sql.select"
    assert ev["decision"] == "allow"
    assert ev["policies"] == ["deploy:churn:sql:crm.customers"]
    assert ev["resource"] == "dataset/crm/table/customers"
    assert ev["run"] == "r1" and ev["deployment"] == DEPLOYMENT
    d = ev["details"]
    assert d["dataset"] == "crm"
    assert d["tables"] == [
        {
            "table": "customers",
            "action": "sql.select",
            "columns": ["country", "id", "name", "plan"],
            "decision": "allow",
            "policies": ["deploy:churn:sql:crm.customers"],
        }
    ]
    assert d["row_count"] == 2 and d["truncated"] is False
    assert d["lineage"] == "rows"
    assert row_keys(env.ledger, d) == env.scope.key_hmacs(["1", "3"])
    assert d["policy_version"] == env.scope.policies.version
    # The statement is a keyed hash, never text: "GB" is a row value.
    assert "GB" not in json.dumps(ev) and "Ada" not in json.dumps(ev)


def test_named_parameters_and_count(env: Env) -> None:
    out = sql(env.scope, "SELECT count(*) AS n FROM customers WHERE plan = :p", {"p": "pro"})
    assert out["rows"] == [[2]]
    d = last_event(env.ledger)["details"]
    assert d["tables"][0]["columns"] == ["plan"]
    # An aggregate row is not one customer: lineage falls back to the table.
    assert d["lineage"] == "table" and "lineage_object" not in d


def test_join_of_two_permitted_tables(env: Env) -> None:
    out = sql(
        env.scope,
        "SELECT c.name, e.kind FROM customers c JOIN events e ON e.customer = c.id ORDER BY c.id",
    )
    assert out["rows"] == [["Ada Lovelace", "login"], ["Grace Hopper", "login"],
                           ["Barbara Liskov", "churn"]]  # fmt: skip
    ev = last_event(env.ledger)
    assert ev["resource"] == "dataset/crm"
    assert sorted(ev["policies"]) == [
        "deploy:churn:sql:crm.customers",
        "deploy:churn:sql:crm.events",
    ]
    assert [t["table"] for t in ev["details"]["tables"]] == ["customers", "events"]


def test_row_limit_truncates(ledger_env: LedgerEnv, tmp_path: Path) -> None:
    ds = make_dataset(tmp_path / "crm.db", extra_rows=50)
    scope = make_scope(ledger_env, ds, row_limit=10)
    out = sql(scope, "SELECT id FROM customers ORDER BY id")
    assert out["row_count"] == 10 and len(out["rows"]) == 10 and out["truncated"] is True
    d = last_event(ledger_env)["details"]
    assert d["row_count"] == 10 and d["truncated"] is True
    assert len(row_keys(ledger_env, d)) == 10  # only the rows answered


def test_statement_timeout_stops_a_runaway_cte(ledger_env: LedgerEnv, tmp_path: Path) -> None:
    import time

    ds = make_dataset(tmp_path / "crm.db")
    scope = make_scope(ledger_env, ds, statement_timeout=0.3)
    started = time.monotonic()
    with pytest.raises(StatementTimeout):
        sql(
            scope,
            "WITH RECURSIVE r(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM r) "
            "SELECT count(*) FROM r, customers",
        )
    assert time.monotonic() - started < 3
    ev = last_event(ledger_env)
    assert ev["details"]["outcome"] == "timeout"


def test_lineage_is_stable_across_runs(ledger_env: LedgerEnv, tmp_path: Path) -> None:
    ds = make_dataset(tmp_path / "crm.db")
    first = make_scope(ledger_env, ds, run_id="r1")
    second = make_scope(ledger_env, ds, run_id="r2")
    sql(first, "SELECT name FROM customers WHERE id = 42")
    sql(second, "SELECT plan, mrr FROM customers c WHERE c.plan = 'enterprise'")
    a, b = events(ledger_env, "sql.")[-2:]
    assert a["run"] == "r1" and b["run"] == "r2"
    # The same keys in both (each read salts its own object, issue 20).
    assert row_keys(ledger_env, a["details"]) == row_keys(ledger_env, b["details"])
    # "Which runs read customer 42?": hash 42 with the tenant's key and look.
    (h,) = first.key_hmacs(["42"])
    assert row_keys(ledger_env, a["details"]) == [h]
    # The key in clear is no value of the reference (its digests are random hex, which
    # may hold the digits 42 anywhere: a substring test failed one run in three).
    ref = a["details"]["lineage_object"]
    assert "42" not in [str(v) for v in ref.values()] and '"42"' not in json.dumps(ref)


def test_lineage_falls_back_to_rowid_without_a_primary_key(env: Env) -> None:
    sql(env.scope, "SELECT kind FROM events WHERE customer = 42")
    d = last_event(env.ledger)["details"]
    assert d["lineage"] == "rows"
    assert row_keys(env.ledger, d) == env.scope.key_hmacs(["3"])  # the third row's rowid


def test_select_star_with_all_columns_permitted(ledger_env: LedgerEnv, tmp_path: Path) -> None:
    ds = make_dataset(tmp_path / "crm.db")
    caps = default_caps()
    caps["datasets"]["crm"]["tables"]["customers"]["columns"] = [*ALLOWED, "email"]
    scope = make_scope(ledger_env, ds, caps=caps)
    out = sql(scope, "SELECT * FROM customers WHERE id = 2")
    assert out["columns"] == ["id", "name", "email", "country", "plan", "mrr"]  # no key column
    assert out["rows"] == [list(CUSTOMERS[1])]


def test_blobs_are_base64(env: Env) -> None:
    out = sql(env.scope, "SELECT zeroblob(3) AS b, name FROM customers WHERE id = 1")
    assert out["rows"] == [[{"base64": "AAAA"}, "Ada Lovelace"]]


# -- writes -------------------------------------------------------------------------


def test_write_when_permitted_commits_and_is_recorded(
    ledger_env: LedgerEnv, tmp_path: Path
) -> None:
    ds = make_dataset(tmp_path / "crm.db")
    scope = make_scope(ledger_env, ds, caps=default_caps("read-write"))
    out = sql(scope, "UPDATE customers SET plan = ? WHERE id = ?", ["pro", 3])
    assert out == {"rows_affected": 1}
    ev = last_event(ledger_env)
    assert ev["action"] == "sql.write" and ev["decision"] == "allow"
    actions = {(t["action"], tuple(t["columns"])) for t in ev["details"]["tables"]}
    assert actions == {("sql.select", ("id",)), ("sql.write", ("plan",))}
    assert ev["details"]["rows_affected"] == 1
    with sqlite3.connect(ds) as conn:
        assert conn.execute("SELECT plan FROM customers WHERE id = 3").fetchone() == ("pro",)


def test_write_refused_when_the_ledger_cannot_record_is_rolled_back(
    ledger_env: LedgerEnv, tmp_path: Path
) -> None:
    ds = make_dataset(tmp_path / "crm.db")
    scope = make_scope(ledger_env, ds, caps=default_caps("read-write"))
    ledger_env.ledger.close()
    with pytest.raises(CallRefused):
        sql(scope, "UPDATE customers SET plan = 'gone' WHERE id = 1")
    with sqlite3.connect(ds) as conn:
        assert conn.execute("SELECT plan FROM customers WHERE id = 1").fetchone() == ("pro",)
        # Nothing left locked: another writer gets in at once.
        conn.execute("UPDATE customers SET mrr = mrr WHERE id = 1")


def test_read_refused_when_the_ledger_cannot_record(env: Env) -> None:
    env.ledger.ledger.close()
    with pytest.raises(CallRefused) as info:
        sql(env.scope, "SELECT name FROM customers")
    assert "ledger" in info.value.message
    assert "Ada" not in info.value.message


def test_insert_needs_write_on_every_column(ledger_env: LedgerEnv, tmp_path: Path) -> None:
    ds = make_dataset(tmp_path / "crm.db")
    scope = make_scope(ledger_env, ds, caps=default_caps("read-write"))
    with pytest.raises(CallDenied):
        # An inserted row has an email (NULL or not): email is not approved.
        sql(scope, "INSERT INTO customers (id, name) VALUES (7, 'x')")
    sql(scope, "INSERT INTO events (customer, kind) VALUES (7, 'signup')")
    with sqlite3.connect(ds) as conn:
        assert conn.execute("SELECT count(*) FROM customers WHERE id = 7").fetchone() == (0,)
        assert conn.execute("SELECT count(*) FROM events WHERE customer = 7").fetchone() == (1,)


# -- malformed calls ------------------------------------------------------------------


@pytest.mark.parametrize(
    "request_",
    [
        {"sql": "SELECT 1"},
        {"dataset": "crm"},
        {"dataset": "crm", "sql": ""},
        {"dataset": "crm", "sql": "SELECT id FROM customers", "params": "x"},
        {"dataset": "crm", "sql": "SELECT id FROM customers WHERE id = ?", "params": [[1]]},
        {"dataset": "crm", "sql": "SELECT id FROM customers WHERE id = ?", "params": []},
        {"dataset": "crm", "sql": "SELEC id FROM customers"},
    ],
)
def test_malformed_calls_are_bad_and_recorded(env: Env, request_: dict[str, Any]) -> None:
    before = len(events(env.ledger))
    with pytest.raises(BadCall):
        asyncio.run(handle_sql(env.scope, request_))
    ev = last_event(env.ledger)
    assert len(events(env.ledger)) == before + 1
    assert ev["decision"] == "deny" and ev["reason"].startswith("refused: ")


def test_unknown_dataset_is_denied(env: Env) -> None:
    with pytest.raises(CallDenied):
        sql(env.scope, "SELECT 1", dataset="hr")
    ev = last_event(env.ledger)
    assert ev["decision"] == "deny" and ev["resource"] == "dataset/hr"


@pytest.mark.parametrize(
    ("request_", "error"),
    [
        ({"dataset": "crm", "sql": ""}, BadCall),
        ({"dataset": "hr", "sql": "SELECT 1"}, CallDenied),
    ],
)
def test_a_refusal_found_parsing_is_left_to_the_record_stage(
    env: Env, request_: dict[str, Any], error: type[Exception]
) -> None:
    """A call refused before its statement is analysed (malformed, a dataset not
    bound) is not recorded from inside the parse: ``prepare`` appends nothing and
    hands the refusal on; the record stage writes it as the call's one event."""
    from proctor.broker._connectors import SqlRefused, prepare

    before = len(events(env.ledger))
    refused = asyncio.run(prepare(env.scope, request_))
    assert isinstance(refused, SqlRefused) and isinstance(refused.ruling.refusal, error)
    assert len(events(env.ledger)) == before
    with pytest.raises(error):
        asyncio.run(handle_sql(env.scope, request_))
    (ev,) = events(env.ledger)[before:]
    assert (ev["action"], ev["decision"]) == ("sql.select", "deny")
    assert ev["reason"] == "refused: " + refused.ruling.refusal.message
    assert ev["resource"] == f"dataset/{request_['dataset']}" and ev["policies"] == []
