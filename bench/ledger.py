"""Ledger figures: durable appends/s, latency, verify time, proof time, bytes/event.

Run with ``make bench`` (or ``python bench/ledger.py [--events N]``). Every run is
on a real SQLite file with WAL and synchronous=FULL, so each batch is fsync'd.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import queue
import random
import sqlite3
import statistics
import tempfile
import threading
import time
from pathlib import Path

from proctor.ledger import Actor, EventDraft, Ledger, Signer, leaf_hash, verify_inclusion
from proctor.ledger._canonical import canonical_event
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


def _fresh(path: Path) -> None:
    for old in path.parent.glob(path.name + "*"):
        old.unlink()


def appends(dirpath: Path, writers: int, total: int) -> dict[str, float]:
    _fresh(dirpath / f"w{writers}.db")
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
    _fresh(dirpath / f"a{writers}.db")
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


# -- the floor: raw SQLite, the same rows, nothing of the ledger ------------------
#
# The fastest a durable group commit of these events can go on this disk from
# Python: the event bytes made in advance (the same canonical bytes the ledger
# writes), one writer thread draining a queue, one ``executemany`` INSERT and one
# COMMIT (WAL, synchronous=FULL: one fsync) per batch, then every waiter woken.
# The table is ledger_entries' shape: (log, seq, time, data), its primary key and
# its time index. The ledger's figure is divided by this one, in the same run.

_FLOOR_SCHEMA = (
    "CREATE TABLE entries (log TEXT NOT NULL, seq INTEGER NOT NULL, time TEXT NOT NULL,"
    " data BLOB NOT NULL, PRIMARY KEY (log, seq)) WITHOUT ROWID",
    "CREATE INDEX entries_time ON entries (log, time)",
)


class _RawWriter:
    def __init__(self, path: Path, max_batch: int = 2048) -> None:
        _fresh(path)
        self.db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=FULL")
        for sql in _FLOOR_SCHEMA:
            self.db.execute(sql)
        self.q: queue.SimpleQueue[tuple[bytes, object] | None] = queue.SimpleQueue()
        self.max_batch = max_batch
        self.seq = 0
        self.batches = 0
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self) -> None:
        while True:
            first = self.q.get()
            if first is None:
                return
            batch = [first]
            while len(batch) < self.max_batch:
                try:
                    item = self.q.get_nowait()
                except queue.Empty:
                    break
                if item is None:
                    self.q.put(None)
                    break
                batch.append(item)
            now = time.strftime("%Y-%m-%dT%H:%M:%S.000000Z", time.gmtime())
            rows = [("acme", self.seq + i, now, data) for i, (data, _) in enumerate(batch)]
            self.seq += len(batch)
            self.db.execute("BEGIN IMMEDIATE")
            self.db.executemany(
                "INSERT INTO entries (log, seq, time, data) VALUES (?, ?, ?, ?)", rows
            )
            self.db.execute("COMMIT")
            self.batches += 1
            loops: dict[asyncio.AbstractEventLoop, list[asyncio.Future[None]]] = {}
            for _, waiter in batch:
                if isinstance(waiter, asyncio.Future):
                    loops.setdefault(waiter.get_loop(), []).append(waiter)
                else:
                    waiter.release()  # type: ignore[attr-defined]
            for loop, futs in loops.items():
                loop.call_soon_threadsafe(_settle_all, futs)

    def close(self) -> None:
        self.q.put(None)
        self.thread.join()
        self.db.close()


def _settle_all(futs: list[asyncio.Future[None]]) -> None:
    for f in futs:
        f.set_result(None)


def event_bytes(n: int) -> list[bytes]:
    t = "2026-01-01T00:00:00.000000Z"
    return [canonical_event(draft(i).to_event(i + 1, t, "acme")) for i in range(n)]


def floor_threads(dirpath: Path, writers: int, total: int) -> dict[str, float]:
    raw = _RawWriter(dirpath / f"floor-w{writers}.db")
    per = total // writers
    rows = event_bytes(per)
    barrier = threading.Barrier(writers + 1)

    def worker() -> None:
        barrier.wait()
        for data in rows:
            done = threading.Lock()
            done.acquire()
            raw.q.put((data, done))
            done.acquire()

    threads = [threading.Thread(target=worker) for _ in range(writers)]
    for t in threads:
        t.start()
    barrier.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    dt = time.perf_counter() - t0
    raw.close()
    return {"events_per_s": per * writers / dt, "events_per_batch": per * writers / raw.batches}


def floor_async(dirpath: Path, writers: int, total: int) -> dict[str, float]:
    raw = _RawWriter(dirpath / f"floor-a{writers}.db")
    per = total // writers
    rows = event_bytes(per)

    async def worker() -> None:
        loop = asyncio.get_running_loop()
        for data in rows:
            fut: asyncio.Future[None] = loop.create_future()
            raw.q.put((data, fut))
            await fut

    async def run_all() -> float:
        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(writers)))
        return time.perf_counter() - t0

    dt = asyncio.run(run_all())
    raw.close()
    return {"events_per_s": per * writers / dt, "events_per_batch": per * writers / raw.batches}


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
    ap.add_argument("--writers", default="1,8,64", help="writer counts to run (comma-separated)")
    ap.add_argument("--only", choices=("appends", "verify"), help="run one half of the bench")
    ap.add_argument("--rounds", type=int, default=3, help="ledger runs per writer count")
    args = ap.parse_args()
    counts = [int(w) for w in args.writers.split(",")]
    with tempfile.TemporaryDirectory(prefix="proctor-bench-", dir=os.environ.get("BENCH_DIR")) as d:
        tmp = Path(d)
        if args.only != "verify":
            durable_appends(tmp, counts, args.appends, max(1, args.rounds))
        if args.only != "appends":
            verify_and_proofs(tmp, args.events)


def durable_appends(tmp: Path, counts: list[int], per_run: int, rounds: int) -> None:
    print("durable appends (WAL, synchronous=FULL, one fsync per batch)")
    print(
        "the raw floor: the same event bytes, one writer thread, one executemany INSERT"
        " and one COMMIT per batch, no ledger"
    )
    print(
        f"{'writers':>16} {'events/s':>10} {'p50 ms':>8} {'p99 ms':>8} {'ev/batch':>9}"
        f" {'raw floor/s':>12} {'ratio':>6}  ratios of the rounds"
    )
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    for kind, fn, floor in (
        ("threads", appends, floor_threads),
        ("asyncio tasks", appends_async, floor_async),
    ):
        for writers in counts:
            total = per_run if writers > 1 else min(per_run, 3_000)
            # Floor and ledger alternate (floor, ledger, floor, ...); each ledger run is
            # divided by the mean of the floors either side of it, and the median of
            # the rounds is printed: the machine's load moves during a run.
            floors = [floor(tmp, writers, total)["events_per_s"]]
            runs: list[dict[str, float]] = []
            for _ in range(rounds):
                runs.append(fn(tmp, writers, total))
                floors.append(floor(tmp, writers, total)["events_per_s"])
            ratios = [
                r["events_per_s"] / ((floors[i] + floors[i + 1]) / 2) for i, r in enumerate(runs)
            ]
            mid = sorted(range(rounds), key=lambda i: ratios[i])[rounds // 2]
            r = runs[mid]
            base = (floors[mid] + floors[mid + 1]) / 2
            print(
                f"{writers:>3} {kind:>12} {r['events_per_s']:>10,.0f} {r['p50_ms']:>8.2f} "
                f"{r['p99_ms']:>8.2f} {r['events_per_batch']:>9.1f} {base:>12,.0f}"
                f" {ratios[mid]:>5.2f}x  {' '.join(f'{x:.2f}' for x in ratios)}"
            )
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


def verify_and_proofs(tmp: Path, n: int) -> None:
    path, signer, rate = big_log(tmp, n)
    size = sum(p.stat().st_size for p in tmp.glob("big.db*"))
    print(f"\nlog of {n:,} events built at {rate:,.0f} events/s (bulk append)")
    print(f"bytes per event on disk: {size / n:,.0f} (store file {size / 1e6:,.0f} MB)")
    store = open_store(str(path))
    ledger = Ledger(store, signer, "bench.local")
    t0 = time.perf_counter()
    report = ledger.verify("acme")
    verify_s = time.perf_counter() - t0
    print(
        f"full verify of {report.size:,} events: {verify_s:.2f} s"
        f" ({report.size / verify_s:,.0f} events/s)"
    )
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
