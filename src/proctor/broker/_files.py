"""Objects in a tenant's buckets, read and written through the broker.

A bucket is a directory under the run's ``buckets_dir``; an object is a file
under it, named by a key such as ``reports/2026/churn.md``. Every call is
decided by Cedar (``file.read`` / ``file.write`` on the Bucket, the key and
size in context) and recorded with the object's SHA-256 and size.

Keys are checked before any path is built: segments of ``[A-Za-z0-9._-]``
that do not start with a dot (so no ``.``, ``..``, hidden or temporary
names), no empty segment, no leading ``/``, at most 1,024 characters. Paths
are then walked one directory at a time from an open directory descriptor
with ``O_NOFOLLOW``, so a symbolic link anywhere under the bucket (even one
swapped in during the call) is refused rather than followed, and nothing
outside the bucket can be named at all.

A write is staged in a temporary file beside its target and fsync'd; the
event is recorded; only then is the file renamed into place and the
directory fsync'd. If the ledger cannot record the event, the temporary file
is removed: readers never see an object whose write is not in the ledger.

An upload through the run's socket is decided on its head alone (bucket, key,
announced length) before a byte of its body is read: a refused upload is never
read and its connection closes. A permitted one is streamed to the temporary
file 256 KiB at a time (a stalled sender holds one piece, not the object). A
chunked upload (Node's default) is decided as large as the cap (its length is
not known before it is read), streamed the same way, refused (413) on the chunk
line that takes it past the cap, and hashed and recorded exactly as the same
bytes sent with a Content-Length.
"""

from __future__ import annotations

import hashlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Any
from urllib.parse import unquote

from proctor.broker._calls import Acted, Call, Ruling, register
from proctor.broker._decide import Question, decide
from proctor.broker._fair import run_blocking
from proctor.broker._http import BodyStream
from proctor.broker._scope import BadCall, BrokerError, CallDenied, RunScope
from proctor.governance import (
    MAX_KEY_LENGTH,
    MAX_OBJECT_BYTES,
    bucket_problem,
    key_problem,
)
from proctor.governance import ObjectMissing as _Missing
from proctor.governance import ObjectTooBig as _TooLarge
from proctor.governance import ObjectUnsafe as _Unsafe
from proctor.governance import read_object_file as _read
from proctor.governance import stage_object as _stage
from proctor.ledger import Action
from proctor.policy import Decision, Entity, EntityRef

#: What an upload holds in memory at a time: one piece, read, hashed and written.
_PIECE = 256 * 1024


class ObjectNotFound(BrokerError):
    """The key names no object in the bucket."""

    code = "not_found"
    status = 404


class ObjectTooLarge(BadCall):
    """The object is larger than the per-object cap."""

    code = "too_large"
    status = 413


def check_key(key: object) -> str:
    """``key`` if it is an acceptable object key; :class:`BadCall` if not."""
    problem = key_problem(key)
    if problem is not None:
        raise BadCall(f"files: {problem}")
    assert isinstance(key, str)
    return key


def check_bucket(bucket: object) -> str:
    problem = bucket_problem(bucket)
    if problem is not None:
        raise BadCall(f"files: {problem}")
    assert isinstance(bucket, str)
    return bucket


def _printable(value: object) -> str:
    """A name for an event about a refused call; only checked names are kept whole."""
    if isinstance(value, str) and value.isprintable() and len(value) <= MAX_KEY_LENGTH:
        return value
    return "?"


# -- the kinds: file.read and file.write ------------------------------------------------


@dataclass(frozen=True)
class FileRequest:
    """One object call: the names as the guest sent them, and for a write its body."""

    bucket: object
    key: object
    data: bytes | BodyStream | None = None
    max_bytes: int = MAX_OBJECT_BYTES


def _object(call: Call) -> tuple[str, str]:
    assert call.head is not None
    path = call.head.target.split("?", 1)[0]
    bucket, sep, key = path.removeprefix("/v1/files/").partition("/")
    if not sep or not bucket or not key:
        raise BadCall("use /v1/files/<bucket>/<key>")
    return bucket, unquote(key)


def _refused(
    scope: RunScope, action: str, resource: str, error: BrokerError, details: dict[str, Any]
) -> Ruling:
    """A call refused before or instead of its policy question."""
    denied = Decision(False, (), scope.policies.version)
    why = "refused: " + error.message.removeprefix("files: ")
    return Ruling(action, resource, denied, why, details, refusal=error)


def _failed(error: BrokerError, discard: Callable[[], Awaitable[None]] | None = None) -> Acted:
    """A refusal found acting (an object missing, a link): the record stage records
    it as the call's event; ``discard`` takes back what was staged."""
    why = error.message.removeprefix("files: ")
    return Acted(refusal=error, why=why, discard=discard)


def _ruling(scope: RunScope, action: str, request: FileRequest, context: dict[str, Any]) -> Ruling:
    """Check names, then ask Cedar ``action`` on the bucket, the key (and a write's
    announced size) in context."""
    b, k = _printable(request.bucket), _printable(request.key)
    resource = f"bucket/{b}/{k}"
    details: dict[str, Any] = {"bucket": b, "key": k}
    try:
        bucket = check_bucket(request.bucket)
        key = check_key(request.key)
        if scope.buckets_dir is None:
            raise CallDenied("files: this run has no buckets")
    except BrokerError as exc:
        return _refused(scope, action, resource, exc, details)
    ref = EntityRef.bucket(scope.tenant, bucket)
    asked = Question(action, ref, {"key": key, **context}, (Entity.in_tenant(ref, scope.tenant),))
    verdict = decide(scope, [asked])
    if not verdict.allowed:
        # With what was decided on (a write's announced size), so it can be re-decided.
        details |= context
        denied = CallDenied(f"{action} on {resource} {verdict.reason}",
                            policies=verdict.decision.policies)  # fmt: skip
        return Ruling(action, resource, verdict.decision, verdict.reason, details, denied)
    found = (bucket, key, scope.buckets_dir)
    return Ruling(action, resource, verdict.decision, verdict.reason, details, found=found)


@dataclass(frozen=True)
class FileRead:
    """``GET /v1/files/<bucket>/<key>``: the object's bytes, read before the event
    (which carries their SHA-256) and held until it is durable."""

    name: str = Action.FILE_READ
    method: str = "GET"
    path: str = "/v1/files/"
    records_first: bool = False

    async def parse(self, call: Call) -> FileRequest:
        return FileRequest(*_object(call))

    async def decide(self, call: Call, request: FileRequest) -> Ruling:
        return _ruling(call.scope, Action.FILE_READ, request, {})

    async def done(self, call: Call, request: object) -> None:
        return None

    async def act(self, call: Call, request: FileRequest, ruling: Ruling | None) -> Acted:
        assert ruling is not None
        scope, (bucket, key, root) = call.scope, ruling.found
        max_bytes = request.max_bytes
        try:
            data = await run_blocking(scope, _read, root, bucket, key, max_bytes)
        except _Missing:
            return _failed(ObjectNotFound(f"files: no object {key!r} in bucket {bucket!r}"))
        except _Unsafe:
            return _failed(CallDenied("files: the key names a link, a directory or a special file"))
        except _TooLarge:
            return _failed(ObjectTooLarge(f"files: the object is larger than {max_bytes} bytes"))
        except OSError as exc:
            return _failed(BrokerError(f"files: the object could not be read: {exc.strerror}"))
        facts = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
        return Acted(answer=data, details=facts)


async def _pieces(data: bytes | BodyStream) -> AsyncIterator[bytes]:
    if isinstance(data, BodyStream):
        async for chunk in data.chunks(_PIECE):
            yield chunk
    else:
        for at in range(0, len(data), _PIECE):
            yield data[at : at + _PIECE]


@dataclass(frozen=True)
class FileWrite:
    """``PUT /v1/files/<bucket>/<key>``: decided on the head (the announced length)
    before a byte of the body is read; streamed to a staged file, hashed; the event
    (SHA-256, size) durable before the object is renamed into place."""

    name: str = Action.FILE_WRITE
    method: str = "PUT"
    path: str = "/v1/files/"
    records_first: bool = False

    async def parse(self, call: Call) -> FileRequest:
        bucket, key = _object(call)
        assert call.head is not None and call.reader is not None
        # Not read here: decided from the head first (a refused upload is never
        # read; the connection closes), then streamed to disk.
        body = BodyStream.of(call.reader, call.head, MAX_OBJECT_BYTES)
        return FileRequest(bucket, key, body)

    async def decide(self, call: Call, request: FileRequest) -> Ruling:
        scope, action = call.scope, Action.FILE_WRITE
        untrusted: object = request.data
        if isinstance(untrusted, BodyStream):
            # Chunked: its size is known only once read, so it is decided as large
            # as it may grow (a tenant's "no upload over N" forbid refuses it, a
            # permit "under N" does not take it: chunking is no way around a size
            # rule), and the stream refuses it past that (413) on the chunk line
            # that passes it.
            size = request.max_bytes if untrusted.length is None else untrusted.length
        elif isinstance(untrusted, bytes | bytearray | memoryview):
            size = len(untrusted)
        else:
            size = -1
        early: BrokerError | None = None
        if size < 0:
            early = BadCall("files: the object must be bytes")
        elif size > request.max_bytes:
            early = ObjectTooLarge(f"files: the object is larger than {request.max_bytes} bytes")
        if early is not None:
            b, k = _printable(request.bucket), _printable(request.key)
            details = {"bucket": b, "key": k, "bytes": size}
            return _refused(scope, action, f"bucket/{b}/{k}", early, details)
        return _ruling(scope, action, request, {"bytes": size})

    async def done(self, call: Call, request: object) -> None:
        return None

    async def act(self, call: Call, request: FileRequest, ruling: Ruling | None) -> Acted:
        assert ruling is not None
        scope, (bucket, key, root) = call.scope, ruling.found
        try:
            staged = await run_blocking(scope, _stage, root, bucket, key)
        except _Missing:
            return _failed(ObjectNotFound(f"files: no bucket {bucket!r}"))
        except _Unsafe:
            return _failed(CallDenied("files: the key runs through or names a link or a non-file"))
        except OSError as exc:
            return _failed(BrokerError(f"files: the object could not be written: {exc.strerror}"))

        async def commit() -> None:
            await run_blocking(scope, staged.commit)

        async def discard() -> None:
            await run_blocking(scope, staged.discard)

        untrusted: object = request.data  # the caller's: bytes-like or a stream
        data = bytes(untrusted) if isinstance(untrusted, bytearray | memoryview) else untrusted
        assert isinstance(data, bytes | BodyStream)
        if isinstance(data, BodyStream) and data.length is None:
            data = replace(data, limit=min(data.limit, request.max_bytes))
        hasher = hashlib.sha256()
        written = 0
        try:
            async for piece in _pieces(data):
                hasher.update(piece)
                written += len(piece)
                await run_blocking(scope, staged.write, piece)
            await run_blocking(scope, staged.finish)
        except BadCall as exc:  # the body stalled, ended early, was misframed or too large
            too_big = f"files: the object is larger than {request.max_bytes} bytes"
            return _failed(ObjectTooLarge(too_big) if exc.status == 413 else exc, discard)
        except OSError as exc:
            error = BrokerError(f"files: the object could not be written: {exc.strerror}")
            return _failed(error, discard)
        except BaseException:
            await discard()
            raise
        digest = hasher.hexdigest()

        return Acted(
            answer={"sha256": digest, "bytes": written},
            details={"bytes": written, "sha256": digest},
            commit=commit,
            discard=discard,
        )


FILE_READ = register(FileRead())
FILE_WRITE = register(FileWrite())


async def read_object(
    scope: RunScope, bucket: str, key: str, *, max_bytes: int = MAX_OBJECT_BYTES
) -> bytes:
    """The object's bytes, once ``file.read`` is permitted and the read recorded
    (with its SHA-256), through the same stages as a guest's call. Raises
    CallDenied, BadCall, ObjectNotFound, ObjectTooLarge, or CallRefused (not
    recorded: nothing is returned)."""
    from proctor.broker._pipeline import perform  # it registers this module's kinds

    data: bytes = await perform(scope, FILE_READ, FileRequest(bucket, key, None, max_bytes))
    return data


async def write_object(
    scope: RunScope,
    bucket: str,
    key: str,
    data: bytes | BodyStream,
    *,
    max_bytes: int = MAX_OBJECT_BYTES,
) -> dict[str, Any]:
    """Write the object atomically once ``file.write`` is permitted; the event
    (SHA-256, size) is durable before the object is visible. Returns
    ``{"sha256", "bytes"}``. Raises CallDenied, BadCall, ObjectTooLarge, or
    CallRefused (not recorded: nothing is written). ``data`` is the object's
    bytes, or a :class:`BodyStream` not read yet (decided on its announced
    length before a byte of it is read, streamed to disk a piece at a time)."""
    from proctor.broker._pipeline import perform  # it registers this module's kinds

    answer: dict[str, Any] = await perform(
        scope, FILE_WRITE, FileRequest(bucket, key, data, max_bytes)
    )
    return answer
