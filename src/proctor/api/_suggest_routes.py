"""The least-privilege manifest a sandbox run's calls and refusals call for."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Path
from pydantic import BaseModel, Field

from proctor.api._context import Ctx, current
from proctor.api._errors import ERROR_RESPONSES
from proctor.api._log import _authorize_events

router = APIRouter(responses=ERROR_RESPONSES)
CtxDep = Annotated[Ctx, Depends(current)]


class SuggestedLine(BaseModel):
    line: str = Field(description="The TOML line as the diff shows it")
    change: str = Field(description="added or removed")
    where: str = Field(description="The TOML table the line is in")
    reason: str = Field(description="Why: the call that needed it, or that no call used it")
    seq: int | None = Field(description="The event (its seq in the tenant's log) that needed it")


class NotSuggestable(BaseModel):
    seq: int
    action: str
    resource: str
    reason: str = Field(description="The event's reason")
    why: str = Field(description="Why no manifest line would lift the refusal")


class SuggestionOut(BaseModel):
    run: str
    tenant: str
    digest: str = Field(description="The run's artifact, whose manifest is the diff's base")
    environment: str
    status: str
    partial: bool = Field(description="The run is still running, or some events were pruned")
    manifest: str = Field(description="The suggested proctor.toml")
    diff: str = Field(description="Unified diff: the submitted manifest to the suggested one")
    lines: list[SuggestedLine]
    not_suggestable: list[NotSuggestable]
    notes: list[str]
    events: int = Field(description="How many of the run's events were read")


@router.get(
    "/tenants/{tenant}/runs/{run_id}/suggested-manifest",
    response_model=SuggestionOut,
    tags=["runs"],
)
def suggested_manifest(
    ctx: CtxDep,
    tenant: str,
    run_id: Annotated[str, Path(min_length=1, max_length=200, description="Any unique prefix")],
) -> dict[str, Any]:
    """The least-privilege manifest the run's calls and refusals call for: the tables
    and columns read and written, the hosts called, the buckets and modes, the secrets
    injected, as TOML and as a diff against its artifact's manifest, each added or
    removed line with its reason and the event that needed it. Decided and recorded as
    a read of the run's events (``run.events.read``: an auditor, or whoever made the
    run's deployment); another tenant's run is not found."""
    from proctor.governance import suggest_for
    from proctor.lifecycle import Runs

    full = _authorize_events(ctx, tenant, run_id)
    assert full is not None
    record = Runs(ctx.rt).get(tenant, full)
    return suggest_for(ctx.rt, record).to_json()
