"""The API against a real uvicorn server on loopback: the governed path through the
SDK, streamed runs, the ledger's read paths (tlog tiles, proofs, export), the
recording of every request, limits, the error shape, fail-closed 503 and TLS."""

from __future__ import annotations

import base64
import datetime as dt
import hashlib
import io
import ipaddress
import json
import subprocess
import sys
import tarfile
from pathlib import Path

import httpx
import pytest

from proctor.api import Limits
from proctor.client import Client
from proctor.errors import LedgerError, NotFound, NotReady, ProctorError, UsageError
from proctor.governance import ApprovalRequired, AuthenticationFailed, ControlDenied
from proctor.ledger import Actor, EventDraft, open_checkpoint, root_from_inclusion
from tests.conftest import run_cli
from tests.integration.test_api_support import (
    ApiEnv,
    api_env,
    artifact_dir,
    build_env,
    self_signed,
)
from tests.sandbox_conftest_helpers import any_backend

__all__ = ["api_env"]
PROCTOR = str(Path(sys.executable).with_name("proctor"))


def client(env: ApiEnv, name: str, tenant: str = "acme") -> Client:
    return Client(env.url, env.token(tenant, name))


def _error(resp: httpx.Response) -> dict[str, object]:
    doc = resp.json()
    assert set(doc) == {"error"}
    assert set(doc["error"]) == {"code", "message", "hint", "request_id"}
    assert doc["error"]["request_id"] == resp.headers["x-request-id"]
    return doc["error"]  # type: ignore[no-any-return]


# -- the governed path -------------------------------------------------------------


@pytest.mark.sandbox
def test_submit_approve_deploy_run_streamed(api_env: ApiEnv, tmp_path: Path) -> None:

    dev, alice, bob = client(api_env, "dev"), client(api_env, "alice"), client(api_env, "bob")
    art = dev.submit_artifact(
        "acme", artifact_dir(tmp_path, "streamer", "import sys\nprint('out-1')\n"
                             "print('err-1', file=sys.stderr)\nprint('out-2')\n"),
    )  # fmt: skip
    digest = art["digest"]
    assert art["author"] == "acme/dev"
    # Same content again is the same artifact.
    assert dev.submit_artifact("acme", artifact_dir(tmp_path / "again", "streamer",
           "import sys\nprint('out-1')\nprint('err-1', file=sys.stderr)\nprint('out-2')\n")
    )["digest"] == digest  # fmt: skip
    with pytest.raises(ControlDenied):
        dev.approve("acme", digest)  # a developer has no approval.grant
    with pytest.raises(ApprovalRequired):
        dev.deploy("acme", digest, "streamer", environment="production", instruction="x")
    a = alice.approve("acme", digest, comment="looked at it", expires_seconds=3600)
    assert a["principal"] == "acme/alice" and a["decision"] == "approve"
    assert [x["id"] for x in bob.approvals("acme", digest)] == [a["id"]]
    dep = dev.deploy("acme", digest, "streamer", environment="production",
                     instruction="monthly report (RET-1)")  # fmt: skip
    assert dep["approvals"] == [a["id"]]
    any_backend()
    out: list[str] = []
    err: list[str] = []
    run = dev.run("acme", "streamer", on_stdout=out.append, on_stderr=err.append)
    assert run["status"] == "succeeded", run
    assert "".join(out) == "out-1\nout-2\n" and "".join(err) == "err-1\n"
    assert b"".join(dev.run_logs("acme", run["id"])) == b"out-1\nout-2\n"
    assert b"".join(dev.run_logs("acme", run["id"], stream="stderr", follow=True)) == b"err-1\n"
    assert [r["id"] for r in dev.runs("acme", "streamer")] == [run["id"]]
    # Revoked: the next run is refused with 409, and the refusal is an answer, not a stream.
    bob.revoke("acme", a["id"])
    with pytest.raises(Exception) as refused:
        dev.run("acme", "streamer")
    assert getattr(refused.value, "code", None) == "run_refused"
    hist = client(api_env, "aud").history("acme", dt.datetime.now(dt.UTC).isoformat())
    assert any(d["name"] == "streamer" for d in hist["deployments"])


def test_a_submission_through_the_api_carries_what_deploy_would_refuse(
    api_env: ApiEnv, tmp_path: Path
) -> None:
    """The warnings `artifact submit` prints locally come back through the API (and
    `--server`): the submission stands, each finding with the command that fixes it."""
    d = artifact_dir(tmp_path, "needs-setup")
    with (d / "proctor.toml").open("a") as f:
        f.write('[datasets.billing.tables.invoices]\ncolumns = ["id"]\naccess = "read"\n'
                '[egress]\nhosts = ["api.example.com"]\n')  # fmt: skip
    art = client(api_env, "dev").submit_artifact("acme", d)
    assert art["digest"].startswith("sha256:")
    fixes = [w["fix"] for w in art["warnings"]]
    assert len(fixes) == 2, art["warnings"]
    assert any(f.startswith("proctor dataset add -t acme billing") for f in fixes)
    assert any("--host api.example.com:443" in f for f in fixes)
    res = subprocess.run(
        [PROCTOR, "--server", api_env.url, "artifact", "submit", "-t", "acme", str(d),
         "--json", "--token", api_env.token("acme", "dev")],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["digest"] == art["digest"]  # stdout: the artifact alone
    assert res.stderr.count("warning:") == 2 and "proctor dataset add -t acme billing" in res.stderr
    # Approved, the same findings refuse a production deploy through the API: 409
    # not_ready, with the fix, and no deployment made.
    client(api_env, "alice").approve("acme", art["digest"], comment="read it")
    client(api_env, "bob").approve("acme", art["digest"], comment="read it too")
    with pytest.raises(NotReady) as refused:
        client(api_env, "dev").deploy("acme", art["digest"], "needs-setup",
                                      instruction="first try", environment="production")  # fmt: skip
    assert refused.value.code == "not_ready" and refused.value.status == 409
    said = f"{refused.value.message} {refused.value.hint}"
    assert "proctor dataset add -t acme billing" in said, said
    names = [d["name"] for d in client(api_env, "dev").deployments("acme")]
    assert "needs-setup" not in names


def test_upload_is_refused_when_unsafe_or_too_large(api_env: ApiEnv) -> None:
    dev = client(api_env, "dev")

    def tar_of(*members: tarfile.TarInfo, data: bytes = b"") -> bytes:
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            for m in members:
                tar.addfile(m, io.BytesIO(data) if m.isfile() else None)
        return buf.getvalue()

    evil = tarfile.TarInfo("../escape.py")
    evil.size = 0
    with pytest.raises(UsageError, match="leaves the artifact"):
        dev.submit_artifact("acme", tar_of(evil))
    link = tarfile.TarInfo("proctor.toml")
    link.type = tarfile.SYMTYPE
    link.linkname = "/etc/passwd"
    with pytest.raises(UsageError):
        dev.submit_artifact("acme", tar_of(link))
    dev_node = tarfile.TarInfo("null")
    dev_node.type = tarfile.CHRTYPE
    with pytest.raises(UsageError, match="not a file"):
        dev.submit_artifact("acme", tar_of(dev_node))
    with pytest.raises(UsageError, match="not a readable tar"):
        dev.submit_artifact("acme", b"\x1f\x8b garbage")


def test_limits_refuse_large_bodies_with_413(tmp_path: Path) -> None:
    env = build_env(tmp_path, limits=Limits(json_body=2048, artifact_upload=4096))
    try:
        with env.http("acme", "root") as http:
            r = http.put("/tenants/acme/policy", json={"text": "x" * 5000})
            assert r.status_code == 413 and _error(r)["code"] == "too_large"

            def chunks() -> object:
                for _ in range(10):
                    yield b" " * 1000

            r = http.put("/tenants/acme/policy", content=chunks(),  # type: ignore[arg-type]
                         headers={"Content-Type": "application/json"})  # fmt: skip
            assert r.status_code == 413
        with env.http("acme", "dev") as http:
            r = http.post("/tenants/acme/artifacts", content=chunks(),  # type: ignore[arg-type]
                          headers={"Content-Type": "application/x-tar"})  # fmt: skip
            assert r.status_code == 413 and _error(r)["code"] == "too_large"
            # A gzip bomb: tiny compressed, large inflated; stopped at the limit.
            buf = io.BytesIO()
            with tarfile.open(fileobj=buf, mode="w:gz") as tar:
                info = tarfile.TarInfo("big.bin")
                info.size = 1 << 20
                tar.addfile(info, io.BytesIO(b"\0" * (1 << 20)))
            assert len(buf.getvalue()) < 4096
            r = http.post("/tenants/acme/artifacts", content=buf.getvalue(),
                          headers={"Content-Type": "application/gzip"})  # fmt: skip
            assert r.status_code == 413
    finally:
        env.server.stop()
        env.rt.close()


# -- the ledger over HTTP -----------------------------------------------------------------


def test_tlog_tiles_checkpoint_and_proofs(api_env: ApiEnv) -> None:
    rt = api_env.rt
    actor = Actor("operator", "test")
    # Past one full tile (256 leaves) so both full and partial tiles exist.
    rt.ledger.append_many("globex", [EventDraft(actor, "test.event", f"t/{i}") for i in range(300)])
    aud = client(api_env, "aud", "globex")
    note = aud.checkpoint("globex")
    cp = open_checkpoint(note, rt.ledger._signer.verifier)  # type: ignore[attr-defined]
    size = cp.size
    assert size > 256
    full = aud.tile("globex", 0, 0)
    assert len(full) == 256 * 32
    partial_width = (size - 1) % 256 + 1 if size % 256 else 256
    # The partial tile of the checkpoint's size (reading through these paths adds no event).
    part = aud.tile("globex", 0, 1, width=partial_width - 0 if size % 256 else 256)
    assert len(part) == partial_width * 32
    # Leaf hashes from the tiles match the events served.
    events = aud.events("globex", start=0, limit=size)
    assert hashlib.sha256(b"\0" + events[5]).digest() == full[5 * 32 : 6 * 32]
    # Entry bundle: big-endian uint16 length prefixes (C2SP tlog-tiles).
    bundle = httpx.get(f"{api_env.url}/tenants/globex/log/tile/entries/000",
                       headers={"Authorization": f"Bearer {api_env.token('globex', 'aud')}"}).content  # fmt: skip
    n = int.from_bytes(bundle[:2], "big")
    assert bundle[2 : 2 + n] == events[0]
    # An inclusion proof verifies against the signed checkpoint's root.
    proof = aud.inclusion_proof("globex", 7, size)
    root = root_from_inclusion(
        7, size, base64.b64decode(proof["leaf_hash"]),
        [base64.b64decode(h) for h in proof["hashes"]],
    )  # fmt: skip
    assert root == cp.root
    assert aud.consistency_proof("globex", 10, size)["new"] == size
    # Not in the tree yet: 404; not a tile path: 400.
    with pytest.raises(NotFound):
        aud.tile("globex", 0, 999)
    with pytest.raises(UsageError):
        httpx_get = Client(api_env.url, api_env.token("globex", "aud"))._request
        httpx_get("GET", "/tenants/globex/log/tile/0/1.p/256")


def test_export_verifies_offline(api_env: ApiEnv, tmp_path: Path) -> None:
    aud = client(api_env, "aud")
    out = aud.export("acme", tmp_path / "exp")
    res = subprocess.run([PROCTOR, "audit", "verify", "--from-export", str(out), "--key",
                          aud.verifier_key()], capture_output=True, text=True, timeout=60)  # fmt: skip
    assert res.returncode == 0, res.stdout + res.stderr
    assert "verified proctor.local/tenant/acme" in res.stdout
    assert aud.verify("acme")["origin"] == "proctor.local/tenant/acme"
    assert any(e["action"] == "audit.export" for e in api_env.events("acme"))


def test_every_request_recorded_with_request_id_and_source(api_env: ApiEnv) -> None:
    with api_env.http("acme", "aud") as http:
        r = http.get("/tenants/acme/artifacts", headers={"X-Request-Id": "trace-123"})
        assert r.status_code == 200 and r.headers["x-request-id"] == "trace-123"
        denied = http.put("/tenants/acme/quorum", json={"required": 1},
                          headers={"X-Request-Id": "trace-456"})  # fmt: skip
        assert denied.status_code == 403 and _error(denied)["code"] == "forbidden"
        # A request id that is not plain is replaced, not written into the ledger.
        weird = http.get("/whoami", headers={"X-Request-Id": ("a b;" * 30).encode()})
        assert weird.headers["x-request-id"].startswith("req_")
    by_id = {e["details"].get("request_id"): e for e in api_env.events("acme")  # type: ignore[union-attr]
             if e["action"] == "api.request"}  # fmt: skip
    ok, no = by_id["trace-123"], by_id["trace-456"]
    assert ok["decision"] == "allow" and ok["actor"] == {"type": "user", "id": "acme/aud"}
    assert ok["policies"] == ["control:auditor"]
    assert ipaddress.ip_address(ok["details"]["source"]).is_loopback  # type: ignore[index]
    assert no["decision"] == "deny" and no["details"]["action"] == "policy.set"  # type: ignore[index]


def test_error_shape_and_no_leaks(api_env: ApiEnv) -> None:
    token = api_env.token("acme", "dev")
    with api_env.http("acme", "dev") as http:
        for resp, status, code in (
            (http.get("/nope"), 404, "not_found"),
            (http.delete("/tenants/acme"), 405, "method_not_allowed"),
            (http.get("/tenants/acme/artifacts/sha256:0000"), 404, "not_found"),
            (http.post("/tenants/acme/deployments", json={"bad": 1}), 422, "invalid_request"),
            (http.post("/tenants/acme/deployments", content=b"{", headers={"Content-Type": "application/json"}), 422, "invalid_request"),
            (httpx.get(f"{api_env.url}/whoami"), 401, "unauthenticated"),
            (httpx.get(f"{api_env.url}/whoami", headers={"Authorization": "Bearer pt_nope"}), 401, "unauthenticated"),
        ):  # fmt: skip
            assert resp.status_code == status, resp.text
            assert _error(resp)["code"] == code
            assert "Traceback" not in resp.text and token not in resp.text
    assert httpx.get(f"{api_env.url}/whoami").headers["www-authenticate"] == "Bearer"


def test_ledger_failure_is_503_with_retry_after(
    api_env: ApiEnv, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(*_: object, **__: object) -> None:
        raise LedgerError("disk I/O error at /secret/path/proctor.db")

    monkeypatch.setattr(api_env.rt.ledger, "append", broken)
    aud = client(api_env, "aud")
    with api_env.http("acme", "aud") as http:
        r = http.get("/tenants/acme/artifacts")
    assert r.status_code == 503 and r.headers["retry-after"] == "2"
    err = _error(r)
    assert err["code"] == "ledger_unavailable" and "/secret/path" not in r.text
    with pytest.raises(LedgerError):
        aud.artifacts("acme")


def test_broker_refusal_is_503(api_env: ApiEnv, monkeypatch: pytest.MonkeyPatch) -> None:
    from proctor.broker import CallRefused

    def refused(*_: object, **__: object) -> None:
        raise CallRefused("not recorded")

    monkeypatch.setattr(api_env.rt.ledger, "append", refused)
    with api_env.http("acme", "aud") as http:
        r = http.get("/whoami")
    assert r.status_code == 503 and "retry-after" in r.headers


def test_principals_and_tokens_over_api(api_env: ApiEnv) -> None:
    root = client(api_env, "root")
    p, token = root.create_principal("acme", "ci-bot", ["developer"], service=True)
    assert p["kind"] == "service" and token.startswith("pt_")
    assert Client(api_env.url, token).whoami()["name"] == "ci-bot"
    new = root.rotate_token("acme", "ci-bot")
    with pytest.raises(Exception) as old:
        Client(api_env.url, token).whoami()
    assert getattr(old.value, "code", None) == "unauthenticated"
    root.disable_principal("acme", "ci-bot")
    with pytest.raises(AuthenticationFailed):
        Client(api_env.url, new).whoami()
    root.enable_principal("acme", "ci-bot")
    assert Client(api_env.url, new).whoami()["name"] == "ci-bot"
    assert "ci-bot" in {x["name"] for x in root.principals("acme")}
    root.set_secret("acme", "stripe_key", "sk_live_very_secret", ["api.stripe.com"])
    assert "sk_live_very_secret" not in json.dumps(root.secrets("acme"))
    pv = root.set_policy("acme", "")
    assert root.policy("acme")["version"] == pv["version"]


def test_tls(tmp_path: Path) -> None:
    certfile, keyfile = self_signed(tmp_path)
    env = build_env(tmp_path, certfile=certfile, keyfile=keyfile)
    try:
        assert env.url.startswith("https://")
        with Client(env.url, env.token("acme", "dev"), verify=str(certfile)) as c:
            assert c.whoami()["tenant"] == "acme"
        with pytest.raises(ProctorError), Client(env.url, env.token("acme", "dev")) as untrusted:
            untrusted.whoami()
        with pytest.raises(httpx.HTTPError):
            httpx.get(env.url.replace("https", "http") + "/healthz", timeout=5)
    finally:
        env.server.stop()
        env.rt.close()


def test_subprocessors_are_read_as_the_audit_log_is(api_env: ApiEnv, tmp_path: Path) -> None:
    # The console's page and `proctor --server ... subprocessor list` read this path;
    # who may read it is who may read the log (an auditor, not a developer).
    rt = api_env.rt
    rt.subprocessors.add("acme", "benchmarks-inc", purpose="churn benchmarks",
                         location="EU", hosts=["api.bench.example:443"],
                         actor=rt.operator)  # fmt: skip
    [row] = client(api_env, "aud").subprocessors("acme")
    assert (row["name"], row["location"], row["hosts"]) == (
        "benchmarks-inc",
        "EU",
        ["api.bench.example:443"],
    )
    with pytest.raises(ControlDenied):
        client(api_env, "dev").subprocessors("acme")
    with pytest.raises(NotFound):  # another tenant's auditor: no such tenant, for it
        client(api_env, "aud", "globex").subprocessors("acme")
    # The CLI's --server form lists the same rows through the SDK.
    out = run_cli("--server", api_env.url, "subprocessor", "list", "-t", "acme", "--json",
                  "--token", api_env.token("acme", "aud")).out  # fmt: skip
    assert [r["name"] for r in json.loads(out)] == ["benchmarks-inc"]


def test_an_evidence_pack_through_the_api_verifies_offline(api_env: ApiEnv, tmp_path: Path) -> None:
    # The console's download and `proctor --server ... evidence export` read this path:
    # the pack `proctor evidence export` writes, checked offline with the held key.
    from proctor.evidence import verify_pack

    vkey = api_env.rt.ledger.vkey()
    got = client(api_env, "aud").evidence_pack("acme", "2000-01-01", "2100-01-01",
                                               tmp_path / "pack.zip")  # fmt: skip
    assert got["events"] > 0 and got["end_size"] >= got["end_seq"]
    assert verify_pack(tmp_path / "pack.zip", vkey).events == got["events"]
    with pytest.raises(ControlDenied):
        client(api_env, "dev").evidence_pack("acme", "2000-01-01", "2100-01-01",
                                             tmp_path / "dev.zip")  # fmt: skip
    assert not (tmp_path / "dev.zip").exists()
    with pytest.raises(UsageError):
        client(api_env, "aud").evidence_pack("acme", "not a time", "2100-01-01",
                                             tmp_path / "bad.zip")  # fmt: skip
    out = run_cli("--server", api_env.url, "evidence", "export", "-t", "acme", "--from",
                  "2000-01-01", "--to", "2100-01-01", "-o", str(tmp_path / "cli.zip"), "--json",
                  "--token", api_env.token("acme", "aud")).out  # fmt: skip
    assert json.loads(out)["events"] > 0
    run_cli("evidence", "verify", str(tmp_path / "cli.zip"), "--key", vkey)


def test_events_filtered_by_actor_through_the_api_and_the_cli(api_env: ApiEnv) -> None:
    # The console's audit filter and `proctor audit events --actor`: decided on the
    # server over the whole log, not over a page the client was given.
    aud = client(api_env, "aud")
    aud.tenant("acme")  # an event by acme/aud
    mine = aud.events("acme", actor="acme/aud", newest=True, limit=1000)
    assert mine and {json.loads(e)["actor"]["id"] for e in mine} == {"acme/aud"}
    paged = list(aud.iter_events("acme", actor="acme/aud"))
    assert len(paged) >= len(mine)
    assert aud.events("acme", actor="acme/nobody", newest=True, limit=10) == []
    out = run_cli("--server", api_env.url, "audit", "events", "-t", "acme", "--actor",
                  "acme/aud", "--json", "--token", api_env.token("acme", "aud")).out  # fmt: skip
    assert {e["actor"]["id"] for e in json.loads(out)} == {"acme/aud"}
    with pytest.raises(UsageError):
        aud.events("acme", actor="x" * 201)


def test_an_unknown_action_filter_is_refused_not_an_empty_answer(api_env: ApiEnv) -> None:
    # Issue 33, item 8, through the API's own route: a typo is a 400 naming the near
    # actions, as the CLI's check says, not an empty list that reads as "nothing".
    aud = client(api_env, "aud")
    with pytest.raises(UsageError, match=r"unknown action 'run\.strat'") as refused:
        aud.events("acme", action="run.strat", newest=True, limit=10)
    assert "run.start" in (refused.value.hint or "")
    with pytest.raises(UsageError, match="unknown action"):
        list(aud.iter_events("acme", action="no.such.action"))
    assert aud.events("acme", action="tenant.create", newest=True, limit=10)


def test_runs_are_filtered_on_the_server(api_env: ApiEnv) -> None:
    # Issue 33, item 17, through the API's own route: bad filters are refused, and a
    # filter that nothing matches answers an empty list, decided over every run.
    aud = client(api_env, "aud")
    with pytest.raises(UsageError):
        aud.runs("acme", status="ok")
    with pytest.raises(UsageError, match="since"):
        aud.runs("acme", since="tomorrow")
    assert aud.runs("acme", since="2100-01-01") == []
    assert aud.runs("acme", mine=True) == []  # the auditor started none
