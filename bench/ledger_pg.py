"""Ledger figures on PostgreSQL: durable appends/s at 1, 8 and 64 writers in one
node, and with 3 runtime nodes (processes) appending to one tenant log at once.

Starts its own PostgreSQL (initdb in a temporary directory, fsync on,
synchronous_commit on: every batch's COMMIT is flushed) and stops it after.
Run with ``python bench/ledger_pg.py [--events N]``; figures go to docs/postgres.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from proctor.ledger import Ledger, Signer
from proctor.store import open_store
from proctor.testing import PostgresServer

# The same realistic broker event and percentile as bench/ledger.py, so the figures compare.
sys.path.insert(0, str(Path(__file__).resolve().parent))
from ledger import draft, pct


def run_writers(ledger: Ledger, writers: int, total: int) -> tuple[float, list[float]]:
    per = total // writers
    lat: list[list[float]] = [[] for _ in range(writers)]
    barrier = threading.Barrier(writers + 1)

    def worker(w: int) -> None:
        out = lat[w]
        barrier.wait()
        for i in range(per):
            t = time.perf_counter()
            ledger.append("acme", draft(i))
            out.append(time.perf_counter() - t)

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(writers)]
    for t in threads:
        t.start()
    barrier.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    return time.perf_counter() - t0, [x for w in lat for x in w]


def node_main(dsn: str, key: str, total: int, writers: int) -> None:
    """One node process: waits for "go" on stdin, appends, prints its timings."""
    store = open_store(dsn)
    ledger = Ledger(store, Signer.load("bench.local", Path(key)), "bench.local")
    ledger.append("acme", draft(-1))  # connections and state warm before the clock starts
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    sys.stdin.readline()
    start = time.time()
    cpu0 = os.times()
    dt, lat = run_writers(ledger, writers, total)
    cpu1 = os.times()
    ledger.close()
    store.close()
    out = {
        "start": start,
        "end": start + dt,
        "events": len(lat),
        "cpu": (cpu1.user - cpu0.user) + (cpu1.system - cpu0.system),
        "p50": pct(lat, 0.5),
        "p99": pct(lat, 0.99),
    }
    sys.stdout.write(json.dumps(out) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--events", type=int, default=60_000)
    ap.add_argument(
        "--writers", type=int, nargs="*", default=[1, 8, 64], help="one node's writer counts"
    )
    ap.add_argument("--node", nargs=4, metavar=("DSN", "KEY", "EVENTS", "WRITERS"))
    args = ap.parse_args()
    if args.node:
        dsn, key, total, writers = args.node
        node_main(dsn, key, int(total), int(writers))
        return

    with PostgresServer(durable=True) as server, tempfile.TemporaryDirectory() as tmp:
        print(
            f"PostgreSQL at {server.dsn()} (fsync on, synchronous_commit on); {os.cpu_count()} CPUs"
        )
        print("| writers | events/s | p50 ms | p99 ms | events per batch |")
        print("|---|---|---|---|---|")
        for writers in args.writers:
            dsn = server.create_database(f"bench_w{writers}")
            store = open_store(dsn, create=True)
            ledger = Ledger(store, Signer.generate("bench.local"), "bench.local")
            ledger.create_log("acme", draft(0))
            total = args.events if writers > 1 else min(args.events, 3000)
            dt, lat = run_writers(ledger, writers, total)
            batches = len(ledger.checkpoints("acme")) - 1
            n = len(lat)
            p50, p99, per_batch = pct(lat, 0.5) * 1000, pct(lat, 0.99) * 1000, n / max(1, batches)
            print(f"| {writers} | {n / dt:,.0f} | {p50:.2f} | {p99:.2f} | {per_batch:.1f} |")
            ledger.close()
            store.close()

        # Three nodes, one log: each a process with its own ledger writer.
        key = Path(tmp) / "key.pem"
        signer = Signer.generate("bench.local")
        signer.save(key)
        dsn = server.create_database("bench_nodes")
        store = open_store(dsn, create=True)
        ledger = Ledger(store, signer, "bench.local")
        ledger.create_log("acme", draft(0))
        ledger.close()
        store.close()
        nodes = 3
        per = args.events // nodes
        procs = [
            subprocess.Popen(
                [sys.executable, __file__, "--node", dsn, str(key), str(per), "64"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
            for _ in range(nodes)
        ]
        for p in procs:
            assert p.stdout is not None and p.stdout.readline() == "ready\n"
        for p in procs:
            assert p.stdin is not None
            p.stdin.write("go\n")
            p.stdin.flush()
        results = []
        for p in procs:
            out, _ = p.communicate(timeout=600)
            results.append(json.loads(out.strip().splitlines()[-1]))
        start = min(r["start"] for r in results)
        end = max(r["end"] for r in results)
        events = sum(r["events"] for r in results)
        store = open_store(dsn)
        check = Ledger(store, signer, "bench.local")
        report = check.verify("acme")
        batches = len(check.checkpoints("acme")) - 1
        check.close()
        store.close()
        p50 = max(r["p50"] for r in results) * 1000
        p99 = max(r["p99"] for r in results) * 1000
        print(
            f"| 3 nodes x 64 | {events / (end - start):,.0f} | {p50:.2f} | {p99:.2f} |"
            f" {report.size / max(1, batches):.1f} |"
        )
        cpu = sum(r["cpu"] for r in results)
        print(f"node processes used {cpu:.1f} CPU-s in {end - start:.1f} s wall")
        print(f"3-node log verified: {report.size} events, {batches} checkpoints, dense")


if __name__ == "__main__":
    main()
