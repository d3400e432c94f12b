"""The operator's probes: liveness (``/healthz``) and readiness (``/readyz``).

Both need no credential and reveal nothing of any tenant."""

from __future__ import annotations

from fastapi import APIRouter

from proctor import __version__
from proctor.api._models import HealthOut

router = APIRouter()


@router.get("/healthz", response_model=HealthOut, tags=["meta"])
def healthz() -> HealthOut:
    """Liveness; needs no credential and reveals nothing of any tenant."""
    return HealthOut(status="ok", version=__version__)
