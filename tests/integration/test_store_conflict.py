"""What differs between the engines is asked of the store, never read off its name:
a write that loses to another writer is ``store.Conflict`` on either engine, and
the capabilities say what each engine can do beyond portable SQL."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest

from proctor.errors import RunRefused, StoreError
from proctor.governance import Runs
from proctor.ledger import utc_now
from proctor.store import Conflict, Engine, Store, open_store


@pytest.fixture
def store(store_url: str) -> Iterator[Store]:
    opened = open_store(store_url, create=True)
    yield opened
    opened.close()


def _tenants(store: Store) -> list[str]:
    with store.read() as conn:
        return [str(r[0]) for r in conn.query("SELECT name FROM tenants ORDER BY name")]


def _add_tenant(conn: Any, name: str) -> None:
    conn.execute(
        "INSERT INTO tenants (name, created_at, created_by) VALUES (?, ?, 'test')",
        (name, utc_now()),
    )


def test_a_second_row_under_a_unique_key_is_a_conflict_and_changes_nothing(
    store: Store,
) -> None:
    with store.write() as conn:
        _add_tenant(conn, "acme")
    # The whole write goes, the row before the conflict with it.
    with pytest.raises(Conflict) as caught, store.write() as conn:
        _add_tenant(conn, "beta")
        _add_tenant(conn, "acme")
    assert isinstance(caught.value, StoreError)  # still a store error to every caller
    assert "conflicting write" in caught.value.message
    assert _tenants(store) == ["acme"]
    # executemany is held to the same rule.
    with pytest.raises(Conflict), store.write() as conn:
        conn.executemany(
            "INSERT INTO tenants (name, created_at, created_by) VALUES (?, ?, 'test')",
            [("gamma", utc_now()), ("acme", utc_now())],
        )
    assert _tenants(store) == ["acme"]
    with store.write() as conn:  # the store is not left broken by a conflict
        _add_tenant(conn, "beta")
    assert _tenants(store) == ["acme", "beta"]


def test_a_refusal_that_is_no_race_is_not_a_conflict(store: Store) -> None:
    """A NOT NULL column left empty is a broken write, not a lost race: a caller
    that retries or reports "already exists" on Conflict must not see it."""
    with pytest.raises(StoreError) as caught, store.write() as conn:
        conn.execute("INSERT INTO tenants (name, created_at, created_by) VALUES ('x', NULL, 'x')")
    assert not isinstance(caught.value, Conflict)
    assert _tenants(store) == []


def test_each_engine_states_its_capabilities(store: Store, store_engine: str) -> None:
    caps = store.capabilities
    assert store.engine is Engine(store_engine)
    if store.engine is Engine.POSTGRESQL:
        assert (caps.bulk_insert, caps.secure_delete, caps.advisory_lock) == (True, False, True)
    else:
        assert (caps.bulk_insert, caps.secure_delete, caps.advisory_lock) == (False, True, False)


def test_a_session_lock_is_held_once_across_connections(store: Store) -> None:
    if not store.capabilities.advisory_lock:
        with pytest.raises(StoreError, match="no session locks"):
            store.try_lock("proctor:test")
        return
    held = store.try_lock("proctor:test")
    assert held is not None
    with held:
        # Another opening of the same store (another node) is refused while it is held.
        other = open_store(_dsn(store))
        try:
            assert other.try_lock("proctor:test") is None
            assert other.try_lock("proctor:other") is not None
        finally:
            other.close()
    again = store.try_lock("proctor:test")
    assert again is not None
    with again:
        pass


def _dsn(store: Store) -> str:
    dsn = getattr(store, "dsn", None)
    assert isinstance(dsn, str)
    return dsn


def _run_row(run_id: str) -> tuple[Any, ...]:
    """A run's values in RunRecord's field order: a service's run, running."""
    return (run_id, "acme", "svc", 1, "sha256:" + "0" * 64, "production",
            f"spiffe://proctor.local/tenant/acme/deployment/svc/run/{run_id}", "[]",
            "bubblewrap", None, "running", None, None, 1, "{}", None, utc_now(), None)  # fmt: skip


@pytest.mark.postgres
def test_a_start_that_loses_the_race_at_the_index_is_refused_on_postgresql(pg_dsn: str) -> None:
    """Two starts of one service overlap so that the second's look finds nothing
    and its insert waits on the first's uncommitted row: the index refuses it
    (UniqueViolation in the driver), which reaches Runs as store.Conflict and is
    refused as a second run, not as a failing store."""
    import psycopg

    store = open_store(pg_dsn, create=True)
    try:
        with store.write() as conn:
            _add_tenant(conn, "acme")
        first_in = threading.Event()
        first_may_commit = threading.Event()
        outcome: list[BaseException | str] = []

        def first() -> None:
            with store.write("race-a") as conn:
                Runs.insert(conn, _run_row("r-a"), "owner-a", exclusive=True)
                first_in.set()
                first_may_commit.wait(60)

        def second() -> None:
            first_in.wait(60)
            try:
                with store.write("race-b") as conn:
                    Runs.insert(conn, _run_row("r-b"), "owner-b", exclusive=True)
                outcome.append("started")
            except BaseException as exc:
                outcome.append(exc)

        a, b = threading.Thread(target=first), threading.Thread(target=second)
        a.start()
        b.start()
        # The second insert waits on the first's row: seen from a third connection.
        with psycopg.connect(pg_dsn, autocommit=True) as watch:
            for _ in range(6000):
                row = watch.execute(
                    "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
                    " AND wait_event_type = 'Lock' AND query LIKE 'INSERT INTO runs%'"
                ).fetchone()
                if row and row[0]:
                    break
                threading.Event().wait(0.01)
            else:
                pytest.fail("the second start never waited on the first's row")
        first_may_commit.set()
        a.join(60)
        b.join(60)
        assert len(outcome) == 1
        refused = outcome[0]
        assert isinstance(refused, RunRefused), refused
        # No run id: the look found none, the index refused the row.
        assert "running already;" in refused.message
        assert isinstance(refused.__context__, Conflict)
    finally:
        store.close()


def test_a_resources_governance_events_are_read_by_its_index_on_either_engine(
    store: Store,
) -> None:
    """The query Record builds from the store's expressions uses the ledger_entries_ref index (migration 13)
    on both engines, tenant included, instead of walking a log."""
    from proctor.governance._backing import _by_resource
    from proctor.store import to_pg_sql

    sql = _by_resource(store)
    if store.engine is Engine.SQLITE:
        with store.read() as conn:
            plan = " ".join(str(r[-1]) for r in conn.query("EXPLAIN QUERY PLAN " + sql, ("a", "t")))
        assert "USING INDEX ledger_entries_ref" in plan, plan
        return
    import psycopg

    with psycopg.connect(_dsn(store), autocommit=True) as db:
        db.execute("SET enable_seqscan = off")  # an empty table: only the index may answer
        rows = db.execute("EXPLAIN " + to_pg_sql(sql), ("a", "t")).fetchall()
    plan = " ".join(str(r[0]) for r in rows)
    assert "ledger_entries_ref" in plan, plan
    assert "log = 't'" in plan.split("Index Cond:")[1], plan
