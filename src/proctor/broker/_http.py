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
    if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
        raise BadCall("malformed request line")
    method, target, version = parts
    if not method.isalpha() or not method.isupper():
        raise BadCall("malformed method")
    if len(lines) - 1 > MAX_HEADERS:
        raise BadCall("too many headers")
    headers: list[tuple[str, str]] = []
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if not sep or not name or name != name.strip() or any(c in name for c in " \t"):
            raise BadCall("malformed header line")
        headers.append((name, value.strip()))
    return RequestHead(method, target, version, headers)


async def read_body(reader: asyncio.StreamReader, head: RequestHead, limit: int) -> bytes:
    if head.header("Transfer-Encoding") is not None:
        raise BadCall("send a Content-Length body; chunked requests are not accepted here")
    length_s = head.header("Content-Length") or "0"
    if not length_s.isdigit():
        raise BadCall("malformed Content-Length")
    length = int(length_s)
    if length > limit:
        err = BadCall(f"the request body is larger than the {limit} bytes allowed")
        err.status = 413
        raise err
    try:
        return await reader.readexactly(length)
    except asyncio.IncompleteReadError as exc:
        raise BadCall("the request body ended early") from exc


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
