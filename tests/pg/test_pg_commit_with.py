"""``commit_with``: a PostgreSQL write's last statement sent with its COMMIT in one
round trip (what the ledger's batch uses under its log's lock). If that statement
fails, nothing of the transaction is committed, the error is the store's
(``Conflict`` for a taken key), and the thread's connection goes on working."""

from __future__ import annotations

import psycopg
import pytest

from proctor.errors import LedgerError, StoreError
from proctor.ledger import Ledger, Signer
from proctor.store import Conflict, Store, open_store
from proctor.store._postgres import lock_key
from tests.conftest import draft

pytestmark = pytest.mark.postgres


def _rows(store: Store) -> list[int]:
    with store.read() as conn:
        return [int(r[0]) for r in conn.query("SELECT k FROM t ORDER BY k")]


def test_a_failing_last_statement_commits_nothing_and_the_connection_goes_on(
    pg_dsn: str,
) -> None:
    store = open_store(pg_dsn, create=True)
    try:
        with store.write() as conn:
            conn.execute("CREATE TABLE t (k INTEGER PRIMARY KEY)")
        with store.write("t") as conn:
            conn.execute("INSERT INTO t (k) VALUES (?)", (1,))
            conn.commit_with("INSERT INTO t (k) VALUES (?)", (2,))  # type: ignore[attr-defined]
        assert _rows(store) == [1, 2]

        # A taken key: Conflict, and the earlier statement of the write is gone too.
        with pytest.raises(Conflict), store.write("t") as conn:
            conn.execute("INSERT INTO t (k) VALUES (?)", (3,))
            conn.commit_with("INSERT INTO t (k) VALUES (?)", (1,))  # type: ignore[attr-defined]
        assert _rows(store) == [1, 2]

        # Any other failure: a StoreError, nothing committed.
        with pytest.raises(StoreError), store.write("t") as conn:
            conn.execute("INSERT INTO t (k) VALUES (?)", (4,))
            conn.commit_with("INSERT INTO t (k) VALUES (1 / (? - 5))", (5,))  # type: ignore[attr-defined]
        assert _rows(store) == [1, 2]

        # The body failing after it: rolled back, the statement never sent.
        with pytest.raises(RuntimeError), store.write("t") as conn:
            conn.commit_with("INSERT INTO t (k) VALUES (?)", (6,))  # type: ignore[attr-defined]
            raise RuntimeError("the caller changed its mind")
        assert _rows(store) == [1, 2]

        # The same thread's connection is not left in a failed transaction.
        with store.write("t") as conn:
            conn.execute("INSERT INTO t (k) VALUES (?)", (7,))
        assert _rows(store) == [1, 2, 7]
    finally:
        store.close()


def test_a_ledger_batch_refused_at_its_commit_writes_nothing_and_the_log_goes_on(
    pg_dsn: str,
) -> None:
    store = open_store(pg_dsn, create=True)
    ledger = Ledger(store, Signer.generate("test.local"), "test.local")
    try:
        ledger.create_log("acme", draft(0))
        ledger.append("acme", draft(1))
        # A row planted at the next place (the store's writer, past the ledger):
        # the batch's one statement fails at its COMMIT.
        with store.write() as conn:
            conn.execute(
                "INSERT INTO ledger_entries (log, seq, time, data) VALUES ('acme', 2, 'x', ?)",
                (b"planted",),
            )
        with pytest.raises(LedgerError):
            ledger.append("acme", draft(2))
        with store.read() as conn:
            head = conn.query_one("SELECT size FROM ledger_logs WHERE log = 'acme'")
            cps = conn.query("SELECT size FROM ledger_checkpoints WHERE log = 'acme'")
        assert head == (2,) and sorted(int(r[0]) for r in cps) == [1, 2]
        with store.write() as conn:
            conn.execute("DELETE FROM ledger_entries WHERE log = 'acme' AND seq = 2")
        assert ledger.append("acme", draft(3)).seq == 2
        assert ledger.verify("acme").size == 3
    finally:
        ledger.close()
        store.close()


def _advisory_held(dsn: str, name: str) -> bool:
    key = lock_key(name)
    with psycopg.connect(dsn, autocommit=True) as other:
        row = other.execute(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted"
            " AND ((classid::bigint << 32) | objid::bigint) = (%s::bigint & x'ffffffffffffffff'::bigint)",
            (key,),
        ).fetchone()
    assert row is not None
    return int(row[0]) > 0


def test_a_lazy_write_locks_with_its_first_statement_and_commits_a_lone_last_one(
    pg_dsn: str,
) -> None:
    store = open_store(pg_dsn, create=True)
    try:
        with store.write() as conn:
            conn.execute("CREATE TABLE t (k INTEGER PRIMARY KEY)")
        lazy = store.write_lazy  # type: ignore[attr-defined]
        with lazy("t") as conn:
            assert not _advisory_held(pg_dsn, "t"), "nothing is sent before a statement"
            conn.execute("INSERT INTO t (k) VALUES (?)", (1,))
            assert _advisory_held(pg_dsn, "t"), "the lock came with the first statement"
        assert not _advisory_held(pg_dsn, "t")
        # No statement: nothing begun, nothing held, nothing to commit.
        with lazy("t"):
            pass
        # Only a last statement: BEGIN, the lock, it and COMMIT in one pipeline.
        with lazy("t") as conn:
            conn.commit_with("INSERT INTO t (k) VALUES (?)", (2,))
        with pytest.raises(Conflict), lazy("t") as conn:
            conn.commit_with("INSERT INTO t (k) VALUES (?)", (2,))
        assert _rows(store) == [1, 2]
        with store.write("t") as conn:
            conn.execute("INSERT INTO t (k) VALUES (?)", (3,))
        assert _rows(store) == [1, 2, 3]
    finally:
        store.close()
