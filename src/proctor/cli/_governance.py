"""Principals, approvals, deployments, runs, freeze and history on the command line."""

from __future__ import annotations

import signal
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Annotated, Any

import typer

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
    exit_if_interrupted,
    make_table,
    open_runtime,
    parse_time,
    print_table,
    remote,
    stop_on_signals,
)
from proctor.cli._units import parse_duration
from proctor.cli._when import EXAMPLES as WHEN_EXAMPLES
from proctor.cli._when import parse_when
from proctor.errors import ProctorError, UsageError
from proctor.governance import KINDS, ROLES, RUN_STATUSES, Environment, Principal
from proctor.ledger import Action
from proctor.policy import EntityRef
from proctor.runtime import Runtime

principal_app = typer.Typer(help="People and service accounts of a tenant.", no_args_is_help=True)
approval_app = typer.Typer(help="Approvals of artifacts.", no_args_is_help=True)
quorum_app = typer.Typer(help="How many approvals production needs.", no_args_is_help=True)
deployment_app = typer.Typer(help="Deployments and their versions.", no_args_is_help=True)
runs_app = typer.Typer(help="Run history and logs.", no_args_is_help=True)
egress_app = typer.Typer(help="Egress settings of a tenant.", no_args_is_help=True)


def _authorize(
    rt: Runtime, principal: Principal | None, action: str, resource: EntityRef, tenant: str,
    event_resource: str, context: dict[str, Any] | None = None,
) -> None:  # fmt: skip
    """Cedar decides for principals; the local operator owns the runtime (recorded as such)."""
    if principal is not None:
        rt.control.authorize(principal, action, resource, tenant, event_resource=event_resource,
                             context=context)  # fmt: skip


def _deploys_to(versions: Iterable[Any]) -> dict[str, Any]:
    """The environment a deployment's versions deploy to, for the Cedar context: "sandbox"
    only if every one did (an agent deploys to the sandbox only)."""
    envs = {v.environment for v in versions}
    if not envs:
        return {}
    return {"environment": envs.pop() if len(envs) == 1 else "production"}


def _read(rt: Runtime, token: str | None, tenant: str, action: str) -> None:
    """A read of ``tenant``: decided (a principal's roles), then of a tenant that
    exists, so that ``-t nope`` is "unknown tenant", not an empty answer. In this
    order a principal learns nothing of other tenants (it is refused first)."""
    authorize_read(rt, token, tenant, action)
    rt.tenants.get(tenant)


# -- principals ----------------------------------------------------------------


@principal_app.command("create")
def principal_create(
    tenant: TenantOpt,
    name: Annotated[str, typer.Argument(help="The principal's name")],
    role: Annotated[
        list[str] | None,
        typer.Option("--role", help=f"One of {', '.join(ROLES)} (an agent's is its kind's)"),
    ] = None,
    service: Annotated[bool, typer.Option(help="A service account, not a person")] = False,
    kind: Annotated[
        str | None, typer.Option("--kind", help=f"One of {', '.join(KINDS)} (default user)")
    ] = None,
    responsible: Annotated[
        str | None,
        typer.Option("--responsible", help="An agent's: the person or team answerable for it"),
    ] = None,
    as_json: JsonOpt = False,
    token: TokenOpt = None,
    home: HomeOpt = None,
) -> None:
    """Create a principal; its token is printed once and never again. An AI agent
    (--kind agent) holds the agent role alone and names who is --responsible for it."""
    if service and kind not in (None, "service"):
        raise UsageError("give --service or --kind, not both")
    chosen = "service" if service else (kind or "user")
    with open_runtime(home) as rt:
        rt.tenants.get(tenant)
        actor, who = acting(rt, token)
        refs = {"service": EntityRef.service_account, "agent": EntityRef.agent}
        _authorize(rt, who, Action.PRINCIPAL_CREATE, refs.get(chosen, EntityRef.user)(tenant, name),
                   tenant, f"principal/{tenant}/{name}")  # fmt: skip
        p, secret = rt.principals.create(tenant, name, chosen, list(role or []), actor,
                                         responsible=responsible)  # fmt: skip
    if as_json:
        # The token is in the object, so that nobody scrapes it from a sentence.
        emit_json({**_principal_json(p), "token": secret})
        return
    console.print(f"created {p.kind} [bold]{p.id}[/] with roles {', '.join(p.roles)}")
    console.print("token (shown once; keep it safe):")
    sys.stdout.write(secret + "\n")


def _principal_json(p: Principal) -> dict[str, Any]:
    return {"id": p.id, "tenant": p.tenant, "name": p.name, "kind": p.kind,
            "roles": list(p.roles), "disabled": p.disabled,
            "responsible": p.responsible}  # fmt: skip


@principal_app.command("list")
def principal_list(
    tenant: TenantOpt,
    as_json: JsonOpt = False,
    wide: WideOpt = False,
    token: TokenOpt = None,
    home: HomeOpt = None,
) -> None:
    """List a tenant's principals and their roles (never their tokens)."""
    with open_runtime(home) as rt:
        _read(rt, token, tenant, Action.TENANT_READ)
        rows = rt.principals.list(tenant)
    if as_json:
        emit_json([_principal_json(p) for p in rows])
        return
    table = make_table("principal", "kind", "roles", "disabled", ids=("principal",))
    for p in rows:
        table.add_row(p.name, p.kind, ", ".join(p.roles), "yes" if p.disabled else "")
    print_table(table, wide)


@principal_app.command("rotate")
def principal_rotate(
    tenant: TenantOpt,
    name: Annotated[str, typer.Argument(help="The principal's name")],
    as_json: JsonOpt = False,
    home: HomeOpt = None,
) -> None:
    """Issue a new token (the old one stops working)."""
    with open_runtime(home) as rt:
        secret = rt.principals.rotate(tenant, name, rt.operator)
    if as_json:
        emit_json({"id": f"{tenant}/{name}", "tenant": tenant, "name": name, "token": secret})
        return
    sys.stdout.write(secret + "\n")


# -- approvals -------------------------------------------------------------------


def _principal(rt: Runtime, token: str | None, what: str) -> Principal:
    _, principal = acting(rt, token)
    if principal is None:
        raise UsageError(
            f"{what} must come from a tenant principal, not the local operator",
            hint="pass --token (or set PROCTOR_TOKEN) of an approver",
        )
    return principal


def approve(
    digest: Annotated[str, typer.Argument(help="sha256:<hex>, or a unique prefix of the hex")],
    tenant: TenantOpt,
    expires: Annotated[str, typer.Option(help="How long it stands, e.g. 30d")] = "30d",
    comment: Annotated[str, typer.Option(help="What you checked")] = "",
    yes: Annotated[
        bool, typer.Option("--yes", "-y", help="Approve without asking (after reading the review)")
    ] = False,
    as_json: JsonOpt = False,
    token: TokenOpt = None,
    home: HomeOpt = None,
) -> None:
    """Approve an artifact: its digest, capabilities and purpose, until it expires.
    Shows what it approves first (capabilities in words, purpose, files, what its
    sandbox runs did), then asks, unless --yes."""
    from datetime import timedelta

    from rich.console import Console

    from proctor.cli._artifacts import print_review, review

    lifetime = timedelta(seconds=parse_duration(expires, "--expires"))
    client = remote(token)
    if client is None:
        with open_runtime(home) as rt:
            _principal(rt, token, "an approval")
    doc = review(tenant, digest, token, home)
    # The review is for the person; with --json, stdout carries only the approval.
    print_review(doc, Console(stderr=True, highlight=False, soft_wrap=True) if as_json else None)
    full = doc["digest"]
    if not yes:
        if not sys.stdin.isatty():
            raise UsageError(
                "approve asks for confirmation, and stdin is not a terminal",
                hint="read the review above (`proctor artifact review`), then pass --yes",
            )
        if not typer.confirm(f"Approve {full} for {expires}?", err=True):
            raise UsageError(f"{full} was not approved", hint="nothing was recorded")
    if client is not None:
        a = client.approve(tenant, full, expires_seconds=int(lifetime.total_seconds()),
                           comment=comment)  # fmt: skip
    else:
        with open_runtime(home) as rt:
            principal = _principal(rt, token, "an approval")
            a = rt.approvals.grant(tenant, full, principal, expires=lifetime,
                                   comment=comment).as_json()  # fmt: skip
    before = doc.get("approved_predecessor")
    if as_json:
        emit_json({**a, "approved_predecessor": before})
        return
    console.print(f"approval [bold]{a['id']}[/] of {a['digest']} by {a['principal']},"
                  f" until {a['expires_at']}")  # fmt: skip
    if before is not None:
        # Said again after the approval: what it replaces, and how to see the change.
        console.print(f"it follows the approved {before['digest']}; what changed: "
                      f"proctor artifact diff -t {tenant} {before['digest']} {full}")  # fmt: skip


def reject(
    digest: Annotated[str, typer.Argument(help="sha256:<hex>, or a unique prefix of the hex")],
    tenant: TenantOpt,
    comment: Annotated[str, typer.Option(help="Why")] = "",
    as_json: JsonOpt = False,
    token: TokenOpt = None,
    home: HomeOpt = None,
) -> None:
    """Reject an artifact: production runs of it are blocked until this is revoked."""
    if (client := remote(token)) is not None:
        a = client.reject(tenant, digest, comment)
    else:
        with open_runtime(home) as rt:
            principal = _principal(rt, token, "a rejection")
            full = rt.artifacts.get(tenant, digest).digest
            a = rt.approvals.reject(tenant, full, principal, comment).as_json()
    if as_json:
        emit_json(a)
        return
    console.print(f"rejection [bold]{a['id']}[/] of {a['digest']} by {a['principal']}")


ApprovalIdArg = Annotated[str, typer.Argument(help="The approval's id (any unique prefix)")]


@approval_app.command("revoke")
def approval_revoke(
    approval_id: ApprovalIdArg,
    tenant: TenantOpt,
    as_json: JsonOpt = False,
    token: TokenOpt = None,
    home: HomeOpt = None,
) -> None:
    """Revoke an approval: the next run is refused, a running service is stopped."""
    if (client := remote(token)) is not None:
        a = client.revoke(tenant, approval_id)
    else:
        with open_runtime(home) as rt:
            actor, principal = acting(rt, token)
            a = rt.approvals.revoke(tenant, approval_id, actor, principal).as_json()
    if as_json:
        emit_json(a)
        return
    console.print(f"approval {a['id']} revoked at {a['revoked_at']}")


@approval_app.command("request")
def approval_request(
    digest: Annotated[str, typer.Argument(help="sha256:<hex>, or a unique prefix of the hex")],
    tenant: TenantOpt,
    comment: Annotated[str, typer.Option(help="What the approvers should look at, and why")] = "",
    as_json: JsonOpt = False,
    token: TokenOpt = None,
    home: HomeOpt = None,
) -> None:
    """Ask the tenant's approvers to approve an artifact (an agent's or a developer's
    request, recorded). It approves nothing: a person approves."""
    if (client := remote(token)) is not None:
        r = client.request_approval(tenant, digest, comment)
    else:
        with open_runtime(home) as rt:
            actor, principal = acting(rt, token)
            if principal is None:
                rt.tenants.get(tenant)
            r = rt.approvals.request(tenant, digest, actor, comment, principal).as_json()
    if as_json:
        emit_json(r)
        return
    console.print(f"approval of {r['digest']} requested by {r['principal']} ({r['id']});"
                  f" the state: proctor approval state -t {tenant} {r['digest']}")  # fmt: skip


@approval_app.command("state")
def approval_state(
    digest: Annotated[str, typer.Argument(help="sha256:<hex>, or a unique prefix of the hex")],
    tenant: TenantOpt,
    as_json: JsonOpt = False,
    token: TokenOpt = None,
    home: HomeOpt = None,
) -> None:
    """Where an artifact's approval stands: who asked and when, the approvals and
    rejections in force, which count, the quorum, and whether production would run it."""
    from proctor.cli._artifacts import _shown

    if (client := remote(token)) is not None:
        doc = client.approval_state(tenant, digest)
    else:
        with open_runtime(home) as rt:
            _read(rt, token, tenant, Action.ARTIFACT_READ)
            doc = rt.approvals.state(tenant, digest).as_json()
    if as_json:
        emit_json(doc)
        return
    console.print(f"{'digest:':12} {doc['digest']}")
    quorum = doc["quorum"]
    console.print(f"{'quorum:':12} {quorum['required']} from {' or '.join(quorum['roles'])}")
    verdict = "yes" if doc["approved"] else f"no: {_shown(str(doc['why']))}"
    console.print(f"{'approved:':12} {verdict}")
    for r in doc["requests"]:
        console.print(f"requested by {_shown(r['principal'])} at {r['created_at']}: "
                      f"{_shown(r['comment'])}")  # fmt: skip
    for a in doc["approvals"]:
        counts = "counts" if a["principal"] in doc["counted"] else "does not count"
        console.print(f"approved by {_shown(a['principal'])} at {a['created_at']} ({counts})")
    for a in doc["rejections"]:
        console.print(f"rejected by {_shown(a['principal'])} at {a['created_at']}: "
                      f"{_shown(a['comment'])}")  # fmt: skip


@approval_app.command("show")
def approval_show(
    approval_id: ApprovalIdArg,
    tenant: TenantOpt,
    as_json: JsonOpt = False,
    token: TokenOpt = None,
    home: HomeOpt = None,
) -> None:
    """One approval or rejection: who, of which digest, the purpose and capabilities it
    approved, when, until when, revoked or not, and the approved version it follows."""
    from proctor.cli._artifacts import _shown, review

    if (client := remote(token)) is not None:
        a = client.approval(tenant, approval_id)
    else:
        with open_runtime(home) as rt:
            _read(rt, token, tenant, Action.ARTIFACT_READ)
            a = rt.approvals.get(tenant, approval_id).as_json()
    # What was approved is the artifact's manifest: the digest fixes it, so its
    # capabilities are the ones the approval's capabilities_hash names.
    art = review(tenant, a["digest"], token, home)
    before = art.get("approved_predecessor")
    doc = {**a, "artifact": art["name"], "capabilities": art["capabilities"],
           "capabilities_words": art["capabilities_words"],
           "approved_predecessor": before}  # fmt: skip
    if as_json:
        emit_json(doc)
        return
    for key in ("id", "decision", "digest", "artifact", "purpose", "principal", "roles",
                "created_at", "expires_at", "revoked_at", "revoked_by", "comment"):  # fmt: skip
        value = ", ".join(doc[key]) if isinstance(doc[key], list) else doc[key]
        console.print(f"{key + ':':12} {'' if value is None else _shown(str(value))}")
    console.print(f"{'capabilities:':12} (sha256 {a['capabilities_hash'].removeprefix('sha256:')})")
    for line in art["capabilities_words"]:
        console.print(f"  - {_shown(line)}")
    if before is None:
        console.print(f"no other version of {_shown(art['name'])} is approved now")
        return
    by = ", ".join(f"{_shown(p['principal'])} ({p['id']})" for p in before["approvals"])
    console.print(
        f"follows the approved {_shown(art['name'])} {before['digest']} (approved by {by})"
    )
    console.print(f"what changed since: proctor artifact diff -t {_shown(tenant)} "
                  f"{before['digest']} {a['digest']}")  # fmt: skip


@approval_app.command("list")
def approval_list(
    tenant: TenantOpt,
    digest: Annotated[
        str | None,
        typer.Option(help="Only this artifact's (a digest or a unique prefix) [default: all]"),
    ] = None,
    as_json: JsonOpt = False,
    wide: WideOpt = False,
    token: TokenOpt = None,
    home: HomeOpt = None,
) -> None:
    """Approvals and rejections, oldest first: of one artifact (beside its sandbox runs),
    or of every artifact of the tenant."""
    if (client := remote(token)) is not None:
        rows: list[dict[str, Any]] = client.approvals(tenant, digest)
        full = rows[0]["digest"] if rows and digest else None
    else:
        with open_runtime(home) as rt:
            _read(rt, token, tenant, Action.ARTIFACT_READ)
            full = rt.artifacts.get(tenant, digest).digest if digest else None
            digests = [full] if full else [a.digest for a in rt.artifacts.list(tenant)]
            found = [a for d in digests for a in rt.approvals.for_artifact(tenant, d)]
        rows = [a.as_json() for a in sorted(found, key=lambda a: (a.created_at, a.id))]
    if as_json:
        emit_json(rows)
        return
    table = make_table("approval", "decision", "artifact", "by", "at", "expires", "revoked",
                       ids=("approval", "artifact"))  # fmt: skip
    for a in rows:
        table.add_row(a["id"], a["decision"], a["digest"], a["principal"], a["created_at"],
                      a["expires_at"] or "", a["revoked_at"] or "")  # fmt: skip
    print_table(table, wide)
    if full and remote(token) is None:
        _print_build_loop(home, tenant, full)


def _print_build_loop(home: Path | None, tenant: str, digest: str) -> None:
    """The promotion path: what this very digest did in the sandbox, beside its approvals."""
    from proctor.lifecycle import Runs

    with open_runtime(home) as rt:
        runs = Runs(rt).of_artifact(tenant, digest)
        runs = [r for r in runs if r.environment == Environment.SANDBOX]
    if not runs:
        console.print("no sandbox run of this digest yet")
        return
    table = make_table("sandbox run", "deployment", "status", "exit", "started",
                       ids=("sandbox run", "deployment"))  # fmt: skip
    for r in runs:
        table.add_row(r.id, r.deployment, r.status, "" if r.exit_code is None else str(r.exit_code),
                      r.started_at)  # fmt: skip
    print_table(table)


@quorum_app.command("set")
def quorum_set(
    tenant: TenantOpt,
    required: Annotated[int, typer.Option(help="Approvals needed")] = 1,
    role: Annotated[list[str] | None, typer.Option(help="Roles that count")] = None,
    as_json: JsonOpt = False,
    token: TokenOpt = None,
    home: HomeOpt = None,
) -> None:
    """Set how many independent approvals production needs, and from which roles."""
    with open_runtime(home) as rt:
        actor, principal = acting(rt, token)
        _authorize(rt, principal, Action.POLICY_SET, EntityRef.tenant(tenant), tenant,
                   f"tenant/{tenant}")  # fmt: skip
        rule = rt.approvals.set_quorum(tenant, required, role or [], actor)
    if as_json:
        emit_json({"required": rule.required, "roles": list(rule.roles)})  # as quorum show
        return
    console.print(f"production in {tenant} needs {rule.required} approval(s) from "
                  f"{' or '.join(rule.roles)}")  # fmt: skip


@quorum_app.command("show")
def quorum_show(
    tenant: TenantOpt, as_json: JsonOpt = False, token: TokenOpt = None, home: HomeOpt = None
) -> None:
    """How many independent approvals production needs in the tenant, and from which roles."""
    doc: dict[str, Any]
    if (client := remote(token)) is not None:
        doc = dict(client.quorum(tenant))
    else:
        with open_runtime(home) as rt:
            _read(rt, token, tenant, Action.TENANT_READ)
            rule = rt.approvals.quorum(tenant)
        doc = {"required": rule.required, "roles": list(rule.roles)}
    if as_json:
        emit_json(doc)
        return
    console.print(f"production in {tenant} needs {doc['required']} approval(s) from "
                  f"{' or '.join(doc['roles'])}")  # fmt: skip


# -- deployments -----------------------------------------------------------------


def deploy(
    tenant: TenantOpt,
    digest: Annotated[
        str | None, typer.Argument(help="Artifact digest (or a unique prefix)")
    ] = None,
    name: Annotated[str | None, typer.Option(help="Deployment name")] = None,
    env: Annotated[str, typer.Option(help="sandbox or production")] = "sandbox",
    mode: Annotated[
        str | None,
        typer.Option(help="job, service or schedule; must equal the manifest's [lifecycle]"),
    ] = None,
    every: Annotated[
        str | None, typer.Option(help="Interval of a schedule, e.g. 1h; must equal the manifest's")
    ] = None,
    instruction: Annotated[str, typer.Option(help="The documented instruction")] = "",
    reference: Annotated[str, typer.Option(help="A ticket or change reference")] = "",
    rollback: Annotated[str | None, typer.Option(help="Deployment to roll back")] = None,
    as_json: JsonOpt = False,
    token: TokenOpt = None,
    home: HomeOpt = None,
) -> None:
    """Deploy an approved artifact (production needs a quorum), or --rollback NAME."""
    # Through the API the answer is already the deployment's JSON object.
    if (client := remote(token)) is not None:
        if rollback is not None:
            emit_json(client.rollback(tenant, rollback))
        elif digest is None or name is None:
            raise UsageError("give DIGEST and --name (or --rollback NAME)")
        else:
            emit_json(client.deploy(
                tenant, digest, name, instruction=instruction, environment=env, mode=mode,
                every_seconds=parse_duration(every, "--every") if every else None,
                reference=reference,
            ))  # fmt: skip
        return
    with open_runtime(home) as rt:
        actor, principal = acting(rt, token)
        if rollback is not None:
            versions = rt.deployments.versions(tenant, rollback)
            if len(versions) < 2:
                raise UsageError(f"deployment {rollback!r} has no earlier version")
            current = versions[-1]
            previous = next((v for v in reversed(versions[:-1]) if v.digest != current.digest),
                            None)  # fmt: skip
            if previous is None:
                raise UsageError(f"deployment {rollback!r} has no earlier artifact")
            _authorize(
                rt,
                principal,
                Action.DEPLOYMENT_ROLLBACK,
                EntityRef.deployment(tenant, rollback),
                tenant,
                f"deployment/{rollback}",
                _deploys_to(versions),
            )
            artifact = rt.artifacts.get(tenant, previous.digest)
            dep = rt.deployments.deploy(
                tenant, artifact, rollback, environment=previous.environment,
                mode=previous.mode, every_seconds=previous.every_seconds,
                instruction=previous.instruction, reference=previous.reference, actor=actor,
                rollback_of=previous.version,
            )  # fmt: skip
        else:
            if digest is None or name is None:
                raise UsageError("give DIGEST and --name (or --rollback NAME)")
            artifact = rt.artifacts.get(tenant, digest)
            _authorize(rt, principal, Action.DEPLOYMENT_CREATE, EntityRef.deployment(tenant, name),
                       tenant, f"deployment/{name}", {"environment": env})  # fmt: skip
            dep = rt.deployments.deploy(
                tenant, artifact, name, environment=env, mode=mode,
                every_seconds=parse_duration(every, "--every") if every else None,
                instruction=instruction, reference=reference, actor=actor,
            )  # fmt: skip
    if as_json:
        emit_json(dep.as_json())
        return
    approved = f", approved by {', '.join(dep.approvals)}" if dep.approvals else ""
    console.print(
        f"deployed [bold]{dep.name}[/] v{dep.version}: {dep.digest} to "
        f"{dep.environment} as a {dep.mode}{approved}"
    )


@deployment_app.command("list")
def deployment_list(
    tenant: TenantOpt,
    as_json: JsonOpt = False,
    wide: WideOpt = False,
    token: TokenOpt = None,
    home: HomeOpt = None,
) -> None:
    """The deployments in force: each one's current version, artifact and approvals."""
    if (client := remote(token)) is not None:
        emit_json(client.deployments(tenant))
        return
    with open_runtime(home) as rt:
        _read(rt, token, tenant, Action.DEPLOYMENT_READ)
        rows = rt.deployments.current(tenant)
    if as_json:
        emit_json([d.as_json() for d in rows])
        return
    table = make_table("deployment", "v", "env", "mode", "status", "artifact", "approvals",
                       ids=("deployment", "artifact", "approvals"))  # fmt: skip
    for d in rows:
        table.add_row(d.name, str(d.version), d.environment, d.mode, d.status, d.digest,
                      ", ".join(d.approvals))  # fmt: skip
    print_table(table, wide)


@deployment_app.command("versions")
def deployment_versions(
    tenant: TenantOpt,
    name: Annotated[str, typer.Argument(help="Deployment name")],
    as_json: JsonOpt = False,
    wide: WideOpt = False,
    token: TokenOpt = None,
    home: HomeOpt = None,
) -> None:
    """Every version of a deployment, oldest first (what --rollback goes back to)."""
    with open_runtime(home) as rt:
        _read(rt, token, tenant, Action.DEPLOYMENT_READ)
        rows = rt.deployments.versions(tenant, name)
    if as_json:
        emit_json([d.as_json() for d in rows])
        return
    table = make_table("v", "env", "mode", "status", "artifact", "approvals", "created", "by",
                       ids=("artifact", "approvals"))  # fmt: skip
    for d in rows:
        table.add_row(str(d.version), d.environment, d.mode, d.status, d.digest,
                      ", ".join(d.approvals), d.created_at, d.created_by)  # fmt: skip
    print_table(table, wide)


@deployment_app.command("stop")
def deployment_stop(
    tenant: TenantOpt,
    name: Annotated[str, typer.Argument(help="Deployment name")],
    as_json: JsonOpt = False,
    token: TokenOpt = None,
    home: HomeOpt = None,
) -> None:
    """Stop a deployment: its runs are stopped and no new one starts."""
    with open_runtime(home) as rt:
        actor, principal = acting(rt, token)
        versions: list[Any] = []
        if principal is not None and principal.tenant == tenant:
            try:
                versions = rt.deployments.versions(tenant, name)
            except ProctorError:
                versions = []
        _authorize(rt, principal, Action.DEPLOYMENT_CREATE, EntityRef.deployment(tenant, name),
                   tenant, f"deployment/{name}", _deploys_to(versions))  # fmt: skip
        rt.undeploy(tenant, name, actor, "stopped by request")
    if as_json:
        emit_json({"tenant": tenant, "name": name, "status": "stopped"})
        return
    console.print(f"deployment {name} stopped")


# -- runs ----------------------------------------------------------------------------


def run(
    name: Annotated[str, typer.Argument(help="The job deployment's name")],
    tenant: TenantOpt,
    backend: Annotated[str | None, typer.Option(help="gvisor or bubblewrap")] = None,
    as_json: JsonOpt = False,
    token: TokenOpt = None,
    home: HomeOpt = None,
) -> None:
    """Run a job deployment now; stream its output; exit with its exit code.

    With --json the job's own output (stdout and stderr) streams to stderr, and stdout
    carries one JSON object at the end: the run record (id, status, reason, exit_code)."""
    # With --json stdout is the JSON object's alone: the job's stdout moves to stderr.
    job_out = sys.stderr if as_json else sys.stdout
    if (client := remote(token)) is not None:
        doc = client.run(
            tenant, name,
            on_stdout=lambda text: (job_out.write(text), job_out.flush()),
            on_stderr=lambda text: (sys.stderr.write(text), sys.stderr.flush()),
        )  # fmt: skip
        print(run_line(doc["id"], doc["status"], doc.get("reason"), doc.get("exit_code")),
              file=sys.stderr)  # fmt: skip
        if as_json:
            emit_json(doc)
        code = doc.get("exit_code")
        raise typer.Exit(code if isinstance(code, int) else 1)

    # From here on a signal stops the run and records its end instead of killing us
    # (which would leave it 'running', its sandbox too); before the run starts, it
    # keeps the run from starting.
    with stop_on_signals() as stop, open_runtime(home) as rt:
        actor, principal = acting(rt, token)
        _authorize(rt, principal, Action.RUN_START, EntityRef.deployment(tenant, name), tenant,
                   f"deployment/{name}")  # fmt: skip
        with rt.make_broker() as broker:
            sup = rt.supervisor(broker, backend)
            out, err = job_out.buffer, sys.stderr.buffer

            def to_out(data: bytes) -> None:
                out.write(data)
                out.flush()

            def to_err(data: bytes) -> None:
                err.write(data)
                err.flush()

            exit_if_interrupted(stop)
            record = sup.start(tenant, name, actor, on_stdout=to_out, on_stderr=to_err,
                               cancel=stop)  # fmt: skip
        code = 128 + stop.signum if stop.signum is not None else record.exit_code
        print(run_line(record.id, record.status, record.reason, code), file=sys.stderr)
    if as_json:
        emit_json({**record.as_json(), "exit_code": code})
    raise typer.Exit(code if code is not None else 1)


def run_line(run_id: str, status: str, reason: str | None, code: int | None) -> str:
    """The run's end in one line, each fact once: ``run r-…: succeeded (exit 0)``, or
    with the cause when the program did not end by itself, ``run r-…: failed:
    timeout (exit 137)``."""
    # "exit" (the program ended by itself) is what the status and the code say already.
    cause = f": {reason}" if reason and reason not in ("exit", status) else ""
    return f"run {run_id}: {status}{cause}" + ("" if code is None else f" (exit {code})")


#: What a run's status may be (``runs list --status``).


@runs_app.command("list")
def runs_list(
    tenant: TenantOpt,
    deployment: Annotated[str | None, typer.Option(help="Only this deployment")] = None,
    status: Annotated[
        str | None, typer.Option(help=f"Only runs in this state: {', '.join(RUN_STATUSES)}")
    ] = None,
    since: Annotated[
        str | None,
        typer.Option(help=f"Only runs started at or after this time: {WHEN_EXAMPLES}"),
    ] = None,
    mine: Annotated[
        bool,
        typer.Option(
            "--mine",
            help="Only runs you started (your token's principal; without one, the local operator)",
        ),
    ] = False,
    as_json: JsonOpt = False,
    wide: WideOpt = False,
    token: TokenOpt = None,
    home: HomeOpt = None,
) -> None:
    """A tenant's runs, newest last, with status, reason and exit code."""
    from proctor.ledger import EventFilter, iter_events
    from proctor.lifecycle import Runs

    if status is not None and status not in RUN_STATUSES:
        raise UsageError(f"--status: {status!r} is not a run status",
                         hint=f"one of {', '.join(RUN_STATUSES)}")  # fmt: skip
    after = parse_when(since, "--since")

    def wanted(r: dict[str, Any]) -> bool:
        return (status is None or r["status"] == status) and (
            after is None or r["started_at"] >= after
        )

    # Who started a run is in its signed run.start event, not in the store's row.
    if (client := remote(token)) is not None:
        # Filtered on the server, over every run, by the signed record for --mine.
        rows = client.runs(tenant, deployment, status=status, since=after, mine=mine)
    else:
        with open_runtime(home) as rt:
            _read(rt, token, tenant, Action.RUN_READ)
            rows = [r.as_json() for r in Runs(rt).all(tenant, deployment, status)]
            rows = [r for r in rows if wanted(r)]
            if mine:
                # The acting principal's own run.start events: what it did itself.
                flt = EventFilter(action=Action.RUN_START, actor=acting(rt, token)[0].id,
                                  since=after)  # fmt: skip
                started = _started(iter_events(rt.ledger, tenant, flt))
                rows = [r for r in rows if r["id"] in started]
    # Through the API the answer has always been the JSON list (scripts read it so).
    if as_json or client is not None:
        emit_json(rows)
        return
    table = make_table("run", "deployment", "v", "env", "status", "reason", "exit", "started",
                       "ended", ids=("run", "deployment"))  # fmt: skip
    for r in rows:
        table.add_row(r["id"], r["deployment"], str(r["version"]), r["environment"], r["status"],
                      r["reason"] or "", "" if r["exit_code"] is None else str(r["exit_code"]),
                      r["started_at"], r["ended_at"] or "")  # fmt: skip
    print_table(table, wide)


def _actor_of(event: bytes) -> str | None:
    import json

    actor = json.loads(event).get("actor")
    return str(actor.get("id")) if isinstance(actor, dict) else None


def _started(events: Iterable[bytes]) -> set[str]:
    """The run ids of ``run.start`` events."""
    import json

    return {str(run) for ev in events if (run := json.loads(ev).get("run"))}


@runs_app.command("show")
def runs_show(
    run_id: Annotated[str, typer.Argument(help="The run's id (any unique prefix)")],
    tenant: TenantOpt,
    logs: Annotated[bool, typer.Option(help="Print the run's output too")] = False,
    limit: Annotated[
        int, typer.Option(min=1, help="Show at most N refused and N allowed calls")
    ] = 200,
    as_json: JsonOpt = False,
    wide: WideOpt = False,
    token: TokenOpt = None,
    home: HomeOpt = None,
) -> None:
    """A run: its record, and the calls it made out of its sandbox (each broker
    decision in the ledger) with the decision and its reason, refusals first."""
    from proctor.cli._audit import RunCalls, authorize_events
    from proctor.ledger import EventFilter, iter_events
    from proctor.lifecycle import Runs

    out: dict[str, str] = {}
    if (client := remote(token)) is not None:
        doc = client.get_run(tenant, run_id)
        since = _shortly_before(doc["started_at"])
        calls = RunCalls.collect(client.iter_events(tenant, run=doc["id"], since=since), limit)
        if logs:
            for stream in ("stdout", "stderr"):
                chunks = client.run_logs(tenant, doc["id"], stream=stream)
                out[stream] = b"".join(chunks).decode(errors="replace")
    else:
        with open_runtime(home) as rt:
            _read(rt, token, tenant, Action.RUN_READ)
            record = Runs(rt).get(tenant, run_id)
            authorize_events(rt, token, tenant, record.id)
            since = _shortly_before(record.started_at)
            found = iter_events(rt.ledger, tenant, EventFilter(run=record.id, since=since))
            calls = RunCalls.collect(found, limit)
            run_dir = rt.home / "runs" / record.id
        doc = record.as_json()
        if logs:
            for stream in ("stdout", "stderr"):
                path = run_dir / f"{stream}.log"
                out[stream] = path.read_text(errors="replace") if path.exists() else ""
    if as_json:
        emit_json({**doc, "calls": calls.as_json(), **({"logs": out} if logs else {})})
        return
    calls.print(doc, wide)
    for stream, text in out.items():
        sys.stdout.write(f"--- {stream}\n{text}")


def _shortly_before(started_at: str) -> str:
    # A run's calls all follow its start: the log is read from a minute before it
    # (found by a binary search on time), not from its first event.
    from datetime import datetime, timedelta

    when = datetime.fromisoformat(started_at.replace("Z", "+00:00")) - timedelta(minutes=1)
    return when.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def serve(
    backend: Annotated[str | None, typer.Option(help="gvisor or bubblewrap")] = None,
    api_host: Annotated[str, typer.Option(help="Address of the HTTP API")] = "127.0.0.1",
    api_port: Annotated[int, typer.Option(help="Port of the HTTP API")] = 8470,
    tls_cert: Annotated[Path | None, typer.Option(help="TLS certificate (PEM)")] = None,
    tls_key: Annotated[Path | None, typer.Option(help="TLS private key (PEM)")] = None,
    oidc_config: Annotated[
        Path | None, typer.Option(help="OIDC issuers to trust (JSON, see docs/api.md)")
    ] = None,
    no_api: Annotated[bool, typer.Option("--no-api", help="Supervise only")] = False,
    no_console: Annotated[
        bool, typer.Option("--no-console", help="Serve the API without the web console at /ui/")
    ] = False,
    console_url: Annotated[
        str | None,
        typer.Option(
            help="The console's origin as people reach it (https://host:port), for the OIDC "
            "redirect; default: the origin of each request"
        ),
    ] = None,
    public_log: Annotated[
        list[str] | None,
        typer.Option(
            help="Serve this tenant's tlog-tiles read paths (log/checkpoint, log/tile/...) "
            "without a token, as a public or auditor-facing mirror; repeatable"
        ),
    ] = None,
    node_lease: Annotated[
        float,
        typer.Option(
            min=1.0,
            max=300.0,
            help="Seconds this node's lease lasts unrenewed: past it, other nodes of the "
            "store take over its runs' services (docs/deploy.md)",
        ),
    ] = 10.0,
    metrics_port: Annotated[
        int | None,
        typer.Option(
            min=1,
            max=65535,
            help="Serve the Prometheus metrics alone at /metrics on this port, without a "
            "token (for a serve with --no-api, or a scraper kept off the API)",
        ),
    ] = None,
    metrics_host: Annotated[
        str, typer.Option(help="Address of --metrics-port (anyone who reaches it reads them)")
    ] = "127.0.0.1",
    metrics_token_file: Annotated[
        Path | None,
        typer.Option(
            help="Serve the metrics at the API's /metrics to the bearer of the token in this "
            "file (Prometheus: authorization.credentials_file); without it the API serves none"
        ),
    ] = None,
    metrics_tenant_labels: Annotated[
        bool,
        typer.Option(
            "--metrics-tenant-labels",
            help="Label calls, ledger appends, refusals, prunes and witness lag with the "
            "tenant's name (a series per tenant; names are then in the metrics)",
        ),
    ] = False,
    home: HomeOpt = None,
) -> None:
    """The long-running runtime: services kept up, schedules fired, runs supervised,
    the HTTP API (OpenAPI at /openapi.json) and the web console (/ui/)."""
    from proctor import telemetry
    from proctor.lifecycle import log_json

    _check_api_options(no_api, tls_cert, tls_key, {
        "--oidc-config": oidc_config, "--console-url": console_url,
        "--public-log": public_log, "--no-console": no_console,
        "--metrics-token-file": metrics_token_file,
    })  # fmt: skip
    if metrics_host != "127.0.0.1" and metrics_port is None:
        raise UsageError("--metrics-host is the address of --metrics-port, which is not given",
                         hint="add --metrics-port PORT, or drop --metrics-host")  # fmt: skip
    log_json()  # one JSON object per line on stderr: docs/operations.md
    # On for the whole serve (cheap: see telemetry); traces only if OTEL_* asks.
    telemetry.enable_metrics(tenant_labels=metrics_tenant_labels)
    if telemetry.configure_tracing():
        # Where to is the OTEL_* variables' (not printed: a URL may carry credentials).
        console.print("traces exported over OTLP/HTTP (OTEL_EXPORTER_OTLP_*)")
    stop_metrics = None
    try:
        if metrics_port is not None:
            stop_metrics = _serve_metrics(metrics_host, metrics_port)
            shown = f"[{metrics_host}]" if ":" in metrics_host else metrics_host
            console.print(f"metrics at http://{shown}:{metrics_port}/metrics")
        _serve(backend, api_host, api_port, tls_cert, tls_key, oidc_config, no_api,
               no_console, console_url, public_log, node_lease, metrics_token_file,
               home)  # fmt: skip
    finally:
        if stop_metrics is not None:
            stop_metrics()
        telemetry.shutdown_tracing()  # what is queued is exported before serve ends


def _serve_metrics(host: str, port: int) -> Any:
    from proctor import telemetry

    try:
        return telemetry.serve_metrics(host, port)
    except OSError as exc:
        raise ProctorError(
            f"cannot serve the metrics on {host}:{port}: {exc.strerror or exc}"
        ) from None


def _serve(
    backend: str | None, api_host: str, api_port: int, tls_cert: Path | None,
    tls_key: Path | None, oidc_config: Path | None, no_api: bool, no_console: bool,
    console_url: str | None, public_log: list[str] | None, node_lease: float,
    metrics_token_file: Path | None, home: Path | None,
) -> None:  # fmt: skip
    import logging

    from proctor.lifecycle import NodeLost, Server, log_event

    with open_runtime(home) as rt, rt.make_broker() as broker:
        for tenant in public_log or ():
            rt.tenants.get(tenant)  # an unknown tenant fails now, not at the first read
        sup = rt.supervisor(broker, backend)
        server = Server(sup, lease=node_lease)
        api = None
        if not no_api:
            from proctor.api import load_oidc_config, serve_api
            from proctor.console import ConsoleConfig

            try:
                api = serve_api(
                    rt, api_host, api_port,
                    certfile=tls_cert,
                    keyfile=tls_key,
                    oidc=load_oidc_config(oidc_config) if oidc_config else (),
                    supervisor=sup,
                    json_log=True,
                    public_logs=public_log or (),
                    console=None if no_console else ConsoleConfig(public_url=console_url),
                    metrics_token_file=metrics_token_file,
                )  # fmt: skip
            except BaseException:
                server.close()  # the node leaves now, not when its lease lapses
                raise
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, lambda n, _frame: server.stop(signal.Signals(n).name))
        console.print(f"serving {rt.home} (pid {sup.supervisor_id})")
        if api is not None:
            console.print(f"HTTP API at {api.url}")
            if not no_console:
                console.print(f"web console at {api.url}/ui/")
            for tenant in public_log or ():
                mirror = f"{api.url}/tenants/{tenant}/log/"
                console.print(f"the log of {tenant} is served without a token at {mirror}")
        try:
            server.serve()
        finally:
            if api is not None:
                api.stop()
            log_event(logging.getLogger("proctor.lifecycle"), "serve.stopped",
                      node=server.node.id, signal=_signal_of(server.stop_cause),
                      unfinished=server.unfinished)  # fmt: skip
    if server.lost is not None:
        # Started again (systemd, Kubernetes), it joins as a new node.
        raise NodeLost(f"this node lost its lease and stopped its runs: {server.lost}")


def _check_api_options(
    no_api: bool, tls_cert: Path | None, tls_key: Path | None, others: dict[str, object]
) -> None:
    """Refuse what ``serve`` would otherwise ignore or fail on late: the API's options
    with --no-api, and a TLS certificate or key that cannot be used."""
    if no_api:
        # Options for an API that will not run would be ignored, and a person would
        # believe, say, that TLS is on: refused instead.
        given = [flag for flag, value in (("--tls-cert", tls_cert), ("--tls-key", tls_key),
                                          *others.items()) if value]  # fmt: skip
        if given:
            raise UsageError(
                f"{', '.join(given)} {'is' if len(given) == 1 else 'are'} for the HTTP API,"
                " and --no-api starts none",
                hint="drop --no-api to serve the API, or drop the API's options",
            )
    if tls_cert is not None or tls_key is not None:
        from proctor.api import check_tls

        # Before the log turns to JSON, the home is opened or a node joins: a
        # certificate that cannot be used is one error line, naming the file.
        check_tls(tls_cert, tls_key)


def _signal_of(cause: str | None) -> str | None:
    return cause if cause is not None and cause.startswith("SIG") else None


def nodes_list(as_json: JsonOpt = False, home: HomeOpt = None) -> None:
    """The runtime nodes of this home's store: each serve, its lease and state."""
    from proctor.lifecycle import nodes

    with open_runtime(home) as rt:
        found = nodes(rt.store)
    if as_json:
        emit_json([n.as_json() for n in found])
        return
    if not found:
        console.print("no node has served this store yet")
        return
    for n in found:
        lease = f"lease {n.expires_in:.1f} s" if n.state == "live" else n.state
        console.print(f"{n.id}  {n.state}  epoch {n.epoch}  {lease}  "
                      f"{','.join(n.backends)}  started {n.started_at}")  # fmt: skip


# -- tenants: freeze, history, egress ---------------------------------------------


def freeze(name: str, unfreeze: bool, token: str | None, home: Path | None,
           as_json: bool = False) -> None:  # fmt: skip
    with open_runtime(home) as rt:
        actor, principal = acting(rt, token)
        action = Action.TENANT_UNFREEZE if unfreeze else Action.TENANT_FREEZE
        _authorize(rt, principal, action, EntityRef.tenant(name), name, f"tenant/{name}")
        t = rt.tenants.set_frozen(name, not unfreeze, actor)
    if as_json:
        emit_json(_tenant_json(t))
        return
    console.print(f"tenant {t.name} is {t.status}")


def _tenant_json(t: Any) -> dict[str, Any]:
    return {"name": t.name, "status": t.status, "created_at": t.created_at,
            "created_by": t.created_by}  # fmt: skip


@egress_app.command("allow-range")
def egress_allow_range(
    tenant: TenantOpt,
    cidr: Annotated[str, typer.Argument(help="e.g. 127.0.0.1/32")],
    as_json: JsonOpt = False,
    home: HomeOpt = None,
) -> None:
    """Let runs reach a special-purpose range (loopback, private) the proxy refuses by default."""
    with open_runtime(home) as rt:
        ranges = rt.allow_egress_range(tenant, cidr, rt.operator)
    if as_json:
        emit_json({"tenant": tenant, "ranges": list(ranges)})
        return
    console.print(f"{tenant} may reach: {', '.join(ranges)}")


@egress_app.command("sandbox-allow")
def egress_sandbox_allow(
    tenant: TenantOpt,
    host: Annotated[
        str, typer.Argument(help="host[:port] or *.domain[:port], e.g. mock.test:8443")
    ],
    as_json: JsonOpt = False,
    home: HomeOpt = None,
) -> None:
    """Mark a host for sandbox use: sandbox runs may reach it, and no other."""
    with open_runtime(home) as rt:
        rt.tenants.get(tenant)
        entry = rt.resources.allow_sandbox_host(tenant, host, rt.operator)
    if as_json:
        emit_json({"tenant": tenant, "host": entry})
        return
    console.print(f"sandbox runs of {tenant} may reach {entry}")


@egress_app.command("sandbox-hosts")
def egress_sandbox_hosts(
    tenant: TenantOpt, as_json: JsonOpt = False, token: TokenOpt = None, home: HomeOpt = None
) -> None:
    """The hosts sandbox runs may reach (none: sandbox runs have no egress)."""
    with open_runtime(home) as rt:
        _read(rt, token, tenant, Action.TENANT_READ)
        hosts = list(rt.resources.sandbox_hosts(tenant))
    if as_json:
        emit_json([{"tenant": tenant, "host": entry} for entry in hosts])
        return
    for entry in hosts:
        console.print(entry)


# -- private upstreams: CA certificates registered for hosts ------------------------

ca_app = typer.Typer(
    help="CA certificates a tenant registers for hosts with private certificates: where "
    "the broker ends TLS (a secret injected) it verifies such a host against them alone.",
    no_args_is_help=True,
)
egress_app.add_typer(ca_app, name="ca")

CaHostArg = Annotated[
    str, typer.Argument(help="The upstream's DNS name, as its certificate names it")
]


def _print_host_cas(entries: list[dict[str, Any]], wide: bool = False) -> None:
    table = make_table("host", "sha256", "subject", "expires", "added by",
                       ids=("host", "sha256"))  # fmt: skip
    for entry in entries:
        for ca in entry["cas"]:
            table.add_row(entry["host"], ca["fingerprint"], ca["subject"],
                          ca["not_after"][:10], ca["added_by"])  # fmt: skip
    print_table(table, wide)


@ca_app.command("add")
def egress_ca_add(
    tenant: TenantOpt,
    host: CaHostArg,
    ca_file: Annotated[
        Path,
        typer.Option(
            "--ca-file",
            help="PEM file of the CA certificate(s) that issue the "
            "host's certificate (CA:TRUE; no key)",
        ),
    ],
    as_json: JsonOpt = False,
    token: TokenOpt = None,
    home: HomeOpt = None,
) -> None:
    """Trust a CA for one host: its certificate is verified against it (and any other
    registered for it), not the system's roots."""
    try:
        pem = ca_file.read_bytes()
    except OSError as exc:
        raise UsageError(f"cannot read {ca_file}: {exc.strerror or exc}") from exc
    if (client := remote(token)) is not None:
        doc = dict(client.add_egress_ca(tenant, host, pem.decode("ascii", "replace")))
    else:
        with open_runtime(home) as rt:
            actor, principal = acting(rt, token)
            rt.tenants.get(tenant)
            _authorize(rt, principal, Action.POLICY_SET, EntityRef.tenant(tenant), tenant,
                       f"egress-ca/{host[:253]}")  # fmt: skip
            doc = rt.add_host_ca(tenant, host, pem, actor, str(ca_file)).to_json()
    if as_json:
        emit_json(doc)
        return
    console.print(f"{doc['host']} is verified against {len(doc['cas'])} CA certificate(s) "
                  f"of {tenant} only")  # fmt: skip
    _print_host_cas([doc])


@ca_app.command("list")
def egress_ca_list(
    tenant: TenantOpt,
    as_json: JsonOpt = False,
    wide: WideOpt = False,
    token: TokenOpt = None,
    home: HomeOpt = None,
) -> None:
    """The hosts with CA certificates registered, and those certificates."""
    if (client := remote(token)) is not None:
        entries = [dict(e) for e in client.egress_cas(tenant)]
    else:
        with open_runtime(home) as rt:
            _read(rt, token, tenant, Action.TENANT_READ)
            entries = [h.to_json() for h in rt.host_cas(tenant)]
    if as_json:
        emit_json(entries)
        return
    if not entries:
        console.print(f"no host of {tenant} has a CA certificate registered")
        return
    _print_host_cas(entries, wide)


@ca_app.command("remove")
def egress_ca_remove(
    tenant: TenantOpt,
    host: CaHostArg,
    fingerprint: Annotated[
        str | None,
        typer.Option(help="Remove only this certificate (its SHA-256, as `ca list` shows)"),
    ] = None,
    as_json: JsonOpt = False,
    token: TokenOpt = None,
    home: HomeOpt = None,
) -> None:
    """Stop trusting a host's registered CA certificates (all, or one): with none left
    the host is verified against the system's roots again."""
    if (client := remote(token)) is not None:
        doc = dict(client.remove_egress_ca(tenant, host, fingerprint))
    else:
        with open_runtime(home) as rt:
            actor, principal = acting(rt, token)
            rt.tenants.get(tenant)
            _authorize(rt, principal, Action.POLICY_SET, EntityRef.tenant(tenant), tenant,
                       f"egress-ca/{host[:253]}")  # fmt: skip
            doc = rt.remove_host_ca(tenant, host, actor, fingerprint).to_json()
    if as_json:
        emit_json(doc)
        return
    left = len(doc["cas"])
    console.print(f"{doc['host']}: {left} CA certificate(s) left" if left else
                  f"{doc['host']} has no CA certificate registered: verified against the "
                  "system's roots")  # fmt: skip


def history(
    tenant: TenantOpt,
    at: Annotated[str, typer.Option(help="ISO 8601 time")],
    window: Annotated[str, typer.Option(help="Runs this close to --at count too")] = "1h",
    as_json: JsonOpt = False,
    wide: WideOpt = False,
    token: TokenOpt = None,
    home: HomeOpt = None,
) -> None:
    """What ran here at time T: deployments in force, runs, digests, policies, approvers, data."""
    from proctor.lifecycle import what_ran

    when = parse_time(at, "--at")
    assert when is not None
    if (client := remote(token)) is not None:
        report = client.history(tenant, when, parse_duration(window, "--window"))
        if as_json:
            emit_json(report)
        else:
            _print_history(report, wide)
        return
    with open_runtime(home) as rt:
        _read(rt, token, tenant, Action.AUDIT_READ)
        report = what_ran(rt, tenant, when, parse_duration(window, "--window"))
    if as_json:
        emit_json(report)
        return
    _print_history(report, wide)


def _print_history(report: dict[str, Any], wide: bool) -> None:
    # The runs' effective sets (tenant set + permits + forbid), not the tenant's own alone.
    effective = ", ".join(report.get("policy_versions") or []) or "no run here"
    console.print(f"[bold]{report['tenant']}[/] at {report['at']}"
                  f" (runs decided under policy {effective})")  # fmt: skip
    table = make_table("deployment", "v", "env", "mode", "artifact", "approved by",
                       "instruction", ids=("deployment", "artifact"))  # fmt: skip
    for d in report["deployments"]:
        table.add_row(
            d["name"], str(d["version"]), d["environment"], d["mode"], d["artifact"],
            ", ".join(d["approved_by"]), d["instruction"],
        )  # fmt: skip
    print_table(table, wide)
    table = make_table("run", "deployment", "status", "started", "ended", "data", "hosts",
                       "denied", "policy", ids=("run", "deployment", "policy"))  # fmt: skip
    for r in report["runs"]:
        table.add_row(r["id"], r["deployment"], r["status"], r["started_at"],
                      r["ended_at"] or "", ", ".join(r["data"]), ", ".join(r["hosts"]),
                      str(r["denied"]), r.get("policy_version") or "")  # fmt: skip
    print_table(table, wide)


TenantArg = Annotated[str, typer.Argument(help="Tenant name")]


def register(app: typer.Typer, tenant_app: typer.Typer) -> None:
    app.add_typer(principal_app, name="principal")
    app.add_typer(approval_app, name="approval")
    app.add_typer(quorum_app, name="quorum")
    app.add_typer(deployment_app, name="deployment")
    app.add_typer(runs_app, name="runs")
    app.add_typer(egress_app, name="egress")
    app.command()(approve)
    app.command()(reject)
    app.command()(deploy)
    app.command()(run)
    app.command()(serve)
    app.command("nodes")(nodes_list)
    app.command()(history)

    @tenant_app.command("freeze")
    def tenant_freeze(name: TenantArg, as_json: JsonOpt = False, token: TokenOpt = None,
                      home: HomeOpt = None) -> None:  # fmt: skip
        """Stop every run of the tenant and refuse every call until unfreeze."""
        freeze(name, False, token, home, as_json)

    @tenant_app.command("quota")
    def tenant_quota(
        name: TenantArg,
        events_per_day: Annotated[
            int | None,
            typer.Option("--events-per-day", help="Set it: events the tenant's log takes a "
                         "UTC day before its runs' calls are refused"),
        ] = None,
        as_json: JsonOpt = False,
        token: TokenOpt = None,
        home: HomeOpt = None,
    ) -> None:  # fmt: skip
        """Show or set the tenant's ledger quota (control-plane actions are never refused)."""
        with open_runtime(home) as rt:
            if events_per_day is None:
                _read(rt, token, name, Action.TENANT_READ)
                q = rt.tenants.ledger_quota(name)
            else:
                actor, principal = acting(rt, token)
                # Admins only, as the tenant's retention is: both bound what its log keeps.
                _authorize(rt, principal, Action.RETENTION_MANAGE, EntityRef.tenant(name), name,
                           f"tenant/{name}")  # fmt: skip
                q = rt.tenants.set_ledger_quota(name, events_per_day, actor)
            today = rt.tenants.ledger_day(name)
        doc = {"tenant": q.tenant, "events_per_day": q.events_per_day, "set_by": q.set_by,
               "set_at": q.set_at, "day": today.day, "events_today": today.events}  # fmt: skip
        if as_json:
            emit_json(doc)
            return
        by = f"set by {q.set_by} at {q.set_at}" if q.set_by else "the default"
        console.print(f"tenant {q.tenant}: {q.events_per_day} events a day ({by}); "
                      f"{today.events} on {today.day} (UTC)")  # fmt: skip

    @tenant_app.command("unfreeze")
    def tenant_unfreeze(name: TenantArg, as_json: JsonOpt = False, token: TokenOpt = None,
                        home: HomeOpt = None) -> None:  # fmt: skip
        """Let the tenant's runs and calls go on again."""
        freeze(name, True, token, home, as_json)
