"""The load soak's workload, shared by ``bench/soak.py`` and ``tests/faults/test_load.py``.

A real governed runtime (SQLite store, signed ledger, the real broker, the
default sandbox backend) runs waves of N concurrent production runs of one
approved artifact. Each run makes M mediated calls in a fixed pattern: SQL
reads of a real SQLite dataset and plain-HTTP requests through the broker's
proxy to a real loopback server, some of them designed to be denied (a column
that was not approved, a path the tenant forbids, a host the artifact never
asked for). Every call carries an id (``<run>.<i>``) that reaches the ledger:
in an SQL literal (the ledger keeps the statement's keyed hash, which the host
recomputes) or in the URL path (kept as ``details.path``). The guest answers
with a JSON line naming every call, its outcome and its latency.

:func:`check_wave` then proves, call by call, that the guest, the ledger, the
policy and the upstream server agree: exactly one decision event per call (no
call without one, no event without a call, no duplicate), each decision the
policy's, each answer the guest got the one the ledger records, and nothing
that was denied ever reached the upstream server.
"""

from __future__ import annotations

import asyncio
import gc
import hashlib
import hmac
import json
import os
import sqlite3
import sys
import textwrap
import threading
import time
from array import array
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from proctor.broker import Broker
from proctor.lifecycle import RunRecord, Supervisor
from proctor.runtime import Runtime, init_home

SOAK = os.environ.get("PROCTOR_SOAK") == "1"
TENANT = "acme"
DEPLOYMENT = "soak"
DATASET = "crm"
ROWS = 500
PRIVATE_RULE = "soak:no-private-path"

#: One cycle of the calls every run makes; call i is PATTERN[i % len(PATTERN)].
#: Four permitted reads, three permitted requests, three designed refusals.
PATTERN = (
    "sql",
    "http",
    "sql",
    "sql_column",
    "http",
    "sql",
    "http_path",
    "http",
    "sql",
    "http_host",
)
#: The statements, with the call's id as a literal so each one's keyed hash in the
#: ledger is unique and the answer names the call it answers.
SQL = {
    "sql": "SELECT id, country, plan, '{cid}' AS call FROM customers WHERE id = ?",
    "sql_column": "SELECT id, email, '{cid}' AS call FROM customers WHERE id = ?",
}
#: ``ok`` is the approved upstream; ``other`` is a second real server the
#: artifact never asked for (so a wrong allow would really reach it).
URLS = {
    "http": "http://127.0.0.1:{ok}/ok/{cid}",
    "http_path": "http://127.0.0.1:{ok}/private/{cid}",
    "http_host": "http://127.0.0.1:{other}/ok/{cid}",
}

GUEST = textwrap.dedent(
    """\
    import json, os, time, urllib.error, urllib.request
    import proctor_guest

    RUN = os.environ["PROCTOR_RUN"]
    CALLS = int(os.environ["SOAK_CALLS"])
    PORTS = {"ok": int(os.environ["SOAK_OK_PORT"]), "other": int(os.environ["SOAK_OTHER_PORT"])}
    PATTERN = %(pattern)r
    SQL = %(sql)r
    URLS = %(urls)r
    ROWS = %(rows)d
    opener = urllib.request.build_opener()  # HTTP_PROXY from the shim: the broker

    def one(i, kind, cid):
        try:
            if kind in SQL:
                n = i %% ROWS + 1
                rows = proctor_guest.sql("crm", SQL[kind].format(cid=cid), [n])["rows"]
                if len(rows) == 1 and rows[0][0] == n and rows[0][-1] == cid:
                    return "ok"
                return "wrong answer: " + json.dumps(rows)[:120]
            url = URLS[kind].format(cid=cid, **PORTS)
            with opener.open(url, timeout=120) as r:
                body = r.read().decode()
            if r.status == 200 and body == "ok /" + url.split("/", 3)[3]:
                return "ok"
            return "wrong answer: " + body[:120]
        except proctor_guest.Denied as e:
            return "denied" if e.code == "denied" else "error:" + e.code
        except proctor_guest.GuestError as e:
            return "error:" + e.code
        except urllib.error.HTTPError as e:
            try:
                code = json.loads(e.read())["error"]
            except Exception:
                code = "?"
            if (e.code, code) == (403, "denied"):
                return "denied"
            return "error:%%d:%%s" %% (e.code, code)
        except Exception as e:
            return "error:%%s: %%s" %% (type(e).__name__, str(e)[:120])

    calls = []
    for i in range(CALLS):
        kind = PATTERN[i %% len(PATTERN)]
        cid = "%%s.%%d" %% (RUN, i)
        t0 = time.perf_counter()
        outcome = one(i, kind, cid)
        calls.append([cid, kind, outcome, round((time.perf_counter() - t0) * 1e6)])
    print(json.dumps({"run": RUN, "calls": calls}), flush=True)
    """
) % {"pattern": PATTERN, "sql": SQL, "urls": URLS, "rows": ROWS}


def expected(kind: str, egress_policy: str) -> tuple[str, tuple[str, ...]]:
    """What the policy must decide for a call of ``kind``: decision and deciding policies.

    Written from the policy, not from what the broker did: the artifact
    approves ``id, country, plan`` and one upstream host:port; the tenant
    forbids ``/private/*``; nothing permits a column or host it did not name.
    """
    return {
        "sql": ("allow", (f"deploy:{DEPLOYMENT}:sql:{DATASET}.customers",)),
        "sql_column": ("deny", ()),
        "http": ("allow", (egress_policy,)),
        "http_path": ("deny", (PRIVATE_RULE,)),
        "http_host": ("deny", ()),
    }[kind]


# -- the upstream: a real loopback HTTP server ---------------------------------


class Upstream:
    """A minimal asyncio HTTP/1.1 server on 127.0.0.1 that answers ``ok <path>`` and
    remembers every path it was asked for (what actually got out of the sandbox)."""

    def __init__(self) -> None:
        self.paths: list[str] = []
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="soak-upstream", daemon=True
        )
        self._thread.start()
        self._server = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(self._handle, "127.0.0.1", 0, backlog=512), self._loop
        ).result(10)
        self.port: int = self._server.sockets[0].getsockname()[1]

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            path = head.split(b" ", 2)[1].decode()
            self.paths.append(path)
            body = f"ok {path}".encode()
            writer.write(
                b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nConnection: close\r\n"
                + f"Content-Length: {len(body)}\r\n\r\n".encode()
                + body
            )
            await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            pass
        finally:
            writer.close()

    def take(self) -> list[str]:
        """The paths received since the last call, oldest first."""
        out, self.paths = self.paths, []
        return out

    def close(self) -> None:
        async def stop() -> None:
            self._server.close()
            await self._server.wait_closed()

        asyncio.run_coroutine_threadsafe(stop(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()


# -- memory ----------------------------------------------------------------------


def rss_bytes() -> int:
    """This process's resident set (VmRSS), in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


class RssSampler:
    """Samples VmRSS every ``interval`` seconds in a thread, for a wave's peak."""

    def __init__(self, interval: float = 0.05) -> None:
        self.peak = rss_bytes()
        self._interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="soak-rss", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            self.peak = max(self.peak, rss_bytes())

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_bytes())
        return self.peak


@dataclass(frozen=True)
class Memory:
    """The runtime process after a wave, once garbage is collected."""

    rss: int
    blocks: int  # sys.getallocatedblocks(): every live Python allocation
    fds: int
    threads: int

    @classmethod
    def now(cls) -> Memory:
        gc.collect()
        return cls(
            rss_bytes(),
            sys.getallocatedblocks(),
            len(os.listdir("/proc/self/fd")),
            threading.active_count(),
        )


# -- the runtime -------------------------------------------------------------------


def _make_dataset(path: Path) -> None:
    db = sqlite3.connect(path)
    db.execute(
        "CREATE TABLE customers (id INTEGER PRIMARY KEY, name TEXT, email TEXT,"
        " country TEXT, plan TEXT, mrr REAL)"
    )
    db.executemany(
        "INSERT INTO customers VALUES (?, ?, ?, ?, ?, ?)",
        [
            (i, f"Name {i}", f"user{i}@example.com", ("DE", "FR", "US")[i % 3],
             ("free", "pro", "team")[i % 3], float(i % 300))
            for i in range(1, ROWS + 1)
        ],
    )  # fmt: skip
    db.commit()
    db.close()


@dataclass
class Call:
    """One guest call as the host expects it."""

    id: str
    run: str
    kind: str
    decision: str
    policies: tuple[str, ...]
    key: tuple[str, str]  # how its decision event is found: ("sql", hmac) or ("http", port+path)


@dataclass
class WaveResult:
    index: int
    runs: list[RunRecord]
    summaries: dict[str, list[list[Any]]]  # run id -> [[call id, kind, outcome, µs], ...]
    upstream_paths: list[str]
    other_paths: list[str]
    first_seq: int
    end_seq: int
    wall: float
    rss_start: int
    rss_peak: int
    cpu_self: float  # seconds of CPU of this process (supervisor, broker, ledger)
    cpu_children: float  # seconds of CPU of the sandboxes it waited for

    @property
    def calls(self) -> int:
        return sum(len(c) for c in self.summaries.values())

    def latencies_us(self) -> list[int]:
        return [int(c[3]) for calls in self.summaries.values() for c in calls]


@dataclass(frozen=True)
class WaveFigures:
    """What is kept of a wave once it is checked."""

    index: int
    runs: int
    calls: int
    events: int
    wall: float
    p50_us: float
    p99_us: float
    by_kind_us: dict[str, tuple[float, float]]
    rss_start: int
    rss_peak: int
    after: Memory
    cpu_self: float
    cpu_children: float
    outcomes: dict[str, int]
    problems: int
    latencies_us: array[int]  # every call's, as the guest timed it (compact: 4 bytes each)


@dataclass
class WaveCheck:
    problems: list[str] = field(default_factory=list)
    events: int = 0
    by_outcome: Counter[str] = field(default_factory=Counter)

    def fail(self, message: str) -> None:
        if len(self.problems) < 50:
            self.problems.append(message)


class Soak:
    """A governed runtime with one approved soak deployment, ready for waves."""

    def __init__(self, tmp: Path, runs: int, calls: int) -> None:
        self.runs_per_wave = runs
        self.calls_per_run = calls
        self.home = tmp / "home"
        init_home(self.home)
        self.rt = Runtime.open(self.home)
        rt, op = self.rt, self.rt.operator
        rt.tenants.create(TENANT, op)
        self.dev, _ = rt.principals.create(TENANT, "dev", "user", ["developer"], op)
        alice, _ = rt.principals.create(TENANT, "alice", "user", ["approver"], op)
        _make_dataset(tmp / "crm.db")
        rt.resources.add_dataset(TENANT, DATASET, tmp / "crm.db", op)
        self.upstream = Upstream()
        self.other = Upstream()
        ok, other = self.upstream.port, self.other.port
        # The loopback is special-purpose: the tenant must name it to reach its own servers.
        rt.allow_egress_range(TENANT, "127.0.0.1/32", op)
        # Both servers are registered recipients, so the refusal of ``other`` is the
        # artifact's capabilities speaking, not the register.
        rt.subprocessors.add(TENANT, "soak-upstream", purpose="load soak", location="loopback",
                             hosts=[f"127.0.0.1:{ok}", f"127.0.0.1:{other}"], actor=op)  # fmt: skip
        rt.policies.set(
            TENANT,
            f'@id("{PRIVATE_RULE}")\n'
            'forbid (principal, action == Proctor::Action::"http.request", resource)\n'
            'when { context has path && context.path like "/private/*" };\n',
            op,
        )
        self.egress_policy = f"deploy:{DEPLOYMENT}:egress:127.0.0.1:{ok}"
        art = tmp / "soak-artifact"
        art.mkdir(mode=0o755)
        (art / "main.py").write_text(GUEST)
        # Generous: a run's calls queue behind every other run's on two cores.
        timeout = max(120, calls * runs // 20)
        (art / "proctor.toml").write_text(
            textwrap.dedent(
                f"""\
                [artifact]
                name = "soak"
                entrypoint = ["python3", "main.py"]
                purpose = "load soak: mediated SQL and HTTP under concurrency"

                [datasets.{DATASET}.tables.customers]
                columns = ["id", "country", "plan"]
                access = "read"

                [egress]
                hosts = ["127.0.0.1:{ok}"]

                [limits]
                timeout = "{timeout}s"
                """
            )
        )
        for f in art.iterdir():
            f.chmod(0o644)
        digest = rt.artifacts.submit(TENANT, art, self.dev.actor).digest
        rt.approvals.grant(TENANT, digest, alice, comment="load soak")
        rt.deployments.deploy(TENANT, rt.artifacts.get(TENANT, digest), DEPLOYMENT,
                              environment="production", mode="job",
                              instruction="load soak (issue 9)", actor=self.dev.actor)  # fmt: skip
        self._lineage_key = rt.keys.lineage_key(TENANT)
        self.broker: Broker = rt.make_broker().start()
        self.supervisor = Supervisor(rt, self.broker)
        self.backend = self.supervisor.driver.name
        self.figures: list[WaveFigures] = []

    def close(self) -> None:
        self.broker.stop()
        self.upstream.close()
        self.other.close()
        self.rt.close()

    @contextmanager
    def opened(self) -> Iterator[Soak]:
        try:
            yield self
        finally:
            self.close()

    def _one_run(self) -> RunRecord:
        return self.supervisor.start(
            TENANT, DEPLOYMENT, self.dev.actor,
            env={"SOAK_CALLS": str(self.calls_per_run), "SOAK_OK_PORT": str(self.upstream.port),
                 "SOAK_OTHER_PORT": str(self.other.port)},
        )  # fmt: skip

    def wave(self) -> WaveResult:
        """N runs at once, each making M calls; returns once all have ended.

        The result holds every call's outcome; the caller drops it after checking
        (the soak keeps only :class:`WaveFigures`, so the harness does not grow)."""
        rss_start = rss_bytes()
        cpu_start = os.times()
        sampler = RssSampler()
        first_seq = self.rt.ledger.head(TENANT).size
        start = time.monotonic()
        with ThreadPoolExecutor(self.runs_per_wave, thread_name_prefix="soak-run") as pool:
            records = list(pool.map(lambda _: self._one_run(), range(self.runs_per_wave)))
        wall = time.monotonic() - start
        peak = sampler.stop()  # the runs' peak, before the harness reads and checks
        cpu = os.times()
        end_seq = self.rt.ledger.head(TENANT).size
        summaries: dict[str, list[list[Any]]] = {}
        for rec in records:
            out = (self.home / "runs" / rec.id / "stdout.log").read_text()
            lines = [line for line in out.splitlines() if line.startswith("{")]
            if lines:
                summaries[rec.id] = json.loads(lines[-1])["calls"]
        return WaveResult(
            len(self.figures) + 1, records, summaries, self.upstream.take(), self.other.take(),
            first_seq, end_seq, wall, rss_start, peak,
            cpu.user + cpu.system - cpu_start.user - cpu_start.system,
            cpu.children_user + cpu.children_system
            - cpu_start.children_user - cpu_start.children_system,
        )  # fmt: skip

    def run_wave(
        self, probe: Callable[[WaveResult], None] | None = None
    ) -> tuple[WaveFigures, WaveCheck]:
        """One wave, checked call by call, then memory sampled (every wave holds its
        result while it is sampled: the same harness state each time). ``probe``
        gets the wave's raw result after that."""
        wave = self.wave()
        chk = self.check_wave(wave)
        lat = wave.latencies_us()
        by_kind: dict[str, list[int]] = {}
        for calls in wave.summaries.values():
            for _cid, kind, _outcome, us in calls:
                by_kind.setdefault("sql" if kind.startswith("sql") else "http", []).append(us)
        fig = WaveFigures(
            wave.index, len(wave.runs), wave.calls, chk.events, wave.wall,
            pct(lat, 0.5), pct(lat, 0.99),
            {k: (pct(v, 0.5), pct(v, 0.99)) for k, v in sorted(by_kind.items())},
            wave.rss_start, wave.rss_peak, self.settled(), wave.cpu_self,
            wave.cpu_children, dict(chk.by_outcome), len(chk.problems), array("I", lat),
        )  # fmt: skip
        self.figures.append(fig)
        if probe is not None:
            probe(wave)
        return fig, chk

    def settled(self) -> Memory:
        """The process once the wave's threads are gone: one store read from a
        fresh thread first, because the store closes the readers of ended
        threads when the next reader connects (as a server's next request
        would), so each wave is measured in the same state."""
        t = threading.Thread(target=lambda: self.rt.ledger.head(TENANT), name="soak-settle")
        t.start()
        t.join()
        return Memory.now()

    def open_sockets(self) -> list[str]:
        """Run sockets still in the broker's directory (each run's is removed at its end)."""
        # The broker has no public accessor for its directory; the files are what count.
        return sorted(p.name for p in self.broker._root.iterdir())

    # -- proving it ------------------------------------------------------------

    def _sql_key(self, kind: str, cid: str) -> str:
        text = SQL[kind].format(cid=cid)
        return hmac.new(self._lineage_key, text.encode(), hashlib.sha256).hexdigest()[:32]

    def expected_calls(self, run_id: str) -> list[Call]:
        out = []
        for i in range(self.calls_per_run):
            kind = PATTERN[i % len(PATTERN)]
            cid = f"{run_id}.{i}"
            decision, policies = expected(kind, self.egress_policy)
            if kind in SQL:
                key = ("sql", self._sql_key(kind, cid))
            else:
                url = URLS[kind].format(cid=cid, ok=self.upstream.port, other=self.other.port)
                port, _, path = url.removeprefix("http://127.0.0.1:").partition("/")
                key = ("http", f"{port}/{path}")
            out.append(Call(cid, run_id, kind, decision, policies, key))
        return out

    def check_wave(self, wave: WaveResult, events: Iterable[bytes] | None = None) -> WaveCheck:
        """Every call against the ledger, the policy, the guest and the upstream.

        ``events`` replaces the wave's slice of the ledger: how a test shows that
        a lost, duplicated or altered event is caught."""
        chk = WaveCheck()
        runs = {r.id: r for r in wave.runs}
        calls: dict[str, Call] = {}
        by_key: dict[tuple[str, str], Call] = {}
        for run_id in runs:
            for c in self.expected_calls(run_id):
                calls[c.id] = c
                by_key[c.key] = c
        for rec in wave.runs:
            if rec.status != "succeeded":
                log = (self.home / "runs" / rec.id / "stderr.log").read_text()[-2000:]
                chk.fail(f"run {rec.id} {rec.status} ({rec.reason}, exit {rec.exit_code}): {log}")
        ended = [r.ended_at for r in wave.runs if r.ended_at is not None]
        if len(wave.runs) > 1 and ended and max(r.started_at for r in wave.runs) >= min(ended):
            chk.fail("the wave's runs did not all overlap: one ended before another started")
        # What the guest saw.
        seen: dict[str, str] = {}
        for run_id, rows in wave.summaries.items():
            for cid, kind, outcome, _us in rows:
                if cid in seen:
                    chk.fail(f"the guest reported {cid} twice")
                seen[cid] = outcome
                chk.by_outcome[outcome if not outcome.startswith("error") else "error"] += 1
                call = calls.get(cid)
                if call is None or call.run != run_id or call.kind != kind:
                    chk.fail(f"the guest of {run_id} reported a call nobody planned: {cid} {kind}")
                    continue
                want = "ok" if call.decision == "allow" else "denied"
                if outcome != want:
                    hint = " (the per-run rate limit answered)" if "rate_limited" in outcome else ""
                    chk.fail(f"{cid} ({kind}): the guest got {outcome!r}, policy says {want}{hint}")
        missing = set(calls) - set(seen)
        if missing:
            chk.fail(f"{len(missing)} planned calls never reported, e.g. {sorted(missing)[:3]}")
        # What the ledger holds for this wave.
        decisions: dict[str, list[dict[str, Any]]] = {}
        ends: dict[int, list[dict[str, Any]]] = {}
        lifecycle: Counter[tuple[str, str]] = Counter()
        if events is None:
            events = self.rt.ledger.entries(TENANT, wave.first_seq, wave.end_seq)
        for raw in events:
            ev = json.loads(raw)
            chk.events += 1
            run_id, action, details = ev.get("run"), ev["action"], ev.get("details", {})
            if run_id not in runs:
                chk.fail(
                    f"event {ev['seq']} ({action}, run {run_id}) belongs to no run of the wave"
                )
                continue
            if action in ("run.start", "run.end"):
                lifecycle[(run_id, action)] += 1
                continue
            if not ev["actor"]["id"].endswith(f"/run/{run_id}"):
                chk.fail(f"event {ev['seq']} of run {run_id} acted as {ev['actor']['id']}")
            if action == "http.request.end":
                ends.setdefault(int(details.get("decision_seq", -1)), []).append(_slim(ev))
                continue
            if action == "sql.select":
                key = ("sql", str(details.get("sql_hmac")))
            elif action == "http.request":
                key = ("http", f"{details.get('port')}{details.get('path')}")
            else:
                chk.fail(f"event {ev['seq']} of run {run_id}: unexpected action {action}")
                continue
            call = by_key.get(key)
            if call is None or call.run != run_id:
                chk.fail(
                    f"event {ev['seq']} ({action} {ev['resource']}) matches no call of {run_id}"
                )
                continue
            decisions.setdefault(call.id, []).append(_slim(ev))
        for run_id in runs:
            for action in ("run.start", "run.end"):
                if lifecycle[(run_id, action)] != 1:
                    chk.fail(f"run {run_id}: {lifecycle[(run_id, action)]} {action} events")
        allowed_paths: Counter[str] = Counter()
        for call in calls.values():
            evs = decisions.get(call.id, [])
            if len(evs) != 1:
                chk.fail(f"{call.id} ({call.kind}): {len(evs)} decision events, expected 1")
                continue
            ev = evs[0]
            got = (ev["decision"], tuple(ev["policies"]))
            if got != (call.decision, call.policies):
                chk.fail(f"{call.id} ({call.kind}): ledger says {got}, policy says "
                         f"{(call.decision, call.policies)}: {ev['reason']}")  # fmt: skip
            outcome = seen.get(call.id)
            if outcome is not None and (outcome == "ok") != (ev["decision"] == "allow"):
                chk.fail(f"{call.id}: the guest saw {outcome!r}, the ledger {ev['decision']}")
            if call.kind == "sql" and (
                ev["details"].get("outcome"),
                ev["details"].get("row_count"),
            ) != ("ok", 1):
                chk.fail(f"{call.id}: sql event details {ev['details']}")  # fmt: skip
            if call.kind.startswith("http"):
                closing = ends.pop(int(ev["seq"]), [])
                if call.decision == "allow":
                    allowed_paths[call.key[1].partition("/")[2]] += 1
                    if len(closing) != 1:
                        chk.fail(f"{call.id}: {len(closing)} http.request.end events, expected 1")
                    elif (
                        closing[0]["details"].get("status") != 200
                        or "error" in closing[0]["details"]
                    ):
                        chk.fail(f"{call.id}: completion {closing[0]['details']}")  # fmt: skip
                elif closing:
                    chk.fail(f"{call.id}: a denied request has a completion event")
        for seq, evs in ends.items():
            chk.fail(f"{len(evs)} http.request.end events point at seq {seq}, no call's decision")
        # What actually reached the servers: every permitted request once, nothing else.
        got_paths = Counter(p.lstrip("/") for p in wave.upstream_paths)
        if got_paths != allowed_paths:
            extra = got_paths - allowed_paths
            lost = allowed_paths - got_paths
            chk.fail(f"upstream received {sum(extra.values())} unexpected (e.g. {list(extra)[:3]}) "
                     f"and missed {sum(lost.values())} (e.g. {list(lost)[:3]})")  # fmt: skip
        if wave.other_paths:
            chk.fail(f"the unapproved host received {len(wave.other_paths)} requests")
        return chk

    def verify(self) -> int:
        """The tenant's whole log, checked from the store; returns its size."""
        return self.rt.ledger.verify(TENANT).size


def _slim(ev: dict[str, Any]) -> dict[str, Any]:
    """What the checks read of an event: a wave's worth of whole events would make
    the harness, not the runtime, the larger part of this process's memory."""
    d = ev.get("details", {})
    keep = ("outcome", "row_count", "status", "error")
    return {
        "seq": ev["seq"],
        "decision": ev["decision"],
        "policies": ev["policies"],
        "reason": ev["reason"],
        "details": {k: d[k] for k in keep if k in d},
    }


def pct(values: list[int], q: float) -> float:
    s = sorted(values)
    return float(s[min(len(s) - 1, int(q * len(s)))]) if s else float("nan")


def mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"
