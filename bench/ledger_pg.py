"""Ledger figures on PostgreSQL: durable appends/s at 1, 8 and 64 writers in one
node, and one node against 3 runtime nodes (processes) appending 64 writers each
to one tenant log, side by side in the same run, with and without a node fence.

Starts its own PostgreSQL (initdb in a temporary directory, fsync on,
synchronous_commit on: every batch's COMMIT is flushed before its appends return)
and stops it after. The fenced rows give each node's ledger a fence like a
runtime node's lease check (``Ledger.set_fence``): one ``SELECT ... FOR SHARE``
of the node's row in every batch's transaction.
Run with ``python bench/ledger_pg.py [--events N] [--rounds R]``; figures go to
docs/postgres.md. This machine is shared: take the medians of several rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from proctor.errors import ProctorError
from proctor.ledger import Fence, Ledger, Signer
from proctor.store import Conn, open_store
from proctor.testing import PostgresServer

# The same realistic broker event and percentile as bench/ledger.py, so the figures compare.
sys.path.insert(0, str(Path(__file__).resolve().parent))
from ledger import draft, pct

WRITERS = 64


class Fenced(ProctorError):
    """A bench node whose row is gone."""


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


def node_fence(node: str) -> Fence:
    def fence(conn: Conn) -> None:
        if conn.query_one("SELECT 1 FROM bench_nodes WHERE id = ? FOR SHARE", (node,)) is None:
            raise Fenced(f"node {node} is fenced off")

    return fence


def node_main(dsn: str, key: str, total: int, writers: int, fence: str) -> None:
    """One node process: waits for "go" on stdin, appends, prints its timings."""
    store = open_store(dsn)
    ledger = Ledger(store, Signer.load("bench.local", Path(key)), "bench.local")
    if fence != "-":
        ledger.set_fence(node_fence(fence))
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


def run_nodes(
    server: PostgresServer, name: str, signer: Signer, key: Path, nodes: int, events: int,
    fenced: bool,
) -> dict[str, float]:  # fmt: skip
    """``nodes`` node processes of WRITERS writers each, ``events`` in all, on one log."""
    dsn = server.create_database(name)
    store = open_store(dsn, create=True)
    ledger = Ledger(store, signer, "bench.local")
    ledger.create_log("acme", draft(0))
    with store.write() as conn:
        conn.execute("CREATE TABLE bench_nodes (id TEXT PRIMARY KEY)")
        for n in range(nodes):
            conn.execute("INSERT INTO bench_nodes (id) VALUES (?)", (f"n{n}",))
    ledger.close()
    store.close()
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, "--node", dsn, str(key), str(events // nodes),
             str(WRITERS), f"n{n}" if fenced else "-"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for n in range(nodes)
    ]  # fmt: skip
    for p in procs:
        assert p.stdout is not None and p.stdout.readline() == "ready\n"
    for p in procs:
        assert p.stdin is not None
        p.stdin.write("go\n")
        p.stdin.flush()
    results = []
    for p in procs:
        out, _ = p.communicate(timeout=600)
        assert p.returncode == 0
        results.append(json.loads(out.strip().splitlines()[-1]))
    start = min(r["start"] for r in results)
    end = max(r["end"] for r in results)
    store = open_store(dsn)
    check = Ledger(store, signer, "bench.local")
    report = check.verify("acme")  # the whole log, dense, every checkpoint consistent
    batches = len(check.checkpoints("acme")) - 1
    check.close()
    store.close()
    server.drop_database(name)
    return {
        "rate": sum(r["events"] for r in results) / (end - start),
        "p50": max(r["p50"] for r in results) * 1000,
        "p99": max(r["p99"] for r in results) * 1000,
        "batch": report.size / max(1, batches),
        "cpu": sum(r["cpu"] for r in results) / (end - start),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--events", type=int, default=30_000, help="events per 3-node run")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of the node runs")
    ap.add_argument(
        "--writers", type=int, nargs="*", default=[1, 8, 64], help="one node's writer counts"
    )
    ap.add_argument("--node", nargs=5, metavar=("DSN", "KEY", "EVENTS", "WRITERS", "FENCE"))
    args = ap.parse_args()
    if args.node:
        dsn, key, total, writers, fence = args.node
        node_main(dsn, key, int(total), int(writers), fence)
        return

    with PostgresServer(durable=True) as server, tempfile.TemporaryDirectory() as tmp:
        print(
            f"PostgreSQL at {server.dsn()} (fsync on, synchronous_commit on); {os.cpu_count()} CPUs"
        )
        print("\nOne node, writer threads in this process:\n")
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

        # One node against three, each a process with its own ledger writer and 64
        # writer threads, one log; the variants interleaved in every round so that
        # the machine's other load falls on all of them alike.
        key = Path(tmp) / "key.pem"
        signer = Signer.generate("bench.local")
        signer.save(key)
        variants = [
            (f"1 node x {WRITERS}", 1, False),
            (f"3 nodes x {WRITERS}", 3, False),
            (f"1 node x {WRITERS}, fenced", 1, True),
            (f"3 nodes x {WRITERS}, fenced", 3, True),
        ]
        runs: dict[str, list[dict[str, float]]] = {label: [] for label, _, _ in variants}
        number = 0
        for _ in range(args.rounds):
            for label, nodes, fenced in variants:
                number += 1
                events = args.events if nodes > 1 else args.events // 3
                runs[label].append(
                    run_nodes(server, f"bench_n{number}", signer, key, nodes, events, fenced)
                )
        print(f"\nNode processes, median of {args.rounds} rounds (each log verified):\n")
        print("| nodes | events/s | each round | p50 ms | p99 ms | events per batch | node CPUs |")
        print("|---|---|---|---|---|---|---|")
        for label, _, _ in variants:
            rs = runs[label]

            def med(k: str, rs: list[dict[str, float]] = rs) -> float:
                return statistics.median(r[k] for r in rs)

            each = ", ".join(f"{r['rate']:,.0f}" for r in rs)
            print(
                f"| {label} | {med('rate'):,.0f} | {each} | {med('p50'):.2f} | {med('p99'):.2f}"
                f" | {med('batch'):.1f} | {med('cpu'):.2f} |"
            )


if __name__ == "__main__":
    main()
