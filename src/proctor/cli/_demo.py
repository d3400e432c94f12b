from __future__ import annotations

import json
import shutil
import sqlite3
import tempfile
from pathlib import Path

from proctor.cli._common import console
from proctor.errors import VerificationFailed
from proctor.ledger import (
    Actor,
    EventDraft,
    Verifier,
    leaf_hash,
    open_checkpoint,
    verify_export,
    verify_inclusion,
)
from proctor.runtime import Runtime, init_home


def run_demo(home: Path | None) -> None:
    """The story so far: a ledger that proves what happened and catches tampering."""
    home = home or Path(tempfile.mkdtemp(prefix="proctor-demo-"))
    console.rule("[bold]Proctor demo: the audit ledger")
    config = init_home(home)
    console.print(f"1. [bold]proctor init[/] made {home} (trust domain {config.trust_domain})")
    with Runtime.open(home) as rt:
        console.print(f"   verifier key: {rt.ledger.vkey()}")
        rt.tenants.create("acme", rt.operator)
        console.print("2. tenant [bold]acme[/] created; its log is", rt.ledger.origin("acme"))
        workload = Actor("workload", "spiffe://proctor.local/tenant/acme/deployment/churn/run/r1")
        calls = [
            ("sql.select", "dataset/crm/table/customers", "allow", "columns id, plan"),
            ("sql.select", "dataset/crm/table/customers", "deny", "column email not approved"),
            ("http.request", "host/api.enrich.example:443", "allow", "host approved"),
            ("http.request", "host/169.254.169.254:80", "deny", "metadata address"),
            ("file.write", "bucket/reports/churn.md", "allow", "bucket approved"),
        ]
        last = None
        for action, resource, decision, reason in calls:
            last = rt.ledger.append(
                "acme",
                EventDraft(
                    workload,
                    action,
                    resource,
                    decision="allow" if decision == "allow" else "deny",
                    reason=reason,
                    deployment="churn",
                    run="r1",
                ),
            )
        assert last is not None
        console.print(f"3. {len(calls)} calls recorded, each durable before it was answered")
        for data in rt.ledger.entries("acme"):
            ev = json.loads(data)
            mark = "[green]allow[/]" if ev["decision"] == "allow" else "[red]deny [/]"
            console.print(
                f"   #{ev['seq']} {mark} {ev['action']:13} {ev['resource']:34} {ev['reason']}"
            )
        head = rt.ledger.head("acme")
        cp = open_checkpoint(head.checkpoint, rt.signer.verifier, head.origin)
        proof = rt.ledger.inclusion_proof("acme", 2)
        event = next(rt.ledger.entries("acme", 2, 3))
        verify_inclusion(2, proof.size, leaf_hash(event), proof.hashes, cp.root)
        console.print(
            f"4. inclusion proof of event #2 in the signed tree of size {cp.size}: "
            f"{len(proof.hashes)} hashes, [green]checked[/]"
        )
        console.print("   signed checkpoint:")
        for line in head.checkpoint.rstrip("\n").split("\n"):
            console.print(f"     {line}")
        report = rt.ledger.verify("acme")
        console.print(f"5. [bold]proctor audit verify[/]: [green]ok[/], {report.size} events")
        export = home / "export-acme"
        rt.ledger.export("acme", export)
        vkey = rt.ledger.vkey()
    verify_export(export, Verifier.parse(vkey))
    console.print(f"6. exported to {export} and verified offline with the key alone: [green]ok[/]")
    tampered = home / "tampered-acme"
    shutil.copytree(export, tampered)
    lines = (tampered / "events.jsonl").read_bytes().split(b"\n")
    lines[2] = (
        lines[2]
        .replace(b'"decision":"deny"', b'"decision":"allow"')
        .replace(b"column email not approved", b"column email approved!!!")
    )
    lines[1] = lines[1].replace(b'"decision":"deny"', b'"decision":"allow"')
    (tampered / "events.jsonl").write_bytes(b"\n".join(lines))
    try:
        verify_export(tampered, Verifier.parse(vkey))
    except VerificationFailed as exc:
        console.print(f"7. a copy with a denied call rewritten as allowed: [red]rejected[/]: {exc}")
    else:
        raise VerificationFailed("the tampered copy verified; the ledger is broken")
    db = sqlite3.connect(home / "proctor.db")
    with db:
        db.execute("DELETE FROM ledger_entries WHERE log = 'acme' AND seq = 3")
    db.close()
    with Runtime.open(home) as rt:
        try:
            rt.ledger.verify("acme")
        except VerificationFailed as exc:
            console.print(f"8. an event deleted from the store: [red]rejected[/]: {exc}")
        else:
            raise VerificationFailed("the deletion went unnoticed; the ledger is broken")
    console.rule()
    console.print(
        f"home kept at {home}; explore it with: PROCTOR_HOME={home} proctor audit events -t acme"
    )
