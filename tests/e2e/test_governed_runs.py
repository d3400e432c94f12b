"""Issue 5 end to end: the CLI as a user drives it, real sandboxes, the real broker."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from proctor.lifecycle import Runs, Server, Supervisor
from tests.conftest import PROCTOR, run_cli, wait_until
from tests.e2e.conftest_gov import Gov, build_gov
from tests.sandbox_conftest_helpers import BACKENDS, working

pytestmark = pytest.mark.sandbox
#: A test whose sandbox part differs by backend (a governed run through the broker, a
#: service killed, restarted, stopped) runs on every backend. One where the sandbox
#: only carries a governance or API check runs on one, the quicker to start: the
#: run itself is covered on both by the first kind.
EVERY = BACKENDS
ONE = ([b for b in ("bubblewrap", "gvisor") if b in working()] or ["bubblewrap"])[:1]

JOB = """
import proctor_guest
rows = proctor_guest.sql("crm", "SELECT id, country FROM customers WHERE id <= 5")["rows"]
print("read", len(rows), "rows")
"""
CAPS = """
[datasets.crm.tables.customers]
columns = ["id", "country"]
access = "read"
"""
SERVICE = '[lifecycle]\nmode = "service"\n'


@pytest.fixture
def gov(tmp_path: Path) -> Iterator[Gov]:
    g = build_gov(tmp_path)
    # Another principal who both writes and approves: separation of duties applies.
    g.people["carol"] = g.rt.principals.create("acme", "carol", "user",
                                               ["developer", "approver"], g.op)  # fmt: skip
    yield g
    g.rt.close()


def cli(gov: Gov, *args: str, who: str | None = None, check: bool = True) -> Any:
    full = list(args)
    if who is not None:
        full += ["--token", gov.token(who)]
    return run_cli(*full, home=gov.home, check=check)


def submit(gov: Gov, who: str = "dev", main: str = JOB, caps: str = CAPS, name: str = "job") -> str:
    art = gov.artifact_dir(name, main, caps)
    out = cli(gov, "artifact", "submit", str(art), "-t", "acme", "--json", who=who).out
    return str(json.loads(out)["digest"])


def events(gov: Gov, tenant: str = "acme") -> list[dict[str, Any]]:
    return [json.loads(e) for e in gov.rt.ledger.entries(tenant)]


def deploy(gov: Gov, digest: str, name: str = "job", env: str = "production",
           mode: str = "job", check: bool = True, **extra: str) -> Any:  # fmt: skip
    args = ["deploy", digest, "-t", "acme", "--name", name, "--env", env, "--mode", mode,
            "--instruction", "nightly job (RET-1)"]  # fmt: skip
    for k, v in extra.items():
        args += [f"--{k}", v]
    return cli(gov, *args, who="dev", check=check)


# Approvals are decided before any sandbox: one backend (each backend's runs are
# exercised by the tests that follow).
@pytest.mark.parametrize("backend", ONE)
def test_approval_rules_are_enforced_and_a_changed_byte_needs_a_new_approval(
    gov: Gov, backend: str
) -> None:
    digest = submit(gov)
    res = deploy(gov, digest, check=False)
    assert res.code == 5 and "0 valid approval(s)" in res.err
    # The author may not approve (carol holds both roles: policy forbids it).
    own = submit(gov, who="carol", main=JOB + "\n# carol's\n")
    res = cli(gov, "approve", own, "-t", "acme", "--yes", who="carol", check=False)
    assert res.code == 5 and "separation-of-duties" in res.err
    # A developer has no approving role; another tenant's approver is not ours.
    assert cli(gov, "approve", digest, "-t", "acme", "--yes", who="dev", check=False).code == 5
    res = cli(gov, "approve", digest, "-t", "acme", "--yes", who="globex-alice", check=False)
    assert res.code == 5 and "globex/alice may not artifact.read" in res.err
    # Without a token nobody approves: the operator is not a tenant principal.
    assert "must come from a tenant principal" in cli(gov, "approve", digest, "-t", "acme", "--yes",
                                                      check=False).err  # fmt: skip
    # Expired: an approval of one second no longer counts.
    cli(gov, "approve", digest, "-t", "acme", "--yes", "--expires", "1s", who="alice")
    time.sleep(1.2)
    assert deploy(gov, digest, check=False).code == 5
    cli(gov, "approve", digest, "-t", "acme", "--yes", who="bob")
    out = deploy(gov, digest).out
    assert "approved by apr_" in out
    res = cli(gov, "run", "job", "-t", "acme", "--backend", backend, who="dev", check=False)
    assert res.code == 0 and "read 5 rows" in res.out
    # Revoked: the next run is refused, and the refusal is recorded.
    bob = [a for a in gov.rt.approvals.for_artifact("acme", digest) if a.principal == "acme/bob"]
    cli(gov, "approval", "revoke", bob[0].id, "-t", "acme", who="root")
    res = cli(gov, "run", "job", "-t", "acme", "--backend", backend, who="dev", check=False)
    assert res.code == 5 and "0 valid approval(s)" in res.err
    refused = [e for e in events(gov) if e["action"] == "run.start" and e["decision"] == "deny"]
    assert refused and refused[-1]["deployment"] == "job"
    # One changed byte: a new digest that needs approval again.
    changed = submit(gov, main=JOB.replace("<= 5", "<= 6"))
    assert changed != digest
    assert deploy(gov, changed, check=False).code == 5


def test_rollback_goes_back_to_the_previous_approved_version(gov: Gov) -> None:
    first = submit(gov)
    second = submit(gov, main=JOB + "\nprint('v2')\n")
    for d in (first, second):
        cli(gov, "approve", d, "-t", "acme", "--yes", who="alice")
        deploy(gov, d)
    cli(gov, "deploy", "-t", "acme", "--rollback", "job", who="dev")
    versions = gov.rt.deployments.versions("acme", "job")
    assert [(v.version, v.digest) for v in versions] == [(1, first), (2, second), (3, first)]
    assert events(gov)[-1]["action"] == "deployment.rollback"


CRASHER = """
import os, signal
print("up", flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.parametrize("backend", EVERY)
def test_a_crashing_service_is_restarted_then_stopped_as_a_crash_loop(
    gov: Gov, backend: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="proctor.lifecycle")
    digest = submit(gov, main=CRASHER, caps=SERVICE, name="svc")
    gov.rt.deployments.deploy("acme", gov.rt.artifacts.get("acme", digest), "svc",
                              environment="sandbox", mode="service", instruction="svc",
                              actor=gov.op)  # fmt: skip
    with gov.rt.make_broker() as broker:
        server = Server(Supervisor(gov.rt, broker, backend), tick=0.1, backoff=(0.1,),
                        crash_limit=3, crash_window=60)  # fmt: skip
        t = threading.Thread(target=server.serve)
        t.start()
        deadline = time.monotonic() + 60
        while gov.rt.deployments.get("acme", "svc").status == "active":
            assert time.monotonic() < deadline, "the crash loop was never stopped"
            time.sleep(0.1)
        server.stop()
        t.join()
    starts = [e for e in events(gov) if e["action"] == "run.start" and e["deployment"] == "svc"]
    assert [e["details"]["attempt"] for e in starts] == [1, 2, 3]
    ends = [e for e in events(gov) if e["action"] == "run.end" and e["deployment"] == "svc"]
    assert all(e["details"]["status"] == "failed" for e in ends)
    stopped = [e for e in events(gov) if e["action"] == "deployment.stopped"]
    assert "crash loop" in stopped[-1]["reason"]
    # serve's log says the same, a line per restart and one for the stop (docs/operations.md).
    said = [(r.proctor_event, r.proctor_fields) for r in caplog.records  # type: ignore[attr-defined]
            if getattr(r, "proctor_fields", {}).get("deployment") == "svc"]  # fmt: skip
    restarts = [f for ev, f in said if ev == "service.restart"]
    assert [f["attempt"] for f in restarts] == [2, 3], said
    assert [f["last_run"] for f in restarts] == [e["run"] for e in starts[:2]]
    assert [f for ev, f in said if ev == "service.stopped"] == [
        {"tenant": "acme", "deployment": "svc", "failures": 3, "reason": "crash loop"}
    ]


SLEEPER = """
import time
print("serving", flush=True)
time.sleep(600)
"""


def _serve(gov: Gov, backend: str) -> subprocess.Popen[bytes]:
    env = dict(os.environ, PROCTOR_HOME=str(gov.home))
    return subprocess.Popen([PROCTOR, "serve", "--backend", backend, "--no-api"], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip


_wait = wait_until


@pytest.mark.parametrize("backend", EVERY)
def test_serve_killed_and_restarted_marks_interrupted_runs_and_resumes(
    gov: Gov, backend: str
) -> None:
    digest = submit(gov, main=SLEEPER, caps=SERVICE, name="svc")
    gov.rt.deployments.deploy("acme", gov.rt.artifacts.get("acme", digest), "svc",
                              environment="sandbox", mode="service", instruction="svc",
                              actor=gov.op)  # fmt: skip
    runs = Runs(gov.rt)
    first = _serve(gov, backend)
    try:
        old = _wait(lambda: runs.all("acme", "svc", "running"), "the service to run")[0]
        first.send_signal(signal.SIGKILL)
        first.wait()
        second = _serve(gov, backend)
        try:
            _wait(lambda: runs.get("acme", old.id).status == "interrupted", "interrupted")
            new = _wait(lambda: runs.all("acme", "svc", "running"), "the service to resume")[0]
            assert new.id != old.id
            second.send_signal(signal.SIGTERM)
            assert second.wait(timeout=60) == 0
        finally:
            second.kill()
    finally:
        first.kill()
    # SIGTERM to serve ends its runs as interrupted (it did not choose to stop them).
    assert runs.get("acme", new.id).status == "interrupted"
    ends = [e for e in events(gov) if e["action"] == "run.end" and e["run"] == old.id]
    assert ends[0]["reason"] == "interrupted: supervisor died"


@pytest.mark.parametrize("backend", EVERY)
def test_freeze_stops_everything_until_unfreeze(gov: Gov, backend: str) -> None:
    digest = submit(gov, main=SLEEPER, caps=SERVICE, name="svc")
    gov.rt.deployments.deploy("acme", gov.rt.artifacts.get("acme", digest), "svc",
                              environment="sandbox", mode="service", instruction="svc",
                              actor=gov.op)  # fmt: skip
    runs = Runs(gov.rt)
    serve = _serve(gov, backend)
    try:
        running = _wait(lambda: runs.all("acme", "svc", "running"), "the service")[0]
        cli(gov, "tenant", "freeze", "acme", who="root")
        _wait(lambda: runs.get("acme", running.id).status == "stopped", "the freeze to stop it")
        res = cli(gov, "run", "svc", "-t", "acme", "--backend", backend, who="dev",
                  check=False)  # fmt: skip
        assert res.code == 5 and "frozen" in res.err
        time.sleep(1.5)
        assert runs.all("acme", "svc", "running") == [], "a frozen tenant's service stays down"
        cli(gov, "tenant", "unfreeze", "acme", who="root")
        _wait(lambda: runs.all("acme", "svc", "running"), "the service to come back")
    finally:
        serve.send_signal(signal.SIGTERM)
        serve.wait(timeout=60)
    actions = [e["action"] for e in events(gov)]
    assert "tenant.freeze" in actions and "tenant.unfreeze" in actions


@pytest.mark.parametrize("backend", ONE)
def test_history_at_a_past_time_gives_that_time(gov: Gov, backend: str) -> None:
    first = submit(gov)
    cli(gov, "approve", first, "-t", "acme", "--yes", who="alice")
    deploy(gov, first)
    cli(gov, "run", "job", "-t", "acme", "--backend", backend, who="dev")
    then = gov.rt.deployments.get("acme", "job").created_at
    time.sleep(0.05)
    second = submit(gov, main=JOB + "\nprint('v2')\n")
    cli(gov, "approve", second, "-t", "acme", "--yes", who="bob")
    deploy(gov, second)
    past = json.loads(cli(gov, "history", "-t", "acme", "--at", then, "--json",
                          "--window", "0s").out)  # fmt: skip
    now = json.loads(cli(gov, "history", "-t", "acme", "--at", "now", "--json").out)
    assert [d["artifact"] for d in past["deployments"]] == [first]
    assert past["deployments"][0]["approved_by"] == ["acme/alice"]
    assert [d["artifact"] for d in now["deployments"]] == [second]
    run = now["runs"][0]
    assert run["data"] == ["crm.customers(country,id)"] and run["status"] == "succeeded"


def test_nothing_of_one_tenant_is_visible_or_usable_from_another(gov: Gov) -> None:
    digest = submit(gov)
    cli(gov, "approve", digest, "-t", "acme", "--yes", who="alice")
    deploy(gov, digest)
    for args in (
        ["artifact", "show", digest, "-t", "acme"],
        ["artifact", "list", "-t", "acme"],
        ["runs", "list", "-t", "acme"],
        ["audit", "events", "-t", "acme"],
        ["dataset", "list", "-t", "acme"],
        ["secret", "list", "-t", "acme"],
        ["deployment", "list", "-t", "acme"],
        ["run", "job", "-t", "acme"],
        ["approve", digest, "-t", "acme", "--yes"],
    ):
        res = cli(gov, *args, who="globex-root", check=False)
        assert res.code == 5, (args, res.err)
        assert digest not in res.out
    # A globex artifact that names acme's dataset gets nothing: it is not globex's.
    gdigest = json.loads(run_cli("artifact", "submit", str(gov.artifact_dir("g", JOB, CAPS)),
                                 "-t", "globex", "--json", "--token", gov.token("globex-dev"),
                                 home=gov.home).out)["digest"]  # fmt: skip
    res = run_cli("deploy", gdigest, "-t", "globex", "--name", "g", "--env", "sandbox",
                  "--instruction", "x", "--token", gov.token("globex-dev"), home=gov.home,
                  check=False)  # fmt: skip
    assert res.code == 5 and "crm" in res.err
    # globex's log holds globex's own attempts (naming what it asked for, denied),
    # never anything of acme's: no approvals, runs, datasets or deployments.
    acme_ids = [a.id for a in gov.rt.approvals.for_artifact("acme", digest)]
    for ev in events(gov, "globex"):
        raw = json.dumps(ev)
        assert not any(i in raw for i in acme_ids)
        assert "crm.db" not in raw
        if digest in raw:
            assert ev["decision"] == "deny" and ev["actor"]["id"] == "globex/root"


@pytest.mark.parametrize("backend", ONE)
def test_sandbox_runs_of_a_digest_are_shown_beside_its_approvals(gov: Gov, backend: str) -> None:
    digest = submit(gov, main="print('hello from the build loop')\n", caps="", name="try")
    deploy(gov, digest, name="try", env="sandbox")
    res = cli(gov, "run", "try", "-t", "acme", "--backend", backend, who="dev")
    assert "hello from the build loop" in res.out
    run_id = Runs(gov.rt).of_artifact("acme", digest)[0].id
    listing = cli(gov, "approval", "list", "-t", "acme", "--digest", digest, who="alice").out
    assert run_id in listing and "succeeded" in listing
    approved = cli(gov, "approve", digest, "-t", "acme", "--yes", who="alice").out
    assert run_id in approved


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize("backend", ONE)
def test_the_cli_works_through_the_api_with_server(gov: Gov, backend: str) -> None:
    """`proctor --server URL --token T ...`: the same commands, through the HTTP API
    that `proctor serve` starts; local-only commands say so."""
    port = _free_port()
    env = dict(os.environ, PROCTOR_HOME=str(gov.home))
    serve = subprocess.Popen(
        [PROCTOR, "serve", "--backend", backend, "--api-port", str(port)], env=env,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        from proctor import Client

        def up() -> bool:
            try:
                Client(url, gov.token("dev")).health()
            except Exception:
                return False
            return True

        _wait(up, "the API")

        def remote(*args: str, who: str, check: bool = True) -> Any:
            return run_cli("--server", url, *args, "--token", gov.token(who), check=check)

        art = gov.artifact_dir("job", JOB, CAPS)
        digest = json.loads(remote("artifact", "submit", str(art), "-t", "acme", "--json",
                                   who="dev").out)["digest"]  # fmt: skip
        assert remote("approve", digest, "-t", "acme", "--yes", who="dev", check=False).code == 5
        remote("approve", digest, "-t", "acme", "--yes", who="alice")
        remote("deploy", digest, "-t", "acme", "--name", "job", "--env", "production",
               "--instruction", "over the API", who="dev")  # fmt: skip
        res = remote("run", "job", "-t", "acme", who="dev")
        assert "read 5 rows" in res.out
        runs = json.loads(remote("runs", "list", "-t", "acme", who="dev").out)
        assert [r["status"] for r in runs] == ["succeeded"]
        lines = remote("audit", "events", "-t", "acme", "--jsonl", who="root").raw.splitlines()
        assert any(b'"run.end"' in line for line in lines)
        assert remote("audit", "checkpoint", "-t", "acme", who="root").out.startswith(
            "proctor.local/tenant/acme\n"
        )
        other = remote("runs", "list", "-t", "acme", who="globex-root", check=False)
        assert other.code != 0
        local = remote("dataset", "list", "-t", "acme", who="root", check=False)
        assert local.code == 2 and "local Proctor home only" in local.err
        assert run_cli("--server", url, "runs", "list", "-t", "acme", check=False).code == 2
    finally:
        serve.send_signal(signal.SIGTERM)
        serve.wait(timeout=60)
