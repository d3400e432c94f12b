"""``proctor sandbox``: the ephemeral mode, for the build loop.

A run here is throwaway (synthetic data, no broker), but it is still recorded
(``proctor.lifecycle.Throwaway``): this module only reads the options and
streams the output.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from proctor.cli._common import (
    HomeOpt,
    JsonOpt,
    WideOpt,
    emit_json,
    exit_if_interrupted,
    make_table,
    open_runtime,
    print_table,
    stop_on_signals,
)
from proctor.cli._units import parse_duration, parse_size
from proctor.errors import UsageError

sandbox_app = typer.Typer(
    help="Ephemeral sandboxes for the build loop (recorded, but not governed).",
    no_args_is_help=True,
)


@sandbox_app.command("backends")
def list_backends(as_json: JsonOpt = False, wide: WideOpt = False) -> None:
    """Which sandbox drivers work on this machine, and why the others do not."""
    from proctor.sandbox import backends  # here: a command that runs no sandbox does without

    found = backends()
    if as_json:
        emit_json([{"name": s.name, "available": s.available, "reason": s.reason} for s in found])
        return
    table = make_table("backend", "works", "why")
    for status in found:
        works = "[green]yes[/]" if status.available else "[red]no[/]"
        table.add_row(status.name, works, status.reason)
    print_table(table, wide)


@sandbox_app.command(
    "run", context_settings={"allow_extra_args": True, "ignore_unknown_options": True}
)
def run(
    command: Annotated[list[str], typer.Argument(help="The program and its arguments, after --")],
    backend: Annotated[
        str | None, typer.Option(help="gvisor or bubblewrap [default: the first that works]")
    ] = None,
    memory: Annotated[str, typer.Option(help="Memory limit, e.g. 256M")] = "256M",
    timeout: Annotated[str, typer.Option(help="Wall-clock limit, e.g. 30s")] = "30s",
    pids: Annotated[int, typer.Option(help="Most processes at once")] = 64,
    cpu: Annotated[float, typer.Option(help="CPU share, in CPUs")] = 1.0,
    output: Annotated[str, typer.Option(help="Cap on stdout+stderr")] = "16M",
    scratch: Annotated[str, typer.Option(help="Size of the scratch tmpfs at /tmp")] = "64M",
    directory: Annotated[
        Path | None, typer.Option("--dir", help="Code directory, mounted read-only at /code")
    ] = None,
    env: Annotated[
        list[str] | None, typer.Option("--env", "-e", help="KEY=VALUE for the guest")
    ] = None,
    as_json: Annotated[
        bool,
        typer.Option(
            "--json",
            help="One JSON object on stdout at the end; the program's output goes to stderr",
        ),
    ] = False,
    home: HomeOpt = None,
) -> None:
    """Run CMD in a throwaway sandbox; stream its output; exit with its exit code."""
    # Here: the other commands do without the sandbox drivers and the lifecycle.
    from proctor.lifecycle import Throwaway
    from proctor.sandbox import Limits, Reason, SandboxSpec, get_driver

    limits = Limits(
        memory_bytes=parse_size(memory, "--memory"),
        pids=pids,
        cpu=cpu,
        wall_seconds=parse_duration(timeout, "--timeout"),
        output_bytes=parse_size(output, "--output"),
    )
    guest_env: dict[str, str] = {}
    for item in env or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise UsageError(f"--env: {item!r} is not KEY=VALUE")
        guest_env[key] = value
    if directory is not None and not directory.is_dir():
        raise UsageError(f"--dir: {directory} is not a directory")
    spec = SandboxSpec(
        argv=tuple(command),
        code_dir=directory.resolve() if directory else None,
        env=guest_env,
        scratch_bytes=parse_size(scratch, "--scratch"),
        limits=limits,
        cwd="/code" if directory else None,
    )
    driver = get_driver(backend)
    # A signal stops the sandbox (removed, like any run's) and is recorded as the
    # end, rather than killing this process and leaving the sandbox running.
    with stop_on_signals() as stop, open_runtime(home) as rt:
        throwaway = Throwaway.start(rt, driver, spec, directory)
        # With --json stdout is the JSON object's alone: the program's stdout moves to stderr.
        out = sys.stderr.buffer if as_json else sys.stdout.buffer
        err = sys.stderr.buffer

        def to_out(data: bytes) -> None:
            out.write(data)
            out.flush()

        def to_err(data: bytes) -> None:
            err.write(data)
            err.flush()

        exit_if_interrupted(stop)
        result = throwaway.run(on_stdout=to_out, on_stderr=to_err, stop=stop)
        if stop.reason is not None:
            print(f"sandbox: interrupted by {stop.reason}", file=sys.stderr)
            exit_if_interrupted(stop)
    if result.reason is not Reason.EXIT:
        console_err = f"sandbox: stopped by {result.reason.value} (exit {result.exit_code})"
        print(console_err, file=sys.stderr)
    if as_json:
        emit_json({"run": result.run_id, "backend": result.backend,
                   "exit_code": result.exit_code, "reason": result.reason.value,
                   "duration_seconds": result.duration_seconds,
                   "stdout_bytes": result.stdout_bytes, "stderr_bytes": result.stderr_bytes,
                   "truncated": result.truncated,
                   "memory_peak_bytes": result.memory_peak_bytes})  # fmt: skip
    raise typer.Exit(result.exit_code)
