"""HTTP/1.1 for every broker path: the one request-head parser, message framing,
and the broker's own answers.

The run's socket (:mod:`._server`), the egress proxy (:mod:`._proxy`) and the
requests inside an injected tunnel (:mod:`._inject`) read a request head with
:func:`parse_request_head`: one set of rules wherever a request arrives, so no
two broker paths can read the same bytes as two different requests. Bodies the
proxy passes on are framed strictly (:func:`request_framing`,
:func:`walk_body`): the bytes go on as they came, so anything another parser
could frame another way is refused before a byte of it is passed on. Bodies
the socket's own endpoints take are read by :func:`read_body` or streamed by
:class:`BodyStream`, to a limit, by Content-Length or chunked (the same chunk-line
parser and rules as the proxy's).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any, Protocol

from proctor.broker._egress import UpstreamFailed
from proctor.broker._scope import REQUEST_EVENTS, BadCall, BrokerError

MAX_HEAD = 64 * 1024
MAX_HEADERS = 100
#: Bytes read from a body at a time.
CHUNK = 65536
_MAX_LINE = 8192
_VERSIONS = ("HTTP/1.1", "HTTP/1.0")
_UPPER = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZ")
TOKEN = frozenset("!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")
HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-connection",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "upgrade",
    }
)
# Methods whose body an upstream may leave unread (RFC 9110 gives a body on them
# no meaning): left unread, it is read as the next request on the connection.
BODYLESS = frozenset({"GET", "HEAD", "DELETE", "OPTIONS", "TRACE"})
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


# -- heads ----------------------------------------------------------------------


def _head_lines(raw: bytes) -> list[str]:
    """The lines of a message head (its bytes up to and including the empty line)."""
    text = raw.decode("latin-1")  # decodes every byte
    if not text.endswith("\r\n\r\n"):
        raise BadCall("the message head ended early")
    body = text[:-4]
    if "\n" in body.replace("\r\n", "") or "\r" in body.replace("\r\n", ""):
        raise BadCall("bare CR or LF in a message head")
    return body.split("\r\n")


def _header_fields(lines: list[str]) -> list[tuple[str, str]]:
    headers: list[tuple[str, str]] = []
    for line in lines:
        name, sep, value = line.partition(":")
        # A token name also refuses a line folded onto the previous one (obs-fold).
        if not sep or not name or not set(name) <= TOKEN:
            raise BadCall("malformed header line")
        if any(c in value for c in "\r\n\0"):
            raise BadCall(f"invalid value for header {name!r}")
        # Only SP and HTAB are whitespace around a value (str.strip() would also
        # eat latin-1 NBSP and the C0 separators, which are part of the value).
        headers.append((name, value.strip(" \t")))
    return headers


def parse_request_head(raw: bytes) -> RequestHead:
    """The request head in ``raw`` (up to and including the empty line), or BadCall.

    The rules of every broker path: a request line of three parts, an
    upper-case method, a target of visible characters, HTTP/1.1 or 1.0, at
    most :data:`MAX_HEADERS` header fields with token names, and no bare CR or
    LF anywhere.
    """
    lines = _head_lines(raw)
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
    return RequestHead(method, target, version, _header_fields(lines[1:]))


def parse_response_head(raw: bytes) -> tuple[str, int, list[tuple[str, str]]]:
    """(status line, status, headers) of an upstream's response head, or UpstreamFailed."""
    try:
        lines = _head_lines(raw)
        headers = _header_fields(lines[1:])
    except BadCall as exc:
        raise UpstreamFailed(f"the upstream sent a malformed response: {exc.message}") from exc
    first = lines[0]
    parts = first.split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
        raise UpstreamFailed("the upstream sent a malformed status line")
    return first, int(parts[1]), headers


class IdleConnection(Exception):
    """No byte of a request arrived before the first-byte timeout."""


async def read_head(
    reader: asyncio.StreamReader,
    timeout: float = 30.0,
    *,
    first_byte: float | None = None,
    arrived: Callable[[], None] | None = None,
) -> RequestHead | None:
    """The next request head, or None at a clean end of stream. With ``first_byte``,
    :class:`IdleConnection` if no byte arrives within that many seconds (a connection
    opened only to be held); ``arrived`` is called when that first byte comes."""
    first = b""
    if first_byte is not None:
        try:
            first = await asyncio.wait_for(reader.readexactly(1), first_byte)
        except asyncio.IncompleteReadError:
            return None
        except TimeoutError:
            raise IdleConnection from None
        if arrived is not None:
            arrived()
    try:
        raw = first + await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout)
    except asyncio.IncompleteReadError as exc:
        if not exc.partial and not first:
            return None
        raise BadCall("the request head ended early") from exc
    except asyncio.LimitOverrunError as exc:
        raise BadCall(f"the request head is larger than {MAX_HEAD} bytes") from exc
    except TimeoutError as exc:
        raise BadCall("no complete request head in time") from exc
    return parse_request_head(raw)


def body_length(head: RequestHead, limit: int) -> int | None:
    """The length ``head`` announces for its body, checked against ``limit`` before a
    byte of the body is read (413 over it); None for a chunked body, whose size is
    known only once read (:class:`BodyStream` counts it against ``limit`` as it comes).

    Framed strictly, as the proxy frames what it passes on: Transfer-Encoding with
    Content-Length, a coding other than ``chunked``, or chunked on HTTP/1.0 is
    refused, never read one way or the other."""
    te = [v for k, v in head.headers if k.lower() == "transfer-encoding"]
    if te:
        if head.header("Content-Length") is not None:
            raise BadCall("both Transfer-Encoding and Content-Length")
        if len(te) != 1 or te[0].lower() != "chunked":
            raise BadCall("only Transfer-Encoding: chunked is supported")
        if head.version != "HTTP/1.1":
            raise BadCall("a chunked body needs HTTP/1.1")
        return None
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
        raise too_large(limit)
    return int(length_s)


def too_large(limit: int) -> BadCall:
    err = BadCall(f"the request body is larger than the {limit} bytes allowed")
    err.status = 413
    return err


#: What a chunked body's framing (chunk lines, extensions, trailers) may cost beyond
#: its content: this much, plus this many bytes per byte of content. A body of one
#: byte per chunk costs 5 per byte; a few bytes each carrying an 8 KiB extension
#: would make the broker read without end for a body inside its limit.
_FRAMING_FREE = 64 * 1024
_FRAMING_PER_BYTE = 8


@dataclass
class _Idle:
    """A reader whose every read is refused (408) after ``idle`` seconds without a
    byte, and whose early end is a refusal: the chunked framing reads through it."""

    reader: asyncio.StreamReader
    idle: float

    def _stalled(self) -> BadCall:
        err = BadCall(f"no byte of the request body for {self.idle:g} s")
        err.status = 408
        return err

    async def read(self, n: int = -1) -> bytes:
        try:
            async with asyncio.timeout(self.idle):
                return await self.reader.read(n)
        except TimeoutError as exc:
            raise self._stalled() from exc

    async def readexactly(self, n: int) -> bytes:
        try:
            async with asyncio.timeout(self.idle):
                return await self.reader.readexactly(n)
        except TimeoutError as exc:
            raise self._stalled() from exc
        except asyncio.IncompleteReadError as exc:
            raise BadCall("the request body ended early") from exc


@dataclass
class BodyStream:
    """A request body not read yet: ``length`` bytes (checked against its limit),
    or chunked (``length`` None: each chunk counted against ``limit`` as its size
    line arrives), handed to a handler that decides the call first and only then
    reads it, a chunk at a time, so a refused or stalled body is never held in
    memory. Either framing yields the same content, in the same pieces."""

    reader: asyncio.StreamReader
    length: int | None
    idle: float = 30.0
    limit: int = 0

    @classmethod
    def of(
        cls, reader: asyncio.StreamReader, head: RequestHead, limit: int, idle: float = 30.0
    ) -> BodyStream:
        """The body ``head`` announces, framed and checked by :func:`body_length`."""
        return cls(reader, body_length(head, limit), idle, limit)

    async def chunks(self, size: int = 1 << 20) -> AsyncIterator[bytes]:
        """The body in pieces of at most ``size`` bytes; refused (408) if ``idle``
        seconds pass with no byte of it, or if it ends early; a chunked one also
        if its framing is malformed (400) or its content passes ``limit`` (413,
        on the size line that passes it, before the chunk is read)."""
        if self.length is None:
            async for content in self._chunked(size):
                yield content
            return
        left = self.length
        while left:
            piece = bytearray()
            while left and len(piece) < size:
                try:
                    chunk = await asyncio.wait_for(
                        self.reader.read(min(left, size - len(piece), CHUNK)), self.idle
                    )
                except TimeoutError as exc:
                    err = BadCall(f"no byte of the request body for {self.idle:g} s")
                    err.status = 408
                    raise err from exc
                if not chunk:
                    raise BadCall("the request body ended early")
                piece += chunk
                left -= len(chunk)
            yield bytes(piece)

    async def _chunked(self, size: int) -> AsyncIterator[bytes]:
        # The proxy's chunk-line parser and rules (walk_body): one reading of
        # chunked framing in the broker, whoever the body is for.
        src = _Idle(self.reader, self.idle)
        total = framing = 0
        piece = bytearray()
        while True:
            line = await _readline(src)
            chunk = _chunk_size(line)
            framing += len(line) + (2 if chunk else 0)
            total += chunk
            if total > self.limit:
                raise too_large(self.limit)
            if framing > _FRAMING_FREE + _FRAMING_PER_BYTE * total:
                raise BadCall("the chunked framing is too large for the body it carries")
            if chunk == 0:
                break
            left = chunk
            while left:
                data = await src.read(min(left, size - len(piece), CHUNK))
                if not data:
                    raise BadCall("the request body ended early")
                piece += data
                left -= len(data)
                if len(piece) == size:
                    yield bytes(piece)
                    piece.clear()
            if await src.readexactly(2) != b"\r\n":
                raise BadCall("chunk data not followed by CRLF")
        for _ in range(_MAX_TRAILERS + 1):  # trailers, up to the empty line
            trailer = await _readline(src)
            if trailer == b"\r\n":
                # The last piece only once the body is whole: a refusal in its
                # trailers refuses the body, as a length body ended early is.
                if piece:
                    yield bytes(piece)
                return
            _check_trailer(trailer)
            framing += len(trailer)
            if framing > _FRAMING_FREE + _FRAMING_PER_BYTE * total:
                raise BadCall("the chunked framing is too large for the body it carries")
        raise BadCall(f"more than {_MAX_TRAILERS} trailer fields")


async def read_body(
    reader: asyncio.StreamReader, head: RequestHead, limit: int, idle: float = 30.0
) -> bytes:
    """The body ``head`` announces (by length or chunked), at most ``limit`` bytes;
    refused if ``idle`` seconds pass with no byte of it arriving (a stalled sender
    holds nothing)."""
    stream = BodyStream.of(reader, head, limit, idle)
    return b"".join([chunk async for chunk in stream.chunks()])


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


def error_bytes(
    exc: BrokerError, status: int | None = None, extra: Iterable[tuple[str, str]] = ()
) -> bytes:
    """The JSON error response for ``exc`` (with ``status`` instead of its own).

    When this request's refusal was recorded, the answer names its event: ``seq`` and
    ``reason`` in the body, the ``X-Proctor-Refusal`` header, and the status line's
    reason phrase, the one part of a refused CONNECT that HTTP clients show (Python's
    ``Tunnel connection failed: 403 …``, curl's ``CONNECT tunnel failed``)."""
    code = status or exc.status
    doc = exc.as_json()
    phrase = HTTPStatus(code).phrase
    headers = list(extra)
    counter = REQUEST_EVENTS.get()
    refusal = counter.refusal if counter is not None and code not in (429, 503) else None
    if refusal is not None:
        seq, reason = refusal
        text = refusal_text(reason)
        doc.update(seq=seq, reason=reason)
        phrase = f"{phrase} (proctor refusal seq={seq}: {text})"
        headers.append((REFUSAL_HEADER, f'seq={seq}; reason="{text}"'))
    elif isinstance(exc, UpstreamFailed) and exc.seq is not None:
        # Allowed, but the upstream could not be reached or verified: the guest's own
        # exception (``Tunnel connection failed: 502 ...``) says why, and names the
        # completion event that records it. The message is the broker's words
        # (the host, the address, OpenSSL's reason), never a secret or upstream bytes.
        text = refusal_text(exc.message)
        doc.update(seq=exc.seq, reason=exc.message)
        phrase = f"{phrase} (proctor upstream failure seq={exc.seq}: {text})"
        headers.append((UPSTREAM_FAILURE_HEADER, f'seq={exc.seq}; reason="{text}"'))
    body = json.dumps(doc, sort_keys=True).encode()
    head = [
        f"HTTP/1.1 {code} {phrase}",
        "Content-Type: application/json",
        f"Content-Length: {len(body)}",
        "Connection: close",
        *(f"{k}: {v}" for k, v in headers),
    ]
    return ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body


#: Names the ledger event of a refusal: ``seq=<n>; reason="<text>"``.
REFUSAL_HEADER = "X-Proctor-Refusal"
#: Names the completion event of an allowed call whose upstream failed, same form.
UPSTREAM_FAILURE_HEADER = "X-Proctor-Upstream-Failure"
_REFUSAL_MAX = 300


def refusal_text(reason: str) -> str:
    """``reason`` fit for a header value, a status line and a quoted string: printable
    ASCII only (no CR, LF or other control that could split a head), no quote or
    backslash, at most a few hundred characters. The reason is the ledger's own
    (policy ids, the resource, the broker's rule), never an upstream's bytes."""
    text = "".join(c if " " <= c <= "~" and c not in '"\\' else "?" for c in reason)
    return text if len(text) <= _REFUSAL_MAX else text[: _REFUSAL_MAX - 3] + "..."


# -- framing --------------------------------------------------------------------


_MAX_LENGTH_DIGITS = 18
_MAX_CHUNK_DIGITS = 16
_MAX_TRAILERS = 100
_HEX = frozenset(b"0123456789abcdefABCDEF")


@dataclass(frozen=True)
class Framing:
    kind: str  # "none", "length", "chunked", "eof"
    length: int = 0


def check_headers(headers: Iterable[tuple[str, str]]) -> None:
    for name, value in headers:
        if not name or not set(name) <= TOKEN:
            raise BadCall(f"invalid header name {name[:64]!r}")
        if any(c in value for c in "\r\n\0"):
            raise BadCall(f"invalid value for header {name!r}")


def request_framing(headers: list[tuple[str, str]], method: str | None = None) -> Framing:
    """How the request's body is framed; with ``method``, a body on a method whose
    body an upstream may leave unread is refused (it would be read as a request)."""
    framing = _framing_of(headers)
    has_body = framing.kind == "chunked" or (framing.kind == "length" and framing.length > 0)
    if method is not None and method.upper() in BODYLESS and has_body:
        raise BadCall(
            f"a {method} request may not carry a body: an upstream may leave it unread "
            "and read it as another request",
            hint="send the body with POST, PUT or PATCH",
        )
    return framing


def _framing_of(headers: list[tuple[str, str]]) -> Framing:
    te = [v for k, v in headers if k.lower() == "transfer-encoding"]
    cl = [v for k, v in headers if k.lower() == "content-length"]
    # Both, or several differing lengths, are how requests get smuggled past
    # a proxy that reads them one way to a server that reads them another.
    if te and cl:
        raise BadCall("both Transfer-Encoding and Content-Length")
    # So is a Connection header naming them: a hop that honours it drops the
    # framing header and reads the body as the next request.
    named = connection_named(headers)
    if named & {"content-length", "transfer-encoding"}:
        raise BadCall("a Connection header may not name Content-Length or Transfer-Encoding")
    if te:
        if len(te) != 1 or te[0].strip().lower() != "chunked":
            raise BadCall("only Transfer-Encoding: chunked is supported")
        return Framing("chunked")
    if cl:
        values = {v.strip() for v in cl}
        if len(values) != 1:
            raise BadCall("conflicting Content-Length headers")
        value = values.pop()
        if not is_length(value):
            raise BadCall("invalid Content-Length")
        return Framing("length", int(value))
    return Framing("none")


def is_length(value: str) -> bool:
    """ASCII digits, at most 18 of them: what every HTTP/1.1 implementation reads alike.
    (``str.isdigit`` also accepts "²", and ``int`` refuses over 4300 digits.)"""
    return value.isascii() and value.isdigit() and len(value.lstrip("0")) <= _MAX_LENGTH_DIGITS


def response_framing(method: str, status: int, headers: list[tuple[str, str]]) -> Framing:
    if method == "HEAD" or 100 <= status < 200 or status in (204, 304):
        return Framing("none")
    te = [v.strip().lower() for k, v in headers if k.lower() == "transfer-encoding"]
    if te:
        return Framing("chunked") if te[-1].endswith("chunked") else Framing("eof")
    cl = {v.strip() for k, v in headers if k.lower() == "content-length"}
    if len(cl) == 1:
        value = cl.pop()
        if is_length(value):
            return Framing("length", int(value))
    if cl:
        raise UpstreamFailed("the upstream sent an invalid Content-Length")
    return Framing("eof")


def serialize_head(first: str, headers: Iterable[tuple[str, str]]) -> bytes:
    lines = [first, *(f"{k}: {v}" for k, v in headers)]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def connection_named(
    headers: Iterable[tuple[str, str]], fields: tuple[str, ...] = ("connection", "proxy-connection")
) -> set[str]:
    """The header names a Connection header (or ``fields``) lists, lower-cased: those
    are about this hop only."""
    return {
        token.strip().lower() for k, v in headers if k.lower() in fields for token in v.split(",")
    }


def forward_headers(
    headers: list[tuple[str, str]], authority: str, *, keep: bool = False
) -> list[tuple[str, str]]:
    """The request's headers as they go upstream: hop-by-hop ones dropped, ``Host``
    the decided authority, and ``Connection: close`` unless the guest's connection
    may be ``keep``-ed (then the upstream's own answer says whether it would have
    kept it, and that answer is what the guest gets)."""
    named = connection_named(headers)
    out = [("Host", authority)]
    for name, value in headers:
        lower = name.lower()
        if (
            lower in HOP_BY_HOP
            or lower in named
            or lower in {"host", "expect"}
            or lower.startswith("proxy-")
        ):
            continue
        out.append((name, value))
    if not keep:
        out.append(("Connection", "close"))
    return out


def response_headers(headers: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """A response's headers without its hop-by-hop ones (those are about the upstream
    connection, closed after each request), ``Transfer-Encoding`` kept."""
    named = connection_named(headers, ("connection",)) - {"transfer-encoding", "content-length"}
    return [(k, v) for k, v in headers if k.lower() not in HOP_BY_HOP | named]


class Source(Protocol):
    """What the request and response parsers read from: a StreamReader or a TlsStream."""

    async def read(self, n: int = ...) -> bytes: ...
    async def readexactly(self, n: int) -> bytes: ...


async def walk_body(
    src: Source,
    framing: Framing,
    put: Callable[[bytes], Awaitable[None]],
    *,
    payload: Callable[[bytes], Awaitable[None]] | None = None,
) -> None:
    """Read one message body as framed, passing its raw bytes (framing included) to
    put; with ``payload``, each piece of the content alone goes there first."""
    if framing.kind == "length":
        left = framing.length
        while left:
            data = await src.read(min(left, CHUNK))
            if not data:
                raise asyncio.IncompleteReadError(b"", left)
            left -= len(data)
            if payload is not None:
                await payload(data)
            await put(data)
    elif framing.kind == "chunked":
        # Strict, and checked before a byte is passed on: the bytes go on as
        # they came, so a line that another parser could read as a different
        # size ("0x10", " 10", "10\n") would frame a second, undecided request.
        while True:
            line = await _readline(src)
            size = _chunk_size(line)
            if size == 0:
                # The last chunk and the trailers go on in one piece, once complete:
                # a refusal on a trailer leaves the upstream with no end of the body
                # (a lenient server could take a cut after "0" as one).
                tail = bytearray(line)
                for _ in range(_MAX_TRAILERS + 1):  # trailers, up to the empty line
                    trailer = await _readline(src)
                    if trailer != b"\r\n":
                        _check_trailer(trailer)
                    tail += trailer
                    if trailer == b"\r\n":
                        await put(bytes(tail))
                        return
                raise BadCall(f"more than {_MAX_TRAILERS} trailer fields")
            await put(line)
            left = size
            while left:
                data = await src.readexactly(min(left, CHUNK))
                left -= len(data)
                if payload is not None:
                    await payload(data)
                await put(data)
            if await src.readexactly(2) != b"\r\n":
                raise BadCall("chunk data not followed by CRLF")
            await put(b"\r\n")
    elif framing.kind == "eof":
        while data := await src.read(CHUNK):
            if payload is not None:
                await payload(data)
            await put(data)


def _chunk_size(line: bytes) -> int:
    """The size in a chunk line (``1*HEXDIG [BWS ";" ext] CRLF``), or BadCall."""
    text = line[:-2]
    size_text, _, ext = text.partition(b";")
    # Whitespace after the digits is read alike by everyone who takes it (h11 does);
    # before them it is not: " 10" is 0x10 to some and a bad line to others.
    size_text = size_text.rstrip(b" \t")
    if not 0 < len(size_text) <= _MAX_CHUNK_DIGITS or not set(size_text) <= _HEX:
        raise BadCall("invalid chunk size")
    if any((b < 0x20 and b != 0x09) or b == 0x7F for b in ext):
        raise BadCall("invalid chunk extension")
    return int(size_text, 16)


def _check_trailer(line: bytes) -> None:
    name, sep, value = line[:-2].partition(b":")
    if not sep or not name or not set(name.decode("latin-1")) <= TOKEN:
        raise BadCall("malformed trailer field")
    if any(b in value for b in b"\r\n\0"):
        raise BadCall("malformed trailer field")


async def _readline(src: Source) -> bytes:
    """One CRLF-terminated line of chunked framing; a bare CR or LF is refused."""
    line = bytearray()
    while not line.endswith(b"\r\n"):
        if len(line) > _MAX_LINE:
            raise BadCall("chunk line too long")
        line += await src.readexactly(1)
        if (line[-1:] == b"\n" and line[-2:] != b"\r\n") or b"\r" in line[:-2]:
            raise BadCall("bare CR or LF in chunked framing")
    return bytes(line)
