"""SIGKILL a process mid-append, many times: every acknowledged event survives."""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

from proctor.ledger import Ledger, Signer
from proctor.store import open_store
from tests.conftest import draft

CHILD = Path(__file__).with_name("crash_child.py")


def test_sigkill_under_load_loses_no_acknowledged_append(tmp_path: Path) -> None:
    db, key = tmp_path / "p.db", tmp_path / "key.pem"
    signer = Signer.generate("test.local")
    signer.save(key)
    store = open_store(str(db), create=True)
    ledger = Ledger(store, signer, "test.local")
    ledger.create_log("acme", draft(0))
    ledger.close()
    store.close()

    rng = random.Random(20261202)
    acked: dict[int, str] = {}
    for run in range(15):
        proc = subprocess.Popen(
            [sys.executable, str(CHILD), str(db), str(key), f"r{run}"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        assert proc.stdout is not None
        assert proc.stdout.readline() == b"ready\n"
        time.sleep(rng.uniform(0.02, 0.5))
        proc.send_signal(signal.SIGKILL)
        out, err = proc.communicate()
        assert proc.returncode == -signal.SIGKILL
        assert b"error" not in err, err.decode()
        for line in out.decode().splitlines():
            if line.count(" ") == 1 and line.endswith(tuple("0123456789")):
                seq, k = line.split(" ")
                assert int(seq) not in acked, "a sequence number was acknowledged twice"
                acked[int(seq)] = k
    assert len(acked) > 100, "the child should have been killed under load"

    store = open_store(str(db))
    ledger = Ledger(store, signer, "test.local")
    try:
        report = ledger.verify("acme")
        events = [json.loads(e) for e in ledger.entries("acme")]
        assert report.size == len(events)
        for seq, k in acked.items():
            assert events[seq]["details"]["k"] == k
        # After all the crashes the log still takes appends.
        assert ledger.append("acme", draft(1)).seq == report.size
    finally:
        ledger.close()
        store.close()
