"""What an approver reads through the API: an artifact's files byte for byte, its
whole tree as a tar, and the review ``proctor approve`` shows before it asks.

Each is a read of the artifact (``artifact.read``), decided by Cedar for the
caller's tenant and recorded like every other; another tenant's artifact is
refused, never looked up. A digest may be any unique prefix (``Artifacts.get``).
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from typing import IO, Any

from fastapi import APIRouter
from fastapi.responses import Response, StreamingResponse

from proctor.api._errors import ERROR_RESPONSES
from proctor.api._models import ApprovalOut
from proctor.api._routes import CtxDep
from proctor.governance import predecessor_of
from proctor.ledger import Action
from proctor.policy import EntityRef

router = APIRouter(responses=ERROR_RESPONSES, tags=["artifacts"])

_CHUNK = 1 << 16


def _authorize(ctx: Any, tenant: str, digest: str) -> None:
    ctx.authorize(
        Action.ARTIFACT_READ, tenant, f"artifact/{digest[:200]}", EntityRef.artifact(tenant, "*")
    )


@router.get(
    "/tenants/{tenant}/artifacts/{digest}/files/{path:path}",
    response_class=Response,
    responses={200: {"content": {"application/octet-stream": {}, "text/plain": {}}}},
)
def artifact_file(ctx: CtxDep, tenant: str, digest: str, path: str) -> Response:
    """The exact bytes of one file of the artifact, verified against its hash:
    ``text/plain; charset=utf-8`` when it is UTF-8 text, else ``application/octet-stream``."""
    _authorize(ctx, tenant, digest)
    arts = ctx.rt.artifacts
    full = arts.get(tenant, digest).digest
    data = arts.read_file(tenant, full, path)
    text = b"\x00" not in data[:8192]
    if text:
        try:
            data.decode("utf-8")
        except UnicodeDecodeError:
            text = False
    return Response(
        content=data,
        media_type="text/plain; charset=utf-8" if text else "application/octet-stream",
        # Never rendered by a browser as a page of the API's origin.
        headers={"x-proctor-digest": full, "x-content-type-options": "nosniff",
                 "content-disposition": "attachment"},
    )  # fmt: skip


@router.get(
    "/tenants/{tenant}/artifacts/{digest}/tar",
    response_class=StreamingResponse,
    responses={200: {"content": {"application/x-tar": {}}}},
)
def artifact_tar(ctx: CtxDep, tenant: str, digest: str) -> StreamingResponse:
    """The artifact's exact tree as a tar: submitting what it extracts to gives the same
    digest. Built (and every blob verified) before the first byte is sent, so an error
    is an error status, never a cut tar."""
    _authorize(ctx, tenant, digest)
    spool = tempfile.SpooledTemporaryFile(max_size=1 << 20)  # noqa: SIM115 - closed by _chunks
    try:
        full = ctx.rt.artifacts.write_tar(tenant, digest, spool).digest  # type: ignore[arg-type]
        spool.seek(0)
    except BaseException:
        spool.close()
        raise
    name = full.removeprefix("sha256:")[:16]
    return StreamingResponse(
        _chunks(spool),
        media_type="application/x-tar",
        headers={"x-proctor-digest": full,
                 "content-disposition": f'attachment; filename="artifact-{name}.tar"'},
    )  # fmt: skip


def _chunks(spool: IO[bytes]) -> Iterator[bytes]:
    try:
        while chunk := spool.read(_CHUNK):
            yield chunk
    finally:
        spool.close()


@router.get("/tenants/{tenant}/artifacts/{digest}/review")
def artifact_review(ctx: CtxDep, tenant: str, digest: str) -> dict[str, Any]:
    """What ``proctor approve`` shows before it asks: the capabilities in words, the
    purpose, the files, the sandbox runs of this digest with their calls and refusals
    (refusals first), and the approvals given so far."""
    _authorize(ctx, tenant, digest)
    doc = ctx.rt.artifacts.review(tenant, digest)
    doc["approvals"] = [a.as_json() for a in ctx.rt.approvals.for_artifact(tenant, doc["digest"])]
    # The approver's first question about a new version: what was approved before it.
    doc["approved_predecessor"] = predecessor_of(ctx.rt.artifacts, ctx.rt.approvals, tenant, doc)
    return doc


@router.get("/tenants/{tenant}/approvals", response_model=list[ApprovalOut], tags=["approvals"])
def list_all_approvals(ctx: CtxDep, tenant: str) -> list[ApprovalOut]:
    """Every approval and rejection of the tenant's artifacts, oldest first."""
    ctx.authorize(Action.ARTIFACT_READ, tenant, f"tenant/{tenant}", EntityRef.artifact(tenant, "*"))
    ctx.rt.tenants.get(tenant)
    found = [a for art in ctx.rt.artifacts.list(tenant)
             for a in ctx.rt.approvals.for_artifact(tenant, art.digest)]  # fmt: skip
    return [ApprovalOut(**a.as_json()) for a in sorted(found, key=lambda a: (a.created_at, a.id))]
