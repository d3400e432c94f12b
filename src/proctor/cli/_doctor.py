"""`proctor doctor`: the readiness checks of a home, each failure with its fix."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.markup import escape

from proctor.cli._common import HomeOpt, JsonOpt, console, emit_json, open_runtime


def doctor(
    backend: Annotated[
        str | None,
        typer.Option(
            help="The sandbox backend serve uses: gvisor or bubblewrap "
            "[default: the first that works]"
        ),
    ] = None,
    as_json: JsonOpt = False,
    home: HomeOpt = None,
) -> None:
    """Check that this home can serve: the store writes, the ledger appends, the sandbox
    backend starts (a real sandbox is started), every witnessed tenant's log is within
    its max age, the keys load. Each check OK or FAIL, a failure with its reason, what
    was found (files, tenants, errors) and the fix; exit 1 when any fails. The same
    checks as the API's /readyz, which names no tenant, file or error."""
    from proctor.lifecycle import Health
    from proctor.sandbox import get_driver

    if backend is not None:
        get_driver(backend)  # a name that is none is a usage error before the home opens
    with open_runtime(home) as rt:
        # Every check now, nothing kept: a real sandbox start and fresh witness tables.
        result = Health(rt, driver=backend, sandbox_every=0, witness_every=0,
                        shared_for=0).check()  # fmt: skip
    if as_json:
        emit_json({**result.as_json(private=True), "ready": result.ready})
    else:
        width = max(len(c.name) for c in result.checks)
        for c in result.checks:
            mark = "[green]OK  [/]" if c.ok else "[red]FAIL[/]"
            said = escape(c.detail if c.ok else c.reason or c.detail)
            console.print(f"{c.name:<{width}}  {mark}  {said}")
            pad = " " * (width + 8)
            for note in c.notes if not c.ok else ():
                console.print(f"{pad}{note}", markup=False)
            if not c.ok and c.fix:
                console.print(f"{pad}fix: {c.fix}", markup=False)
        console.print("ready" if result.ready else
                      f"not ready: {len(result.failing)} check(s) failed")  # fmt: skip
    if not result.ready:
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    """Add the commands to ``app``."""
    app.command("doctor")(doctor)
