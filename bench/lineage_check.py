"""What `audit verify` pays to hold the lineage record to the signed log.

``governance.check_lineage_record`` reads every lineage event, every object and the
whole key index (sorted by event) once: each object held to its event, each erased
entry to the erasure that lists it, the index to the objects' kept keys. This
builds a tenant of N reads of R rows each on a real SQLite file (and, with
``--pg``, on a throwaway PostgreSQL server), erases K keys, and times the check
against ``Ledger.verify`` of the same log.

    python bench/lineage_check.py [--reads 50] [--rows 10000] [--erase 20] [--pg]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

from proctor.governance import erase_key
from proctor.governance._erasure import check_lineage_record
from proctor.ledger import Actor, EventDraft, Ledger, Signer, keyed_hash, lineage_object
from proctor.store import Store, open_store

T = "acme"
OP = Actor("operator", "bench")
LKEY = os.urandom(32)


def build(store: Store, reads: int, rows: int, erase: int) -> Ledger:
    ledger = Ledger(store, Signer.generate("bench.local"), "bench.local")
    with store.write() as conn:
        conn.execute("INSERT INTO tenants (name, created_at, created_by) VALUES (?, 'now', 'b')",
                     (T,))  # fmt: skip
    ledger.create_log(T, EventDraft(OP, "tenant.create", f"tenant/{T}"))
    for i in range(reads):
        start = i * rows // 2  # neighbouring reads overlap by half
        obj, ref = lineage_object(keyed_hash(LKEY, str(k)) for k in range(start, start + rows))
        ledger.append(T, EventDraft(Actor("workload", f"r{i}"), "sql.select", "table/t",
                                    objects=(obj,),
                                    details={"dataset": "crm", "lineage_object": ref}))  # fmt: skip
    for k in range(erase):
        key = keyed_hash(LKEY, str(k * rows // max(erase, 1) + rows // 2))
        erase_key(store, ledger, T, "crm", key, f"DSR-{k}", OP)
    return ledger


def measure(store: Store, label: str, reads: int, rows: int, erase: int) -> None:
    ledger = build(store, reads, rows, erase)
    t0 = time.perf_counter()
    ledger.verify(T)
    t1 = time.perf_counter()
    check = check_lineage_record(store, T)
    t2 = time.perf_counter()
    assert check.problems == [], check.problems[:3]
    print(f"{label}: {reads} reads x {rows} rows, {check.erasures} erasures, "
          f"{check.index_rows} index rows: verify_log {t1 - t0:.2f} s, "
          f"check_lineage_record {t2 - t1:.2f} s")  # fmt: skip
    ledger.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reads", type=int, default=50)
    ap.add_argument("--rows", type=int, default=10_000)
    ap.add_argument("--erase", type=int, default=20)
    ap.add_argument("--pg", action="store_true")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        store = open_store(str(Path(tmp) / "bench.db"), create=True)
        measure(store, "SQLite", a.reads, a.rows, a.erase)
        store.close()
    if a.pg:
        from proctor.testing import PostgresServer

        server = PostgresServer(durable=False)
        server.start()
        try:
            store = open_store(server.create_database("bench_lineage_check"), create=True)
            measure(store, "PostgreSQL", a.reads, a.rows, a.erase)
            store.close()
        finally:
            server.stop()


if __name__ == "__main__":
    main()
