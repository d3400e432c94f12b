"""A mediated SQL call (compile under the authorizer, Cedar per table, durable
ledger event, keyed lineage) vs the same query run directly on SQLite.

Open loop: calls are started at a fixed rate (default 1,000/s) on one event
loop, as the broker's per-run servers would start them, and each call's
latency is measured from its scheduled start. Direct runs the same query on
a connection opened once, in a worker thread, at the same rate.

    .venv/bin/python bench/broker_sql.py [--rate 1000] [--seconds 3] [--write-docs]

``--write-docs`` replaces the figures between the bench markers in
docs/datasets.md.
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import sqlite3
import sys
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path

from proctor.broker import DatasetBinding, RunScope, handle_sql
from proctor.ledger import Actor, EventDraft, Ledger, Signer
from proctor.policy import capability_policies, compile_policies
from proctor.store import open_store

QUERY = "SELECT id, name, plan, mrr FROM customers WHERE id = ?"
MARK_BEGIN = "<!-- bench/broker_sql.py: begin -->"
MARK_END = "<!-- bench/broker_sql.py: end -->"


def make_dataset(path: Path, rows: int = 10_000) -> None:
    conn = sqlite3.connect(path)
    conn.execute(
        "CREATE TABLE customers (id INTEGER PRIMARY KEY, name TEXT, email TEXT,"
        " country TEXT, plan TEXT, mrr INTEGER)"
    )
    conn.executemany(
        "INSERT INTO customers VALUES (?, ?, ?, ?, ?, ?)",
        [(i, f"c{i}", f"c{i}@example.com", "FR", "pro", i % 100) for i in range(rows)],
    )
    conn.commit()
    conn.close()


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


async def open_loop(
    call: Callable[[int], Awaitable[object]], rate: float, seconds: float
) -> tuple[list[float], float]:
    """Start ``call(i)`` every 1/rate s; latency counts from the scheduled start,
    so a call delayed by a busy loop is charged for it (no coordinated omission)."""
    loop = asyncio.get_running_loop()
    total = int(rate * seconds)
    latencies: list[float] = []
    start = loop.time() + 0.05
    tasks = []

    async def one(i: int, at: float) -> None:
        await call(i)
        latencies.append(loop.time() - at)

    for i in range(total):
        at = start + i / rate
        delay = at - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(i, at)))
    await asyncio.gather(*tasks)
    return latencies, total / (loop.time() - start)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rate", type=float, default=1000.0)
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--write-docs", action="store_true")
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        make_dataset(d / "crm.db")
        store = open_store(str(d / "proctor.db"), create=True)
        ledger = Ledger(store, Signer.generate("bench.local"), "bench.local")
        ledger.create_log("acme", EventDraft(Actor("operator", "bench"), "tenant.create", "t"))
        caps = {
            "datasets": {
                "crm": {"tables": {"customers": {"columns": ["id", "name", "plan", "mrr"]}}}
            }
        }
        scope = RunScope(
            tenant="acme",
            run_id="r1",
            workload="spiffe://bench.local/tenant/acme/deployment/churn/run/r1",
            deployment="churn",
            artifact=None,
            approvals=(),
            environment="production",
            policies=compile_policies(capability_policies("acme", "churn", caps)),
            ledger=ledger,
            datasets={"crm": DatasetBinding("crm", "sqlite", str(d / "crm.db"))},
            lineage_key=b"k" * 32,
        )
        direct_conn = sqlite3.connect(d / "crm.db", check_same_thread=False)

        def direct_query(i: int) -> list[tuple[object, ...]]:
            return direct_conn.execute(QUERY, (i % 10_000,)).fetchall()

        async def direct(i: int) -> object:
            return await asyncio.to_thread(direct_query, i)

        async def mediated(i: int) -> object:
            out = await handle_sql(scope, {"dataset": "crm", "sql": QUERY, "params": [i % 10_000]})
            assert out["row_count"] == 1
            return out

        async def event_only(i: int) -> object:
            # The floor mediation cannot go under: one durable event per call.
            draft = EventDraft(
                Actor("workload", scope.workload), "sql.select", "dataset/crm", details={"i": i}
            )
            return await ledger.append_async("acme", draft)

        async def run() -> dict[str, tuple[list[float], float]]:
            for _ in range(200):  # warm up: thread pool, Cedar, page cache
                await mediated(1)
            results = {}
            paths = (
                ("direct", direct),
                ("durable event alone", event_only),
                ("mediated", mediated),
            )
            for name, fn in paths:
                results[name] = await open_loop(fn, args.rate, args.seconds)
            return results

        results = asyncio.run(run())
        events = ledger.head("acme").size
        ledger.close()
        store.close()

    rows = []
    for name, (lat, achieved) in results.items():
        rows.append((name, achieved, pct(lat, 0.5) * 1000, pct(lat, 0.99) * 1000))
    added50 = rows[2][2] - rows[0][2]
    added99 = rows[2][3] - rows[0][3]
    lines = [
        f"One `SELECT ... WHERE id = ?` on a 10,000-row table, started at "
        f"{args.rate:,.0f} calls/s for {args.seconds:g} s (open loop); mediated = "
        f"authorizer compile + Cedar + durable ledger event (group commit, fsync) + lineage. "
        f"Python {platform.python_version()}, SQLite {sqlite3.sqlite_version}, "
        f"{platform.machine()}, {events:,} events in the log at the end.",
        "",
        "| path | calls/s achieved | p50 | p99 |",
        "|---|---:|---:|---:|",
        *[f"| {n} | {a:,.0f} | {p50:.2f} ms | {p99:.2f} ms |" for n, a, p50, p99 in rows],
        "",
        f"Mediation adds **{added50:.2f} ms at p50** and **{added99:.2f} ms at p99** "
        "(target: < 1 ms and < 5 ms).",
    ]
    text = "\n".join(lines)
    print(text)
    if args.write_docs:
        doc = Path(__file__).resolve().parent.parent / "docs" / "datasets.md"
        body = doc.read_text()
        if MARK_BEGIN not in body or MARK_END not in body:
            sys.exit(f"markers not found in {doc}")
        head, rest = body.split(MARK_BEGIN, 1)
        _, tail = rest.split(MARK_END, 1)
        doc.write_text(f"{head}{MARK_BEGIN}\n{text}\n{MARK_END}{tail}")


if __name__ == "__main__":
    main()
