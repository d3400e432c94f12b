"""`proctor ask list/show/approve/deny`: single calls a run waits on a person for."""

from __future__ import annotations

import json
from typing import Annotated, Any

import typer
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
from proctor.governance import ASK_STATES as STATES
from proctor.ledger import Action

ask_app = typer.Typer(
    help="Calls that wait for a person's answer (capabilities marked ask in the manifest).",
    no_args_is_help=True,
)

AskIdArg = Annotated[str, typer.Argument(help="The ask's id (ask_...), as ask list shows it")]
CommentOpt = Annotated[str, typer.Option(help="Why, for the record")]


def _shown(arguments: dict[str, Any]) -> str:
    # The arguments come from the guest: JSON with every non-ASCII character escaped
    # shows a terminal nothing it would act on, and no Rich markup.
    return escape(json.dumps(arguments, sort_keys=True, ensure_ascii=True))


@ask_app.command("list")
def ask_list(
    tenant: TenantOpt,
    run: Annotated[str | None, typer.Option(help="Only this run's asks")] = None,
    state: Annotated[
        str | None, typer.Option(help="Only in this state: " + ", ".join(STATES))
    ] = None,
    as_json: JsonOpt = False,
    wide: WideOpt = False,
    token: TokenOpt = None,
    home: HomeOpt = None,
) -> None:
    """The tenant's asked calls, pending first: the run, the call, its arguments."""
    if state is not None and state not in STATES:
        raise UsageError(f"unknown ask state {state!r}", hint="one of " + ", ".join(STATES))
    if (client := remote(token)) is not None:
        docs = client.asked_calls(tenant, run=run, state=state)
    else:
        with open_runtime(home) as rt:
            authorize_read(rt, token, tenant, Action.RUN_READ)
            rt.tenants.get(tenant)
            asks = rt.asks.find(tenant, run=run, state=state)
            docs = [a.to_json() for a in asks]
    if as_json:
        emit_json(docs)
        return
    if not docs:
        console.print("no asked calls")
        return
    table = make_table("ask", "state", "run", "call", "arguments", "deadline", "answered by",
                       ids=("ask", "run"))  # fmt: skip
    for d in docs:
        table.add_row(d["id"], d["state"], d["run"], d["action"], _shown(d["arguments"]),
                      d["deadline"], escape(d["answered_by"] or ""))  # fmt: skip
    print_table(table, wide)


@ask_app.command("show")
def ask_show(
    ask_id: AskIdArg,
    tenant: TenantOpt,
    as_json: JsonOpt = False,
    token: TokenOpt = None,
    home: HomeOpt = None,
) -> None:
    """One asked call: its run, its exact arguments, its answer and the events' seqs."""
    if (client := remote(token)) is not None:
        doc = client.asked_call(tenant, ask_id)
    else:
        with open_runtime(home) as rt:
            authorize_read(rt, token, tenant, Action.RUN_READ)
            doc = rt.asks.get(tenant, ask_id).to_json()
    if as_json:
        emit_json(doc)
        return
    _print(doc)


def _print(d: dict[str, Any]) -> None:
    console.print(f"ask {d['id']}: {d['state']}")
    console.print(f"  run        {d['run']} (deployment {escape(d['deployment'])})")
    console.print(f"  call       {d['action']} {escape(json.dumps(d['resource'])[1:-1])}")
    for key, value in sorted(d["arguments"].items()):
        console.print(f"    {key}: {escape(json.dumps(value, ensure_ascii=True))}")
    console.print(
        f"  asked      {d['created_at']} (event {d['ask_seq']}), deadline {d['deadline']}"
    )
    if d["state"] != "pending":
        console.print(f"  answered   {d['state']} by {escape(d['answered_by'] or '')} at"
                      f" {d['answered_at']} (event {d['answer_seq']})")  # fmt: skip
        if d.get("comment"):
            console.print(f"  comment    {escape(json.dumps(d['comment'], ensure_ascii=True))}")


def _answer(
    ask_id: str, tenant: str, approve: bool, comment: str, as_json: bool, token: str | None,
    home: Any,
) -> None:  # fmt: skip
    if (client := remote(token)) is not None:
        doc = client.answer_call(tenant, ask_id, approve, comment)
    else:
        with open_runtime(home) as rt:
            actor, principal = acting(rt, token)
            if principal is None:
                rt.tenants.get(tenant)
            ask = rt.asks.answer(
                tenant, ask_id, approve, actor=actor, principal=principal, comment=comment,
                trust_domain=rt.config.trust_domain,
            )  # fmt: skip
            doc = ask.to_json()
    if as_json:
        emit_json(doc)
        return
    console.print(f"ask {doc['id']} {doc['state']} by {escape(doc['answered_by'] or '')}"
                  f" (event {doc['answer_seq']})")  # fmt: skip


@ask_app.command("approve")
def ask_approve(
    ask_id: AskIdArg,
    tenant: TenantOpt,
    comment: CommentOpt = "",
    as_json: JsonOpt = False,
    token: TokenOpt = None,
    home: HomeOpt = None,
) -> None:
    """Approve an asked call: it goes on. Not by the author of the code, never by an
    agent; exactly one answer counts (a later one is refused, exit 5)."""
    _answer(ask_id, tenant, True, comment, as_json, token, home)


@ask_app.command("deny")
def ask_deny(
    ask_id: AskIdArg,
    tenant: TenantOpt,
    comment: CommentOpt = "",
    as_json: JsonOpt = False,
    token: TokenOpt = None,
    home: HomeOpt = None,
) -> None:
    """Deny an asked call: it is refused, its refusal naming this answer's event."""
    _answer(ask_id, tenant, False, comment, as_json, token, home)


def register(app: typer.Typer) -> None:
    """Add the commands to ``app``."""
    app.add_typer(ask_app, name="ask")
