"""``proctor evidence``, ``subprocessor``, ``lineage`` and ``receipt``: evidence for
auditors and controllers, a thin layer over :mod:`proctor.evidence`."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape

from proctor.cli._common import (
    HomeOpt,
    JsonOpt,
    TenantOpt,
    TokenOpt,
    WideOpt,
    acting,
    authorize_read,
    console,
    make_table,
    open_runtime,
    parse_time,
    print_table,
)
from proctor.cli._witness import WitnessOpt, WitnessQuorumOpt
from proctor.errors import UsageError
from proctor.governance import Subprocessors
from proctor.ledger import Action

# Each command imports proctor.evidence itself: loading it here would cost every other
# command of the CLI about 40 ms.

evidence_app = typer.Typer(
    help="Evidence packs and GDPR records for auditors and controllers.", no_args_is_help=True
)
subprocessor_app = typer.Typer(
    help="The subprocessor register (GDPR Art. 28(2)/(4)); egress elsewhere is refused.",
    no_args_is_help=True,
)
receipt_app = typer.Typer(help="Signed run receipts (C2SP tlog-proof).", no_args_is_help=True)
KeyOpt = Annotated[
    str | None,
    typer.Option("--key", help="Verifier key you trust [default: the pack's own, with a warning]"),
]


def _emit(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n")


def _write(
    doc: Any, out: Path | None, as_json: bool = False, text: Callable[[Any], str] | None = None
) -> None:
    """The document on stdout (JSON; with ``text`` and without --json, ``text(doc)``
    for people), or into --out as JSON; there, --json says where it went."""
    if out is None:
        if text is not None and not as_json:
            sys.stdout.write(text(doc))
            sys.stdout.flush()
            return
        _emit(doc)
        return
    out.write_text(json.dumps(doc, indent=2, sort_keys=True, ensure_ascii=False) + "\n")
    if as_json:
        _emit({"written": str(out)})
        return
    console.print(f"wrote {escape(str(out))}")


class ExportFormat(StrEnum):
    pack = "pack"
    ocsf_parquet = "ocsf-parquet"


@evidence_app.command("export")
def export(
    tenant: TenantOpt,
    since: Annotated[str, typer.Option("--from", help="ISO 8601 start (inclusive)")],
    until: Annotated[str, typer.Option("--to", help="ISO 8601 end (exclusive)")],
    out: Annotated[
        Path,
        typer.Option(
            "--out", "-o", help="The pack to create (.zip); for ocsf-parquet, a new directory"
        ),
    ],
    fmt: Annotated[
        ExportFormat,
        typer.Option(
            "--format",
            help="pack: the evidence pack; ocsf-parquet: the period's OCSF as Parquet for an "
            "AWS Security Lake custom source (needs the extra: pip install 'proctor\\[parquet]')",
        ),
    ] = ExportFormat.pack,
    region: Annotated[
        str | None, typer.Option(help="ocsf-parquet: the AWS region of the partition path")
    ] = None,
    account_id: Annotated[
        str | None,
        typer.Option(help="ocsf-parquet: the AWS account (or external) id of the source"),
    ] = None,
    source: Annotated[
        str, typer.Option(help="ocsf-parquet: each class's source is <source>-<class_uid>")
    ] = "proctor",
    as_json: JsonOpt = False,
    token: TokenOpt = None,
    home: HomeOpt = None,
) -> None:
    """Write the evidence pack of a period: events, OCSF, checkpoints, proofs, records, report
    (or with --format ocsf-parquet its OCSF as Parquet, one class per source)."""
    from proctor.evidence import export_pack

    start, end = parse_time(since, "--from"), parse_time(until, "--to")
    assert start is not None and end is not None
    if fmt is ExportFormat.ocsf_parquet:
        _export_parquet(tenant, start, end, out, region, account_id, source, as_json, token, home)
        return
    from proctor.cli._common import remote

    if (client := remote(token)) is not None:
        got = client.evidence_pack(tenant, start, end, out)
    else:
        with open_runtime(home) as rt:
            rt.tenants.get(tenant)
            authorize_read(rt, token, tenant, Action.EVIDENCE_EXPORT)
            info = export_pack(rt, tenant, start, end, out)
        got = {"events": info.events, "first_seq": info.first_seq, "end_seq": info.end_seq,
               "context": info.context, "end_size": info.end_size}  # fmt: skip
    if as_json:
        _emit({"pack": str(out), "tenant": tenant, **got})
        return
    console.print(
        f"exported {got['events']} events (seq {got['first_seq']} to {got['end_seq'] - 1}) and "
        f"{got['context']} context events of {tenant} to {escape(str(out))}; end checkpoint "
        f"size {got['end_size']}"
    )


@evidence_app.command("verify")
def verify(
    pack: Annotated[Path, typer.Argument(help="An evidence pack (.zip)")],
    key: KeyOpt = None,
    witness: WitnessOpt = None,
    witness_quorum: WitnessQuorumOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Verify a pack offline: signatures, proofs, approvals, capabilities, records, report;
    with --witness, also that witnesses you trust cosigned a checkpoint covering its period."""
    from proctor.evidence import verify_pack, verify_pack_witnesses

    quorum = _witness_policy(witness, witness_quorum)
    if key is None:
        # On stderr: stdout is the report's, which --json makes one JSON object.
        Console(stderr=True, highlight=False).print(
            "[yellow]trusting the pack's own verifier key; pass --key to check it "
            "against the key you hold[/]"
        )
    report = verify_pack(pack, key)
    witnessed = verify_pack_witnesses(pack, key, witness, quorum) if witness else None
    if as_json:
        _emit({**report.__dict__, **({"witness": witnessed} if witnessed is not None else {})})
        return
    if witnessed is not None:
        console.print(
            f"[green]witnessed[/]: {quorum} of your witnesses cosigned the checkpoint of size "
            f"{witnessed['witnessed_size']}, which extends the pack's end checkpoint"
        )
    console.print(
        f"[green]verified[/] {report.origin}: {report.events} events (seq {report.first_seq} to "
        f"{report.end_seq - 1}) and {report.context} context events in the signed tree of size "
        f"{report.end_size}; {report.production_runs} production run(s), "
        f"{report.approvals_checked} approval(s) and {report.accesses_checked} allowed "
        f"access(es) checked; {report.policy_versions} policy text(s) hash to the versions "
        f"cited, {report.decisions_redecided} recorded decision(s) decided again alike"
    )
    if report.erasures:
        older = report.erasures_uncommitted
        console.print(
            "erasures: every erased lineage entry is listed by a proven erasure its object "
            f"names ({report.erasures} erasure(s))"
            + (
                f"; {older} recorded before erasures listed their entries, held to one entry "
                "per object, their dataset, their order and their object count only"
                if older
                else ""
            )
        )


@evidence_app.command("report")
def report(
    pack: Annotated[Path, typer.Argument(help="An evidence pack (.zip)")],
    out: Annotated[Path, typer.Option("--out", "-o", help="Directory to write the report to")],
    as_json: JsonOpt = False,
) -> None:
    """Extract a pack's report (Markdown, HTML, JSON, chart)."""
    import zipfile

    out.mkdir(parents=True, exist_ok=True)
    written: list[str] = []
    with zipfile.ZipFile(pack) as zf:
        for name in zf.namelist():
            if name.startswith("report/") and "/" not in name[7:] and name[7:]:
                (out / name[7:]).write_bytes(zf.read(name))
                written.append(str(out / name[7:]))
    if as_json:
        _emit({"pack": str(pack), "out": str(out), "files": written})
        return
    console.print(f"report of {escape(str(pack))} written to {escape(str(out))}")


@evidence_app.command("dpa-annex")
def dpa_annex_cmd(
    tenant: TenantOpt,
    out: Annotated[Path | None, typer.Option("--out", "-o", help="Write JSON here")] = None,
    as_json: JsonOpt = False,
    token: TokenOpt = None,
    home: HomeOpt = None,
) -> None:
    """The DPA's subprocessor annex: the register and the egress actually seen (text;
    --json or --out FILE: JSON)."""
    from proctor.evidence import dpa_annex

    with open_runtime(home) as rt:
        authorize_read(rt, token, tenant, Action.AUDIT_READ)
        doc = dpa_annex(rt, tenant)
    _write(doc, out, as_json, _dpa_annex_text)


@evidence_app.command("ropa")
def ropa_cmd(
    tenant: TenantOpt,
    out: Annotated[Path | None, typer.Option("--out", "-o", help="Write JSON here")] = None,
    as_json: JsonOpt = False,
    token: TokenOpt = None,
    home: HomeOpt = None,
) -> None:
    """Records of processing (GDPR Art. 30(2)) from deployments, datasets and
    subprocessors (text; --json or --out FILE: JSON)."""
    from proctor.evidence import ropa

    with open_runtime(home) as rt:
        authorize_read(rt, token, tenant, Action.AUDIT_READ)
        doc = ropa(rt, tenant)
    _write(doc, out, as_json, _ropa_text)


def _counts(reached: dict[str, int]) -> str:
    return ", ".join(f"{host} ({n} call{'s' if n != 1 else ''})" for host, n in
                     sorted(reached.items())) or "none"  # fmt: skip


def _dpa_annex_text(doc: dict[str, Any]) -> str:
    """The annex as a person reads it: each subprocessor and what runs reached of it,
    then the egress no subprocessor covers."""
    lines = [f"Subprocessor annex of {doc['tenant']}", ""]
    subs = doc.get("subprocessors") or []
    if not subs:
        lines.append("No subprocessors registered (`proctor subprocessor add`).")
    for sp in subs:
        lines += [
            f"{sp['name']}: {sp['purpose']}",
            f"  location: {sp['location']}",
            f"  hosts:    {', '.join(sp.get('hosts') or []) or 'none'}",
            f"  since:    {sp.get('created_at')} (by {sp.get('created_by')})",
            f"  reached:  {_counts(sp.get('reached') or {})}",
        ]
    uncovered = doc.get("uncovered") or {}
    lines += ["", "Egress no subprocessor covers: " + _counts(uncovered)]
    if uncovered:
        lines.append("  (register them: proctor subprocessor add, or refuse them by policy)")
    return "\n".join(lines) + "\n"


def _ropa_text(doc: dict[str, Any]) -> str:
    """Records of processing as a person reads them, one block a processing."""
    lines = [
        f"Records of processing (GDPR Art. 30(2)) of {doc['processor']} for {doc['tenant']}",
        "",
    ]
    records = doc.get("records") or []
    if not records:
        lines.append("No production deployments: no processing on record.")
    for r in records:
        lines += [f"{r['processing']} ({r['status']}, since {r['since']})",
                  f"  purpose:     {r.get('purpose')}",
                  f"  instruction: {r.get('controller_instruction')}"]  # fmt: skip
        if r.get("reference"):
            lines.append(f"  reference:   {r['reference']}")
        cats = r.get("categories_of_data") or []
        lines.append("  data:        " + ("none" if not cats else ""))
        for c in cats:
            cols = ", ".join(c.get("columns") or []) or "all columns"
            lines.append(f"    {c['dataset']}.{c['table']} ({c.get('access')}): {cols}")
        recips = r.get("recipients") or []
        lines.append("  recipients:  " + ("none" if not recips else ""))
        for rc in recips:
            by = ", ".join(rc.get("subprocessors") or []) or "no subprocessor registered"
            lines.append(f"    {rc['host']} ({by})")
        lines += [f"  approved by: {', '.join(r.get('approvals') or []) or 'nobody'}",
                  f"  artifact:    {r.get('artifact')}", ""]  # fmt: skip
    subs = doc.get("subprocessors") or []
    lines.append("Subprocessors: " + ("none" if not subs else ""))
    lines += [f"  {s['name']}: {s['purpose']} ({s['location']})" for s in subs]
    lines += ["", "Security measures:"]
    lines += [f"  - {m}" for m in doc.get("security_measures") or []]
    return "\n".join(lines) + "\n"


@evidence_app.command("sample")
def sample(
    tenant: TenantOpt,
    n: Annotated[int, typer.Option("--n", help="How many production runs")] = 25,
    seed: Annotated[str, typer.Option("--seed", help="Seed: the same seed, the same sample")] = "0",
    out: Annotated[Path | None, typer.Option("--out", "-o", help="Write JSON here")] = None,
    as_json: JsonOpt = False,
    token: TokenOpt = None,
    home: HomeOpt = None,
) -> None:
    """A reproducible random sample of production runs, each with its full chain
    (text; --json or --out FILE: JSON)."""
    from proctor.evidence import sample_runs

    with open_runtime(home) as rt:
        authorize_read(rt, token, tenant, Action.AUDIT_READ)
        doc = sample_runs(rt, tenant, n, seed)
    _write(doc, out, as_json, _sample_text)


def _sample_text(doc: dict[str, Any]) -> str:
    """The sample as an auditor reads it: one block a run, its chain in order."""
    lines = [f"{doc['n']} of {doc['population']} production runs of {doc['tenant']} "
             f"(seed {doc['seed']!r}: the same seed gives the same sample)", ""]  # fmt: skip
    for item in doc.get("runs") or []:
        run, art, dep = item["run"], item["artifact"], item.get("deployment") or {}
        lines += [
            f"{run['id']}  {run['deployment']}  {run['status']}  {run['started_at']}",
            f"  started by:  {item.get('started_by')}",
            f"  artifact:    {art['name']} {art['digest']} by {art['author']}",
            f"  purpose:     {art.get('purpose')}",
            f"  deployed:    version {dep.get('version')} by {dep.get('created_by')}",
        ]
        for a in item.get("approvals") or []:
            lines.append(f"  approved by: {a.get('principal')} at {a.get('created_at')}")
        if not item.get("approvals"):
            lines.append("  approved by: nobody")
        lines.append("")
    if not doc.get("runs"):
        lines.append("No production runs to sample.")
    lines.append("The full chain of each: --json (or --out FILE).")
    return "\n".join(lines) + "\n"


def lineage_cmd(
    tenant: TenantOpt,
    dataset: Annotated[str, typer.Option("--dataset", help="Dataset name")],
    key: Annotated[
        str, typer.Option("--key", help="The record's primary key (JSON array if composite)")
    ],
    as_json: JsonOpt = False,
    wide: WideOpt = False,
    token: TokenOpt = None,
    home: HomeOpt = None,
) -> None:
    """Every run that read or wrote one record: when, under which deployment and approvals."""
    from proctor.evidence import lineage

    with open_runtime(home) as rt:
        authorize_read(rt, token, tenant, Action.AUDIT_READ)
        doc = lineage(rt, tenant, dataset, key)
    if as_json:
        _emit(doc)
        return
    if not wide:
        _lineage_narrow(doc)
        return
    table = make_table("run", "env", "deployment", "first", "last", "approved by", "events",
                       "lineage", ids=("run", "deployment"))  # fmt: skip
    for kind, rows in (("row", doc["read"]), ("table only", doc["possibly"])):
        for r in rows:
            table.add_row(
                r["run"],
                str(r["environment"]),
                str(r["deployment"]),
                r["first"],
                r["last"],
                ", ".join(r["approved_by"]) or "—",
                ", ".join(str(s) for s in r["events"][:10]),
                kind,
            )
    print_table(table, wide)


def _lineage_narrow(doc: dict[str, Any]) -> None:
    """Lineage in four columns of two lines each, to fit 80 columns (--wide: eight)."""
    table = make_table("run", "deployment (env)\napproved by", "first (UTC)\nlast",
                       "events\nlineage", ids=("run",))  # fmt: skip
    for kind, rows in (("row", doc["read"]), ("table only", doc["possibly"])):
        for r in rows:
            table.add_row(
                r["run"],
                escape(
                    f"{r['deployment']} ({r['environment']})\n{', '.join(r['approved_by']) or '—'}"
                ),
                f"{str(r['first'])[:19].replace('T', ' ')}\n"
                f"{str(r['last'])[:19].replace('T', ' ')}",
                ", ".join(str(s) for s in r["events"][:10]) + f"\n{kind}",
            )
    print_table(table)


@receipt_app.command("verify")
def receipt_verify(
    file: Annotated[Path, typer.Argument(help="A .tlog-proof receipt")],
    key: Annotated[str, typer.Option("--key", help="The verifier key you trust")],
    witness: WitnessOpt = None,
    witness_quorum: WitnessQuorumOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Check a run receipt offline against the verifier key (and, with --witness, that
    witnesses you trust cosigned its checkpoint)."""
    from proctor.evidence import verify_receipt

    quorum = _witness_policy(witness, witness_quorum)
    try:
        text = file.read_text(encoding="utf-8")
    except OSError as exc:
        raise UsageError(f"cannot read {file}: {exc.strerror}") from exc
    r = verify_receipt(text, key, witness or (), quorum)
    if as_json:
        _emit({"origin": r.origin, "index": r.index, "size": r.size, "event": r.event})
        return
    ev = r.event
    console.print(
        f"[green]verified[/] event {r.index} of {r.origin} (tree size {r.size}): "
        f"{escape(str(ev.get('action')))} {escape(str(ev.get('resource')))} at {ev.get('time')}"
        f" ({escape(str(ev.get('reason')))})"
        + (f"; cosigned by {quorum} of your witnesses" if quorum else "")
    )


@receipt_app.command("get")
def receipt_get(
    run_id: Annotated[str, typer.Argument(help="The run's id, or any unique prefix of it")],
    tenant: TenantOpt,
    output: Annotated[
        Path | None,
        typer.Option("--output", "-o", help="Write the receipt to this file [default: stdout]"),
    ] = None,
    as_json: JsonOpt = False,
    token: TokenOpt = None,
    home: HomeOpt = None,
) -> None:
    """A production run's signed receipt (C2SP tlog-proof), exactly as written;
    `proctor receipt verify` checks it offline. With --json: one object with the
    run's full id and the receipt (or where it was written)."""
    from proctor.cli._common import remote

    if (client := remote(token)) is not None:
        text = client.run_receipt(tenant, run_id)
        full = str(client.get_run(tenant, run_id)["id"]) if as_json else run_id
    else:
        from proctor.lifecycle import Runs, run_receipt

        with open_runtime(home) as rt:
            authorize_read(rt, token, tenant, Action.RUN_READ)
            text = run_receipt(rt, tenant, run_id)
            full = Runs(rt).get(tenant, run_id).id
    to_stdout = output is None or str(output) == "-"
    if to_stdout and not as_json:
        sys.stdout.write(text)
        return
    if not to_stdout:
        assert output is not None
        try:
            output.write_text(text, encoding="utf-8")
        except OSError as exc:
            raise UsageError(f"cannot write {output}: {exc.strerror}") from exc
    if as_json:
        _emit({"run": full, "tenant": tenant,
               **({"receipt": text} if to_stdout else {"written": str(output)})})  # fmt: skip
        return
    console.print(f"receipt of run {full} written to {output}")


@subprocessor_app.command("add")
def sp_add(
    tenant: TenantOpt,
    name: Annotated[str, typer.Argument(help="The subprocessor's name")],
    purpose: Annotated[str, typer.Option(help="What it processes the data for")],
    location: Annotated[str, typer.Option(help="Where it processes (country, region)")],
    host: Annotated[
        list[str], typer.Option("--host", help="A host it serves (host[:port], *.domain)")
    ],
    as_json: JsonOpt = False,
    token: TokenOpt = None,
    home: HomeOpt = None,
) -> None:
    """Register a subprocessor and the hosts it serves."""
    with open_runtime(home) as rt:
        actor, principal = acting(rt, token)
        if principal is not None:
            from proctor.policy import EntityRef

            rt.control.authorize(
                principal,
                Action.SUBPROCESSOR_MANAGE,
                EntityRef.tenant(tenant),
                tenant,
                event_resource=f"subprocessor/{name}",
            )
        sp = Subprocessors(rt.store, rt.ledger).add(
            tenant, name, purpose=purpose, location=location, hosts=host, actor=actor
        )
    if as_json:
        _emit(sp.as_json())
        return
    console.print(
        f"registered subprocessor [bold]{escape(sp.name)}[/] for {escape(', '.join(sp.hosts))}"
    )


@subprocessor_app.command("list")
def sp_list(
    tenant: TenantOpt,
    as_json: JsonOpt = False,
    wide: WideOpt = False,
    token: TokenOpt = None,
    home: HomeOpt = None,
) -> None:
    """List the tenant's subprocessors."""
    from proctor.cli._common import remote

    if (client := remote(token)) is not None:
        rows = [dict(r) for r in client.subprocessors(tenant)]
    else:
        with open_runtime(home) as rt:
            authorize_read(rt, token, tenant, Action.AUDIT_READ)
            rt.tenants.get(tenant)  # -t nope: unknown tenant, not an empty list
            rows = [s.as_json() for s in Subprocessors(rt.store, rt.ledger).list(tenant)]
    if as_json:
        _emit(rows)
        return
    table = make_table("name", "purpose", "location", "hosts", "since", "by",
                       ids=("name", "hosts"))  # fmt: skip
    for r in rows:
        cells = [str(r[k]) for k in ("name", "purpose", "location")]
        table.add_row(*cells, ", ".join(r["hosts"]), str(r["created_at"]), str(r["created_by"]))
    print_table(table, wide)


@subprocessor_app.command("remove")
def sp_remove(
    tenant: TenantOpt,
    name: Annotated[str, typer.Argument(help="The subprocessor's name")],
    as_json: JsonOpt = False,
    token: TokenOpt = None,
    home: HomeOpt = None,
) -> None:
    """Remove a subprocessor: egress to its hosts is refused from the next run on."""
    with open_runtime(home) as rt:
        actor, principal = acting(rt, token)
        if principal is not None:
            from proctor.policy import EntityRef

            rt.control.authorize(
                principal,
                Action.SUBPROCESSOR_MANAGE,
                EntityRef.tenant(tenant),
                tenant,
                event_resource=f"subprocessor/{name}",
            )
        Subprocessors(rt.store, rt.ledger).remove(tenant, name, actor)
    if as_json:
        _emit({"tenant": tenant, "name": name, "removed": True})
        return
    console.print(f"removed subprocessor [bold]{escape(name)}[/]")


def register(app: typer.Typer) -> None:
    """Add the evidence commands to the ``proctor`` app."""
    app.add_typer(evidence_app, name="evidence")
    app.add_typer(subprocessor_app, name="subprocessor")
    app.add_typer(receipt_app, name="receipt")
    app.command("lineage")(lineage_cmd)


def _witness_policy(witness: list[str] | None, quorum: int | None) -> int:
    """The quorum a --witness policy asks (0: no policy)."""
    if not witness:
        if quorum is not None:
            raise UsageError("--witness-quorum needs at least one --witness KEY")
        return 0
    from proctor.witness import check_policy

    return check_policy(witness, quorum)


def _export_parquet(
    tenant: str, start: str, end: str, out: Path, region: str | None, account: str | None,
    source: str, as_json: bool, token: str | None, home: Path | None,
) -> None:  # fmt: skip
    from proctor.evidence import export_parquet

    if region is None or account is None:
        raise UsageError(
            "--format ocsf-parquet needs --region and --account-id (Security Lake's partitions)",
            hint="e.g. --region eu-west-1 --account-id 123456789012",
        )
    with open_runtime(home) as rt:
        rt.tenants.get(tenant)
        authorize_read(rt, token, tenant, Action.EVIDENCE_EXPORT)
        files = export_parquet(rt, tenant, start, end, out, region=region, account=account,
                               source=source)  # fmt: skip
    if as_json:
        _emit({"format": "ocsf-parquet", "out": str(out), "tenant": tenant,
               "files": [{"path": str(f.path), "class_uid": f.class_uid,
                          "class_name": f.class_name, "event_day": f.event_day,
                          "rows": f.rows} for f in files]})  # fmt: skip
        return
    classes = sorted({f.class_uid for f in files})
    console.print(
        f"wrote {sum(f.rows for f in files)} OCSF events of {tenant} in {len(files)} Parquet "
        f"file(s), {len(classes)} class(es), under {escape(str(out))}"
    )
    for f in files:
        console.print(f"  {escape(str(f.path))}: {f.rows} {f.class_name} ({f.class_uid})")
