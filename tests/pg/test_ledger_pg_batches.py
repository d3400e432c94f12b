"""The ledger writer's PostgreSQL paths: the right edge read with the head in one
query is the right edge the general reload builds, at every tile boundary; two
nodes taking turns on a log reload each other's edge correctly; and a batch that
waited for its log's lock takes what was queued meanwhile, keeping the order."""

from __future__ import annotations

import asyncio
import itertools

import psycopg
import pytest

from proctor.ledger import EventDraft, Ledger, Signer, verify_consistency
from proctor.ledger._ledger import _LogState
from proctor.store import Store, open_store
from proctor.store._postgres import lock_key
from tests.conftest import OPERATOR, draft

pytestmark = pytest.mark.postgres


def _tiny(i: int) -> EventDraft:
    return EventDraft(OPERATOR, "test.tiny", "r", details={"i": i})


def _same(a: _LogState, b: _LogState) -> None:
    assert (a.origin, a.last_time, a.tree.size) == (b.origin, b.last_time, b.tree.size)
    assert a.tree.peaks == b.tree.peaks
    assert a.tree.root() == b.tree.root()
    assert {k: (i, bytes(t)) for k, (i, t) in a.tiles.items()} == {
        k: (i, bytes(t)) for k, (i, t) in b.tiles.items()
    }


def _edges_agree(ledger: Ledger, store: Store, log: str) -> int:
    with store.write(f"ledger:{log}") as conn:
        fast = ledger._edge(conn, log, None)
        plain = ledger._reload(conn, log, None)
        assert fast is not None and plain is not None
        _same(fast, plain)
        # Known to be current: the head alone, no tiles.
        assert ledger._edge(conn, log, fast) is fast
        return fast.tree.size


def test_the_edge_read_with_the_head_is_the_reloaded_edge_at_every_boundary(
    pg_dsn: str,
) -> None:
    store = open_store(pg_dsn, create=True)
    ledger = Ledger(store, Signer.generate("test.local"), "test.local", max_batch=4096)
    try:
        ledger.create_log("acme", _tiny(0))
        size = 1
        # Up to and across a level-2 tile (65,536 leaves): each a full level-0
        # tile, a full level-1 tile, one short of them, one past them.
        for target in (
            2, 255, 256, 257, 511, 512, 513, 4097,
            65535, 65536, 65537, 65536 + 256, 65536 + 257,
        ):  # fmt: skip
            while size < target:
                n = min(target - size, 4096)
                ledger.append_many("acme", [_tiny(size + i) for i in range(n)])
                size += n
            assert _edges_agree(ledger, store, "acme") == target
        assert ledger.verify("acme").size == size
    finally:
        ledger.close()
        store.close()


def test_two_nodes_taking_turns_reload_each_others_edge(pg_dsn: str) -> None:
    signer = Signer.generate("test.local")
    stores = [open_store(pg_dsn, create=True), open_store(pg_dsn)]
    nodes = [Ledger(s, signer, "test.local") for s in stores]
    try:
        nodes[0].create_log("acme", draft(0))
        notes: list[str] = []
        expected = 1
        # Batch sizes that put the other node's edge on, before and after tile ends.
        for turn, n in enumerate([254, 1, 1, 255, 256, 3, 250, 2, 7, 300]):
            done = nodes[turn % 2].append_many("acme", [draft(expected + i) for i in range(n)])
            assert [a.seq for a in done] == list(range(expected, expected + n))
            expected += n
            notes.append(done[-1].checkpoint)
        report = nodes[1].verify("acme", trusted=notes)
        assert report.size == expected
        sizes = [s for s, _, _ in nodes[0].checkpoints("acme")]
        heads = {s: nodes[0].root_at("acme", s) for s in sizes if s}
        for old, new in itertools.pairwise(s for s in sizes if s):
            proof = nodes[1].consistency_proof("acme", old, new)
            verify_consistency(old, new, heads[old], heads[new], proof.hashes)
    finally:
        for node, s in zip(nodes, stores, strict=True):
            node.close()
            s.close()


def _waiting(conn: psycopg.Connection[tuple[int]]) -> int:
    """How many sessions wait for an advisory lock."""
    row = conn.execute(
        "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted"
    ).fetchone()
    assert row is not None
    return int(row[0])


def _sizes(store: Store, log: str) -> list[int]:
    with store.read() as conn:
        rows = conn.query("SELECT size FROM ledger_checkpoints WHERE log = ? ORDER BY size", (log,))
    return [int(r[0]) for r in rows]


def test_a_batch_that_waited_for_its_lock_takes_what_came_meanwhile_in_order(
    pg_dsn: str,
) -> None:
    store = open_store(pg_dsn, create=True)
    ledger = Ledger(store, Signer.generate("test.local"), "test.local")
    other = psycopg.connect(pg_dsn, autocommit=True)
    try:
        ledger.create_log("acme", draft(0))
        ledger.create_log("beta", draft(0))
        # Another node holds acme's lock: the writer's next batch waits for it.
        other.execute("SELECT pg_advisory_lock(%s)", (lock_key("ledger:acme"),))

        async def go() -> list[tuple[str, int]]:
            first = ledger.append_async("acme", draft(1))
            # Until the writer waits on the lock with `first` alone; then queue more.
            while not _waiting(other):
                await asyncio.sleep(0.01)
            rest = [
                ledger.append_async("acme", draft(2)),
                ledger.append_async("acme", draft(3)),
                ledger.append_async("beta", draft(4)),  # not under the held lock
                ledger.append_async("acme", draft(5)),
            ]
            other.execute("SELECT pg_advisory_unlock_all()")
            done = [await first] + [await f for f in rest]
            return [(a.log, a.seq) for a in done]

        assert asyncio.run(go()) == [
            ("acme", 1),
            ("acme", 2),
            ("acme", 3),
            ("beta", 1),
            ("acme", 4),
        ]
        # One commit for the three acme events queued before beta's; acme's fourth
        # came after beta's and commits with it, in the next batch.
        assert _sizes(store, "acme") == [1, 4, 5]
        assert _sizes(store, "beta") == [1, 2]
        assert ledger.verify("acme").size == 5
    finally:
        other.close()
        ledger.close()
        store.close()
