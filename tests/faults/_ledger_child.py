"""A ledger workload in its own process, for fault injection from outside.

Run by test_io_inject.py with the ``iofail`` shim preloaded:
``python _ledger_child.py DB KEY_PEM AFTER`` where AFTER is ``continue`` (keep
appending after the fault) or ``crash`` (``os._exit`` as soon as the faulted
batch has been refused, leaving the store exactly as the fault left it).

Three phases, every append reported on stdout as one JSON line
``{"phase", "k", "ok", "seq", "leaf", "error"}``:

1. ``before``: concurrent appends, the fault disarmed.
2. ``fault``: one batch built on purpose. A first append's hook holds the
   writer inside its transaction while FAULT_BATCH appends queue up behind it,
   so those all land in the next batch; one of them carries a hook that arms
   the shim (``iofail_arm``) from inside that batch's transaction, so the
   armed write or fsync is that batch's own commit and nothing else's.
3. ``after``: concurrent appends again (AFTER=continue only).

The last line is ``{"done": …}`` with how many faults the shim injected and,
in the same process, the log's size and whether it verifies.

``python _ledger_child.py tenant HOME`` instead creates tenant ``globex`` in
the runtime at HOME with the fault armed inside the creation's transaction
(the tenant's row, its log's event 0 and the system log's record of it), and
reports the outcome as ``{"done", "hits", "create"}``.
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

from proctor.errors import LedgerError, ProctorError
from proctor.ledger import Actor, EventDraft, Ledger, Signer
from proctor.store import Conn, open_store

LOG = "acme"
FAULT_BATCH = 24
ACTOR = Actor("operator", "fault-child")


def tenant_main(home: Path) -> None:
    from proctor.runtime import Runtime

    shim = ctypes.CDLL(os.environ["IOFAIL_LIB"])
    rt = Runtime.open(home)
    create_log = rt.ledger.create_log

    def create_log_armed(log: str, first: Any, hook: Any = None, then: Any = None) -> Any:
        def armed(conn: Conn) -> None:
            if hook is not None:
                hook(conn)
            shim.iofail_arm(1)  # this transaction's commit: the whole creation

        return create_log(log, first, hook=armed, then=then)

    rt.ledger.create_log = create_log_armed  # type: ignore[method-assign]
    try:
        rt.tenants.create("globex", rt.operator)
    except ProctorError as exc:
        outcome = f"{type(exc).__name__}: {exc.message}"
    else:
        outcome = "ok"
    sys.stdout.write(json.dumps({"done": True, "hits": shim.iofail_hits(), "create": outcome}))
    sys.stdout.write("\n")
    rt.close()


def main() -> None:
    if sys.argv[1] == "tenant":
        tenant_main(Path(sys.argv[2]))
        return
    db, key, after = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
    nth = int(os.environ.get("IOFAIL_ARM_NTH", "1"))
    shim = ctypes.CDLL(os.environ["IOFAIL_LIB"])  # already loaded by LD_PRELOAD: same copy
    store = open_store(db)
    ledger = Ledger(store, Signer.load("test.local", key), "test.local")
    out_lock = threading.Lock()

    def report(**fields: Any) -> None:
        with out_lock:
            sys.stdout.write(json.dumps(fields, sort_keys=True) + "\n")
            sys.stdout.flush()

    def one(phase: str, k: str, hook: Any = None) -> None:
        draft = EventDraft(ACTOR, "test.event", f"thing/{k}", details={"k": k})
        try:
            a = ledger.append(LOG, draft, hook=hook)
        except LedgerError as exc:
            report(phase=phase, k=k, ok=False, error=f"LedgerError: {exc.message}")
        except ProctorError as exc:  # anything else is a wrong answer: the parent fails
            report(phase=phase, k=k, ok=False, error=f"{type(exc).__name__}: {exc.message}")
        else:
            report(phase=phase, k=k, ok=True, seq=a.seq, leaf=a.leaf_hash.hex(), size=a.size)

    def concurrent(phase: str, threads: int, each: int) -> None:
        def worker(w: int) -> None:
            for i in range(each):
                one(phase, f"{phase}-{w}-{i}")

        ts = [threading.Thread(target=worker, args=(w,)) for w in range(threads)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()

    concurrent("before", 4, 10)

    # The fault batch: hold the writer, queue the batch, arm from inside it.
    holding, release = threading.Event(), threading.Event()

    def hold(conn: Conn) -> None:
        holding.set()
        if not release.wait(30):
            raise LedgerError("the test never released the writer")

    def arm(conn: Conn) -> None:
        shim.iofail_arm(nth)

    blocker = threading.Thread(target=one, args=("hold", "hold-0", hold))
    blocker.start()
    if not holding.wait(30):
        raise SystemExit("the writer never started the holding batch")
    queued = [threading.Thread(target=one, args=("fault", "fault-arm", arm))]
    queued += [
        threading.Thread(target=one, args=("fault", f"fault-{i}")) for i in range(FAULT_BATCH - 1)
    ]
    for t in queued:
        t.start()
    deadline = time.monotonic() + 30
    # Private, but the point: every append of the batch is in the queue.
    while ledger._queue.qsize() < FAULT_BATCH:
        if time.monotonic() > deadline:
            raise SystemExit("the fault batch never queued")
        time.sleep(0.001)
    release.set()
    blocker.join()
    for t in queued:
        t.join()
    hits = int(shim.iofail_hits())
    if after == "crash":
        report(done=True, hits=hits)
        os._exit(0)  # no close, no checkpoint: as if the process died here

    concurrent("after", 4, 10)
    head = ledger.head(LOG)
    verified = ledger.verify(LOG).size
    report(done=True, hits=hits, size=head.size, verified=verified)
    ledger.close()
    store.close()


if __name__ == "__main__":
    main()
