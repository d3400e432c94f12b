"""``proctor artifact``: submit code with its manifest, show it, and review changes."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import sys
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, BinaryIO

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
from proctor.errors import NotFound, UsageError
from proctor.governance import (
    Artifact,
    Artifacts,
    Manifest,
    approved_predecessor,
    predecessor_of,
    standing_approvals,
)
from proctor.ledger import Action
from proctor.runtime import Runtime

if TYPE_CHECKING:
    from proctor.client import Client

artifact_app = typer.Typer(
    help="Artifacts: code and its manifest, content-addressed, for review and approval.",
    no_args_is_help=True,
)

DigestArg = Annotated[str, typer.Argument(help="sha256:<hex>, or a unique prefix of the hex")]


def _artifacts(rt: Runtime, token: str | None, tenant: str, action: str) -> Artifacts:
    """The runtime's artifacts, once Cedar has let the caller's principal do ``action``."""
    authorize_read(rt, token, tenant, action)
    return rt.artifacts


#: Characters that change what a terminal shows without being seen: C0/C1 controls
#: (an escape sequence can hide or rewrite lines) and the bidirectional overrides of
#: "Trojan Source" (CVE-2021-42574). An approver is shown them, never their effect.
_BIDI = frozenset("\u061c\u200e\u200f\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069")


def _visible(text: str) -> str:
    """``text`` with every invisible or terminal-controlling character spelled out."""
    if text.isprintable() and not _BIDI.intersection(text):
        return text
    out = []
    for ch in text:
        if ch == "\t" or (ch.isprintable() and ch not in _BIDI):
            out.append(ch)
        else:
            out.append(f"\\x{ord(ch):02x}" if ord(ch) < 0x100 else f"\\u{ord(ch):04x}")
    return "".join(out)


def _shown(text: str) -> str:
    """Text of an artifact for a terminal: controls spelled out, Rich markup escaped."""
    return escape(_visible(text))


MaybeTenantOpt = Annotated[
    str | None,
    typer.Option(
        "--tenant",
        "-t",
        help="The artifact's tenant [default: your token's; for the local operator, the one"
        " tenant that has the digest]",
        show_default=False,
    ),
]


def _local_tenant(rt: Runtime, token: str | None, tenant: str | None, digest: str) -> str:
    """The tenant given, else the principal's own, else (for the local operator, who
    sees every tenant) the one tenant with an artifact of this digest or prefix."""
    if tenant is not None:
        return tenant
    _, principal = acting(rt, token)
    if principal is not None:
        return principal.tenant
    found = []
    for t in rt.tenants.list():
        try:
            rt.artifacts.get(t.name, digest)
        except NotFound:
            continue
        found.append(t.name)
    if len(found) == 1:
        return found[0]
    where = f"several tenants ({', '.join(found)})" if found else "no tenant"
    raise UsageError(f"{digest!r} names an artifact in {where}", hint="pass --tenant")


def _remote_tenant(client: Client, tenant: str | None) -> str:
    return tenant if tenant is not None else str(client.whoami()["tenant"])


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
    console.print(f"[bold]{_shown(a.name)}[/] {a.digest}")
    console.print(f"  tenant:       {_shown(a.tenant)}")
    console.print(f"  purpose:      {_shown(a.purpose)}")
    console.print(f"  entrypoint:   {_shown(' '.join(m.entrypoint))}")
    console.print(f"  author:       {_shown(a.author)}")
    console.print(f"  submitted:    {a.submitted_at}")
    console.print(f"  files:        {a.file_count} ({_size(a.size)})")
    console.print(f"  capabilities: {a.capabilities_hash}")
    for line in _capability_lines(a.capabilities):
        console.print(f"    {_shown(line)}")
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
        warnings = doc.pop("warnings", [])
        _print_warnings((str(w["message"]), str(w["fix"])) for w in warnings)
        if as_json:
            _json(doc)
        else:
            console.print(f"submitted to {_shown(tenant)}")
            console.print(f"digest: {doc['digest']}")
        return
    with open_runtime(home) as rt:
        rt.tenants.get(tenant)
        author, _ = acting(rt, token)
        arts = _artifacts(rt, token, tenant, Action.ARTIFACT_SUBMIT)
        artifact = arts.submit(tenant, directory, author)
        _warn_not_ready(rt, tenant, artifact.capabilities)
    if as_json:
        _json(artifact.to_json())
        return
    console.print(f"submitted [bold]{_shown(artifact.name)}[/] to {_shown(tenant)}")
    console.print(f"digest: {artifact.digest}")
    console.print(f"capabilities: {artifact.capabilities_hash}")
    for line in _capability_lines(artifact.capabilities):
        console.print(f"  {_shown(line)}")


@artifact_app.command("show")
def artifact_show(
    digest: DigestArg,
    files: Annotated[bool, typer.Option("--files", help="List the files too")] = False,
    tenant: MaybeTenantOpt = None,
    as_json: JsonOpt = False,
    wide: WideOpt = False,
    token: TokenOpt = None,
    home: HomeOpt = None,
) -> None:
    """An artifact's manifest: purpose, entrypoint, capabilities, limits, lifecycle."""
    if (client := remote(token)) is not None:
        doc: dict[str, Any] = client.artifact(_remote_tenant(client, tenant), digest)
    else:
        with open_runtime(home) as rt:
            t = _local_tenant(rt, token, tenant, digest)
            arts = _artifacts(rt, token, t, Action.ARTIFACT_READ)
            artifact = arts.get(t, digest)
            entries = arts.files(t, artifact.digest)
        doc = {**artifact.to_json(), "files": [f.to_json() for f in entries]}
    if as_json:
        emit_json(doc)
        return
    _print_artifact(_from_json(doc))
    if files:
        table = make_table("mode", "size", "path", "sha256", ids=("path", "sha256"))
        for f in doc["files"]:
            if f.get("link") is not None:
                table.add_row("link", "", _shown(f"{f['path']} -> {f['link']}"), "")
            else:
                table.add_row(f"{f['mode']:04o}", str(f["size"]), _shown(f["path"]), f["sha256"])
        print_table(table, wide)


def _from_json(doc: dict[str, Any]) -> Artifact:
    manifest = Manifest.from_json(doc["manifest"])
    return Artifact(
        doc["tenant"], doc["digest"], doc["name"], manifest, manifest.capabilities,
        doc["capabilities_hash"], doc["purpose"], doc["author"], doc["submitted_at"],
        doc["size"], doc["file_count"],
    )  # fmt: skip


@artifact_app.command("list")
def artifact_list(
    tenant: TenantOpt,
    as_json: JsonOpt = False,
    wide: WideOpt = False,
    token: TokenOpt = None,
    home: HomeOpt = None,
) -> None:
    """The tenant's artifacts, oldest first."""
    rows, approvals = _artifacts_and_approvals(tenant, token, home)
    for a in rows:
        a["approved"] = bool(standing_approvals(approvals, a))
    if as_json:
        emit_json(rows)
        return
    table = make_table("digest", "name", "approved", "files", "size", "submitted", "by",
                       "purpose", ids=("digest",))  # fmt: skip
    for a in rows:
        table.add_row(a["digest"], _shown(a["name"]),
                      "[green]approved[/]" if a["approved"] else "", str(a["file_count"]),
                      _size(a["size"]), a["submitted_at"][:19], _shown(a["author"]),
                      _shown(a["purpose"]))  # fmt: skip
    print_table(table, wide)


def _artifacts_and_approvals(
    tenant: str, token: str | None, home: Path | None
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The tenant's artifacts (oldest first) and every approval and rejection of them."""
    if (client := remote(token)) is not None:
        return list(client.artifacts(tenant)), list(client.approvals(tenant))
    with open_runtime(home) as rt:
        rt.tenants.get(tenant)
        found = _artifacts(rt, token, tenant, Action.ARTIFACT_READ).list(tenant)
        approvals = [
            ap.as_json() for a in found for ap in rt.approvals.for_artifact(tenant, a.digest)
        ]
        return [a.to_json() for a in found], approvals


def print_diff(d: dict[str, Any]) -> None:
    """The review view of a diff (its JSON form, so that a local home and ``--server``
    print alike): the capability changes in words first, then every file with its content."""
    console.print(f"[bold]old[/] {d['old']}")
    console.print(f"[bold]new[/] {d['new']}")
    console.print()
    caps = d["capabilities"]
    if d["same_capabilities"] and not caps:
        console.print("[bold]manifest[/]: unchanged")
    else:
        verdict = (
            "[bold red]widened: the new version may do more[/]" if d["widens"] else "not widened"
        )
        console.print(f"[bold]manifest[/]: {len(caps)} change(s), {verdict}")
        for c in caps:
            sign = {"added": "+", "removed": "-", "changed": "~"}[c["change"]]
            style = "red" if c["widens"] else "green" if c["change"] == "removed" else "yellow"
            mark = "  [bold red](widens)[/]" if c["widens"] else ""
            console.print(f"  [{style}]{sign} {_shown(c['text'])}[/]{mark}")
    console.print()
    files = d["files"]
    if not files:
        console.print("[bold]code[/]: unchanged")
        return
    counts = {k: sum(f["change"] == k for f in files) for k in ("modified", "added", "removed")}
    console.print(
        f"[bold]code[/]: {counts['modified']} changed, {counts['added']} added,"
        f" {counts['removed']} removed"
    )
    for f in files:
        console.print(f"  {f['change']:8} {_shown(f['path'])} ({_shown(f['summary'])})")
    for f in files:
        console.print()
        console.print(f"[bold]{f['change']} {_shown(f['path'])}[/]: {_shown(f['summary'])}")
        for line in (f["diff"] or "").removesuffix("\n").split("\n") if f["diff"] else []:
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
            text = _shown(line)
            console.print(f"[{style}]{text}[/]" if style else text)


@artifact_app.command("diff")
def artifact_diff(
    old: Annotated[str, typer.Argument(help="The approved (older) artifact's digest")],
    new: Annotated[str, typer.Argument(help="The newer artifact's digest")],
    tenant: MaybeTenantOpt = None,
    as_json: JsonOpt = False,
    token: TokenOpt = None,
    home: HomeOpt = None,
) -> None:
    """What changed: the capability changes in words first (what an approver must see),
    then every changed, added and removed file with its content (a unified diff for
    text; size and sha256 for binary)."""
    if (client := remote(token)) is not None:
        doc = client.diff(_remote_tenant(client, tenant), old, new)
    else:
        with open_runtime(home) as rt:
            t = _local_tenant(rt, token, tenant, old)
            doc = _artifacts(rt, token, t, Action.ARTIFACT_READ).diff(t, old, new).to_json()
    if as_json:
        emit_json(doc)
        return
    print_diff(doc)


PathArg = Annotated[
    str, typer.Argument(help="A file's path as `artifact show --files` lists it, e.g. lib/util.py")
]


def visible_text(data: bytes) -> str:
    """``data`` as a terminal may show it: on a terminal the bytes would act, not show (an
    escape sequence in the code can hide lines from the person reading it), so control
    and bidirectional characters are spelled out, with a warning; exact when piped."""
    text = data.decode("utf-8", errors="backslashreplace")
    lines = [_visible(line) for line in text.split("\n")]
    if lines != text.split("\n"):
        Console(stderr=True, highlight=False).print(
            "[yellow]warning:[/] the file holds control or bidirectional characters,"
            " shown here as \\xNN / \\uNNNN; pipe or redirect stdout for the exact bytes"
        )
    return "\n".join(lines)


@artifact_app.command("cat")
def artifact_cat(
    digest: DigestArg,
    path: PathArg,
    tenant: MaybeTenantOpt = None,
    token: TokenOpt = None,
    home: HomeOpt = None,
) -> None:
    """Write the exact bytes of one file of the artifact to stdout (binary-safe)."""
    if (client := remote(token)) is not None:
        data = client.artifact_file(_remote_tenant(client, tenant), digest, path)
    else:
        with open_runtime(home) as rt:
            t = _local_tenant(rt, token, tenant, digest)
            data = _artifacts(rt, token, t, Action.ARTIFACT_READ).read_file(t, digest, path)
    if sys.stdout.isatty():
        data = visible_text(data).encode()
    sys.stdout.flush()
    sys.stdout.buffer.write(data)
    sys.stdout.buffer.flush()


@artifact_app.command("download")
def artifact_download(
    digest: DigestArg,
    output: Annotated[
        Path, typer.Option("--output", "-o", help="The tar file to write (replaced if it exists)")
    ],
    tenant: MaybeTenantOpt = None,
    as_json: JsonOpt = False,
    token: TokenOpt = None,
    home: HomeOpt = None,
) -> None:
    """Write the artifact's exact tree as a tar: submitting what it extracts to gives
    the same digest. With -o -, the tar goes to stdout."""
    if str(output) == "-":
        if as_json:
            raise UsageError(
                "with -o -, stdout carries the tar; --json needs -o FILE",
                hint="`proctor artifact show --files --json` lists the files and digests",
            )
        # Spooled first, so a refusal or failure midway leaves stdout empty, not a torn tar.
        with tempfile.TemporaryFile() as spool:
            _write_artifact_tar(digest, tenant, token, home, spool)
            spool.seek(0)
            shutil.copyfileobj(spool, sys.stdout.buffer)
        sys.stdout.buffer.flush()
        return
    if output.is_dir():
        raise UsageError(
            f"{output} is a directory", hint="give the tar file's name, e.g. -o job.tar"
        )
    tmp = output.with_name(f".{output.name}.{secrets.token_hex(4)}.part")
    try:
        with tmp.open("wb") as out:
            full = _write_artifact_tar(digest, tenant, token, home, out)
        size = tmp.stat().st_size
        os.replace(tmp, output)
    finally:
        tmp.unlink(missing_ok=True)
    if as_json:
        emit_json({"digest": full, "path": str(output), "bytes": size})
        return
    console.print(f"wrote {_shown(str(output))} ({_size(size)}), the tree of {full}")


def _write_artifact_tar(
    digest: str, tenant: str | None, token: str | None, home: Path | None, out: BinaryIO
) -> str:
    if (client := remote(token)) is not None:
        return client.download_artifact(_remote_tenant(client, tenant), digest, out)
    with open_runtime(home) as rt:
        t = _local_tenant(rt, token, tenant, digest)
        return _artifacts(rt, token, t, Action.ARTIFACT_READ).write_tar(t, digest, out).digest


@artifact_app.command("review")
def artifact_review(
    digest: DigestArg,
    tenant: MaybeTenantOpt = None,
    show_diff: Annotated[
        bool,
        typer.Option(
            "--diff", help="Also what changed since the approved version of the same name"
        ),
    ] = False,
    as_json: JsonOpt = False,
    token: TokenOpt = None,
    home: HomeOpt = None,
) -> None:
    """What `proctor approve` shows before it asks: the capabilities in words, the
    purpose, the files, what the sandbox runs of this digest did (calls, refusals), and
    the approved version of the same name it follows (--diff: what changed since)."""
    doc = review(tenant, digest, token, home)
    before = doc.get("approved_predecessor")
    changes = None
    if show_diff and before is not None:
        changes = _diff_doc(doc["tenant"], before["digest"], doc["digest"], token, home)
    if as_json:
        emit_json({**doc, **({"diff": changes} if changes is not None else {})})
        return
    print_review(doc)
    if changes is not None:
        console.print()
        print_diff(changes)


def _diff_doc(
    tenant: str, old: str, new: str, token: str | None, home: Path | None
) -> dict[str, Any]:
    if (client := remote(token)) is not None:
        return dict(client.diff(tenant, old, new))
    with open_runtime(home) as rt:
        return _artifacts(rt, token, tenant, Action.ARTIFACT_READ).diff(tenant, old, new).to_json()


def review(tenant: str | None, digest: str, token: str | None, home: Path | None) -> dict[str, Any]:
    """The review of one artifact, from the local home or through ``--server``."""
    if (client := remote(token)) is not None:
        doc: dict[str, Any] = client.review(_remote_tenant(client, tenant), digest)
    else:
        with open_runtime(home) as rt:
            t = _local_tenant(rt, token, tenant, digest)
            doc = _artifacts(rt, token, t, Action.ARTIFACT_READ).review(t, digest)
            doc["approvals"] = [a.as_json() for a in rt.approvals.for_artifact(t, doc["digest"])]
            doc["approved_predecessor"] = predecessor_of(rt.artifacts, rt.approvals, t, doc)
    if "approved_predecessor" not in doc:
        # The approver's first question about a new version: what was approved before
        # it (a server of an earlier version does not say; ask it the same way).
        artifacts, approvals = _artifacts_and_approvals(doc["tenant"], token, home)
        doc["approved_predecessor"] = approved_predecessor(doc, artifacts, approvals)
    return doc


def print_review(doc: dict[str, Any], out: Console | None = None) -> None:
    """The review for people; ``out`` is stderr when stdout carries JSON."""
    c = out or console
    c.print(f"[bold]{_shown(doc['name'])}[/] {doc['digest']}")
    c.print(f"  purpose:    {_shown(doc['purpose'])}")
    c.print(f"  entrypoint: {_shown(' '.join(doc['manifest']['entrypoint']))}")
    c.print(f"  author:     {_shown(doc['author'])}, submitted {doc['submitted_at']}")
    c.print("  the code may use:")
    for line in doc["capabilities_words"]:
        c.print(f"    - {_shown(line)}")
    c.print(f"  files ({len(doc['files'])}, {_size(doc['size'])}):")
    for f in doc["files"]:
        if f.get("link") is not None:
            c.print(f"    link {_shown(f['path'])} -> {_shown(f['link'])}")
        else:
            c.print(f"    {f['mode']:04o} {f['size']:>9} {_shown(f['path'])}  sha256 {f['sha256']}")
    c.print(f"  read them: proctor artifact cat -t {_shown(doc['tenant'])} {doc['digest']} PATH")
    runs = doc["sandbox_runs"]
    if not runs:
        c.print("  [yellow]no sandbox run of this digest yet[/]: nothing was observed")
    for r in runs:
        exit_code = "" if r["exit_code"] is None else f", exit {r['exit_code']}"
        c.print(
            f"  sandbox run {r['id']} ({r['status']}{exit_code}, {r['started_at']}):"
            f" {r['calls']} call(s), {r['refused']} refused"
        )
        for e in r["events"]:
            style = "red" if e["decision"] == "deny" else "green"
            c.print(
                f"    [{style}]{e['decision']:5}[/] #{e['seq']} {_shown(e['action'])}"
                f" {_shown(e['resource'])}: {_shown(e['reason'])}"
            )
        if r["calls"] > len(r["events"]):
            c.print(f"    … {r['calls'] - len(r['events'])} more: proctor audit events -t"
                    f" {_shown(doc['tenant'])} --run {r['id']}")  # fmt: skip
    for a in doc.get("approvals", []):
        c.print(
            f"  {a['decision']} {a['id']} by {_shown(a['principal'])} at {a['created_at']}"
            + (" (revoked)" if a.get("revoked_at") else "")
        )
    before = doc.get("approved_predecessor")
    if before is not None:
        by = ", ".join(f"{_shown(a['principal'])} ({a['id']})" for a in before["approvals"])
        c.print(f"  [bold]follows the approved {_shown(doc['name'])} {before['digest']}[/]"
                f" (approved by {by})")  # fmt: skip
        c.print(f"  what changed since: proctor artifact review -t {_shown(doc['tenant'])} "
                f"{doc['digest']} --diff")  # fmt: skip
    elif doc.get("approved_predecessor", "") is None:
        c.print(f"  no earlier version of {_shown(doc['name'])} is approved")


def _warn_not_ready(rt: Runtime, tenant: str, capabilities: dict[str, Any]) -> None:
    """What ``deploy`` to production would refuse (a dataset not registered, egress no
    subprocessor covers), said at submit as warnings on stderr: the submission stands,
    and the developer learns the missing set-up before an approver's time is spent."""
    from proctor.governance import readiness

    found = readiness(rt.resources, rt.subprocessors, tenant, capabilities)
    _print_warnings((f.message, f.fix) for f in found)


def _print_warnings(findings: Iterable[tuple[str, str]]) -> None:
    """Findings as warnings on stderr, each with its fix (the API returns the same)."""
    err = Console(stderr=True, highlight=False, soft_wrap=True)
    for message, fix in findings:
        err.print(f"[yellow]warning:[/] {_shown(message)}")
        err.print(f"  [dim]fix:[/] {_shown(fix)}")
