"""Retention, legal holds and erasure over HTTP (issue 20): ``proctor retention``,
``proctor hold`` and ``proctor erase`` with ``--server``, and the SDK's calls.

Each request is decided by Cedar (``retention.read``: auditors and admins;
``retention.manage`` and ``erasure.request``: admins only) and recorded in the
caller's tenant log as an ``api.request`` event, like every other control-plane
route; the change itself is its own event (``retention.set``, ``hold.add``, ...).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Query
from pydantic import Field

from proctor.api._context import Ctx, current
from proctor.api._errors import ERROR_RESPONSES
from proctor.api._models import Strict
from proctor.governance import Retention, erase_key, record_key_hmac
from proctor.ledger import Action

router = APIRouter(responses=ERROR_RESPONSES, tags=["retention"])
CtxDep = Annotated[Ctx, Depends(current)]


class RetentionIn(Strict):
    days: int = Field(ge=1, le=36_500)
    below_legal_minimum: str | None = Field(default=None, min_length=1, max_length=512)


class HoldIn(Strict):
    scope: Literal["tenant", "deployment", "run"]
    # A run id or deployment name, or a unique prefix of one: Retention.add_hold
    # resolves it as the CLI does (404 unknown, 400 ambiguous) and stores the full id.
    target: str | None = Field(default=None, min_length=1, max_length=200)
    reason: str = Field(min_length=1, max_length=512)


def _retention(ctx: Ctx) -> Retention:
    return Retention(ctx.rt.store, ctx.rt.ledger)


@router.get("/tenants/{tenant}/retention")
def show_retention(ctx: CtxDep, tenant: str) -> dict[str, Any]:
    """The rule in force (or none: kept forever), the active holds, and the record of
    rule changes, holds, prunes and erasures."""
    ctx.authorize(Action.RETENTION_READ, tenant, f"tenant/{tenant}")
    r = _retention(ctx)
    rule = r.rule(tenant)
    return {
        "tenant": tenant,
        "rule": None if rule is None else rule.as_json(),
        "holds": [h.as_json() for h in r.holds(tenant)],
        "history": r.history(tenant),
    }


@router.put("/tenants/{tenant}/retention")
def set_retention(ctx: CtxDep, tenant: str, body: RetentionIn) -> dict[str, Any]:
    """Set the period; under 183 days only with ``below_legal_minimum`` (recorded)."""
    ctx.authorize(Action.RETENTION_MANAGE, tenant, f"tenant/{tenant}")
    rule = _retention(ctx).set(
        tenant, body.days, ctx.principal.actor, below_legal_minimum=body.below_legal_minimum
    )
    return rule.as_json()


@router.post("/tenants/{tenant}/retention/prune")
def prune(ctx: CtxDep, tenant: str) -> dict[str, Any]:
    """Prune now what is past the period and under no hold."""
    ctx.authorize(Action.RETENTION_MANAGE, tenant, f"tenant/{tenant}")
    return _retention(ctx).prune(tenant, ctx.principal.actor).as_json()


@router.get("/tenants/{tenant}/holds")
def list_holds(
    ctx: CtxDep, tenant: str, all_: Annotated[bool, Query(alias="all")] = False
) -> list[dict[str, Any]]:
    ctx.authorize(Action.RETENTION_READ, tenant, f"tenant/{tenant}")
    return [h.as_json() for h in _retention(ctx).holds(tenant, all_=all_)]


@router.post("/tenants/{tenant}/holds")
def add_hold(ctx: CtxDep, tenant: str, body: HoldIn) -> dict[str, Any]:
    """Suspend pruning of the tenant's log, or of one deployment's or run's events."""
    ctx.authorize(Action.RETENTION_MANAGE, tenant, f"tenant/{tenant}")
    hold = _retention(ctx).add_hold(tenant, body.scope, body.target, body.reason,
                                    ctx.principal.actor)  # fmt: skip
    return hold.as_json()


@router.delete("/tenants/{tenant}/holds/{hold_id}")
def remove_hold(ctx: CtxDep, tenant: str, hold_id: str) -> dict[str, Any]:
    ctx.authorize(Action.RETENTION_MANAGE, tenant, f"hold/{hold_id}"[:200])
    return _retention(ctx).remove_hold(tenant, hold_id, ctx.principal.actor).as_json()


class ErasureIn(Strict):
    dataset: str = Field(min_length=1, max_length=63)
    key: str = Field(min_length=1, max_length=4096, description="the record's key, as lineage")
    request_ref: str = Field(min_length=1, max_length=128)


@router.post("/tenants/{tenant}/erasures")
def erase(ctx: CtxDep, tenant: str, body: ErasureIn) -> dict[str, Any]:
    """Erase one record key from the lineage record (``proctor erase``). The key is
    used to compute its keyed hash and is recorded nowhere."""
    ctx.authorize(Action.ERASURE_REQUEST, tenant, f"dataset/{body.dataset}")
    ctx.rt.tenants.get(tenant)
    hashed = record_key_hmac(ctx.rt.keys.lineage_key(tenant), body.key)
    result = erase_key(ctx.rt.store, ctx.rt.ledger, tenant, body.dataset, hashed,
                       body.request_ref, ctx.principal.actor)  # fmt: skip
    return result.as_json()
