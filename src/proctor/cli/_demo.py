"""``proctor demo``: the main job, end to end, told as a person would want to read it.

An AI-written churn report (examples/churn-report) runs first in the sandbox
environment on a synthetic twin of the customer database, is refused in
production until someone other than its author approves it, then runs on the
real data: the calls it was approved for go through, the ones it was not (the
email column, an unapproved host, the cloud metadata address) are refused by
policy and recorded. Then the audit trail, offline verification, tamper
detection, and "what ran here today?".
"""

from __future__ import annotations

import contextlib
import json
import random
import re
import shutil
import sqlite3
import sys
import tempfile
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from rich.markup import escape
from rich.table import Table

from proctor.cli._common import console
from proctor.errors import ProctorError, SandboxError, UsageError, VerificationFailed
from proctor.governance import RunRecord
from proctor.ledger import Verifier, utc_now, verify_export
from proctor.lifecycle import what_ran
from proctor.runtime import Runtime, init_home

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "churn-report"
COUNTRIES = ["DE", "FR", "NL", "US", "GB", "ES", "IT", "SE"]
PLANS = {"free": (0, 0), "starter": (19, 49), "pro": (99, 299), "enterprise": (900, 4000)}
FIRST = ["Ada", "Alan", "Grace", "Linus", "Edsger", "Barbara", "Ken", "Radia", "Tim", "Frances"]
LAST = ["Lovelace", "Turing", "Hopper", "Torvalds", "Dijkstra", "Liskov", "Thompson", "Perlman"]


def make_customers(path: Path, n: int, seed: int) -> None:
    """A customer database made on the fly: name, email, country, plan, monthly revenue."""
    rng = random.Random(seed)
    path.unlink(missing_ok=True)
    db = sqlite3.connect(path)
    db.execute(
        "CREATE TABLE customers (id INTEGER PRIMARY KEY, name TEXT NOT NULL, email TEXT NOT NULL,"
        " country TEXT NOT NULL, plan TEXT NOT NULL, mrr REAL NOT NULL)"
    )
    rows = []
    for i in range(1, n + 1):
        first, last = rng.choice(FIRST), rng.choice(LAST)
        plan = rng.choices(list(PLANS), weights=[40, 30, 22, 8])[0]
        low, high = PLANS[plan]
        mrr = round(rng.uniform(low, high) * (0.3 if rng.random() < 0.15 else 1.0), 2)
        rows.append((i, f"{first} {last}", f"{first}.{last}{i}@example.com".lower(),
                     rng.choice(COUNTRIES), plan, mrr))  # fmt: skip
    db.executemany("INSERT INTO customers VALUES (?, ?, ?, ?, ?, ?)", rows)
    db.commit()
    db.close()


class _Enrichment(BaseHTTPRequestHandler):
    """The stand-in third party: takes aggregates, answers with market benchmarks."""

    protocol_version = "HTTP/1.1"
    received: list[dict[str, Any]] = []  # noqa: RUF012 - shared by design, one demo at a time

    def log_message(self, *args: Any) -> None:
        pass

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
        with contextlib.suppress(ValueError):
            _Enrichment.received.append(json.loads(body))
        answer = json.dumps({"market_churn_rate": 0.061, "source": "enrichment API (demo)"})
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer.encode())


def _step(n: int, text: str) -> None:
    console.print()
    console.print(f"[bold cyan]{n}.[/] [bold]{text}[/]")


def _out(prefix: str) -> Any:
    buf = bytearray()

    def sink(data: bytes) -> None:
        buf.extend(data)
        while b"\n" in buf:
            line, _, rest = bytes(buf).partition(b"\n")
            buf[:] = rest
            console.print(f"   [dim]{prefix}[/] {escape(line.decode(errors='replace'))}")

    return sink


def _succeeded(rec: RunRecord, home: Path) -> None:
    """Each later step reads what a run did: a run that failed (a sandbox that could
    not start, most often) ends the demo here, with the reason its record holds,
    rather than a step later at a report it never wrote."""
    if rec.status == "succeeded" and rec.exit_code == 0:
        return
    why = rec.reason or f"exit {rec.exit_code}"
    raise SandboxError(
        f"the demo stops: run {rec.id} {rec.status}: {why}",
        hint="`proctor sandbox backends` says whether each sandbox backend works here; "
        f"the run's record: proctor runs show {rec.id} -t acme --logs --home {home}",
    )


#: Marks a directory as a demo's home: only such a directory is ever replaced.
_MARKER = ".proctor-demo"


def _prepare(home: Path, replace: bool) -> None:
    """The demo's home is a new or empty directory, or an earlier demo's with
    --replace: it never writes into, nor deletes, anything else."""
    if not home.exists() or not any(home.iterdir()):
        return
    if not (home / "demo" / _MARKER).is_file():
        raise UsageError(
            f"{home} is not empty, and not the home of an earlier demo",
            hint="give --home a new or empty directory",
        )
    if not replace:
        raise UsageError(
            f"{home} holds an earlier demo",
            hint=f"run: proctor demo --home {home} --replace (deletes it and starts again), "
            "or give --home a new directory",
        )
    shutil.rmtree(home)


def run_demo(home: Path | None, replace: bool = False) -> None:
    home = home or Path(tempfile.mkdtemp(prefix="proctor-demo-")) / "home"
    _prepare(home, replace)
    # Everything the demo writes beside the home's own files (the customer databases,
    # the artifact's copy, the exports, the pack) stays inside it: two demos in sibling
    # directories share nothing.
    work = home / "demo"
    work.mkdir(parents=True, exist_ok=True)
    (work / _MARKER).write_text("written by proctor demo; --replace may delete this home\n")
    # The story reads best wide; a pipe (make demo | less) gets 120 columns too.
    console.width = max(console.width, 120)
    console.rule("[bold]Proctor: a churn report an AI wrote, run on real customer data")

    _step(1, "proctor init, a tenant, two people, the data")
    init_home(home)
    rt = Runtime.open(home)
    try:
        _story(rt, home, work)
    finally:
        rt.close()
    console.rule()
    console.print(f"The home is kept at [bold]{home}[/]; go on exploring it:")
    console.print(f"  export PROCTOR_HOME={home}")
    # `proctor` as the README writes it: make setup links it into /usr/local/bin when
    # root; where PATH finds no such one (or another), the line that makes it so.
    me = Path(sys.argv[0])
    found = shutil.which("proctor")
    if me.name == "proctor" and (found is None or Path(found).resolve() != me.resolve()):
        console.print(f"  export PATH={escape(str(me.resolve().parent))}:$PATH", soft_wrap=True)
    console.print("  proctor audit events -t acme; proctor runs list -t acme; "
                  "proctor history -t acme --at now")  # fmt: skip


def _story(rt: Runtime, home: Path, work: Path) -> None:
    op = rt.operator
    rt.tenants.create("acme", op)
    dev, _ = rt.principals.create("acme", "dev", "user", ["developer"], op)
    alice, _ = rt.principals.create("acme", "alice", "user", ["approver"], op)
    make_customers(work / "customers.db", 10_000, seed=1)
    make_customers(work / "customers-synthetic.db", 10_000, seed=2)
    rt.resources.add_dataset("acme", "crm", work / "customers.db", op)
    rt.resources.add_dataset("acme", "crm_synthetic", work / "customers-synthetic.db", op,
                             synthetic=True, twin_of="crm")  # fmt: skip
    rt.resources.add_bucket("acme", "reports", op)
    api = ThreadingHTTPServer(("127.0.0.1", 0), _Enrichment)
    threading.Thread(target=api.serve_forever, daemon=True).start()
    api_host = f"127.0.0.1:{api.server_address[1]}"
    enrich_url = f"http://{api_host}/v1/churn-benchmarks"
    # The stand-in third party lives on this machine's loopback, which the proxy
    # refuses by default: allow exactly that address, nothing more.
    rt.allow_egress_range("acme", "127.0.0.1/32", op)
    # Egress goes only to registered subprocessors (GDPR Art. 28(2)), whatever a
    # deployment asks: the stand-in third party is one.
    rt.subprocessors.add("acme", "benchmarks-inc", purpose="churn benchmarks by segment",
                         location="EU (Ireland)", hosts=[api_host], actor=op)  # fmt: skip
    console.print("   tenant [bold]acme[/]; [bold]dev[/] (developer) and [bold]alice[/] (approver)")
    console.print("   10,000 customers (name, email, country, plan, revenue), and a synthetic twin")
    console.print(f"   the 'enrichment API', a third party, listens at {enrich_url};")
    console.print(
        "   it is registered as subprocessor benchmarks-inc (EU): egress goes nowhere else"
    )

    _step(2, "dev submits the artifact an AI agent wrote (examples/churn-report)")
    code = work / "churn-report"
    shutil.copytree(EXAMPLE, code)
    manifest = (code / "proctor.toml").read_text()
    (code / "proctor.toml").write_text(re.sub(r'hosts = \[".*?"\]', f'hosts = ["{api_host}"]',
                                              manifest))  # fmt: skip
    for p in [code, *code.rglob("*")]:
        p.chmod(0o755 if p.is_dir() else 0o644)
    art = rt.artifacts.submit("acme", code, dev.actor)
    console.print(f"   digest  {art.digest}")
    console.print(f"   purpose {escape(art.purpose)}")
    console.print("   asks for: crm.customers (id, country, plan, mrr) read; "
                  f"egress {api_host}; bucket reports write")  # fmt: skip

    with rt.make_broker() as broker:
        sup = rt.supervisor(broker)
        env = {"ENRICH_URL": enrich_url}
        _step(3, "the build loop: a sandbox deployment, on the synthetic twin (no approval)")
        rt.deployments.deploy("acme", art, "churn-sandbox", environment="sandbox", mode="job",
                              instruction="try the churn report on synthetic data",
                              actor=dev.actor)  # fmt: skip
        rec = sup.start("acme", "churn-sandbox", dev.actor, on_stdout=_out("sandbox |"), env=env)
        _succeeded(rec, home)
        console.print(f"   run {rec.id}: [green]{rec.status}[/] on {sup.driver.name}")
        console.print("   the sandbox reaches stand-ins only: the synthetic twin, its own bucket"
                      " tree (production's report is untouched), no host (none is marked for"
                      " sandbox use)")  # fmt: skip

        _step(4, "production without approval: refused")
        try:
            rt.deployments.deploy("acme", art, "churn", environment="production", mode="job",
                                  instruction="x", actor=dev.actor)  # fmt: skip
        except ProctorError as exc:
            console.print(f"   [red]refused[/]: {escape(exc.message)}")
        try:
            rt.approvals.grant("acme", art.digest, dev)
        except ProctorError as exc:
            console.print(
                f"   dev approving their own code: [red]refused[/]: {escape(exc.message)}"
            )

        _step(5, "alice (approver) reviews and approves the exact digest")
        note = "reads 4 non-personal columns; posts aggregates only"
        approval = rt.approvals.grant("acme", art.digest, alice, comment=note)
        dep = rt.deployments.deploy(
            "acme", art, "churn", environment="production", mode="job",
            instruction="Monthly churn-risk report for the retention team (instruction of "
            "the controller, ticket RET-142)", reference="RET-142", actor=dev.actor,
        )  # fmt: skip
        console.print(
            f"   approval {approval.id} by {approval.principal}, until {approval.expires_at}"
        )
        console.print(
            f"   deployment churn v{dep.version} to production, approved by {approval.id}"
        )

        _step(6, "the production run, on the real customers")
        rec = sup.start("acme", "churn", dev.actor, on_stdout=_out("prod |"), env=env)
        _succeeded(rec, home)
        console.print(f"   run {rec.id}: [green]{rec.status}[/] (exit {rec.exit_code}) as")
        console.print(f"   {rec.workload}")
        console.print(f"   the enrichment API received {len(_Enrichment.received)} request(s): "
                      "aggregates only")  # fmt: skip

    _step(7, "the report it wrote (bucket reports/churn.md)")
    report = (rt.resources.bucket_dir("acme") / "reports" / "churn.md").read_text()
    for line in report.splitlines()[:14]:
        console.print(f"   [dim]|[/] {escape(line)}")

    _step(8, "the audit trail of that run")
    table = Table("seq", "action", "resource", "decision", "policies / reason", expand=False)
    for raw in rt.ledger.entries("acme"):
        ev = json.loads(raw)
        if ev.get("run") != rec.id:
            continue
        style = "green" if ev["decision"] == "allow" else "bold red"
        why = ", ".join(ev["policies"]) or ev["reason"]
        table.add_row(str(ev["seq"]), ev["action"], escape(ev["resource"][:40]),
                      f"[{style}]{ev['decision']}[/]", escape(why[:48]))  # fmt: skip
    console.print(table)

    _step(9, "verification: by the runtime, and offline by an auditor with the key alone")
    report_v = rt.ledger.verify("acme")
    console.print(f"   proctor audit verify: [green]ok[/], {report_v.size} events, "
                  f"{report_v.checkpoints} signed checkpoints")  # fmt: skip
    export = work / "acme-log"
    rt.ledger.export("acme", export)
    vkey = rt.ledger.vkey()
    verify_export(export, Verifier.parse(vkey))
    console.print(f"   export {export} verified offline with {vkey[:40]}…: [green]ok[/]")
    tampered = work / "acme-log-tampered"
    shutil.copytree(export, tampered)
    raw_events = (tampered / "events.jsonl").read_bytes().split(b"\n")
    for i, event in enumerate(raw_events):
        if b'"decision":"deny"' in event:
            raw_events[i] = event.replace(b'"decision":"deny"', b'"decision":"allow"')
            break
    (tampered / "events.jsonl").write_bytes(b"\n".join(raw_events))
    try:
        verify_export(tampered, Verifier.parse(vkey))
    except VerificationFailed as exc:
        console.print(f"   a copy with one refusal rewritten as allowed: [red]rejected[/]: "
                      f"{escape(exc.message)}")  # fmt: skip
    else:
        raise VerificationFailed("the tampered copy verified: the ledger is broken")

    _step(10, "what ran here today?")
    answer = what_ran(rt, "acme", utc_now(), 24 * 3600)
    for d in answer["deployments"]:
        approvers = ", ".join(d["approved_by"]) or "nobody (sandbox, synthetic data)"
        console.print(f"   deployment {d['name']} v{d['version']} ({d['environment']}): "
                      f"{d['artifact'][:19]}…, approved by {approvers}")  # fmt: skip
    for r in answer["runs"]:
        console.print(f"   run {r['id']} of {r['deployment']}: {r['status']}; data "
                      f"{escape('; '.join(r['data']))}; hosts {', '.join(r['hosts'])}; "
                      f"{r['denied']} refused")  # fmt: skip
    for version in answer["policy_versions"]:
        console.print(f"   runs decided under policy {version[:23]}…")

    _step(11, "evidence for the auditor: a pack for today, verified offline; the run's receipt")
    from proctor.evidence import export_pack, verify_pack, verify_receipt

    pack = work / "acme-evidence.zip"
    start = answer["at"][:10] + "T00:00:00.000000Z"
    export_pack(rt, "acme", start, utc_now(), pack)
    checked = verify_pack(pack, vkey)
    console.print(f"   {pack}: [green]verified[/]: {checked.events} events, "
                  f"{checked.production_runs} production run(s), {checked.approvals_checked} "
                  f"approval(s) dated before their runs, {checked.accesses_checked} data and "
                  "egress calls inside their approved capabilities")  # fmt: skip
    console.print(f"   report: {pack} (report.html, report.md inside)")
    receipt = home / "runs" / rec.id / "receipt.tlog-proof"
    verify_receipt(receipt.read_text(), vkey)
    console.print(f"   receipt of run {rec.id} (C2SP tlog-proof): [green]verified[/]")
