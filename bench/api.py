"""API throughput and latency: an authenticated read and an approval (a ledger write),
at 1, 16 and 64 concurrent clients, against a real uvicorn server on loopback.

The server runs in its own process (so the clients' interpreter does not share its
lock); the clients are asyncio tasks over keep-alive connections. Every request,
the read included, is decided by Cedar and recorded durably in the ledger before
it is answered, so a "read" is one fsync'd event and an approval is two.

    python bench/api.py [--seconds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

SERVER = textwrap.dedent(
    """
    import json, sys, textwrap
    from pathlib import Path
    from proctor.api import Limits, serve_api
    from proctor.runtime import Runtime, init_home

    home = Path(sys.argv[1])
    init_home(home)
    rt = Runtime.open(home)
    rt.tenants.create("acme", rt.operator)
    _, dev = rt.principals.create("acme", "dev", "user", ["developer"], rt.operator)
    _, alice = rt.principals.create("acme", "alice", "user", ["approver"], rt.operator)
    art = home.parent / "art"
    art.mkdir()
    (art / "main.py").write_text("print('hi')\\n")
    (art / "proctor.toml").write_text(textwrap.dedent('''
        [artifact]
        name = "bench"
        entrypoint = ["python3", "main.py"]
        purpose = "benchmark"
    '''))
    digest = rt.artifacts.submit("acme", art, rt.operator).digest
    # The throughput is measured, not the per-principal budget (which would answer 429).
    unlimited = Limits(requests_per_second=1e9, request_burst=10**9)
    server = serve_api(rt, "127.0.0.1", 0, worker_threads=int(sys.argv[2]), limits=unlimited)
    print(json.dumps({"url": server.url, "dev": dev, "alice": alice, "digest": digest}),
          flush=True)
    sys.stdin.read()
    server.stop()
    rt.close()
    """
)


def pct(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(p * len(ordered)))]


async def _exchange(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                    request: bytes) -> int:  # fmt: skip
    """One request on a kept-alive connection; returns the status."""
    writer.write(request)
    await writer.drain()
    head = await reader.readuntil(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    await reader.readexactly(length)
    return status


async def load(url: str, token: str, method: str, path: str, body: dict[str, object] | None,
               clients: int, seconds: float) -> tuple[float, float, float, int]:  # fmt: skip
    """``clients`` connections, each sending its next request as soon as the last is
    answered. A minimal HTTP/1.1 client (not httpx): at 64 connections httpx's own
    pool costs more CPU than the server, and this machine has two cores."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    payload = json.dumps(body).encode() if body is not None else b""
    request = (
        f"{method} {path} HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {token}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n"
    ).encode() + payload
    latencies: list[float] = []
    errors = 0
    conns = [await asyncio.open_connection(host, int(port)) for _ in range(clients)]
    # Warm the connections and the server's caches.
    await asyncio.gather(*(_exchange(r, w, request) for r, w in conns))
    deadline = time.perf_counter() + seconds

    async def worker(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal errors
        while time.perf_counter() < deadline:
            t0 = time.perf_counter()
            status = await _exchange(reader, writer, request)
            latencies.append(time.perf_counter() - t0)
            if status >= 300:
                errors += 1

    start = time.perf_counter()
    await asyncio.gather(*(worker(r, w) for r, w in conns))
    elapsed = time.perf_counter() - start
    for _, w in conns:
        w.close()
    return len(latencies) / elapsed, pct(latencies, 0.5), pct(latencies, 0.99), errors


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--threads", type=int, default=40, help="server worker threads")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        proc = subprocess.Popen(
            [sys.executable, "-c", SERVER, str(Path(tmp) / "home"), str(args.threads)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        try:
            assert proc.stdout is not None
            info = json.loads(proc.stdout.readline())
            cases = [
                ("authenticated read (GET deployments)", info["dev"], "GET",
                 "/tenants/acme/deployments", None),
                ("approval (POST approvals, a ledger write)", info["alice"], "POST",
                 f"/tenants/acme/artifacts/{info['digest']}/approvals", {"comment": "bench"}),
            ]  # fmt: skip
            print("| request | clients | requests/s | p50 | p99 | errors |")
            print("|---|---|---|---|---|---|")
            for label, token, method, path, body in cases:
                for clients in (1, 16, 64):
                    rps, p50, p99, errors = asyncio.run(
                        load(info["url"], token, method, path, body, clients, args.seconds)
                    )
                    print(f"| {label} | {clients} | {rps:,.0f} | {p50 * 1000:.1f} ms "
                          f"| {p99 * 1000:.1f} ms | {errors} |", flush=True)  # fmt: skip
        finally:
            if proc.stdin:
                proc.stdin.close()
            proc.wait(timeout=30)


if __name__ == "__main__":
    main()
