"""Control-plane routes: tenants, principals, policies, resources, artifacts,
approvals, deployments, runs and history. Each handler authorizes first (see
``Ctx.authorize``), then calls the runtime exactly as the CLI does."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import json
import shutil
import tempfile
import threading
import weakref
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import StreamingResponse

from proctor.api._context import Ctx, bound
from proctor.api._errors import ERROR_RESPONSES, ApiError, describe
from proctor.api._models import (
    ApprovalIn,
    ApprovalOut,
    ArtifactDetail,
    ArtifactOut,
    DatasetOut,
    DecisionOut,
    DeploymentIn,
    DeploymentOut,
    FindingOut,
    FreezeIn,
    PolicyIn,
    PolicyOut,
    PrincipalCreate,
    PrincipalCreated,
    PrincipalOut,
    QuorumIn,
    QuorumOut,
    RejectionIn,
    RunOut,
    SecretIn,
    SecretOut,
    StopIn,
    SubmittedOut,
    SubprocessorOut,
    TenantOut,
    TokenOut,
)
from proctor.api._tar import extract_artifact
from proctor.errors import ProctorError, UsageError
from proctor.governance import RUN_STATUSES, Principal, readiness
from proctor.ledger import Action
from proctor.policy import EntityRef

router = APIRouter(responses=ERROR_RESPONSES)
CtxDep = Annotated[Ctx, Depends(bound)]


def _principal(p: Principal) -> PrincipalOut:
    return PrincipalOut(
        tenant=p.tenant, name=p.name, kind=p.kind, roles=list(p.roles), disabled=p.disabled,
        responsible=p.responsible,
    )  # fmt: skip


def _tenant(ctx: Ctx, name: str) -> TenantOut:
    t = ctx.rt.tenants.get(name)
    head = ctx.rt.ledger.head(name)
    return TenantOut(
        name=t.name, status=t.status, created_at=t.created_at, created_by=t.created_by,
        origin=head.origin, log_size=head.size,
    )  # fmt: skip


def _runs_ref(ctx: Ctx, tenant: str) -> EntityRef:
    # "*" stands for every run of the tenant; the tenant parent makes it decidable.
    return EntityRef.workload(f"spiffe://{ctx.rt.config.trust_domain}/tenant/{tenant}/*")


def _artifact_ref(tenant: str, digest: str = "*") -> EntityRef:
    return EntityRef.artifact(tenant, digest)


# -- who am I, tenants ------------------------------------------------------------


@router.get("/whoami", response_model=PrincipalOut, tags=["principals"])
def whoami(ctx: CtxDep) -> PrincipalOut:
    """The principal the credential names (a token's, or one mapped from a JWT)."""
    p = ctx.principal
    ctx.authorize(Action.TENANT_READ, p.tenant, f"principal/{p.id}")
    return _principal(p)


@router.get("/tenants", response_model=list[TenantOut], tags=["tenants"])
def list_tenants(ctx: CtxDep) -> list[TenantOut]:
    """The tenants the caller can see: its own. Tenants are created by the operator."""
    t = ctx.principal.tenant
    ctx.authorize(Action.TENANT_READ, t, f"tenant/{t}")
    return [_tenant(ctx, t)]


@router.get("/tenants/{tenant}", response_model=TenantOut, tags=["tenants"])
def get_tenant(ctx: CtxDep, tenant: str) -> TenantOut:
    ctx.authorize(Action.TENANT_READ, tenant, f"tenant/{tenant}")
    return _tenant(ctx, tenant)


@router.post("/tenants/{tenant}/freeze", response_model=TenantOut, tags=["tenants"])
def freeze(ctx: CtxDep, tenant: str, body: FreezeIn) -> TenantOut:
    """Stop every run of the tenant and refuse every call until unfreeze."""
    ctx.authorize(Action.TENANT_FREEZE, tenant, f"tenant/{tenant}")
    ctx.rt.tenants.set_frozen(tenant, True, ctx.principal.actor, body.reason)
    return _tenant(ctx, tenant)


@router.post("/tenants/{tenant}/unfreeze", response_model=TenantOut, tags=["tenants"])
def unfreeze(ctx: CtxDep, tenant: str, body: FreezeIn) -> TenantOut:
    ctx.authorize(Action.TENANT_UNFREEZE, tenant, f"tenant/{tenant}")
    ctx.rt.tenants.set_frozen(tenant, False, ctx.principal.actor, body.reason)
    return _tenant(ctx, tenant)


# -- principals -------------------------------------------------------------------


@router.get("/tenants/{tenant}/principals", response_model=list[PrincipalOut], tags=["principals"])
def list_principals(ctx: CtxDep, tenant: str) -> list[PrincipalOut]:
    ctx.authorize(Action.TENANT_READ, tenant, f"tenant/{tenant}")
    return [_principal(p) for p in ctx.rt.principals.list(tenant)]


@router.post(
    "/tenants/{tenant}/principals",
    response_model=PrincipalCreated,
    status_code=201,
    tags=["principals"],
)
def create_principal(ctx: CtxDep, tenant: str, body: PrincipalCreate) -> PrincipalCreated:
    """Create a principal; its token is in this response and never again."""
    ref = _KIND_REFS[body.kind](tenant, body.name)
    ctx.authorize(Action.PRINCIPAL_CREATE, tenant, f"principal/{tenant}/{body.name}", ref)
    p, token = ctx.rt.principals.create(
        tenant, body.name, body.kind, list(body.roles), ctx.principal.actor,
        responsible=body.responsible,
    )  # fmt: skip
    return PrincipalCreated(principal=_principal(p), token=token)


@router.get("/tenants/{tenant}/principals/{name}", response_model=PrincipalOut, tags=["principals"])
def get_principal(ctx: CtxDep, tenant: str, name: str) -> PrincipalOut:
    ctx.authorize(Action.TENANT_READ, tenant, f"principal/{tenant}/{name}")
    return _principal(ctx.rt.principals.get(tenant, name))


_KIND_REFS = {
    "user": EntityRef.user,
    "service": EntityRef.service_account,
    "agent": EntityRef.agent,
}


def _principal_ref(ctx: Ctx, tenant: str, name: str) -> EntityRef:
    if tenant == ctx.principal.tenant:
        try:
            return _KIND_REFS[ctx.rt.principals.get(tenant, name).kind](tenant, name)
        except (ProctorError, KeyError):
            pass
    return EntityRef.user(tenant, name)


@router.post(
    "/tenants/{tenant}/principals/{name}/token", response_model=TokenOut, tags=["principals"]
)
def rotate_token(ctx: CtxDep, tenant: str, name: str) -> TokenOut:
    """Issue a new token for the principal; the old one stops working."""
    ref = _principal_ref(ctx, tenant, name)
    ctx.authorize(Action.TOKEN_ISSUE, tenant, f"principal/{tenant}/{name}", ref)
    return TokenOut(token=ctx.rt.principals.rotate(tenant, name, ctx.principal.actor))


def _set_disabled(ctx: Ctx, tenant: str, name: str, disabled: bool) -> PrincipalOut:
    # The schema has no principal.disable: managing principals is principal.create's.
    ref = _principal_ref(ctx, tenant, name)
    ctx.authorize(Action.PRINCIPAL_CREATE, tenant, f"principal/{tenant}/{name}", ref)
    ctx.rt.principals.set_disabled(tenant, name, disabled, ctx.principal.actor)
    return _principal(ctx.rt.principals.get(tenant, name))


@router.post(
    "/tenants/{tenant}/principals/{name}/disable", response_model=PrincipalOut,
    tags=["principals"],
)  # fmt: skip
def disable_principal(ctx: CtxDep, tenant: str, name: str) -> PrincipalOut:
    return _set_disabled(ctx, tenant, name, True)


@router.post(
    "/tenants/{tenant}/principals/{name}/enable", response_model=PrincipalOut,
    tags=["principals"],
)  # fmt: skip
def enable_principal(ctx: CtxDep, tenant: str, name: str) -> PrincipalOut:
    return _set_disabled(ctx, tenant, name, False)


# -- policies, quorum, resources ----------------------------------------------------


def _policy(pv: Any) -> PolicyOut:
    return PolicyOut(tenant=pv.tenant, version=pv.version, text=pv.text, set_at=pv.set_at,
                     set_by=pv.set_by, seq=pv.seq)  # fmt: skip


@router.get("/tenants/{tenant}/policy", response_model=PolicyOut, tags=["policies"])
def get_policy(ctx: CtxDep, tenant: str) -> PolicyOut:
    ctx.authorize(Action.POLICY_READ, tenant, f"policy/{tenant}")
    return _policy(ctx.rt.policies.current(tenant))


@router.put("/tenants/{tenant}/policy", response_model=PolicyOut, tags=["policies"])
def set_policy(ctx: CtxDep, tenant: str, body: PolicyIn) -> PolicyOut:
    """Validate and set the tenant's Cedar policy set (deny by default)."""
    ctx.authorize(Action.POLICY_SET, tenant, f"policy/{tenant}")
    ctx.rt.tenants.get(tenant)
    return _policy(ctx.rt.policies.set(tenant, body.text, ctx.principal.actor))


@router.get("/tenants/{tenant}/policy/history", response_model=list[PolicyOut], tags=["policies"])
def policy_history(ctx: CtxDep, tenant: str) -> list[PolicyOut]:
    ctx.authorize(Action.POLICY_READ, tenant, f"policy/{tenant}")
    return [_policy(pv) for pv in ctx.rt.policies.history(tenant)]


@router.get("/tenants/{tenant}/policy/effective", tags=["policies"])
def effective_policy(
    ctx: CtxDep,
    tenant: str,
    deployment: Annotated[str, Query(min_length=1, max_length=63)],
    version: Annotated[int | None, Query(ge=1)] = None,
) -> dict[str, Any]:
    """The whole set a run of the deployment is decided under (``policy show --effective``)."""
    from proctor.lifecycle import effective_policy as effective

    ctx.authorize(Action.POLICY_READ, tenant, f"policy/{tenant}")
    result: dict[str, Any] = effective(ctx.rt, tenant, deployment, version)
    return result


@router.post("/tenants/{tenant}/policy/test", response_model=DecisionOut, tags=["policies"])
def test_policy(ctx: CtxDep, tenant: str, body: dict[str, Any]) -> DecisionOut:
    """Decide one request (``proctor policy test``'s JSON) against the current policy."""
    from proctor.policy import evaluate_request

    ctx.authorize(Action.POLICY_READ, tenant, f"policy/{tenant}")
    decision = evaluate_request(ctx.rt.policies.compiled(tenant), body)
    return DecisionOut(**decision.to_json())


@router.get("/tenants/{tenant}/quorum", response_model=QuorumOut, tags=["policies"])
def get_quorum(ctx: CtxDep, tenant: str) -> QuorumOut:
    ctx.authorize(Action.TENANT_READ, tenant, f"tenant/{tenant}")
    ctx.rt.tenants.get(tenant)
    rule = ctx.rt.approvals.quorum(tenant)
    return QuorumOut(required=rule.required, roles=list(rule.roles))


@router.put("/tenants/{tenant}/quorum", response_model=QuorumOut, tags=["policies"])
def set_quorum(ctx: CtxDep, tenant: str, body: QuorumIn) -> QuorumOut:
    """How many approvals production needs, and from which roles."""
    ctx.authorize(Action.POLICY_SET, tenant, f"tenant/{tenant}")
    ctx.rt.tenants.get(tenant)
    rule = ctx.rt.approvals.set_quorum(tenant, body.required, list(body.roles),
                                       ctx.principal.actor)  # fmt: skip
    return QuorumOut(required=rule.required, roles=list(rule.roles))


@router.get("/tenants/{tenant}/datasets", response_model=list[DatasetOut], tags=["resources"])
def list_datasets(ctx: CtxDep, tenant: str) -> list[DatasetOut]:
    """Datasets by name; where they are stays with the runtime."""
    ctx.authorize(Action.TENANT_READ, tenant, f"tenant/{tenant}")
    ctx.rt.tenants.get(tenant)
    return [
        DatasetOut(name=d.name, kind=d.kind, synthetic=d.synthetic, twin_of=d.twin_of)
        for d in ctx.rt.resources.datasets(tenant)
    ]


@router.get("/tenants/{tenant}/secrets", response_model=list[SecretOut], tags=["resources"])
def list_secrets(ctx: CtxDep, tenant: str) -> list[SecretOut]:
    """Secrets by name and the hosts they go to; never their values."""
    ctx.authorize(Action.TENANT_READ, tenant, f"tenant/{tenant}")
    ctx.rt.tenants.get(tenant)
    return [
        SecretOut(name=s.name, hosts=list(s.hosts), header=s.header, twin_of=s.twin_of)
        for s in ctx.rt.resources.secrets(tenant)
    ]


@router.get(
    "/tenants/{tenant}/subprocessors", response_model=list[SubprocessorOut], tags=["resources"]
)
def list_subprocessors(ctx: CtxDep, tenant: str) -> list[SubprocessorOut]:
    """The tenant's subprocessors: who may receive its data, for what, from where
    (`proctor subprocessor list`); read as the audit log is."""
    ctx.authorize(Action.AUDIT_READ, tenant, f"tenant/{tenant}")
    ctx.rt.tenants.get(tenant)
    return [SubprocessorOut(**s.as_json()) for s in ctx.rt.subprocessors.list(tenant)]


@router.put("/tenants/{tenant}/secrets/{name}", response_model=SecretOut, tags=["resources"])
def set_secret(ctx: CtxDep, tenant: str, name: str, body: SecretIn) -> SecretOut:
    """Store a secret, sealed; the broker injects it, runs never see it."""
    try:
        ref = EntityRef.secret(tenant, name)
    except ProctorError as exc:
        raise UsageError(f"invalid secret name {name!r}") from exc
    ctx.authorize(Action.SECRET_REGISTER, tenant, f"secret/{tenant}/{name}", ref)
    ctx.rt.tenants.get(tenant)
    s = ctx.rt.resources.set_secret(tenant, name, body.value, body.hosts, ctx.principal.actor,
                                    header=body.header, template=body.template,
                                    twin_of=body.twin_of)  # fmt: skip
    return SecretOut(name=s.name, hosts=list(s.hosts), header=s.header, twin_of=s.twin_of)


@router.get("/tenants/{tenant}/buckets", response_model=list[str], tags=["resources"])
def list_buckets(ctx: CtxDep, tenant: str) -> list[str]:
    ctx.authorize(Action.TENANT_READ, tenant, f"tenant/{tenant}")
    ctx.rt.tenants.get(tenant)
    return ctx.rt.resources.buckets(tenant)


# -- artifacts and approvals --------------------------------------------------------

_TAR_BODY = {
    "required": True,
    "content": {
        "application/x-tar": {"schema": {"type": "string", "format": "binary"}},
        "application/gzip": {"schema": {"type": "string", "format": "binary"}},
    },
}


@router.post(
    "/tenants/{tenant}/artifacts",
    response_model=SubmittedOut,
    status_code=201,
    tags=["artifacts"],
    openapi_extra={"requestBody": _TAR_BODY},
)
async def submit_artifact(ctx: CtxDep, tenant: str, request: Request) -> SubmittedOut:
    """Submit an artifact: a tar (or tar.gz) of its directory, ``proctor.toml`` at the
    root (or inside one top-level directory). Identical content is the same artifact.
    ``warnings`` are what a production deploy would refuse today, with their fixes."""
    state = ctx.state
    await run_in_threadpool(
        ctx.authorize, Action.ARTIFACT_SUBMIT, tenant, f"tenant/{tenant}", _artifact_ref(tenant)
    )
    await run_in_threadpool(ctx.rt.tenants.get, tenant)
    limit = state.limits.artifact_upload
    # Spooled to disk past 1 MiB: the upload is read once, counted, never held whole.
    spool = tempfile.SpooledTemporaryFile(max_size=1 << 20)  # noqa: SIM115 - closed below
    try:
        size = 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise ApiError(413, "too_large", f"the upload is over {limit} bytes")
            spool.write(chunk)
        spool.seek(0)
        artifact = await run_in_threadpool(_unpack_and_submit, ctx, tenant, spool)
    finally:
        spool.close()
    found = await run_in_threadpool(
        readiness, ctx.rt.resources, ctx.rt.subprocessors, tenant, artifact.capabilities
    )
    warnings = [FindingOut(message=f.message, fix=f.fix) for f in found]
    return SubmittedOut(**artifact.to_json(), warnings=warnings)


def _unpack_and_submit(ctx: Ctx, tenant: str, upload: Any) -> Any:
    limits = ctx.state.limits
    work = Path(tempfile.mkdtemp(prefix="proctor-upload-"))
    try:
        root = work / "a"
        root.mkdir(mode=0o700)
        extract_artifact(
            upload, root, max_bytes=limits.artifact_upload, max_files=limits.artifact_files
        )
        entries = list(root.iterdir())
        # One top-level folder is the artifact; a link to a folder is not followed.
        only = entries[0] if len(entries) == 1 else None
        if (
            not (root / "proctor.toml").exists()
            and only
            and only.is_dir()
            and not only.is_symlink()
        ):
            root = only
        return ctx.rt.artifacts.submit(
            tenant, root, ctx.principal.actor,
            max_bytes=limits.artifact_upload, max_files=limits.artifact_files,
        )  # fmt: skip
    finally:
        shutil.rmtree(work, ignore_errors=True)


@router.get("/tenants/{tenant}/artifacts", response_model=list[ArtifactOut], tags=["artifacts"])
def list_artifacts(ctx: CtxDep, tenant: str) -> list[ArtifactOut]:
    ctx.authorize(Action.ARTIFACT_READ, tenant, f"tenant/{tenant}", _artifact_ref(tenant))
    ctx.rt.tenants.get(tenant)
    return [ArtifactOut(**a.to_json()) for a in ctx.rt.artifacts.list(tenant)]


@router.get(
    "/tenants/{tenant}/artifacts/{digest}", response_model=ArtifactDetail, tags=["artifacts"]
)
def get_artifact(ctx: CtxDep, tenant: str, digest: str) -> ArtifactDetail:
    """An artifact's manifest, capabilities and files (``digest`` may be a unique prefix)."""
    ctx.authorize(Action.ARTIFACT_READ, tenant, f"artifact/{digest}", _artifact_ref(tenant))
    a = ctx.rt.artifacts.get(tenant, digest)
    files = [f.to_json() for f in ctx.rt.artifacts.files(tenant, a.digest)]
    return ArtifactDetail(**a.to_json(), files=files)  # type: ignore[arg-type]


@router.get("/tenants/{tenant}/artifacts/{old}/diff/{new}", tags=["artifacts"])
def diff_artifacts(ctx: CtxDep, tenant: str, old: str, new: str) -> dict[str, Any]:
    """What changed between two artifacts: capabilities first, then the code."""
    ctx.authorize(Action.ARTIFACT_READ, tenant, f"artifact/{new}", _artifact_ref(tenant))
    result: dict[str, Any] = ctx.rt.artifacts.diff(tenant, old, new).to_json()
    return result


def _approval(a: Any) -> ApprovalOut:
    return ApprovalOut(**a.as_json())


@router.get(
    "/tenants/{tenant}/artifacts/{digest}/approvals",
    response_model=list[ApprovalOut],
    tags=["approvals"],
)
def list_approvals(ctx: CtxDep, tenant: str, digest: str) -> list[ApprovalOut]:
    ctx.authorize(Action.ARTIFACT_READ, tenant, f"artifact/{digest}", _artifact_ref(tenant))
    full = ctx.rt.artifacts.get(tenant, digest).digest
    return [_approval(a) for a in ctx.rt.approvals.for_artifact(tenant, full)]


@router.post(
    "/tenants/{tenant}/artifacts/{digest}/approvals",
    response_model=ApprovalOut,
    status_code=201,
    tags=["approvals"],
)
def approve(ctx: CtxDep, tenant: str, digest: str, body: ApprovalIn) -> ApprovalOut:
    """Approve the artifact's digest, capabilities and purpose until it expires.
    Separation of duties: its author cannot."""
    return _decide(ctx, tenant, digest, Action.APPROVAL_GRANT, body.comment, body.expires_seconds)


@router.post(
    "/tenants/{tenant}/artifacts/{digest}/rejections",
    response_model=ApprovalOut,
    status_code=201,
    tags=["approvals"],
)
def reject(ctx: CtxDep, tenant: str, digest: str, body: RejectionIn) -> ApprovalOut:
    """Reject the artifact: production runs of it are blocked until this is revoked."""
    return _decide(ctx, tenant, digest, Action.APPROVAL_REJECT, body.comment, None)


def _decide(
    ctx: Ctx, tenant: str, digest: str, action: str, comment: str, expires: int | None
) -> ApprovalOut:
    p = ctx.principal
    author = False
    if tenant == p.tenant:
        # Resolved as everywhere (a prefix too), so that a shortened digest cannot hide
        # that the approver is the author; a digest that names nothing is refused below.
        with contextlib.suppress(ProctorError):
            author = ctx.rt.artifacts.get(tenant, digest).author == p.id
    ref = _artifact_ref(tenant, digest if len(digest) <= 200 else "*")
    ctx.authorize(action, tenant, f"artifact/{digest}", ref, {"principal_is_author": author})
    full = ctx.rt.artifacts.get(tenant, digest).digest
    if action == Action.APPROVAL_GRANT:
        assert expires is not None
        a = ctx.rt.approvals.grant(tenant, full, p, expires=timedelta(seconds=expires),
                                   comment=comment)  # fmt: skip
    else:
        a = ctx.rt.approvals.reject(tenant, full, p, comment)
    return _approval(a)


@router.get(
    "/tenants/{tenant}/approvals/{approval_id}", response_model=ApprovalOut, tags=["approvals"]
)
def get_approval(ctx: CtxDep, tenant: str, approval_id: str) -> ApprovalOut:
    ctx.authorize(Action.ARTIFACT_READ, tenant, f"approval/{approval_id}", _artifact_ref(tenant))
    return _approval(ctx.rt.approvals.get(tenant, approval_id))


@router.post(
    "/tenants/{tenant}/approvals/{approval_id}/revoke",
    response_model=ApprovalOut,
    tags=["approvals"],
)
def revoke(ctx: CtxDep, tenant: str, approval_id: str) -> ApprovalOut:
    """Revoke an approval: the next run is refused, a running service is stopped."""
    ctx.authorize(Action.APPROVAL_REVOKE, tenant, f"approval/{approval_id}", _artifact_ref(tenant))
    a = ctx.rt.approvals.revoke(tenant, approval_id, ctx.principal.actor, ctx.principal)
    return _approval(a)


# -- deployments ----------------------------------------------------------------------


def _deployment(d: Any) -> DeploymentOut:
    return DeploymentOut(**d.as_json())


@router.get(
    "/tenants/{tenant}/deployments", response_model=list[DeploymentOut], tags=["deployments"]
)
def list_deployments(ctx: CtxDep, tenant: str) -> list[DeploymentOut]:
    ctx.authorize(Action.DEPLOYMENT_READ, tenant, f"tenant/{tenant}",
                  EntityRef.deployment(tenant, "*") if tenant else None)  # fmt: skip
    ctx.rt.tenants.get(tenant)
    return [_deployment(d) for d in ctx.rt.deployments.current(tenant)]


@router.post(
    "/tenants/{tenant}/deployments",
    response_model=DeploymentOut,
    status_code=201,
    tags=["deployments"],
)
def create_deployment(ctx: CtxDep, tenant: str, body: DeploymentIn) -> DeploymentOut:
    """Deploy an artifact (production needs a quorum of approvals)."""
    # The environment is in the context: an agent deploys to the sandbox only.
    ctx.authorize(Action.DEPLOYMENT_CREATE, tenant, f"deployment/{body.name}",
                  EntityRef.deployment(tenant, body.name),
                  {"environment": body.environment})  # fmt: skip
    artifact = ctx.rt.artifacts.get(tenant, body.digest)
    dep = ctx.rt.deployments.deploy(
        tenant, artifact, body.name, environment=body.environment, mode=body.mode,
        every_seconds=body.every_seconds, instruction=body.instruction,
        reference=body.reference, actor=ctx.principal.actor,
    )  # fmt: skip
    return _deployment(dep)


def _environment(ctx: Ctx, tenant: str, name: str) -> dict[str, Any]:
    """The Cedar context naming the environment ``name`` deploys to: "sandbox" only if
    every version of it did (a rollback may go back to any); none if it is not the
    principal's tenant's or does not exist (an agent is then refused)."""
    if tenant != ctx.principal.tenant:
        return {}
    try:
        envs = {v.environment for v in ctx.rt.deployments.versions(tenant, name)}
    except ProctorError:
        return {}
    if not envs:
        return {}
    return {"environment": envs.pop() if len(envs) == 1 else "production"}


def _deployment_ref(tenant: str, name: str) -> EntityRef:
    try:
        return EntityRef.deployment(tenant, name)
    except ProctorError:
        return EntityRef.deployment(tenant, "*")


@router.get(
    "/tenants/{tenant}/deployments/{name}",
    response_model=list[DeploymentOut],
    tags=["deployments"],
)
def deployment_versions(ctx: CtxDep, tenant: str, name: str) -> list[DeploymentOut]:
    """Every version of one deployment, oldest first (the last is current)."""
    ctx.authorize(
        Action.DEPLOYMENT_READ, tenant, f"deployment/{name}", _deployment_ref(tenant, name)
    )
    return [_deployment(d) for d in ctx.rt.deployments.versions(tenant, name)]


@router.post(
    "/tenants/{tenant}/deployments/{name}/rollback",
    response_model=DeploymentOut,
    tags=["deployments"],
)
def rollback(ctx: CtxDep, tenant: str, name: str) -> DeploymentOut:
    """Deploy the previous artifact of this deployment again (as a new version)."""
    ctx.authorize(Action.DEPLOYMENT_ROLLBACK, tenant, f"deployment/{name}",
                  _deployment_ref(tenant, name), _environment(ctx, tenant, name))  # fmt: skip
    versions = ctx.rt.deployments.versions(tenant, name)
    current_version = versions[-1]
    previous = next(
        (v for v in reversed(versions[:-1]) if v.digest != current_version.digest), None
    )
    if previous is None:
        raise UsageError(f"deployment {name!r} has no earlier artifact")
    artifact = ctx.rt.artifacts.get(tenant, previous.digest)
    dep = ctx.rt.deployments.deploy(
        tenant, artifact, name, environment=previous.environment, mode=previous.mode,
        every_seconds=previous.every_seconds, instruction=previous.instruction,
        reference=previous.reference, actor=ctx.principal.actor, rollback_of=previous.version,
    )  # fmt: skip
    return _deployment(dep)


@router.post(
    "/tenants/{tenant}/deployments/{name}/stop",
    response_model=DeploymentOut,
    tags=["deployments"],
)
def stop_deployment(ctx: CtxDep, tenant: str, name: str, body: StopIn) -> DeploymentOut:
    ctx.authorize(Action.DEPLOYMENT_CREATE, tenant, f"deployment/{name}",
                  _deployment_ref(tenant, name), _environment(ctx, tenant, name))  # fmt: skip
    ctx.rt.deployments.set_status(tenant, name, "stopped", ctx.principal.actor, body.reason)
    return _deployment(ctx.rt.deployments.get(tenant, name))


# -- runs -----------------------------------------------------------------------------

_NDJSON: dict[int | str, dict[str, Any]] = {
    200: {
        "content": {"application/x-ndjson": {"schema": {"type": "string"}}},
        "description": "One JSON object per line",
    }
}


@router.post(
    "/tenants/{tenant}/deployments/{name}/runs",
    response_class=StreamingResponse,
    responses=_NDJSON,
    tags=["runs"],
)
async def start_run(ctx: CtxDep, tenant: str, name: str) -> StreamingResponse:
    """Run a job deployment now and stream it as JSON lines: ``{"stream": "stdout"|"stderr",
    "data": text}`` while it runs, then ``{"run": {...}}`` (or ``{"error": {...}}``)."""
    await run_in_threadpool(
        ctx.authorize, Action.RUN_START, tenant, f"deployment/{name}", _deployment_ref(tenant, name)
    )
    # A deployment that is not there is "not found", whether or not this host can
    # start a sandbox (the supervisor is made on the first run).
    await run_in_threadpool(ctx.rt.deployments.get, tenant, name)
    sup = await run_in_threadpool(ctx.state.get_supervisor)
    actor = ctx.principal.actor
    # Refusals (frozen tenant, stopped deployment, no quorum) are answered as errors,
    # not as a stream that starts well and ends badly.
    await run_in_threadpool(sup.check_startable, tenant, name, actor)
    # The supervisor of a serve node carries its run queue: with other nodes live, the
    # run goes to whichever node has room.
    queue = getattr(sup, "queue", None)
    if queue is not None and await run_in_threadpool(queue.wanted):
        return StreamingResponse(_queued_run(ctx, queue, tenant, name, actor),
                                 media_type="application/x-ndjson")  # fmt: skip
    # The stream waits on the event loop, not on a worker thread: a client that
    # holds many runs' streams open holds no thread of the API's pool.
    loop = asyncio.get_running_loop()
    lines: asyncio.Queue[bytes | None] = asyncio.Queue()

    def put(item: bytes | None) -> None:
        with contextlib.suppress(RuntimeError):  # the server stopped: nobody reads
            loop.call_soon_threadsafe(lines.put_nowait, item)

    def emit(stream: str) -> Any:
        def out(data: bytes) -> None:
            doc = {"stream": stream, "data": data.decode("utf-8", errors="replace")}
            put(json.dumps(doc).encode() + b"\n")

        return out

    request_id = ctx.request_id

    def body() -> None:
        try:
            record = sup.start(tenant, name, actor, on_stdout=emit("stdout"),
                               on_stderr=emit("stderr"))  # fmt: skip
            put(json.dumps({"run": record.as_json()}).encode() + b"\n")
        except Exception as exc:
            _, doc, _ = describe(exc, request_id)
            put(json.dumps(doc).encode() + b"\n")
        finally:
            put(None)

    # The run outlives a client that hangs up: it is recorded to the end either way.
    # In the request's context: the run's log lines carry its request id.
    threading.Thread(target=contextvars.copy_context().run, args=(body,), name=f"api-run-{name}",
                     daemon=True).start()  # fmt: skip

    async def stream() -> AsyncIterator[bytes]:
        while (line := await lines.get()) is not None:
            yield line

    return StreamingResponse(stream(), media_type="application/x-ndjson")


async def _queued_run(
    ctx: Any, queue: Any, tenant: str, name: str, actor: Any
) -> AsyncIterator[bytes]:
    """A run handed to whichever node takes it (lifecycle/_queue.py), followed here:
    its output from the home's shared runs/ directory, then its record."""
    from proctor.lifecycle import Runs

    rid = await run_in_threadpool(queue.submit, tenant, name, actor)
    offsets = {"stdout": 0, "stderr": 0}
    while True:
        request = await run_in_threadpool(queue.get, rid)
        if request is not None and request.run_id is not None:
            run_dir = ctx.rt.home / "runs" / request.run_id
            for stream, offset in offsets.items():
                chunk = await run_in_threadpool(_read_at, run_dir / f"{stream}.log", offset)
                while chunk:
                    offsets[stream] += len(chunk)
                    doc = {"stream": stream, "data": chunk.decode("utf-8", errors="replace")}
                    yield json.dumps(doc).encode() + b"\n"
                    chunk = await run_in_threadpool(
                        _read_at, run_dir / f"{stream}.log", offsets[stream]
                    )
        if request is not None and request.state == "done":
            if request.error is not None:
                yield json.dumps(request.error).encode() + b"\n"
            else:
                record = await run_in_threadpool(Runs(ctx.rt).get, tenant, request.run_id)
                yield json.dumps({"run": record.as_json()}).encode() + b"\n"
            return
        await asyncio.sleep(0.1)


def _run(r: Any) -> RunOut:
    return RunOut(**r.as_json())


_STATUS_PATTERN = "^(" + "|".join(RUN_STATUSES) + ")$"


@router.get("/tenants/{tenant}/runs", response_model=list[RunOut], tags=["runs"])
def list_runs(
    ctx: CtxDep,
    tenant: str,
    deployment: Annotated[str | None, Query(max_length=63)] = None,
    status: Annotated[
        str | None, Query(pattern=_STATUS_PATTERN, description="Only runs in this state")
    ] = None,
    since: Annotated[
        str | None, Query(max_length=40, description="Only runs started at or after (ISO 8601)")
    ] = None,
    mine: Annotated[bool, Query(description="Only runs the caller started")] = False,
) -> list[RunOut]:
    """A tenant's runs, oldest first. ``mine``: those whose run.start event names the
    caller as the actor (who started a run is in the signed record, not the row)."""
    from proctor.ledger import EventFilter, iter_events
    from proctor.lifecycle import Runs

    ctx.authorize(Action.RUN_READ, tenant, f"tenant/{tenant}", _runs_ref(ctx, tenant))
    ctx.rt.tenants.get(tenant)
    after = parse_time(since, "since") if since else None
    rows = [r for r in Runs(ctx.rt).all(tenant, deployment, status)
            if after is None or r.started_at >= after]  # fmt: skip
    if mine:
        flt = EventFilter(action=Action.RUN_START, actor=ctx.principal.actor.id, since=after)
        started = {str(json.loads(e).get("run")) for e in iter_events(ctx.rt.ledger, tenant, flt)
                   if json.loads(e).get("decision") == "allow"}  # fmt: skip
        rows = [r for r in rows if r.id in started]
    return [_run(r) for r in rows]


@router.get("/tenants/{tenant}/runs/{run_id}", response_model=RunOut, tags=["runs"])
def get_run(ctx: CtxDep, tenant: str, run_id: str) -> RunOut:
    from proctor.lifecycle import Runs

    ctx.authorize(Action.RUN_READ, tenant, f"run/{run_id}", _runs_ref(ctx, tenant))
    return _run(Runs(ctx.rt).get(tenant, run_id))


def _authorize_output(ctx: Ctx, runs: Any, tenant: str, run_id: str) -> Any:
    """Decide a read of a run's output (``run.output.read``: what the run wrote may
    hold its data; an agent reads only its own runs'), recorded; the run's record."""
    from proctor.governance import run_events_context

    if ctx.principal.tenant != tenant:
        # Refused and recorded before any run of another tenant is looked up.
        ctx.authorize(Action.RUN_OUTPUT_READ, tenant, f"run/{run_id}", _runs_ref(ctx, tenant),
                      {"principal_is_creator": False})  # fmt: skip
    record = runs.get(tenant, run_id)
    context = run_events_context(ctx.rt.deployments, ctx.principal, record, ctx.rt.ledger)
    ctx.authorize(Action.RUN_OUTPUT_READ, tenant, f"run/{record.id}",
                  EntityRef.workload(record.workload), context)  # fmt: skip
    return record


_TEXT: dict[int | str, dict[str, Any]] = {
    200: {
        "content": {"text/plain": {"schema": {"type": "string"}}},
        "description": "The run's output, as it was written",
    }
}


@router.get(
    "/tenants/{tenant}/runs/{run_id}/logs",
    response_class=StreamingResponse,
    responses=_TEXT,
    tags=["runs"],
)
async def run_logs(
    ctx: CtxDep,
    tenant: str,
    run_id: str,
    stream: Annotated[str, Query(pattern="^(stdout|stderr)$")] = "stdout",
    follow: bool = False,
) -> StreamingResponse:
    """A run's stdout or stderr; with ``follow``, kept open until the run ends. A
    principal may follow a few logs at once (429 beyond)."""
    from proctor.lifecycle import Runs

    runs = Runs(ctx.rt)
    record = await run_in_threadpool(_authorize_output, ctx, runs, tenant, run_id)
    path = ctx.rt.home / "runs" / record.id / f"{stream}.log"
    release = ctx.state.principals.follow(ctx.principal) if follow else None

    async def tail() -> AsyncIterator[bytes]:
        # Waits with awaits between polls: a follow holds no worker thread while
        # its run is quiet, only for each short read.
        offset = 0
        try:
            while True:
                running = (
                    follow
                    and (await run_in_threadpool(runs.get, tenant, run_id)).status == "running"
                )
                chunk = await run_in_threadpool(_read_at, path, offset)
                while chunk:
                    offset += len(chunk)
                    yield chunk
                    chunk = await run_in_threadpool(_read_at, path, offset)
                if not running:
                    return
                await asyncio.sleep(0.2)
        finally:
            if release is not None:
                release()

    body = tail()
    if release is not None:
        # A stream never started (the client left first) runs no finally: the
        # follow is given back when the generator is collected.
        weakref.finalize(body, release)
    return StreamingResponse(body, media_type="text/plain")


def _read_at(path: Path, offset: int) -> bytes:
    try:
        with path.open("rb") as f:
            f.seek(offset)
            return f.read(64 * 1024)
    except FileNotFoundError:
        return b""


# -- history ------------------------------------------------------------------------


def parse_time(value: str, name: str) -> str:
    """An ISO 8601 date or time as the ledger's fixed-width UTC string."""
    try:
        dt = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError as exc:
        raise UsageError(f"{name}: {value!r} is not an ISO 8601 date or time") from exc
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=UTC)
    return dt.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


@router.get("/tenants/{tenant}/history", tags=["runs"])
def history(
    ctx: CtxDep,
    tenant: str,
    at: Annotated[str, Query(max_length=40, description="ISO 8601 time")],
    window_seconds: Annotated[float, Query(ge=0, le=31 * 86400)] = 3600.0,
) -> dict[str, Any]:
    """What ran here at time T: deployments in force, runs, digests, policies, approvers."""
    from proctor.lifecycle import what_ran

    ctx.authorize(Action.AUDIT_READ, tenant, f"tenant/{tenant}")
    when = parse_time(at, "at")
    report: dict[str, Any] = what_ran(ctx.rt, tenant, when, window_seconds)
    return report
