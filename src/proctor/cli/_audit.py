from __future__ import annotations

import itertools
import json
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from proctor.cli._common import (
    HomeOpt,
    JsonOpt,
    TenantOpt,
    TokenOpt,
    WideOpt,
    acting,
    authorize_read,
    console,
    open_runtime,
    print_table,
    remote,
)
from proctor.cli._when import EXAMPLES as WHEN_EXAMPLES
from proctor.cli._when import parse_when
from proctor.cli._witness import (
    WitnessOfflineOpt,
    WitnessOpt,
    WitnessQuorumOpt,
    WitnessUrlOpt,
)
from proctor.errors import UsageError, VerificationFailed
from proctor.governance import unbacked_erasures, unbacked_rows
from proctor.ledger import (
    SYSTEM_LOG,
    Action,
    Actor,
    EventDraft,
    EventFilter,
    Verifier,
    check_action,
    iter_events,
    query_events,
    verify_export,
)
from proctor.policy import DATA_PLANE_ACTIONS
from proctor.runtime import Runtime

if TYPE_CHECKING:  # the witness component (and httpx) loads only when asked for
    from proctor.witness import WitnessReport

audit_app = typer.Typer(
    help="The audit ledger: events, checkpoints, proofs, verification.", no_args_is_help=True
)


def _emit_json(obj: object) -> None:
    sys.stdout.write(json.dumps(obj, sort_keys=True) + "\n")


RunFilterOpt = Annotated[
    str | None, typer.Option("--run", help="Only this run's events (any unique prefix of its id)")
]
ActionFilterOpt = Annotated[
    str | None, typer.Option("--action", help="Only this action (e.g. http.request, sql.select)")
]
DecisionFilterOpt = Annotated[
    str | None, typer.Option("--decision", help="Only 'allow' or only 'deny'")
]
ActorFilterOpt = Annotated[
    str | None, typer.Option("--actor", help="Only this actor's (its id, e.g. acme/alice)")
]


def authorize_events(rt: Runtime, token: str | None, tenant: str, run: str | None) -> str | None:
    """Decide a read of ``tenant``'s log, or of one run's events (an auditor, or the
    developer who created the run's deployment); returns the run's full id."""
    _, principal = acting(rt, token)
    if run is None:
        log = rt.log_name(tenant)
        if token is not None and log == SYSTEM_LOG:
            raise UsageError("the system log is the operator's; principals read their tenant's")
        authorize_read(rt, token, log, Action.AUDIT_READ)
        return None
    if rt.log_name(tenant) == SYSTEM_LOG:
        raise UsageError("runs belong to tenants; the system log has none")
    from proctor.governance import run_events_context
    from proctor.lifecycle import Runs
    from proctor.policy import EntityRef

    if principal is not None and principal.tenant != tenant:
        # Refused and recorded before any run of another tenant is looked up.
        rt.control.authorize(
            principal,
            Action.RUN_EVENTS_READ,
            EntityRef.workload(f"spiffe://{rt.config.trust_domain}/tenant/{tenant}/*"),
            tenant,
            event_resource=f"run/{run}",
            context={"principal_is_creator": False},
        )
    record = Runs(rt).get(tenant, run)
    if principal is not None:
        rt.control.authorize(
            principal,
            Action.RUN_EVENTS_READ,
            EntityRef.workload(record.workload),
            tenant,
            event_resource=f"run/{record.id}",
            context=run_events_context(rt.deployments, principal, record, rt.ledger),
        )
    return record.id


def _event_row(table: Table, ev: dict[str, Any], wide: bool = True) -> None:
    if "pruned" in ev:  # a pruned entry's marker (docs/ledger.md): no actor, no decision
        p = ev["pruned"] if isinstance(ev["pruned"], dict) else {}
        why = escape(f"pruned at {p.get('at')} under {p.get('rule')}")
        if not wide:
            table.add_row(str(ev["seq"]), f"{_short_time(ev.get('time'))}\n—",
                          f"{Action.LEDGER_PRUNED}\n[dim]pruned[/]", why)  # fmt: skip
            return
        table.add_row(str(ev["seq"]), str(ev.get("time")), "—", Action.LEDGER_PRUNED, "—",
                      "[dim]pruned[/]", why)  # fmt: skip
        return
    decision = ev["decision"]
    style = "green" if decision == "allow" else "bold red"
    if not wide:
        # Two lines a row, four columns: at 80 columns a row is two or three lines,
        # not the eight or nine that seven columns of ids fold into.
        table.add_row(
            str(ev["seq"]),
            escape(f"{_short_time(ev['time'])}\n{short_actor(ev['actor'])}"),
            f"{escape(ev['action'])}\n[{style}]{decision}[/]",
            escape(f"{ev['resource']}\n{ev['reason']}"),
        )
        return
    table.add_row(
        str(ev["seq"]),
        ev["time"],
        escape(f"{ev['actor']['type']}:{ev['actor']['id']}"),
        escape(ev["action"]),
        escape(ev["resource"]),
        f"[{style}]{decision}[/]",
        escape(ev["reason"]),
    )


def _events_table(wide: bool = True) -> Table:
    if not wide:
        table = Table("seq", "time (UTC)\nactor", "action\ndecision", "resource\nreason")
    else:
        table = Table("seq", "time", "actor", "action", "resource", "decision", "reason")
    for col in table.columns:
        col.overflow = "fold"
    return table


def _short_time(value: object) -> str:
    """``2026-12-05T08:06:55.949407Z`` as ``2026-12-05 08:06:55`` (--wide: as recorded)."""
    text = str(value)
    return text[:19].replace("T", " ") if len(text) >= 19 else text


def short_actor(actor: dict[str, Any]) -> str:
    """An actor as a table shows it without --wide: a workload by its run (its SPIFFE
    id is the run's, ``.../run/<id>``), others as ``type:id``, breakable after the type."""
    kind, ident = str(actor.get("type")), str(actor.get("id"))
    if kind == "workload" and "/run/" in ident:
        return "run " + ident.rsplit("/run/", 1)[1]
    return f"{kind}: {ident}" if len(ident) > 16 else f"{kind}:{ident}"


@audit_app.command("events")
def events(
    tenant: TenantOpt,
    since: Annotated[
        str | None, typer.Option(help=f"Start, inclusive (UTC: {WHEN_EXAMPLES})")
    ] = None,
    until: Annotated[
        str | None, typer.Option(help="End, exclusive (the same forms as --since)")
    ] = None,
    run: RunFilterOpt = None,
    action: ActionFilterOpt = None,
    decision: DecisionFilterOpt = None,
    actor: ActorFilterOpt = None,
    limit: Annotated[
        int | None,
        typer.Option(
            min=1, help="At most N events: the newest N, or the first N with --from-start"
        ),
    ] = None,
    from_start: Annotated[
        bool, typer.Option("--from-start", help="With --limit, keep the oldest N instead")
    ] = False,
    as_json: JsonOpt = False,
    as_lines: Annotated[
        bool,
        typer.Option("--jsonl", help="JSON Lines: one event a line, its bytes exactly as hashed"),
    ] = False,
    wide: WideOpt = False,
    token: TokenOpt = None,
    home: HomeOpt = None,
) -> None:
    """List a log's events, filtered (the filters combine). --json prints one JSON
    array, one event a line, each the event's bytes exactly as hashed; --jsonl the
    same bytes as JSON Lines."""
    form = "jsonl" if as_lines else "json" if as_json else "table"
    check_action(action)
    start, end = parse_when(since, "--since"), parse_when(until, "--until")
    flt = EventFilter(run=run, action=action, decision=decision, since=start, until=end,
                      actor=actor)  # fmt: skip
    if (client := remote(token)) is not None:
        kw: dict[str, Any] = {"since": start, "until": end, "run": run, "action": action,
                              "decision": decision, "actor": actor}  # fmt: skip
        if limit is not None and not from_start:
            found: Iterable[bytes] = client.events(tenant, limit=limit, newest=True, **kw)
        else:
            found = itertools.islice(client.iter_events(tenant, **kw), limit)
        _print_events(found, form, wide)
        return
    with open_runtime(home) as rt:
        log, flt = _local_read(rt, token, tenant, flt)
        if limit is not None:
            found = query_events(rt.ledger, log, flt, limit=limit, newest=not from_start)
        else:
            found = iter_events(rt.ledger, log, flt)
        _print_events(found, form, wide)


def _local_read(
    rt: Runtime, token: str | None, tenant: str, flt: EventFilter
) -> tuple[str, EventFilter]:
    """Authorize a read of ``tenant``'s events on the local home; the log to read and
    the filter with its run prefix resolved to the full id."""
    run_id = authorize_events(rt, token, tenant, flt.run)
    if run_id is not None:
        flt = replace(flt, run=run_id)
    return rt.log_name(tenant), flt


def _print_events(found: Iterable[bytes], form: str, wide: bool = False) -> None:
    out = sys.stdout.buffer
    if form == "jsonl":
        for data in found:
            out.write(data + b"\n")
        out.flush()
        return
    if form == "json":
        # Written as read, never held whole: '[', the events joined by ',\n', ']'.
        sep = b"[\n"
        for data in found:
            out.write(sep + data)
            sep = b",\n"
        out.write(b"[]\n" if sep == b"[\n" else b"\n]\n")
        out.flush()
        return
    table = _events_table(wide)
    for data in found:
        _event_row(table, json.loads(data), wide)
    print_table(table, wide)


@audit_app.command("tail")
def tail(
    tenant: TenantOpt,
    run: RunFilterOpt = None,
    action: ActionFilterOpt = None,
    decision: DecisionFilterOpt = None,
    as_json: JsonOpt = False,
    token: TokenOpt = None,
    home: HomeOpt = None,
) -> None:
    """Follow a log: print each new event as it is appended, until Ctrl-C; with
    --json, JSON Lines (each event's canonical bytes)."""
    check_action(action)
    flt = EventFilter(run=run, action=action, decision=decision)
    try:
        if (client := remote(token)) is not None:

            def opened(start: int) -> None:
                print(f"following {tenant} from event {start}", file=sys.stderr, flush=True)

            found = client.follow_events(
                tenant, run=run, action=action, decision=decision, on_open=opened
            )
            for data in found:
                _print_live(data, as_json)
            return
        with open_runtime(home) as rt:
            log, flt = _local_read(rt, token, tenant, flt)
            nxt = rt.ledger.head(log).size
            # Ready: a reader (or a test) knows from here on every append is shown.
            print(f"following {log} from event {nxt}", file=sys.stderr, flush=True)
            while True:
                size = rt.ledger.head(log).size
                if size > nxt:
                    for data in iter_events(rt.ledger, log, flt, start=nxt, end=size):
                        _print_live(data, as_json)
                    nxt = size
                else:
                    time.sleep(_TAIL_POLL)
    except KeyboardInterrupt:
        return


_TAIL_POLL = 0.2  # seconds between reads of a quiet log


def _print_live(data: bytes, as_json: bool) -> None:
    if as_json:
        sys.stdout.buffer.write(data + b"\n")
        sys.stdout.buffer.flush()
        return
    ev = json.loads(data)
    style = "green" if ev["decision"] == "allow" else "bold red"
    head = escape(
        f"{ev['seq']} {ev['time']} {ev['actor']['type']}:{ev['actor']['id']} {ev['action']}"
        f" {ev['resource']}"
    )
    console.print(
        f"{head} [{style}]{ev['decision']}[/] {escape(ev['reason'])}",
        soft_wrap=True,
        highlight=False,
        markup=True,
    )
    sys.stdout.flush()


@audit_app.command("checkpoint")
def checkpoint(
    tenant: TenantOpt, as_json: JsonOpt = False, token: TokenOpt = None, home: HomeOpt = None
) -> None:
    """Print the latest signed checkpoint exactly as signed."""
    if (client := remote(token)) is not None:
        note = client.checkpoint(tenant)
    else:
        with open_runtime(home) as rt:
            note = rt.ledger.head(rt.log_name(tenant)).checkpoint
    if as_json:
        # The note's exact text, signature lines included: what a verifier checks.
        _emit_json({"tenant": tenant, "checkpoint": note})
        return
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
    witness: WitnessOpt = None,
    witness_quorum: WitnessQuorumOpt = None,
    witness_url: WitnessUrlOpt = None,
    witness_offline: WitnessOfflineOpt = False,
    as_json: JsonOpt = False,
    home: HomeOpt = None,
) -> None:
    """Recompute every leaf and root, check every signed checkpoint, and hold every
    governance row of the store (artifacts, approvals, deployments, principals, the
    quorum rule) to the events that back it. With --witness: ask each witness for the
    newest checkpoint it cosigned; the log must extend it, a quorum must answer, and no
    newer event may be older than the tenant's witness max age."""
    trusted = [p.read_text(encoding="utf-8") for p in checkpoint or []]
    verifier = Verifier.parse(key) if key else None
    backing = None
    witnessed_size = None
    witnessing: WitnessReport | None = None
    quorum = 0
    if witness:
        from proctor.witness import check_policy, witnessed

        quorum = check_policy(witness, witness_quorum)
    elif witness_quorum is not None or witness_url or witness_offline:
        raise UsageError("--witness-quorum, --witness-url and --witness-offline need --witness KEY")
    if witness_url and witness_offline:
        raise UsageError("--witness-url asks the witnesses, --witness-offline does not: give one")
    if from_export is not None:
        if from_export.is_dir() and not (from_export / "checkpoint").is_file():
            raise UsageError(
                f"{from_export} is not an export of a Proctor log (it has no checkpoint)",
                hint="give the directory `proctor audit export -t T --out DIR` wrote",
            )
        if witness and not witness_offline:
            raise UsageError(
                "an export cannot be held to what the witnesses cosigned since it was made",
                hint="give --witness-offline to check the cosignatures it carries (and any "
                "--checkpoint), or verify the live store with -t TENANT, which asks them",
            )
        if verifier is None:
            vkey = (from_export / "verifier.key").read_text(encoding="utf-8").strip()
            Console(stderr=True, highlight=False).print(
                f"[yellow]trusting the export's own key[/] {vkey}"
            )
        if witness:
            # The export's checkpoint, or one held elsewhere (--checkpoint), must be
            # cosigned; the log is then held to it like any trusted checkpoint.
            own = (from_export / "checkpoint").read_text(encoding="utf-8")
            witnessed_size, note = witnessed([own, *trusted], witness, quorum)
            trusted.append(note)
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
            if witness:
                from proctor.witness import verify_witnessed_log

                try:
                    report, witnessing = verify_witnessed_log(
                        rt.store, rt.ledger, log, witness, quorum, trusted=trusted,
                        pinned=witness_url or (), offline=witness_offline,
                    )  # fmt: skip
                except VerificationFailed as exc:
                    from proctor.backup import behind_witnesses

                    behind_witnesses(rt.home, log, exc)  # a restored home: how far behind
                    raise
                witnessed_size = witnessing.witnessed_size
            else:
                report = rt.ledger.verify(log, trusted)
            if log != SYSTEM_LOG:
                # The log is sound; now every governance row must be one it backs.
                backing = unbacked_rows(rt.store, rt.ledger, rt.artifacts, rt.approvals,
                                        rt.deployments, log)  # fmt: skip
                # Lineage objects held to their events, each erased entry to the erasure
                # that lists it, the key index to the objects (docs/compliance.md).
                erasures = unbacked_erasures(rt.store, log)
                if erasures:
                    raise VerificationFailed(
                        f"{len(erasures)} problem(s) in the lineage record of {tenant!r} that"
                        f" the signed log does not back: {erasures[0]}",
                        hint="someone rewrote lineage objects or the key index without an"
                        " erasure request; restore them from a backup",
                    )
    # With --json, stdout is the one JSON object's; the sentences go to stderr.
    say = Console(stderr=True, highlight=False) if as_json else console
    say.print(
        f"[green]verified[/] {report.origin}: {report.size} events, "
        f"{report.checkpoints} signed checkpoints consistent"
        + (
            f"; {report.pruned} entries pruned past retention (markers held to their prune"
            " events), 0 tampered"
            if report.pruned
            else ""
        )
    )
    if witnessing is not None:
        _say_witnessed(say, witnessing, report.size)
    elif witnessed_size is not None:
        say.print(
            f"[green]witnessed[/]: the log extends the checkpoint of size {witnessed_size} that "
            f"{quorum} of your witnesses cosigned ({report.size - witnessed_size} newer events)"
        )
        say.print(
            "[yellow]witnesses not asked[/] (--witness-offline): only the cosignatures the "
            "export carries were checked, not what the witnesses cosigned since; no max age "
            "applied"
        )
    if backing is not None:
        problems, counts = backing
        checked = ", ".join(f"{n} {k}" for k, n in counts.items())
        if problems:
            for p in problems:
                say.print(f"[bold red]not backed[/] {p}", soft_wrap=True)
            raise VerificationFailed(
                f"{len(problems)} store row(s) of {tenant!r} are not backed by the signed"
                f" record: " + "; ".join(f"{p.kind} {p.key}" for p in problems),
                hint="someone changed the store file without the signing key; restore it"
                " from a backup and find out who could write it",
            )
        say.print(f"[green]store rows backed by the record[/]: {checked}")
    if as_json:
        _emit_json({"origin": report.origin, "size": report.size,
                    "checkpoints": report.checkpoints, "verified": True,
                    "pruned": report.pruned, "tampered": 0,
                    "rows_backed": None if backing is None else backing[1],
                    "witnessed_size": witnessed_size,
                    "witnessing": witnessing.as_json() if witnessing else None})  # fmt: skip


def _say_witnessed(say: Console, w: WitnessReport, size: int) -> None:
    """What was checked against the witnesses, and what was not, one line each."""
    newer = size - w.witnessed_size
    if w.asked:
        for a in w.answers:
            if a.checkpoint is None:
                say.print(f"[yellow]witness {escape(a.name)}[/] {escape(a.error or '')}",
                          soft_wrap=True)  # fmt: skip
                continue
            say.print(
                f"[green]witness {escape(a.name)}[/] (asked at {escape(a.url or '')}, from "
                f"{escape(a.url_from or '')}) last cosigned size {a.checkpoint.size}: the log "
                "extends it",
                soft_wrap=True,
            )
        say.print(
            f"[green]witnessed[/]: {w.quorum} of your witnesses cosigned the log up to size "
            f"{w.witnessed_size} ({newer} newer events)"
        )
    else:
        say.print(
            f"[green]witnessed[/]: the log extends the checkpoint of size {w.witnessed_size} "
            f"that {w.quorum} of your witnesses cosigned ({newer} newer events)"
        )
        say.print(
            "[yellow]witnesses not asked[/] (--witness-offline): only the cosignatures the "
            "store holds were checked; a store rolled back to before the witnesses' last "
            "cosignature passes this check",
            soft_wrap=True,
        )
    say.print(
        f"[green]max age[/]: the oldest event newer than size {w.witnessed_size} waited "
        f"{w.uncosigned_for:.0f} s; the tenant allows {w.max_age} s"
        if newer
        else f"[green]max age[/]: every event is witnessed (the tenant allows {w.max_age} s)"
    )


@audit_app.command("export")
def export(
    tenant: TenantOpt,
    out: Annotated[Path, typer.Option("--out", "-o", help="Directory to create")],
    as_json: JsonOpt = False,
    home: HomeOpt = None,
) -> None:
    """Export a log so that `verify --from-export` needs nothing else, with a complete
    static C2SP tlog-tiles tree beside it (serve the directory as the log's URL prefix)."""
    with open_runtime(home) as rt:
        log = rt.log_name(tenant)
        head = rt.ledger.export(log, out)
        actor: Actor = rt.operator
        rt.ledger.append(
            log if log != SYSTEM_LOG else SYSTEM_LOG,
            EventDraft(
                actor,
                Action.AUDIT_EXPORT,
                f"log/{log}",
                reason="exported",
                details={"size": head.size, "path": str(out.resolve())},
            ),
        )
    if as_json:
        _emit_json({"origin": head.origin, "size": head.size, "out": str(out)})
        return
    console.print(f"exported {head.size} events of {head.origin} to {out}")
    console.print(f"a static tlog-tiles tree of the log: serve {out} as its URL prefix")


@dataclass
class RunCalls:
    """A run's calls out of its sandbox: the broker's decision events of the run,
    refusals first. At most ``limit`` of each kind are kept; the rest are counted.

    An allowed call whose upstream could not be reached or verified is shown as
    failed, with the reason and seq of its completion event (``http.request.end``):
    allowed by policy, but the job got a 502, not the upstream's answer."""

    denied: list[dict[str, Any]] = field(default_factory=list)
    allowed: list[dict[str, Any]] = field(default_factory=list)
    total: dict[str, int] = field(default_factory=lambda: {"allow": 0, "deny": 0, "failed": 0})
    #: The completion event (seq, error) of each allowed call that failed, by decision seq.
    failures: dict[int, tuple[int, str]] = field(default_factory=dict)
    #: The run's asked calls (capabilities marked ask): call.ask and call.answer events
    #: by ask id; a call's own event names its ask (``details.ask``).
    asks: dict[str, dict[str, Any]] = field(default_factory=dict)
    answers: dict[str, dict[str, Any]] = field(default_factory=dict)

    @classmethod
    def collect(cls, found: Iterable[bytes], limit: int) -> RunCalls:
        calls = cls()
        for data in found:
            ev = json.loads(data)
            action = str(ev.get("action", ""))
            if action == Action.HTTP_REQUEST_END:
                calls._completion(ev)
                continue
            if action in (Action.CALL_ASK, Action.CALL_ANSWER):
                kept_by = calls.asks if action == Action.CALL_ASK else calls.answers
                if ev.get("decision") == "allow" or action == Action.CALL_ASK:
                    kept_by[str((ev.get("details") or {}).get("ask"))] = ev
                continue
            if action not in DATA_PLANE_ACTIONS and not action.startswith("broker."):
                continue  # the run's start and end: not decisions
            kind = "deny" if ev.get("decision") == "deny" else "allow"
            calls.total[kind] += 1
            kept = calls.denied if kind == "deny" else calls.allowed
            if len(kept) < limit:
                kept.append(ev)
        return calls

    def _completion(self, ev: dict[str, Any]) -> None:
        details = ev.get("details") or {}
        decided = details.get("decision_seq")
        # Answered by the broker itself (a 502), not by the upstream: the call failed.
        if ev.get("reason") == "failed" and details.get("answered") and isinstance(decided, int):
            self.failures[decided] = (int(ev["seq"]), str(details.get("error") or "failed"))
            self.total["failed"] += 1

    def call_json(self, ev: dict[str, Any]) -> dict[str, Any]:
        call = _call_json(ev)
        failure = self.failures.get(int(ev["seq"]))
        if failure is not None and call["decision"] == "allow":
            call["failed"] = {"seq": failure[0], "error": failure[1]}
        return call

    def as_json(self) -> list[dict[str, Any]]:
        return [self.call_json(ev) for ev in (*self.denied, *self.allowed)]

    def print(self, run: dict[str, Any], wide: bool = False) -> None:
        console.print(
            f"run [bold]{escape(run['id'])}[/] of {escape(run['deployment'])} v{run['version']}"
            f" ({escape(run['environment'])}): {escape(run['status'])}"
            + (f" ({escape(run['reason'])})" if run.get("reason") else "")
            + ("" if run.get("exit_code") is None else f", exit {run['exit_code']}"),
            soft_wrap=True,
        )
        failed = self.total["failed"]
        console.print(
            f"calls: {self.total['deny']} refused, {self.total['allow']} allowed"
            + (f" ({failed} of them failed upstream)" if failed else ""),
            highlight=False,
        )
        if not (self.denied or self.allowed):
            self._print_asks()
            return
        if wide:
            table = Table("seq", "action", "resource", "decision", "reason / policies")
        else:
            table = Table("seq", "action\ndecision", "resource\nreason / policies")
        for col in table.columns:
            col.overflow = "fold"
        # Failed calls before the ones that went through: they are what a person looks for.
        allowed = sorted(self.allowed, key=lambda ev: int(ev["seq"]) not in self.failures)
        for ev in (*self.denied, *allowed):
            call = self.call_json(ev)
            if "failed" in call:
                decision = "[bold yellow]failed upstream[/]"
                why = f"{call['failed']['error']} (event {call['failed']['seq']})"
            elif call["decision"] == "allow":
                decision = "[green]allow[/]"
                why = ", ".join(call["policies"]) or call["reason"]
            else:
                decision = "[bold red]deny[/]"
                why = call["reason"]
            if wide:
                table.add_row(str(call["seq"]), escape(call["action"]), escape(call["resource"]),
                              decision, escape(why))  # fmt: skip
            else:
                table.add_row(str(call["seq"]), f"{escape(call['action'])}\n{decision}",
                              escape(f"{call['resource']}\n{why}"))  # fmt: skip
        print_table(table, wide)
        self._print_asks()
        for kind, kept in (("deny", self.denied), ("allow", self.allowed)):
            if self.total[kind] > len(kept):
                console.print(f"({self.total[kind] - len(kept)} more {kind} not shown: --limit)")

    def _print_asks(self) -> None:
        """Each asked call: its request, its answer, and the call's event that followed."""
        decided = {str(c["ask"]["id"]): c["seq"] for c in self.as_json() if "ask" in c}
        for ask_id, asked in self.asks.items():
            answer = self.answers.get(ask_id)
            state = "waiting for an answer"
            if answer is not None:
                d = answer.get("details") or {}
                state = (f"{d.get('answer')} by {answer['actor']['id']}"
                         f" (event {answer['seq']})")  # fmt: skip
            then = f", then event {decided[ask_id]}" if ask_id in decided else ""
            call = str((asked.get("details") or {}).get("call", ""))
            console.print(
                f"asked {escape(ask_id)} (event {asked['seq']}): {escape(call)}"
                f" {escape(str(asked['resource']))}: {escape(state)}{then}",
                highlight=False, soft_wrap=True,
            )  # fmt: skip


def _call_json(ev: dict[str, Any]) -> dict[str, Any]:
    ask = (ev.get("details") or {}).get("ask")
    if isinstance(ask, dict):
        return {**_plain_call_json(ev), "ask": ask}
    return _plain_call_json(ev)


def _plain_call_json(ev: dict[str, Any]) -> dict[str, Any]:
    return {
        "seq": ev["seq"],
        "time": ev["time"],
        "action": ev["action"],
        "resource": ev["resource"],
        "decision": ev["decision"],
        "reason": ev["reason"],
        "policies": list(ev.get("policies") or []),
    }
