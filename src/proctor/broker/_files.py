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
file 256 KiB at a time (a stalled sender holds one piece, not the object).
"""

from __future__ import annotations

import hashlib
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any

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


# -- the handlers ----------------------------------------------------------------------


async def _refuse(
    scope: RunScope, action: str, resource: str, error: BrokerError, details: Mapping[str, Any]
) -> BrokerError:
    """Record a call refused before or instead of a policy question; returns the error."""
    await scope.record_refusal(
        action, resource, error.message.removeprefix("files: "), details=dict(details)
    )
    return error


async def _prepare(
    scope: RunScope, action: str, bucket: object, key: object, context: Mapping[str, Any]
) -> tuple[str, str, Path, Decision, dict[str, Any]]:
    """Check names, decide, record a deny. Returns what an allowed call needs."""
    b, k = _printable(bucket), _printable(key)
    resource = f"bucket/{b}/{k}"
    details: dict[str, Any] = {"bucket": b, "key": k}
    try:
        bucket = check_bucket(bucket)
        key = check_key(key)
        if scope.buckets_dir is None:
            raise CallDenied("files: this run has no buckets")
    except BrokerError as exc:
        raise await _refuse(scope, action, resource, exc, details) from None
    ref = EntityRef.bucket(scope.tenant, bucket)
    decision = scope.decide(
        action, ref, {"key": key, **context}, (Entity.in_tenant(ref, scope.tenant),)
    )
    if not decision.allowed:
        reason = decision.reason
        # With what was decided on (a write's announced size), so it can be re-decided.
        details |= dict(context)
        await scope.record(action, resource, decision, reason=reason, details=details)
        raise CallDenied(f"{action} on {resource} {reason}", policies=decision.policies)
    return bucket, key, scope.buckets_dir, decision, details


async def read_object(
    scope: RunScope, bucket: str, key: str, *, max_bytes: int = MAX_OBJECT_BYTES
) -> bytes:
    """The object's bytes, once ``file.read`` is permitted and the read recorded
    (with its SHA-256). Raises CallDenied, BadCall, ObjectNotFound,
    ObjectTooLarge, or CallRefused (not recorded: nothing is returned)."""
    action = "file.read"
    bucket, key, root, decision, details = await _prepare(scope, action, bucket, key, {})
    resource = f"bucket/{bucket}/{key}"
    try:
        data = await run_blocking(scope, _read, root, bucket, key, max_bytes)
    except _Missing:
        error: BrokerError = ObjectNotFound(f"files: no object {key!r} in bucket {bucket!r}")
        raise await _refuse(scope, action, resource, error, details) from None
    except _Unsafe:
        error = CallDenied("files: the key names a link, a directory or a special file")
        raise await _refuse(scope, action, resource, error, details) from None
    except _TooLarge:
        error = ObjectTooLarge(f"files: the object is larger than {max_bytes} bytes")
        raise await _refuse(scope, action, resource, error, details) from None
    except OSError as exc:
        error = BrokerError(f"files: the object could not be read: {exc.strerror}")
        raise await _refuse(scope, action, resource, error, details) from None
    details |= {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    await scope.record(action, resource, decision, reason=decision.reason, details=details)
    return data


async def _pieces(data: bytes | BodyStream) -> AsyncIterator[bytes]:
    if isinstance(data, BodyStream):
        async for chunk in data.chunks(_PIECE):
            yield chunk
    else:
        for at in range(0, len(data), _PIECE):
            yield data[at : at + _PIECE]


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
    CallRefused (not recorded: nothing is written).

    ``data`` is the object's bytes, or a :class:`BodyStream` not read yet: the
    call is then decided on its announced length before a byte of it is read
    (a refused body is never read), and it is streamed to disk a chunk at a
    time, never held whole."""
    action = "file.write"
    untrusted: object = data
    early: BrokerError | None = None
    if isinstance(untrusted, BodyStream):
        size = untrusted.length
    elif isinstance(untrusted, bytes | bytearray | memoryview):
        size = len(untrusted)
        data = bytes(untrusted)
    else:
        size = -1
    if size < 0:
        early = BadCall("files: the object must be bytes")
    elif size > max_bytes:
        early = ObjectTooLarge(f"files: the object is larger than {max_bytes} bytes")
    if early is not None:
        resource = f"bucket/{_printable(bucket)}/{_printable(key)}"
        info: dict[str, Any] = {"bucket": _printable(bucket), "key": _printable(key)}
        raise await _refuse(scope, action, resource, early, {**info, "bytes": size})
    bucket, key, root, decision, details = await _prepare(
        scope, action, bucket, key, {"bytes": size}
    )
    resource = f"bucket/{bucket}/{key}"
    error: BrokerError
    try:
        staged = await run_blocking(scope, _stage, root, bucket, key)
    except _Missing:
        error = ObjectNotFound(f"files: no bucket {bucket!r}")
        raise await _refuse(scope, action, resource, error, details) from None
    except _Unsafe:
        error = CallDenied("files: the key runs through or names a link or a non-file")
        raise await _refuse(scope, action, resource, error, details) from None
    except OSError as exc:
        error = BrokerError(f"files: the object could not be written: {exc.strerror}")
        raise await _refuse(scope, action, resource, error, details) from None
    hasher = hashlib.sha256()
    written = 0
    try:
        try:
            async for piece in _pieces(data):
                hasher.update(piece)
                written += len(piece)
                await run_blocking(scope, staged.write, piece)
            await run_blocking(scope, staged.finish)
        except BadCall as exc:  # the body stalled or ended early
            raise await _refuse(scope, action, resource, exc, details) from None
        except OSError as exc:
            error = BrokerError(f"files: the object could not be written: {exc.strerror}")
            raise await _refuse(scope, action, resource, error, details) from None
        digest = hasher.hexdigest()
        details |= {"bytes": written, "sha256": digest}
        await scope.record(action, resource, decision, reason=decision.reason, details=details)
    except BaseException:
        await run_blocking(scope, staged.discard)
        raise
    await run_blocking(scope, staged.commit)
    return {"sha256": digest, "bytes": written}
