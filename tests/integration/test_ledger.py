"""The ledger on real stores (SQLite files, PostgreSQL): proofs, concurrency, hooks,
durability failures."""

from __future__ import annotations

import json
import os
import subprocess
import threading
from pathlib import Path

import pytest

from proctor.errors import AlreadyExists, LedgerError, NotFound, UsageError
from proctor.ledger import (
    EventDraft,
    Ledger,
    leaf_hash,
    open_checkpoint,
    verify_consistency,
    verify_export,
    verify_inclusion,
)
from proctor.store import Conn, open_store
from tests.conftest import OPERATOR, LedgerEnv, draft
from tests.unit.test_merkle import ref_mth, ref_root_from_path, ref_roots_from_consistency


def _build(env: LedgerEnv, n: int, log: str = "acme") -> list[bytes]:
    env.ledger.create_log(log, draft(0))
    for i in range(1, n):
        env.ledger.append(log, draft(i))
    return list(env.ledger.entries(log))


def test_proofs_for_every_index_of_trees_1_to_300(ledger_env: LedgerEnv) -> None:
    """Every (index, size) for sizes 1..300, from stored tiles, checked independently."""
    events = _build(ledger_env, 300)
    leaves = [leaf_hash(e) for e in events]
    ledger = ledger_env.ledger
    roots = {}
    for size, _, note in ledger.checkpoints("acme"):
        cp = open_checkpoint(note, ledger_env.signer.verifier, ledger.origin("acme"))
        roots[size] = cp.root
    assert sorted(roots) == list(range(1, 301))  # one signed checkpoint per batch
    # Every index of the sizes where the stored tiles change shape (small trees, the
    # first full tile and level 1, the end) and of every 5th size on SQLite, every
    # 10th on PostgreSQL (the proofs are engine-independent code); `make soak` checks
    # every size.
    step = 5 if ledger_env.url == str(ledger_env.path) else 10
    sizes = sorted({*range(1, 18), *range(250, 262), *range(295, 301), *range(step, 301, step)})
    if os.environ.get("PROCTOR_SOAK") == "1":
        sizes = list(range(1, 301))
    for size in sizes:
        root = roots[size]
        assert root == ref_mth(events[:size])
        for index in range(size):
            p = ledger.inclusion_proof("acme", index, size)
            assert p.leaf_hash == leaves[index]
            assert ref_root_from_path(index, size, leaves[index], list(p.hashes)) == root
            verify_inclusion(index, size, leaves[index], p.hashes, root)


def test_consistency_proofs_between_every_pair_up_to_300(ledger_env: LedgerEnv) -> None:
    events = _build(ledger_env, 300)
    roots = [b""] + [ref_mth(events[:n]) for n in range(1, 301)]
    for new in range(1, 301, 7):
        for old in range(1, new + 1):
            p = ledger_env.ledger.consistency_proof("acme", old, new)
            if old < new:
                got = ref_roots_from_consistency(old, new, list(p.hashes), True, roots[old])
                assert got == (roots[old], roots[new])
            verify_consistency(old, new, roots[old], roots[new], p.hashes)


def test_large_tree_uses_higher_tile_levels(ledger_env: LedgerEnv) -> None:
    """66,000 leaves need level-2 tiles (256^2 = 65,536); proofs still verify."""
    n = 66_000
    ledger = ledger_env.ledger
    ledger.create_log("big", draft(0))

    # Concurrent batches (a commit per batch, not per event): the tile levels are the
    # point here; test_concurrent_appends_are_dense_and_each_acknowledged covers
    # one-event appends racing.
    def worker(k: int) -> None:
        for start in range(1 + 64 * k, n, 64 * 16):
            ledger.append_many("big", [draft(i) for i in range(start, min(start + 64, n))])

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    head = ledger.head("big")
    assert head.size == n
    assert ledger.tile("big", 2, 0), "a level-2 tile was written"
    events = list(ledger.entries("big"))
    for index in (0, 255, 256, 65_535, 65_536, n - 1):
        p = ledger.inclusion_proof("big", index)
        verify_inclusion(index, n, leaf_hash(events[index]), p.hashes, head.root)
    for old in (1, 256, 65_536, 65_537, n - 1):
        p = ledger.consistency_proof("big", old)
        verify_consistency(old, n, ledger.root_at("big", old), head.root, p.hashes)
    assert ledger.verify("big").size == n


def test_concurrent_appends_are_dense_and_each_acknowledged(ledger_env: LedgerEnv) -> None:
    ledger = ledger_env.ledger
    ledger.create_log("acme", draft(0))
    acks: dict[str, int] = {}
    lock = threading.Lock()

    def worker(w: int) -> None:
        for i in range(100):
            a = ledger.append("acme", draft(i, worker=w))
            with lock:
                acks[f"{w}-{i}"] = a.seq

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    events = [json.loads(e) for e in ledger.entries("acme")]
    assert [e["seq"] for e in events] == list(range(3201))
    for key, seq in acks.items():
        w, i = key.split("-")
        assert events[seq]["details"] == {"i": int(i), "worker": int(w)}
    # Group commit: far fewer checkpoints (batches) than events.
    assert len(ledger.checkpoints("acme")) < 3201
    ledger.verify("acme")


def test_checkpoints_are_consistent_with_each_other(ledger_env: LedgerEnv) -> None:
    _build(ledger_env, 40)
    ledger = ledger_env.ledger
    cps = [open_checkpoint(n, ledger_env.signer.verifier) for _, _, n in ledger.checkpoints("acme")]
    last = cps[-1]
    for cp in cps[:-1]:
        if cp.size == 0:
            continue
        p = ledger.consistency_proof("acme", cp.size, last.size)
        verify_consistency(cp.size, last.size, cp.root, last.root, p.hashes)


def test_hook_commits_with_its_event_or_not_at_all(ledger_env: LedgerEnv) -> None:
    ledger = ledger_env.ledger
    ledger.create_log("acme", draft(0))
    with ledger_env.store.write() as conn:
        conn.execute("INSERT INTO meta (key, value) VALUES ('x', '0')")

    def ok(conn: Conn) -> None:
        conn.execute("UPDATE meta SET value = '1' WHERE key = 'x'")

    def refuse(conn: Conn) -> None:
        conn.execute("UPDATE meta SET value = '2' WHERE key = 'x'")
        raise AlreadyExists("refused by the hook")

    a = ledger.append("acme", draft(1), hook=ok)
    with pytest.raises(AlreadyExists):
        ledger.append("acme", draft(2), hook=refuse)
    b = ledger.append("acme", draft(3))
    assert b.seq == a.seq + 1, "a refused hook consumes no sequence number"
    with ledger_env.store.read() as conn:
        assert conn.query_one("SELECT value FROM meta WHERE key = 'x'") == ("1",)
    ledger.verify("acme")


def test_unknown_log_and_duplicate_create_are_refused(ledger_env: LedgerEnv) -> None:
    ledger = ledger_env.ledger
    with pytest.raises(NotFound):
        ledger.append("nobody", draft(0))
    ledger.create_log("acme", draft(0))
    with pytest.raises(AlreadyExists):
        ledger.create_log("acme", draft(1))
    with pytest.raises(UsageError):
        ledger.inclusion_proof("acme", 1)
    with pytest.raises(UsageError):
        ledger.consistency_proof("acme", 2)
    assert ledger.head("acme").size == 1


def test_state_survives_reopen_and_other_writers(ledger_env: LedgerEnv) -> None:
    _build(ledger_env, 700)
    env = ledger_env.reopen()
    try:
        # A second ledger object on the same file plays the part of another process.
        other = Ledger(open_store(env.url), env.signer, "test.local")
        for i in range(300):
            (env.ledger if i % 2 else other).append("acme", draft(1000 + i))
        other.close()
        assert env.ledger.verify("acme").size == 1000
    finally:
        env.ledger.close()
        env.store.close()


def test_export_verifies_offline(ledger_env: LedgerEnv, tmp_path: Path) -> None:
    _build(ledger_env, 600)
    out = tmp_path / "export"
    head = ledger_env.ledger.export("acme", out)
    assert (out / "tile/0/001").is_file()
    assert (out / "tile/0/002.p/88").is_file()
    assert (out / "tile/1/000.p/2").is_file()
    assert (out / "checkpoint").read_text() == head.checkpoint
    report = verify_export(out, ledger_env.signer.verifier)
    assert (report.size, report.root) == (600, head.root)
    with pytest.raises(UsageError):
        ledger_env.ledger.export("acme", out)


@pytest.fixture
def tiny_fs(tmp_path: Path):  # type: ignore[no-untyped-def]
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], check=False)
    if r.returncode != 0:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


@pytest.mark.host
def test_full_disk_fails_closed_and_recovers(tiny_fs: Path) -> None:
    """A real ENOSPC: appends raise LedgerError, nothing half-written; once space is
    freed, appends go on and the log verifies."""
    from proctor.ledger import Signer

    ballast = tiny_fs / "ballast"
    ballast.write_bytes(b"\0" * 300_000)
    store = open_store(str(tiny_fs / "p.db"), create=True)
    ledger = Ledger(store, Signer.generate("test.local"), "test.local")
    ledger.create_log("acme", draft(0))
    big = "x" * 15_000  # under MAX_EVENT_BYTES: the disk, not the bound, refuses
    acked = 1
    with pytest.raises(LedgerError, match="durably"):
        for i in range(1000):
            ledger.append("acme", EventDraft(OPERATOR, "test.event", "r", details={"p": big}))
            acked += 1
            assert i < 999, "a 1 MB disk never filled"
    assert ledger.head("acme").size == acked
    ballast.unlink()
    after = ledger.append("acme", draft(1))
    assert after.seq == acked, "the refused append consumed no sequence number"
    assert ledger.verify("acme").size == acked + 1
    ledger.close()
    store.close()


def test_async_appends_share_batches_and_are_durable(ledger_env: LedgerEnv) -> None:
    import asyncio

    ledger = ledger_env.ledger
    ledger.create_log("acme", draft(0))

    async def main() -> list[int]:
        results = await asyncio.gather(*(ledger.append_async("acme", draft(i)) for i in range(500)))
        with pytest.raises(NotFound):
            await ledger.append_async("nobody", draft(0))
        return [r.seq for r in results]

    seqs = asyncio.run(main())
    assert sorted(seqs) == list(range(1, 501))
    assert len(ledger.checkpoints("acme")) < 100, "500 concurrent appends were group-committed"
    assert ledger.verify("acme").size == 501


def test_the_sqlite_store_closes_the_readers_of_ended_threads(tmp_path: Path) -> None:
    from proctor.store import open_store

    store = open_store(str(tmp_path / "fds.db"), create=True)
    try:

        def read() -> None:
            with store.read() as conn:
                conn.query_one("SELECT 1")

        read()

        def fds() -> int:
            return len(os.listdir("/proc/self/fd"))

        before = fds()
        for _ in range(50):
            t = threading.Thread(target=read)
            t.start()
            t.join()
        # The next connection to open closes those of the threads that ended.
        t = threading.Thread(target=read)
        t.start()
        t.join()
        # One reader (the last thread's: database, WAL and shared memory) may remain.
        assert fds() <= before + 3, "readers of ended threads keep their descriptors"
    finally:
        store.close()
