"""`proctor manifest suggest` end to end: a real sandbox run of code that reads a column
its manifest does not grant, calls a host it does not list, writes a bucket, leaves
another unused, and tries the metadata address; the suggestion read through the CLI (a
subprocess, --json) and the API (the SDK); the suggested manifest resubmitted, deployed
to the sandbox, run again: the same code then meets no refusal a manifest could lift,
and its own suggestion is the manifest it ran under. Bad input is one line, and
records nothing but the refused read."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from proctor import Client
from proctor.api import serve_api
from proctor.errors import ProctorError
from proctor.governance import Runs, parse_manifest
from tests.conftest import run_cli
from tests.e2e.conftest_gov import Gov, build_gov
from tests.sandbox_conftest_helpers import working

BACKEND = ([b for b in ("bubblewrap", "gvisor") if b in working()] or ["bubblewrap"])[0]

JOB = """
import json, os, urllib.error, urllib.request
import proctor_guest

out = {}
def attempt(name, fn):
    try:
        out[name] = fn()
    except proctor_guest.GuestError as exc:
        out[name] = "refused"
    except urllib.error.HTTPError as exc:
        out[name] = exc.code

attempt("rows", lambda: len(proctor_guest.sql(
    "fake", "SELECT id, country, plan FROM customers WHERE id <= 3")["rows"]))
port = os.environ["UP_PORT"]
attempt("score", lambda: urllib.request.urlopen(
    f"http://localhost:{port}/v1/score", timeout=30).read().decode())
attempt("write", lambda: proctor_guest.write("reports", "churn.md", b"# churn")["bytes"])
attempt("metadata", lambda: urllib.request.urlopen(
    "http://169.254.169.254/latest/meta-data/", timeout=30).status)
print(json.dumps(out))
"""


class _Score(BaseHTTPRequestHandler):
    def log_message(self, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        body = b"0.42"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture
def gov(tmp_path: Path) -> Iterator[Gov]:
    g = build_gov(tmp_path)
    yield g
    g.rt.close()


def _run(gov: Gov, digest: str, port: int) -> tuple[str, dict[str, Any]]:
    rt = gov.rt
    rt.deployments.deploy("acme", rt.artifacts.get("acme", digest), "churn",
                          environment="sandbox", mode="job", instruction="suggest test",
                          actor=gov.principal("dev").actor)  # fmt: skip
    out: list[bytes] = []
    with rt.make_broker() as broker:
        record = rt.supervisor(broker, BACKEND).start(
            "acme", "churn", gov.principal("dev").actor, on_stdout=out.append,
            env={"UP_PORT": str(port)},
        )  # fmt: skip
    stdout = b"".join(out).decode()
    assert record.status == "succeeded", (stdout, gov.home / "runs" / record.id)
    return record.id, json.loads(stdout.strip().splitlines()[-1])


def _denied(gov: Gov, run_id: str) -> list[dict[str, Any]]:
    return [ev for d in gov.rt.ledger.entries("acme")
            if (ev := json.loads(d)).get("run") == run_id and ev["decision"] == "deny"]  # fmt: skip


@pytest.mark.sandbox
def test_the_suggested_manifest_lets_the_same_code_run_without_refusals(gov: Gov) -> None:
    rt = gov.rt
    upstream = ThreadingHTTPServer(("127.0.0.1", 0), _Score)
    threading.Thread(target=upstream.serve_forever, daemon=True).start()
    port = upstream.server_address[1]
    try:
        rt.resources.allow_sandbox_host("acme", f"localhost:{port}", gov.op)
        rt.allow_egress_range("acme", "127.0.0.1/32", gov.op)
        rt.resources.add_bucket("acme", "archive", gov.op)
        art = gov.artifact_dir("churn", JOB, """
            [datasets.fake.tables.customers]
            columns = ["id", "country", "mrr"]
            [buckets]
            reports = "write"
            archive = "read"
            [limits]
            timeout = "90s"
            """)  # fmt: skip
        first_digest = gov.submit("acme", art)
        run_id, guest = _run(gov, first_digest, port)
        assert guest == {"rows": "refused", "score": 403, "write": 7, "metadata": 403}
        refused = {ev["action"] + " " + ev["resource"]: ev["seq"] for ev in _denied(gov, run_id)}
        sql_seq = refused["sql.select dataset/fake/table/customers"]
        host_seq = refused[f"http.request host/localhost:{port}"]
        meta_seq = refused["http.request host/169.254.169.254:80"]

        # The CLI, in a subprocess, as the developer who deployed it, with a prefix.
        res = run_cli("manifest", "suggest", "--run", run_id[:8], "-t", "acme", "--json",
                      "--token", gov.token("dev"), home=gov.home)  # fmt: skip
        doc = json.loads(res.out)
        suggested = parse_manifest(doc["manifest"])
        assert suggested.capabilities == {
            "datasets": {"fake": {"tables": {"customers": {
                "columns": ["country", "id", "plan"], "access": "read"}}}},
            "egress": [f"localhost:{port}"],
            "secrets": [],
            "buckets": {"reports": "write"},
            "egress_rules": {f"localhost:{port}": {"methods": ["GET"], "paths": ["/v1/score"]}},
        }  # fmt: skip
        lines = {(x["change"], x["line"].strip()): x for x in doc["lines"]}
        assert lines[("added", '"plan",')]["seq"] == sql_seq
        assert lines[("added", f'"localhost:{port}",')]["seq"] == host_seq
        assert lines[("removed", 'archive = "read"')] == {
            "line": 'archive = "read"', "change": "removed", "where": "buckets",
            "reason": "no call of this run used it", "seq": None,
        }  # fmt: skip
        assert lines[("removed", '"mrr",')]["reason"] == "no call of this run used it"
        assert [u["seq"] for u in doc["not_suggestable"]] == [meta_seq]
        assert '+  "plan",' in doc["diff"] and '-archive = "read"' in doc["diff"]
        # The human form says the same in words.
        written = gov.home.parent / "suggested.toml"
        words = run_cli("manifest", "suggest", "--run", run_id, "-t", "acme", "-o", str(written),
                        home=gov.home).out  # fmt: skip
        assert written.read_text() == doc["manifest"]
        assert f"seq {sql_seq}:" in words and "no call of this run used it" in words
        assert "169.254.169.254" in words

        # The API, through the SDK: the same document; the read recorded as the API does.
        server = serve_api(rt, "127.0.0.1", 0)
        try:
            with Client(server.url, gov.token("dev")) as dev:
                assert dev.suggest_manifest("acme", run_id[:8]) == doc
            with (
                Client(server.url, gov.token("globex-dev")) as other,
                pytest.raises(ProctorError) as info,
            ):
                other.suggest_manifest("acme", run_id)
            assert info.value.code == "not_found" and "\n" not in str(info.value)
            with Client(server.url, gov.token("dev")) as dev, pytest.raises(ProctorError) as info:
                dev.suggest_manifest("acme", "r-000000000000")
            assert info.value.code == "not_found"
        finally:
            server.stop()
        # Recorded as the API records reads: an api.request event naming the action and
        # the path; the other tenant's refusal in its own log.
        reads = [json.loads(d) for d in rt.ledger.entries("acme")]
        path = f"/tenants/acme/runs/{run_id[:8]}/suggested-manifest"
        assert any(e["action"] == "api.request" and e["decision"] == "allow"
                   and e["actor"]["id"] == "acme/dev" and e["details"]["path"] == path
                   and e["details"]["action"] == "run.events.read" for e in reads)  # fmt: skip
        globex = [json.loads(d) for d in rt.ledger.entries("globex")]
        assert globex[-1]["decision"] == "deny"
        assert globex[-1]["details"]["action"] == "run.events.read"

        # Resubmitted with the suggested manifest, deployed to the sandbox, run again:
        # the same code meets only the refusal no manifest lifts.
        (art / "proctor.toml").write_text(doc["manifest"])
        second_digest = gov.submit("acme", art)
        assert second_digest != first_digest
        again_id, again = _run(gov, second_digest, port)
        assert again == {"rows": 3, "score": "0.42", "write": 7, "metadata": 403}
        assert [e["resource"] for e in _denied(gov, again_id)] == ["host/169.254.169.254:80"]
        fixpoint = json.loads(run_cli("manifest", "suggest", "--run", again_id, "-t", "acme",
                                      "--json", home=gov.home).out)  # fmt: skip
        assert fixpoint["lines"] == [] and fixpoint["diff"] == ""
        assert fixpoint["manifest"] == doc["manifest"]
    finally:
        upstream.shutdown()
        upstream.server_close()
    # A suggestion approves, deploys and submits nothing: the two submissions and two
    # deployments are the test's own.
    assert rt.approvals.for_artifact("acme", first_digest) == []
    assert rt.approvals.for_artifact("acme", second_digest) == []
    assert len(rt.artifacts.list("acme")) == 2
    assert len(Runs(rt).all("acme")) == 2


def test_bad_input_is_one_line_and_changes_nothing(gov: Gov) -> None:
    before = gov.rt.ledger.head("acme").size
    res = run_cli("manifest", "suggest", "--run", "r-nope", "-t", "acme", "--json",
                  home=gov.home, check=False)  # fmt: skip
    assert res.code != 0 and res.out == ""
    assert len(res.err.strip().splitlines()) <= 2 and "r-nope" in res.err
    res = run_cli("manifest", "suggest", "--run", "r-nope", "-t", "nope", home=gov.home,
                  check=False)  # fmt: skip
    assert res.code != 0 and "nope" in res.err and "Traceback" not in res.err
    taken = gov.home.parent / "taken.toml"
    taken.write_text("mine")
    res = run_cli("manifest", "suggest", "--run", "r-nope", "-t", "acme", "-o", str(taken),
                  home=gov.home, check=False)  # fmt: skip
    assert res.code == 2 and "exists already" in res.err and taken.read_text() == "mine"
    res = run_cli("manifest", "suggest", "-t", "acme", home=gov.home, check=False)
    assert res.code == 2 and "--run" in res.err
    assert gov.rt.ledger.head("acme").size == before


def test_through_the_api_an_unknown_or_another_tenants_run_is_not_found(gov: Gov) -> None:
    server = serve_api(gov.rt, "127.0.0.1", 0)
    try:
        for who, tenant in (("dev", "acme"), ("globex-dev", "acme"), ("dev", "globex")):
            with Client(server.url, gov.token(who)) as client, pytest.raises(ProctorError) as info:
                client.suggest_manifest(tenant, "r-0123456789ab")
            assert info.value.code == "not_found", (who, tenant, info.value)
            assert "\n" not in str(info.value)
    finally:
        server.stop()
    # Each refused read is recorded in the reader's log; nothing else is.
    last = json.loads(list(gov.rt.ledger.entries("globex"))[-1])
    assert last["decision"] == "deny" and last["actor"]["id"] == "globex/dev"
    assert last["details"]["action"] == "run.events.read"
