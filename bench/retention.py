"""Retention: what a prune costs, and what pruned entries cost verification.

A tenant log of N events written a day at a time over a year (back-dated through
the ledger's clock), on a real SQLite file (WAL, synchronous=FULL): the time of
one ``Retention.prune`` that rewrites the entries past a 183-day period as markers
(with their ``retention.prune`` events, one per 20,000 markers), and of
``verify_log`` over the whole log before and after. Then one erasure of a key read
by every day's events (each with a 10-key lineage object).

    python bench/retention.py [N]
"""

from __future__ import annotations

import sys
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

from proctor.governance import Retention, erase_key, record_key_hmac
from proctor.ledger import Actor, EventDraft, Ledger, Signer, lineage_object
from proctor.store import open_store

OP = Actor("operator", "bench")


def main(n: int) -> None:
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
        t = time.perf_counter()
        result = ret.prune("acme", OP)
        p = time.perf_counter() - t
        t = time.perf_counter()
        report = ledger.verify("acme")
        v1 = time.perf_counter() - t
        t = time.perf_counter()
        erased = erase_key(store, ledger, "acme", "crm", record_key_hmac(lkey, "25"), "DSR-1", OP)
        e = time.perf_counter() - t
        print(
            f"log of {size} events over a year; {result.pruned} pruned in {p:.2f} s "
            f"({len(result.events)} prune events); verify {v0:.2f} s before, {v1:.2f} s after "
            f"({report.pruned} pruned entries checked); erasure of one key from "
            f"{erased.objects} objects of {erased.events} events: {e:.2f} s"
        )
        ledger.close()
        store.close()


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 7_300)
