"""Egress proxy figures on loopback: request latency and tunnel throughput, proxy vs direct.

``python bench/broker_proxy.py [--requests N] [--megabytes M]``. Everything is
real: an asyncio upstream on 127.0.0.1, the proxy's handlers on a loopback
server (standing in for the run's socket), a real SQLite ledger with fsync
(two durable events per connection: decision before, completion after).

Last, HTTPS requests with a secret injected (TLS terminated with the tenant CA,
a TLS upstream verified against its own CA): their latency, and what each costs
the policy engine and the ledger, counted: decisions recorded, Cedar questions
asked, and events appended (one decision, with the secret inside it, and the
completion record).
"""

from __future__ import annotations

import argparse
import asyncio
import ssl
import statistics
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from proctor.broker import EgressProxy, RunScope, SecretBinding, TenantCA
from proctor.ledger import Actor, Appended, EventDraft, Ledger, Signer
from proctor.policy import capability_policies, compile_policies
from proctor.store import open_store

BLOCK = b"x" * 65536


async def upstream_server(download: int) -> asyncio.AbstractServer:
    async def on(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        if head.startswith(b"GET /big"):
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % download)
            left = download
            while left:
                n = min(left, len(BLOCK))
                writer.write(BLOCK[:n])
                await writer.drain()
                left -= n
        else:
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok")
        await writer.drain()
        writer.close()

    return await asyncio.start_server(on, "127.0.0.1", 0)


async def fetch(port: int, request: bytes) -> int:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(request)
    total = 0
    while data := await reader.read(1 << 20):
        total += len(data)
    writer.close()
    return total


async def tunnel_fetch(proxy_port: int, target: str, request: bytes) -> int:
    reader, writer = await asyncio.open_connection("127.0.0.1", proxy_port)
    writer.write(f"CONNECT {target} HTTP/1.1\r\n\r\n".encode())
    await reader.readuntil(b"\r\n\r\n")
    writer.write(request)
    total = 0
    while data := await reader.read(1 << 20):
        total += len(data)
    writer.close()
    return total


def pct(values: list[float], q: float) -> float:
    return sorted(values)[min(len(values) - 1, int(q * len(values)))]


async def main(requests: int, megabytes: int) -> None:
    home = Path(tempfile.mkdtemp())
    store = open_store(str(home / "p.db"), create=True)
    ledger = Ledger(store, Signer.generate("bench.local"), "bench.local")
    ledger.create_log("acme", EventDraft(Actor("operator", "b"), "tenant.create", "tenant/acme"))
    up = await upstream_server(megabytes << 20)
    port = up.sockets[0].getsockname()[1]
    policies = compile_policies(
        capability_policies("acme", "churn", {"egress": [f"127.0.0.1:{port}"]})
    )
    scope = RunScope(
        "acme",
        "r1",
        "spiffe://bench.local/tenant/acme/deployment/churn/run/r1",
        "churn",
        None,
        (),
        "sandbox",
        policies,
        ledger,
        allowed_ranges=("127.0.0.0/8",),
    )
    proxy = EgressProxy()

    async def on_proxy(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = (await reader.readuntil(b"\r\n\r\n")).decode().split("\r\n")
        method, target, _ = head[0].split(" ")
        if method == "CONNECT":
            await proxy.handle_connect(scope, target, reader, writer)
        else:
            await proxy.handle_forward(scope, method, target, [], reader, writer)

    front = await asyncio.start_server(on_proxy, "127.0.0.1", 0)
    pport = front.sockets[0].getsockname()[1]
    origin = b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"
    absolute = f"GET http://127.0.0.1:{port}/ HTTP/1.1\r\n\r\n".encode()

    for _ in range(20):  # warm up
        await fetch(port, origin)
        await fetch(pport, absolute)
    direct, proxied = [], []
    for _ in range(requests):
        t = time.perf_counter()
        await fetch(port, origin)
        direct.append((time.perf_counter() - t) * 1000)
        t = time.perf_counter()
        await fetch(pport, absolute)
        proxied.append((time.perf_counter() - t) * 1000)

    big = b"GET /big HTTP/1.1\r\nHost: x\r\n\r\n"
    t = time.perf_counter()
    await fetch(port, big)
    direct_s = time.perf_counter() - t
    t = time.perf_counter()
    await tunnel_fetch(pport, f"127.0.0.1:{port}", big)
    tunnel_s = time.perf_counter() - t

    print(f"{requests} plain-HTTP GETs, one connection each (ms):")
    print("| path | p50 | p99 | mean |")
    print("|---|---:|---:|---:|")
    for name, xs in (("direct", direct), ("through the proxy", proxied)):
        print(f"| {name} | {pct(xs, 0.5):.2f} | {pct(xs, 0.99):.2f} | {statistics.mean(xs):.2f} |")
    added = [p - d for p, d in zip(proxied, direct, strict=True)]
    print(f"added by the proxy: p50 {pct(added, 0.5):.2f} ms, p99 {pct(added, 0.99):.2f} ms")
    print(
        f"{megabytes} MB download: direct {megabytes / direct_s:.0f} MB/s, "
        f"CONNECT tunnel {megabytes / tunnel_s:.0f} MB/s "
        f"({100 * direct_s / tunnel_s:.0f}% of direct)"
    )
    await asyncio.sleep(0.2)  # the last completion event
    await injected(home, ledger, requests // 5 or 1)
    front.close()
    up.close()
    ledger.close()
    store.close()


class CountingScope(RunScope):
    """A run's scope that counts the Cedar questions it asks."""

    questions: int = 0

    def decide(self, *args: Any, **kwargs: Any) -> Any:
        CountingScope.questions += 1
        return super().decide(*args, **kwargs)


async def injected(home: Path, ledger: Ledger, requests: int) -> None:
    """HTTPS GETs with a secret injected, one CONNECT each; latency and counts."""
    upstream_ca = TenantCA(home / "upstream-ca", "upstream")
    cafile = home / "upstream-ca.pem"
    cafile.write_bytes(upstream_ca.ca_pem())
    tls = upstream_ca.server_context("127.0.0.1")

    async def on(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok")
        await writer.drain()
        writer.close()

    up = await asyncio.start_server(on, "127.0.0.1", 0, ssl=tls)
    port = up.sockets[0].getsockname()[1]
    host = f"127.0.0.1:{port}"
    policies = compile_policies(
        capability_policies("acme", "churn", {"egress": [host], "secrets": ["api"]})
    )
    scope = CountingScope(
        "acme", "r2", "spiffe://bench.local/tenant/acme/deployment/churn/run/r2", "churn",
        None, (), "sandbox", policies, ledger, allowed_ranges=("127.0.0.0/8",),
        secrets={"api": SecretBinding("api", "bench-secret-value", (host,))},
    )  # fmt: skip
    proxy = EgressProxy(home / "ca", upstream_cafile=str(cafile))
    actions: Counter[str] = Counter()
    append = ledger.append_async

    async def counted(log: str, draft: EventDraft, hook: Any = None) -> Appended:
        actions[draft.action] += 1
        return await append(log, draft, hook)

    ledger.append_async = counted  # type: ignore[method-assign]

    async def on_proxy(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = (await reader.readuntil(b"\r\n\r\n")).decode().split("\r\n")
        await proxy.handle_connect(scope, head[0].split(" ")[1], reader, writer)
        writer.close()

    front = await asyncio.start_server(on_proxy, "127.0.0.1", 0)
    pport = front.sockets[0].getsockname()[1]
    guest_tls = ssl.create_default_context(cadata=proxy.tenant_ca("acme").ca_pem().decode())
    request = f"GET / HTTP/1.1\r\nHost: {host}\r\n\r\n".encode()

    async def one() -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", pport)
        writer.write(f"CONNECT {host} HTTP/1.1\r\n\r\n".encode())
        await reader.readuntil(b"\r\n\r\n")
        await writer.start_tls(guest_tls, server_hostname="127.0.0.1")
        writer.write(request)
        await writer.drain()
        got = b""
        while not got.endswith(b"\r\n\r\nok"):  # the guest's side is kept alive
            data = await reader.read(1 << 16)
            if not data:
                break
            got += data
        writer.close()

    await one()  # warm up: the tenant CA and its leaf
    await asyncio.sleep(0.1)
    actions.clear()
    CountingScope.questions = 0
    times = []
    for _ in range(requests):
        t = time.perf_counter()
        await one()
        times.append((time.perf_counter() - t) * 1000)
    await asyncio.sleep(0.2)  # the last completion event
    ledger.append_async = append  # type: ignore[method-assign]
    decisions = actions["http.request"] + actions["secret.use"]
    print(f"{requests} HTTPS GETs with a secret injected, one CONNECT each (ms): "
          f"p50 {pct(times, 0.5):.2f}, p99 {pct(times, 0.99):.2f}")  # fmt: skip
    print("| per injected request | count |")
    print("|---|---:|")
    print(f"| decisions recorded (http.request with the secret inside; secret.use) | "
          f"{decisions / requests:g} |")  # fmt: skip
    print(f"| Cedar questions asked (http.request, secret.use) | "
          f"{CountingScope.questions / requests:g} |")  # fmt: skip
    each = ", ".join(f"{a} {n / requests:g}" for a, n in sorted(actions.items()))
    print(f"| ledger appends | {sum(actions.values()) / requests:g} ({each}) |")
    front.close()
    up.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=500)
    parser.add_argument("--megabytes", type=int, default=100)
    args = parser.parse_args()
    asyncio.run(main(args.requests, args.megabytes))
