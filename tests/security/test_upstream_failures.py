"""An upstream that fails is named to the developer (issue 33, item 1): guest code in a
real sandbox calls, through the real shim and the runtime's own broker, an HTTPS
server on loopback whose certificate is self-signed (a secret is injected for it, so
the broker ends TLS and verifies the upstream) and a port nothing listens on (a
plain tunnel, and plain HTTP).

Before, the job got a bare ``502 Bad Gateway`` and ``runs show`` listed the calls as
``allow``; the cause was only in the ``http.request.end`` event. Now the job's own
exception names the cause and the seq of the event that records it, the answer's
body and ``X-Proctor-Upstream-Failure`` header say the same, no secret is in any of
it, and ``runs show`` (the real CLI) shows each such call as failed upstream.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import ssl
import subprocess
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, ClassVar

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from proctor.lifecycle import Supervisor
from tests.conftest import PROCTOR, run_cli
from tests.e2e.conftest_gov import Gov, build_gov
from tests.sandbox_conftest_helpers import working

pytestmark = pytest.mark.sandbox
BACKEND = ([b for b in ("bubblewrap", "gvisor") if b in working()] or ["bubblewrap"])[0]
SECRET = "s3cr3t-" + os.urandom(12).hex()

JOB = r"""
import json, os, urllib.request, urllib.error
out = {}
for name, url in (("cert", f"https://localhost:{os.environ['SS_PORT']}/x"),
                  ("tunnel", f"https://127.0.0.1:{os.environ['CLOSED']}/x"),
                  ("plain", f"http://127.0.0.1:{os.environ['CLOSED']}/x")):
    try:
        urllib.request.urlopen(url, timeout=30)
        out[name] = {"ok": True}
    except urllib.error.HTTPError as e:
        out[name] = {"status": e.code, "text": str(e),
                     "header": e.headers.get("X-Proctor-Upstream-Failure"),
                     "body": json.loads(e.read())}
    except urllib.error.URLError as e:
        out[name] = {"text": str(e.reason)}
print(json.dumps(out), flush=True)
"""


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    seen: ClassVar[list[str]] = []

    def log_message(self, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        _Handler.seen.append(self.headers.get("Authorization", ""))
        self.send_response(200)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"ok")


def _self_signed(path: Path) -> Path:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost")]), False)
        .sign(key, hashes.SHA256())
    )
    path.write_bytes(
        cert.public_bytes(serialization.Encoding.PEM)
        + key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return path


@pytest.fixture(scope="module")
def self_signed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    """A real HTTPS server on 127.0.0.1 with a self-signed certificate for localhost."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(_self_signed(tmp_path_factory.mktemp("ss") / "leaf.pem"))
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    server.socket = ctx.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield int(server.server_address[1])
    server.shutdown()
    server.server_close()


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def failed(
    tmp_path_factory: pytest.TempPathFactory, self_signed: int
) -> Iterator[tuple[Gov, str, dict[str, Any]]]:
    """One run of the job: (the governed home, the run's id, what the guest printed)."""
    gov = build_gov(tmp_path_factory.mktemp("upfail"))
    rt, op = gov.rt, gov.op
    closed = _closed_port()
    host, dead = f"localhost:{self_signed}", f"127.0.0.1:{closed}"
    rt.resources.set_secret("acme", "crm_token", "real-" + SECRET, [host], op)
    rt.resources.set_secret("acme", "crm_token_test", SECRET, [host], op, twin_of="crm_token")
    for h in (host, dead):
        rt.resources.allow_sandbox_host("acme", h, op)
    rt.allow_egress_range("acme", "127.0.0.1/32", op)
    art = gov.artifact_dir("upfail", JOB, f"""
        [egress]
        hosts = ["{host}", "{dead}", "127.0.0.1:{closed}"]
        [secrets]
        names = ["crm_token"]
        [limits]
        timeout = "60s"
        """)  # fmt: skip
    digest = gov.submit("acme", art)
    rt.deployments.deploy("acme", rt.artifacts.get("acme", digest), "upfail",
                          environment="sandbox", mode="job", instruction="test", actor=op)  # fmt: skip
    out: list[bytes] = []
    with rt.make_broker() as broker:
        record = Supervisor(rt, broker, BACKEND).start(
            "acme", "upfail", gov.principal("dev").actor, on_stdout=out.append,
            env={"SS_PORT": str(self_signed), "CLOSED": str(closed)},
        )  # fmt: skip
    stdout = b"".join(out).decode()
    assert stdout.strip(), (record, (gov.home / "runs" / record.id / "stderr.log").read_text())
    yield gov, record.id, json.loads(stdout.strip().splitlines()[-1])
    rt.close()


def _event(gov: Gov, seq: int) -> dict[str, Any]:
    (data,) = list(gov.rt.ledger.entries("acme", seq, seq + 1))
    return dict(json.loads(data))


def _seq_in(text: str) -> int:
    marker = "proctor upstream failure seq="
    assert marker in text, text
    return int(text.split(marker, 1)[1].split(":", 1)[0])


def test_the_job_is_told_the_certificate_did_not_verify_with_the_event(
    failed: tuple[Gov, str, dict[str, Any]],
) -> None:
    gov, run_id, guest = failed
    text = guest["cert"]["text"]
    # Python's own exception: "Tunnel connection failed: 502 Bad Gateway (proctor ...)".
    assert "502" in text and "upstream certificate did not verify: self-signed certificate" in (
        text
    ), text
    ev = _event(gov, _seq_in(text))
    assert ev["action"] == "http.request.end" and ev["run"] == run_id
    assert ev["details"]["answered"] == 502
    assert "self-signed certificate" in ev["details"]["error"]
    assert _Handler.seen == []  # the secret never went to an upstream that did not verify
    assert SECRET not in json.dumps(guest) and "real-" + SECRET not in json.dumps(guest)


def test_the_job_is_told_the_connection_was_refused_with_the_event(
    failed: tuple[Gov, str, dict[str, Any]],
) -> None:
    gov, run_id, guest = failed
    tunnel = guest["tunnel"]["text"]
    assert "connection refused" in tunnel, tunnel
    ev = _event(gov, _seq_in(tunnel))
    assert ev["action"] == "http.request.end" and ev["run"] == run_id
    assert "connection refused" in ev["details"]["error"]
    # Plain HTTP: the status line, the header and the body all name it.
    plain = guest["plain"]
    assert plain["status"] == 502 and "connection refused" in plain["text"], plain
    seq = plain["body"]["seq"]
    assert plain["body"]["error"] == "upstream_failed"
    assert "connection refused" in plain["body"]["reason"]
    assert (
        plain["header"].startswith(f"seq={seq}; reason=")
        and "connection refused" in (plain["header"])
    )
    assert _event(gov, seq)["details"]["answered"] == 502


def test_runs_show_lists_the_calls_as_failed_upstream(
    failed: tuple[Gov, str, dict[str, Any]],
) -> None:
    gov, run_id, _ = failed
    doc = json.loads(run_cli("runs", "show", run_id, "-t", "acme", "--json", home=gov.home).out)
    calls = [c for c in doc["calls"] if c["action"] == "http.request"]
    assert len(calls) == 3, doc["calls"]
    assert all(c["decision"] == "allow" and "failed" in c for c in calls), calls
    errors = sorted(c["failed"]["error"] for c in calls)
    assert sum("connection refused" in e for e in errors) == 2, errors
    assert sum("self-signed certificate" in e for e in errors) == 1, errors
    for c in calls:
        assert _event(gov, c["failed"]["seq"])["details"]["decision_seq"] == c["seq"]
    env = {**os.environ, "PROCTOR_HOME": str(gov.home), "COLUMNS": "80"}
    narrow = subprocess.run([PROCTOR, "runs", "show", run_id, "-t", "acme"], env=env,
                            capture_output=True, check=True, timeout=120).stdout.decode()  # fmt: skip
    assert max(len(line) for line in narrow.splitlines()) <= 80, narrow  # issue 33, item 7
    human = run_cli("runs", "show", run_id, "-t", "acme", home=gov.home).out
    assert "3 of them failed upstream" in human, human
    assert human.count("failed upstream") >= 4 and "self-signed certificate" in human, human
