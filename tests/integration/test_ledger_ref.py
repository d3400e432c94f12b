"""Governance events are found by ``ledger_entries.ref`` (migration 13), a column the
ledger writes from each event's draft, instead of an expression index that parsed
every event's bytes at every insert. A column is something a store writer can edit,
so nothing is believed because of it: the look-up by resource re-reads each event it
finds (governance/_backing.py), and ``verify`` holds every row's ``ref`` to its
event, so a ref that is cleared (the event hidden from the runtime's checks), moved
or added is found like altered bytes."""

from __future__ import annotations

import re

import pytest

from proctor.errors import VerificationFailed
from proctor.governance._backing import Record
from proctor.ledger import INDEXED_ACTIONS, Action, Actor, EventDraft, Ledger, event_ref
from proctor.store import Engine, open_store
from proctor.store._migrations import SQLITE_MIGRATIONS
from proctor.store._pg_migrations import POSTGRES_MIGRATIONS
from tests.conftest import LedgerEnv, draft

ALICE = Actor("user", "acme/alice")
A, B = "artifact/sha256:" + "a" * 64, "artifact/sha256:" + "b" * 64


def _grant(resource: str) -> EventDraft:
    return EventDraft(ALICE, Action.APPROVAL_GRANT, resource, details={"approval": "apr-1"})


def _log(env: LedgerEnv) -> None:
    """acme: 0 a test event, 1 a grant of A, 2 a grant of B, 3 a read of A (no
    governance event: not indexed)."""
    env.ledger.create_log("acme", draft(0))
    env.ledger.append("acme", _grant(A))
    env.ledger.append("acme", _grant(B))
    env.ledger.append("acme", EventDraft(ALICE, Action.ARTIFACT_READ, A))


def _refs(env: LedgerEnv, log: str = "acme") -> dict[int, str | None]:
    with env.store.read() as conn:
        rows = conn.query("SELECT seq, ref FROM ledger_entries WHERE log = ? ORDER BY seq", (log,))
    return {int(r[0]): (None if r[1] is None else str(r[1])) for r in rows}


def _tamper(env: LedgerEnv, sql: str, params: tuple[object, ...]) -> None:
    with env.store.write() as conn:
        conn.execute(sql, params)


def _seqs(env: LedgerEnv, resource: str) -> list[int]:
    return [int(e["seq"]) for e in Record(env.store, env.ledger).events("acme", resource)]


def test_the_writer_fills_ref_for_exactly_the_governance_actions(ledger_env: LedgerEnv) -> None:
    ledger_env.ledger.create_log("acme", draft(0))
    drafts = [EventDraft(ALICE, action, f"thing/{action}") for action in Action]
    ledger_env.ledger.append_many("acme", drafts)
    refs = _refs(ledger_env)
    for seq, d in enumerate(drafts, start=1):
        assert refs[seq] == event_ref(d.action, d.resource), d.action
    assert {drafts[s - 1].action for s, r in refs.items() if r is not None} == INDEXED_ACTIONS
    # A follow-up event in another log (made in the writer from a leaf hash) too.
    ledger_env.ledger.create_log(
        "beta", draft(0), then=("acme", lambda leaf: _grant(f"tenant/{leaf.hex()[:8]}"))
    )
    follow = max(_refs(ledger_env))
    assert str(_refs(ledger_env)[follow]).startswith("tenant/")
    assert ledger_env.ledger.verify("acme").size == follow + 1


def test_a_lookup_finds_its_events_by_ref_and_verify_passes(ledger_env: LedgerEnv) -> None:
    _log(ledger_env)
    assert _refs(ledger_env) == {0: None, 1: A, 2: B, 3: None}
    assert _seqs(ledger_env, A) == [1]
    assert _seqs(ledger_env, B) == [2]
    assert ledger_env.ledger.verify("acme").size == 4


def test_a_ref_moved_to_another_resource_is_refused_by_the_lookup_and_verify(
    ledger_env: LedgerEnv,
) -> None:
    _log(ledger_env)
    # B's grant moved under A: the look-up of A would count a grant of B.
    _tamper(ledger_env, "UPDATE ledger_entries SET ref = ? WHERE log = 'acme' AND seq = 2", (A,))
    with pytest.raises(VerificationFailed, match=r"seq 2 .*indexed under another resource"):
        _seqs(ledger_env, A)
    with pytest.raises(VerificationFailed, match="event seq 2: its row's ref column says"):
        ledger_env.ledger.verify("acme")


def test_a_ref_added_to_an_event_that_is_no_governance_event_is_refused(
    ledger_env: LedgerEnv,
) -> None:
    _log(ledger_env)
    # The read of A is about A, but it backs nothing: indexing it is tampering.
    _tamper(ledger_env, "UPDATE ledger_entries SET ref = ? WHERE log = 'acme' AND seq = 3", (A,))
    with pytest.raises(VerificationFailed, match=r"seq 3 .*not a governance event"):
        _seqs(ledger_env, A)
    with pytest.raises(
        VerificationFailed, match="event seq 3: its row's ref column says 'artifact"
    ):
        ledger_env.ledger.verify("acme")


def test_altered_bytes_under_a_true_ref_are_not_trusted(ledger_env: LedgerEnv) -> None:
    _log(ledger_env)
    # The grant's bytes rewritten (another approval id), its ref left as it was.
    data = next(ledger_env.ledger.entries("acme", 1, 2)).replace(b"apr-1", b"apr-9")
    _tamper(
        ledger_env, "UPDATE ledger_entries SET data = ? WHERE log = 'acme' AND seq = 1", (data,)
    )
    with pytest.raises(VerificationFailed, match="seq 1 of 'acme' is not in the signed log"):
        _seqs(ledger_env, A)


def test_a_cleared_ref_hides_the_event_from_the_lookup_and_verify_names_it(
    ledger_env: LedgerEnv,
) -> None:
    _log(ledger_env)
    _tamper(ledger_env, "UPDATE ledger_entries SET ref = NULL WHERE log = 'acme' AND seq = 1", ())
    # What a store writer can do at run time (as deleting the row could before) ...
    assert _seqs(ledger_env, A) == []
    # ... and what `audit verify` finds: the governance event lacks its ref.
    with pytest.raises(VerificationFailed, match="event seq 1: its row's ref column says None"):
        ledger_env.ledger.verify("acme")


# -- migration 13 over a store written before it --------------------------------------


def _back_to_12(env: LedgerEnv) -> None:
    """The store as migration 12 left it: no ref column, migration 7's index."""
    migrations = POSTGRES_MIGRATIONS if env.store.engine is Engine.POSTGRESQL else SQLITE_MIGRATIONS
    with env.store.write() as conn:
        conn.execute("DROP INDEX ledger_entries_ref")
        conn.execute("ALTER TABLE ledger_entries DROP COLUMN ref")
        conn.execute(migrations[6][1])
        # The migrations after 13 only add tables and columns: undone, they are
        # applied again.
        for later in migrations[13:]:
            for statement in later:
                made = re.match(r"\s*CREATE TABLE (\w+)", statement)
                if made:
                    conn.execute(f"DROP TABLE {made.group(1)}")
                added = re.match(r"\s*ALTER TABLE (\w+) ADD COLUMN (\w+)", statement)
                if added:
                    conn.execute(f"ALTER TABLE {added.group(1)} DROP COLUMN {added.group(2)}")
        conn.execute("DELETE FROM schema_migrations WHERE version >= 13")


def test_migration_13_fills_ref_from_the_events_written_before_it(ledger_env: LedgerEnv) -> None:
    _log(ledger_env)
    _back_to_12(ledger_env)
    env = ledger_env.reopen()
    try:
        assert _refs(env) == {0: None, 1: A, 2: B, 3: None}
        assert _seqs(env, A) == [1]
        assert env.ledger.verify("acme").size == 4
        env.ledger.append("acme", _grant(A))  # and the writer goes on from there
        assert _seqs(env, A) == [1, 4]
    finally:
        env.ledger.close()
        env.store.close()


@pytest.mark.parametrize("store_engine", ["sqlite"], indirect=True)
def test_migration_13_leaves_a_row_that_is_no_json_readable_for_verify(
    ledger_env: LedgerEnv,
) -> None:
    _log(ledger_env)
    _back_to_12(ledger_env)
    # Bytes that are not JSON (a tampered row): migration 7's index kept them
    # writable; migration 13 must not fail on them, and verify names the row.
    _tamper(
        ledger_env, "UPDATE ledger_entries SET data = ? WHERE log = 'acme' AND seq = 2", (b"\xff{",)
    )
    env = ledger_env.reopen()
    try:
        assert _refs(env) == {0: None, 1: A, 2: None, 3: None}
        with pytest.raises(VerificationFailed, match="event seq 2: not valid JSON"):
            env.ledger.verify("acme")
    finally:
        env.ledger.close()
        env.store.close()


@pytest.mark.parametrize("migrations", [SQLITE_MIGRATIONS, POSTGRES_MIGRATIONS])
def test_migration_13_fills_ref_for_exactly_the_indexed_actions(
    migrations: list[list[str]],
) -> None:
    backfill = migrations[12][1]
    names = set(re.findall(r"'([a-z]+\.[a-z_.]+)'", backfill))
    assert names == set(INDEXED_ACTIONS)


def test_a_store_at_13_has_no_expression_index_left(tmp_path: object) -> None:
    store = open_store(f"{tmp_path}/p.db", create=True)
    try:
        with store.read() as conn:
            sql = conn.query_one(
                "SELECT sql FROM sqlite_schema WHERE type = 'index' AND name = 'ledger_entries_ref'"
            )
        assert sql is not None and "json" not in str(sql[0]).lower()
        assert "WHERE ref IS NOT NULL" in str(sql[0])
    finally:
        store.close()


def test_the_ledger_writes_no_ref_for_a_non_governance_log(tmp_path: object) -> None:
    """The hot path (broker events) leaves ref NULL: nothing enters the partial index."""
    from proctor.ledger import Signer

    store = open_store(f"{tmp_path}/q.db", create=True)
    ledger = Ledger(store, Signer.generate("t.local"), "t.local")
    try:
        ledger.create_log("acme", draft(0))
        ledger.append_many("acme", [EventDraft(ALICE, Action.SQL_SELECT, "dataset/x")] * 5)
        with store.read() as conn:
            row = conn.query_one("SELECT count(*) FROM ledger_entries WHERE ref IS NOT NULL")
        assert row is not None and int(row[0]) == 0
    finally:
        ledger.close()
        store.close()


def test_retention_never_prunes_an_indexed_event() -> None:
    """A pruned event's bytes become a marker but its row keeps its ref, which verify
    would then refuse: every indexed action must be one retention keeps."""
    from proctor.governance._retention import kept

    assert all(kept(action) for action in INDEXED_ACTIONS)
