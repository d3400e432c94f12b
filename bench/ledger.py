"""Ledger figures: durable appends/s, latency, verify time, proof time, bytes/event.

Run with ``make bench`` (or ``python bench/ledger.py [--events N]``). Every run is
on a real SQLite file with WAL and synchronous=FULL, so each batch is fsync'd.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import tempfile
import threading
import time
from pathlib import Path

from proctor.ledger import Actor, EventDraft, Ledger, Signer, leaf_hash, verify_inclusion
from proctor.store import open_store

ACTOR = Actor("workload", "spiffe://proctor.local/tenant/acme/deployment/churn/run/r-0001")


def draft(i: int) -> EventDraft:
    # A realistic broker event: a SQL call with its columns and lineage hash.
    return EventDraft(
        ACTOR,
        "sql.select",
        "dataset/crm/table/customers",
        policies=("deploy:churn:sql:crm.customers",),
        reason="permitted by deploy:churn:sql:crm.customers",
        deployment="churn",
        run="r-0001",
        artifact="sha256:" + "ab" * 32,
        approvals=("apr-1",),
        details={"columns": ["country", "id", "plan"], "rows": 100, "keys_hmac": "cd" * 32, "i": i},
    )


def pct(values: list[float], p: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(len(values) * p))]


def appends(dirpath: Path, writers: int, total: int) -> dict[str, float]:
    store = open_store(str(dirpath / f"w{writers}.db"), create=True)
    ledger = Ledger(store, Signer.generate("bench.local"), "bench.local")
    ledger.create_log("acme", draft(0))
    per = total // writers
    lat: list[list[float]] = [[] for _ in range(writers)]
    drafts = [draft(i) for i in range(per)]
    barrier = threading.Barrier(writers + 1)

    def worker(w: int) -> None:
        out = lat[w]
        barrier.wait()
        for d in drafts:
            t = time.perf_counter()
            ledger.append("acme", d)
            out.append(time.perf_counter() - t)

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(writers)]
    for t in threads:
        t.start()
    barrier.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    dt = time.perf_counter() - t0
    batches = len(ledger.checkpoints("acme"))
    ledger.close()
    store.close()
    all_lat = [x for w in lat for x in w]
    return {
        "writers": writers,
        "events_per_s": per * writers / dt,
        "p50_ms": pct(all_lat, 0.50) * 1000,
        "p99_ms": pct(all_lat, 0.99) * 1000,
        "events_per_batch": per * writers / max(1, batches - 1),
    }


def appends_async(dirpath: Path, writers: int, total: int) -> dict[str, float]:
    """The same, as asyncio tasks on one event loop: how the broker appends."""
    store = open_store(str(dirpath / f"a{writers}.db"), create=True)
    ledger = Ledger(store, Signer.generate("bench.local"), "bench.local")
    ledger.create_log("acme", draft(0))
    per = total // writers
    drafts = [draft(i) for i in range(per)]
    lat: list[float] = []

    async def worker() -> None:
        for d in drafts:
            t = time.perf_counter()
            await ledger.append_async("acme", d)
            lat.append(time.perf_counter() - t)

    async def run_all() -> float:
        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(writers)))
        return time.perf_counter() - t0

    dt = asyncio.run(run_all())
    batches = len(ledger.checkpoints("acme"))
    ledger.close()
    store.close()
    return {
        "writers": writers,
        "events_per_s": per * writers / dt,
        "p50_ms": pct(lat, 0.50) * 1000,
        "p99_ms": pct(lat, 0.99) * 1000,
        "events_per_batch": per * writers / max(1, batches - 1),
    }


def big_log(dirpath: Path, n: int) -> tuple[Path, Signer, float]:
    path = dirpath / "big.db"
    store = open_store(str(path), create=True)
    signer = Signer.generate("bench.local")
    ledger = Ledger(store, signer, "bench.local", max_batch=8192)
    ledger.create_log("acme", draft(0))
    t0 = time.perf_counter()
    chunk = 20_000
    done = 1
    while done < n:
        k = min(chunk, n - done)
        ledger.append_many("acme", [draft(done + i) for i in range(k)])
        done += k
    dt = time.perf_counter() - t0
    ledger.close()
    store.close()
    return path, signer, n / dt


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--events", type=int, default=1_000_000, help="size of the verify log")
    ap.add_argument("--appends", type=int, default=40_000, help="appends per writer run")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="proctor-bench-", dir=os.environ.get("BENCH_DIR")) as d:
        tmp = Path(d)
        print("durable appends (WAL, synchronous=FULL, one fsync per batch)")
        print(f"{'writers':>14} {'events/s':>10} {'p50 ms':>8} {'p99 ms':>8} {'ev/batch':>9}")
        for kind, fn in (("threads", appends), ("asyncio tasks", appends_async)):
            for writers in (1, 8, 64):
                total = args.appends if writers > 1 else min(args.appends, 3_000)
                r = fn(tmp, writers, total)
                print(
                    f"{writers:>3} {kind:>10} {r['events_per_s']:>10,.0f} {r['p50_ms']:>8.2f} "
                    f"{r['p99_ms']:>8.2f} {r['events_per_batch']:>9.1f}"
                )
        n = args.events
        path, signer, rate = big_log(tmp, n)
        size = sum(p.stat().st_size for p in tmp.glob("big.db*"))
        print(f"\nlog of {n:,} events built at {rate:,.0f} events/s (bulk append)")
        print(f"bytes per event on disk: {size / n:,.0f} (store file {size / 1e6:,.0f} MB)")
        store = open_store(str(path))
        ledger = Ledger(store, signer, "bench.local")
        t0 = time.perf_counter()
        report = ledger.verify("acme")
        verify_s = time.perf_counter() - t0
        print(f"full verify of {report.size:,} events: {verify_s:.1f} s")
        head = ledger.head("acme")
        rng = random.Random(1)
        idx = [rng.randrange(n) for _ in range(2000)]
        leaves = {i: leaf_hash(next(ledger.entries("acme", i, i + 1))) for i in idx[:200]}
        times = []
        for i in idx:
            t = time.perf_counter()
            p = ledger.inclusion_proof("acme", i)
            times.append(time.perf_counter() - t)
            if i in leaves:
                verify_inclusion(i, head.size, leaves[i], p.hashes, head.root)
        print(
            f"inclusion proof at size {n:,}: p50 {pct(times, 0.5) * 1000:.3f} ms, "
            f"p99 {pct(times, 0.99) * 1000:.3f} ms"
        )
        times = []
        for old in (rng.randrange(1, n) for _ in range(500)):
            t = time.perf_counter()
            ledger.consistency_proof("acme", old)
            times.append(time.perf_counter() - t)
        print(
            f"consistency proof at size {n:,}: p50 {statistics.median(times) * 1000:.3f} ms, "
            f"p99 {pct(times, 0.99) * 1000:.3f} ms"
        )
        ledger.close()
        store.close()


if __name__ == "__main__":
    main()
