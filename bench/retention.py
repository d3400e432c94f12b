"""Retention: what a prune costs, and what pruned entries cost verification.

A tenant log of N events written a day at a time over a year (back-dated through
the ledger's clock), on a real SQLite file (WAL, synchronous=FULL): the time of
one ``Retention.prune`` that rewrites the entries past a 183-day period as markers
(with their ``retention.prune`` events, one per 20,000 markers), and of
``verify_log`` over the whole log before and after. Then one erasure of a key read
by every day's events (each with a 10-key lineage object).

The prune goes by each event's signed time (its bytes parsed, its leaf hash held to
the level-0 tile) and walks the log in seq order up to the first event signed at or
after the cut-off. Wall and CPU (this process) seconds are printed; with R repeats
(each on a fresh log) the median of each figure.

    python bench/retention.py [N] [R]
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

from proctor.governance import Retention, erase_key, record_key_hmac
from proctor.ledger import Actor, EventDraft, Ledger, Signer, lineage_object
from proctor.store import open_store

OP = Actor("operator", "bench")


def once(n: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        store = open_store(str(Path(tmp) / "p.db"), create=True)
        now = [datetime(2025, 1, 1, tzinfo=UTC)]
        ledger = Ledger(
            store,
            Signer.generate("bench.local"),
            "bench.local",
            clock=lambda: now[0].strftime("%Y-%m-%dT%H:%M:%S.%fZ"),
        )
        with store.write() as conn:
            conn.execute(
                "INSERT INTO tenants (name, created_at, created_by) VALUES ('acme', 'x', 'bench')"
            )
        ledger.create_log("acme", EventDraft(OP, "tenant.create", "tenant/acme"))
        per_day = max(1, n // 365)
        lkey = b"\x01" * 32
        for day in range(365):
            now[0] = datetime(2025, 1, 1, tzinfo=UTC) + timedelta(days=day)
            drafts = []
            for i in range(per_day):
                run = f"run-{day}-{i}"
                obj, ref = lineage_object(record_key_hmac(lkey, str(k)) for k in range(i, i + 10))
                drafts.append(
                    EventDraft(
                        Actor("workload", run),
                        "sql.select",
                        "table/t",
                        run=run,
                        objects=(obj,),
                        details={"dataset": "crm", "lineage_object": ref},
                    )
                )
            ledger.append_many("acme", drafts)
        now[0] = datetime(2026, 1, 2, tzinfo=UTC)
        size = ledger.head("acme").size
        t = time.perf_counter()
        ledger.verify("acme")
        v0 = time.perf_counter() - t
        ret = Retention(store, ledger)
        ret.set("acme", 183, OP)
        t, c = time.perf_counter(), time.process_time()
        result = ret.prune("acme", OP)
        p, pc = time.perf_counter() - t, time.process_time() - c
        assert result.pruned and not result.misdated and not result.unverified
        t = time.perf_counter()
        report = ledger.verify("acme")
        v1 = time.perf_counter() - t
        t = time.perf_counter()
        erased = erase_key(store, ledger, "acme", "crm", record_key_hmac(lkey, "25"), "DSR-1", OP)
        e = time.perf_counter() - t
        figures = {"size": size, "pruned": result.pruned, "prune_events": len(result.events),
                   "prune": p, "prune_cpu": pc, "verify_before": v0, "verify_after": v1,
                   "checked": report.pruned, "erased_objects": erased.objects,
                   "erased_events": erased.events, "erase": e}  # fmt: skip
        ledger.close()
        store.close()
    return figures


def main(n: int, repeat: int) -> None:
    runs = [once(n) for _ in range(repeat)]
    f = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    print(
        f"log of {f['size']:.0f} events over a year; {f['pruned']:.0f} pruned in"
        f" {f['prune']:.2f} s ({f['prune_cpu']:.2f} s CPU; {f['prune_events']:.0f} prune"
        f" events); verify {f['verify_before']:.2f} s before, {f['verify_after']:.2f} s after"
        f" ({f['checked']:.0f} pruned entries checked); erasure of one key from"
        f" {f['erased_objects']:.0f} objects of {f['erased_events']:.0f} events:"
        f" {f['erase']:.2f} s" + (f" (median of {repeat})" if repeat > 1 else "")
    )


if __name__ == "__main__":
    main(
        int(sys.argv[1]) if len(sys.argv) > 1 else 7_300,
        int(sys.argv[2]) if len(sys.argv) > 2 else 1,
    )
