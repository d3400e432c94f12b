"""``proctor retention`` (set, show, prune) and ``proctor hold`` (add, list, remove):
a tenant's retention period and the legal holds that suspend it, over
:class:`proctor.governance.Retention`, or through the API with ``--server``."""

from __future__ import annotations

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
    emit_json,
    make_table,
    open_runtime,
    print_table,
    remote,
)
from proctor.errors import UsageError
from proctor.ledger import Action
from proctor.runtime import Runtime

retention_app = typer.Typer(
    help="A tenant's retention period: past it, events' payloads are pruned (their leaf "
    "hashes stay, so every proof still verifies).",
    no_args_is_help=True,
)
hold_app = typer.Typer(
    help="Legal holds: nothing a hold covers (a tenant, a deployment or a run) is pruned.",
    no_args_is_help=True,
)


def _manage(rt: Runtime, token: str | None, tenant: str, resource: str) -> None:
    _, principal = acting(rt, token)
    if principal is None:
        return  # the local operator owns the runtime; its actions are recorded all the same
    from proctor.policy import EntityRef

    rt.control.authorize(principal, Action.RETENTION_MANAGE, EntityRef.tenant(tenant), tenant,
                         event_resource=resource)  # fmt: skip


def _retention(rt: Runtime) -> Any:
    from proctor.governance import Retention

    return Retention(rt.store, rt.ledger)


def _say_rule(doc: dict[str, Any]) -> None:
    rule = doc.get("rule")
    if rule is None:
        console.print(f"tenant {escape(doc['tenant'])}: no retention rule (events kept forever)")
        return
    extra = ""
    if rule.get("below_legal_minimum"):
        extra = f" [yellow](below the legal minimum: {escape(rule['below_legal_minimum'])})[/]"
    console.print(
        f"tenant {escape(rule['tenant'])}: events kept {rule['days']} days ({rule['rule']}), set by"
        f" {escape(rule['set_by'])} at {rule['set_at']}{extra}"
    )


@retention_app.command("set")
def set_cmd(
    tenant: TenantOpt,
    days: Annotated[int, typer.Option("--days", help="Keep events this many days")],
    below_legal_minimum: Annotated[
        str | None,
        typer.Option(
            "--below-legal-minimum",
            help="Allow a period under 183 days (EU AI Act Art. 19, 26(6): six months), "
            "giving the reason; it is recorded",
            metavar="REASON",
            show_default=False,
        ),
    ] = None,
    as_json: JsonOpt = False,
    token: TokenOpt = None,
    home: HomeOpt = None,
) -> None:
    """Set how long the tenant's events are kept before their payloads are pruned."""
    doc: dict[str, Any]
    if (client := remote(token)) is not None:
        doc = dict(client.set_retention(tenant, days, below_legal_minimum=below_legal_minimum))
    else:
        with open_runtime(home) as rt:
            _manage(rt, token, tenant, f"tenant/{tenant}")
            actor, _ = acting(rt, token)
            rule = _retention(rt).set(tenant, days, actor, below_legal_minimum=below_legal_minimum)
            doc = rule.as_json()
    if as_json:
        emit_json(doc)
        return
    _say_rule({"tenant": tenant, "rule": doc})


@retention_app.command("show")
def show_cmd(
    tenant: TenantOpt,
    as_json: JsonOpt = False,
    wide: WideOpt = False,
    token: TokenOpt = None,
    home: HomeOpt = None,
) -> None:
    """The rule in force, the active holds, and the record of prunes and erasures."""
    doc: dict[str, Any]
    if (client := remote(token)) is not None:
        doc = dict(client.retention(tenant))
    else:
        with open_runtime(home) as rt:
            authorize_read(rt, token, tenant, Action.RETENTION_READ)
            rt.tenants.get(tenant)  # -t nope: unknown tenant
            r = _retention(rt)
            rule = r.rule(tenant)
            doc = {
                "tenant": tenant,
                "rule": None if rule is None else rule.as_json(),
                "holds": [h.as_json() for h in r.holds(tenant)],
                "history": r.history(tenant),
            }
    if as_json:
        emit_json(doc)
        return
    _say_rule(doc)
    for h in doc["holds"]:
        console.print(f"  hold {h['id']} on {h['scope']} {escape(h['target'])}: "
                      f"{escape(h['reason'])}")  # fmt: skip
    table = make_table("seq", "time", "action", "by", "what")
    for e in doc["history"]:
        d = e.get("details", {})
        what = {
            Action.RETENTION_SET: lambda d: f"{d.get('days')} days",
            Action.RETENTION_PRUNE: lambda d: f"{d.get('count')} pruned before {d.get('cutoff')}",
            Action.HOLD_ADD: lambda d: f"{d.get('hold')} on {d.get('scope')} {d.get('target')}",
            Action.HOLD_REMOVE: lambda d: f"{d.get('hold')} removed",
            Action.ERASURE_REQUEST: _erasure_what,
        }.get(e["action"], lambda d: "")(d)
        # To the second without --wide: a time folded over two lines is read wrong.
        when = str(e["time"]) if wide else str(e["time"])[:19].replace("T", " ")
        table.add_row(str(e["seq"]), when, e["action"], str(e["actor"]), escape(what))
    if doc["history"]:
        print_table(table, wide)


def _erasure_what(d: dict[str, Any]) -> str:
    ref = f"request {d.get('request_ref')} on {d.get('dataset')}"
    if not d.get("events"):
        return f"{ref}: nothing left to erase (erased already)"
    return f"{ref}: key erased from {d.get('objects')} object(s) of {d.get('events')} event(s)"


@retention_app.command("prune")
def prune_cmd(
    tenant: TenantOpt, as_json: JsonOpt = False, token: TokenOpt = None, home: HomeOpt = None
) -> None:
    """Prune now the events past the period that no hold covers (``serve`` does it daily)."""
    doc: dict[str, Any]
    if (client := remote(token)) is not None:
        doc = dict(client.prune(tenant))
    else:
        with open_runtime(home) as rt:
            _manage(rt, token, tenant, f"tenant/{tenant}")
            actor, _ = acting(rt, token)
            doc = _retention(rt).prune(tenant, actor).as_json()
    if as_json:
        emit_json(doc)
        return
    if doc.get("why_none"):
        console.print(f"nothing pruned: {doc['why_none']}")
        return
    console.print(
        f"{doc['pruned']} events of {escape(tenant)} pruned before {doc['cutoff']} under "
        f"{doc['rule']}; {doc['held']} kept under legal hold"
    )
    # What the prune saw of tampering: it went by the signed times, but say so.
    err = Console(stderr=True, highlight=False, soft_wrap=True)
    for key, what in (
        ("misdated", "whose stored time column is not the time they were signed at (the"
         " column was altered; pruning goes by the signed time, so they were judged by it)"),
        ("unverified", "whose bytes do not hash to the log's tree: not pruned"),
    ):  # fmt: skip
        if doc.get(f"{key}_count"):
            seqs = ", ".join(str(s) for s in doc.get(key, []))
            more = "" if len(doc.get(key, [])) >= doc[f"{key}_count"] else ", …"
            err.print(
                f"[yellow]warning:[/] {doc[f'{key}_count']} entries {what}: seq {seqs}{more};"
                f" run `proctor audit verify -t {escape(tenant)}`"
            )


@hold_app.command("add")
def hold_add(
    tenant: TenantOpt,
    reason: Annotated[str, typer.Option("--reason", help="Why (a case or request reference)")],
    run: Annotated[
        str | None,
        typer.Option(
            "--run",
            help="Hold one run's events (its id, or a unique prefix of it)",
            show_default=False,
        ),
    ] = None,
    deployment: Annotated[
        str | None,
        typer.Option(
            "--deployment",
            help="Hold one deployment's events (its name, or a unique prefix of it)",
            show_default=False,
        ),
    ] = None,
    as_json: JsonOpt = False,
    token: TokenOpt = None,
    home: HomeOpt = None,
) -> None:
    """Put a legal hold on the tenant (or on one run or deployment): nothing under it is pruned.

    The run or deployment must exist; the hold stores its full id."""
    if run is not None and deployment is not None:
        raise UsageError("a hold is on a run or on a deployment, not both",
                         hint="add two holds")  # fmt: skip
    # `--run ""` (an empty variable) is a run not named, refused: never a hold on the tenant.
    scope, target = ("run", run) if run is not None else (
        ("deployment", deployment) if deployment is not None else ("tenant", None))  # fmt: skip
    doc: dict[str, Any]
    if (client := remote(token)) is not None:
        doc = dict(client.add_hold(tenant, reason, run=run, deployment=deployment))
    else:
        with open_runtime(home) as rt:
            _manage(rt, token, tenant, f"tenant/{tenant}")
            actor, _ = acting(rt, token)
            doc = _retention(rt).add_hold(tenant, scope, target, reason, actor).as_json()
    if as_json:
        emit_json(doc)
        return
    console.print(f"legal hold {doc['id']} on {doc['scope']} {escape(doc['target'])}")


@hold_app.command("list")
def hold_list(
    tenant: TenantOpt,
    include_removed: Annotated[bool, typer.Option("--all", help="Include removed holds")] = False,
    as_json: JsonOpt = False,
    wide: WideOpt = False,
    token: TokenOpt = None,
    home: HomeOpt = None,
) -> None:
    """The tenant's legal holds."""
    docs: list[dict[str, Any]]
    if (client := remote(token)) is not None:
        docs = list(client.holds(tenant, include_removed=include_removed))
    else:
        with open_runtime(home) as rt:
            authorize_read(rt, token, tenant, Action.RETENTION_READ)
            rt.tenants.get(tenant)  # -t nope: unknown tenant
            docs = [h.as_json() for h in _retention(rt).holds(tenant, all_=include_removed)]
    if as_json:
        emit_json(docs)
        return
    table = make_table("id", "scope", "target", "reason", "by", "since", "removed", ids=("id",))
    for h in docs:
        table.add_row(h["id"], h["scope"], escape(h["target"]), escape(h["reason"]),
                      escape(h["created_by"]), h["created_at"], h["removed_at"] or "")  # fmt: skip
    print_table(table, wide)


@hold_app.command("remove")
def hold_remove(
    tenant: TenantOpt,
    hold_id: Annotated[str, typer.Argument(help="The hold's id (hold list)", metavar="ID")],
    as_json: JsonOpt = False,
    token: TokenOpt = None,
    home: HomeOpt = None,
) -> None:
    """Lift a legal hold; its record stays."""
    doc: dict[str, Any]
    if (client := remote(token)) is not None:
        doc = dict(client.remove_hold(tenant, hold_id))
    else:
        with open_runtime(home) as rt:
            _manage(rt, token, tenant, f"hold/{hold_id}"[:200])
            actor, _ = acting(rt, token)
            doc = _retention(rt).remove_hold(tenant, hold_id, actor).as_json()
    if as_json:
        emit_json(doc)
        return
    console.print(f"legal hold {doc['id']} removed")


def erase_cmd(
    tenant: TenantOpt,
    dataset: Annotated[str, typer.Option("--dataset", help="The dataset the record is in")],
    key: Annotated[
        str, typer.Option("--key", help="The record's key (a JSON array for a composite key)")
    ],
    request_ref: Annotated[
        str,
        typer.Option(
            "--request-ref",
            help="The erasure request's reference (a ticket number; recorded, never the person)",
        ),
    ],
    as_json: JsonOpt = False,
    token: TokenOpt = None,
    home: HomeOpt = None,
) -> None:
    """Erase one data subject's record key from the lineage record (GDPR Art. 17): no one
    can look the key up afterwards; counts and proofs still verify."""
    doc: dict[str, Any]
    if (client := remote(token)) is not None:
        doc = dict(client.erase(tenant, dataset, key, request_ref))
    else:
        with open_runtime(home) as rt:
            _, principal = acting(rt, token)
            if principal is not None:
                from proctor.policy import EntityRef

                rt.control.authorize(principal, Action.ERASURE_REQUEST, EntityRef.tenant(tenant),
                                     tenant, event_resource=f"dataset/{dataset}")  # fmt: skip
            from proctor.governance import erase_key, record_key_hmac

            actor, _ = acting(rt, token)
            rt.tenants.get(tenant)
            hashed = record_key_hmac(rt.keys.lineage_key(tenant), key)
            doc = erase_key(rt.store, rt.ledger, tenant, dataset, hashed, request_ref,
                            actor).as_json()  # fmt: skip
    if as_json:
        emit_json(doc)
        return
    if not doc.get("events"):
        console.print(
            f"nothing to erase: no lineage of this key is left in {escape(doc['dataset'])} "
            "(erased already, or never returned by a recorded read); nothing changed. "
            f"The request {escape(doc['request_ref'])} is recorded at seq {doc['seq']}"
        )
        return
    console.print(
        f"erasure {doc['erasure']} (request {escape(doc['request_ref'])}): the key is gone from "
        f"{doc['objects']} lineage object(s) of {doc['events']} event(s) of "
        f"{escape(doc['dataset'])}; recorded at seq {doc['seq']}"
    )


def register(app: typer.Typer) -> None:
    app.add_typer(retention_app, name="retention")
    app.add_typer(hold_app, name="hold")
    app.command("erase")(erase_cmd)
