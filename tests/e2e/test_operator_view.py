"""Issue 15, operators: a job's output fetched from its bucket (CLI, API, SDK), a file
put, a run's receipt, the quorum, and `proctor serve`'s JSON log.

One `proctor serve` (API and supervisor) for the module: its schedule fires a
production job that writes a CSV; the tests then work on that output, and the last
one stops the server and reads its log."""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from proctor.client import Client
from proctor.errors import ProctorError
from proctor.lifecycle import Runs
from tests.conftest import PROCTOR, run_cli, wait_until
from tests.e2e.conftest_gov import Gov, build_gov
from tests.sandbox_conftest_helpers import working

pytestmark = pytest.mark.sandbox
BACKEND = ([b for b in ("bubblewrap", "gvisor") if b in working()] or ["bubblewrap"])[0]

JOB = """
import proctor_guest
rows = proctor_guest.sql("crm", "SELECT id, country FROM customers WHERE id <= 20")["rows"]
csv = "id,country\\n" + "".join(f"{r[0]},{r[1]}\\n" for r in rows)
proctor_guest.write("reports", "export/customers.csv", csv.encode())
print("wrote", len(rows), "rows")
"""
CAPS = """
[datasets.crm.tables.customers]
columns = ["id", "country"]
access = "read"

[buckets]
reports = "write"

[lifecycle]
mode = "schedule"
every = "1h"
"""
SECRET = "s3cr3t-value-7f1e2d"  # a test secret: it must never reach the log
CSV_KEY = "export/customers.csv"


@dataclass
class Op:
    gov: Gov
    url: str
    serve: subprocess.Popen[bytes]
    log: Path
    run_id: str
    tmp: Path

    def cli(self, *args: str, who: str | None = None, server: bool = False,
            check: bool = True) -> Any:  # fmt: skip
        full = (["--server", self.url] if server else []) + list(args)
        if who is not None:
            full += ["--token", self.gov.token(who)]
        return run_cli(*full, home=self.gov.home, check=check)

    def sdk(self, who: str) -> Client:
        return Client(self.url, self.gov.token(who))

    @property
    def bucket(self) -> Path:
        return self.gov.rt.resources.bucket_dir("acme") / "reports"

    def events(self, action: str) -> list[dict[str, Any]]:
        evs = [json.loads(e) for e in self.gov.rt.ledger.entries("acme")]
        return [e for e in evs if e["action"] == action]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait(cond: Any, what: str, timeout: float = 30) -> Any:
    return wait_until(cond, what, timeout)


@pytest.fixture(scope="module")
def op(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Op]:
    tmp = tmp_path_factory.mktemp("operator")
    gov = build_gov(tmp)
    rt = gov.rt
    rt.resources.set_secret("acme", "api_key", SECRET, ["api.example.com"], gov.op)
    digest = gov.submit("acme", gov.artifact_dir("nightly", JOB, CAPS))
    rt.approvals.grant("acme", digest, gov.principal("alice"))
    rt.deployments.deploy("acme", rt.artifacts.get("acme", digest), "nightly",
                          environment="production", mode="schedule", every_seconds=3600.0,
                          instruction="nightly export (OPS-1)", actor=gov.op)  # fmt: skip
    # A sandbox job: its runs have no receipt, and one is started through the API.
    sandbox = gov.submit("acme", gov.artifact_dir("try", "print('hi')\n"))
    rt.deployments.deploy("acme", rt.artifacts.get("acme", sandbox), "try",
                          environment="sandbox", instruction="try", actor=gov.op)  # fmt: skip
    port = _free_port()
    log = tmp / "serve.stderr"
    env = dict(os.environ, PROCTOR_HOME=str(gov.home))
    with log.open("wb") as err:
        serve = subprocess.Popen(
            [PROCTOR, "serve", "--backend", BACKEND, "--api-port", str(port)], env=env,
            stdout=subprocess.DEVNULL, stderr=err,
        )  # fmt: skip
    try:
        runs = Runs(rt)
        done = _wait(lambda: runs.all("acme", "nightly", "succeeded")
                     or runs.all("acme", "nightly", "failed"), "the schedule's run")  # fmt: skip
        assert done[0].status == "succeeded", (done[0], log.read_text())
        url = f"http://127.0.0.1:{port}"
        yield Op(gov, url, serve, log, done[0].id, tmp)
    finally:
        if serve.poll() is None:
            serve.send_signal(signal.SIGTERM)
            serve.wait(timeout=60)
        rt.close()


def test_an_operator_lists_gets_and_puts_objects_through_the_cli_the_api_and_the_sdk(
    op: Op,
) -> None:
    on_disk = (op.bucket / CSV_KEY).read_bytes()
    assert on_disk.startswith(b"id,country\n")
    sha = hashlib.sha256(on_disk).hexdigest()
    # Listed, locally (the operator) and through the API (a developer), the same.
    local = json.loads(op.cli("bucket", "objects", "-t", "acme", "reports", "--json").out)
    assert [(o["key"], o["size"], o["sha256"]) for o in local] == [(CSV_KEY, len(on_disk), sha)]
    remote = json.loads(op.cli("bucket", "objects", "-t", "acme", "reports", "--json",
                               who="dev", server=True).out)  # fmt: skip
    assert remote == local
    table = op.cli("bucket", "objects", "-t", "acme", "reports").out
    assert CSV_KEY in table and sha in table
    # Got byte for byte: to a file, to stdout, over the API, by the SDK.
    out = op.tmp / "customers.csv"
    op.cli("bucket", "get", "-t", "acme", "reports", CSV_KEY, "-o", str(out))
    assert out.read_bytes() == on_disk
    doc = json.loads(op.cli("bucket", "get", "-t", "acme", "reports", CSV_KEY, "-o", str(out),
                            "--json").out)  # fmt: skip
    assert doc == {"bucket": "reports", "key": CSV_KEY, "size": len(on_disk), "sha256": sha,
                   "written": str(out)}  # fmt: skip
    res = op.cli("bucket", "get", "-t", "acme", "reports", CSV_KEY, "-o", "-", "--json",
                 check=False)  # fmt: skip
    assert res.code == 2 and res.raw == b"" and "--json needs -o FILE" in res.err
    assert op.cli("bucket", "get", "-t", "acme", "reports", CSV_KEY, "-o", "-").raw == on_disk
    assert op.cli("bucket", "get", "-t", "acme", "reports", CSV_KEY[:3] + "ort/customers.csv",
                  "-o", "-", who="dev", server=True).raw == on_disk  # fmt: skip
    with op.sdk("dev") as dev:
        assert dev.get_object("acme", "reports", CSV_KEY) == on_disk
        assert dev.bucket_objects("acme", "reports") == local
    # Each read recorded with the object's digest and size, never its content.
    reads = op.events("bucket.read")
    assert len(reads) == 5
    assert all(e["details"]["sha256"] == sha and e["details"]["bytes"] == len(on_disk)
               for e in reads)  # fmt: skip
    assert [e["actor"]["id"] for e in reads][-2:] == ["acme/dev", "acme/dev"]
    assert not any("id,country" in json.dumps(e) for e in op.events("bucket.read"))
    # Put: by the operator (CLI) and an admin (SDK); read back exact.
    params = op.tmp / "params.json"
    params.write_bytes(b'{"since": "2026-01-01"}\n')
    put = json.loads(op.cli("bucket", "put", "-t", "acme", "reports", "inbox/params.json",
                            str(params), "--json").out)  # fmt: skip
    assert put["sha256"] == hashlib.sha256(params.read_bytes()).hexdigest()
    assert (op.bucket / "inbox" / "params.json").read_bytes() == params.read_bytes()
    with op.sdk("root") as root:
        doc = root.put_object("acme", "reports", "inbox/blob.bin", bytes(range(256)) * 40)
        assert doc["size"] == 10240
        assert root.get_object("acme", "reports", "inbox/blob.bin") == bytes(range(256)) * 40
    writes = [(e["details"]["key"], e["actor"]["type"], e["details"]["bytes"])
              for e in op.events("bucket.write")]  # fmt: skip
    assert writes[-2:] == [("inbox/params.json", "operator", 24), ("inbox/blob.bin", "user", 10240)]


def test_bucket_refusals_change_nothing(op: Op) -> None:
    outside = op.tmp / "outside.txt"
    outside.write_text("not in any bucket\n")
    outside_dir = op.tmp / "outside-dir"
    outside_dir.mkdir(exist_ok=True)
    (op.bucket / "leak").unlink(missing_ok=True)
    (op.bucket / "leak").symlink_to(outside)
    (op.bucket / "linked").unlink(missing_ok=True)
    (op.bucket / "linked").symlink_to(outside_dir, target_is_directory=True)
    before = len(list(op.gov.rt.ledger.entries("acme")))
    listed = json.loads(op.cli("bucket", "objects", "-t", "acme", "reports", "--json").out)
    assert not any(o["key"].startswith(("leak", "linked")) for o in listed)
    src = op.tmp / "evil.txt"
    src.write_text("evil\n")
    dest = op.tmp / "should-not-exist"
    # Each CLI call is a process: three keys here, the rest through the SDK below.
    for key in ("../secrets.json", "/etc/passwd", "x/../../y"):
        res = op.cli("bucket", "get", "-t", "acme", "reports", key, "-o", str(dest), check=False)
        assert res.code == 2 and "bad object key" in res.err, (key, res.err)
        res = op.cli("bucket", "put", "-t", "acme", "reports", key, str(src), check=False)
        assert res.code == 2 and "bad object key" in res.err, (key, res.err)
    assert not dest.exists()
    for key in ("leak", "linked/x.txt"):
        res = op.cli("bucket", "get", "-t", "acme", "reports", key, "-o", str(dest), check=False)
        assert res.code == 2 and "link" in res.err, (key, res.err)
        res = op.cli("bucket", "put", "-t", "acme", "reports", key, str(src), check=False)
        assert res.code == 2 and "link" in res.err, (key, res.err)
    assert outside.read_text() == "not in any bucket\n" and not any(outside_dir.iterdir())
    # Over the API: the same keys, and a NUL, which argv cannot carry.
    with op.sdk("root") as root:
        for key in ("../secrets.json", "/etc/passwd", "a\x00b", "..", "a//b", ".hidden"):
            with pytest.raises(ProctorError) as err:
                root.put_object("acme", "reports", key, b"evil")
            assert "bad object key" in err.value.message, key
            with pytest.raises(ProctorError):
                root.get_object("acme", "reports", key)
    # Only the listing above was recorded: refused input changes nothing.
    after = [json.loads(e) for e in op.gov.rt.ledger.entries("acme")][before:]
    assert {e["action"] for e in after} <= {"bucket.list", "api.request"}
    assert not any(e["action"] == "api.request" and e["decision"] == "deny" for e in after)
    (op.bucket / "leak").unlink()
    (op.bucket / "linked").unlink()
    # Another tenant's bucket, and principals without the right.
    res = op.cli("bucket", "objects", "-t", "acme", "reports", who="globex-root", server=True,
                 check=False)  # fmt: skip
    assert res.code == 2 and "unknown tenant" in res.err
    res = op.cli("bucket", "get", "-t", "acme", "reports", CSV_KEY, "-o", "-",
                 who="globex-root", check=False)  # fmt: skip
    assert res.code == 5 and res.raw == b""
    with op.sdk("globex-root") as other:
        with pytest.raises(ProctorError) as err:
            other.get_object("acme", "reports", CSV_KEY)
        assert err.value.code == "not_found"
        with pytest.raises(ProctorError):
            other.put_object("acme", "reports", "inbox/x", b"x")
    with op.sdk("alice") as approver, pytest.raises(ProctorError) as err:
        approver.bucket_objects("acme", "reports")
    assert err.value.code == "forbidden"
    with op.sdk("dev") as dev, pytest.raises(ProctorError) as err:
        dev.put_object("acme", "reports", "inbox/x", b"x")
    assert err.value.code == "forbidden"
    res = op.cli("bucket", "put", "-t", "acme", "reports", "inbox/x", str(src), who="dev",
                 check=False)  # fmt: skip
    assert res.code == 5 and "bucket.write" in res.err
    assert not (op.bucket / "inbox" / "x").exists()
    denied = [e for e in op.events("api.request") if e["decision"] == "deny"]
    assert {e["details"]["action"] for e in denied} >= {"bucket.read", "bucket.write"}
    res = op.cli("bucket", "objects", "-t", "acme", "nosuch", check=False)
    assert res.code == 2 and "no bucket 'nosuch'" in res.err


def test_receipt_and_quorum(op: Op) -> None:
    receipt = op.tmp / "run.tlog-proof"
    prefix = op.run_id[:8]
    op.cli("receipt", "get", prefix, "-t", "acme", "-o", str(receipt), who="dev")
    assert receipt.read_text() == (op.gov.home / "runs" / op.run_id / "receipt.tlog-proof"
                                   ).read_text()  # fmt: skip
    doc = json.loads(op.cli("receipt", "get", prefix, "-t", "acme", "--json").out)
    assert doc == {"run": op.run_id, "tenant": "acme", "receipt": receipt.read_text()}
    vkey = op.gov.rt.ledger.vkey()
    verified = json.loads(op.cli("receipt", "verify", str(receipt), "--key", vkey, "--json").out)
    assert verified["event"]["run"] == op.run_id and verified["event"]["action"] == "run.end"
    assert op.cli("receipt", "get", op.run_id, "-t", "acme", who="dev",
                  server=True).out == receipt.read_text()  # fmt: skip
    with op.sdk("alice") as approver:
        assert approver.run_receipt("acme", prefix) == receipt.read_text()
    # Another tenant's run; a run that has none; a prefix that names none.
    res = op.cli("receipt", "get", op.run_id, "-t", "acme", who="globex-dev", server=True,
                 check=False)  # fmt: skip
    assert res.code == 2 and "unknown tenant" in res.err
    res = op.cli("receipt", "get", op.run_id, "-t", "globex", check=False)
    assert res.code == 2 and "no run" in res.err
    op.cli("run", "try", "-t", "acme", "--backend", BACKEND, who="dev")
    try_run = Runs(op.gov.rt).all("acme", "try")[0].id
    res = op.cli("receipt", "get", try_run, "-t", "acme", check=False)
    assert res.code == 2 and "sandbox environment" in res.err and "hint:" in res.err
    # Too short to mean one run: refused with how many it matches (Runs.get's, tested with it).
    res = op.cli("receipt", "get", "r-", "-t", "acme", check=False)
    assert res.code == 2 and re.search(r"'r-' is ambiguous: \d+ run ids", res.err), res.err
    # The quorum, locally and through the API.
    local = json.loads(op.cli("quorum", "show", "-t", "acme", "--json").out)
    assert local == {"required": 1, "roles": ["approver", "admin"]}
    remote = json.loads(op.cli("quorum", "show", "-t", "acme", "--json", who="alice",
                               server=True).out)  # fmt: skip
    assert remote == local
    assert "needs 1 approval(s)" in op.cli("quorum", "show", "-t", "acme").out


def test_serve_writes_one_json_line_per_request_run_and_schedule_and_no_secret(op: Op) -> None:
    with op.sdk("root") as root:
        root.set_secret("acme", "other_key", SECRET + "-2", ["api.example.com"])
    rid = "ops-check-0001"
    with httpx.Client(base_url=op.url) as http:
        resp = http.get("/tenants/acme/runs", params={"token": "pt_not_a_real_token"},
                        headers={"Authorization": f"Bearer {op.gov.token('dev')}",
                                 "X-Request-Id": rid})  # fmt: skip
        assert resp.status_code == 200 and resp.headers["x-request-id"] == rid
        made = http.get("/healthz", headers={"X-Request-Id": "bad id with spaces"})
        fresh = made.headers["x-request-id"]
        assert fresh.startswith("req_")
        # A run started by a request: its lines carry the request's id.
        started = http.post("/tenants/acme/deployments/try/runs",
                            headers={"Authorization": f"Bearer {op.gov.token('dev')}",
                                     "X-Request-Id": "ops-run-0001"}, timeout=120)  # fmt: skip
        api_run = json.loads(started.text.splitlines()[-1])["run"]["id"]
    op.serve.send_signal(signal.SIGTERM)
    op.serve.wait(timeout=60)
    text = op.log.read_text()
    lines = [json.loads(line) for line in text.splitlines() if line.strip()]
    assert all({"time", "level", "logger", "event"} <= set(line) for line in lines)
    by_event: dict[str, list[dict[str, Any]]] = {}
    for line in lines:
        by_event.setdefault(line["event"], []).append(line)
    request = [r for r in by_event["api.request"] if r["request_id"] == rid]
    assert len(request) == 1
    assert request[0] | {"duration_ms": 0} == {
        **request[0], "method": "GET", "path": "/tenants/acme/runs", "status": 200,
        "actor": "acme/dev", "duration_ms": 0,
    }  # fmt: skip
    assert any(r["request_id"] == fresh and r["actor"] is None for r in by_event["api.request"])
    fired = [f for f in by_event["schedule.fire"] if f["deployment"] == "nightly"]
    assert fired and fired[0]["tenant"] == "acme" and fired[0]["every_seconds"] == 3600
    start = [s for s in by_event["run.start"] if s["run"] == op.run_id]
    end = [e for e in by_event["run.end"] if e["run"] == op.run_id]
    assert len(start) == len(end) == 1
    assert end[0]["outcome"] == "succeeded" and end[0]["digest"].startswith("sha256:")
    assert end[0]["deployment"] == "nightly" and end[0]["actor"].startswith("supervisor:")
    assert "reap" in by_event
    (api_start,) = [s for s in by_event["run.start"] if s["run"] == api_run]
    (api_end,) = [e for e in by_event["run.end"] if e["run"] == api_run]
    for line in (api_start, api_end):
        assert line["request_id"] == "ops-run-0001" and line["actor"] == "acme/dev", line
    assert api_end["outcome"] == "succeeded" and api_end["environment"] == "sandbox"
    # No token, no secret, no query string.
    for who in op.gov.people:
        assert op.gov.token(who) not in text
    assert SECRET not in text and "pt_not_a_real_token" not in text and "token=" not in text
