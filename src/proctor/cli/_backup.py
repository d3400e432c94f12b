"""`proctor backup`, `proctor backup verify` and `proctor restore`: a home copied
consistently while it runs, checked offline, and made a working home again."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape

from proctor.cli._common import HomeOpt, JsonOpt, console, emit_json
from proctor.errors import UsageError

backup_app = typer.Typer(
    no_args_is_help=False,
    help="Back a home up while it runs: `proctor backup -o DIR` copies the store "
    "consistently (SQLite's online backup, or pg_dump of a snapshot), each log's newest "
    "signed checkpoint, the configuration, keys, blobs, buckets and run outputs, with a "
    "manifest of their SHA-256 signed by the home's checkpoint key. The backup holds the "
    "home's private keys: keep it as you keep the home. `proctor backup verify DIR` "
    "checks one offline.",
)

KeyOpt = Annotated[
    str | None,
    typer.Option(
        "--key",
        help="The verifier key you trust (`proctor key show`, kept apart from the backup): "
        "the backup must be signed by it (without it, the backup's own key is trusted)",
    ),
]


@backup_app.callback(invoke_without_command=True)
def backup(
    ctx: typer.Context,
    out: Annotated[
        Path | None,
        typer.Option("--out", "-o", help="The new (or empty) directory the backup goes into"),
    ] = None,
    no_keys: Annotated[
        bool,
        typer.Option(
            "--no-keys",
            help="Leave the home's private keys out: a backup for auditors, which verifies "
            "but does not restore",
        ),
    ] = False,
    as_json: JsonOpt = False,
    home: HomeOpt = None,
) -> None:
    """Copy the home consistently while it runs: the store (SQLite's online backup, or
    pg_dump of a snapshot), each log's newest signed checkpoint, the configuration,
    keys, blobs, buckets and run outputs, and a signed manifest of their SHA-256."""
    if ctx.invoked_subcommand is not None:
        return
    if out is None:
        raise UsageError("give the directory the backup goes into: proctor backup -o DIR",
                         hint="or check one: proctor backup verify DIR")  # fmt: skip
    from proctor.backup import take_backup
    from proctor.runtime import default_home

    where = home or default_home()
    m = take_backup(where, out, keys=not no_keys)
    size = sum(f.size for f in m.files.values())
    if as_json:
        emit_json({"directory": str(out), "created": m.created, "engine": m.engine,
                   "keys": m.keys, "files": len(m.files), "bytes": size,
                   "logs": {log: {"size": p.size} for log, p in sorted(m.logs.items())},
                   "skipped": m.skipped, "verifier_key": m.verifier_key})  # fmt: skip
        return
    logs = ", ".join(f"{escape(log)} at {p.size}" for log, p in sorted(m.logs.items()))
    console.print(
        f"[green]backed up[/] {escape(str(where))} to {escape(str(out))}: {len(m.files)} files, "
        f"{size} bytes, {m.engine} store; logs {logs}"
    )
    for s in m.skipped:
        console.print(f"[yellow]not in the backup[/] {escape(s)}")
    if m.keys:
        console.print(
            "[yellow]this backup holds the home's private keys[/]: keep it as you keep the home"
        )
    console.print(
        f"check it with: proctor backup verify {escape(str(out))} --key '{m.verifier_key}'"
    )


@backup_app.command("verify")
def verify(
    directory: Annotated[Path, typer.Argument(help="The backup's directory")],
    key: KeyOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Check a backup offline, with no home: the manifest's signature, every file's
    SHA-256, each log's checkpoint, and the store copy's ledger up to it."""
    from proctor.backup import verify_backup

    report = verify_backup(directory, key)
    if as_json:
        emit_json(report.as_json())
        return
    m = report.manifest
    for log, size in sorted(report.logs.items()):
        console.print(f"[green]verified[/] log {escape(log)}: {size} events, up to its checkpoint")
    console.print(
        f"[green]verified[/] backup of {m.created} ({m.engine} store, Proctor {m.version}): "
        f"{report.files} files, {report.bytes} bytes, every SHA-256 the signed manifest's"
    )
    if not key:
        console.print(
            f"[yellow]checked against the backup's own key[/] {escape(m.verifier_key)}: "
            "give --key with the key you trust to catch a backup signed again"
        )
    if not m.keys:
        console.print("[yellow]made without the home's keys[/] (--no-keys): it does not restore")


def register(app: typer.Typer) -> None:
    """Add the commands to ``app``."""
    app.add_typer(backup_app, name="backup")

    @app.command("restore")
    def restore(
        directory: Annotated[Path, typer.Argument(help="The backup's directory")],
        new_home: Annotated[
            Path,
            typer.Option("--home", help="The new home: a new or empty directory"),
        ],
        store: Annotated[
            str | None,
            typer.Option(
                "--store",
                help="A PostgreSQL home's new, empty database (postgresql://…); a SQLite "
                "home's store is a file of the new home",
            ),
        ] = None,
        key: KeyOpt = None,
        as_json: JsonOpt = False,
    ) -> None:
        """Make a working home from a backup: verified first, then every path its own
        (never the original's store)."""
        from proctor.backup import restore_backup

        report = restore_backup(directory, new_home, key=key, store=store)
        if as_json:
            emit_json(report.as_json())
            return
        logs = ", ".join(f"{escape(log)} at {n}" for log, n in sorted(report.backup.logs.items()))
        console.print(
            f"[green]restored[/] {escape(str(directory))} to {escape(str(new_home))} "
            f"(store {escape(report.store)}): logs {logs}, verified"
        )
        console.print(
            "[yellow]the witnesses may have cosigned more of the original's logs[/]: "
            "`proctor audit verify -t T --witness KEY` says how far behind this home is"
        )
