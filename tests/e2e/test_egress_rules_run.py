"""Request rules end to end (issue 17, item 5): guest code in a real sandbox (both
drivers) calls a read-only REST API through the real shim and the runtime's own
broker. The manifest allows ``GET /v1/customers/*`` on the host and nothing else,
with no secret bound: the supervisor gives the run the tenant CA (constrained to the
host), the broker ends TLS, and a DELETE and a path outside the pattern are refused
inside TLS, naming the rule, recorded, and never reach the API.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any, ClassVar

import pytest

from proctor.lifecycle import Supervisor
from tests.e2e.conftest_gov import Gov, build_gov
from tests.integration.test_broker_proxy import UpstreamCA, https_upstream
from tests.sandbox_conftest_helpers import BACKENDS

pytestmark = pytest.mark.sandbox

GUEST = r"""
import json, os, urllib.request, urllib.error
port = int(os.environ["UP_PORT"])
out = []
for method, path in (("GET", "/v1/customers/42"), ("DELETE", "/v1/customers/42"),
                     ("GET", "/v1/invoices/7")):
    req = urllib.request.Request(f"https://localhost:{port}{path}", method=method)
    try:
        with urllib.request.urlopen(req, timeout=20) as r:
            out.append({"status": r.status, "body": r.read().decode()})
    except urllib.error.HTTPError as e:
        out.append({"status": e.code, "body": json.loads(e.read())})
    except urllib.error.URLError as e:
        out.append({"error": str(e.reason)[:300]})
print(json.dumps(out), flush=True)
"""


class _Crm(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    seen: ClassVar[list[tuple[str, str]]] = []

    def log_message(self, *args: Any) -> None:
        pass

    def _handle(self) -> None:
        _Crm.seen.append((self.command, self.path))
        body = b'{"id": 42}'
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_DELETE = _handle


@pytest.fixture(scope="module")
def crm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[int, UpstreamCA]]:
    with https_upstream(_Crm, ["localhost"], tmp_path_factory.mktemp("crm")) as up:
        yield up


@pytest.fixture
def gov(tmp_path: Path) -> Iterator[Gov]:
    g = build_gov(tmp_path)
    yield g
    g.rt.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_read_only_api_in_a_real_run(gov: Gov, crm: tuple[int, UpstreamCA], backend: str) -> None:
    port, ca = crm
    rt, op = gov.rt, gov.op
    host = f"localhost:{port}"
    rt.resources.allow_sandbox_host("acme", host, op)
    rt.allow_egress_range("acme", "127.0.0.1/32", op)
    rt.add_host_ca("acme", "localhost", ca.pem(), op)
    art = gov.artifact_dir("crmread", GUEST, f"""
        [egress]
        hosts = ["{host}"]
        [egress.rules."{host}"]
        methods = ["GET"]
        paths = ["/v1/customers/*"]
        [limits]
        timeout = "60s"
        """)  # fmt: skip
    digest = gov.submit("acme", art)
    rt.deployments.deploy("acme", rt.artifacts.get("acme", digest), "crmread",
                          environment="sandbox", mode="job", instruction="test", actor=op)  # fmt: skip
    _Crm.seen.clear()
    out: list[bytes] = []
    with rt.make_broker() as broker:
        record = Supervisor(rt, broker, backend).start(
            "acme", "crmread", gov.principal("dev").actor, on_stdout=out.append,
            env={"UP_PORT": str(port)},
        )  # fmt: skip
    stdout = b"".join(out).decode()
    assert stdout.strip(), (record, (gov.home / "runs" / record.id / "stderr.log").read_text())
    got, deleted, other = json.loads(stdout.splitlines()[0])
    assert got == {"status": 200, "body": '{"id": 42}'}
    rule = f"proctor:egress:rule:{host}"
    assert deleted["status"] == 403 and deleted["body"]["policies"] == [f"{rule}:methods"]
    assert other["status"] == 403 and other["body"]["policies"] == [f"{rule}:paths"]
    assert _Crm.seen == [("GET", "/v1/customers/42")]
    events = [json.loads(e) for e in rt.ledger.entries("acme") if record.id.encode() in e]
    denies = [e for e in events if e["action"] == "http.request" and e["decision"] == "deny"]
    assert [d["policies"] for d in denies] == [[f"{rule}:methods"], [f"{rule}:paths"]]
    allowed = [e for e in events if e["action"] == "http.request" and e["decision"] == "allow"]
    assert allowed and all(a["details"]["rules"]["methods"] == ["GET"] for a in allowed)
