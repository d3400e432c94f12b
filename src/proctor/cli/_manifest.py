"""`proctor manifest suggest`: the least-privilege manifest a sandbox run called for."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.markup import escape

from proctor.cli._common import (
    HomeOpt,
    JsonOpt,
    TenantOpt,
    TokenOpt,
    console,
    emit_json,
    open_runtime,
    remote,
)
from proctor.errors import UsageError

manifest_app = typer.Typer(
    help="Manifests: the least-privilege one a run's calls called for.", no_args_is_help=True
)


@manifest_app.command("suggest")
def suggest_cmd(
    run: Annotated[
        str, typer.Option("--run", help="The run whose calls to learn from (any unique prefix)")
    ],
    tenant: TenantOpt,
    output: Annotated[
        Path | None,
        typer.Option(
            "--output", "-o", help="Also write the suggested proctor.toml to this new file"
        ),
    ] = None,
    as_json: JsonOpt = False,
    token: TokenOpt = None,
    home: HomeOpt = None,
) -> None:
    """The manifest that would have allowed exactly the calls a run made and the
    refusals it met: the tables and columns read and written, the hosts called, the
    buckets and modes, the secrets injected; shown as a diff against its artifact's
    manifest, each added or removed line with the event that needed it (or "no call
    of this run used it"), then the refusals no manifest line lifts, with why. A read
    of the run's events, decided and recorded as `runs show`'s is."""
    if output is not None and output.exists():
        raise UsageError(f"{output} exists already", hint="give a new file: nothing is overwritten")
    if (client := remote(token)) is not None:
        doc = client.suggest_manifest(tenant, run)
    else:
        from proctor.cli._audit import authorize_events
        from proctor.governance import suggest_for
        from proctor.lifecycle import Runs

        with open_runtime(home) as rt:
            full = authorize_events(rt, token, tenant, run)
            assert full is not None
            doc = suggest_for(rt, Runs(rt).get(tenant, full)).to_json()
    if output is not None:
        try:
            with output.open("x", encoding="utf-8") as f:
                f.write(doc["manifest"])
        except OSError as exc:
            raise UsageError(f"cannot write {output}: {exc.strerror}") from None
    if as_json:
        emit_json(doc)
        return
    _print(doc, output)


def _print(doc: dict[str, Any], output: Path | None) -> None:
    added = sum(1 for x in doc["lines"] if x["change"] == "added")
    removed = len(doc["lines"]) - added
    refused = len(doc["not_suggestable"])
    console.print(
        escape(
            f"run {doc['run']} ({doc['environment']}, {doc['status']}) of {doc['digest']}: "
            f"{added} line(s) added, {removed} removable, {refused} refusal(s) no manifest lifts"
        )
    )
    for note in doc["notes"]:
        console.print(f"[yellow]note:[/] {escape(note)}")
    if not doc["diff"]:
        console.print("the submitted manifest is already what the run's calls used")
    else:
        sys.stdout.write(doc["diff"])
        console.print("\n[bold]why each line[/]")
        for x in doc["lines"]:
            sign = "+" if x["change"] == "added" else "-"
            seq = f"seq {x['seq']}: " if x["seq"] is not None else ""
            line = x["line"].strip()
            where = "" if line == f"[{x['where']}]" else f"  [{x['where']}]"
            console.print(escape(f"  {sign} {line}{where}  {seq}{x['reason']}"))
    if doc["not_suggestable"]:
        console.print("\n[bold]not suggestable[/] (no manifest line lifts these refusals)")
        for u in doc["not_suggestable"]:
            console.print(escape(f"  seq {u['seq']} {u['action']} {u['resource']}: {u['why']}"))
    if output is not None:
        console.print(escape(f"wrote the suggested manifest to {output}"))


def register(app: typer.Typer) -> None:
    """Add the commands to ``app``."""
    app.add_typer(manifest_app, name="manifest")
