"""Agents' routes (issue 35): approval requests for an artifact and where its approval
stands, and a dataset's description (tables, columns, types; never a row).

Each is decided by the role policy like every route (``Ctx.authorize``) and recorded:
an agent or a developer may ask the approvers (``approval.request``); anyone who may
read artifacts may read the approval state; developers, agents, auditors and admins
may describe a tenant's datasets (``dataset.describe``)."""

from __future__ import annotations

import contextlib
from typing import Annotated, Any

from fastapi import APIRouter, Depends
from pydantic import BaseModel, Field

from proctor.api._context import Ctx, bound
from proctor.api._errors import ERROR_RESPONSES
from proctor.api._models import Strict
from proctor.errors import ProctorError
from proctor.ledger import Action
from proctor.policy import EntityRef

router = APIRouter(responses=ERROR_RESPONSES)
CtxDep = Annotated[Ctx, Depends(bound)]


class ApprovalRequestIn(Strict):
    comment: str = Field(default="", max_length=2000, description="What to look at, and why")


class ApprovalRequestOut(BaseModel):
    id: str
    tenant: str
    digest: str
    principal: str
    comment: str
    created_at: str
    seq: int


def _artifact_ref(tenant: str, digest: str) -> EntityRef:
    try:
        return EntityRef.artifact(tenant, digest if len(digest) <= 200 else "*")
    except ProctorError:
        return EntityRef.artifact(tenant, "*")


@router.post(
    "/tenants/{tenant}/artifacts/{digest}/approval-requests",
    response_model=ApprovalRequestOut,
    status_code=201,
    tags=["approvals"],
)
def request_approval(
    ctx: CtxDep, tenant: str, digest: str, body: ApprovalRequestIn
) -> ApprovalRequestOut:
    """Ask the tenant's approvers to approve the artifact (an agent's or a developer's
    request, with a comment): recorded as an ``approval.request`` event. It approves
    nothing: a person approves."""
    ctx.authorize(Action.APPROVAL_REQUEST, tenant, f"artifact/{digest}",
                  _artifact_ref(tenant, digest))  # fmt: skip
    req = ctx.rt.approvals.request(
        tenant, digest, ctx.principal.actor, body.comment,
        details={"request_id": ctx.request_id, **ctx.event_details()},
    )  # fmt: skip
    return ApprovalRequestOut(**req.as_json())


@router.get("/tenants/{tenant}/artifacts/{digest}/approval-state", tags=["approvals"])
def approval_state(ctx: CtxDep, tenant: str, digest: str) -> dict[str, Any]:
    """Where the artifact's approval stands: who asked and when, the approvals and
    rejections in force and who made them, which of them count, the quorum the tenant
    needs, and whether production would run it now (and if not, why)."""
    ctx.authorize(Action.ARTIFACT_READ, tenant, f"artifact/{digest}",
                  _artifact_ref(tenant, digest))  # fmt: skip
    state: dict[str, Any] = ctx.rt.approvals.state(tenant, digest).as_json()
    return state


@router.get("/tenants/{tenant}/datasets/{name}/schema", tags=["resources"])
def describe_dataset(ctx: CtxDep, tenant: str, name: str) -> dict[str, Any]:
    """A dataset's tables and views, their columns and declared types, read from the
    database's own catalog; never a row, and never where the dataset is."""
    ref = EntityRef.dataset(tenant, "*")
    with contextlib.suppress(ProctorError):
        ref = EntityRef.dataset(tenant, name)
    ctx.authorize(Action.DATASET_DESCRIBE, tenant, f"dataset/{name}", ref)
    details = {"request_id": ctx.request_id, **ctx.event_details()}
    return ctx.rt.describe_dataset(tenant, name, ctx.principal.actor, ctx.principal.tenant,
                                   details)  # fmt: skip
