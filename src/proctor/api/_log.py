"""The audit ledger over HTTP: events, checkpoints, proofs, verification, export, and
the C2SP tlog-tiles read paths (``log/checkpoint``, ``log/tile/<L>/<N>[.p/<W>]``,
``log/tile/entries/<N>[.p/<W>]``) so that standard tlog clients can read a tenant's
log. Reading a log is ``audit.read`` and, like every request, recorded; reads through
the tlog-tiles paths are counted in the system log instead of the log read
(``_log_reads``), and may be served without a token for a tenant the server mirrors
publicly (``proctor serve --public-log``)."""

from __future__ import annotations

import asyncio
import base64
import gzip
import io
import json
import shutil
import tarfile
import tempfile
import weakref
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query, Request, Security
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import Response, StreamingResponse
from fastapi.security import HTTPAuthorizationCredentials

from proctor.api._context import ApiState, Ctx, _bearer, current
from proctor.api._errors import ERROR_RESPONSES, ApiError
from proctor.api._models import CheckpointOut, ConsistencyOut, InclusionOut, VerifyOut
from proctor.api._routes import parse_time
from proctor.errors import UsageError
from proctor.ledger import (
    SYSTEM_LOG,
    Action,
    Actor,
    EventDraft,
    EventFilter,
    Ledger,
    parse_tile_path,
    query_events,
)
from proctor.policy import EntityRef
from proctor.witness import TenantWitnesses

router = APIRouter(responses=ERROR_RESPONSES, tags=["audit"])
CtxDep = Annotated[Ctx, Depends(current)]

TILE_WIDTH = 256
_HASH = 32
_MAX_EVENTS = 10_000
_FOLLOW_POLL = 0.2  # seconds between reads of a quiet log


def _read(ctx: Ctx, tenant: str) -> None:
    ctx.authorize(Action.AUDIT_READ, tenant, f"log/{tenant}")


RunQ = Annotated[
    str | None,
    Query(min_length=1, max_length=200, description="Only this run's events (any unique prefix)"),
]
ActionQ = Annotated[str | None, Query(min_length=1, max_length=200, description="Only this action")]
ActorQ = Annotated[
    str | None,
    Query(min_length=1, max_length=200, description="Only this actor's (its id, exactly)"),
]
DecisionQ = Annotated[
    str | None, Query(pattern="^(allow|deny)$", description="Only allowed or denied calls")
]


def _authorize_events(ctx: Ctx, tenant: str, run: str | None) -> str | None:
    """Decide a read of the log (``audit.read``) or of one run's events
    (``run.events.read``: an auditor, or the developer who created the run's
    deployment); returns the run's full id. Either way decided and recorded."""
    if run is None:
        _read(ctx, tenant)
        return None
    if ctx.principal.tenant != tenant:
        # Refused and recorded before any run of another tenant is looked up.
        every = EntityRef.workload(f"spiffe://{ctx.rt.config.trust_domain}/tenant/{tenant}/*")
        ctx.authorize(
            Action.RUN_EVENTS_READ, tenant, f"run/{run}", every, {"principal_is_creator": False}
        )
    from proctor.governance import run_events_context
    from proctor.lifecycle import Runs

    record = Runs(ctx.rt).get(tenant, run)
    context = run_events_context(ctx.rt.deployments, ctx.principal, record, ctx.rt.ledger)
    ctx.authorize(
        Action.RUN_EVENTS_READ,
        tenant,
        f"run/{record.id}",
        EntityRef.workload(record.workload),
        context,
    )
    return record.id


def _filter(
    run: str | None, action: str | None, decision: str | None,
    since: str | None, until: str | None, actor: str | None = None,
) -> EventFilter:  # fmt: skip
    lo = parse_time(since, "since") if since else None
    hi = parse_time(until, "until") if until else None
    return EventFilter(run=run, action=action, decision=decision, since=lo, until=hi,
                       actor=actor)  # fmt: skip


@router.get(
    "/tenants/{tenant}/events",
    response_class=Response,
    responses={
        200: {
            "content": {"application/x-ndjson": {"schema": {"type": "string"}}},
            "description": "Events as hashed (RFC 8785), one per line",
        }
    },
)
def events(
    ctx: CtxDep,
    tenant: str,
    start: Annotated[int, Query(ge=0, le=2**62, description="First sequence number")] = 0,
    limit: Annotated[int, Query(ge=1, le=_MAX_EVENTS)] = 1000,
    since: Annotated[str | None, Query(max_length=40, description="ISO 8601, inclusive")] = None,
    until: Annotated[str | None, Query(max_length=40, description="ISO 8601, exclusive")] = None,
    run: RunQ = None,
    action: ActionQ = None,
    decision: DecisionQ = None,
    actor: ActorQ = None,
    newest: Annotated[
        bool, Query(description="The newest ``limit`` matches instead of a page from ``start``")
    ] = False,
) -> Response:
    """A page of the log's events, the canonical bytes exactly as hashed, filtered by
    run, action, actor, decision and time (the filters combine). The header ``X-Next-Start``
    gives ``start`` for the next page when there may be more. A developer may read
    the events of a run of a deployment they created (``run=``), nothing else."""
    flt = _filter(run, action, decision, since, until, actor)
    run_id = _authorize_events(ctx, tenant, run)
    if run_id is not None:
        flt = replace(flt, run=run_id)
    ledger = ctx.rt.ledger
    if newest:
        out = query_events(ledger, tenant, flt, limit=limit, newest=True, start=start)
        return Response(b"".join(d + b"\n" for d in out), media_type="application/x-ndjson")
    # One page of sequence numbers at most is scanned per call (a filtered read of a
    # long log is paged by the client through X-Next-Start, never held whole).
    end = start + _MAX_EVENTS
    out = query_events(ledger, tenant, flt, limit=limit, newest=False, start=start, end=end)
    size = ledger.head(tenant).size
    if len(out) >= limit:
        nxt: int | None = int(json.loads(out[-1])["seq"]) + 1
    elif end < size and not (flt.until is not None and _past(ledger, tenant, end, flt.until)):
        nxt = end
    else:
        nxt = None
    headers = {"X-Next-Start": str(nxt)} if nxt is not None else {}
    body = b"".join(d + b"\n" for d in out)
    return Response(body, media_type="application/x-ndjson", headers=headers)


def _past(ledger: Ledger, tenant: str, seq: int, until: str) -> bool:
    for data in ledger.entries(tenant, seq, seq + 1):
        return str(json.loads(data)["time"]) >= until
    return True


@router.get(
    "/tenants/{tenant}/events/follow",
    response_class=StreamingResponse,
    responses={
        200: {
            "content": {"application/x-ndjson": {"schema": {"type": "string"}}},
            "description": "Events as hashed (RFC 8785), one per line, as they are appended",
        }
    },
)
async def follow_events(
    ctx: CtxDep,
    tenant: str,
    start: Annotated[
        int | None, Query(ge=0, le=2**62, description="First sequence number [default: the end]")
    ] = None,
    run: RunQ = None,
    action: ActionQ = None,
    decision: DecisionQ = None,
    actor: ActorQ = None,
) -> StreamingResponse:
    """The log's events as they are appended, kept open until the client leaves;
    filtered and decided like ``events``. A principal may follow a few logs at once
    (429 beyond)."""
    flt = _filter(run, action, decision, None, None, actor)
    run_id = await run_in_threadpool(_authorize_events, ctx, tenant, run)
    if run_id is not None:
        flt = replace(flt, run=run_id)
    ledger = ctx.rt.ledger
    first = start if start is not None else (await run_in_threadpool(ledger.head, tenant)).size
    release = ctx.state.principals.follow(ctx.principal)

    def page(lo: int) -> tuple[list[bytes], int]:
        size = ledger.head(tenant).size
        hi = min(size, lo + _MAX_EVENTS)
        return query_events(ledger, tenant, flt, newest=False, start=lo, end=hi), max(lo, hi)

    async def tail() -> AsyncIterator[bytes]:
        # Waits with awaits between polls: a follow holds no worker thread while
        # the log is quiet, only for each short read.
        nxt = first
        try:
            while True:
                out, nxt = await run_in_threadpool(page, nxt)
                for data in out:
                    yield data + b"\n"
                if not out:
                    await asyncio.sleep(_FOLLOW_POLL)
        finally:
            release()

    body = tail()
    # A stream never started (the client left first) runs no finally: the follow
    # is given back when the generator is collected.
    weakref.finalize(body, release)
    # X-Start: the first event the stream can show (a caller knows from when on it
    # misses nothing).
    return StreamingResponse(
        body, media_type="application/x-ndjson", headers={"X-Start": str(first)}
    )


@router.get("/tenants/{tenant}/checkpoints", response_model=list[CheckpointOut])
def checkpoints(ctx: CtxDep, tenant: str) -> list[CheckpointOut]:
    """Every signed checkpoint the log has published, oldest first."""
    _read(ctx, tenant)
    return [CheckpointOut(size=s, time=t, note=n) for s, t, n in ctx.rt.ledger.checkpoints(tenant)]


_TEXT: dict[int | str, dict[str, Any]] = {
    200: {
        "content": {"text/plain": {"schema": {"type": "string"}}},
        "description": "The C2SP signed note, exactly as signed",
    }
}
_BYTES: dict[int | str, dict[str, Any]] = {
    200: {
        "content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}},
        "description": "A C2SP tlog-tiles tile",
    }
}


# Authenticated answers may sit in the reader's cache only; a public mirror's in any.
_IMMUTABLE = "max-age=31536000, immutable"


@dataclass(frozen=True)
class _Reader:
    """Who reads a log through the tlog-tiles paths: a principal, or nobody (a read
    of a tenant the server mirrors publicly, sent without a token)."""

    state: ApiState
    ctx: Ctx | None


def _reader(
    request: Request,
    credentials: HTTPAuthorizationCredentials | None = Security(_bearer),  # noqa: B008
) -> _Reader:
    state: ApiState = request.app.state.proctor
    tenant = request.path_params.get("tenant")
    # Only without a token: a request that sends one is that principal's, decided so.
    if "authorization" not in request.headers and tenant in state.public_logs:
        return _Reader(state, None)
    return _Reader(state, current(request, credentials))


ReaderDep = Annotated[_Reader, Depends(_reader)]
_MIRROR = Actor("runtime", "public-log-mirror")


def _read_tiles(r: _Reader, tenant: str, kind: str) -> str:
    """Decide a read through the tlog-tiles paths and count it (never an event in the
    log read: see ``_log_reads``); returns the Cache-Control scope of the answer."""
    if r.ctx is None:
        r.state.log_reads.count(_MIRROR, "", tenant, kind)
        return "public"
    p = r.ctx.principal
    # A refusal is an event in the system log at once; an allowed read is counted.
    r.ctx.authorize(
        Action.AUDIT_READ, tenant, f"log/{tenant}", log=SYSTEM_LOG, record_allowed=False
    )
    r.state.log_reads.count(p.actor, p.tenant, tenant, kind)
    return "private"


@router.get("/tenants/{tenant}/log/checkpoint", response_class=Response, responses=_TEXT)
def log_checkpoint(r: ReaderDep, tenant: str) -> Response:
    """The latest signed checkpoint (C2SP tlog-checkpoint), for tlog clients. Its
    reads are counted in the system log, not recorded in the log read."""
    scope = _read_tiles(r, tenant, "checkpoint")
    rt = r.state.rt
    # With the cosignatures its witnesses returned for this size (extra signature
    # lines, which a tlog client that does not know the witnesses ignores).
    note = TenantWitnesses(rt.store, rt.ledger).cosigned(tenant, rt.ledger.head(tenant).checkpoint)
    return Response(
        note,
        media_type="text/plain; charset=utf-8",
        headers={"Cache-Control": f"{scope}, no-cache"},
    )


def _accepts_gzip(header: str | None) -> bool:
    for part in (header or "").split(","):
        name, _, params = part.strip().partition(";")
        if name.strip().lower() in ("gzip", "*"):
            q = params.strip().replace(" ", "")
            return q not in ("q=0", "q=0.0", "q=0.00", "q=0.000")
    return False


@router.get("/tenants/{tenant}/log/tile/{path:path}", response_class=Response, responses=_BYTES)
def log_tile(r: ReaderDep, tenant: str, path: str, request: Request) -> Response:
    """A hash tile ``<L>/<N>[.p/<W>]`` or an entry bundle ``entries/<N>[.p/<W>]``
    (C2SP tlog-tiles), in its canonical spelling only. A tile's content never
    changes (a partial one is the prefix of its full tile): every one may be cached
    for good. Entry bundles are gzipped for a client that accepts it."""
    ref = parse_tile_path(f"tile/{path}")
    if ref is None:
        raise UsageError(
            f"{path!r} is not a canonical tlog-tiles path",
            hint="<L>/<N>[.p/<W>] or entries/<N>[.p/<W>]: N in 3-digit groups led by 'x' "
            "(x001/234), W from 1 to 255, no leading zeroes in L or W",
        )
    kind = ("partial_" if ref.partial else "") + ("entries" if ref.level is None else "tile")
    scope = _read_tiles(r, tenant, kind)
    ledger = r.state.rt.ledger
    headers = {"Cache-Control": f"{scope}, {_IMMUTABLE}"}
    if ref.level is None:
        data = _bundle(ledger, tenant, ref.index, ref.width)
        headers["Vary"] = "Accept-Encoding"
        if _accepts_gzip(request.headers.get("accept-encoding")):
            data = gzip.compress(data, compresslevel=6, mtime=0)
            headers["Content-Encoding"] = "gzip"
    else:
        tile = ledger.tile(tenant, ref.level, ref.index)
        if len(tile) < ref.width * _HASH:
            raise _absent(f"tile {path} is not in the tree yet")
        data = tile[: ref.width * _HASH]
    return Response(data, media_type="application/octet-stream", headers=headers)


def _absent(message: str) -> ApiError:
    # A tile the tree does not have yet will be there later: no cache may keep the 404.
    return ApiError(404, "not_found", message, headers={"Cache-Control": "no-store"})


def _bundle(ledger: Ledger, tenant: str, index: int, width: int) -> bytes:
    size = ledger.head(tenant).size
    first = index * TILE_WIDTH
    if first + width > size:
        raise _absent(f"entry bundle {index} of width {width} is not in the log yet")
    out = io.BytesIO()
    for data in ledger.entries(tenant, first, first + width):
        if len(data) > 0xFFFF:
            raise UsageError("an event is too large for a tlog-tiles entry bundle")
        out.write(len(data).to_bytes(2, "big") + data)
    return out.getvalue()


@router.get("/tenants/{tenant}/proofs/inclusion", response_model=InclusionOut)
def inclusion(
    ctx: CtxDep,
    tenant: str,
    index: Annotated[int, Query(ge=0, le=2**62)],
    size: Annotated[int | None, Query(ge=1, le=2**62)] = None,
) -> InclusionOut:
    """Inclusion proof (RFC 9162 §2.1.3) of event ``index`` in the tree of ``size``."""
    _read(ctx, tenant)
    return InclusionOut(**ctx.rt.ledger.inclusion_proof(tenant, index, size).as_json())


@router.get("/tenants/{tenant}/proofs/consistency", response_model=ConsistencyOut)
def consistency(
    ctx: CtxDep,
    tenant: str,
    old: Annotated[int, Query(ge=1, le=2**62)],
    new: Annotated[int | None, Query(ge=1, le=2**62)] = None,
) -> ConsistencyOut:
    """Consistency proof (RFC 9162 §2.1.4) that the tree of ``new`` extends ``old``."""
    _read(ctx, tenant)
    return ConsistencyOut(**ctx.rt.ledger.consistency_proof(tenant, old, new).as_json())


@router.get("/tenants/{tenant}/verify", response_model=VerifyOut)
def verify(ctx: CtxDep, tenant: str) -> VerifyOut:
    """Recompute every leaf and root on the server and check every checkpoint. An
    auditor who trusts only the key verifies an export offline instead."""
    _read(ctx, tenant)
    r = ctx.rt.ledger.verify(tenant)
    return VerifyOut(
        origin=r.origin,
        size=r.size,
        root=base64.b64encode(r.root).decode(),
        checkpoints=r.checkpoints,
        pruned=r.pruned,
    )


_TGZ: dict[int | str, dict[str, Any]] = {
    200: {
        "content": {"application/gzip": {"schema": {"type": "string", "format": "binary"}}},
        "description": "The export directory as a tar.gz",
    }
}


_ZIP: dict[int | str, dict[str, Any]] = {
    200: {
        "content": {"application/zip": {"schema": {"type": "string", "format": "binary"}}},
        "description": "The evidence pack (.zip); its figures in the X-Evidence-Pack header",
    }
}


@router.get("/tenants/{tenant}/evidence", response_class=Response, responses=_ZIP)
def evidence_pack(
    ctx: CtxDep,
    tenant: str,
    since: Annotated[str, Query(alias="from", max_length=64, description="ISO 8601 start")],
    until: Annotated[str, Query(alias="to", max_length=64, description="ISO 8601 end")],
) -> Response:
    """The evidence pack of events with time in [from, to), as ``proctor evidence
    export`` writes it (events, OCSF, checkpoints, proofs, records, report);
    ``proctor evidence verify`` checks it offline against the key the auditor holds."""
    from proctor.evidence import export_pack

    ctx.authorize(Action.EVIDENCE_EXPORT, tenant, f"log/{tenant}")
    start, end = parse_time(since, "from"), parse_time(until, "to")
    work = Path(tempfile.mkdtemp(prefix="proctor-evidence-"))
    try:
        info = export_pack(ctx.rt, tenant, start, end, work / "pack.zip")
        data = (work / "pack.zip").read_bytes()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    figures = {"events": info.events, "first_seq": info.first_seq, "end_seq": info.end_seq,
               "context": info.context, "end_size": info.end_size}  # fmt: skip
    return Response(
        data,
        media_type="application/zip",
        headers={
            "Content-Disposition": f'attachment; filename="{tenant}-evidence.zip"',
            "X-Evidence-Pack": json.dumps(figures, separators=(",", ":")),
        },
    )


@router.get("/tenants/{tenant}/export", response_class=Response, responses=_TGZ)
def export(ctx: CtxDep, tenant: str) -> Response:
    """The log as ``proctor audit export`` writes it (events, checkpoints, verifier key,
    tiles), as a tar.gz that ``proctor audit verify --from-export`` checks offline."""
    _read(ctx, tenant)
    work = Path(tempfile.mkdtemp(prefix="proctor-export-"))
    try:
        out = work / "export"
        head = ctx.rt.ledger.export(tenant, out)
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w:gz") as tar:
            tar.add(out, arcname=f"{tenant}-log")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    ctx.rt.ledger.append(
        ctx.principal.tenant,
        EventDraft(
            ctx.principal.actor,
            Action.AUDIT_EXPORT,
            f"log/{tenant}",
            reason="exported",
            details={"size": head.size, "request_id": ctx.request_id},
        ),
    )
    return Response(
        buf.getvalue(),
        media_type="application/gzip",
        headers={
            "Content-Disposition": f'attachment; filename="{tenant}-log.tar.gz"',
            "X-Log-Size": str(head.size),
        },
    )
