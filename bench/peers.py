"""Proctor's egress against the proxies users would pick instead (issue 22, item 5).

``python bench/peers.py [--quick] [--rounds R] [--requests N] [--seconds S]
[--clients C] [--megabytes M] [--pause-us P] [--keep-peers]`` (as root, for
the peers; without root, or without gcc, what cannot be measured is skipped
and said so).

One run measures every target side by side, on loopback, with one native
client and one native upstream (``bench/peers/client.c``, ``upstream.c``,
built with gcc into a temporary directory):

- direct: the client straight to the upstream (the baseline of "added");
- squid and tinyproxy from Debian (installed with apt-get only when missing,
  each started on a port of its own with a minimal configuration in the
  temporary directory, logging every request as it does by default: squid's
  access log through its log daemon, buffered and never synced per request;
  tinyproxy's log at ``LogLevel Info``, Debian's default, with an fsync after
  every line, seven lines a request);
- Proctor's egress proxy alone, a real SQLite ledger with fsync under it (as
  ``bench/broker_proxy.py`` builds it), served on a TCP port by a process of
  its own;
- Proctor as a guest reaches it: the guest shim (``proctor.guest.shim``, its
  own process) bridging to a real broker's run socket (another process),
  which decides, records and proxies.

Each round measures every target, the order rotated each round, so that the
machine's noise falls on all of them: latency, the targets taking turns
request by request (one connection per request, one request at a time, an
untimed pause of P us after each), then, one target after another, requests
per second with C clients (each request on a connection of its own) and one
CONNECT download of M MiB (direct: the same GET without a proxy). It prints a
table and the ratios issue 22 names. Everything is stopped at the end (all of
it this script's children: the upstream, the Proctor servers and a guard
around each peer end when their stdin closes, so also when the bench dies, and
after an hour in any case). A peer the bench installed is purged again at the
end (the exact packages apt added) unless ``--keep-peers``; a service apt
started is stopped, and none is left enabled.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import pwd
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
SOURCES = HERE / "peers"
SQUID = "/usr/sbin/squid"
TINYPROXY = "/usr/bin/tinyproxy"
PACKAGES = ("squid", "tinyproxy")
#: Directories the packages' scripts make and their purge leaves behind.
LEFT_BY_PACKAGES = (Path("/run/squid"), Path("/run/tinyproxy"))
#: A peer's added latency under this (microseconds) is within the clock's reach of
#: nothing: no ratio is taken against it.
FLOOR_US = 10.0
#: How long a helper process may live at most, whatever happens to the bench.
LIFETIME = 3600


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def fsync_ms(directory: Path, count: int = 50) -> float:
    """The median time of appending a log line and syncing it, here: tinyproxy
    pays it seven times a request, one line at a time; Proctor's ledger syncs
    two events a request, several requests' to a commit under load."""
    path = directory / "fsync-probe"
    times = []
    with path.open("ab") as f:
        for _ in range(count):
            started = time.perf_counter()
            f.write(b"x" * 120 + b"\n")
            f.flush()
            os.fsync(f.fileno())
            times.append((time.perf_counter() - started) * 1000)
    path.unlink()
    return statistics.median(times)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_port(
    port: int, proc: subprocess.Popen[bytes] | None, what: str, timeout: float = 30
) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise SystemExit(f"{what} exited ({proc.returncode}) before it listened")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 1):
            return
        time.sleep(0.05)
    raise SystemExit(f"{what} did not listen on 127.0.0.1:{port} in {timeout:.0f} s")


# -- the Proctor servers (``--serve``), each a process of its own --------------


def _scope(home: Path, upstream: int) -> Any:
    from proctor.broker import RateLimit, RunScope
    from proctor.ledger import Actor, EventDraft, Ledger, Signer
    from proctor.policy import capability_policies, compile_policies
    from proctor.store import open_store

    store = open_store(str(home / "proctor.db"), create=True)
    ledger = Ledger(store, Signer.generate("bench.local"), "bench.local")
    ledger.create_log("acme", EventDraft(Actor("operator", "b"), "tenant.create", "tenant/acme"))
    policies = compile_policies(
        capability_policies("acme", "churn", {"egress": [f"127.0.0.1:{upstream}"]})
    )
    # The run's budget is raised out of the way: the bench measures the path, not
    # the default bound of 1,000 calls/s and 10,000 calls a run.
    return RunScope(
        "acme", "r1", "spiffe://bench.local/tenant/acme/deployment/churn/run/r1", "churn",
        None, (), "sandbox", policies, ledger, allowed_ranges=("127.0.0.0/8",),
        rate_limit=RateLimit(1e6, 1_000_000), call_bound=1 << 40,
    )  # fmt: skip


def _events(scope: Any) -> int:
    return int(scope.ledger.head("acme").size) - 1  # less tenant.create


def _until_stdin_closes() -> None:
    # A bench that dies closes the pipe; a wedged one is outlived by at most LIFETIME.
    timer = threading.Timer(LIFETIME, os._exit, (3,))
    timer.daemon = True
    timer.start()
    sys.stdin.buffer.read()


def guard(argv: list[str]) -> int:
    """Run a peer until this process's stdin closes (the bench stops it, or dies),
    the peer exits, or LIFETIME passes; then stop the peer. A peer that drops to
    its own user loses a parent-death signal, so this is what bounds its life."""
    child = subprocess.Popen(argv, stdin=subprocess.DEVNULL)
    watch = threading.Thread(target=sys.stdin.buffer.read, daemon=True)
    watch.start()
    deadline = time.monotonic() + LIFETIME
    while watch.is_alive() and child.poll() is None and time.monotonic() < deadline:
        watch.join(0.5)
    if child.poll() is None:
        child.terminate()
        try:
            child.wait(timeout=15)
        except subprocess.TimeoutExpired:
            child.kill()
    return child.wait()


def serve_alone(home: Path, upstream: int) -> None:
    """The egress proxy's handlers on a TCP port, as bench/broker_proxy.py runs them."""
    from proctor.broker import EgressProxy

    scope = _scope(home, upstream)
    proxy = EgressProxy(home / "ca")

    async def on_proxy(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            kept = True
            while kept:  # a kept-alive connection's requests, each a call of its own
                head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
                method, target, _ = head[0].split(" ")
                headers = [
                    (name.strip(), value.strip())
                    for name, _, value in (line.partition(":") for line in head[1:] if line)
                ]
                if method == "CONNECT":
                    await proxy.handle_connect(scope, target, reader, writer)
                    return
                kept = await proxy.handle_forward(
                    scope, method, target, headers, reader, writer, persistent=True
                )
        except (asyncio.IncompleteReadError, ConnectionError, ValueError):
            pass
        finally:
            writer.close()

    async def main() -> None:
        server = await asyncio.start_server(on_proxy, "127.0.0.1", 0, backlog=1024)
        port = server.sockets[0].getsockname()[1]
        print(json.dumps({"port": port}), flush=True)
        await asyncio.get_running_loop().run_in_executor(None, _until_stdin_closes)
        server.close()
        await asyncio.sleep(0.3)  # the last completion records

    import uvloop  # the broker's own loop (broker/_server.py)

    uvloop.run(main())
    print(json.dumps({"events": _events(scope)}), flush=True)
    scope.ledger.close()


def serve_broker(home: Path, upstream: int) -> None:
    """A real broker serving one run's socket; prints the socket and the token."""
    from proctor.broker import Broker, EgressProxy, Handlers

    scope = _scope(home, upstream)
    broker = Broker(Handlers.for_proxy(EgressProxy(home / "ca")), os.urandom(32)).start()
    try:
        channel = broker.open_run(scope, ttl=LIFETIME)
        print(json.dumps({"socket": str(channel.socket), "token": channel.token}), flush=True)
        _until_stdin_closes()
        time.sleep(0.3)  # the last completion records
    finally:
        broker.stop()
    print(json.dumps({"events": _events(scope)}), flush=True)
    scope.ledger.close()


# -- the peers -----------------------------------------------------------------


def _installed() -> dict[str, str]:
    out = subprocess.run(
        ["dpkg-query", "-W", "-f", "${Package}:${Architecture}\t${Status}\n"],
        capture_output=True, text=True, check=False,
    ).stdout  # fmt: skip
    return {name: status for name, _, status in (line.partition("\t") for line in out.splitlines())}


def _peer_pids() -> set[int]:
    pids = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if os.readlink(entry / "exe") in (SQUID, TINYPROXY):
                    pids.add(int(entry.name))
    return pids


@dataclass
class Installation:
    """What the bench did to the host to have the peers, so it can undo it."""

    added: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    #: Of LEFT_BY_PACKAGES, those that were not there before the install.
    made: list[Path] = field(default_factory=list)


def install_peers() -> Installation:
    done = Installation()
    missing = [p for p, b in zip(PACKAGES, (SQUID, TINYPROXY), strict=True) if not Path(b).exists()]
    if not missing:
        return done
    if os.geteuid() != 0:
        done.notes.append(f"not root: cannot install {', '.join(missing)}; skipped")
        return done
    before = {k for k, v in _installed().items() if "ok installed" in v}
    done.made = [p for p in LEFT_BY_PACKAGES if not p.exists()]
    running = _peer_pids()
    # Services must not start from the package scripts: a policy-rc.d that says
    # so, for the length of the install, unless the host already has one.
    guard = Path("/usr/sbin/policy-rc.d")
    placed = not guard.exists()
    if placed:
        guard.write_text("#!/bin/sh\nexit 101\n")
        guard.chmod(0o755)
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    cmd = ["apt-get", "install", "-y", "-q", "--no-install-recommends", *missing]
    try:
        print(f"installing {' '.join(missing)} (apt-get) for the bench...", flush=True)
        got = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
        if got.returncode != 0:
            subprocess.run(["apt-get", "update", "-q"], env=env, capture_output=True, check=False)
            got = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    finally:
        if placed:
            guard.unlink()
    after = {k for k, v in _installed().items() if "ok installed" in v}
    done.added = sorted(after - before)
    if got.returncode != 0:
        done.notes.append(f"apt-get install failed: {got.stderr.strip()[-300:]}")
    # Whatever apt started anyway is stopped, and nothing is left enabled.
    for pid in _peer_pids() - running:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGTERM)
        done.notes.append(f"stopped pid {pid}, started by the package scripts")
    disable_services(missing)
    return done


def disable_services(names: list[str]) -> None:
    if Path("/run/systemd/system").exists():
        for name in names:
            subprocess.run(
                ["systemctl", "disable", "--now", name], capture_output=True, check=False
            )
    elif shutil.which("update-rc.d"):
        for name in names:
            if Path(f"/etc/init.d/{name}").exists():
                subprocess.run(["update-rc.d", name, "disable"], capture_output=True, check=False)


def remove_peers(done: Installation) -> None:
    if not done.added:
        return
    names = [p.split(":")[0] for p in done.added]
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    got = subprocess.run(
        ["apt-get", "purge", "-y", "-q", *names], env=env, capture_output=True, text=True,
        check=False,
    )  # fmt: skip
    state = "purged" if got.returncode == 0 else f"purge failed: {got.stderr.strip()[-200:]}"
    if got.returncode == 0:
        for path in done.made:
            shutil.rmtree(path, ignore_errors=True)
    print(f"the bench's own packages ({len(names)}): {state}")


def version(argv: list[str]) -> str:
    out = subprocess.run(argv, capture_output=True, text=True, check=False)
    text = (out.stdout or out.stderr).strip().splitlines()
    return text[0] if text else "?"


# -- targets -------------------------------------------------------------------


@dataclass
class Target:
    name: str
    label: str
    port: int
    mode: str  # "direct" or "proxy"
    lat: list[float] = field(default_factory=list)
    lat_rounds: list[float] = field(default_factory=list)  # p50 per round
    rps: list[float] = field(default_factory=list)
    keep_lat: list[float] = field(default_factory=list)  # requests on kept-alive connections
    keep_connections: int = 0
    mbps: list[float] = field(default_factory=list)
    errors: int = 0
    requests: int = 0  # sent in all, the warm-up's included
    logged: str = ""


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.tmp = Path(tempfile.mkdtemp(prefix="proctor-peers-"))
        # The peers drop to their own users: they must reach their directories.
        self.tmp.chmod(0o755)
        self.children: list[subprocess.Popen[bytes]] = []
        self.targets: list[Target] = []
        self.finals: dict[str, subprocess.Popen[bytes]] = {}
        self.notes: list[str] = []
        self.load = os.getloadavg()
        self.fsync = (fsync_ms(self.tmp), 0.0)
        self.upstream = 0

    # helpers

    def spawn(self, argv: list[str], **kw: Any) -> subprocess.Popen[bytes]:
        proc = subprocess.Popen(argv, **kw)
        self.children.append(proc)
        return proc

    def build(self) -> None:
        for name in ("client", "upstream"):
            subprocess.run(
                ["gcc", "-O2", "-Wall", "-pthread", "-o", str(self.tmp / name),
                 str(SOURCES / f"{name}.c")], check=True,
            )  # fmt: skip

    def client(self, *argv: str, timeout: float) -> dict[str, Any]:
        done = subprocess.run(
            [str(self.tmp / "client"), *argv], capture_output=True, timeout=timeout, check=False
        )
        if done.returncode != 0:
            raise SystemExit(f"client {' '.join(argv)} failed: {done.stderr.decode()[-500:]}")
        return dict(json.loads(done.stdout))

    # starting

    def start_upstream(self) -> int:
        proc = self.spawn(
            [str(self.tmp / "upstream"), str(LIFETIME)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        )  # fmt: skip
        assert proc.stdout is not None
        self.upstream = int(proc.stdout.readline())
        return self.upstream

    def start_squid(self) -> None:
        port = free_port()
        d = self.tmp / "squid"
        d.mkdir()
        (d / "squid.conf").write_text(
            f"""# Minimal: Debian's defaults, less the port rules (CONNECT to any port)
http_port 127.0.0.1:{port}
http_access allow localhost
http_access deny all
# Measure the forwarding, not the cache (the upstream's answers carry no validators).
cache deny all
visible_hostname bench.local
pid_filename {d}/squid.pid
cache_log {d}/cache.log
# Debian's default access log: through the log daemon, buffered, never synced.
access_log daemon:{d}/access.log squid
coredump_dir {d}
netdb_filename none
# No ICMP helper: it can outlive squid, and loopback has nothing to measure.
pinger_enable off
shutdown_lifetime 1 seconds
"""
        )
        proxy = pwd.getpwnam("proxy")
        os.chown(d, proxy.pw_uid, proxy.pw_gid)
        proc = self.spawn([sys.executable, __file__, "--guard", SQUID, "-N", "-f",
                           str(d / "squid.conf")], stdin=subprocess.PIPE,
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
        try:
            wait_port(port, proc, "squid")
        except SystemExit as exc:
            log = (
                (d / "cache.log").read_text(errors="replace") if (d / "cache.log").exists() else ""
            )
            raise SystemExit(f"{exc}; its cache.log ends:\n{log[-1000:]}") from None
        self.targets.append(
            Target(
                "squid", version([SQUID, "-v"]).replace("Squid Cache: ", "squid "), port, "proxy"
            )
        )

    def start_tinyproxy(self) -> None:
        port = free_port()
        d = self.tmp / "tinyproxy"
        d.mkdir()
        (d / "tinyproxy.conf").write_text(
            f"""# Minimal: Debian's defaults, less ConnectPort (CONNECT to any port)
User nobody
Group nogroup
Port {port}
Listen 127.0.0.1
Timeout 600
LogFile "{d}/tinyproxy.log"
LogLevel Info
PidFile "{d}/tinyproxy.pid"
MaxClients 100
Allow 127.0.0.1
ViaProxyName "tinyproxy"
"""
        )
        nobody = pwd.getpwnam("nobody")
        os.chown(d, nobody.pw_uid, nobody.pw_gid)
        proc = self.spawn([sys.executable, __file__, "--guard", TINYPROXY, "-d", "-c",
                           str(d / "tinyproxy.conf")], stdin=subprocess.PIPE,
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
        wait_port(port, proc, "tinyproxy")
        self.targets.append(Target("tinyproxy", version([TINYPROXY, "-v"]), port, "proxy"))

    def serve(self, kind: str) -> tuple[subprocess.Popen[bytes], dict[str, Any]]:
        home = self.tmp / f"proctor-{kind}"
        home.mkdir(mode=0o700)
        proc = self.spawn(
            [sys.executable, __file__, "--serve", kind, "--upstream", str(self.upstream),
             "--home", str(home)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        )  # fmt: skip
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if not line:
            raise SystemExit(f"the Proctor {kind} server did not start")
        self.finals[kind] = proc
        return proc, dict(json.loads(line))

    def start_proctor(self) -> None:
        proc, got = self.serve("alone")
        wait_port(int(got["port"]), proc, "Proctor's proxy")
        self.targets.append(
            Target("proctor-proxy", "Proctor's proxy alone, real ledger", int(got["port"]), "proxy")
        )
        _, run = self.serve("broker")
        port = free_port()
        env = dict(os.environ, PROCTOR_BROKER=run["socket"], PROCTOR_TOKEN=run["token"],
                   PROCTOR_PROXY_PORT=str(port))  # fmt: skip
        # The entrypoint waits for its stdin to close; the shim outlives it by nothing.
        wait = "import sys; sys.stdin.read()"
        shim = self.spawn(
            [sys.executable, "-m", "proctor.guest.shim", "--", sys.executable, "-c", wait],
            stdin=subprocess.PIPE, env=env,
        )  # fmt: skip
        wait_port(port, shim, "the guest shim")
        self.targets.append(
            Target("proctor-guest", "Proctor as a guest reaches it (shim + broker)", port, "proxy")
        )

    # measuring

    def measure(self) -> None:
        a = self.args
        up = f"127.0.0.1:{self.upstream}"
        direct = Target("direct", "direct (no proxy)", self.upstream, "direct")
        self.targets.insert(0, direct)
        for t in self.targets:  # warm up: connections, caches, the tenant's first events
            self.client("lat", "127.0.0.1", str(t.port), t.mode, up, "20", timeout=120)
            self.client("tunnel", "127.0.0.1", str(t.port), t.mode, up, "1", timeout=120)
            t.requests += 21
        n = len(self.targets)
        for r in range(a.rounds):
            order = [self.targets[(i + r) % n] for i in range(n)]
            print(f"round {r + 1}/{a.rounds}: {', '.join(t.name for t in order)}", flush=True)
            # Latency: the targets take turns request by request.
            got = self.client("mix", "127.0.0.1", up, str(a.requests), str(a.pause_us),
                              *(f"{t.port}:{t.mode}" for t in order), timeout=900)  # fmt: skip
            for t, lat, errors in zip(order, got["lat_us"], got["errors"], strict=True):
                t.lat += lat
                t.lat_rounds.append(pct(lat, 0.5) if lat else float("nan"))
                t.errors += errors
                t.requests += a.requests
            # Keep-alive: the same requests, each target's on one connection if it
            # keeps it (each request still decided and recorded on its own).
            got = self.client("keep", "127.0.0.1", up, str(a.requests),
                              *(f"{t.port}:{t.mode}" for t in order), timeout=900)  # fmt: skip
            for t, lat, errors, conns in zip(order, got["lat_us"], got["errors"],
                                             got["connections"], strict=True):  # fmt: skip
                t.keep_lat += lat
                t.keep_connections += conns
                t.errors += errors
                t.requests += a.requests
            for t in order:
                got = self.client("rps", "127.0.0.1", str(t.port), t.mode, up,
                                  str(a.clients), str(int(a.seconds * 1000)),
                                  timeout=a.seconds + 120)  # fmt: skip
                t.rps.append(got["done"] / got["seconds"])
                t.errors += got["errors"]
                t.requests += got["done"] + got["errors"]
                time.sleep(0.2)  # the last completions of this load, before the next target
            for t in order:
                got = self.client("tunnel", "127.0.0.1", str(t.port), t.mode, up,
                                  str(a.megabytes), timeout=600)  # fmt: skip
                t.errors += got["errors"]
                t.requests += 1
                if not got["errors"]:
                    t.mbps.append(got["bytes"] / (1 << 20) / got["seconds"])

    # stopping

    def stop(self) -> None:
        self.fsync = (self.fsync[0], fsync_ms(self.tmp))
        for proc in reversed(self.children):
            if proc.poll() is not None:
                continue
            if proc.stdin is not None:
                with contextlib.suppress(OSError):
                    proc.stdin.close()
            else:
                proc.terminate()
            try:
                proc.wait(timeout=30)  # a guard gives its peer 15 s
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.reap_helpers()
        named = {"alone": "proctor-proxy", "broker": "proctor-guest"}
        counts: dict[str, tuple[int, str]] = {}
        for kind, proc in self.finals.items():
            assert proc.stdout is not None
            for line in proc.stdout.read().splitlines():
                counts[named[kind]] = (json.loads(line)["events"], "events in its ledger")
        counts["squid"] = (_lines(self.tmp / "squid" / "access.log"), "access.log lines")
        counts["tinyproxy"] = (
            _lines(self.tmp / "tinyproxy" / "tinyproxy.log"),
            "log lines, each fsynced",
        )
        for t in self.targets:
            if t.name in counts and t.requests:
                n, what = counts[t.name]
                t.logged = f"{n:,} {what}, {n / t.requests:.1f} a request"

    def reap_helpers(self, timeout: float = 10) -> None:
        """Wait for the peers' helpers (squid's log daemon finishing its writes)
        to go; stop any still there. Found by this run's own directory in their
        command lines, so nothing else on the machine is touched."""
        mark = str(self.tmp).encode()
        deadline = time.monotonic() + timeout
        while True:
            left = []
            for entry in Path("/proc").iterdir():
                if entry.name.isdigit() and int(entry.name) != os.getpid():
                    with contextlib.suppress(OSError):
                        if mark in (entry / "cmdline").read_bytes():
                            left.append(int(entry.name))
            if not left:
                return
            if time.monotonic() > deadline:
                for pid in left:
                    with contextlib.suppress(OSError):
                        os.kill(pid, signal.SIGKILL)
                self.notes.append(f"stopped {len(left)} peer helper(s) that outlived their peer")
                return
            time.sleep(0.1)

    def cleanup(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)

    # reporting

    def report(self) -> None:
        a = self.args
        by = {t.name: t for t in self.targets}
        base = pct(by["direct"].lat, 0.5)
        base_mbps = statistics.median(by["direct"].mbps) if by["direct"].mbps else float("nan")
        print()
        print(f"{a.rounds} rounds, the targets' order rotated each round; per round and "
              f"target: {a.requests} requests one at a time (the targets taking turns request "
              f"by request), {a.clients} clients for {a.seconds:g} s, one {a.megabytes} MiB "
              f"CONNECT download; the same requests again on kept-alive connections. Otherwise "
              f"every request on a connection of its own. Load average "
              f"{self.load[0]:.2f} before, {os.getloadavg()[0]:.2f} after; "
              f"{os.cpu_count()} CPUs; a log line appended and fsynced in the run's "
              f"directory: {self.fsync[0]:.2f} ms before, {self.fsync[1]:.2f} ms after "
              f"(median of 50).")  # fmt: skip
        print()
        print("| path | p50 | p95 | p99 | added p50 | kept alive: p50, connections | req/s, "
              f"{a.clients} clients | CONNECT {a.megabytes} MiB | errors | logged |")  # fmt: skip
        print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---|")
        for t in self.targets:
            if not t.lat:
                print(f"| {t.label} | — | — | — | — | — | — | — | {t.errors} | {t.logged} |")
                continue
            p50 = pct(t.lat, 0.5)
            added = "—" if t.name == "direct" else f"{(p50 - base) / 1000:.2f} ms"
            tunnel = "failed"
            if t.mbps:
                mbps = statistics.median(t.mbps)
                share = "" if t.name == "direct" else f" ({100 * mbps / base_mbps:.0f}%)"
                tunnel = f"{mbps:,.0f} MB/s{share}"
            kept = "—"
            if t.keep_lat:
                kept = (f"{pct(t.keep_lat, 0.5) / 1000:.2f} ms, {t.keep_connections:,} for "
                        f"{a.requests * a.rounds:,}")  # fmt: skip
            print(f"| {t.label} | {p50 / 1000:.2f} ms | {pct(t.lat, 0.95) / 1000:.2f} ms | "
                  f"{pct(t.lat, 0.99) / 1000:.2f} ms | {added} | {kept} | "
                  f"{statistics.median(t.rps):,.0f} | {tunnel} | {t.errors} | "
                  f"{t.logged} |")  # fmt: skip
        print()
        print("Latency: all samples of the run; added: over direct's p50. Kept alive: the "
              "same requests, each target's on one connection while it keeps it, and the "
              "connections that took. req/s and MB/s: the median of the rounds. squid keeps "
              "its upstream connections alive (its default); tinyproxy and Proctor open one "
              "per request upstream. Ratios, with issue 22's "
              "targets and the range over the rounds:")  # fmt: skip
        for name in ("proctor-guest", "proctor-proxy"):
            if name not in by or not by[name].lat:
                continue
            t = by[name]
            print(f"- {t.label}:")
            for peer, bound in (("tinyproxy", 1.5), ("squid", 2.0)):
                if peer in by and by[peer].lat:
                    print(f"  - added latency p50 vs {peer}: "
                          f"{self.added_ratio(t, by[peer], base)} (target <= {bound:g}x; "
                          f"{self.round_range(t, by[peer], by['direct'])})")  # fmt: skip
            if "tinyproxy" in by and min(by["tinyproxy"].rps, default=0) > 0:
                ratios = [x / y for x, y in zip(t.rps, by["tinyproxy"].rps, strict=True)]
                print(f"  - req/s with {a.clients} clients vs tinyproxy: "
                      f"{statistics.median(t.rps) / statistics.median(by['tinyproxy'].rps):.2f}x "
                      f"(target >= 1x; rounds {min(ratios):.2f}-{max(ratios):.2f})")  # fmt: skip
            if t.mbps and by["direct"].mbps:
                print(
                    f"  - CONNECT throughput vs direct: "
                    f"{statistics.median(t.mbps) / base_mbps:.2f}x (target >= 0.8x)"
                )
        for note in self.notes:
            print(f"note: {note}")

    @staticmethod
    def added_ratio(t: Target, peer: Target, base: float) -> str:
        mine, theirs = pct(t.lat, 0.5) - base, pct(peer.lat, 0.5) - base
        if theirs < FLOOR_US:
            return f"n/a ({peer.name} adds under {FLOOR_US:g} us)"
        return f"{mine / theirs:.2f}x"

    @staticmethod
    def round_range(t: Target, peer: Target, direct: Target) -> str:
        ratios = [
            (x - d) / (y - d)
            for x, y, d in zip(t.lat_rounds, peer.lat_rounds, direct.lat_rounds, strict=True)
            if y - d >= FLOOR_US
        ]
        if not ratios:
            return "no round measurable"
        return f"rounds {min(ratios):.2f}-{max(ratios):.2f}"


def _lines(path: Path) -> int:
    try:
        return len(path.read_bytes().splitlines())
    except OSError:
        return 0


@contextlib.contextmanager
def terminated_as_exit() -> Iterator[None]:
    """SIGTERM and SIGHUP unwind like an exception, so every child is stopped."""

    def stop(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)

    old = {s: signal.signal(s, stop) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)


def run(args: argparse.Namespace) -> int:
    if shutil.which("gcc") is None:
        print("peers: gcc is needed to build the native client and upstream; skipped")
        return 0
    installation = Installation()
    bench = Bench(args)
    with terminated_as_exit():
        try:
            installation = install_peers()
            bench.notes += installation.notes
            bench.build()
            bench.start_upstream()
            if Path(SQUID).exists() and os.geteuid() == 0:
                bench.start_squid()
            else:
                bench.notes.append("squid not measured (not installed, or not root)")
            if Path(TINYPROXY).exists() and os.geteuid() == 0:
                bench.start_tinyproxy()
            else:
                bench.notes.append("tinyproxy not measured (not installed, or not root)")
            bench.start_proctor()
            bench.measure()
        finally:
            bench.stop()
            if not args.keep_peers:
                remove_peers(installation)
            bench.cleanup()
    bench.report()
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a short run")
    parser.add_argument("--rounds", type=int)
    parser.add_argument("--requests", type=int, help="latency requests per round and target")
    parser.add_argument("--seconds", type=float, help="load per round and target")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--megabytes", type=int)
    parser.add_argument("--pause-us", type=int, default=5000,
                        help="untimed pause after each latency request (microseconds)")  # fmt: skip
    parser.add_argument("--keep-peers", action="store_true",
                        help="leave squid and tinyproxy installed (services disabled)")  # fmt: skip
    parser.add_argument("--serve", choices=("alone", "broker"), help=argparse.SUPPRESS)
    parser.add_argument("--guard", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    parser.add_argument("--upstream", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--home", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.guard:
        return guard(args.guard)
    if args.serve:
        (serve_alone if args.serve == "alone" else serve_broker)(args.home, args.upstream)
        return 0
    quick = {"rounds": 2, "requests": 50, "seconds": 1.0, "megabytes": 100}
    full = {"rounds": 5, "requests": 200, "seconds": 3.0, "megabytes": 100}
    for key, value in (quick if args.quick else full).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if min(args.rounds, args.requests, args.clients, args.megabytes) < 1 or args.seconds <= 0:
        parser.error("rounds, requests, clients, megabytes and seconds must be positive")
    if not 0 <= args.pause_us <= 1_000_000:
        parser.error("--pause-us is 0 to 1000000")
    if args.clients > 256:
        parser.error("at most 256 clients")
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
