from __future__ import annotations

import json
import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console
from rich.table import Table

from proctor.errors import UsageError
from proctor.governance import Principal
from proctor.ledger import Action, Actor
from proctor.runtime import Runtime, default_home

if TYPE_CHECKING:
    from proctor.client import Client
    from proctor.lifecycle import Interrupt

console = Console(highlight=False, soft_wrap=True)

HomeOpt = Annotated[
    Path | None,
    typer.Option(
        "--home",
        envvar="PROCTOR_HOME",
        help="Proctor home directory [default: ~/.proctor]",
        show_default=False,
    ),
]
TenantOpt = Annotated[
    str, typer.Option("--tenant", "-t", help="Tenant name ('system' for the runtime's log)")
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Machine-readable output")]


#: Set by ``proctor --server URL`` (or PROCTOR_SERVER): commands then go through the API.
REMOTE: dict[str, str | None] = {"url": None, "ca": None}
#: The homes this process opened: an unexpected error about a file inside one may be
#: a damaged home; about any other file, it is that file (proctor.cli.guarded).
OPENED: list[Path] = []


def open_runtime(home: Path | None) -> Runtime:
    if REMOTE["url"] is not None:
        raise UsageError(
            "this command works on a local Proctor home only; it has no --server form",
            hint="run it on the runtime's machine, or unset PROCTOR_SERVER",
        )
    OPENED.append(home or default_home())
    return Runtime.open(OPENED[-1])


#: What asks a command that runs something to end: Ctrl-C, kill, a closed terminal.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@contextmanager
def stop_on_signals() -> Iterator[Interrupt]:
    """While the block lasts, SIGINT, SIGTERM and SIGHUP set the returned event
    instead of ending the process, so that a run in progress is stopped, its
    sandbox removed and its end recorded before the command exits (with
    128 + the signal: see ``exit_if_interrupted``). Main thread only."""
    from proctor.lifecycle import Interrupt

    stop = Interrupt()
    previous = {s: signal.signal(s, lambda signum, _frame: stop.interrupt(signum))
                for s in STOP_SIGNALS}  # fmt: skip
    try:
        yield stop
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def exit_if_interrupted(stop: Interrupt) -> None:
    """Exit as a process ended by the signal would, by the shell's convention."""
    if stop.signum is not None:
        raise typer.Exit(128 + stop.signum)


def remote(token: str | None) -> Client | None:
    """The API client when ``--server`` is given, else None (work on the local home)."""
    url = REMOTE["url"]
    if url is None:
        return None
    if not token:
        raise UsageError(
            "--server needs a principal's token (--token or PROCTOR_TOKEN)",
            hint="the API serves principals; the local operator works on the local home",
        )
    # Here, not at the top: httpx is a tenth of a second a local command does without.
    from proctor.client import Client

    ca = REMOTE["ca"]
    return Client(url, token, verify=ca if ca else True)


def emit_json(doc: object) -> None:
    sys.stdout.write(json.dumps(doc, sort_keys=True, indent=2) + "\n")


def parse_time(value: str | None, flag: str) -> str | None:
    """An ISO 8601 date or time, as the ledger's fixed-width UTC string."""
    if value is None:
        return None
    if value == "now":
        return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    try:
        dt = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError as exc:
        raise UsageError(f"{flag}: {value!r} is not an ISO 8601 date or time") from exc
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=UTC)
    return dt.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


TokenOpt = Annotated[
    str | None,
    typer.Option(
        "--token",
        envvar="PROCTOR_TOKEN",
        help="Your principal's token [default: act as the local operator]",
        show_default=False,
    ),
]


def acting(rt: Runtime, token: str | None) -> tuple[Actor, Principal | None]:
    """Who is acting: the principal the token names, or the local operator."""
    if token:
        principal = rt.principals.authenticate(token)
        return principal.actor, principal
    return rt.operator, None


def authorize_read(rt: Runtime, token: str | None, tenant: str, action: str) -> None:
    """Reads are decided too: a principal sees only its own tenant (and only what its
    roles allow). The local operator owns the runtime and sees everything."""
    _, principal = acting(rt, token)
    if principal is None:
        return
    from proctor.policy import EntityRef

    # Each action applies to one entity type (the schema says which); "*" stands for
    # "all of them in this tenant", which the tenant parent makes decidable.
    resources: dict[str, EntityRef] = {
        Action.ARTIFACT_READ: EntityRef.artifact(tenant, "*"),
        Action.ARTIFACT_SUBMIT: EntityRef.artifact(tenant, "*"),
        Action.DEPLOYMENT_READ: EntityRef.deployment(tenant, "*"),
        Action.RUN_READ: EntityRef.workload(f"spiffe://{rt.config.trust_domain}/tenant/{tenant}/*"),
    }
    rt.control.authorize(
        principal,
        action,
        resources.get(action, EntityRef.tenant(tenant)),
        tenant,
        event_resource=f"tenant/{tenant}",
    )


# ---- the CLI convention (docs/cli.md), shared by every command ---------------------

WideOpt = Annotated[
    bool,
    typer.Option("--wide", help="Print tables at their full width instead of the terminal's"),
]


def emit_json_lines(doc: object) -> None:
    """One object of a live stream (``--json`` on a follow/tail command): one line each,
    flushed, so a reader sees it as it happens."""
    sys.stdout.write(json.dumps(doc, sort_keys=True) + "\n")
    sys.stdout.flush()


def make_table(*columns: str, ids: tuple[str, ...] = ()) -> Table:
    """A table for people. Columns named in ``ids`` (ids, digests, tokens, hosts) are
    never cut: they do not wrap, and on a terminal too narrow for them they fold onto
    the next line whole, so what a person copies from a table is an id that works.
    Everyone: build tables with this, print them with ``print_table``."""
    table = Table()
    for name in columns:
        if name in ids:
            table.add_column(name, no_wrap=True, overflow="fold", min_width=len(name))
        else:
            table.add_column(name, overflow="fold", min_width=min(len(name), 8))
    return table


def print_table(table: Table, wide: bool = False) -> None:
    """Print a table; with ``--wide`` at its natural width whatever the terminal's."""
    if wide:
        Console(highlight=False, soft_wrap=True, width=100_000).print(table)
        return
    # Rich crops whatever is wider than the terminal: where the id columns alone do
    # not fit, the table takes the width they need and the terminal wraps the lines.
    need = console.measure(table, options=console.options.update_width(100_000)).minimum
    if need > console.width:
        Console(highlight=False, soft_wrap=True, width=need).print(table)
    else:
        console.print(table)
