"""What the broker keeps between a run's SQL calls must never answer for a call it
does not fit.

A run sends the same statement again and again, so the SQLite connector keeps
what compiling it taught (the accesses, the b-trees its plan reads through, where
the key goes) per connection and schema version, and the shared path keeps
Cedar's answers per policy set. Each test lets a first call be kept, then changes
what the answer depends on (the schema, a parameter SQLite plans with, the
parameters' count, the policy set) and tries the same statement again: it must
be decided afresh, as if nothing had been kept.
"""

from __future__ import annotations

import asyncio
import sqlite3
from pathlib import Path
from typing import Any

import pytest

from proctor.broker import BadCall, CallDenied, handle_sql
from proctor.policy import capability_policies, compile_policies
from tests.conftest import LedgerEnv
from tests.integration.test_broker_sql import DEPLOYMENT, TENANT, events, make_scope, sql

ROWS = [
    (1, "n1", "zoe@example.com", "pro"),
    (2, "n2", "amy@example.com", "pro"),
    (3, "n3", "kim@example.com", "pro"),
    (4, "n4", "bob@example.com", "free"),
]
ALLOWED = ["id", "name", "plan"]  # not email


def _caps() -> dict[str, Any]:
    return {"datasets": {"crm": {"tables": {"customers": {"columns": ALLOWED}}}}}


def _dataset(path: Path, schema: str = "") -> Path:
    conn = sqlite3.connect(path)
    conn.executescript(
        "CREATE TABLE customers (id INTEGER PRIMARY KEY, name TEXT, email TEXT, plan TEXT);"
        + schema
    )
    conn.executemany("INSERT INTO customers VALUES (?, ?, ?, ?)", ROWS)
    conn.commit()
    conn.close()
    return path


def _denied_through_email(ledger_env: LedgerEnv) -> None:
    ev = events(ledger_env, "sql.")[-1]
    assert ev["decision"] == "deny"
    (grant,) = ev["details"]["tables"]
    assert "email" in grant["columns"]
    assert ev["details"]["plan"][0]["via"] == "index by_name"


def test_an_index_made_after_a_statement_was_kept_is_decided(
    ledger_env: LedgerEnv, tmp_path: Path
) -> None:
    """Kept while the table had no index, the statement is compiled again once the
    data owner adds one on (name, email): its plan now reads the names in email
    order within each name, through the denied column, and is refused."""
    ds = _dataset(tmp_path / "crm.db")
    scope = make_scope(ledger_env, ds, caps=_caps())
    query = "SELECT name FROM customers WHERE name > ?"
    assert sql(scope, query, ["n"])["row_count"] == 4
    assert sql(scope, query, ["n1"])["row_count"] == 3  # kept, answered again
    owner = sqlite3.connect(ds)
    owner.execute("CREATE INDEX by_name ON customers (name, email)")
    owner.commit()
    owner.close()
    with pytest.raises(CallDenied, match="email"):
        sql(scope, query, ["n"])
    _denied_through_email(ledger_env)


def test_a_like_pattern_is_planned_with_its_value_on_every_call(
    ledger_env: LedgerEnv, tmp_path: Path
) -> None:
    """SQLite plans ``name LIKE ?`` with the pattern's value: a leading wildcard scans
    the table, a prefix searches the (name, email) index. The first call is
    permitted; the second, the same text, must not inherit its plan."""
    ds = _dataset(
        tmp_path / "crm.db", "CREATE INDEX by_name ON customers (name COLLATE NOCASE, email);"
    )
    scope = make_scope(ledger_env, ds, caps=_caps())
    query = "SELECT plan FROM customers WHERE name LIKE ?"
    assert sql(scope, query, ["%1"])["rows"] == [["pro"]]
    with pytest.raises(CallDenied, match="email"):
        sql(scope, query, ["n%"])
    _denied_through_email(ledger_env)


def test_a_kept_statement_still_checks_its_parameters(
    ledger_env: LedgerEnv, tmp_path: Path
) -> None:
    ds = _dataset(tmp_path / "crm.db")
    scope = make_scope(ledger_env, ds, caps=_caps())
    query = "SELECT name FROM customers WHERE id = ?"
    assert sql(scope, query, [1])["rows"] == [["n1"]]
    with pytest.raises(BadCall, match="parameters do not match"):
        sql(scope, query, [1, 2])
    with pytest.raises(BadCall, match="parameters do not match"):
        sql(scope, query, [])
    assert sql(scope, query, [2])["rows"] == [["n2"]]


def test_a_kept_decision_does_not_outlive_its_policy_set(
    ledger_env: LedgerEnv, tmp_path: Path
) -> None:
    """Cedar's answer for a statement is kept for the run; a new policy set (a
    forbid added) is asked again, and the event carries the new set's version."""
    ds = _dataset(tmp_path / "crm.db")
    scope = make_scope(ledger_env, ds, caps=_caps())
    query = "SELECT name FROM customers WHERE id = ?"
    assert sql(scope, query, [1])["rows"] == [["n1"]]
    assert sql(scope, query, [2])["rows"] == [["n2"]]
    before = scope.policies.version
    text = capability_policies(TENANT, DEPLOYMENT, _caps())
    scope.policies = compile_policies(
        text + '\n@id("no-crm")\nforbid (principal, action, '
        'resource == Proctor::Table::"acme/crm/customers");'
    )
    with pytest.raises(CallDenied):
        sql(scope, query, [3])
    ev = events(ledger_env, "sql.")[-1]
    assert ev["decision"] == "deny" and ev["policies"] == ["no-crm"]
    assert ev["details"]["policy_version"] == scope.policies.version != before
    # And back: the permit answers again, under the first set's version.
    scope.policies = compile_policies(text)
    assert sql(scope, query, [3])["rows"] == [["n3"]]
    assert events(ledger_env, "sql.")[-1]["details"]["policy_version"] == before


# -- reads answered on the event loop ---------------------------------------------


def _big(path: Path, rows: int) -> Path:
    conn = sqlite3.connect(path)
    conn.execute(
        "CREATE TABLE customers (id INTEGER PRIMARY KEY, name TEXT, email TEXT, plan TEXT)"
    )
    conn.executemany(
        "INSERT INTO customers VALUES (?, ?, ?, ?)",
        ((i, f"n{i}", f"e{i}@example.com", "pro") for i in range(rows)),
    )
    conn.commit()
    conn.close()
    return path


def test_a_quick_statement_that_turns_slow_is_answered_whole_by_a_worker(
    ledger_env: LedgerEnv, tmp_path: Path
) -> None:
    """The same kept statement, quick for one value and a scan of the whole table for
    another: the scan is stopped on the event loop and answered by a worker, whole,
    with one event (nothing of the stopped attempt is used or recorded)."""
    rows = 300_000
    ds = _big(tmp_path / "crm.db", rows)
    scope = make_scope(ledger_env, ds, caps=_caps())
    query = "SELECT count(name) FROM customers WHERE id >= ?"
    for _ in range(3):  # kept, then found quick, then answered on the loop
        assert sql(scope, query, [rows - 1])["rows"] == [[1]]
    assert sql(scope, query, [0])["rows"] == [[rows]]
    assert sql(scope, query, [rows - 2])["rows"] == [[2]]
    evs = events(ledger_env, "sql.")
    assert len(evs) == 5
    assert all(e["decision"] == "allow" and e["details"]["outcome"] == "ok" for e in evs)


def test_a_locked_dataset_is_waited_for_by_a_worker_not_refused(
    ledger_env: LedgerEnv, tmp_path: Path
) -> None:
    """A kept, quick read meets the dataset locked by its owner's write: the attempt on
    the event loop does not wait (busy timeout zero) and gives up; the worker waits,
    as every read did before, and answers once the write is committed."""
    ds = _dataset(tmp_path / "crm.db")
    scope = make_scope(ledger_env, ds, caps=_caps())
    query = "SELECT name FROM customers WHERE id = ?"
    for i in (1, 2, 3):
        assert sql(scope, query, [i])["rows"] == [[f"n{i}"]]
    owner = sqlite3.connect(ds, isolation_level=None, check_same_thread=False)
    owner.execute("BEGIN EXCLUSIVE")
    owner.execute("UPDATE customers SET name = 'renamed' WHERE id = 4")

    async def read_while_locked() -> dict[str, Any]:
        call = asyncio.create_task(
            handle_sql(scope, {"dataset": "crm", "sql": query, "params": [4]})
        )
        await asyncio.sleep(0.3)
        assert not call.done()  # waiting on the lock, not refused
        owner.execute("COMMIT")
        return await call

    try:
        out = asyncio.run(read_while_locked())
    finally:
        if owner.in_transaction:
            owner.execute("ROLLBACK")
        owner.close()
    assert out["rows"] == [["renamed"]]
    assert events(ledger_env, "sql.")[-1]["details"]["outcome"] == "ok"


def test_quick_reads_past_a_runs_share_of_the_loop_take_the_worker_path(
    ledger_env: LedgerEnv, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run's reads answered on the event loop are held to its share of the loop
    (the loop serves every run's calls): with the share spent, the same quick read is
    answered by a worker, decided and recorded the same."""
    from proctor.broker import _fair, _sql

    # A clock that moves a second each time it is read: each read on the loop is
    # charged one second, nothing refills, and the run's burst covers three.
    ticks = iter(range(1, 1_000_000))
    spent = _fair.LoopShare(share=0.0, burst=2.5, total=0.0, clock=lambda: float(next(ticks)))
    monkeypatch.setattr(_fair, "LOOP", spent)
    monkeypatch.setattr("proctor.broker._datasets.LOOP", spent)
    on_loop: list[int] = []
    real = _sql._Statement.quick_read

    def counted(self: Any, *args: Any) -> Any:
        found = real(self, *args)
        on_loop.append(found is not None)
        return found

    monkeypatch.setattr(_sql._Statement, "quick_read", counted)
    ds = _dataset(tmp_path / "crm.db")
    scope = make_scope(ledger_env, ds, caps=_caps())
    query = "SELECT name FROM customers WHERE id = ?"
    for i in (1, 2, 3, 4, 1, 2):
        assert sql(scope, query, [i])["rows"] == [[f"n{i}"]]
    # Three tries on the loop (one of them at least answered there), then the run's
    # share is spent and the other reads go to the worker path.
    assert len(on_loop) == 3 and any(on_loop), on_loop
    assert len(events(ledger_env, "sql.")) == 6


def test_the_loop_share_refills_at_its_rate_and_bounds_all_runs() -> None:
    from proctor.broker._fair import LoopShare

    now = [0.0]

    class Scope:
        def __init__(self, run: str) -> None:
            self.tenant, self.run_id = "acme", run

    share = LoopShare(share=0.25, burst=0.05, total=0.5, clock=lambda: now[0])

    def work(seconds: float) -> str:
        now[0] += seconds
        return "ran"

    a, b, c = Scope("a"), Scope("b"), Scope("c")
    # Run a overruns its burst; it refills at a quarter of each second elapsed.
    assert share.run(a, lambda: work(0.1)) == "ran"  # type: ignore[arg-type]
    assert share.run(a, lambda: work(0.01)) is None  # type: ignore[arg-type]
    now[0] += 0.14
    assert share.run(a, lambda: work(0.01)) == "ran"  # type: ignore[arg-type]
    # Run b's work overruns what is left of the total: run c waits, though its own
    # share is whole, until the total refills (half of each second elapsed).
    assert share.run(b, lambda: work(0.3)) == "ran"  # type: ignore[arg-type]
    assert share.run(c, lambda: work(0.01)) is None  # type: ignore[arg-type]
    now[0] += 0.2
    assert share.run(c, lambda: work(0.01)) == "ran"  # type: ignore[arg-type]
