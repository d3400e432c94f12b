"""`proctor serve` killed with SIGKILL at random moments, restarted each time.

A governed tenant runs a production service and a schedule whose runs query a
dataset and write objects through the broker. The real ``proctor serve`` is
SIGKILLed at seeded random moments (while it starts and reaps, when a sandbox
is being set up, right after a ledger write, in the middle of a run) and
started again. After every restart has settled, and at the end, nothing of a
dead server may remain: no sandbox registry entry, cgroup, process, runsc
state, mount or broker socket of a dead owner; every run it left 'running' is
'interrupted' with one matching ``run.end``; the logs verify and extend every
checkpoint seen along the way, and no answer or object exists that the ledger
did not record first. A second runtime on the same machine (the decoy) shares
the sandbox registry and the broker socket root throughout: reaping must never
touch its live sandbox or socket.

``PROCTOR_FAULT_SEED=N`` replays one schedule of kills; the seed is printed.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import random
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import pytest

from proctor.lifecycle import Runs
from proctor.sandbox import SandboxSpec, _cgroup, get_driver, reap_orphans
from proctor.sandbox._cgroup import CGROUP_ROOT, detect
from tests.conftest import PROCTOR, run_cli
from tests.e2e.conftest_gov import Gov, build_gov
from tests.faults import _serve_child as _child
from tests.sandbox_conftest_helpers import SANDBOXES, any_backend, working

pytestmark = pytest.mark.sandbox

SOAK = os.environ.get("PROCTOR_SOAK") == "1"
KILLS = 40 if SOAK else 6
WORKING = working()
SETTLE_SECONDS = 30.0

CAPS = """
[datasets.crm.tables.customers]
columns = ["id", "country"]
access = "read"

[buckets]
reports = "write"

[limits]
timeout = "60s"
"""

# Every answer the guest gets is printed; the ledger must hold its event.
CALLS = """
import os, time
import proctor_guest as g
run = os.environ["PROCTOR_RUN"]
for i in range({calls}):
    rows = g.sql("crm", "SELECT id, country FROM customers WHERE id <= ?", [i + 1])["rows"]
    print(f"ANSWER sql {{i}} {{len(rows)}}", flush=True)
    key = f"{{run}}/{{i}}.txt"
    res = g.write("reports", key, f"{{run}} {{i}}".encode())
    print(f"ANSWER write {{key}} {{res['sha256']}}", flush=True)
    time.sleep({pause})
"""
SLEEPER = """
import time
print("serving", flush=True)
time.sleep(3600)
"""


# -- processes, cgroups, owners --------------------------------------------------


def start_time(pid: int) -> str | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rpartition(")")[2].split()[19]


def alive(pid: int, start: str | None) -> bool:
    return start is not None and start_time(pid) == start


class Jail:
    """A cgroup of the test's own in every hierarchy the drivers use. A server
    started in it makes its run cgroups under it, so every cgroup and process of
    its sandboxes is found here, whatever the registry says."""

    def __init__(self, name: str) -> None:
        lay = detect()
        self.dirs = [parent / name for parent in lay.v1.values()]
        if lay.v2 is not None:
            self.dirs.append(lay.v2 / name)
        # The hierarchy that classifies processes: pids (v1) or the unified tree.
        self.key = lay.v1["pids"] / name if "pids" in lay.v1 else self.dirs[-1]
        self.mount = CGROUP_ROOT / "pids" if "pids" in lay.v1 else CGROUP_ROOT
        self.v1 = "pids" in lay.v1
        for d in self.dirs:
            d.mkdir()

    @property
    def rel(self) -> str:
        return "/" + str(self.key.relative_to(self.mount))

    def children(self) -> set[str]:
        return {p.name for d in self.dirs if d.is_dir() for p in d.iterdir() if p.is_dir()}

    def members(self) -> dict[int, str]:
        """Every process inside, with the child cgroup it is in ('' for the jail itself)."""
        found: dict[int, str] = {}
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                lines = (entry / "cgroup").read_text().splitlines()
            except OSError:
                continue
            for line in lines:
                hid, controllers, path = line.split(":", 2)
                mine = "pids" in controllers.split(",") if self.v1 else hid == "0"
                if not mine:
                    continue
                if path == self.rel or path.startswith(self.rel + "/"):
                    found[int(entry.name)] = path[len(self.rel) :].lstrip("/").split("/")[0]
        return found

    def spawn_argv(self, argv: list[str]) -> list[str]:
        moves = "; ".join(
            f"echo $$ > {shlex.quote(str(d / 'cgroup.procs'))} || exit 97" for d in self.dirs
        )
        return ["/bin/sh", "-c", f'{moves}; exec "$@"', "proctor-serve", *argv]

    def destroy(self) -> None:
        """Kill whatever is left inside and remove the cgroups (clean-up after a failure)."""
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            for pid in self.members():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            for d in self.dirs:
                for child in [c for c in d.iterdir() if c.is_dir()] if d.is_dir() else []:
                    with contextlib.suppress(OSError):  # EBUSY until the last task is reaped
                        child.rmdir()
                with contextlib.suppress(OSError):
                    d.rmdir()
            if not any(d.exists() for d in self.dirs):
                return
            time.sleep(0.02)


def proc_info(pid: int) -> str:
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        cmd = "?"
    return f"{pid}: {cmd[:200]}"


def ppid(pid: int) -> int:
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("PPid:"):
                return int(line.split()[1])
    return -1


# -- the machine-wide places both runtimes share ---------------------------------


@dataclass
class Places:
    root: Path  # short: broker socket paths must stay under 108 bytes

    @property
    def registry(self) -> Path:
        return self.root / "sandboxes"

    @property
    def brokers(self) -> Path:
        return self.root / "brokers"

    @property
    def tmp(self) -> Path:
        return self.root / "tmp"

    def env(self, home: Path) -> dict[str, str]:
        return dict(
            os.environ,
            PROCTOR_HOME=str(home),
            PROCTOR_SANDBOX_REGISTRY=str(self.registry),
            PROCTOR_BROKER_SOCKETS=str(self.brokers),
            TMPDIR=str(self.tmp),
        )

    def registry_entries(self) -> dict[str, dict[str, Any]]:
        out: dict[str, dict[str, Any]] = {}
        if self.registry.is_dir():
            for p in self.registry.iterdir():
                try:
                    out[p.name] = json.loads(p.read_text())
                except (OSError, ValueError):
                    out[p.name] = {"pid": -1, "start": None, "unreadable": True}
        return out

    def broker_owners(self) -> dict[str, tuple[int, str | None]]:
        """Owner directories of broker sockets: name -> (pid, start time)."""
        out: dict[str, tuple[int, str | None]] = {}
        if self.brokers.is_dir():
            for p in self.brokers.iterdir():
                pid, _, start = p.name.partition("-")
                out[p.name] = (int(pid), start) if pid.isdigit() else (-1, None)
        return out


# -- one runtime: a home, a jail, and its `proctor serve` --------------------------


@dataclass
class Node:
    gov: Gov
    jail: Jail
    places: Places
    logs: Path
    serve: subprocess.Popen[bytes] | None = None
    incarnation: int = 0
    _log: IO[bytes] | None = None

    def spawn(self, backend: str) -> subprocess.Popen[bytes]:
        self.incarnation += 1
        self._log = (self.logs / f"serve-{self.incarnation}.log").open("wb")
        argv = [PROCTOR, "serve", "--backend", backend, "--no-api"]
        self.serve = subprocess.Popen(
            self.jail.spawn_argv(argv),
            env=self.places.env(self.gov.home),
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        return self.serve

    def kill(self) -> None:
        assert self.serve is not None
        self.serve.send_signal(signal.SIGKILL)
        self.serve.wait()
        self._close_log()

    def stop(self) -> int:
        assert self.serve is not None
        self.serve.send_signal(signal.SIGTERM)
        code = self.serve.wait(timeout=90)
        self._close_log()
        return code

    def _close_log(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None

    def running_rows(self) -> list[tuple[str, str, str]]:
        with self.gov.rt.store.read() as conn:
            rows = conn.query("SELECT id, tenant, supervisor FROM runs WHERE status = 'running'")
        return [(str(r[0]), str(r[1]), str(r[2])) for r in rows]

    def owns(self, supervisor: str) -> bool:
        """Whether a runs.supervisor value names the current server."""
        assert self.serve is not None
        parts = supervisor.split(":")
        return len(parts) >= 2 and parts[1] == str(self.serve.pid)


def wait_for(cond: Callable[[], Any], what: str, timeout: float = SETTLE_SECONDS) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out after {timeout:.0f} s waiting for {what}"
        time.sleep(0.05)


# -- the checks --------------------------------------------------------------------


@dataclass
class Decoy:
    """The second runtime's live sandbox and socket, as first seen."""

    node: Node
    run_id: str
    entry: str
    pids: dict[int, str | None]
    broker_dir: str
    sockets: set[str] = field(default_factory=set)

    def assert_intact(self) -> None:
        node = self.node
        assert node.serve is not None and node.serve.poll() is None, "the decoy server died"
        running = [r for r in node.running_rows() if r[1] == "acme"]
        assert [r[0] for r in running] == [self.run_id], "the decoy's live run was touched"
        entries = node.places.registry_entries()
        assert self.entry in entries, "a live owner's sandbox was unregistered"
        assert self.entry in node.jail.children(), "a live owner's cgroup was removed"
        for pid, started in self.pids.items():
            assert alive(pid, started), f"a live owner's sandbox process {pid} was killed"
        sock_dir = node.places.brokers / self.broker_dir
        assert sock_dir.is_dir(), "a live owner's broker socket directory was removed"
        now = {p.name: p for p in sock_dir.rglob("*.sock")}
        assert self.sockets <= set(now), "a live owner's broker socket was removed"
        for name in self.sockets:
            with socket.socket(socket.AF_UNIX) as conn:
                conn.connect(str(now[name]))  # still served by the live broker


def check_settled(node: Node, others: list[Node]) -> None:
    """Wait until the new server has reaped and marked what its dead predecessors left."""
    places = node.places

    def leftovers() -> list[str]:
        left = []
        for name, entry in places.registry_entries().items():
            if not alive(int(entry["pid"]), entry.get("start")):
                left.append(f"registry entry {name} of dead pid {entry['pid']}")
        for name, (pid, started) in places.broker_owners().items():
            if not alive(pid, started):
                left.append(f"broker socket directory {name} of a dead owner")
        for run_id, _tenant, supervisor in node.running_rows():
            if not node.owns(supervisor):
                left.append(f"run {run_id} still 'running' for dead supervisor {supervisor}")
        return left

    deadline = time.monotonic() + SETTLE_SECONDS
    while (left := leftovers()) and time.monotonic() < deadline:
        assert node.serve is not None and node.serve.poll() is None, (
            f"the restarted server exited with {node.serve.returncode if node.serve else None}"
        )
        time.sleep(0.05)
    assert not left, f"not reaped within {SETTLE_SECONDS:.0f} s: {left}"
    for other in others:
        assert other.serve is not None and other.serve.poll() is None, "a live runtime died"


def _stable(problems: Callable[[], list[str]]) -> list[str]:
    """Problems still there a moment later: a live owner may be between two steps
    of its own clean-up (cgroup removed, entry not yet) when we look."""
    first = problems()
    if not first:
        return []
    time.sleep(0.5)
    again = set(problems())
    return [p for p in first if p in again]


def check_no_orphans(nodes: list[Node]) -> None:
    """Strict: nothing of a dead owner anywhere; everything left has a live owner."""
    places = nodes[0].places

    def live_entries() -> dict[str, dict[str, Any]]:
        return {n: e for n, e in places.registry_entries().items()
                if alive(int(e["pid"]), e.get("start"))}  # fmt: skip

    def problems() -> list[str]:
        out: list[str] = []
        for node in nodes:
            assert node.serve is not None
            children = node.jail.children()
            members = node.jail.members()
            live = live_entries()
            mine = {n for n, e in live.items() if int(e["pid"]) == node.serve.pid}
            for child in sorted(children - mine):
                out.append(f"cgroup {child} in {node.jail.key} has no live owner")
            for pid, child in members.items():
                if pid == node.serve.pid or child in mine:
                    continue
                if child == "" and ppid(pid) == node.serve.pid:
                    continue  # launched a moment ago, not yet moved into its run's cgroup
                out.append(f"process {proc_info(pid)} (cgroup {child or '-'}) has no live owner")
        live = live_entries()
        workdirs = {str(e.get("workdir")) for e in live.values() if e.get("workdir")}
        if places.tmp.is_dir():
            for d in places.tmp.iterdir():
                if d.name.startswith("proctor-") and str(d) not in workdirs:
                    out.append(f"{d} left in the temporary directory")
        for name, (pid, started) in places.broker_owners().items():
            if not alive(pid, started):
                out.append(f"broker socket directory {name} of a dead owner")
        # Any process on the machine still working for one of our runtimes.
        roots = (str(places.root), *(str(n.gov.home) for n in nodes))
        jailed = {pid for n in nodes for pid in n.jail.members()}
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) in jailed:
                continue
            try:
                cmd = (entry / "cmdline").read_bytes().decode(errors="replace")
            except OSError:
                continue
            if any(r in cmd for r in roots) and int(entry.name) != os.getpid():
                out.append(f"process {proc_info(int(entry.name))} outside every jail")
        mounts = Path("/proc/self/mountinfo").read_text().splitlines()
        out += [f"mount left: {m}" for m in mounts if any(r in m for r in roots)]
        runsc_root = Path("/run/runsc")
        if runsc_root.is_dir():
            out += [f"runsc state {p}" for p in runsc_root.iterdir() if "proctor-" in p.name]
        return out

    left = _stable(problems)
    assert not left, "orphans of a dead server:\n" + "\n".join(left)


def events_of(gov: Gov, tenant: str = "acme") -> list[dict[str, Any]]:
    return [json.loads(e) for e in gov.rt.ledger.entries(tenant)]


def check_runs_closed(node: Node, *, final: bool) -> dict[str, int]:
    """Every ended run has exactly one run.end, its last event; interrupted runs
    have the supervisor's reason and left no copy of their code behind."""
    gov = node.gov
    # Runs first: a row is committed with its run.start, so every row read here
    # has its events in the later read (a run may end in between: see below).
    runs = Runs(gov.rt).all("acme")
    events = events_of(gov)
    by_run: dict[str, list[dict[str, Any]]] = {}
    for e in events:
        if e.get("run"):
            by_run.setdefault(e["run"], []).append(e)
    counts: dict[str, int] = {}
    for rec in runs:
        counts[rec.status] = counts.get(rec.status, 0) + 1
        mine = by_run.get(rec.id, [])
        starts = [e for e in mine if e["action"] == "run.start"]
        ends = [e for e in mine if e["action"] == "run.end"]
        assert len(starts) == 1, f"run {rec.id}: {len(starts)} run.start events"
        if rec.status == "running":
            assert not final, f"run {rec.id} is still 'running' after a clean stop"
            assert len(ends) <= 1, f"run {rec.id}: {len(ends)} run.end events"
            continue  # and perhaps ended since the rows were read
        assert len(ends) == 1, f"run {rec.id} ({rec.status}): {len(ends)} run.end events"
        assert ends[0]["details"]["status"] == rec.status
        assert mine[-1] is ends[0], f"run {rec.id}: an event was recorded after its run.end"
        if rec.status == "interrupted":
            # Killed (closed by a successor), or ended by a clean stop of its serve.
            assert rec.reason in ("supervisor died", "supervisor stopping")
            assert ends[0]["reason"] == f"interrupted: {rec.reason}"
            if rec.reason == "supervisor died":
                counts["died"] = counts.get("died", 0) + 1
            code = gov.home / "runs" / rec.id / "code"
            assert not code.exists(), f"the interrupted run {rec.id} left its code at {code}"
    return counts


def check_fail_closed(gov: Gov) -> dict[str, int]:
    """No answer reached a guest, and no object became visible, that the ledger had
    not recorded first."""
    events = events_of(gov)
    sql: dict[str, set[int]] = {}
    writes: dict[str, str] = {}
    for e in events:
        if e["decision"] != "allow" or not e.get("run"):
            continue
        if e["action"] == "sql.select" and e["details"].get("outcome") == "ok":
            sql.setdefault(e["run"], set()).add(int(e["details"]["row_count"]))
        elif e["action"] == "file.write":
            writes[e["resource"]] = e["details"]["sha256"]
    answers = 0
    for rec in Runs(gov.rt).all("acme"):
        log = gov.home / "runs" / rec.id / "stdout.log"
        if not log.exists():
            continue
        for line in log.read_text(errors="replace").splitlines():
            if not line.startswith("ANSWER "):
                continue
            answers += 1
            _, kind, a, b = line.split()
            if kind == "sql":
                assert int(b) in sql.get(rec.id, set()), f"run {rec.id} got an unrecorded answer"
            else:
                assert writes.get(f"bucket/reports/{a}") == b, f"{a}: answered, not recorded"
    objects = temps = 0
    bucket = gov.rt.resources.bucket_dir("acme") / "reports"
    for path in bucket.rglob("*"):
        if not path.is_file():
            continue
        if path.name.startswith(".tmp-"):
            temps += 1  # staged by a server killed before its event: never visible
            continue
        objects += 1
        key = path.relative_to(bucket).as_posix()
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        assert writes.get(f"bucket/reports/{key}") == digest, f"object {key} was never recorded"
    return {"answers": answers, "objects": objects, "staged_leftovers": temps}


# -- the test ----------------------------------------------------------------------


def wait_for_moment(node: Node, mode: str, rng: random.Random) -> None:
    """Return at a random moment of the kind ``mode`` names."""
    assert node.serve is not None
    pid = node.serve.pid
    registry = node.places.registry_entries
    if mode == "sandbox-start":
        # Registered a moment ago: the bundle, the cgroup or the launch is under way.
        seen = set(registry())
        wait_for(lambda: {k for k, e in registry().items() if e["pid"] == pid} - seen,
                 "a sandbox being set up")  # fmt: skip
        time.sleep(rng.uniform(0.0, 0.4))
    elif mode == "ledger-write":
        wal = node.gov.home / "proctor.db-wal"
        time.sleep(rng.uniform(0.1, 1.5))
        before = wal.stat().st_mtime_ns if wal.exists() else 0
        wait_for(lambda: wal.exists() and wal.stat().st_mtime_ns != before, "a ledger write")
        time.sleep(rng.uniform(0.0, 0.004))
    else:
        wait_for(lambda: any(node.owns(r[2]) for r in node.running_rows()), "a run")
        time.sleep(rng.uniform(0.0, 2.0))


def _deploy(gov: Gov, name: str, main: str, caps: str, env: str, mode: str,
            every: float | None = None) -> None:  # fmt: skip
    lifecycle = f'\n[lifecycle]\nmode = "{mode}"\n' + (f'every = "{every:g}s"\n' if every else "")
    art = gov.artifact_dir(name, main, caps + lifecycle)
    digest = gov.submit("acme", art)
    artifact = gov.rt.artifacts.get("acme", digest)
    if env == "production":
        gov.rt.approvals.grant("acme", digest, gov.principal("alice"))
    gov.rt.deployments.deploy("acme", artifact, name, environment=env, mode=mode,
                              instruction=f"{name} (fault test)", every_seconds=every,
                              actor=gov.op)  # fmt: skip


@pytest.fixture
def places() -> Iterator[Places]:
    root = Path(tempfile.mkdtemp(prefix="pk-", dir="/tmp"))
    p = Places(root)
    p.tmp.mkdir()
    yield p
    shutil.rmtree(root, ignore_errors=True)


@pytest.mark.timeout(1200 if SOAK else 300)
def test_serve_killed_at_random_moments_leaves_nothing_and_loses_nothing(
    tmp_path: Path, places: Places
) -> None:
    any_backend()
    seed = int(os.environ.get("PROCTOR_FAULT_SEED") or random.randrange(1 << 32))
    print(f"PROCTOR_FAULT_SEED={seed} ({KILLS} kills, backends {WORKING})")
    rng = random.Random(seed)
    tag = f"{os.getpid()}-{seed % 100000}"

    (tmp_path / "main").mkdir()
    gov = build_gov(tmp_path / "main")
    _deploy(gov, "svc", CALLS.format(calls=8, pause=0.05), CAPS, "production", "service")
    _deploy(gov, "tick", CALLS.format(calls=1, pause=0), CAPS, "production", "schedule", 1.0)
    (tmp_path / "decoy").mkdir()
    decoy_gov = build_gov(tmp_path / "decoy")
    _deploy(decoy_gov, "svc", SLEEPER, '[limits]\ntimeout = "1h"\n', "sandbox", "service")

    logs = tmp_path / "logs"
    logs.mkdir()
    node = Node(gov, Jail(f"pk-main-{tag}"), places, logs / "main")
    decoy_node = Node(decoy_gov, Jail(f"pk-decoy-{tag}"), places, logs / "decoy")
    node.logs.mkdir()
    decoy_node.logs.mkdir()
    held: list[Path] = []
    timeline: list[str] = []
    try:
        # The decoy: a live runtime with one live sandbox and one open socket.
        decoy_node.spawn(WORKING[0])
        rows = wait_for(lambda: [r for r in decoy_node.running_rows() if decoy_node.owns(r[2])],
                        "the decoy's service")  # fmt: skip
        pid = decoy_node.serve.pid if decoy_node.serve else -1

        def decoy_ready() -> Decoy | None:
            entries = {n: e for n, e in places.registry_entries().items() if e["pid"] == pid}
            pids = decoy_node.jail.members()
            owners = [n for n, (p, _) in places.broker_owners().items() if p == pid]
            if len(entries) != 1 or len(owners) != 1:
                return None
            (entry,) = entries
            in_run = {p: start_time(p) for p, child in pids.items() if child == entry}
            socks = {s.name for s in (places.brokers / owners[0]).rglob("*.sock")}
            if not in_run or not socks:
                return None
            return Decoy(decoy_node, rows[0][0], entry, in_run, owners[0], socks)

        decoy = wait_for(decoy_ready, "the decoy's sandbox and socket")
        time.sleep(1.0)  # let it pass its start-up
        decoy.assert_intact()

        for n in range(KILLS):
            backend = rng.choice(WORKING)
            mode = rng.choice(["early", "sandbox-start", "ledger-write", "mid-run", "mid-run"])
            serve = node.spawn(backend)
            began = time.monotonic()
            if mode == "early":
                time.sleep(rng.uniform(0.0, 0.8))
            else:
                check_settled(node, [decoy_node])
                check_no_orphans([node, decoy_node])
                decoy.assert_intact()
                counts = check_runs_closed(node, final=False)
                head = gov.rt.ledger.head("acme")
                cp = logs / f"acme-{head.size}.checkpoint"
                cp.write_text(head.checkpoint)
                held.append(cp)
                timeline.append(f"  restart {n}: settled after {time.monotonic() - began:.2f} s,"
                                f" runs {counts}")  # fmt: skip
                wait_for_moment(node, mode, rng)
            assert serve.poll() is None, f"serve exited early with {serve.returncode}"
            node.kill()
            timeline.append(f"kill {n}: {mode}, {backend}, after {time.monotonic() - began:.2f} s")

        # The last start: settle, let runs finish normally, then a clean stop.
        node.spawn(rng.choice(WORKING))
        check_settled(node, [decoy_node])
        check_no_orphans([node, decoy_node])
        decoy.assert_intact()
        before = {r.id for r in Runs(gov.rt).all("acme", status="succeeded")}
        wait_for(lambda: {r.id for r in Runs(gov.rt).all("acme", status="succeeded")} - before,
                 "a run of the last server to succeed")  # fmt: skip
        assert node.stop() == 0, "the clean stop failed"
        decoy.assert_intact()
        counts = check_runs_closed(node, final=True)
        assert not node.running_rows(), "a run is 'running' after the clean stop"
        ours = {n for n, e in places.registry_entries().items() if e["pid"] != pid}
        assert not ours, f"registry entries left after a clean stop: {ours}"
        assert not node.jail.children() and not node.jail.members()
        mine = [n for n, (p, _) in places.broker_owners().items() if p != pid]
        assert not mine, f"broker socket directories left after a clean stop: {mine}"
        closed = check_fail_closed(gov)
        for log in ("acme", "globex", "system"):
            extra = [a for cp in held for a in ("--checkpoint", str(cp))] if log == "acme" else []
            out = run_cli("audit", "verify", "-t", log, *extra, home=gov.home).out
            assert "verified" in out
        interrupted = counts.get("died", 0)
        assert interrupted >= 1, "no kill caught a run: the test did not test anything"
        assert closed["answers"] > 0 and closed["objects"] > 0

        # The decoy stops cleanly too, and takes its sandbox and socket with it.
        assert decoy_node.stop() == 0
        assert not places.registry_entries(), "the decoy left its sandbox registered"
        assert not places.broker_owners(), "the decoy left its broker socket directory"
        assert not decoy_node.jail.children()
        assert [r.status for r in Runs(decoy_gov.rt).all("acme")] == ["interrupted"]
        for log in ("acme", "system"):
            decoy_gov.rt.ledger.verify(log)
        print("\n".join(timeline))
        print(f"runs {counts}; {closed}; {len(held)} checkpoints held and extended")
    except BaseException:
        print("\n".join(timeline))
        for f in sorted(logs.rglob("*.log"), key=lambda f: f.stat().st_mtime)[-3:]:
            print(f"--- {f}\n{f.read_text(errors='replace')[-3000:]}")
        raise
    finally:
        for n_ in (node, decoy_node):
            if n_.serve is not None and n_.serve.poll() is None:
                n_.kill()
        for n_ in (node, decoy_node):
            n_.jail.destroy()
        gov.rt.close()
        decoy_gov.rt.close()


# -- the same, one precise point at a time -------------------------------------------

CHILD = Path(__file__).with_name("_serve_child.py")
POINTS = [
    (backend, point)
    for backend in SANDBOXES
    for point in _child.POINTS
    if backend == "gvisor" or point not in _child.GVISOR_ONLY
]


@pytest.mark.parametrize(("backend", "point"), POINTS)
def test_an_owner_killed_at_each_step_of_a_sandbox_leaves_nothing_after_a_reap(
    backend: str, point: str, places: Places, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The owner dies at one exact step of set-up or tear-down; one reap, from a
    process in another cgroup, removes all of it and nothing of a live owner."""
    jail = Jail(f"pk-step-{os.getpid()}-{point}")
    monkeypatch.setattr(_cgroup, "REGISTRY", places.registry)
    stop = threading.Event()
    live = threading.Thread(
        target=get_driver(backend).run,
        args=(SandboxSpec(argv=("python3", "-c", "import time; time.sleep(60)")),),
        kwargs={"cancel": stop},
    )
    try:
        owner = subprocess.run(
            jail.spawn_argv([sys.executable, str(CHILD), backend, point]),
            env=places.env(places.root),
            capture_output=True,
            timeout=60,
            check=False,
        )
        assert owner.returncode == -signal.SIGKILL, (
            f"the owner did not die at {point}: {owner.returncode} {owner.stderr.decode()[-2000:]}"
        )
        left = [*places.registry.iterdir(), *jail.children(), *places.tmp.iterdir()]
        assert left, f"killed at {point} ({_child.POINTS[point]}), the owner left nothing to reap"
        # A live owner beside it: this process, with a sandbox of its own.
        live.start()
        # Its entry once renamed into place: a staged ``.tmp-`` copy is complete JSON
        # for a moment too, and is gone by the time the check below looks.
        mine = wait_for(
            lambda: [n for n, e in places.registry_entries().items()
                     if e["pid"] == os.getpid() and not n.startswith(".tmp-")],
            "the live sandbox",
        )  # fmt: skip
        time.sleep(0.3)
        reaped = reap_orphans()
        assert reaped or point == "staged", "reap_orphans reported nothing"
        assert set(places.registry_entries()) == set(mine), "the live owner's entry went"
        assert [p.name for p in places.registry.iterdir()] == mine, "a staged entry was left"
        assert not jail.children(), f"cgroups left: {jail.children()}"
        # The dead owner's wall-clock guard leaves once it sees the cgroup gone (0.2 s).
        wait_for(lambda: not jail.members(), "the dead owner's processes to be gone")
        assert not [d for d in places.tmp.iterdir() if str(d) not in
                    {e["workdir"] for e in places.registry_entries().values()}], "a workdir was left"  # fmt: skip
        mounts = Path("/proc/self/mountinfo").read_text()
        assert str(places.root) not in mounts
        assert live.is_alive(), "the live owner's sandbox was ended by the reap"
    finally:
        stop.set()
        if live.is_alive() or live.ident is not None:
            live.join(timeout=30)
        jail.destroy()
    assert not places.registry_entries(), "the live sandbox did not clean up after itself"


def test_a_staged_registry_entry_is_never_reaped_as_a_sandbox(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The registry is written aside (``.tmp-<owner>-<name>``) and renamed. A staged
    copy is complete JSON for a moment, so the reaper must not read it as an entry:
    a live owner's is left for its rename, a dead owner's is removed (its rename
    never came, and nothing was created after it), and neither is reported reaped
    nor has a cgroup of its name touched."""
    registry = tmp_path / "registry"
    registry.mkdir(mode=0o700)
    monkeypatch.setattr(_cgroup, "REGISTRY", registry)
    dead = subprocess.Popen(["sleep", "60"])
    dead_owner = f"{dead.pid}-{start_time(dead.pid)}"
    dead.kill()
    dead.wait()
    live_owner = f"{os.getpid()}-{start_time(os.getpid())}"
    # Contents naming a dead owner: read as an entry, they would be reaped.
    entry = json.dumps({"pid": dead.pid, "start": dead_owner.partition("-")[2],
                        "workdir": "", "cgroups": {}})  # fmt: skip
    staged_live = registry / f".tmp-{live_owner}-proctor-live"
    staged_dead = registry / f".tmp-{dead_owner}-proctor-dead"
    unnamed = registry / ".tmp-not-an-owner"
    for path in (staged_live, staged_dead, unnamed):
        path.write_text(entry)
    assert reap_orphans() == [], "a staged copy was reaped as a sandbox"
    assert staged_live.exists(), "a live owner's staged entry went before its rename"
    assert not staged_dead.exists(), "a dead owner's staged entry was left"
    assert unnamed.exists(), "a name that is not ours to judge was removed"


def test_a_dead_supervisors_runs_are_closed_even_when_its_pid_lives_again(tmp_path: Path) -> None:
    """A run's supervisor is host:pid:start time. A pid the kernel has handed to
    another process no longer keeps the dead supervisor's runs 'running'; a live
    supervisor's runs are left alone, in either form of the id."""
    from proctor.lifecycle import Supervisor

    any_backend()
    gov = build_gov(tmp_path)
    other = subprocess.Popen(["sleep", "60"])  # stands for the process that got the pid
    host = os.uname().nodename
    try:
        theirs = start_time(other.pid)
        cases = {
            "r-reused": (f"{host}:{other.pid}:{int(theirs or 0) - 1}", "interrupted"),
            "r-live": (f"{host}:{other.pid}:{theirs}", "running"),
            "r-live-legacy": (f"{host}:{other.pid}", "running"),
            "r-dead-legacy": (f"{host}:{2**22 + 1}", "interrupted"),
        }
        with gov.rt.store.write() as conn:
            for run_id, (supervisor, _) in cases.items():
                conn.execute(
                    "INSERT INTO runs (id, tenant, deployment, version, digest, environment,"
                    " workload, approvals, backend, platform, status, reason, exit_code, attempt,"
                    " limits, output_digest, started_at, ended_at, supervisor) VALUES"
                    " (?, 'acme', 'svc', 1, 'sha256:00', 'sandbox', 'w', '[]', 'gvisor', NULL,"
                    " 'running', NULL, NULL, 1, '{}', NULL, '2026-01-01T00:00:00Z', NULL, ?)",
                    (run_id, supervisor),
                )
        with gov.rt.make_broker() as broker:
            sup = Supervisor(gov.rt, broker, WORKING[0])
            assert sup.supervisor_id == f"{host}:{os.getpid()}:{start_time(os.getpid())}"
            marked = {r.id for r in sup.mark_interrupted(gov.op)}
        runs = Runs(gov.rt)
        for run_id, (_, status) in cases.items():
            assert runs.get("acme", run_id).status == status, run_id
        assert marked == {r for r, (_, s) in cases.items() if s == "interrupted"}
        ends = [e for e in events_of(gov) if e["action"] == "run.end"]
        assert sorted(e["run"] for e in ends) == sorted(marked)
    finally:
        other.kill()
        other.wait()
        gov.rt.close()
