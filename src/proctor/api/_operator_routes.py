"""Operators' routes: a bucket's objects (list, get, put) and a run's signed receipt.
Each handler authorizes first (``Ctx.authorize``, recorded), then calls the runtime
exactly as the CLI does."""

from __future__ import annotations

import hashlib
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import Response
from pydantic import BaseModel

from proctor.api._context import Ctx, current
from proctor.api._errors import ERROR_RESPONSES
from proctor.errors import UsageError
from proctor.governance import MAX_OBJECT_BYTES, BucketObject, bucket_problem
from proctor.ledger import Action
from proctor.policy import EntityRef

router = APIRouter(responses=ERROR_RESPONSES)
CtxDep = Annotated[Ctx, Depends(current)]


class ObjectOut(BaseModel):
    key: str
    size: int
    sha256: str
    modified: str


def _object(o: BucketObject) -> ObjectOut:
    return ObjectOut(key=o.key, size=o.size, sha256=o.sha256, modified=o.modified)


def _authorize_bucket(ctx: Ctx, action: str, tenant: str, bucket: str, what: str) -> None:
    problem = bucket_problem(bucket)
    if problem is not None:
        raise UsageError(f"bucket {bucket[:64]!r}: {problem}")
    ctx.authorize(action, tenant, what, EntityRef.bucket(tenant, bucket))


_BYTES: dict[int | str, dict[str, Any]] = {
    200: {
        "content": {"application/octet-stream": {"schema": {"type": "string"}}},
        "description": "The object's exact bytes (X-Object-Sha256 carries their SHA-256)",
    }
}


@router.get(
    "/tenants/{tenant}/buckets/{bucket}/objects",
    response_model=list[ObjectOut],
    tags=["resources"],
)
def list_objects(ctx: CtxDep, tenant: str, bucket: str) -> list[ObjectOut]:
    """The bucket's objects: key, size, SHA-256, modified (UTC)."""
    _authorize_bucket(ctx, Action.BUCKET_READ, tenant, bucket, f"bucket/{bucket}")
    return [_object(o) for o in ctx.rt.resources.objects(tenant, bucket, ctx.principal.actor)]


@router.get(
    "/tenants/{tenant}/buckets/{bucket}/objects/{key:path}",
    response_class=Response,
    responses=_BYTES,
    tags=["resources"],
)
def get_object(ctx: CtxDep, tenant: str, bucket: str, key: str) -> Response:
    """One object's exact bytes; the read is recorded with their SHA-256 and size."""
    _authorize_bucket(ctx, Action.BUCKET_READ, tenant, bucket, f"bucket/{bucket}/{key}")
    data = ctx.rt.resources.get_object(tenant, bucket, key, ctx.principal.actor)
    return Response(
        data,
        media_type="application/octet-stream",
        headers={"X-Object-Sha256": hashlib.sha256(data).hexdigest()},
    )


@router.put(
    "/tenants/{tenant}/buckets/{bucket}/objects/{key:path}",
    response_model=ObjectOut,
    tags=["resources"],
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {"application/octet-stream": {"schema": {"type": "string"}}},
        }
    },
)
async def put_object(ctx: CtxDep, request: Request, tenant: str, bucket: str, key: str) -> Any:
    """Write an object (the body, as is); recorded with its SHA-256 and size before it
    becomes visible. Admins only, by the role policy."""
    await run_in_threadpool(
        _authorize_bucket, ctx, Action.BUCKET_WRITE, tenant, bucket, f"bucket/{bucket}/{key}"
    )
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_OBJECT_BYTES:
            raise UsageError(f"the object is larger than {MAX_OBJECT_BYTES} bytes")
        chunks.append(chunk)
    written = await run_in_threadpool(
        ctx.rt.resources.put_object, tenant, bucket, key, b"".join(chunks), ctx.principal.actor
    )
    return _object(written)


_RECEIPT: dict[int | str, dict[str, Any]] = {
    200: {
        "content": {"text/plain": {"schema": {"type": "string"}}},
        "description": "The run's signed receipt (C2SP tlog-proof), exactly as written",
    }
}


@router.get(
    "/tenants/{tenant}/runs/{run_id}/receipt",
    response_class=Response,
    responses=_RECEIPT,
    tags=["runs"],
)
def get_receipt(ctx: CtxDep, tenant: str, run_id: str) -> Response:
    """A production run's signed receipt; ``proctor receipt verify`` checks it offline."""
    from proctor.lifecycle import run_receipt

    ref = EntityRef.workload(f"spiffe://{ctx.rt.config.trust_domain}/tenant/{tenant}/*")
    ctx.authorize(Action.RUN_READ, tenant, f"run/{run_id}", ref)
    text = run_receipt(ctx.rt, tenant, run_id)
    return Response(text, media_type="text/plain; charset=utf-8")
