"""Single calls waiting for a person's approval (``ask`` capabilities): list,
show, approve, deny.

Reading them is reading the tenant's runs (``run.read``); answering is
``call.answer``, decided by the role policy (the approver role; never the author
of the code the run runs) and refused to an agent, each refusal recorded. Exactly
one answer counts (``governance._asks``): a later one is 409 ``already_answered``
and is not recorded as an answer.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query
from pydantic import BaseModel, Field

from proctor.api._context import Ctx, current
from proctor.api._errors import ERROR_RESPONSES
from proctor.api._models import Strict
from proctor.errors import NotFound
from proctor.governance import Ask, Asks
from proctor.ledger import Action
from proctor.policy import EntityRef

router = APIRouter(responses=ERROR_RESPONSES)
CtxDep = Annotated[Ctx, Depends(current)]

_STATES = "^(pending|approved|denied|timed_out|abandoned)$"


class AskOut(BaseModel):
    id: str
    tenant: str
    run: str
    deployment: str
    artifact: str | None
    action: str = Field(description="The call's action: http.request, file.write, sql.write")
    resource: str
    arguments: dict[str, Any] = Field(description="The call's exact arguments")
    state: str = Field(description="pending, approved, denied, timed_out or abandoned")
    created_at: str
    deadline: str
    ask_seq: int | None = Field(description="The seq of its call.ask event")
    answered_by: str | None
    answered_at: str | None
    answer_seq: int | None = Field(description="The seq of its call.answer event")
    comment: str | None


class AnswerIn(Strict):
    comment: str = Field(default="", max_length=2000, description="Why, for the record")


def _asks(ctx: Ctx) -> Asks:
    return ctx.rt.asks


def _runs_ref(ctx: Ctx, tenant: str) -> EntityRef:
    return EntityRef.workload(f"spiffe://{ctx.rt.config.trust_domain}/tenant/{tenant}/*")


def _out(ask: Ask) -> AskOut:
    return AskOut(**ask.to_json())


@router.get("/tenants/{tenant}/asks", response_model=list[AskOut], tags=["asks"])
def list_asks(
    ctx: CtxDep,
    tenant: str,
    run: Annotated[str | None, Query(max_length=64, description="Only this run's")] = None,
    state: Annotated[str | None, Query(pattern=_STATES, description="Only in this state")] = None,
) -> list[AskOut]:
    """The tenant's asked calls, pending first, newest first."""
    ctx.authorize(Action.RUN_READ, tenant, f"tenant/{tenant}", _runs_ref(ctx, tenant))
    return [_out(a) for a in _asks(ctx).find(tenant, run=run, state=state)]


@router.get("/tenants/{tenant}/asks/{ask_id}", response_model=AskOut, tags=["asks"])
def get_ask(ctx: CtxDep, tenant: str, ask_id: str) -> AskOut:
    """One asked call: the run, the call and its exact arguments, its answer."""
    ctx.authorize(Action.RUN_READ, tenant, f"ask/{ask_id}", _runs_ref(ctx, tenant))
    return _out(_asks(ctx).get(tenant, ask_id))


def _answer(ctx: Ctx, tenant: str, ask_id: str, approve: bool, comment: str) -> AskOut:
    p = ctx.principal
    if tenant != p.tenant:
        # Another tenant's asks are nobody's here: refused and recorded like any
        # cross-tenant request (the role policy permits nothing outside one's tenant).
        ctx.authorize(Action.CALL_ANSWER, tenant, f"ask/{ask_id}", _runs_ref(ctx, tenant),
                      {"principal_is_author": False})  # fmt: skip
        raise NotFound(f"no ask {ask_id!r} in tenant {tenant!r}")
    ask = _asks(ctx).answer(tenant, ask_id, approve, actor=p.actor, principal=p,
                            comment=comment, trust_domain=ctx.rt.config.trust_domain)  # fmt: skip
    return _out(ask)


@router.post("/tenants/{tenant}/asks/{ask_id}/approve", response_model=AskOut, tags=["asks"])
def approve_ask(ctx: CtxDep, tenant: str, ask_id: str, body: AnswerIn) -> AskOut:
    """Approve the asked call: it goes on (an approver who is not the code's author;
    never an agent). 409 ``already_answered`` if it has its one answer already."""
    return _answer(ctx, tenant, ask_id, True, body.comment)


@router.post("/tenants/{tenant}/asks/{ask_id}/deny", response_model=AskOut, tags=["asks"])
def deny_ask(ctx: CtxDep, tenant: str, ask_id: str, body: AnswerIn) -> AskOut:
    """Deny the asked call: it is refused, naming this answer's event."""
    return _answer(ctx, tenant, ask_id, False, body.comment)
