"""A mediated SQL call (compile under the authorizer, Cedar per table, durable
ledger event, keyed lineage) vs the same query run directly on SQLite.

Open loop: calls are started at a fixed rate (default 1,000/s) on one event
loop, as the broker's per-run servers would start them, and each call's
latency is measured from its scheduled start. Direct runs the same query on
a connection opened once, in a worker thread, at the same rate.

The paths alternate over several rounds (default 3: direct, the durable event
alone, mediated, then again), so a neighbour's load on a shared machine falls
on all of them; what mediation adds is taken per round, and the median round
is reported beside each round's. The machine's load average is printed.

    .venv/bin/python bench/broker_sql.py [--rate 1000] [--seconds 3] [--rounds 3]
        [--postgres] [--write-docs]

``--postgres`` also runs the same comparison on a PostgreSQL dataset (a
throwaway server from ``proctor.testing``; direct is psycopg on one
connection). ``--write-docs`` replaces the figures between the bench markers
in docs/datasets.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import platform
import sqlite3
import statistics
import sys
import tempfile
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from proctor.broker import DatasetBinding, RunScope, handle_sql
from proctor.ledger import Actor, EventDraft, Ledger, Signer
from proctor.policy import capability_policies, compile_policies
from proctor.store import open_store

Round = dict[str, tuple[list[float], float]]

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


ROWS = 10_000
CAPS = {"datasets": {"crm": {"tables": {"customers": {"columns": ["id", "name", "plan", "mrr"]}}}}}


@dataclass
class Paths:
    """One dataset's three paths: the query alone, the durable event alone, mediated."""

    engine: str
    rate: float
    direct: Callable[[int], Awaitable[object]]
    event_only: Callable[[int], Awaitable[object]]
    mediated: Callable[[int], Awaitable[object]]
    rounds: list[Round] = field(default_factory=list)


def make_scope(ledger: Ledger, binding: DatasetBinding) -> RunScope:
    return RunScope(
        tenant="acme",
        run_id="r1",
        workload="spiffe://bench.local/tenant/acme/deployment/churn/run/r1",
        deployment="churn",
        artifact=None,
        approvals=(),
        environment="production",
        policies=compile_policies(capability_policies("acme", "churn", CAPS)),
        ledger=ledger,
        datasets={"crm": binding},
        lineage_key=b"k" * 32,
    )


def paths_for(engine: str, rate: float, scope: RunScope, query: Callable[[int], object]) -> Paths:
    async def direct(i: int) -> object:
        return await asyncio.to_thread(query, i)

    async def mediated(i: int) -> object:
        out = await handle_sql(scope, {"dataset": "crm", "sql": QUERY, "params": [i % ROWS]})
        assert out["row_count"] == 1
        return out

    async def event_only(i: int) -> object:
        # The floor mediation cannot go under: one durable event per call.
        draft = EventDraft(
            Actor("workload", scope.workload), "sql.select", "dataset/crm", details={"i": i}
        )
        return await scope.ledger.append_async("acme", draft)

    return Paths(engine, rate, direct, event_only, mediated)


@contextlib.contextmanager
def sqlite_paths(d: Path, ledger: Ledger, rate: float) -> Iterator[Paths]:
    make_dataset(d / "crm.db", ROWS)
    scope = make_scope(ledger, DatasetBinding("crm", "sqlite", str(d / "crm.db")))
    conn = sqlite3.connect(d / "crm.db", check_same_thread=False)

    def query(i: int) -> list[tuple[object, ...]]:
        return conn.execute(QUERY, (i % ROWS,)).fetchall()

    try:
        yield paths_for("SQLite", rate, scope, query)
    finally:
        conn.close()


@contextlib.contextmanager
def postgres_paths(ledger: Ledger, rate: float) -> Iterator[Paths]:
    import psycopg

    from proctor.broker._pg_sql import close_pg_pools, grant_deployment_role
    from proctor.testing import PostgresServer

    server = PostgresServer(durable=False).start()
    try:
        dsn = server.create_database("crm")
        with psycopg.connect(dsn) as db:
            db.execute(
                "CREATE TABLE customers (id BIGINT PRIMARY KEY, name TEXT, email TEXT,"
                " country TEXT, plan TEXT, mrr INTEGER)"
            )
            with db.cursor() as cur:
                cur.executemany(
                    "INSERT INTO customers VALUES (%s, %s, %s, %s, %s, %s)",
                    [(i, f"c{i}", f"c{i}@example.com", "FR", "pro", i % 100) for i in range(ROWS)],
                )
        with psycopg.connect(dsn, autocommit=True) as db:
            # Now, not by autovacuum in the middle of a round.
            db.execute("VACUUM ANALYZE customers")
            db.execute("CHECKPOINT")
        grant_deployment_role(dsn, "acme", "churn", "crm", CAPS["datasets"]["crm"]["tables"])
        scope = make_scope(ledger, DatasetBinding("crm", "postgresql", dsn))
        conn = psycopg.connect(dsn, autocommit=True)
        pg_query = QUERY.replace("?", "%s")

        def query(i: int) -> list[tuple[Any, ...]]:
            return conn.execute(pg_query, (i % ROWS,)).fetchall()

        try:
            yield paths_for("PostgreSQL", rate, scope, query)
        finally:
            conn.close()
            close_pg_pools(scope)
    finally:
        server.stop()


def summary(paths: Paths) -> list[str]:
    pooled: dict[str, list[float]] = {}
    achieved: dict[str, list[float]] = {}
    for rnd in paths.rounds:
        for name, (lat, rate) in rnd.items():
            pooled.setdefault(name, []).extend(lat)
            achieved.setdefault(name, []).append(rate)
    qs = (0.5, 0.95, 0.99)
    adds = [
        [(pct(r["mediated"][0], q) - pct(r["direct"][0], q)) * 1000 for q in qs]
        for r in paths.rounds
    ]
    median = [statistics.median(a[k] for a in adds) for k in range(len(qs))]
    each = "; ".join(" / ".join(f"{v:.2f}" for v in a) for a in adds)
    return [
        f"{paths.engine}, {paths.rate:,.0f} calls/s:",
        "",
        "| path | calls/s achieved | p50 | p95 | p99 |",
        "|---|---:|---:|---:|---:|",
        *[
            f"| {name} | {min(achieved[name]):,.0f} | "
            + " | ".join(f"{pct(lat, q) * 1000:.2f} ms" for q in qs)
            + " |"
            for name, lat in pooled.items()
        ],
        "",
        f"Mediation adds **{median[0]:.2f} ms at p50**, {median[1]:.2f} ms at p95 and "
        f"**{median[2]:.2f} ms at p99** (median round; target: < 1 ms and < 5 ms); "
        f"each round p50 / p95 / p99: {each} ms.",
    ]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rate", type=float, default=1000.0)
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--postgres", action="store_true")
    ap.add_argument("--pg-rate", type=float, default=None, help="PostgreSQL's rate (--rate)")
    ap.add_argument("--write-docs", action="store_true")
    args = ap.parse_args()

    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        d = Path(tmp)
        store = open_store(str(d / "proctor.db"), create=True)
        ledger = Ledger(store, Signer.generate("bench.local"), "bench.local")
        ledger.create_log("acme", EventDraft(Actor("operator", "bench"), "tenant.create", "t"))
        datasets = [stack.enter_context(sqlite_paths(d, ledger, args.rate))]
        if args.postgres:
            pg_rate = args.pg_rate if args.pg_rate is not None else args.rate
            datasets.append(stack.enter_context(postgres_paths(ledger, pg_rate)))

        async def run() -> None:
            for paths in datasets:
                for _ in range(200):  # warm up: thread pool, Cedar, page cache
                    await paths.mediated(1)
            for _ in range(args.rounds):
                for paths in datasets:
                    rnd: Round = {}
                    for name, fn in (
                        ("direct", paths.direct),
                        ("durable event alone", paths.event_only),
                        ("mediated", paths.mediated),
                    ):
                        rnd[name] = await open_loop(fn, paths.rate, args.seconds)
                    paths.rounds.append(rnd)

        asyncio.run(run())
        events = ledger.head("acme").size
        ledger.close()
        store.close()
    load_after = os.getloadavg()

    lines = [
        f"One `SELECT ... WHERE id = ?` on a {ROWS:,}-row table, started at a fixed "
        f"rate for {args.seconds:g} s per path and round, "
        f"{args.rounds} rounds alternating the paths (open loop); mediated = "
        "authorizer compile (or the statement's kept analysis) + Cedar (or its kept "
        "answer) + durable ledger event (group commit, fsync) + lineage. "
        f"Python {platform.python_version()}, SQLite {sqlite3.sqlite_version}, "
        f"{platform.machine()}, {os.cpu_count()} CPUs, load average "
        f"{load_before[0]:.2f} before and {load_after[0]:.2f} after; "
        f"{events:,} events in the log at the end. Latencies pooled over the rounds.",
    ]
    for paths in datasets:
        lines += ["", *summary(paths)]
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
