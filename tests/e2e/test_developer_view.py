"""A developer sees why: the refusals of their run inside the sandbox (with the event's
sequence number and reason, also through a CONNECT tunnel), in `runs show` and in
`audit events --run R --decision deny`, over the CLI and the API; and nothing of
another developer's runs or of the rest of the tenant's log. `audit tail` follows
new events live, locally and through the API."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import IO, Any

import pytest

from proctor import Client
from proctor.api import serve_api
from proctor.errors import ProctorError
from proctor.governance import Runs
from proctor.ledger import EventDraft, utc_now
from tests.conftest import PROCTOR, run_cli
from tests.e2e.conftest_gov import Gov, build_gov
from tests.sandbox_conftest_helpers import working

pytestmark = pytest.mark.sandbox
BACKEND = ([b for b in ("bubblewrap", "gvisor") if b in working()] or ["bubblewrap"])[0]

# Three refused calls: a column the manifest does not grant, a plain HTTP request and a
# CONNECT to a host it does not name (refused on the name: nothing leaves the machine).
JOB = """
import json, urllib.error, urllib.request
import proctor_guest

out = {}
try:
    proctor_guest.sql("crm", "SELECT email FROM customers WHERE id = 1")
except proctor_guest.Denied as exc:
    out["sql"] = {"seq": exc.seq, "reason": exc.reason, "text": str(exc)}
try:
    urllib.request.urlopen("http://refused.example/x", timeout=30)
except urllib.error.HTTPError as exc:
    out["http"] = {"status": exc.code, "header": exc.headers.get("X-Proctor-Refusal"),
                   "body": json.loads(exc.read())}
try:
    urllib.request.urlopen("https://refused.example/x", timeout=30)
except urllib.error.URLError as exc:
    out["connect"] = str(exc.reason)
rows = proctor_guest.sql("crm", "SELECT id FROM customers WHERE id <= 2")["rows"]
out["allowed_rows"] = len(rows)
print(json.dumps(out))
"""
CAPS = """
[datasets.crm.tables.customers]
columns = ["id", "country"]
access = "read"
"""


@dataclass
class View:
    gov: Gov
    url: str
    run_id: str
    guest: dict[str, Any]


def cli(gov: Gov, *args: str, who: str | None = None, check: bool = True) -> Any:
    full = list(args)
    if who is not None:
        full += ["--token", gov.token(who)]
    return run_cli(*full, home=gov.home, check=check)


@pytest.fixture(scope="module")
def view(tmp_path_factory: pytest.TempPathFactory) -> Iterator[View]:
    gov = build_gov(tmp_path_factory.mktemp("devview"))
    for name, roles in (("dev2", ["developer"]), ("aud", ["auditor"])):
        gov.people[name] = gov.rt.principals.create("acme", name, "user", roles, gov.op)
    art = gov.artifact_dir("job", JOB, CAPS)
    digest = json.loads(
        cli(gov, "artifact", "submit", str(art), "-t", "acme", "--json", who="dev").out
    )["digest"]
    gov.rt.approvals.grant("acme", digest, gov.principal("alice"), expires=timedelta(days=1))
    cli(gov, "deploy", digest, "-t", "acme", "--name", "job", "--env", "production",
        "--instruction", "developer view test", who="dev")  # fmt: skip
    cli(gov, "run", "job", "-t", "acme", "--backend", BACKEND, who="dev")
    (run,) = Runs(gov.rt).all("acme", "job")
    stdout = (gov.home / "runs" / run.id / "stdout.log").read_text()
    guest = json.loads(stdout.strip().splitlines()[-1])
    # A second run whose id shares the first one's first 8 characters: a prefix of 8
    # is ambiguous, one of 9 is not.
    twin = run.id[:8] + "zz" + run.id[10:]
    with gov.rt.store.write() as conn:
        Runs.insert(conn, (twin, "acme", "other", 1, run.digest, "sandbox",
                           run.workload + "-twin", "[]", run.backend, None, "succeeded", None,
                           0, 1, "{}", None, run.started_at, run.ended_at), "twin")  # fmt: skip
    server = serve_api(gov.rt, "127.0.0.1", 0)
    yield View(gov, server.url, run.id, guest)
    server.stop()
    gov.rt.close()


def _event(gov: Gov, seq: int) -> dict[str, Any]:
    (data,) = list(gov.rt.ledger.entries("acme", seq, seq + 1))
    return dict(json.loads(data))


def test_the_guest_sees_each_refusal_with_its_ledger_event(view: View) -> None:
    g, gov = view.guest, view.gov
    assert g["allowed_rows"] == 2, g
    # SQL: the guest library's exception names the event and its reason.
    sql = g["sql"]
    ev = _event(gov, sql["seq"])
    assert ev["run"] == view.run_id and ev["decision"] == "deny" and ev["action"] == "sql.select"
    assert sql["reason"] == ev["reason"] and f"seq={sql['seq']}" in sql["text"]
    # Plain HTTP: the body and the header.
    http = g["http"]
    assert http["status"] == 403
    seq = http["body"]["seq"]
    ev = _event(gov, seq)
    assert ev["run"] == view.run_id and ev["decision"] == "deny"
    assert ev["resource"] == "host/refused.example:80" and http["body"]["reason"] == ev["reason"]
    assert http["header"] == f'seq={seq}; reason="{ev["reason"]}"'
    # CONNECT: Python shows the status line's reason phrase in its error text.
    text = g["connect"]
    assert text.startswith("Tunnel connection failed: 403 Forbidden (proctor refusal seq="), text
    cseq = int(text.split("seq=")[1].split(":")[0])
    ev = _event(gov, cseq)
    assert ev["resource"] == "host/refused.example:443" and ev["decision"] == "deny"
    assert ev["reason"] in text and ev["run"] == view.run_id


def test_the_developer_finds_the_refusals_with_the_cli(view: View) -> None:
    gov, run_id = view.gov, view.run_id
    seqs = {view.guest["sql"]["seq"], view.guest["http"]["body"]["seq"]}
    prefix = run_id[:9]
    # audit events: the filters combine; the run is given as a prefix.
    denied = json.loads(cli(gov, "audit", "events", "-t", "acme", "--run", prefix,
                            "--decision", "deny", "--json", who="dev").out)  # fmt: skip
    assert seqs <= {e["seq"] for e in denied} and len(denied) == 3
    assert all(e["run"] == run_id and e["decision"] == "deny" for e in denied)
    only_sql = cli(gov, "audit", "events", "-t", "acme", "--run", prefix, "--action",
                   "sql.select", "--jsonl", who="dev").raw.splitlines()  # fmt: skip
    assert [json.loads(x)["decision"] for x in only_sql] == ["deny", "allow"]
    newest = cli(gov, "audit", "events", "-t", "acme", "--limit", "2", "--jsonl").raw
    first = cli(gov, "audit", "events", "-t", "acme", "--limit", "2", "--from-start", "--jsonl").raw
    head = gov.rt.ledger.head("acme").size
    assert [json.loads(x)["seq"] for x in first.splitlines()] == [0, 1]
    assert [json.loads(x)["seq"] for x in newest.splitlines()] == [head - 2, head - 1]
    # runs show: the calls, refusals first, with their reasons.
    shown = json.loads(cli(gov, "runs", "show", prefix, "-t", "acme", "--json", who="dev").out)
    assert shown["id"] == run_id
    decisions = [c["decision"] for c in shown["calls"]]
    assert decisions[:3] == ["deny"] * 3 and "allow" in decisions[3:]
    assert {c["seq"] for c in shown["calls"][:3]} >= seqs
    human = cli(gov, "runs", "show", prefix, "-t", "acme", who="dev").out
    assert "3 refused" in human and "refused.example" in human
    # Bad input: a clear error, nothing read (the filter's own checks:
    # tests/integration/test_ledger_query.py).
    for args, words in (
        (("--decision", "maybe"), "neither 'allow' nor 'deny'"),
        (("--run", "r-nosuchrun"), "r-nosuchrun"),
        (("--run", run_id[:8]), "is ambiguous: 2 run ids"),
    ):
        res = cli(gov, "audit", "events", "-t", "acme", *args, check=False)
        assert res.code != 0 and words in res.out + res.err, (args, res.out, res.err)


def test_a_developer_reads_only_their_own_runs_events(view: View) -> None:
    gov, run_id = view.gov, view.run_id
    before = gov.rt.ledger.head("acme").size
    # Another developer of the tenant: refused, on the CLI and the API, and recorded.
    res = cli(gov, "runs", "show", run_id, "-t", "acme", who="dev2", check=False)
    assert res.code != 0 and "run.events.read" in res.err, res.err
    res = cli(gov, "audit", "events", "-t", "acme", "--run", run_id, who="dev2", check=False)
    assert res.code != 0
    # The developer may not read the tenant's log as a whole.
    res = cli(gov, "audit", "events", "-t", "acme", who="dev", check=False)
    assert res.code != 0 and "audit.read" in res.err
    dev, dev2, aud = (Client(view.url, gov.token(n)) for n in ("dev", "dev2", "aud"))
    mine = dev.events("acme", run=run_id[:10], decision="deny")
    assert len(mine) == 3 and all(json.loads(e)["run"] == run_id for e in mine)
    with pytest.raises(ProctorError) as refused:
        dev2.events("acme", run=run_id)
    assert refused.value.code == "forbidden"
    with pytest.raises(ProctorError):
        dev.events("acme")
    with pytest.raises(ProctorError):
        dev.events("acme", action="run.start")

    # The same through the CLI's --server.
    def remote(*args: str, who: str) -> Any:
        return run_cli("--server", view.url, *args, "--token", gov.token(who), check=False)

    shown = json.loads(remote("runs", "show", run_id[:9], "-t", "acme", "--json", who="dev").out)
    assert [c["decision"] for c in shown["calls"][:3]] == ["deny"] * 3
    listed = remote("audit", "events", "-t", "acme", "--run", run_id[:9], "--decision", "deny",
                    "--limit", "2", "--json", who="dev")  # fmt: skip
    newest_two = [json.loads(x)["seq"] for x in mine[-2:]]
    assert [e["seq"] for e in json.loads(listed.out)] == newest_two, listed
    assert remote("runs", "show", run_id, "-t", "acme", who="dev2").code != 0
    # Another tenant's developer learns nothing of acme's runs.
    other = Client(view.url, gov.token("globex-dev"))
    with pytest.raises(ProctorError) as nothing:
        other.events("acme", run=run_id)
    assert nothing.value.code == "not_found"
    # An auditor reads every run's events, and the whole log.
    assert len(aud.events("acme", run=run_id, decision="deny")) == 3
    assert aud.events("acme", limit=1, newest=True)
    with pytest.raises(ProctorError) as ambiguous:
        aud.events("acme", run=run_id[:8])
    assert "is ambiguous" in ambiguous.value.message
    with pytest.raises(ProctorError) as bad:
        aud.events("acme", decision="maybe")
    assert bad.value.code == "invalid_request", bad.value.code
    # Each refusal above is in the log, under the principal who tried.
    refusals = [json.loads(d) for d in gov.rt.ledger.entries("acme", before)]
    refusals = [e for e in refusals if e["decision"] == "deny"]
    who = {(e["actor"]["id"], e["details"].get("action", e["action"])) for e in refusals}
    assert ("acme/dev2", "run.events.read") in who and ("acme/dev", "audit.read") in who
    assert any(e["actor"]["id"] == "globex/dev" for e in
               (json.loads(d) for d in gov.rt.ledger.entries("globex")))  # fmt: skip


def _lines(stream: IO[bytes]) -> queue.Queue[bytes]:
    q: queue.Queue[bytes] = queue.Queue()

    def pump() -> None:
        for line in iter(stream.readline, b""):
            q.put(line)

    threading.Thread(target=pump, daemon=True).start()
    return q


def _tail(args: list[str], gov: Gov) -> tuple[subprocess.Popen[bytes], queue.Queue[bytes]]:
    env = dict(os.environ, PROCTOR_HOME=str(gov.home))
    proc = subprocess.Popen([PROCTOR, *args], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)  # fmt: skip
    assert proc.stderr is not None and proc.stdout is not None
    err = _lines(proc.stderr)
    ready = err.get(timeout=60)
    assert ready.startswith(b"following "), ready
    return proc, _lines(proc.stdout)


def test_audit_tail_follows_new_events(view: View) -> None:
    gov, run_id = view.gov, view.run_id
    local, local_out = _tail(["audit", "tail", "-t", "acme", "--json"], gov)
    remote, remote_out = _tail(["--server", view.url, "audit", "tail", "-t", "acme", "--run",
                                run_id[:9], "--json", "--token", gov.token("dev")], gov)  # fmt: skip
    try:
        noise = gov.rt.ledger.append(
            "acme", EventDraft(gov.op, "test.noise", "tenant/acme", reason="not of the run")
        )
        mark = gov.rt.ledger.append(
            "acme",
            EventDraft(gov.op, "test.mark", f"run/{run_id}", reason=f"at {utc_now()}",
                       run=run_id),
        )  # fmt: skip
        # Everything appended after it started (the API's record of the remote tail's
        # request too), in order, up to the mark.
        seen = [json.loads(local_out.get(timeout=60))["seq"]]
        while seen[-1] < mark.seq:
            seen.append(json.loads(local_out.get(timeout=60))["seq"])
        assert seen == sorted(seen) and seen[-2:] == [noise.seq, mark.seq]
        # Through the API, filtered to the developer's run: only the mark.
        assert json.loads(remote_out.get(timeout=60))["seq"] == mark.seq
    finally:
        for proc in (local, remote):
            proc.send_signal(signal.SIGINT)
            assert proc.wait(timeout=30) == 0
