"""A private upstream end to end (issue 17, item 4): guest code in a real sandbox (both
drivers) calls an HTTPS host whose certificate comes from a private CA, through the
real shim and the runtime's own broker (``Runtime.make_broker``, no
``upstream_cafile``: the system's roots), with a secret injected.

With the CA registered for the host (``proctor egress ca add``, here the runtime
call the CLI makes) the call is answered and its completion event names the CA
that verified the upstream; with another CA registered in its place the call is
refused (502), the event records why, and the upstream never sees the secret.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any, ClassVar

import pytest
from cryptography.hazmat.primitives import hashes

from proctor.lifecycle import Supervisor
from tests.e2e.conftest_gov import Gov, build_gov
from tests.integration.test_broker_proxy import UpstreamCA, https_upstream
from tests.sandbox_conftest_helpers import BACKENDS

pytestmark = pytest.mark.sandbox
SECRET = "s3cr3t-" + os.urandom(12).hex()

GUEST = r"""
import json, os, urllib.request, urllib.error
port = int(os.environ["UP_PORT"])
try:
    with urllib.request.urlopen(f"https://localhost:{port}/private", timeout=20) as r:
        print(json.dumps({"status": r.status, "body": r.read().decode()}), flush=True)
except urllib.error.URLError as e:
    print(json.dumps({"error": str(e.reason)[:300]}), flush=True)
"""


class _Private(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    seen: ClassVar[list[str]] = []

    def log_message(self, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        _Private.seen.append(self.headers.get("Authorization", ""))
        body = b"private ok"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture(scope="module")
def private(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[int, UpstreamCA]]:
    with https_upstream(_Private, ["localhost"], tmp_path_factory.mktemp("private")) as up:
        yield up


@pytest.fixture
def gov(tmp_path: Path) -> Iterator[Gov]:
    g = build_gov(tmp_path)
    yield g
    g.rt.close()


def _run(gov: Gov, port: int, backend: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """One run of the job: what the guest printed, and the run's completion event."""
    out: list[bytes] = []
    with gov.rt.make_broker() as broker:
        record = Supervisor(gov.rt, broker, backend).start(
            "acme", "private", gov.principal("dev").actor, on_stdout=out.append,
            env={"UP_PORT": str(port)},
        )  # fmt: skip
    stdout = b"".join(out).decode()
    assert stdout.strip(), (record, (gov.home / "runs" / record.id / "stderr.log").read_text())
    events = [json.loads(e) for e in gov.rt.ledger.entries("acme") if record.id.encode() in e]
    ends = [e for e in events if e["action"] == "http.request.end"]
    assert len(ends) == 1, events
    return json.loads(stdout.splitlines()[0]), ends[0]["details"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_private_upstream_verifies_with_its_ca_and_fails_with_another(
    gov: Gov, private: tuple[int, UpstreamCA], backend: str
) -> None:
    port, ca = private
    rt, op = gov.rt, gov.op
    host = f"localhost:{port}"
    rt.resources.set_secret("acme", "crm_token", "real-" + SECRET, [host], op)
    rt.resources.set_secret("acme", "crm_token_test", SECRET, [host], op, twin_of="crm_token")
    rt.resources.allow_sandbox_host("acme", host, op)
    rt.allow_egress_range("acme", "127.0.0.1/32", op)
    art = gov.artifact_dir("private", GUEST, f"""
        [egress]
        hosts = ["{host}"]
        [secrets]
        names = ["crm_token"]
        [limits]
        timeout = "60s"
        """)  # fmt: skip
    digest = gov.submit("acme", art)
    rt.deployments.deploy("acme", rt.artifacts.get("acme", digest), "private",
                          environment="sandbox", mode="job", instruction="test", actor=op)  # fmt: skip
    _Private.seen.clear()

    rt.add_host_ca("acme", "localhost", ca.pem(), op)
    printed, end = _run(gov, port, backend)
    assert printed == {"status": 200, "body": "private ok"}
    assert _Private.seen == [f"Bearer {SECRET}"]
    assert end["trust"] == "tenant-ca:" + ca.cert.fingerprint(hashes.SHA256()).hex()

    # Another CA in its place: the system's roots are not consulted, nothing verifies.
    other = UpstreamCA.make()
    rt.add_host_ca("acme", "localhost", other.pem(), op)
    rt.remove_host_ca("acme", "localhost", op, ca.cert.fingerprint(hashes.SHA256()).hex())
    printed, end = _run(gov, port, backend)
    assert "502" in printed.get("error", ""), printed
    assert _Private.seen == [f"Bearer {SECRET}"]  # nothing more reached it
    assert end["answered"] == 502 and "did not verify" in end["error"]
    assert "registered for localhost only" in end["error"]
    assert "trust" not in end
    assert SECRET.encode() not in b"\n".join(rt.ledger.entries("acme"))
