"""Transparent egress figures, side by side in one run: a direct connection, the
explicit proxy (CONNECT through the broker) and the transparent path (no proxy
settings; the run's network hands the connection to the broker).

``python bench/transparent.py [--requests N] [--megabytes M] [--rounds R]
[--transfers T] [--networks K] [--backend bubblewrap|gvisor]... [--quick]``

Everything is real and on loopback: an upstream (HTTPS and plain HTTP, a
process of its own, blocking threads) on 127.0.0.1; a real broker (its Unix
socket, its egress proxy, a SQLite ledger with fsync: two durable events per
connection) in this process; the guest's client is a stdlib Python script in a
real sandbox with the run's network (``GuestNetwork``), as an unprivileged uid:

- explicit: ``CONNECT up.bench:PORT`` (or an absolute-form GET) to the guest
  shim's proxy on the sandbox's loopback, which bridges to the broker socket;
- transparent: a plain connection to the address the run's DNS gave for
  ``up.bench`` (resolved once before the loop; DNS is timed on its own).

The direct client is the same script run on the host, connecting to 127.0.0.1.
Rounds alternate the direct run and the sandboxed run so that load on this
shared machine falls on both; within a run the paths alternate request by
request. Figures: per-connection latency (connect + TLS + a 2-byte GET, and a
plain-HTTP GET), throughput of one large HTTPS download, the cost of a run's
network (``GuestNetwork.create()`` + ``close()``, attaching it to the broker,
a whole brokered sandbox run with and without it) and DNS lookups in the run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from ipaddress import ip_address
from pathlib import Path
from typing import Any

from proctor.broker import Broker, EgressProxy, Handlers, RunScope, TenantCA
from proctor.ledger import Actor, EventDraft, Ledger, Signer
from proctor.lifecycle import brokered_spec
from proctor.policy import capability_policies, compile_policies
from proctor.sandbox import GuestNetwork, Limits, get_driver, network_available
from proctor.sandbox._rootfs import host_interpreter
from proctor.store import open_store

NAME = "up.bench"
MiB = 1 << 20

# The upstream: blocking threads (ssl and sendall run outside the GIL), its own
# process, so that the broker in this one has the interpreter to itself.
UPSTREAM = r"""
import json, socket, ssl, sys, threading
ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
ctx.load_cert_chain(sys.argv[1])
BLOCK = b"x" * (1 << 20)

def serve(conn, tls):
    try:
        if tls:
            conn = ctx.wrap_socket(conn, server_side=True)
        head = b""
        while b"\r\n\r\n" not in head:
            data = conn.recv(65536)
            if not data:
                return
            head += data
        target = head.split(b"\r\n", 1)[0].split(b" ")[1]
        size = int(target.rsplit(b"/", 1)[1]) if target.startswith(b"/big/") else 2
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\nConnection: close\r\n\r\n" % size)
        if size == 2:
            conn.sendall(b"ok")
        left = size if size != 2 else 0
        while left:
            n = min(left, len(BLOCK))
            conn.sendall(BLOCK[:n])
            left -= n
    except (OSError, ValueError, IndexError):
        pass
    finally:
        conn.close()

def accept(listener, tls):
    while True:
        conn, _ = listener.accept()
        threading.Thread(target=serve, args=(conn, tls), daemon=True).start()

def listen(tls):
    s = socket.create_server(("127.0.0.1", 0), backlog=256)
    threading.Thread(target=accept, args=(s, tls), daemon=True).start()
    return s.getsockname()[1]

print(json.dumps({"https": listen(True), "http": listen(False)}), flush=True)
sys.stdin.read()  # until the bench closes it
"""

# The client, where a guest sits (stdlib only). Prints one JSON line of samples.
CLIENT = r"""
import json, os, socket, ssl, time
cfg = json.loads(os.environ["BENCH"])
socket.setdefaulttimeout(60)  # a stuck path ends the run, not the bench
NAME, S, H = cfg["name"], cfg["https"], cfg["http"]
ctx = ssl.create_default_context(cafile=cfg["ca"])
buf = bytearray(1 << 20)
view = memoryview(buf)
out = {"https": {}, "http": {}, "mbps": {}, "dns_new": [], "dns_same": []}
address = "127.0.0.1"
if "transparent" in cfg["paths"]:
    address = socket.getaddrinfo(NAME, S, socket.AF_INET, socket.SOCK_STREAM)[0][4][0]
    out["resolved"] = address

def response(s):
    head = b""
    while b"\r\n\r\n" not in head:
        data = s.recv(65536)
        if not data:
            raise OSError("closed before the response head: %r" % head[:200])
        head += data
    head, _, body = head.partition(b"\r\n\r\n")
    if not head.startswith(b"HTTP/1.1 200"):
        raise OSError("answered %r" % head[:300])
    length = next(int(l.split(b":")[1]) for l in head.split(b"\r\n")
                  if l.lower().startswith(b"content-length:"))
    got = len(body)
    while got < length:
        n = s.recv_into(view)
        if not n:
            raise OSError("closed after %d of %d bytes" % (got, length))
        got += n
    return got

def opened(path, port):
    if path == "direct":
        return socket.create_connection(("127.0.0.1", port))
    if path == "transparent":
        return socket.create_connection((address, port))
    if path == "socket":
        u = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        u.connect(os.environ["PROCTOR_BROKER"])
        return u
    return socket.create_connection(("127.0.0.1", cfg["proxy_port"]))

def proxy_head(first):
    # The shim adds the run's token after the request line; a client of the socket
    # itself adds it there too.
    if path_now[0] != "socket":
        return first + "\r\n"
    return first + "\r\nProctor-Token: " + os.environ["PROCTOR_TOKEN"] + "\r\n"

path_now = [None]

def https_get(path, target):
    path_now[0] = path
    s = opened(path, S)
    try:
        if path in ("explicit", "socket"):
            first = proxy_head("CONNECT %s:%d HTTP/1.1" % (NAME, S))
            s.sendall((first + "Host: %s:%d\r\n\r\n" % (NAME, S)).encode())
            head = b""
            while b"\r\n\r\n" not in head:  # nothing follows it: TLS is the client's to start
                data = s.recv(4096)
                if not data:
                    raise OSError("proxy closed: %r" % head)
                head += data
            if not head.startswith(b"HTTP/1.1 200"):
                raise OSError("CONNECT answered %r" % head[:300])
        t = ctx.wrap_socket(s, server_hostname=NAME)
        t.sendall(("GET %s HTTP/1.1\r\nHost: %s:%d\r\nConnection: close\r\n\r\n"
                   % (target, NAME, S)).encode())
        return response(t)
    finally:
        s.close()

def http_get(path):
    path_now[0] = path
    s = opened(path, H)
    try:
        proxied = path in ("explicit", "socket")
        target = "http://%s:%d/" % (NAME, H) if proxied else "/"
        first = proxy_head("GET %s HTTP/1.1" % target)
        s.sendall((first + "Host: %s:%d\r\nConnection: close\r\n\r\n" % (NAME, H)).encode())
        return response(s)
    finally:
        s.close()

def timed(fn, *args):
    t = time.perf_counter()
    fn(*args)
    return (time.perf_counter() - t) * 1000

paths = cfg["paths"]
for p in paths:
    out["https"][p], out["http"][p], out["mbps"][p] = [], [], []
    for _ in range(cfg["warmup"]):
        https_get(p, "/")
        http_get(p)
for i in range(cfg["requests"]):
    order = paths[i % len(paths):] + paths[:i % len(paths)]
    for p in order:
        out["https"][p].append(timed(https_get, p, "/"))
    for p in order:
        out["http"][p].append(timed(http_get, p))
big = "/big/%d" % cfg["bytes"]
for _ in range(cfg["transfers"]):
    for p in paths:
        t = time.perf_counter()
        try:
            https_get(p, big)
        except Exception as exc:
            raise SystemExit("the download on path %s failed: %r" % (p, exc))
        out["mbps"][p].append(cfg["bytes"] / (1 << 20) / (time.perf_counter() - t))
if cfg["dns"]:
    tag = os.urandom(3).hex()
    for i in range(cfg["dns"]):
        t = time.perf_counter()
        socket.getaddrinfo("n%d-%s.bench" % (i, tag), 443, type=socket.SOCK_STREAM)
        out["dns_new"].append((time.perf_counter() - t) * 1000)
        t = time.perf_counter()
        socket.getaddrinfo(NAME, 443, type=socket.SOCK_STREAM)
        out["dns_same"].append((time.perf_counter() - t) * 1000)
print(json.dumps(out), flush=True)
"""


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def timed(fn: Callable[[], Any]) -> float:
    t = time.perf_counter()
    fn()
    return (time.perf_counter() - t) * 1000


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.home = Path(tempfile.mkdtemp(prefix="proctor-bench-transparent-"))
        self.store = open_store(str(self.home / "p.db"), create=True)
        self.ledger = Ledger(self.store, Signer.generate("bench.local"), "bench.local")
        self.ledger.create_log(
            "acme", EventDraft(Actor("operator", "b"), "tenant.create", "tenant/acme")
        )
        ca = TenantCA(self.home / "upstream-ca", "upstream")
        cert, key = ca.leaf_for(NAME)
        (self.home / "leaf.pem").write_bytes(cert + key)
        self.code = self.home / "code"
        self.code.mkdir()
        (self.code / "client.py").write_text(CLIENT)
        (self.code / "ca.pem").write_bytes(ca.ca_pem())
        os.chmod(self.home, 0o755)
        os.chmod(self.code, 0o755)
        for f in self.code.iterdir():
            f.chmod(0o644)
        self.python = str(host_interpreter().executable)
        self.upstream = subprocess.Popen(
            [self.python, "-c", UPSTREAM, str(self.home / "leaf.pem")],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        )  # fmt: skip
        assert self.upstream.stdout is not None
        ports = json.loads(self.upstream.stdout.readline())
        self.https, self.http = int(ports["https"]), int(ports["http"])
        self.policies = compile_policies(
            capability_policies(
                "acme", "churn", {"egress": [f"{NAME}:{self.https}", f"{NAME}:{self.http}"]}
            )
        )

        async def resolver(name: str, port: int) -> list[Any]:
            return [ip_address("127.0.0.1")] if name == NAME else []

        self.proxy = EgressProxy(self.home / "ca", resolver=resolver, connect_timeout=5)
        self.broker = Broker(Handlers.for_proxy(self.proxy), os.urandom(32)).start()
        self.backends = [b for b in args.backends if get_driver(b).status().available]
        self.skipped = [b for b in args.backends if b not in self.backends]
        self.runs = 0

    def close(self) -> None:
        self.broker.stop()
        if self.upstream.stdin is not None:
            self.upstream.stdin.close()
        self.upstream.wait(timeout=10)
        self.ledger.close()
        self.store.close()
        shutil.rmtree(self.home, ignore_errors=True)

    def scope(self) -> RunScope:
        self.runs += 1
        run = f"r{self.runs}"
        return RunScope(
            "acme", run, f"spiffe://bench.local/tenant/acme/deployment/churn/run/{run}",
            "churn", None, (), "sandbox", self.policies, self.ledger,
            allowed_ranges=("127.0.0.0/8",),
        )  # fmt: skip

    def config(self, paths: list[str], ca: str, dns: int) -> dict[str, Any]:
        a = self.args
        return {"name": NAME, "https": self.https, "http": self.http, "ca": ca,
                "paths": paths, "proxy_port": 3128, "warmup": a.warmup,
                "requests": a.requests // a.rounds, "bytes": a.megabytes * MiB,
                "transfers": a.transfers,
                "dns": dns}  # fmt: skip

    def direct(self) -> dict[str, Any]:
        cfg = self.config(["direct"], str(self.code / "ca.pem"), 0)
        done = subprocess.run(
            [self.python, str(self.code / "client.py")], env={"BENCH": json.dumps(cfg)},
            capture_output=True, timeout=600, check=False,
        )  # fmt: skip
        if done.returncode != 0:
            raise SystemExit(f"direct client failed: {done.stderr.decode()[-2000:]}")
        return dict(json.loads(done.stdout.decode().strip().splitlines()[-1]))

    def brokered(
        self, backend: str, argv: tuple[str, ...], env: dict[str, str], network: bool
    ) -> bytes:
        """One brokered sandbox run (with the run's network if ``network``); stdout."""
        scope = self.scope()
        channel = self.broker.open_run(scope, ttl=900)
        net = None
        out: list[bytes] = []
        err: list[bytes] = []
        try:
            if network:
                net = GuestNetwork.create()
                self.broker.attach_network(scope.run_id, net)
            limits = Limits(wall_seconds=600, memory_bytes=1 << 30, pids=256,
                            cpu=float(os.cpu_count() or 1))  # fmt: skip
            spec = brokered_spec(channel, argv, code_dir=self.code, env=env, limits=limits,
                                 network=net)  # fmt: skip
            result = get_driver(backend).run(spec, on_stdout=out.append, on_stderr=err.append)
        finally:
            self.broker.close_run(scope.run_id)
            if net is not None:
                net.close()
        if result.exit_code != 0:
            raise SystemExit(
                f"{backend} client failed ({result.exit_code}): "
                f"{b''.join(err).decode(errors='replace')[-2000:]}"
            )
        return b"".join(out)

    def guest(self, backend: str, dns: int) -> dict[str, Any]:
        """The client in a sandbox with the run's network; samples keyed path@backend."""
        cfg = self.config(["explicit", "socket", "transparent"], "/code/ca.pem", dns)
        argv = ("python3", "/code/client.py")
        out = self.brokered(backend, argv, {"BENCH": json.dumps(cfg)}, True)
        got = dict(json.loads(out.decode().strip().splitlines()[-1]))
        for kind in ("https", "http", "mbps"):
            got[kind] = {f"{k}@{backend}": v for k, v in got[kind].items()}
        got["dns"] = {f"new@{backend}": got["dns_new"], f"same@{backend}": got["dns_same"]}
        return got

    def network_costs(self) -> dict[str, list[float]]:
        """A run's network alone, attached, and in a whole brokered run (per backend)."""
        made: list[float] = []
        attached: list[float] = []
        for _ in range(self.args.networks):
            t = time.perf_counter()
            net = GuestNetwork.create()
            net.close()
            made.append((time.perf_counter() - t) * 1000)
        for _ in range(self.args.networks):
            scope = self.scope()
            self.broker.open_run(scope, ttl=60)
            net = GuestNetwork.create()
            try:
                t = time.perf_counter()
                self.broker.attach_network(scope.run_id, net)
                attached.append((time.perf_counter() - t) * 1000)
            finally:
                self.broker.close_run(scope.run_id)
                net.close()
        costs = {"made": made, "attached": attached}
        argv = ("python3", "-c", "pass")
        for backend in self.backends:
            for i in range(self.args.networks):
                # Alternating, so that load falls on both.
                for network in (i % 2 == 0, i % 2 != 0):
                    t = time.perf_counter()
                    self.brokered(backend, argv, {}, network)
                    key = f"{'with' if network else 'without'}@{backend}"
                    costs.setdefault(key, []).append((time.perf_counter() - t) * 1000)
        return costs


def report(bench: Bench, samples: dict[str, Any], costs: dict[str, list[float]]) -> None:
    a = bench.args
    names = {"bubblewrap": "bubblewrap", "gvisor": "gVisor"}
    if "gvisor" in bench.backends:
        # Every guest syscall's cost, and so these figures, depend on it.
        names["gvisor"] = f"gVisor ({getattr(get_driver('gvisor'), 'platform', '?')})"
    paths = [("direct", "direct (client on the host)")]
    for b in bench.backends:
        paths += [
            (f"explicit@{b}", f"{names[b]} guest: explicit proxy (the shim, then the socket)"),
            (f"socket@{b}", f"{names[b]} guest: the broker socket itself (no shim)"),
            (f"transparent@{b}", f"{names[b]} guest: transparent (redirected)"),
        ]
    n = len(samples["https"]["direct"])
    for kind, what in (
        ("https", "HTTPS GETs (connect + TLS + 2-byte body; CONNECT tunnel or redirected)"),
        ("http", "plain-HTTP GETs (absolute-form to the proxy, or redirected: egress.forward)"),
    ):
        base = pct(samples[kind]["direct"], 0.5)
        print(f"{n} {what}, one connection each, per path (ms):")
        print("| path | p50 | p95 | p99 | p50 vs direct |")
        print("|---|---:|---:|---:|---:|")
        for key, name in paths:
            xs = samples[kind][key]
            print(f"| {name} | {pct(xs, 0.5):.2f} | {pct(xs, 0.95):.2f} | {pct(xs, 0.99):.2f} "
                  f"| {pct(xs, 0.5) / base:.2f}x |")  # fmt: skip
        for b in bench.backends:
            e = pct(samples[kind][f"explicit@{b}"], 0.5)
            t = pct(samples[kind][f"transparent@{b}"], 0.5)
            print(f"{names[b]}: transparent vs explicit at p50: {t / e:.2f}x ({t - e:+.2f} ms)")
    direct_mbps = statistics.median(samples["mbps"]["direct"])
    direct_best = max(samples["mbps"]["direct"])
    count = len(samples["mbps"]["direct"])
    print(f"{a.megabytes} MiB HTTPS download on one connection, {count} per path (MiB/s):")
    print("| path | median | of direct | best | of direct | range |")
    print("|---|---:|---:|---:|---:|---:|")
    for key, name in paths:
        xs = samples["mbps"][key]
        mbps, best = statistics.median(xs), max(xs)
        print(f"| {name} | {mbps:.0f} | {100 * mbps / direct_mbps:.0f}% | {best:.0f} "
              f"| {100 * best / direct_best:.0f}% | {min(xs):.0f}-{best:.0f} |")  # fmt: skip
    print(f"A run's network ({len(costs['made'])} each):")
    print("| | p50 | p95 |")
    print("|---|---:|---:|")
    rows = [("made", "GuestNetwork.create() + close()"),
            ("attached", "Broker.attach_network() (relay sockets, DNS, listener)")]  # fmt: skip
    for b in bench.backends:
        rows += [
            (f"without@{b}", f"brokered {names[b]} run of `python3 -c pass`, no network"),
            (f"with@{b}", "the same with the run's network (create, attach, close)"),
        ]
    for key, name in rows:
        xs = costs[key]
        print(f"| {name} | {pct(xs, 0.5):.2f} ms | {pct(xs, 0.95):.2f} ms |")
    for b in bench.backends:
        w, wo = pct(costs[f"with@{b}"], 0.5), pct(costs[f"without@{b}"], 0.5)
        print(f"{names[b]}: the network adds {w - wo:.1f} ms to a run at p50 ({w / wo:.2f}x)")
    for b in bench.backends:
        dn, ds = samples["dns"][f"new@{b}"], samples["dns"][f"same@{b}"]
        print(f"DNS in a {names[b]} run (getaddrinfo, A and AAAA, answered by the broker, "
              f"{len(dn)} each): a new name p50 {pct(dn, 0.5):.2f} ms, "
              f"p95 {pct(dn, 0.95):.2f} ms; a name asked before p50 {pct(ds, 0.5):.2f} ms, "
              f"p95 {pct(ds, 0.95):.2f} ms")  # fmt: skip
    # What was measured went where it says: one decision per connection, by path.
    via: dict[str, int] = {}
    ends = 0
    for raw in bench.ledger.entries("acme"):
        event = json.loads(raw)
        if event["action"] == "http.request" and event["decision"] == "allow":
            key = event["details"].get("via", "proxy")
            via[key] = via.get(key, 0) + 1
        ends += event["action"] == "http.request.end"
    print(f"decisions recorded (allowed http.request): {via}; completion records: {ends}")
    for b in bench.skipped:
        print(f"{names[b]}: skipped (unavailable here)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=300, help="per path and kind")
    parser.add_argument("--megabytes", type=int, default=128, help="the large download")
    parser.add_argument("--rounds", type=int, default=3, help="alternations of the clients")
    parser.add_argument("--transfers", type=int, default=3, help="downloads per path and round")
    parser.add_argument("--networks", type=int, default=20, help="samples of a run's network")
    parser.add_argument("--dns", type=int, default=200, help="lookups in the run")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--backend", dest="backends", action="append",
                        choices=("bubblewrap", "gvisor"), help="default: both")  # fmt: skip
    parser.add_argument("--quick", action="store_true", help="small sizes, for a smoke run")
    args = parser.parse_args()
    args.backends = args.backends or ["bubblewrap", "gvisor"]
    if args.quick:
        args.requests, args.megabytes, args.rounds, args.transfers = 30, 16, 1, 1
        args.networks, args.dns, args.warmup = 4, 20, 2
    if not network_available():
        print("transparent egress: skipped (needs root, iproute2 and nftables)")
        return
    args.rounds = max(1, min(args.rounds, args.requests))
    bench = Bench(args)
    try:
        if not bench.backends:
            print("transparent egress: skipped (no sandbox backend available)")
            return
        samples: dict[str, Any] = {"https": {}, "http": {}, "mbps": {}, "dns": {}}
        for r in range(args.rounds):
            runs = [bench.direct()]
            for b in bench.backends:
                runs.append(bench.guest(b, args.dns if r == args.rounds - 1 else 0))
            for got in runs:
                for kind in ("https", "http", "mbps", "dns"):
                    for key, xs in got.get(kind, {}).items():
                        samples[kind].setdefault(key, []).extend(xs)
        costs = bench.network_costs()
        report(bench, samples, costs)
    finally:
        bench.close()


if __name__ == "__main__":
    main()
