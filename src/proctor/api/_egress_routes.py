"""Private upstreams over HTTP (issue 17): the CA certificates a tenant registers for
named hosts, ``proctor egress ca`` with ``--server`` and the SDK's calls.

Registering a CA decides which upstream a secret may be sent to, so it is decided
as a change of the tenant's policy (``policy.set``: admins); reading them as a read
of the tenant (``tenant.read``). Each request is recorded in the caller's tenant
log as an ``api.request`` event, like every other control-plane route; the change
itself is its own event (``egress.ca.add``, ``egress.ca.remove``).
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query
from pydantic import BaseModel, Field

from proctor.api._context import Ctx, current
from proctor.api._errors import ERROR_RESPONSES
from proctor.api._models import Strict
from proctor.governance import MAX_HOST_CAS
from proctor.ledger import Action

router = APIRouter(responses=ERROR_RESPONSES, tags=["egress"])
CtxDep = Annotated[Ctx, Depends(current)]

#: As ``governance.read_ca_pem`` takes (64 KiB), in characters of PEM text.
_MAX_PEM = 64 * 1024


class EgressCAIn(Strict):
    pem: str = Field(
        min_length=1,
        max_length=_MAX_PEM,
        description=f"PEM CA certificate(s) (basicConstraints CA:TRUE), at most {MAX_HOST_CAS}",
    )


class RegisteredCAOut(BaseModel):
    fingerprint: str = Field(description="SHA-256 of the certificate (DER), hex")
    subject: str
    not_after: str
    added_at: str
    added_by: str


class HostCAsOut(BaseModel):
    host: str
    cas: list[RegisteredCAOut]


def _out(doc: dict[str, Any]) -> HostCAsOut:
    return HostCAsOut.model_validate(doc)


def _event_resource(host: str) -> str:
    return f"egress-ca/{host}"[:200]


@router.get("/tenants/{tenant}/egress/cas", response_model=list[HostCAsOut])
def list_egress_cas(ctx: CtxDep, tenant: str) -> list[HostCAsOut]:
    """The hosts whose certificates are verified against CA certificates the tenant
    registered, and those certificates (never a key: none is ever taken)."""
    ctx.authorize(Action.TENANT_READ, tenant, f"tenant/{tenant}")
    return [_out(h.to_json()) for h in ctx.rt.host_cas(tenant)]


@router.post("/tenants/{tenant}/egress/cas/{host}", response_model=HostCAsOut)
def add_egress_ca(ctx: CtxDep, tenant: str, host: str, body: EgressCAIn) -> HostCAsOut:
    """Register CA certificates for ``host``: where the broker ends TLS to it (a secret
    injected), its certificate is verified against them alone, not the system's roots."""
    ctx.authorize(Action.POLICY_SET, tenant, _event_resource(host))
    found = ctx.rt.add_host_ca(tenant, host, body.pem.encode("utf-8"), ctx.principal.actor,
                               "the pem field")  # fmt: skip
    return _out(found.to_json())


@router.delete("/tenants/{tenant}/egress/cas/{host}", response_model=HostCAsOut)
def remove_egress_ca(
    ctx: CtxDep,
    tenant: str,
    host: str,
    fingerprint: Annotated[str | None, Query(max_length=100)] = None,
) -> HostCAsOut:
    """Remove ``host``'s CA certificates (only the one of ``fingerprint``, if given);
    the answer is what is left."""
    ctx.authorize(Action.POLICY_SET, tenant, _event_resource(host))
    left = ctx.rt.remove_host_ca(tenant, host, ctx.principal.actor, fingerprint)
    return _out(left.to_json())
