"""A node's fence (``Ledger.set_fence``): checked inside every transaction the
ledger's writer commits, so a node that lost its lease records nothing, on
either engine, whichever way the events came (append, with a hook, many,
a new log, awaited, queued for later)."""

from __future__ import annotations

import asyncio

import pytest

from proctor.errors import ProctorError
from proctor.store import Conn
from tests.conftest import LedgerEnv, draft


class LeaseLost(ProctorError):
    """What a node's fence raises once another node holds its lease."""


def _probe_table(env: LedgerEnv) -> None:
    with env.store.write() as conn:
        conn.execute("CREATE TABLE fence_probe (n INTEGER NOT NULL)")


def _probe_rows(env: LedgerEnv) -> list[int]:
    with env.store.read() as conn:
        return [int(r[0]) for r in conn.query("SELECT n FROM fence_probe ORDER BY n")]


def _stored(env: LedgerEnv) -> tuple[int, int, int, list[str]]:
    """The log's size, its stored events and checkpoints, and the logs there are."""
    with env.store.read() as conn:
        entries = conn.query_one("SELECT COUNT(*) FROM ledger_entries")
        cps = conn.query_one("SELECT COUNT(*) FROM ledger_checkpoints")
    assert entries is not None and cps is not None
    return env.ledger.head("acme").size, int(entries[0]), int(cps[0]), env.ledger.logs()


def test_a_refusing_fence_fails_every_append_and_nothing_is_written(
    ledger_env: LedgerEnv,
) -> None:
    ledger = ledger_env.ledger
    _probe_table(ledger_env)
    ledger.create_log("acme", draft(0))
    ledger.create_log("system", draft(0))
    before = _stored(ledger_env)
    refusal = LeaseLost("node a no longer holds its lease")

    def fence(conn: Conn) -> None:
        # Written in the batch's transaction, then refused: the row goes with it.
        conn.execute("INSERT INTO fence_probe (n) VALUES (1)")
        raise refusal

    ledger.set_fence(fence)

    def hook(conn: Conn) -> None:
        conn.execute("INSERT INTO fence_probe (n) VALUES (2)")

    with pytest.raises(LeaseLost) as caught:
        ledger.append("acme", draft(1))
    assert caught.value is refusal, "the appends fail with the fence's own error"
    with pytest.raises(LeaseLost):
        ledger.append("acme", draft(2), hook=hook)
    with pytest.raises(LeaseLost):
        ledger.append_many("acme", [draft(3), draft(4), draft(5)])
    with pytest.raises(LeaseLost):
        ledger.create_log("beta", draft(0), hook=hook)
    with pytest.raises(LeaseLost):
        ledger.append("acme", draft(6), then=("system", lambda leaf: draft(7)))

    async def awaited() -> list[object]:
        return list(
            await asyncio.gather(
                ledger.append_async("acme", draft(8)),
                ledger.append_async("acme", draft(9), hook=hook),
                ledger.append_later("acme", draft(10)),
                return_exceptions=True,
            )
        )

    results = asyncio.run(awaited())
    assert [type(r) for r in results] == [LeaseLost, LeaseLost, LeaseLost]
    ledger.flush()

    assert _stored(ledger_env) == before, "a fenced batch left an event, a checkpoint or a log"
    assert _probe_rows(ledger_env) == [], "the fence's and the hooks' rows rolled back"

    # Fence lifted: the log goes on from where the store has it, not from the
    # right edge the refused batches had moved in memory.
    ledger.set_fence(None)
    assert ledger.append("acme", draft(11)).seq == 1
    assert ledger.verify("acme").size == 2


def test_a_passing_fence_runs_once_in_each_committed_batch(ledger_env: LedgerEnv) -> None:
    ledger = ledger_env.ledger
    _probe_table(ledger_env)
    ledger.create_log("acme", draft(0))
    calls: list[int] = []

    def fence(conn: Conn) -> None:
        calls.append(len(calls) + 1)
        conn.execute("INSERT INTO fence_probe (n) VALUES (?)", (len(calls),))

    ledger.set_fence(fence)
    assert ledger.append("acme", draft(1)).seq == 1
    assert ledger.append("acme", draft(2), hook=lambda c: None).seq == 2
    assert [a.seq for a in ledger.append_many("acme", [draft(3), draft(4)])] == [3, 4]

    async def awaited() -> list[int]:
        later = ledger.append_later("acme", draft(5))
        now = await ledger.append_async("acme", draft(6))
        return [(await later).seq, now.seq]

    assert asyncio.run(awaited()) == [5, 6]
    # Each commit ran the fence once, and its row committed with the batch.
    assert calls and _probe_rows(ledger_env) == calls
    assert ledger.verify("acme").size == 7


def test_a_fence_reads_what_the_store_holds_at_each_batch(ledger_env: LedgerEnv) -> None:
    """The fence sees a change another writer committed between two batches:
    the lease lapses, appends fail; it is renewed, they succeed."""
    ledger = ledger_env.ledger
    with ledger_env.store.write() as conn:
        conn.execute("CREATE TABLE fence_lease (holder TEXT NOT NULL)")
        conn.execute("INSERT INTO fence_lease (holder) VALUES ('a')")
    ledger.create_log("acme", draft(0))

    def fence(conn: Conn) -> None:
        row = conn.query_one("SELECT holder FROM fence_lease")
        if row is None or row[0] != "a":
            raise LeaseLost("node a no longer holds its lease")

    ledger.set_fence(fence)
    assert ledger.append("acme", draft(1)).seq == 1
    with ledger_env.store.write() as conn:
        conn.execute("UPDATE fence_lease SET holder = 'b'")
    with pytest.raises(LeaseLost):
        ledger.append("acme", draft(2))
    with ledger_env.store.write() as conn:
        conn.execute("UPDATE fence_lease SET holder = 'a'")
    assert ledger.append("acme", draft(3)).seq == 2
    assert ledger.verify("acme").size == 3


def test_a_fence_that_fails_otherwise_fails_the_batch_as_a_store_error(
    ledger_env: LedgerEnv,
) -> None:
    from proctor.errors import LedgerError

    ledger = ledger_env.ledger
    ledger.create_log("acme", draft(0))

    def fence(conn: Conn) -> None:
        conn.execute("SELECT * FROM no_such_table")

    ledger.set_fence(fence)
    with pytest.raises(LedgerError):
        ledger.append("acme", draft(1))
    ledger.set_fence(None)
    assert ledger.append("acme", draft(2)).seq == 1
