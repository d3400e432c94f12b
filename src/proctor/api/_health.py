"""The operator's probes: liveness (``/healthz``) and readiness (``/readyz``).

Both need no credential and reveal nothing of any tenant. ``/readyz`` runs the
readiness checks (``proctor.lifecycle.Health``: the store writes, the ledger
appends, the sandbox backend starts, the witnessed logs are within their max
age, the keys load, this node holds its lease) and answers each check's name, and
for a failing one its reason and fix, in words that name no tenant, file, host or
raw error: the kubelet that asks has no token, and tenants are not told apart
across the boundary (an unknown tenant and another's are the same 404). Which
tenant's witnesses are stale, and the error itself, are for the operator of the
machine: ``proctor doctor`` prints them."""

from __future__ import annotations

import threading
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field

from proctor import __version__
from proctor.api._errors import ERROR_RESPONSES, ApiError
from proctor.api._models import HealthOut
from proctor.lifecycle import CHECKS, DOCTOR_HINT, Health

router = APIRouter()

_made = threading.Lock()


class CheckOut(BaseModel):
    name: str = Field(description="store, ledger, sandbox, witnesses, keys or node")
    ok: bool
    detail: str = Field(description="What was checked, and found")
    reason: str | None = Field(None, description="Why not ready (a failing check only)")
    fix: str | None = Field(None, description="What fixes it (a failing check only)")


class ReadyOut(BaseModel):
    status: str = Field(description="ready or not_ready")
    version: str
    checks: list[CheckOut]
    excluded: list[str] = Field(default_factory=list, description="Checks left out (?exclude=)")
    hint: str | None = Field(None, description="Where the operator learns more (not ready only)")


@router.get("/healthz", response_model=HealthOut, tags=["meta"])
def healthz() -> HealthOut:
    """Liveness; needs no credential and reveals nothing of any tenant."""
    return HealthOut(status="ok", version=__version__)


def _health(request: Request) -> Health:
    app_state = request.app.state
    with _made:
        health: Health | None = getattr(app_state, "proctor_health", None)
        if health is None:
            state = app_state.proctor

            def driver() -> Any:
                # The driver runs use: serve's supervisor's, else the backend the API
                # was given (None: the best this host has, as its first run picks).
                if state.supervisor is not None:
                    return state.supervisor.driver
                return state.backend

            def node() -> str | None:
                sup = state.supervisor
                return None if sup is None else str(sup.supervisor_id)

            health = Health(state.rt, driver=driver, node=node)
            app_state.proctor_health = health
    return health


@router.get(
    "/readyz",
    response_model=ReadyOut,
    tags=["meta"],
    responses={
        400: ERROR_RESPONSES[400],
        422: ERROR_RESPONSES[422],
        503: {"model": ReadyOut, "description": "Not ready: the failing checks say why"},
    },
)
def readyz(
    request: Request,
    exclude: Annotated[
        list[str] | None,
        Query(
            description="Leave this check out (repeatable): e.g. `witnesses`, which "
            "every node shares, so that a stale witness is alerted on rather than taking "
            "every node out of service"
        ),
    ] = None,
) -> JSONResponse:
    """Readiness: 200 when every check passes, 503 naming each failing check's reason
    and fix. Needs no credential and names no tenant, file or host."""
    left_out = sorted(set(exclude or ()))
    unknown = [name for name in left_out if name not in CHECKS]
    if unknown:
        # A probe's typo is refused, not taken as nothing to leave out: its 400 shows.
        raise ApiError(400, "invalid_request", f"no readiness check {unknown[0]!r}",
                       hint=f"the checks are {', '.join(CHECKS)}")  # fmt: skip
    result = _health(request).check()
    checks = [c for c in result.checks if c.name not in left_out]
    ready = all(c.ok for c in checks)
    doc = ReadyOut(status="ready" if ready else "not_ready", version=__version__,
                   checks=[CheckOut(**c.as_json()) for c in checks], excluded=left_out,
                   hint=None if ready else DOCTOR_HINT)  # fmt: skip
    return JSONResponse(doc.model_dump(), status_code=200 if ready else 503,
                        headers={"Cache-Control": "no-store"})  # fmt: skip
