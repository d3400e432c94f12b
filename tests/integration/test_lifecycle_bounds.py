"""Issue 23, item 6: a run's footing is held at every call, not at the next poll.

A real governed run on a real sandbox loops SQL calls through the real broker
while another process (the CLI) freezes the tenant, stops the deployment or
revokes the run's approval. No timing is asserted: the ledger orders it. Every
call event of the run after the governance event's index must be a refusal
(its standing re-read in the same transaction as the call's event), and the
run must have been answered before it.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from proctor.errors import RunRefused, StoreError
from proctor.ledger import utc_now
from proctor.lifecycle import RunRecord, Runs, Supervisor
from proctor.store import Store
from tests.conftest import PROCTOR, run_cli
from tests.e2e.conftest_gov import Gov, build_gov
from tests.sandbox_conftest_helpers import working

pytestmark = pytest.mark.sandbox
CALLS = {"sql.select", "file.write"}
STANDING_RULE = "proctor:broker:run-standing"  # the broker's rule named in the refusal
ONE = ([b for b in ("bubblewrap", "gvisor") if b in working()] or ["bubblewrap"])[:1]

# SQL and file calls in turn until it is stopped; every answer and refusal is printed.
LOOPER = """
import proctor_guest as g
for i in range(1000000):
    try:
        if i % 2:
            g.write("reports", f"n/{i}.txt", b"x")
        else:
            g.sql("crm", "SELECT id FROM customers WHERE id <= ?", [1 + i % 5])
        print("ANSWER", i, flush=True)
    except Exception as exc:
        print("REFUSED", i, str(exc)[:200], flush=True)
"""
CAPS = """
[datasets.crm.tables.customers]
columns = ["id"]
access = "read"

[buckets]
reports = "write"
"""


@pytest.fixture
def gov(tmp_path: Path) -> Iterator[Gov]:
    g = build_gov(tmp_path)
    yield g
    g.rt.close()


def _deploy(gov: Gov) -> str:
    digest = gov.submit("acme", gov.artifact_dir("looper", LOOPER, CAPS))
    approval = gov.rt.approvals.grant("acme", digest, gov.principal("alice"))
    gov.rt.deployments.deploy("acme", gov.rt.artifacts.get("acme", digest), "looper",
                              environment="production", instruction="loops calls (RET-1)",
                              actor=gov.principal("dev").actor)  # fmt: skip
    return approval.id


def _events(gov: Gov) -> list[dict[str, Any]]:
    return [json.loads(e) for e in gov.rt.ledger.entries("acme")]


@pytest.mark.parametrize("how", ["freeze", "stop", "revoke"])
@pytest.mark.parametrize("backend", ONE)
def test_the_first_call_after_a_freeze_stop_or_revocation_is_refused(
    gov: Gov, backend: str, how: str
) -> None:
    approval = _deploy(gov)
    answered = threading.Event()
    done: list[RunRecord] = []

    def out(data: bytes) -> None:
        if b"ANSWER 20" in data:
            answered.set()

    with gov.rt.make_broker() as broker:
        sup = Supervisor(gov.rt, broker, backend)
        thread = threading.Thread(
            target=lambda: done.append(
                sup.start("acme", "looper", gov.principal("dev").actor, on_stdout=out)
            )
        )
        thread.start()
        try:
            assert answered.wait(120), "the run never got going"
            # Another process takes the run's footing away.
            args = {
                "freeze": ["tenant", "freeze", "acme"],
                "stop": ["deployment", "stop", "looper", "-t", "acme"],
                "revoke": ["approval", "revoke", approval, "-t", "acme"],
            }[how]
            run_cli(*args, "--token", gov.token("root"), home=gov.home)
        finally:
            thread.join(120)
    (record,) = done
    action = {"freeze": "tenant.freeze", "stop": "deployment.stopped",
              "revoke": "approval.revoke"}[how]  # fmt: skip
    evs = _events(gov)
    (cut,) = [e["seq"] for e in evs if e["action"] == action]
    calls = [e for e in evs if e.get("run") == record.id and e["action"] in CALLS]
    before = [e for e in calls if e["seq"] < cut]
    after = [e for e in calls if e["seq"] > cut]
    assert before and all(e["decision"] == "allow" for e in before)
    assert after, "the run made calls after the event (the watcher polls every 0.5 s)"
    allowed = [e["seq"] for e in after if e["decision"] == "allow"]
    assert allowed == [], f"calls allowed after {action} (seq {cut})"
    assert all(e["policies"] == [STANDING_RULE] for e in after)
    why = {"freeze": "the tenant is frozen", "stop": "the deployment is stopped",
           "revoke": "its approvals no longer make the quorum"}[how]  # fmt: skip
    assert after[0]["reason"].startswith(f"refused: {why}")
    assert {e["action"] for e in before} == CALLS, "SQL and files both answered before"
    assert record.status == "stopped"


# -- one serve per home -------------------------------------------------------------


def _serve_env(gov: Gov, root: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("PROCTOR_TOKEN", None)
    env.update(PROCTOR_HOME=str(gov.home), PROCTOR_SANDBOX_REGISTRY=str(root / "sandboxes"),
               PROCTOR_BROKER_SOCKETS=str(root / "brokers"), COLUMNS="200")  # fmt: skip
    return env


def _serving(env: dict[str, str]) -> subprocess.Popen[bytes]:
    """A `proctor serve --no-api` that has said it is serving."""
    proc = subprocess.Popen([PROCTOR, "serve", "--no-api"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=env)  # fmt: skip
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.startswith(b"serving"), (line, proc.stderr.read() if proc.stderr else b"")
    return proc


def test_a_second_serve_of_one_home_is_refused_and_a_dead_ones_lock_is_not_kept(
    gov: Gov,
) -> None:
    root = Path(tempfile.mkdtemp(prefix="lock-", dir="/tmp"))
    env = _serve_env(gov, root)
    first = _serving(env)
    try:
        second = subprocess.run([PROCTOR, "serve", "--no-api"], capture_output=True,
                                env=env, timeout=60)  # fmt: skip
        err = second.stderr.decode()
        assert second.returncode != 0
        assert "supervises" in err and f":{first.pid}:" in err, err
        assert first.poll() is None, "the first serve is not disturbed"
        first.kill()  # SIGKILL: no clean-up; the kernel drops the lock with the process
        first.wait()
        third = _serving(env)
        third.send_signal(signal.SIGTERM)
        assert third.wait(timeout=60) == 0
    finally:
        for proc in (first,):
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        shutil.rmtree(root, ignore_errors=True)


# -- one run of a service at a time -------------------------------------------------


def _row(run_id: str, deployment: str = "svc") -> tuple[Any, ...]:
    """A run's values in RunRecord's field order."""
    return (run_id, "acme", deployment, 1, "sha256:" + "0" * 64, "production",
            f"spiffe://proctor.local/tenant/acme/deployment/{deployment}/run/{run_id}", "[]",
            "bubblewrap", None, "running", None, None, 1, "{}", None, utc_now(), None)  # fmt: skip


def _running(store: Store, deployment: str = "svc") -> list[str]:
    with store.read() as conn:
        rows = conn.query(
            "SELECT id FROM runs WHERE tenant = 'acme' AND deployment = ? AND status = 'running'",
            (deployment,),
        )
    return [str(r[0]) for r in rows]


def test_racing_starts_of_a_service_leave_one_run_on_either_engine(ledger_env: Any) -> None:
    store = ledger_env.store
    with store.write() as conn:
        conn.execute("INSERT INTO tenants (name, created_at, created_by, status)"
                     " VALUES ('acme', ?, 'test', 'active')", (utc_now(),))  # fmt: skip
    starters = 6
    barrier = threading.Barrier(starters)
    outcomes: list[str] = []

    def start(i: int) -> None:
        barrier.wait()
        try:
            # Distinct lock names: on PostgreSQL the transactions really overlap.
            with store.write(f"race-{i}") as conn:
                Runs.insert(conn, _row(f"r-{i}"), f"owner-{i}", exclusive=True)
            outcomes.append("started")
        except RunRefused as exc:
            outcomes.append(exc.message)

    threads = [threading.Thread(target=start, args=(i,)) for i in range(starters)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert outcomes.count("started") == 1, outcomes
    assert all("running already" in o for o in outcomes if o != "started")
    assert len(_running(store)) == 1
    # The store itself refuses a second running row, not only Runs' look before it.
    columns = (
        "id, tenant, deployment, version, digest, environment, workload, approvals, backend,"
        " platform, status, reason, exit_code, attempt, limits, output_digest, started_at,"
        " ended_at, supervisor, service"
    )
    with pytest.raises(StoreError), store.write() as conn:
        conn.execute(f"INSERT INTO runs ({columns}) VALUES ({', '.join('?' * 20)})",
                     (*_row("r-sneak"), "owner", "svc"))  # fmt: skip
    assert len(_running(store)) == 1
    # Jobs are not limited; a service whose run ended may start again.
    for i in range(2):
        with store.write() as conn:
            Runs.insert(conn, _row(f"j-{i}", "job"), "owner")
    assert len(_running(store, "job")) == 2
    with store.write() as conn:
        conn.execute("UPDATE runs SET status = 'interrupted' WHERE deployment = 'svc'")
    with store.write() as conn:
        Runs.insert(conn, _row("r-again"), "owner", exclusive=True)
    assert _running(store) == ["r-again"]


SERVICE = """
import time
print("up", flush=True)
time.sleep(300)
"""


@pytest.mark.parametrize("backend", ONE)
def test_a_second_start_of_a_running_service_is_refused_and_recorded(
    gov: Gov, backend: str
) -> None:
    digest = gov.submit("acme", gov.artifact_dir("svc", SERVICE, '[lifecycle]\nmode = "service"\n'))
    gov.rt.deployments.deploy("acme", gov.rt.artifacts.get("acme", digest), "svc",
                              environment="sandbox", mode="service", instruction="svc",
                              actor=gov.op)  # fmt: skip
    up = threading.Event()
    stop = threading.Event()
    done: list[RunRecord] = []
    with gov.rt.make_broker() as broker:
        sup = Supervisor(gov.rt, broker, backend)
        thread = threading.Thread(target=lambda: done.append(sup.start(
            "acme", "svc", gov.op, on_stdout=lambda _: up.set(), cancel=stop)))  # fmt: skip
        thread.start()
        try:
            assert up.wait(120), "the service never came up"
            # From another process: the CLI's own supervisor.
            res = run_cli("run", "svc", "-t", "acme", "--backend", backend, "--token",
                          gov.token("dev"), home=gov.home, check=False)  # fmt: skip
            assert res.code != 0 and "running already" in res.err, res.err
            with pytest.raises(RunRefused, match="running already"):
                sup.start("acme", "svc", gov.op)
        finally:
            stop.set()
            thread.join(120)
    (record,) = Runs(gov.rt).all("acme", "svc")
    assert record.id == done[0].id and record.status == "stopped"
    refusals = [e for e in _events(gov) if e["action"] == "run.start" and e["decision"] == "deny"]
    assert len(refusals) == 2 and all("running already" in e["reason"] for e in refusals)


def test_a_run_that_no_longer_stands_is_refused_every_call_but_keeps_its_evidence(
    gov: Gov,
) -> None:
    """At the scope: every allowed event (egress, SQL, files, secrets, whoami) is
    refused once the standing says no, and recorded as that refusal; a completion
    event of a call admitted before (``http.request.end``) is still recorded."""
    import asyncio

    from proctor.broker import CallDenied, RunScope
    from proctor.policy import Decision

    rt = gov.rt
    policies = rt.policies.compiled("acme", "")
    why: list[str] = []
    scope = RunScope("acme", "r-scope", "spiffe://proctor.local/tenant/acme/deployment/d/run/r",
                     "d", None, (), "sandbox", policies, rt.ledger,
                     standing=lambda _conn: why[0] if why else None)  # fmt: skip
    allow = Decision(True, ("permit-all",), policies.version)

    async def calls() -> list[str]:
        out = []
        for action in ("http.request", "sql.select", "file.write", "broker.whoami"):
            try:
                await scope.record(action, "thing/x", allow, reason="ok", details={})
                out.append("allowed")
            except CallDenied as exc:
                out.append(exc.message)
        await scope.record("http.request.end", "thing/x", allow, reason="closed", details={})
        return out

    assert asyncio.run(calls()) == ["allowed"] * 4
    why.append("the tenant is frozen")
    refused = asyncio.run(calls())
    assert all(r.endswith("refused: the tenant is frozen") for r in refused), refused
    evs = [e for e in _events(gov) if e.get("run") == "r-scope"]
    assert [e["decision"] for e in evs] == ["allow"] * 5 + ["deny"] * 4 + ["allow"]
    assert {tuple(e["policies"]) for e in evs[5:9]} == {(STANDING_RULE,)}
    assert evs[-1]["action"] == "http.request.end"


@pytest.mark.parametrize("backend", ONE)
def test_serve_leaves_a_service_that_runs_elsewhere_alone_and_takes_it_up_after(
    gov: Gov, backend: str
) -> None:
    """A run of the service started by someone else (`proctor run`, the API) is
    neither doubled by serve nor counted as a crash; serve keeps it up once it ends."""
    from proctor.lifecycle import Server

    digest = gov.submit("acme", gov.artifact_dir("svc", SERVICE, '[lifecycle]\nmode = "service"\n'))
    gov.rt.deployments.deploy("acme", gov.rt.artifacts.get("acme", digest), "svc",
                              environment="sandbox", mode="service", instruction="svc",
                              actor=gov.op)  # fmt: skip
    up = threading.Event()
    stop = threading.Event()
    runs = Runs(gov.rt)
    with gov.rt.make_broker() as broker:
        sup = Supervisor(gov.rt, broker, backend)
        other = threading.Thread(target=lambda: sup.start(
            "acme", "svc", gov.op, on_stdout=lambda _: up.set(), cancel=stop))  # fmt: skip
        other.start()
        server = Server(sup, tick=0.1, backoff=(0.1,), crash_limit=2)
        try:
            assert up.wait(120), "the service never came up"
            for _ in range(5):
                server.tick()
            assert len(runs.all("acme", "svc")) == 1, "serve doubled the running service"
            stop.set()
            other.join(120)
            server.tick()  # its run has ended: serve takes the service up
            deadline = time.monotonic() + 120
            while not runs.all("acme", "svc", "running"):
                assert time.monotonic() < deadline, "serve never took the service up"
                time.sleep(0.05)
        finally:
            stop.set()
            server.stop()
            server.serve()  # returns at once: stops what the ticks started, lets go
    assert gov.rt.deployments.get("acme", "svc").status == "active", "counted as a crash"
    denied = [e for e in _events(gov) if e["action"] == "run.start" and e["decision"] == "deny"]
    assert denied == []
    assert [r.status for r in runs.all("acme", "svc")] == ["stopped", "interrupted"]


def test_an_api_server_without_serve_ends_its_runs_before_it_stops(tmp_path: Path) -> None:
    """The API makes its own supervisor when no `serve` hands it one; stopping the API
    stops that supervisor's runs, each recorded, before the broker they use goes."""
    from proctor.client import Client
    from tests.integration.test_api_support import artifact_dir, build_env

    env = build_env(tmp_path)
    try:
        dev = Client(env.url, env.token("acme", "dev"))
        alice = Client(env.url, env.token("acme", "alice"))
        body = "import time\nprint('started', flush=True)\ntime.sleep(120)\n"
        digest = dev.submit_artifact("acme", artifact_dir(tmp_path, "sleeper", body))["digest"]
        alice.approve("acme", digest, comment="a sleeper", expires_seconds=3600)
        dev.deploy("acme", digest, "sleeper", environment="production", instruction="test")
        started = threading.Event()
        outcome: list[object] = []

        def run() -> None:
            def seen(text: str) -> None:
                if "started" in text:
                    started.set()

            try:
                outcome.append(dev.run("acme", "sleeper", on_stdout=seen))
            except Exception as exc:  # the stream is cut when the server stops
                outcome.append(exc)

        runner = threading.Thread(target=run, daemon=True)
        runner.start()
        assert started.wait(60), "the run never started"
        (record,) = Runs(env.rt).all("acme", "sleeper")
        assert record.status == "running"
    finally:
        env.server.stop()
    runner.join(30)
    (record,) = Runs(env.rt).all("acme", "sleeper")
    env.rt.close()
    assert record.status == "interrupted", record
    assert record.reason is not None and "supervisor stopping" in record.reason
