"""Just enough HTTP/1.1 for the broker socket: a bounded request-head reader and
response writer. Bodies are read by the handlers that know their limits."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any

from proctor.broker._scope import BadCall

MAX_HEAD = 64 * 1024
MAX_HEADERS = 100
_VERSIONS = ("HTTP/1.1", "HTTP/1.0")
_UPPER = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZ")
_TOKEN = frozenset("!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")
_REASONS = {
    200: "OK",
    201: "Created",
    400: "Bad Request",
    401: "Unauthorized",
    403: "Forbidden",
    404: "Not Found",
    405: "Method Not Allowed",
    408: "Request Timeout",
    413: "Payload Too Large",
    500: "Internal Server Error",
    502: "Bad Gateway",
    503: "Service Unavailable",
}


@dataclass(frozen=True)
class RequestHead:
    method: str
    target: str
    version: str
    headers: list[tuple[str, str]]

    def header(self, name: str) -> str | None:
        lname = name.lower()
        for key, value in self.headers:
            if key.lower() == lname:
                return value
        return None

    def without(self, *names: str) -> list[tuple[str, str]]:
        drop = {n.lower() for n in names}
        return [(k, v) for k, v in self.headers if k.lower() not in drop]


async def read_head(reader: asyncio.StreamReader, timeout: float = 30.0) -> RequestHead | None:
    """The next request head, or None at a clean end of stream."""
    try:
        raw = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout)
    except asyncio.IncompleteReadError as exc:
        if not exc.partial:
            return None
        raise BadCall("the request head ended early") from exc
    except asyncio.LimitOverrunError as exc:
        raise BadCall(f"the request head is larger than {MAX_HEAD} bytes") from exc
    except TimeoutError as exc:
        raise BadCall("no complete request head in time") from exc
    try:
        text = raw.decode("latin-1")
    except UnicodeDecodeError as exc:  # pragma: no cover - latin-1 decodes every byte
        raise BadCall("undecodable request head") from exc
    lines = text[:-4].split("\r\n")
    parts = lines[0].split(" ")
    if len(parts) != 3 or parts[2] not in _VERSIONS:
        raise BadCall("malformed request line")
    method, target, version = parts
    if not method or not set(method) <= _UPPER:
        raise BadCall("malformed method")
    # A target is visible ASCII and latin-1 text; a control character in it is
    # a way to make two parsers see two different requests.
    if not target or any(ord(c) < 0x21 or ord(c) == 0x7F for c in target):
        raise BadCall("malformed request target")
    if len(lines) - 1 > MAX_HEADERS:
        raise BadCall("too many headers")
    headers: list[tuple[str, str]] = []
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if not sep or not name or not set(name) <= _TOKEN:
            raise BadCall("malformed header line")
        if any(c in value for c in "\r\n\0"):
            raise BadCall(f"invalid value for header {name!r}")
        # Only SP and HTAB are whitespace around a value (str.strip() would also
        # eat latin-1 NBSP and the C0 separators, which are part of the value).
        headers.append((name, value.strip(" \t")))
    return RequestHead(method, target, version, headers)


async def read_body(
    reader: asyncio.StreamReader, head: RequestHead, limit: int, idle: float = 30.0
) -> bytes:
    """The body ``head`` announces, at most ``limit`` bytes; refused if ``idle``
    seconds pass with no byte of it arriving (a stalled sender holds nothing)."""
    if head.header("Transfer-Encoding") is not None:
        raise BadCall("send a Content-Length body; chunked requests are not accepted here")
    lengths = {v for k, v in head.headers if k.lower() == "content-length"}
    if len(lengths) > 1:
        raise BadCall("conflicting Content-Length headers")
    length_s = lengths.pop() if lengths else "0"
    # ASCII digits only: str.isdigit() also says yes to "²" and "٣", which int()
    # refuses or reads as another number.
    if not length_s or not length_s.isascii() or not length_s.isdigit():
        raise BadCall("malformed Content-Length")
    # Compared by length first: int() refuses strings of over 4300 digits.
    if len(length_s.lstrip("0")) > len(str(limit)) or int(length_s) > limit:
        err = BadCall(f"the request body is larger than the {limit} bytes allowed")
        err.status = 413
        raise err
    left = int(length_s)
    body = bytearray()
    while left:
        try:
            chunk = await asyncio.wait_for(reader.read(min(left, 1 << 16)), idle)
        except TimeoutError as exc:
            err = BadCall(f"no byte of the request body for {idle:g} s")
            err.status = 408
            raise err from exc
        if not chunk:
            raise BadCall("the request body ended early")
        body += chunk
        left -= len(chunk)
    return bytes(body)


async def respond(
    writer: asyncio.StreamWriter,
    status: int,
    body: bytes,
    content_type: str = "application/json",
    extra: list[tuple[str, str]] | None = None,
) -> None:
    head = [f"HTTP/1.1 {status} {_REASONS.get(status, 'Status')}"]
    head.append(f"Content-Type: {content_type}")
    head.append(f"Content-Length: {len(body)}")
    head.append("Connection: close")
    for key, value in extra or []:
        head.append(f"{key}: {value}")
    writer.write(("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body)
    await writer.drain()


async def respond_json(writer: asyncio.StreamWriter, status: int, doc: Any) -> None:
    await respond(writer, status, json.dumps(doc, sort_keys=True).encode())
