"""The broker end to end: guest code in real sandboxes (both drivers), calling out
through the real shim, proxy, SQL and file handlers, decided by Cedar, recorded."""

from __future__ import annotations

import json
import os
import socket
import ssl
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from proctor.lifecycle import Supervisor
from tests.e2e.conftest_gov import Gov, build_gov
from tests.integration.test_broker_proxy import UpstreamCA
from tests.sandbox_conftest_helpers import BACKENDS

pytestmark = pytest.mark.sandbox
SECRET = "s3cr3t-" + os.urandom(12).hex()


class _Auth(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        ok = self.headers.get("Authorization") == f"Bearer {SECRET}"
        body = b"authorized" if ok else b"no credentials"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture(scope="module")
def upstream(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[int, Path]]:
    d = tmp_path_factory.mktemp("upstream")
    ca = UpstreamCA.make()
    (d / "ca.pem").write_bytes(ca.pem())
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(ca.issue(["localhost", "127.0.0.1"], d / "leaf.pem"))
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Auth)
    server.socket = ctx.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1], d / "ca.pem"
    server.shutdown()


@pytest.fixture
def gov(tmp_path: Path) -> Iterator[Gov]:
    g = build_gov(tmp_path)
    yield g
    g.rt.close()


GUEST = r"""
import json, os, socket, urllib.request, urllib.error, proctor_guest
PORT = int(os.environ["UP_PORT"]); HOST_PORT = int(os.environ["HOST_PORT"])
res = {}
res["sql_ok"] = proctor_guest.sql("fake", "SELECT id, country FROM customers WHERE id <= 3")["row_count"]
for name, q in [
    ("star", "SELECT * FROM customers"),
    ("email", "SELECT email FROM customers"),
    ("subquery", "SELECT id FROM customers WHERE id IN (SELECT id FROM customers WHERE email LIKE 'a%')"),
    ("json", "SELECT json_extract(email, '$') FROM customers"),
    ("attach", "ATTACH DATABASE '/tmp/x.db' AS x"),
    ("write", "UPDATE customers SET plan = 'x' WHERE id = 1"),
]:
    try:
        proctor_guest.sql("fake", q); res[name] = "ALLOWED"
    except proctor_guest.Denied:
        res[name] = "denied"
    except proctor_guest.GuestError as e:
        res[name] = "refused:" + e.code
res["write_ok"] = proctor_guest.write("reports", "out.txt", b"hello")["bytes"]
try:
    proctor_guest.write("other", "x", b"x"); res["other_bucket"] = "ALLOWED"
except proctor_guest.GuestError:
    res["other_bucket"] = "denied"
with urllib.request.urlopen(f"https://localhost:{PORT}/", timeout=10) as r:
    res["https"] = r.read().decode()
req = urllib.request.Request("http://api.other.example/",
                             headers={"Authorization": "Bearer proctor-secret:crm_token"})
try:
    urllib.request.urlopen(req, timeout=5); res["placeholder"] = "ALLOWED"
except urllib.error.HTTPError as e:
    res["placeholder"] = e.code
for url in [f"http://127.0.0.1:{PORT}/", f"http://127.1:{PORT}/", f"http://2130706433:{PORT}/",
            f"http://0x7f000001:{PORT}/", f"http://[::ffff:127.0.0.1]:{PORT}/",
            f"http://[::1]:{PORT}/", "http://169.254.169.254/latest/meta-data/",
            "http://2852039166/", f"https://localhost:{PORT + 1}/",
            f"http://localhost:{PORT + 2}/"]:
    try:
        urllib.request.urlopen(url, timeout=5); res[url] = "ALLOWED"
    except urllib.error.HTTPError as e:
        res[url] = e.code
    except urllib.error.URLError as e:
        res[url] = "refused: " + str(e.reason)[:40]
try:
    socket.create_connection(("127.0.0.1", HOST_PORT), timeout=3); res["direct"] = "CONNECTED"
except OSError:
    res["direct"] = "refused"
print(json.dumps(res), flush=True)
print("READY", flush=True)
import time; time.sleep(60)
"""


def _dump_sandbox_memory(needle: bytes) -> tuple[int, bool]:
    """Read the memory of every process in a running Proctor sandbox, from the host."""
    scanned, found = 0, False
    pids: set[int] = set()
    for root in (
        Path("/sys/fs/cgroup/pids"),
        Path("/sys/fs/cgroup/unified"),
        Path("/sys/fs/cgroup"),
    ):
        for procs in root.glob("proctor-*/cgroup.procs"):
            pids.update(int(p) for p in procs.read_text().split())
    for pid in pids:
        try:
            maps = Path(f"/proc/{pid}/maps").read_text().splitlines()
            mem = open(f"/proc/{pid}/mem", "rb", buffering=0)  # noqa: SIM115
        except OSError:
            continue
        with mem:
            for line in maps:
                addr, perms = line.split()[:2]
                if "r" not in perms:
                    continue
                start, end = (int(x, 16) for x in addr.split("-"))
                if end - start > 256 * 1024 * 1024:
                    continue  # sparse reservations (the sentry's heap arena): unbacked zeros
                try:
                    mem.seek(start)
                    chunk = mem.read(end - start)
                except (OSError, ValueError, OverflowError):
                    continue
                scanned += len(chunk)
                found = found or needle in chunk
    return scanned, found


@pytest.mark.parametrize("backend", BACKENDS)
def test_guest_calls_are_mediated_refused_recorded_and_the_secret_never_enters(
    gov: Gov, upstream: tuple[int, Path], backend: str
) -> None:
    port, ca = upstream
    rt = gov.rt
    # A sandbox run gets the test twin of a secret, never the real one, and reaches
    # only hosts marked for sandbox use (governance/_environments.py).
    rt.resources.set_secret("acme", "crm_token", "real-" + SECRET, [f"localhost:{port}"], gov.op)
    rt.resources.set_secret("acme", "crm_token_test", SECRET, [f"localhost:{port}"], gov.op,
                            twin_of="crm_token")  # fmt: skip
    rt.resources.allow_sandbox_host("acme", f"localhost:{port}", gov.op)
    rt.allow_egress_range("acme", "127.0.0.1/32", gov.op)
    rt.subprocessors.add("acme", "upstream-co", purpose="test upstream", location="here",
                         hosts=[f"localhost:{port}"], actor=gov.op)  # fmt: skip
    art = gov.artifact_dir(
        "probe",
        GUEST,
        f"""
        [datasets.fake.tables.customers]
        columns = ["id", "country", "plan"]
        access = "read"
        [egress]
        hosts = ["localhost:{port}", "localhost:{port + 2}"]
        [secrets]
        names = ["crm_token"]
        [buckets]
        reports = "write"
        [limits]
        timeout = "90s"
        """,
    )
    digest = gov.submit("acme", art)
    rt.deployments.deploy("acme", rt.artifacts.get("acme", digest), "probe",
                          environment="sandbox", mode="job", instruction="test", actor=gov.op)  # fmt: skip
    host_listener = socket.socket()
    host_listener.bind(("127.0.0.1", 0))
    host_listener.listen()
    host_listener.settimeout(0.1)
    out: list[bytes] = []
    cancel = threading.Event()
    scan: dict[str, Any] = {}

    def watch_output(data: bytes) -> None:
        out.append(data)
        if b"READY" in b"".join(out) and "done" not in scan:
            scan["done"] = True
            scan["scanned"], scan["found"] = _dump_sandbox_memory(SECRET.encode())
            cancel.set()

    with rt.make_broker(upstream_cafile=str(ca)) as broker:
        sup = Supervisor(rt, broker, backend)
        record = sup.start(
            "acme", "probe", gov.principal("dev").actor, on_stdout=watch_output,
            cancel=cancel, env={"UP_PORT": str(port), "HOST_PORT": str(host_listener.getsockname()[1])},
        )  # fmt: skip
    stdout = b"".join(out).decode()
    assert "READY" in stdout, (record, (gov.home / "runs" / record.id / "stderr.log").read_text())
    res = json.loads(stdout.splitlines()[0])
    assert res["sql_ok"] == 3
    assert {k: res[k] for k in ("star", "email", "subquery", "json", "write")} == dict.fromkeys(
        ("star", "email", "subquery", "json", "write"), "denied"
    )
    assert res["attach"] in ("denied", "refused:bad_request")
    assert res["write_ok"] == 5 and res["other_bucket"] == "denied"
    assert res["https"] == "authorized", "the broker injected the credential upstream"
    assert res["placeholder"] == 403
    ssrf = {k: v for k, v in res.items() if k.startswith(("http://", "https://"))}
    # urllib reports a refused CONNECT (a disallowed port) as a failed tunnel.
    # Its reason phrase names the refusal's event (seq and reason).
    assert all(v == 403 or str(v).startswith("refused: Tunnel connection failed: 403 Forbidden")
               for v in ssrf.values()), ssrf  # fmt: skip
    assert len(ssrf) == 10
    # The manifest names localhost:PORT+2 and the deployment permits it, but it is
    # not marked for sandbox use: the sandbox environment's forbid wins.
    by_sub = [
        json.loads(e) for e in rt.ledger.entries("acme")
        if f"host/localhost:{port + 2}".encode() in e and b'"http.request"' in e
    ]  # fmt: skip
    assert by_sub and all(e["policies"] == ["tenant:sandbox-egress"] for e in by_sub)
    assert all(e["decision"] == "deny" for e in by_sub)
    assert res["direct"] == "refused"
    with pytest.raises(TimeoutError):
        host_listener.accept()  # the direct connection never reached the host
    assert scan["scanned"] > 1_000_000, "the sandbox's memory was read"
    assert scan["found"] is False, "the secret's value is in the sandbox's memory"
    events = b"\n".join(rt.ledger.entries("acme"))
    assert SECRET.encode() not in events
    assert SECRET not in stdout
    assert b"user1@example.com" not in events, "no row value in the ledger"
    run_events = [json.loads(e) for e in rt.ledger.entries("acme") if record.id.encode() in e]
    denies = [e for e in run_events if e["decision"] == "deny"]
    assert len(denies) >= 15
    actions = {e["action"] for e in denies}
    assert {"sql.select", "http.request", "file.write", "secret.use"} <= actions
    assert all(e["actor"]["id"].endswith(f"/run/{record.id}") for e in run_events
               if e["action"] not in ("run.start", "run.end"))  # fmt: skip
    rt.ledger.verify("acme")
