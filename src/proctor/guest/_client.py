from __future__ import annotations

import http.client
import json
import os
import socket
from typing import Any
from urllib.parse import quote

from .protocol import SOCKET_ENV, SOCKET_PATH, TOKEN_ENV, TOKEN_HEADER


class GuestError(Exception):
    """A broker call failed. ``code`` is the broker's stable error code; for a refusal
    the broker recorded, ``seq`` is its event in the tenant's ledger and ``reason`` the
    reason recorded there (``proctor audit events --run R --decision deny`` shows it)."""

    def __init__(
        self,
        message: str,
        code: str = "error",
        policies: tuple[str, ...] = (),
        seq: int | None = None,
        reason: str | None = None,
    ) -> None:
        if seq is not None:
            message = f"{message} [ledger event seq={seq}]"
        super().__init__(message)
        self.code = code
        self.policies = policies
        self.seq = seq
        self.reason = reason


class Denied(GuestError):
    """Policy refused the call; ``policies`` names the deciding policies (if any)."""


class NotRecorded(GuestError):
    """The ledger could not record the call, so it was refused (fail closed)."""


class BrokerUnavailable(GuestError):
    """There is no broker to talk to: this run has no way out."""


class UpstreamFailed(GuestError):
    """The call was allowed, but its upstream could not be reached or verified (a
    connection refused, a certificate that did not verify): the message says which, and
    ``seq`` names the ``http.request.end`` event that records it."""


class RateLimited(GuestError):
    """The run made calls faster than its limit allows; wait a second and retry."""


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("broker", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(self._path)
        except OSError:
            sock.close()
            raise
        self.sock = sock


def _call(method: str, path: str, body: bytes | None = None, timeout: float = 60.0) -> bytes:
    sock_path = os.environ.get(SOCKET_ENV, SOCKET_PATH)
    headers = {TOKEN_HEADER: os.environ.get(TOKEN_ENV, "")}
    if body is not None:
        headers["Content-Type"] = "application/json"
    conn = _UnixConnection(sock_path, timeout)
    try:
        conn.request(method, path, body=body, headers=headers)
        resp = conn.getresponse()
        data = resp.read()
    except OSError as exc:
        raise BrokerUnavailable(
            f"cannot reach the broker at {sock_path}: {exc}", code="broker_unavailable"
        ) from exc
    finally:
        conn.close()
    if resp.status == 200:
        return data
    seq: int | None = None
    reason: str | None = None
    try:
        err = json.loads(data)
        message, code = str(err["message"]), str(err["error"])
        policies = tuple(str(p) for p in err.get("policies", []))
        if isinstance(err.get("seq"), int):
            seq, reason = int(err["seq"]), str(err.get("reason", ""))
    except (ValueError, KeyError, TypeError):
        message, code, policies = data.decode(errors="replace"), f"http_{resp.status}", ()
    kind = {403: Denied, 503: NotRecorded, 429: RateLimited}.get(resp.status, GuestError)
    if code == "upstream_failed":
        kind = UpstreamFailed
    raise kind(message, code, policies, seq, reason)


def sql(dataset: str, query: str, params: list[Any] | dict[str, Any] | None = None) -> Any:
    """Run one SQL statement on a dataset the run was approved for.

    Returns ``{"columns", "rows", "row_count", "truncated"}`` for reads and
    ``{"rows_affected"}`` for writes.
    """
    body = json.dumps({"dataset": dataset, "sql": query, "params": params or []})
    return json.loads(_call("POST", "/v1/sql", body.encode()))


def read(bucket: str, key: str) -> bytes:
    return _call("GET", f"/v1/files/{quote(bucket, safe='')}/{quote(key, safe='')}")


def write(bucket: str, key: str, data: bytes) -> Any:
    """Store ``data``; returns ``{"sha256", "bytes"}`` as recorded in the ledger."""
    return json.loads(
        _call("PUT", f"/v1/files/{quote(bucket, safe='')}/{quote(key, safe='')}", data)
    )


def whoami() -> Any:
    """The run's identity: tenant, run, workload (SPIFFE id), deployment, artifact."""
    return json.loads(_call("GET", "/v1/whoami"))
