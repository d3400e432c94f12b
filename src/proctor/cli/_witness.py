"""``proctor witness``: run a witness (init, add-log, serve, show) and choose a
tenant's witnesses (use, list, remove, policy, submit), over :mod:`proctor.witness`."""

from __future__ import annotations

import signal
import sys
import threading
from pathlib import Path
from types import FrameType
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
    emit_json_lines,
    make_table,
    open_runtime,
    print_table,
)
from proctor.ledger import Action
from proctor.runtime import Runtime

witness_app = typer.Typer(
    help="Witnesses that cosign a log's checkpoints (C2SP tlog-witness), and a tenant's choice "
    "of them.",
    no_args_is_help=True,
)

StateOpt = Annotated[
    Path,
    typer.Option("--state", help="The witness's state directory (its key and database)",
                 metavar="DIR"),
]  # fmt: skip


#: A verifier's witness policy (audit verify, evidence verify, receipt verify).
WitnessOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--witness",
        help="A witness's cosignature key you trust (repeatable): the checkpoint relied on "
        "must carry its cosignature",
        show_default=False,
    ),
]
WitnessQuorumOpt = Annotated[
    int | None,
    typer.Option(
        "--witness-quorum",
        help="How many of the --witness keys must have cosigned [default: all of them]",
        show_default=False,
    ),
]

WitnessUrlOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--witness-url",
        help="Ask the witness at this URL what it last cosigned (repeatable); when given, "
        "the URLs the store registers are not used [default: the tenant's witnesses' URLs]",
        show_default=False,
    ),
]
WitnessOfflineOpt = Annotated[
    bool,
    typer.Option(
        "--witness-offline",
        help="Do not ask the witnesses: check only the cosignatures held with the log (a "
        "store rolled back to before their last cosignature then passes)",
    ),
]


def _manage(rt: Runtime, token: str | None, tenant: str, name: str) -> None:
    """Choosing witnesses is part of the tenant's trust policy: the policy.set action."""
    _, principal = acting(rt, token)
    if principal is None:
        return
    from proctor.policy import EntityRef

    rt.control.authorize(
        principal,
        Action.POLICY_SET,
        EntityRef.tenant(tenant),
        tenant,
        event_resource=f"witness/{name}",
    )


# ---- the witness itself ---------------------------------------------------------


@witness_app.command("init")
def init_cmd(
    state: StateOpt,
    name: Annotated[
        str, typer.Option("--name", help="The witness's key name, e.g. witness.example.com/w1")
    ],
    as_json: JsonOpt = False,
) -> None:
    """Make a witness: its Ed25519 key and empty state; prints its verifier key."""
    from proctor.witness import Witness

    w = Witness.init(state, name)
    if as_json:
        emit_json({"name": name, "vkey": w.vkey, "state": str(state)})
        return
    console.print(f"witness {escape(name)} made in {escape(str(state))}; its verifier key:")
    print(w.vkey)


@witness_app.command("add-log")
def add_log_cmd(
    state: StateOpt,
    origin: Annotated[
        str, typer.Argument(help="The log's origin line, e.g. proctor.local/tenant/acme")
    ],
    vkey: Annotated[str, typer.Argument(help="The log's verifier key ('proctor key show')")],
    as_json: JsonOpt = False,
) -> None:
    """Trust a log's verifier key: the witness then cosigns that log's checkpoints."""
    from proctor.witness import Witness

    st = Witness.open(state).add_log(origin, vkey)
    if as_json:
        emit_json(st.as_json())
        return
    console.print(f"the witness now follows {escape(origin)} (cosigned up to size {st.size})")


@witness_app.command("show")
def show_cmd(state: StateOpt, as_json: JsonOpt = False, wide: WideOpt = False) -> None:
    """The witness's key and, per log, the keys it trusts and the last size it cosigned."""
    from proctor.witness import Witness

    w = Witness.open(state)
    logs = w.logs()
    if as_json:
        emit_json({"name": w.cosigner.name, "vkey": w.vkey, "logs": [s.as_json() for s in logs]})
        return
    console.print(f"witness {escape(w.cosigner.name)}")
    print(w.vkey)
    table = make_table("origin", "size", "updated", "log keys", ids=("origin", "log keys"))
    for s in logs:
        table.add_row(s.origin, str(s.size), s.updated or "-", "\n".join(s.keys))
    print_table(table, wide)


@witness_app.command("serve")
def serve_cmd(
    state: StateOpt,
    listen: Annotated[
        str, typer.Option("--listen", help="HOST:PORT to serve add-checkpoint on (port 0: any)")
    ] = "127.0.0.1:7380",
    per_address: Annotated[
        int,
        typer.Option(
            "--per-address",
            min=1,
            help="Connections one client address (an IPv6 /64) may hold at once",
        ),
    ] = 32,
    request_timeout: Annotated[
        float,
        typer.Option(
            "--request-timeout",
            min=0.1,
            help="Seconds a request has to arrive whole, or an idle connection to "
            "send the next, before it is closed",
        ),
    ] = 10.0,
    as_json: JsonOpt = False,
) -> None:
    """Serve the witness over HTTP (POST /add-checkpoint, GET /<sha256 of origin>/checkpoint)
    until interrupted."""
    from proctor.witness import Witness, WitnessServer, parse_listen

    host, port = parse_listen(listen)
    server = WitnessServer(Witness.open(state), host, port, per_address=per_address,
                           request_timeout=request_timeout)  # fmt: skip
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, on_signal)
    server.start()
    bound_host, bound_port = server.address
    if as_json:
        # One line: a supervisor (or a test) reads the address before any request.
        emit_json_lines({"listen": f"{bound_host}:{bound_port}", "state": str(state),
                         "per_address": server.gate.per_address,
                         "max_connections": server.gate.total})  # fmt: skip
    else:
        console.print(f"witness listening on http://{bound_host}:{bound_port}")
    sys.stdout.flush()
    try:
        while not stop.wait(1.0):
            pass
    finally:
        server.stop()


# ---- a tenant's witnesses -------------------------------------------------------


@witness_app.command("use")
def use_cmd(
    tenant: TenantOpt,
    name: Annotated[str, typer.Argument(help="A name for the witness in this tenant")],
    vkey: Annotated[str, typer.Argument(help="The witness's verifier key ('witness show')")],
    url: Annotated[
        str, typer.Argument(help="The witness's submission prefix, http(s)://host:port")
    ],
    as_json: JsonOpt = False,
    token: TokenOpt = None,
    home: HomeOpt = None,
) -> None:
    """Submit the tenant's checkpoints to this witness from now on."""
    from proctor.witness import TenantWitnesses

    with open_runtime(home) as rt:
        _manage(rt, token, tenant, name)
        actor, _ = acting(rt, token)
        w = TenantWitnesses(rt.store, rt.ledger).use(tenant, name, vkey, url, actor)
    if as_json:
        emit_json(w.as_json())
        return
    console.print(f"tenant {escape(tenant)} now submits its checkpoints to {escape(name)}")


@witness_app.command("remove")
def remove_cmd(
    tenant: TenantOpt,
    name: Annotated[str, typer.Argument(help="The witness's name in this tenant")],
    as_json: JsonOpt = False,
    token: TokenOpt = None,
    home: HomeOpt = None,
) -> None:
    """Stop submitting to a witness (the cosignatures it gave are kept)."""
    from proctor.witness import TenantWitnesses

    with open_runtime(home) as rt:
        _manage(rt, token, tenant, name)
        actor, _ = acting(rt, token)
        TenantWitnesses(rt.store, rt.ledger).remove(tenant, name, actor)
    if as_json:
        emit_json({"tenant": tenant, "name": name, "removed": True})
        return
    console.print(f"removed witness {escape(name)} from tenant {escape(tenant)}")


@witness_app.command("list")
def list_cmd(
    tenant: TenantOpt,
    as_json: JsonOpt = False,
    wide: WideOpt = False,
    token: TokenOpt = None,
    home: HomeOpt = None,
) -> None:
    """The tenant's witnesses, and how far each has cosigned its log. --json: one array,
    one object a witness (`witness status` has the policy and the log's standing)."""
    status = _status(tenant, token, home)
    if as_json:
        emit_json([{**w, "cosigned_up_to": status["per_witness"][w["name"]]}
                   for w in status["witnesses"]])  # fmt: skip
        return
    table = make_table("name", "url", "cosigned up to", "key", ids=("name", "url", "key"))
    for w in status["witnesses"]:
        table.add_row(w["name"], w["url"], str(status["per_witness"][w["name"]]), w["vkey"])
    print_table(table, wide)
    _print_standing(status)


@witness_app.command("status")
def status_cmd(
    tenant: TenantOpt,
    as_json: JsonOpt = False,
    token: TokenOpt = None,
    home: HomeOpt = None,
) -> None:
    """How well witnessed the tenant's log is: its size, the newest checkpoint a quorum
    cosigned and how long ago, against the witness policy; each witness's progress."""
    status = _status(tenant, token, home)
    if as_json:
        emit_json(status)
        return
    _print_standing(status)


def _status(tenant: str, token: str | None, home: Path | None) -> dict[str, Any]:
    from proctor.witness import TenantWitnesses

    with open_runtime(home) as rt:
        authorize_read(rt, token, tenant, Action.AUDIT_READ)
        return TenantWitnesses(rt.store, rt.ledger).status(tenant)


def _print_standing(status: dict[str, Any]) -> None:
    policy = status["policy"]
    age = status["newest_cosigned_age_seconds"]
    console.print(
        f"log size {status['log_size']}; newest checkpoint with {policy['quorum']} "
        f"cosignature(s): {status['newest_cosigned_size'] or 'none'}"
        + (f" ({age:.0f} s ago)" if age is not None else "")
        + f"; policy allows {policy['max_age_seconds']} s: "
        + ("[green]within[/]" if status["within_policy"] else "[red]exceeded[/]")
    )


@witness_app.command("policy")
def policy_cmd(
    tenant: TenantOpt,
    quorum: Annotated[
        int | None, typer.Option("--quorum", help="Cosignatures a checkpoint needs", min=1)
    ] = None,
    max_age: Annotated[
        int | None,
        typer.Option("--max-age", help="Seconds the log may go without a cosigned head", min=1),
    ] = None,
    as_json: JsonOpt = False,
    token: TokenOpt = None,
    home: HomeOpt = None,
) -> None:
    """Show the tenant's witness policy, or set it with --quorum / --max-age."""
    from proctor.witness import TenantWitnesses

    with open_runtime(home) as rt:
        witnesses = TenantWitnesses(rt.store, rt.ledger)
        if quorum is None and max_age is None:
            authorize_read(rt, token, tenant, Action.AUDIT_READ)
            policy = witnesses.policy(tenant)
        else:
            _manage(rt, token, tenant, "policy")
            actor, _ = acting(rt, token)
            policy = witnesses.set_policy(tenant, actor, quorum=quorum, max_age=max_age)
    if as_json:
        emit_json({"tenant": tenant, **policy.as_json()})
        return
    console.print(
        f"tenant {escape(tenant)}: {policy.quorum} cosignature(s) per checkpoint; the log may go "
        f"{policy.max_age_seconds} s without a cosigned head"
    )


@witness_app.command("submit")
def submit_cmd(
    tenant: TenantOpt,
    as_json: JsonOpt = False,
    token: TokenOpt = None,
    home: HomeOpt = None,
) -> None:
    """Submit the tenant's newest checkpoint to its witnesses now ('proctor serve' does it
    on its own every few seconds)."""
    from proctor.witness import TenantWitnesses

    with open_runtime(home) as rt:
        _manage(rt, token, tenant, "submit")
        done = TenantWitnesses(rt.store, rt.ledger).submit(tenant)
    if as_json:
        emit_json([s.as_json() for s in done])
        return
    if not done:
        console.print(f"tenant {escape(tenant)} uses no witness ('proctor witness use')")
    for s in done:
        mark = "[green]cosigned[/]" if s.ok else "[red]not cosigned[/]"
        console.print(f"{escape(s.witness)}: size {s.size} {mark}: {escape(s.detail)}")


def register(app: typer.Typer) -> None:
    app.add_typer(witness_app, name="witness")
