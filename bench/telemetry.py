"""What the metrics cost on the egress path: calls through the real broker with the
metrics off (the no-op set) and on, side by side in one run.

``python bench/telemetry.py [--rounds R] [--calls N]``. Everything is real: the
broker's Unix socket, the egress proxy, an HTTP upstream on loopback, a SQLite
ledger with fsync (a decision event per call, its completion record with the next
commit). Each round makes N pairs of calls, one with the metrics off and one on,
the first of the pair alternating, so that a drift of the machine (the shared
disk's fsync, another process) falls on both alike. Reported: each side's median
and p99, the ratio of the medians, and what the metrics add at the median and the
p99. Last, what a call's end costs in itself (``broker._telemetry.finished``: its
counter, its two histograms), off and on, without the socket and the fsync.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from proctor import telemetry
from proctor.broker import Broker, EgressProxy, Handlers, RunScope
from proctor.broker._calls import ADMIT, ANSWER, DECIDE, PARSE, RECORD, Call
from proctor.broker._proxy import FORWARD
from proctor.broker._telemetry import finished
from proctor.guest.protocol import TOKEN_HEADER
from proctor.ledger import Actor, EventDraft, Ledger, Signer
from proctor.ledger._ledger import _observe
from proctor.policy import capability_policies, compile_policies
from proctor.store import open_store
from proctor.telemetry import _metrics


def upstream() -> tuple[int, asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()

    async def on(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok")
        await writer.drain()
        writer.close()

    async def start() -> asyncio.AbstractServer:
        return await asyncio.start_server(on, "127.0.0.1", 0)

    server = asyncio.run_coroutine_threadsafe(start(), loop).result()
    return int(server.sockets[0].getsockname()[1]), loop


def call(path: str, request: bytes) -> float:
    """One egress call on its own connection, as a guest makes it: milliseconds."""
    t = time.perf_counter()
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(path)
        s.sendall(request)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    took = (time.perf_counter() - t) * 1000
    if not data.startswith(b"HTTP/1.1 200"):
        raise SystemExit(f"the call failed: {data[:200]!r}")
    return took


def pct(values: list[float], q: float) -> float:
    return sorted(values)[min(len(values) - 1, int(q * len(values)))]


def finish_cost(scope: RunScope, n: int) -> float:
    """Microseconds one call's end costs (its metrics), on a call made up as the
    pipeline leaves it."""
    calls = []
    for i in range(n):
        c = Call(scope, kind=FORWARD)
        for stage in (ADMIT, PARSE, DECIDE, RECORD, ANSWER):
            c.passed(stage)
        c.recorded("allow", i)
        calls.append(c)
    t = time.perf_counter()
    for c in calls:
        finished(c)
    return (time.perf_counter() - t) / n * 1e6


def commit_cost(n: int) -> float:
    """Microseconds a ledger commit's metrics cost (a batch of one event), and the
    connection gauge's up and down."""
    rows = [("acme", 1, "2026-01-01T00:00:00Z", b"{}", None)]
    gauge = telemetry.metrics().broker_connections
    t = time.perf_counter()
    for _ in range(n):
        _observe(rows, 0.001)
        gauge.inc()
        gauge.dec()
    return (time.perf_counter() - t) / n * 1e6


def main(rounds: int, per_round: int) -> None:
    home = Path(tempfile.mkdtemp())
    store = open_store(str(home / "p.db"), create=True)
    ledger = Ledger(store, Signer.generate("bench.local"), "bench.local")
    ledger.create_log("acme", EventDraft(Actor("operator", "b"), "tenant.create", "tenant/acme"))
    port, up_loop = upstream()
    entry = f"127.0.0.1:{port}"
    scope = RunScope(
        "acme", "r1", "spiffe://bench.local/tenant/acme/deployment/churn/run/r1", "churn",
        None, (), "sandbox",
        compile_policies(capability_policies("acme", "churn", {"egress": [entry]})),
        ledger, allowed_ranges=("127.0.0.0/8",),
        # The bench makes its calls as fast as it can: no budget of the run's in the way.
        call_bound=10_000_000,
    )  # fmt: skip
    telemetry.enable_metrics(tenant_labels=True)
    from proctor.broker import RateLimit

    scope.rate_limit = RateLimit(per_second=1e9, burst=1_000_000)
    times: dict[str, list[float]] = {"off": [], "on": []}
    with Broker(Handlers.for_proxy(EgressProxy(None, connect_timeout=5)), os.urandom(32)) as b:
        channel = b.open_run(scope, ttl=3600)
        path = str(channel.socket)
        head = f"GET http://{entry}/ HTTP/1.1\r\nHost: {entry}\r\nConnection: close\r\n"
        request = f"{head}{TOKEN_HEADER}: {channel.token}\r\n\r\n".encode()
        for _ in range(50):  # warm up
            call(path, request)
        pairs = 0
        for _ in range(rounds):
            for _ in range(per_round):
                # One call each way, the first one alternating: a pair sees the same machine.
                order = ("off", "on") if pairs % 2 == 0 else ("on", "off")
                pairs += 1
                for side in order:
                    _metrics._switch(side == "on")
                    times[side].append(call(path, request))
        _metrics._switch(True)
        b.close_run("r1")
    ledger.flush()
    body, _ = telemetry.exposition()
    counted = next(
        line for line in body.decode().splitlines()
        if line.startswith('proctor_calls_total{decision="allow",kind="egress.forward"')
    )  # fmt: skip
    cost = {}
    for side in ("off", "on"):
        _metrics._switch(side == "on")
        finish_cost(scope, 2000)  # warm
        cost[side] = statistics.median(finish_cost(scope, 20_000) for _ in range(5))
        cost[side + " commit"] = statistics.median(commit_cost(20_000) for _ in range(5))
    _metrics._switch(True)
    n = rounds * per_round
    print(f"{n} egress calls with the metrics off and {n} on, in pairs ({rounds} rounds);")
    print("plain-HTTP GETs through the broker's socket, one connection each (ms):")
    print("| metrics | p50 | p99 | mean |")
    print("|---|---:|---:|---:|")
    for side in ("off", "on"):
        xs = times[side]
        print(f"| {side} | {pct(xs, 0.5):.3f} | {pct(xs, 0.99):.3f} | {statistics.mean(xs):.3f} |")
    off, on = times["off"], times["on"]
    paired = [b - a for a, b in zip(off, on, strict=True)]
    error = statistics.stdev(paired) / len(paired) ** 0.5 * 1000
    median, mean = statistics.median(paired) * 1000, statistics.mean(paired) * 1000
    print(
        f"paired (each on call less the off call made next to it): median {median:+.1f} us, "
        f"mean {mean:+.1f} us (standard error {error:.1f} us: within two of 0, no measurable cost)"
    )
    print(
        f"ratio of medians (on/off): {pct(on, 0.5) / pct(off, 0.5):.3f}; added by the metrics: "
        f"p50 {pct(on, 0.5) - pct(off, 0.5):+.3f} ms, p99 {pct(on, 0.99) - pct(off, 0.99):+.3f} ms"
    )
    print(
        f"a call's end in itself (its counter and two histograms): off {cost['off']:.2f} us, "
        f"on {cost['on']:.2f} us; its ledger commit's metrics and its connection's gauge: "
        f"off {cost['off commit']:.2f} us, on {cost['on commit']:.2f} us"
    )
    print(f"the scrape counted them: {counted}")
    up_loop.call_soon_threadsafe(up_loop.stop)
    ledger.close()
    store.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--calls", type=int, default=50)
    args: Any = parser.parse_args()
    main(args.rounds, args.calls)
