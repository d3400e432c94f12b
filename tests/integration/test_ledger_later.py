"""Events nobody waits on (``Ledger.append_later``: a call's completion record,
queued after its answer went out) share the next commit that somebody waits on,
keep their place in the log, and are never lost to a quiet ledger or a close."""

from __future__ import annotations

import asyncio
import json

from proctor.ledger import Ledger
from tests.conftest import LedgerEnv, draft


def _checkpoint_sizes(env: LedgerEnv) -> list[int]:
    with env.store.read() as conn:
        rows = conn.query("SELECT size FROM ledger_checkpoints WHERE log = 'acme' ORDER BY size")
    return [int(r[0]) for r in rows]


def test_a_later_event_commits_with_the_next_awaited_one_in_one_batch(
    ledger_env: LedgerEnv,
) -> None:
    ledger_env.ledger.create_log("acme", draft(0))

    async def go() -> tuple[int, int]:
        later = ledger_env.ledger.append_later("acme", draft(1))
        awaited = await ledger_env.ledger.append_async("acme", draft(2))
        return (await later).seq, awaited.seq

    later_seq, awaited_seq = asyncio.run(go())
    # In the order queued, and one checkpoint (one commit) for both.
    assert (later_seq, awaited_seq) == (1, 2)
    assert _checkpoint_sizes(ledger_env) == [1, 3]
    assert [json.loads(e)["details"]["i"] for e in ledger_env.ledger.entries("acme")] == [0, 1, 2]


def test_a_later_event_alone_is_committed_after_the_linger(ledger_env: LedgerEnv) -> None:
    ledger_env.ledger.create_log("acme", draft(0))

    async def go() -> int:
        return (await asyncio.wait_for(ledger_env.ledger.append_later("acme", draft(1)), 5)).seq

    assert asyncio.run(go()) == 1
    assert _checkpoint_sizes(ledger_env) == [1, 2]


def test_closing_the_ledger_commits_a_queued_later_event(ledger_env: LedgerEnv) -> None:
    # A linger far longer than the test: only the close can end it.
    ledger = Ledger(ledger_env.store, ledger_env.signer, "test.local", linger=600)
    ledger.create_log("acme", draft(0))

    async def go() -> None:
        ledger.append_later("acme", draft(1))
        await asyncio.sleep(0.05)  # the writer is waiting on the linger now
        await asyncio.to_thread(ledger.close)

    asyncio.run(go())
    reopened = Ledger(ledger_env.store, ledger_env.signer, "test.local")
    try:
        assert [json.loads(e)["details"]["i"] for e in reopened.entries("acme")] == [0, 1]
        assert reopened.verify("acme").size == 2  # raises on any mismatch
    finally:
        reopened.close()


def test_flush_returns_once_a_later_event_is_committed(ledger_env: LedgerEnv) -> None:
    ledger = Ledger(ledger_env.store, ledger_env.signer, "test.local", linger=600)
    ledger.create_log("acme", draft(0))
    try:

        async def go() -> None:
            later = ledger.append_later("acme", draft(1))
            await asyncio.to_thread(ledger.flush)
            # Committed by the flush, not by the ten-minute linger; the future
            # settles on this loop.
            assert (await asyncio.wait_for(later, 5)).seq == 1

        asyncio.run(go())
        assert [json.loads(e)["details"]["i"] for e in ledger.entries("acme")] == [0, 1]
    finally:
        ledger.close()
