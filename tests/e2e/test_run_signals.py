"""`proctor run` ended by a signal: the run is closed in the record, nothing stays.

The real CLI in a subprocess runs a governed production job that sleeps, on a
real sandbox. SIGINT, SIGTERM and SIGHUP stop the sandbox and record ``run.end``
(interrupted, the signal named) before the CLI exits with 128+n. A SIGKILL runs
no clean-up at all: the next CLI command that opens the home notices that the
run's owner is dead, removes its sandbox and records it as interrupted.

Each test has its own sandbox registry, broker socket root and TMPDIR, so that
"nothing left behind" is checked on this run's things alone, whatever else runs
on the machine.
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import pytest

from proctor.lifecycle import Runs
from tests.conftest import PROCTOR
from tests.e2e.conftest_gov import Gov, build_gov
from tests.sandbox_conftest_helpers import working

pytestmark = pytest.mark.sandbox
GVISOR = ["gvisor"]
BWRAP = ["bubblewrap"]

SLEEPER = """
import time
print("ready", flush=True)
time.sleep(300)
"""
DEADLINE = 60.0  # bounds every wait; a healthy run needs a few seconds


@dataclass
class Place:
    gov: Gov
    root: Path  # short: broker socket paths must stay under 108 bytes

    @property
    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.pop("PROCTOR_TOKEN", None)
        env.update(
            PROCTOR_HOME=str(self.gov.home),
            PROCTOR_SANDBOX_REGISTRY=str(self.root / "sandboxes"),
            PROCTOR_BROKER_SOCKETS=str(self.root / "brokers"),
            TMPDIR=str(self.root / "tmp"),
            COLUMNS="200",
        )
        return env

    def registry(self) -> dict[str, dict[str, Any]]:
        d = self.root / "sandboxes"
        return {p.name: json.loads(p.read_text()) for p in d.iterdir()} if d.is_dir() else {}

    def leftovers(self) -> list[str]:
        """Everything a run of the CLI may leave: sandboxes (registry entries, their
        work directories in TMPDIR) and broker socket directories."""
        found = [f"registry entry {n}" for n in self.registry()]
        found += [f"tmp {p.name}" for p in (self.root / "tmp").iterdir()]
        brokers = self.root / "brokers"
        if brokers.is_dir():
            found += [f"broker dir {p.name}" for p in brokers.iterdir()]
        return found


@pytest.fixture
def place(tmp_path: Path) -> Iterator[Place]:
    gov = build_gov(tmp_path)
    art = gov.artifact_dir("sleeper", SLEEPER)
    digest = gov.submit("acme", art)
    gov.rt.approvals.grant("acme", digest, gov.principal("alice"))
    gov.rt.deployments.deploy("acme", gov.rt.artifacts.get("acme", digest), "sleeper",
                              environment="production", instruction="sleeps (signal test)",
                              actor=gov.principal("dev").actor)  # fmt: skip
    root = Path(tempfile.mkdtemp(prefix="sig-", dir="/tmp"))
    (root / "tmp").mkdir()
    p = Place(gov, root)
    yield p
    gov.rt.close()
    # A failed test may have left the CLI's sandbox running (its owner is dead by now).
    subprocess.run([sys.executable, "-c", "from proctor.sandbox import reap_orphans; reap_orphans()"],
                   env=p.env, check=False, timeout=DEADLINE)  # fmt: skip
    shutil.rmtree(root, ignore_errors=True)


def start_run(place: Place, backend: str) -> subprocess.Popen[bytes]:
    """`proctor run sleeper` as a principal; returns once the guest said it is up."""
    proc = subprocess.Popen(
        [PROCTOR, "run", "sleeper", "-t", "acme", "--backend", backend,
         "--token", place.gov.token("dev")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=place.env,
    )  # fmt: skip
    wait_ready(proc)
    return proc


def wait_ready(proc: subprocess.Popen[bytes]) -> None:
    assert proc.stdout is not None
    wait_for(proc, proc.stdout, b"ready\n", "the guest never said ready")


def wait_serving(serve: subprocess.Popen[bytes]) -> None:
    """Until `serve` has opened the home and done its first reap (its first log line).
    Opening the home closes the runs of dead owners too, under another name: a run
    killed before that is closed by the opening, not by the sweep a test waits for."""
    assert serve.stderr is not None
    wait_for(serve, serve.stderr, b'"event": "reap"', "serve never started")


def wait_for(proc: subprocess.Popen[bytes], stream: IO[bytes], marker: bytes, what: str) -> None:
    sel = selectors.DefaultSelector()
    sel.register(stream, selectors.EVENT_READ)
    seen = b""
    deadline = time.monotonic() + DEADLINE
    while marker not in seen:
        left = deadline - time.monotonic()
        if left <= 0 or proc.poll() is not None:
            proc.kill()
            out, err = proc.communicate()
            pytest.fail(f"{what}: {seen!r} {out.decode()} {err.decode()}")
        if sel.select(timeout=left):
            seen += os.read(stream.fileno(), 4096)
    sel.close()


def the_run(place: Place) -> tuple[Any, list[dict[str, Any]]]:
    (record,) = Runs(place.gov.rt).all("acme", "sleeper")
    evs = [json.loads(e) for e in place.gov.rt.ledger.entries("acme")]
    return record, [e for e in evs if e.get("run") == record.id]


def cgroups_of(place: Place, pid: int) -> list[Path]:
    entries = [e for e in place.registry().values() if e.get("pid") == pid]
    assert entries, "the run's sandbox is registered under the CLI's pid"
    return [Path(p) for e in entries for p in (e.get("cgroups") or {}).values()]


def assert_nothing_left(place: Place, run_id: str, cgroups: list[Path]) -> None:
    assert place.leftovers() == []
    assert not [c for c in cgroups if c.exists()], "the run's cgroups are removed"
    run_dir = place.gov.home / "runs" / run_id
    assert not (run_dir / "code").exists(), "the copy of the approved code is removed"
    assert not (place.gov.home / "ca-bundles" / "acme" / run_id).exists()


@pytest.mark.parametrize(
    ("backend", "sig"),
    [
        pytest.param(b, s, id=f"{b}-{s.name}")
        for b, s in [
            *((b, s) for b in GVISOR for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)),
            *((b, signal.SIGTERM) for b in BWRAP),
        ]
    ],
)
def test_a_signal_stops_the_run_and_records_its_end(
    place: Place, backend: str, sig: signal.Signals
) -> None:
    proc = start_run(place, backend)
    cgroups = cgroups_of(place, proc.pid)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=DEADLINE)
    assert proc.returncode == 128 + sig, err.decode()
    record, evs = the_run(place)
    assert record.status == "interrupted" and record.ended_at is not None
    assert sig.name in str(record.reason)
    ends = [e for e in evs if e["action"] == "run.end"]
    assert len(ends) == 1 and ends[0] == evs[-1], "one run.end, the run's last event"
    assert ends[0]["reason"] == f"interrupted: {sig.name}"
    assert ends[0]["details"]["status"] == "interrupted"
    assert f"run {record.id}: interrupted" in err.decode()
    assert_nothing_left(place, record.id, cgroups)


@pytest.mark.parametrize("backend", GVISOR + BWRAP)
def test_a_killed_runs_next_command_closes_it(place: Place, backend: str) -> None:
    proc = start_run(place, backend)
    cgroups = cgroups_of(place, proc.pid)
    proc.kill()  # SIGKILL: no clean-up runs at all
    proc.communicate(timeout=DEADLINE)
    record, _ = the_run(place)
    assert record.status == "running", "nobody has looked yet"
    # The next command that opens the home, whatever it is, closes the run.
    deadline = time.monotonic() + DEADLINE
    while True:
        out = subprocess.run([PROCTOR, "runs", "list", "-t", "acme", "--json"],
                             capture_output=True, env=place.env, timeout=DEADLINE,
                             check=True).stdout  # fmt: skip
        (listed,) = json.loads(out)
        if listed["status"] != "running" or time.monotonic() > deadline:
            break
    assert listed["status"] == "interrupted"
    record, evs = the_run(place)
    ends = [e for e in evs if e["action"] == "run.end"]
    assert len(ends) == 1 and ends[0]["reason"] == "interrupted: supervisor died"
    assert ends[0]["actor"]["type"] == "runtime"
    assert_nothing_left(place, record.id, cgroups)
    # A second look changes nothing: one ending, recorded once.
    subprocess.run([PROCTOR, "runs", "list", "-t", "acme"], capture_output=True,
                   env=place.env, timeout=DEADLINE, check=True)  # fmt: skip
    assert len([e for e in the_run(place)[1] if e["action"] == "run.end"]) == 1


@pytest.mark.parametrize("backend", working()[:1] or GVISOR)
def test_serve_closes_a_killed_runs_record_while_it_runs(place: Place, backend: str) -> None:
    """No command and no restart needed: a running `proctor serve` looks every few
    seconds for runs of this host whose owner died."""
    serve = subprocess.Popen([PROCTOR, "serve", "--no-api", "--backend", backend],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             env=place.env)  # fmt: skip
    try:
        wait_serving(serve)
        proc = start_run(place, backend)
        cgroups = cgroups_of(place, proc.pid)
        proc.kill()
        proc.communicate(timeout=DEADLINE)
        runs = Runs(place.gov.rt)
        deadline = time.monotonic() + DEADLINE
        while runs.all("acme", "sleeper")[0].status == "running":
            assert time.monotonic() < deadline, "serve never closed the killed run"
            time.sleep(0.2)
        record, evs = the_run(place)
        assert record.status == "interrupted"
        (end,) = [e for e in evs if e["action"] == "run.end"]
        assert end["actor"]["id"].startswith(f"supervisor:{os.uname().nodename}:{serve.pid}:")
        serve.send_signal(signal.SIGTERM)
        serve.communicate(timeout=DEADLINE)
        assert_nothing_left(place, record.id, cgroups)
    finally:
        if serve.poll() is None:
            serve.kill()
            serve.communicate()


@pytest.mark.parametrize("backend", GVISOR + BWRAP)
def test_a_signal_stops_a_throwaway_sandbox_and_records_its_end(place: Place, backend: str) -> None:
    proc = subprocess.Popen(
        [PROCTOR, "sandbox", "run", "--backend", backend, "--", "python3", "-c", SLEEPER],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=place.env,
    )  # fmt: skip
    wait_ready(proc)
    cgroups = cgroups_of(place, proc.pid)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=DEADLINE)
    assert proc.returncode == 128 + signal.SIGTERM, err.decode()
    evs = [json.loads(e) for e in place.gov.rt.ledger.entries("sandbox")]
    start, end = [e for e in evs if e["action"] == "sandbox.run"]
    assert start["reason"] == "started" and end["reason"] == "interrupted: SIGTERM"
    assert place.leftovers() == []
    assert not [c for c in cgroups if c.exists()]


SERVICE_MANIFEST = '[lifecycle]\nmode = "service"\n'


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize("backend", GVISOR + BWRAP)
def test_sigterm_to_serve_ends_every_run_it_supervises_before_it_exits(
    place: Place, backend: str
) -> None:
    """A service kept up by `serve` and a job started through its API: SIGTERM
    stops both sandboxes and records both ends before `serve` exits; nothing of
    either is left for a successor to find."""
    from proctor import Client

    gov = place.gov
    art = gov.artifact_dir("svc", SLEEPER, SERVICE_MANIFEST)
    digest = gov.submit("acme", art)
    gov.rt.approvals.grant("acme", digest, gov.principal("alice"))
    gov.rt.deployments.deploy("acme", gov.rt.artifacts.get("acme", digest), "svc",
                              environment="production", mode="service", instruction="svc",
                              actor=gov.principal("dev").actor)  # fmt: skip
    port = _free_port()
    serve = subprocess.Popen([PROCTOR, "serve", "--backend", backend, "--api-port", str(port)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             env=place.env)  # fmt: skip
    runs = Runs(gov.rt)
    client = Client(f"http://127.0.0.1:{port}", gov.token("dev"))
    api_run: list[Any] = []
    try:
        deadline = time.monotonic() + DEADLINE
        while True:
            try:
                client.health()
                break
            except Exception:
                assert time.monotonic() < deadline and serve.poll() is None, "no API"
                time.sleep(0.1)
        started = threading.Event()

        def job() -> None:
            try:
                api_run.append(client.run("acme", "sleeper", on_stdout=lambda _: started.set()))
            except Exception as exc:  # the stream may be cut by the exit
                api_run.append(exc)

        threading.Thread(target=job, daemon=True).start()
        assert started.wait(DEADLINE), "the job through the API never started"
        while len(runs.all("acme", status="running")) < 2:
            assert time.monotonic() < deadline, "the service never started"
            time.sleep(0.1)
        cgroups = [Path(p) for e in place.registry().values() if e.get("pid") == serve.pid
                   for p in (e.get("cgroups") or {}).values()]  # fmt: skip
        assert cgroups, "both sandboxes are registered under serve's pid"
        serve.send_signal(signal.SIGTERM)
        _, err = serve.communicate(timeout=DEADLINE)
        assert serve.returncode == 0, err.decode()
    finally:
        if serve.poll() is None:
            serve.kill()
            serve.communicate()
    records, host = runs.all("acme"), os.uname().nodename
    assert {r.deployment for r in records} == {"svc", "sleeper"}
    assert [r.status for r in records] == ["interrupted", "interrupted"]
    evs = [json.loads(e) for e in gov.rt.ledger.entries("acme")]
    for record in records:
        ends = [e for e in evs if e.get("run") == record.id and e["action"] == "run.end"]
        assert [e["reason"] for e in ends] == ["interrupted: supervisor stopping"]
        starter = (
            "acme/dev" if record.deployment == "sleeper" else f"supervisor:{host}:{serve.pid}:"
        )
        assert ends[0]["actor"]["id"].startswith(starter), "recorded as its starter's act"
        assert not (gov.home / "runs" / record.id / "code").exists()
    assert place.leftovers() == []
    assert not [c for c in cgroups if c.exists()], "the runs' cgroups are removed"


def _procs(cgroups: list[Path]) -> set[int]:
    found: set[int] = set()
    for c in cgroups:
        with contextlib.suppress(OSError):
            found.update(int(p) for p in (c / "cgroup.procs").read_text().split())
    return found


@pytest.mark.parametrize("backend", GVISOR + BWRAP)
def test_a_sandbox_dies_at_its_wall_clock_limit_though_its_owner_was_killed(
    place: Place, backend: str
) -> None:
    """SIGKILL of the owner before the limit: no proctor process runs afterwards,
    and still the sandbox's processes are gone once the limit (plus the guard's
    grace) has passed; the next command that opens the home records the run."""
    gov = place.gov
    # The limit counts from the run's start, sandbox start included: gVisor's start
    # took over 3 s on a loaded CI machine, and the run was ended before its guest
    # said ready. 6 s leaves it twice that; the wait after the kill grows by 3 s.
    art = gov.artifact_dir("short", SLEEPER, '[limits]\ntimeout = "6s"\n')
    digest = gov.submit("acme", art)
    gov.rt.approvals.grant("acme", digest, gov.principal("alice"))
    gov.rt.deployments.deploy("acme", gov.rt.artifacts.get("acme", digest), "short",
                              environment="production", instruction="a 6 s limit",
                              actor=gov.principal("dev").actor)  # fmt: skip
    proc = subprocess.Popen(
        [PROCTOR, "run", "short", "-t", "acme", "--backend", backend,
         "--token", gov.token("dev")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=place.env,
    )  # fmt: skip
    wait_ready(proc)
    cgroups = cgroups_of(place, proc.pid)
    proc.kill()  # the owner is gone before the limit; nothing of proctor runs from here
    proc.communicate(timeout=DEADLINE)
    if backend == "gvisor":  # bwrap has --die-with-parent; runsc lives on without a guard
        assert _procs(cgroups), "the sandbox outlives its owner's SIGKILL"
    deadline = time.monotonic() + DEADLINE  # generous: the limit is 6 s, the grace 2 s
    while _procs(cgroups):
        assert time.monotonic() < deadline, "the sandbox outlived its wall-clock limit"
        time.sleep(0.2)

    def guards() -> list[Path]:
        return [p for p in Path("/proc").iterdir() if p.name.isdigit()
                and any(str(c) in _cmdline(p) for c in cgroups)]  # fmt: skip

    while guards():
        assert time.monotonic() < deadline, "the guard stays once the sandbox is dead"
        time.sleep(0.1)
    record = Runs(gov.rt).all("acme", "short")[0]
    assert record.status == "running", "nobody has looked yet"
    out = subprocess.run([PROCTOR, "runs", "list", "-t", "acme", "--json"], capture_output=True,
                         env=place.env, timeout=DEADLINE, check=True).stdout  # fmt: skip
    assert {r["deployment"]: r["status"] for r in json.loads(out)} == {"short": "interrupted"}
    assert_nothing_left(place, record.id, cgroups)


def _cmdline(p: Path) -> str:
    try:
        return (p / "cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return ""
