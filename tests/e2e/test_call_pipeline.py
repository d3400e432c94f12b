"""One call, one path (issue 32): a call of each kind, made by guest code in a real
sandbox through the real shim, broker and ledger, passes the pipeline's stages in
order, as the trace the pipeline keeps for each call shows; and an HTTPS request
with a secret injected is one decision and one event, then its completion record."""

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

from proctor.evidence import export_pack, verify_pack
from proctor.lifecycle import Supervisor
from tests.e2e.conftest_gov import Gov, build_gov
from tests.integration.test_broker_proxy import UpstreamCA
from tests.sandbox_conftest_helpers import BACKENDS

pytestmark = pytest.mark.sandbox
SECRET = "s3cr3t-" + os.urandom(12).hex()

#: An act held until its event is durable (the bytes read, a staged write, an identity).
HELD = ("admit", "parse", "decide", "act", "record", "answer")
#: An act that cannot be held back (a connection dialed): recorded first, then its
#: completion record before whatever it still owes the guest.
RECORDED_FIRST = ("admit", "parse", "decide", "record", "act", "complete", "answer")
#: SQL: one question per table, one decision; a read run and held (in the same worker
#: trip as its decision), a write run in its transaction and committed once recorded.
SQL = HELD
#: A refusal: recorded, then answered; nothing acted.
REFUSED = ("admit", "parse", "decide", "record", "answer")


class _Upstream(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        if self.path == "/secret":
            ok = self.headers.get("Authorization") == f"Bearer {SECRET}"
            body = b"authorized" if ok else b"no credentials"
        else:
            body = f"plain {self.path}".encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


def _serve(ctx: ssl.SSLContext | None) -> ThreadingHTTPServer:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Upstream)
    if ctx is not None:
        server.socket = ctx.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@pytest.fixture(scope="module")
def upstreams(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[int, int, Path]]:
    d = tmp_path_factory.mktemp("upstreams")
    ca = UpstreamCA.make()
    (d / "ca.pem").write_bytes(ca.pem())
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(ca.issue(["localhost", "127.0.0.1"], d / "leaf.pem"))
    tls, plain = _serve(ctx), _serve(None)
    yield tls.server_address[1], plain.server_address[1], d / "ca.pem"
    tls.shutdown()
    plain.shutdown()


@pytest.fixture
def gov(tmp_path: Path) -> Iterator[Gov]:
    g = build_gov(tmp_path)
    yield g
    g.rt.close()


GUEST = r"""
import http.client, json, os, urllib.request, proctor_guest
TLS = int(os.environ["TLS_PORT"]); PLAIN = int(os.environ["PLAIN_PORT"])
res = {"whoami": proctor_guest.whoami()["run"]}
res["write"] = proctor_guest.write("reports", "out.txt", b"hello")["bytes"]
res["read"] = proctor_guest.read("reports", "out.txt").decode()
res["sql"] = proctor_guest.sql("fake", "SELECT id FROM customers WHERE id <= 2")["row_count"]
with urllib.request.urlopen(f"http://localhost:{PLAIN}/forward", timeout=10) as r:
    res["http"] = r.read().decode()
# A blind CONNECT tunnel (no secret bound to the host), plain HTTP inside it.
conn = http.client.HTTPConnection("127.0.0.1", 3128, timeout=10)
conn.set_tunnel("localhost", PLAIN)
conn.request("GET", "/tunnel")
res["tunnel"] = conn.getresponse().read().decode()
conn.close()
with urllib.request.urlopen(f"https://localhost:{TLS}/secret", timeout=10) as r:
    res["https"] = r.read().decode()
try:
    proctor_guest.write("other", "x", b"x"); res["refused"] = "ALLOWED"
except proctor_guest.GuestError:
    res["refused"] = "denied"
print(json.dumps(res), flush=True)
"""


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_call_of_each_kind_passes_the_stages_in_order(
    gov: Gov, upstreams: tuple[int, int, Path], backend: str, tmp_path: Path
) -> None:
    tls, plain, ca = upstreams
    rt = gov.rt
    rt.resources.set_secret("acme", "crm_token", "real-" + SECRET, [f"localhost:{tls}"], gov.op)
    rt.resources.set_secret("acme", "crm_token_test", SECRET, [f"localhost:{tls}"], gov.op,
                            twin_of="crm_token")  # fmt: skip
    for port in (tls, plain):
        rt.resources.allow_sandbox_host("acme", f"localhost:{port}", gov.op)
    rt.allow_egress_range("acme", "127.0.0.1/32", gov.op)
    rt.subprocessors.add("acme", "upstream-co", purpose="test upstreams", location="here",
                         hosts=[f"localhost:{tls}", f"localhost:{plain}"], actor=gov.op)  # fmt: skip
    art = gov.artifact_dir(
        "kinds",
        GUEST,
        f"""
        [datasets.fake.tables.customers]
        columns = ["id", "country", "plan"]
        access = "read"
        [egress]
        hosts = ["localhost:{tls}", "localhost:{plain}"]
        [secrets]
        names = ["crm_token"]
        [buckets]
        reports = "read-write"
        [limits]
        timeout = "90s"
        """,
    )
    digest = gov.submit("acme", art)
    rt.deployments.deploy("acme", rt.artifacts.get("acme", digest), "kinds",
                          environment="sandbox", mode="job", instruction="test", actor=gov.op)  # fmt: skip
    out: list[bytes] = []
    with rt.make_broker(upstream_cafile=str(ca)) as broker:
        sup = Supervisor(rt, broker, backend)
        record = sup.start("acme", "kinds", gov.principal("dev").actor, on_stdout=out.append,
                           env={"TLS_PORT": str(tls), "PLAIN_PORT": str(plain)})  # fmt: skip
        traces = [(t.kind, t.stages) for t in broker.traces if t.run_id == record.id]
    stdout = b"".join(out).decode()
    assert stdout, (record, (gov.home / "runs" / record.id / "stderr.log").read_text())
    res = json.loads(stdout.splitlines()[0])
    assert res == {
        "whoami": record.id, "write": 5, "read": "hello", "sql": 2, "http": "plain /forward",
        "tunnel": "plain /tunnel", "https": "authorized", "refused": "denied",
    }  # fmt: skip
    # A call's trace is kept when its connection ends: the injected tunnel's side is
    # kept alive, so it may end after the calls made later.
    assert sorted(traces) == sorted([
        ("whoami", HELD),
        ("file.write", HELD),
        ("file.read", HELD),
        ("sql", SQL),
        ("egress.forward", RECORDED_FIRST),
        ("egress.connect", RECORDED_FIRST),  # the blind tunnel
        ("egress.connect", RECORDED_FIRST),  # TLS ended, the secret injected
        ("file.write", REFUSED),
    ])  # fmt: skip
    assert traces[:6] == [("whoami", HELD), ("file.write", HELD), ("file.read", HELD),
                          ("sql", SQL), ("egress.forward", RECORDED_FIRST),
                          ("egress.connect", RECORDED_FIRST)]  # fmt: skip
    # The injected request: one decision event with the secret inside it, and its
    # completion record; no secret.use decision of its own.
    events = [json.loads(e) for e in rt.ledger.entries("acme") if record.id.encode() in e]
    mine = [e for e in events if e["resource"] == f"host/localhost:{tls}"]
    assert [e["action"] for e in mine] == ["http.request", "http.request.end"]
    assert mine[0]["details"]["inject"] == [{"secret": "crm_token", "header": "Authorization"}]
    assert not [e for e in events if e["action"] == "secret.use"]
    assert SECRET.encode() not in b"\n".join(rt.ledger.entries("acme"))
    rt.ledger.verify("acme")
    # The verifier decides the new format again (the request and its secret's
    # question, one decision), as it does the old.
    export_pack(rt, "acme", "2000-01-01T00:00:00.000000Z", "2100-01-01T00:00:00.000000Z",
                tmp_path / "p.zip")  # fmt: skip
    report = verify_pack(tmp_path / "p.zip", rt.ledger.vkey())
    data = ("sql.select", "sql.write", "http.request", "file.read", "file.write", "secret.use")
    decided = [e for e in events if e["action"] in data and "policy_version" in e["details"]]
    assert report.decisions_redecided == len(decided) == 7
