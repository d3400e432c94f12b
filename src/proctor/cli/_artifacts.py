"""``proctor artifact``: submit code with its manifest, show it, and review changes."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.markup import escape
from rich.table import Table

from proctor.cli._common import (
    HomeOpt,
    JsonOpt,
    TenantOpt,
    TokenOpt,
    acting,
    authorize_read,
    console,
    emit_json,
    open_runtime,
    remote,
)
from proctor.governance import Artifact, ArtifactDiff, Artifacts
from proctor.runtime import Runtime

artifact_app = typer.Typer(
    help="Artifacts: code and its manifest, content-addressed, for review and approval.",
    no_args_is_help=True,
)

DigestArg = Annotated[str, typer.Argument(help="sha256:<hex>, or a unique prefix of the hex")]


def _artifacts(rt: Runtime, token: str | None, tenant: str, action: str) -> Artifacts:
    """The runtime's artifacts, once Cedar has let the caller's principal do ``action``."""
    authorize_read(rt, token, tenant, action)
    return rt.artifacts


def _json(value: Any) -> None:
    sys.stdout.write(json.dumps(value, sort_keys=True) + "\n")


def _size(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f}".removesuffix(".0") + f" {unit}"
    return f"{n} B"


def _seconds(s: float) -> str:
    for unit, scale in (("d", 86400), ("h", 3600), ("m", 60)):
        if s >= scale and s % scale == 0:
            return f"{int(s // scale)}{unit}"
    return f"{s:g}s"


def _capability_lines(caps: dict[str, Any]) -> list[str]:
    lines = []
    for ds, spec in caps["datasets"].items():
        for table, grant in spec["tables"].items():
            lines.append(
                f"dataset {ds}, table {table}: {grant['access']} {', '.join(grant['columns'])}"
            )
    lines += [f"egress {host}" for host in caps["egress"]]
    lines += [f"secret {name}" for name in caps["secrets"]]
    lines += [f"bucket {name}: {access}" for name, access in caps["buckets"].items()]
    return lines or ["none (the code can reach nothing outside its sandbox)"]


def _print_artifact(a: Artifact) -> None:
    m = a.manifest
    console.print(f"[bold]{escape(a.name)}[/] {a.digest}")
    console.print(f"  tenant:       {escape(a.tenant)}")
    console.print(f"  purpose:      {escape(a.purpose)}")
    console.print(f"  entrypoint:   {escape(' '.join(m.entrypoint))}")
    console.print(f"  author:       {escape(a.author)}")
    console.print(f"  submitted:    {a.submitted_at}")
    console.print(f"  files:        {a.file_count} ({_size(a.size)})")
    console.print(f"  capabilities: {a.capabilities_hash}")
    for line in _capability_lines(a.capabilities):
        console.print(f"    {escape(line)}")
    limits = m.limits
    parts = []
    if limits.memory_bytes is not None:
        parts.append(f"memory {_size(limits.memory_bytes)}")
    if limits.wall_seconds is not None:
        parts.append(f"timeout {_seconds(limits.wall_seconds)}")
    if limits.pids is not None:
        parts.append(f"pids {limits.pids}")
    if limits.cpu is not None:
        parts.append(f"cpu {limits.cpu:g}")
    if limits.output_bytes is not None:
        parts.append(f"output {_size(limits.output_bytes)}")
    console.print(f"  limits:       {', '.join(parts) or 'runtime defaults'}")
    lc = m.lifecycle
    mode = lc.mode
    if lc.every_seconds is not None:
        mode += f" every {_seconds(lc.every_seconds)}"
    if lc.restart is not None:
        mode += f", restart {lc.restart}"
    console.print(f"  lifecycle:    {mode}")


@artifact_app.command("submit")
def artifact_submit(
    tenant: TenantOpt,
    directory: Annotated[Path, typer.Argument(help="The artifact's directory (with proctor.toml)")],
    as_json: JsonOpt = False,
    token: TokenOpt = None,
    home: HomeOpt = None,
) -> None:
    """Validate the manifest, store the files content-addressed, record the submission."""
    if (client := remote(token)) is not None:
        doc = client.submit_artifact(tenant, directory)
        if as_json:
            _json(doc)
        else:
            console.print(f"submitted to {escape(tenant)}")
            console.print(f"digest: {doc['digest']}")
        return
    with open_runtime(home) as rt:
        rt.tenants.get(tenant)
        author, _ = acting(rt, token)
        arts = _artifacts(rt, token, tenant, "artifact.submit")
        artifact = arts.submit(tenant, directory, author)
    if as_json:
        _json(artifact.to_json())
        return
    console.print(f"submitted [bold]{escape(artifact.name)}[/] to {escape(tenant)}")
    console.print(f"digest: {artifact.digest}")
    console.print(f"capabilities: {artifact.capabilities_hash}")
    for line in _capability_lines(artifact.capabilities):
        console.print(f"  {escape(line)}")


@artifact_app.command("show")
def artifact_show(
    tenant: TenantOpt,
    digest: DigestArg,
    files: Annotated[bool, typer.Option("--files", help="List the files too")] = False,
    as_json: JsonOpt = False,
    token: TokenOpt = None,
    home: HomeOpt = None,
) -> None:
    """An artifact's manifest: purpose, entrypoint, capabilities, limits, lifecycle."""
    if (client := remote(token)) is not None:
        emit_json(client.artifact(tenant, digest))
        return
    with open_runtime(home) as rt:
        arts = _artifacts(rt, token, tenant, "artifact.read")
        artifact = arts.get(tenant, digest)
        entries = arts.files(tenant, artifact.digest)
    if as_json:
        _json({**artifact.to_json(), "files": [f.to_json() for f in entries]})
        return
    _print_artifact(artifact)
    if files:
        table = Table("mode", "size", "path", "sha256")
        for f in entries:
            if f.link is not None:
                table.add_row("link", "", escape(f"{f.path} -> {f.link}"), "")
            else:
                table.add_row(f"{f.mode:04o}", str(f.size), escape(f.path), f.sha256[:16])
        console.print(table)


@artifact_app.command("list")
def artifact_list(
    tenant: TenantOpt, as_json: JsonOpt = False, token: TokenOpt = None, home: HomeOpt = None
) -> None:
    """The tenant's artifacts, oldest first."""
    if (client := remote(token)) is not None:
        emit_json(client.artifacts(tenant))
        return
    with open_runtime(home) as rt:
        rt.tenants.get(tenant)
        rows = _artifacts(rt, token, tenant, "artifact.read").list(tenant)
    if as_json:
        for a in rows:
            _json(a.to_json())
        return
    table = Table()
    for column in ("digest", "name", "files", "size", "submitted", "by"):
        table.add_column(column, no_wrap=True)
    # The purpose is the long one: it gives way first, cut rather than wrapped.
    table.add_column("purpose", no_wrap=True, overflow="ellipsis", max_width=32)
    for a in rows:
        table.add_row(
            a.digest[:19],
            escape(a.name),
            str(a.file_count),
            _size(a.size),
            a.submitted_at[:19],
            escape(a.author),
            escape(a.purpose),
        )
    console.print(table)


def _print_diff(d: ArtifactDiff) -> None:
    console.print(f"[bold]old[/] {d.old.digest} ({escape(d.old.name)}, {d.old.submitted_at})")
    console.print(f"[bold]new[/] {d.new.digest} ({escape(d.new.name)}, {d.new.submitted_at})")
    console.print()
    if d.same_capabilities and not d.capabilities:
        console.print("[bold]manifest[/]: unchanged")
    else:
        verdict = "[bold red]widened: the new version may do more[/]" if d.widens else "not widened"
        console.print(f"[bold]manifest[/]: {len(d.capabilities)} change(s), {verdict}")
        for c in d.capabilities:
            sign = {"added": "+", "removed": "-", "changed": "~"}[c.change]
            style = "red" if c.widens else "green" if c.change == "removed" else "yellow"
            if c.change == "changed":
                what = f"{escape(c.old or '')} -> {escape(c.new or '')}"
            else:
                what = escape((c.new if c.change == "added" else c.old) or "")
            mark = "  [bold red](widens)[/]" if c.widens else ""
            console.print(f"  [{style}]{sign} {c.area} {escape(c.subject)}[/]: {what}{mark}")
    console.print()
    if not d.files:
        console.print("[bold]code[/]: unchanged")
        return
    console.print(f"[bold]code[/]: {len(d.files)} file(s) changed")
    for f in d.files:
        old, new = f.old, f.new
        detail = ""
        if old is not None and new is not None:
            if old.link is not None or new.link is not None:
                detail = f"link {old.link or '(file)'} -> {new.link or '(file)'}"
            elif old.sha256 == new.sha256:
                detail = f"mode {old.mode:04o} -> {new.mode:04o}"
            else:
                detail = f"{old.size} -> {new.size} bytes"
                if old.mode != new.mode:
                    detail += f", mode {old.mode:04o} -> {new.mode:04o}"
        elif new is not None:
            detail = f"link -> {new.link}" if new.link else f"{new.size} bytes"
        elif old is not None:
            detail = f"link -> {old.link}" if old.link else f"{old.size} bytes"
        if f.binary:
            detail += ", binary"
        console.print(f"  {f.change:8} {escape(f.path)} ({escape(detail)})")
    for f in d.files:
        if f.diff:
            console.print()
            for line in f.diff.splitlines():
                style = (
                    "bold"
                    if line.startswith(("---", "+++"))
                    else "green"
                    if line.startswith("+")
                    else "red"
                    if line.startswith("-")
                    else "cyan"
                    if line.startswith("@@")
                    else ""
                )
                text = escape(line)
                console.print(f"[{style}]{text}[/]" if style else text)


@artifact_app.command("diff")
def artifact_diff(
    tenant: TenantOpt,
    old: Annotated[str, typer.Argument(help="The approved (older) artifact's digest")],
    new: Annotated[str, typer.Argument(help="The newer artifact's digest")],
    as_json: JsonOpt = False,
    token: TokenOpt = None,
    home: HomeOpt = None,
) -> None:
    """What changed: capabilities first (what an approver must see), then the code."""
    if (client := remote(token)) is not None:
        emit_json(client.diff(tenant, old, new))
        return
    with open_runtime(home) as rt:
        d = _artifacts(rt, token, tenant, "artifact.read").diff(tenant, old, new)
    if as_json:
        _json(d.to_json())
        return
    _print_diff(d)
