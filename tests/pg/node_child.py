"""One runtime node: appends to one tenant log on PostgreSQL from several threads.

Run by test_pg_nodes.py: ``python node_child.py DSN KEY_PEM NODE COUNT THREADS``.
Prints ``ready``, then ``seq key`` for every acknowledged append, then ``done``.
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path

from proctor.errors import ProctorError
from proctor.ledger import Actor, EventDraft, Ledger, Signer
from proctor.store import open_store


def main() -> None:
    dsn, key, node = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
    count, threads = int(sys.argv[4]), int(sys.argv[5])
    store = open_store(dsn)
    ledger = Ledger(store, Signer.load("test.local", key), "test.local")
    out_lock = threading.Lock()
    actor = Actor("operator", f"node-{node}")
    failed = []

    def worker(w: int) -> None:
        for i in range(w, count, threads):
            k = f"{node}-{i}"
            try:
                a = ledger.append("acme", EventDraft(actor, "test.event", "r", details={"k": k}))
            except ProctorError as exc:
                failed.append(exc)
                print(f"error {exc}", file=sys.stderr, flush=True)
                return
            with out_lock:
                sys.stdout.write(f"{a.seq} {k}\n")
                sys.stdout.flush()

    sys.stdout.write("ready\n")
    sys.stdout.flush()
    ts = [threading.Thread(target=worker, args=(w,), daemon=True) for w in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    ledger.close()
    store.close()
    sys.stdout.write("done\n" if not failed else "failed\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
