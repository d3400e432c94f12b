"""Appends under load until killed; prints ``seq key`` for every acknowledged append.

Run by test_ledger_crash.py: ``python crash_child.py DB KEY_PEM RUN_ID``.
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path

from proctor.errors import ProctorError
from proctor.ledger import Actor, EventDraft, Ledger, Signer
from proctor.store import open_store


def main() -> None:
    db, key, run = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
    store = open_store(db)
    ledger = Ledger(store, Signer.load("test.local", key), "test.local")
    out_lock = threading.Lock()
    actor = Actor("operator", "crash-child")

    def worker(w: int) -> None:
        i = 0
        while True:
            k = f"{run}-{w}-{i}"
            try:
                a = ledger.append("acme", EventDraft(actor, "test.event", "r", details={"k": k}))
            except ProctorError as exc:
                print(f"error {exc}", file=sys.stderr, flush=True)
                return
            with out_lock:
                sys.stdout.write(f"{a.seq} {k}\n")
                sys.stdout.flush()
            i += 1

    sys.stdout.write("ready\n")
    sys.stdout.flush()
    threads = [threading.Thread(target=worker, args=(w,), daemon=True) for w in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


if __name__ == "__main__":
    main()
