"""Several runtime nodes (processes) on one PostgreSQL, appending to one tenant log.

One sequencer at a time per log (an advisory lock held for the batch's
transaction): whichever node commits, the log has no gap and no duplicate
sequence number, every checkpoint is consistent with every other, and a node
killed mid-batch loses nothing it acknowledged and blocks nobody.
"""

from __future__ import annotations

import itertools
import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from proctor.ledger import Ledger, Signer, open_checkpoint, verify_consistency
from proctor.store import open_store
from tests.conftest import draft

pytestmark = pytest.mark.postgres

CHILD = Path(__file__).with_name("node_child.py")


def _start(dsn: str, key: Path, node: str, count: int, threads: int) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, str(CHILD), dsn, str(key), node, str(count), str(threads)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


def _acks(out: bytes, acked: dict[int, str]) -> None:
    for line in out.decode().splitlines():
        if line.count(" ") == 1 and line[0].isdigit():
            seq, k = line.split(" ")
            assert int(seq) not in acked, f"sequence number {seq} was acknowledged twice"
            acked[int(seq)] = k


def test_three_nodes_one_log_one_killed_mid_batch(pg_dsn: str, tmp_path: Path) -> None:
    key = tmp_path / "key.pem"
    signer = Signer.generate("test.local")
    signer.save(key)
    store = open_store(pg_dsn, create=True)
    ledger = Ledger(store, signer, "test.local")
    ledger.create_log("acme", draft(0))
    ledger.close()
    store.close()

    count = 4000
    procs = {n: _start(pg_dsn, key, n, count, 16) for n in ("a", "b", "c")}
    for proc in procs.values():
        assert proc.stdout is not None
        assert proc.stdout.readline() == b"ready\n"
    # Node b's acknowledgements are read as they come, so that it is killed
    # while it is appending (its writer is then inside a batch's transaction).
    b_out: list[bytes] = []
    b = procs["b"]
    assert b.stdout is not None
    first = b.stdout.readline()
    b_out.append(first)
    reader = threading.Thread(target=lambda: b_out.extend(iter(b.stdout.readline, b"")))  # type: ignore[union-attr]
    reader.start()
    time.sleep(0.4)
    b.send_signal(signal.SIGKILL)
    b.wait(30)
    reader.join(30)
    assert b.returncode == -signal.SIGKILL

    acked: dict[int, str] = {}
    _acks(b"".join(b_out), acked)
    killed_acks = len(acked)
    assert 0 < killed_acks < count, "node b should have been killed while appending"
    for n in ("a", "c"):
        out, err = procs[n].communicate(timeout=120)
        assert procs[n].returncode == 0, err.decode()
        assert out.endswith(b"done\n"), err.decode()
        _acks(out, acked)

    store = open_store(pg_dsn)
    ledger = Ledger(store, signer, "test.local")
    try:
        report = ledger.verify("acme")
        events = [json.loads(e) for e in ledger.entries("acme")]
        with store.read() as conn:
            seqs = [
                int(r[0])
                for r in conn.query(
                    "SELECT seq FROM ledger_entries WHERE log = ? ORDER BY seq", ("acme",)
                )
            ]
        assert seqs == list(range(report.size)), "sequence numbers are dense"
        assert report.size == len(events) >= 1 + 2 * count + killed_acks
        for seq, k in acked.items():
            assert events[seq]["details"]["k"] == k, f"acknowledged append {k} is not at {seq}"
        keys = [e["details"].get("k") for e in events[1:]]
        assert len(keys) == len(set(keys)), "no event was written twice"
        # Every node's batches interleave in one tree: consecutive checkpoints,
        # whoever signed them, are proven consistent with each other.
        cps = [
            open_checkpoint(note, signer.verifier, ledger.origin("acme"))
            for _, _, note in ledger.checkpoints("acme")
        ]
        assert len(cps) > 20
        for old, new in itertools.pairwise(cps):
            if old.size:
                proof = ledger.consistency_proof("acme", old.size, new.size)
                verify_consistency(old.size, new.size, old.root, new.root, proof.hashes)
        # The killed node's transaction was rolled back and its lock released.
        assert ledger.append("acme", draft(1)).seq == report.size
    finally:
        ledger.close()
        store.close()


def test_nodes_opening_a_new_database_at_once_migrate_it_once(pg_dsn: str) -> None:
    errors: list[BaseException] = []

    def node() -> None:
        try:
            open_store(pg_dsn, create=True).close()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=node) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    store = open_store(pg_dsn)
    try:
        from proctor.store._pg_migrations import POSTGRES_MIGRATIONS

        assert store.schema_version() == len(POSTGRES_MIGRATIONS)
        with store.read() as conn:
            assert conn.query("SELECT version FROM schema_migrations ORDER BY version") == [
                (v,) for v in range(1, len(POSTGRES_MIGRATIONS) + 1)
            ]
    finally:
        store.close()
