from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from proctor.cli._common import (
    HomeOpt,
    JsonOpt,
    TenantOpt,
    TokenOpt,
    authorize_read,
    console,
    open_runtime,
    parse_time,
    remote,
)
from proctor.errors import UsageError, VerificationFailed
from proctor.governance import unbacked_rows
from proctor.ledger import SYSTEM_LOG, Actor, EventDraft, Verifier, verify_export

audit_app = typer.Typer(
    help="The audit ledger: events, checkpoints, proofs, verification.", no_args_is_help=True
)


def _emit_json(obj: object) -> None:
    sys.stdout.write(json.dumps(obj, sort_keys=True) + "\n")


@audit_app.command("events")
def events(
    tenant: TenantOpt,
    since: Annotated[str | None, typer.Option(help="ISO 8601 start (inclusive)")] = None,
    until: Annotated[str | None, typer.Option(help="ISO 8601 end (exclusive)")] = None,
    as_json: JsonOpt = False,
    token: TokenOpt = None,
    home: HomeOpt = None,
) -> None:
    """List a log's events; with --json, the canonical bytes exactly as hashed."""
    start, end = parse_time(since, "--since"), parse_time(until, "--until")
    if (client := remote(token)) is not None:
        out = sys.stdout.buffer
        for data in client.iter_events(tenant, since=start, until=end):
            out.write(data + b"\n")
        out.flush()
        return
    with open_runtime(home) as rt:
        log = rt.log_name(tenant)
        if token is not None and log == SYSTEM_LOG:
            raise UsageError("the system log is the operator's; principals read their tenant's")
        authorize_read(rt, token, log, "audit.read")
        if as_json:
            out = sys.stdout.buffer
            for data in rt.ledger.events_between(log, start, end):
                out.write(data + b"\n")
            out.flush()
            return
        table = Table("seq", "time", "actor", "action", "resource", "decision", "reason")
        for data in rt.ledger.events_between(log, start, end):
            ev = json.loads(data)
            decision = ev["decision"]
            style = "green" if decision == "allow" else "bold red"
            table.add_row(
                str(ev["seq"]),
                ev["time"],
                f"{ev['actor']['type']}:{ev['actor']['id']}",
                ev["action"],
                ev["resource"],
                f"[{style}]{decision}[/]",
                ev["reason"],
            )
    console.print(table)


@audit_app.command("checkpoint")
def checkpoint(tenant: TenantOpt, token: TokenOpt = None, home: HomeOpt = None) -> None:
    """Print the latest signed checkpoint exactly as signed."""
    if (client := remote(token)) is not None:
        sys.stdout.write(client.checkpoint(tenant))
        return
    with open_runtime(home) as rt:
        note = rt.ledger.head(rt.log_name(tenant)).checkpoint
    sys.stdout.write(note)


def _print_proof(doc: dict[str, Any], as_json: bool, title: str) -> None:
    if as_json:
        _emit_json(doc)
        return
    console.print(title)
    for i, h in enumerate(doc["hashes"]):
        console.print(f"  {i:2d} {h}")


@audit_app.command("proof")
def proof(
    tenant: TenantOpt,
    index: Annotated[int, typer.Option(help="Sequence number of the event")],
    size: Annotated[int | None, typer.Option(help="Tree size [default: latest]")] = None,
    as_json: JsonOpt = False,
    home: HomeOpt = None,
) -> None:
    """Inclusion proof (RFC 9162 §2.1.3) of one event in the tree of a given size."""
    with open_runtime(home) as rt:
        p = rt.ledger.inclusion_proof(rt.log_name(tenant), index, size)
    doc = p.as_json()
    _print_proof(
        doc, as_json, f"event {p.index} in tree of size {p.size}; leaf hash {doc['leaf_hash']}"
    )


@audit_app.command("consistency")
def consistency(
    tenant: TenantOpt,
    old: Annotated[int, typer.Option(help="Older tree size")],
    new: Annotated[int | None, typer.Option(help="Newer tree size [default: latest]")] = None,
    as_json: JsonOpt = False,
    home: HomeOpt = None,
) -> None:
    """Consistency proof (RFC 9162 §2.1.4) that the newer tree extends the older."""
    with open_runtime(home) as rt:
        p = rt.ledger.consistency_proof(rt.log_name(tenant), old, new)
    _print_proof(p.as_json(), as_json, f"tree {p.new} extends tree {p.old}")


@audit_app.command("verify")
def verify(
    tenant: Annotated[
        str | None, typer.Option("--tenant", "-t", help="Tenant ('system' for the runtime)")
    ] = None,
    from_export: Annotated[
        Path | None, typer.Option(help="Verify an export directory instead of the store")
    ] = None,
    key: Annotated[
        str | None, typer.Option(help="Verifier key to trust [default: the runtime's or export's]")
    ] = None,
    checkpoint: Annotated[
        list[Path] | None,
        typer.Option(help="A signed checkpoint held elsewhere that the log must extend"),
    ] = None,
    home: HomeOpt = None,
) -> None:
    """Recompute every leaf and root, check every signed checkpoint, and hold every
    governance row of the store (artifacts, approvals, deployments, principals, the
    quorum rule) to the events that back it."""
    trusted = [p.read_text(encoding="utf-8") for p in checkpoint or []]
    verifier = Verifier.parse(key) if key else None
    backing = None
    if from_export is not None:
        if verifier is None:
            vkey = (from_export / "verifier.key").read_text(encoding="utf-8").strip()
            console.print(f"[yellow]trusting the export's own key[/] {vkey}")
        report = verify_export(from_export, verifier, trusted)
        if tenant is not None and report.origin.rsplit("/", 1)[-1] != tenant:
            raise VerificationFailed(f"the export is of {report.origin}, not tenant {tenant!r}")
    else:
        if tenant is None:
            raise UsageError("give --tenant, or --from-export DIR")
        with open_runtime(home) as rt:
            if verifier is not None and verifier.vkey() != rt.ledger.vkey():
                raise VerificationFailed("the runtime's key is not the key you trust")
            log = rt.log_name(tenant)
            report = rt.ledger.verify(log, trusted)
            if log != SYSTEM_LOG:
                # The log is sound; now every governance row must be one it backs.
                backing = unbacked_rows(rt.store, rt.ledger, rt.artifacts, rt.approvals,
                                        rt.deployments, log)  # fmt: skip
    console.print(
        f"[green]verified[/] {report.origin}: {report.size} events, "
        f"{report.checkpoints} signed checkpoints consistent"
    )
    if backing is not None:
        problems, counts = backing
        checked = ", ".join(f"{n} {k}" for k, n in counts.items())
        if problems:
            for p in problems:
                console.print(f"[bold red]not backed[/] {p}", soft_wrap=True)
            raise VerificationFailed(
                f"{len(problems)} store row(s) of {tenant!r} are not backed by the signed"
                f" record: " + "; ".join(f"{p.kind} {p.key}" for p in problems),
                hint="someone changed the store file without the signing key; restore it"
                " from a backup and find out who could write it",
            )
        console.print(f"[green]store rows backed by the record[/]: {checked}")


@audit_app.command("export")
def export(
    tenant: TenantOpt,
    out: Annotated[Path, typer.Option("--out", "-o", help="Directory to create")],
    home: HomeOpt = None,
) -> None:
    """Export a log so that `verify --from-export` needs nothing else."""
    with open_runtime(home) as rt:
        log = rt.log_name(tenant)
        head = rt.ledger.export(log, out)
        actor: Actor = rt.operator
        rt.ledger.append(
            log if log != SYSTEM_LOG else SYSTEM_LOG,
            EventDraft(
                actor,
                "audit.export",
                f"log/{log}",
                reason="exported",
                details={"size": head.size, "path": str(out.resolve())},
            ),
        )
    console.print(f"exported {head.size} events of {head.origin} to {out}")
