"""A node's fence on PostgreSQL, where several nodes share the ledger: the fence
runs in the very transaction that writes the batch (same transaction id as the
events' rows), and a node whose lease another node took records nothing while
the new holder appends on."""

from __future__ import annotations

import asyncio
import itertools

import pytest

from proctor.errors import ProctorError
from proctor.ledger import Fence, Ledger, Signer
from proctor.store import Conn, open_store
from tests.conftest import draft

pytestmark = pytest.mark.postgres


class LeaseLost(ProctorError):
    """What a node's fence raises once another node holds its lease."""


def _lease_fence(node: str, epoch: int, seen: list[int]) -> Fence:
    def fence(conn: Conn) -> None:
        # FOR SHARE: a node taking the lease over waits for this batch to commit,
        # and this batch sees the take-over if it committed first.
        row = conn.query_one(
            "SELECT holder, epoch, pg_current_xact_id()::text FROM fence_lease FOR SHARE"
        )
        assert row is not None
        seen.append(int(row[2]))
        if (row[0], int(row[1])) != (node, epoch):
            raise LeaseLost(f"node {node} lost its lease (epoch {epoch})")

    return fence


def _raise_epoch(conn: Conn) -> None:
    conn.execute("UPDATE fence_lease SET epoch = 9")


def test_the_fence_runs_in_the_batch_transaction_and_a_taken_lease_stops_a_node(
    pg_dsn: str,
) -> None:
    signer = Signer.generate("test.local")
    store_a, store_b = open_store(pg_dsn, create=True), open_store(pg_dsn)
    a = Ledger(store_a, signer, "test.local")
    b = Ledger(store_b, signer, "test.local")
    try:
        with store_a.write() as conn:
            conn.execute("CREATE TABLE fence_lease (holder TEXT NOT NULL, epoch BIGINT NOT NULL)")
            conn.execute("INSERT INTO fence_lease VALUES ('a', 1)")
        a.create_log("acme", draft(0))
        seen_a: list[int] = []
        seen_b: list[int] = []
        a.set_fence(_lease_fence("a", 1, seen_a))
        b.set_fence(_lease_fence("b", 2, seen_b))

        # The fence's transaction is the one that inserted the batch's rows.
        done = a.append_many("acme", [draft(i) for i in range(1, 6)])
        with store_a.read() as conn:
            xmins = {
                int(r[0])
                for r in conn.query(
                    "SELECT xmin::text FROM ledger_entries WHERE log = 'acme' AND seq >= 1"
                )
            }
        assert xmins and xmins <= {x % 2**32 for x in seen_a}
        assert [x.seq for x in done] == [1, 2, 3, 4, 5]
        with pytest.raises(LeaseLost):
            b.append("acme", draft(99))

        # Node b takes the lease over: a's appends fail, every path, and b's go on.
        with store_b.write() as conn:
            conn.execute("UPDATE fence_lease SET holder = 'b', epoch = 2")
        size = a.head("acme").size
        with pytest.raises(LeaseLost):
            a.append("acme", draft(6))
        with pytest.raises(LeaseLost):
            a.append("acme", draft(7), hook=_raise_epoch)

        async def queued() -> list[object]:
            return list(
                await asyncio.gather(
                    a.append_async("acme", draft(8)),
                    a.append_later("acme", draft(9)),
                    return_exceptions=True,
                )
            )

        assert [type(r) for r in asyncio.run(queued())] == [LeaseLost, LeaseLost]
        a.flush()
        assert a.head("acme").size == size
        with store_a.read() as conn:
            assert conn.query("SELECT holder, epoch FROM fence_lease") == [("b", 2)]
        assert [x.seq for x in b.append_many("acme", [draft(10), draft(11)])] == [6, 7]

        events = list(a.entries("acme"))
        report = a.verify("acme")
        assert report.size == len(events) == 8
        for old, new in itertools.pairwise([s for s, _, _ in a.checkpoints("acme")]):
            if old:
                a.consistency_proof("acme", old, new)
    finally:
        a.close()
        b.close()
        store_a.close()
        store_b.close()
