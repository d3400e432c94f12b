"""Lineage objects: what a read's row keys cost at append, and a key lookup.

For reads of 1 to 100,000 rows: the time to build the object (HMACs already made:
dedupe, sort, canonical bytes, SHA-256, Merkle root) and the time of a durable
append that stores it with its key index (``ledger_lineage``, one row per key),
on a real SQLite file (WAL, synchronous=FULL) and, with ``--pg``, on a throwaway
PostgreSQL server; the event's size; then ``lineage_seqs`` for one key.

    python bench/lineage.py [--pg]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

from proctor.ledger import (
    Actor,
    EventDraft,
    Ledger,
    Signer,
    lineage_object,
    lineage_seqs,
)
from proctor.store import Store, open_store

ACTOR = Actor("workload", "spiffe://proctor.local/tenant/acme/deployment/churn/run/r-0001")
SIZES = (1, 10, 1_000, 10_000, 100_000)


def keys(n: int, salt: int) -> list[str]:
    return [os.urandom(16).hex() for _ in range(n)] if salt else [f"{i:032x}" for i in range(n)]


def run(store: Store, label: str) -> None:
    ledger = Ledger(store, Signer.generate("bench.local"), "bench.local")
    ledger.create_log("acme", EventDraft(ACTOR, "tenant.create", "tenant/acme"))
    print(f"\n{label}")
    print(f"{'rows':>8} {'object ms':>10} {'append ms':>10} {'event B':>8} {'object KB':>10}")
    probe = ""
    for n in SIZES:
        builds, appends = [], []
        size = 0
        obj_kb = 0.0
        for rep in range(3):
            hmacs = keys(n, rep + 1)
            t = time.perf_counter()
            obj, ref = lineage_object(hmacs)
            builds.append(time.perf_counter() - t)
            draft = EventDraft(
                ACTOR,
                "sql.select",
                "dataset/crm/table/customers",
                details={"row_count": n, "lineage": "rows", "lineage_object": ref},
                objects=(obj,),
            )
            t = time.perf_counter()
            got = ledger.append("acme", draft)
            appends.append(time.perf_counter() - t)
            size, obj_kb = len(got.event), len(obj.data) / 1024
            probe = hmacs[len(hmacs) // 2]
        print(
            f"{n:>8} {statistics.median(builds) * 1000:>10.1f}"
            f" {statistics.median(appends) * 1000:>10.1f} {size:>8} {obj_kb:>10.1f}"
        )
    t = time.perf_counter()
    for _ in range(100):
        lineage_seqs(store, "acme", probe)
    print(f"lineage_seqs (one key, {sum(SIZES) * 3:,} index rows): "
          f"{(time.perf_counter() - t) * 10:.2f} ms")  # fmt: skip
    ledger.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pg", action="store_true", help="also on a throwaway PostgreSQL")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        store = open_store(str(Path(d) / "bench.db"), create=True)
        run(store, "SQLite")
        store.close()
        if args.pg:
            from proctor.testing import PostgresServer

            with PostgresServer() as pg:
                store = open_store(pg.create_database("bench"), create=True)
                run(store, "PostgreSQL")
                store.close()


if __name__ == "__main__":
    main()
