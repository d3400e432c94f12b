"""The oracle for the broker socket's HTTP parser (``proctor.broker._http``), shared by
the hypothesis tests and the atheris harness: bytes in, and either a well-formed
request that round-trips or a clean 4xx refusal out; anything else is an AssertionError."""

from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass

from proctor.broker._http import MAX_HEAD, RequestHead, read_body, read_head
from proctor.broker._scope import BadCall

_TOKEN = frozenset("!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")
BODY_LIMIT = 4096
_LOOP: asyncio.AbstractEventLoop | None = None


def _loop() -> asyncio.AbstractEventLoop:
    global _LOOP
    if _LOOP is None or _LOOP.is_closed():
        _LOOP = asyncio.new_event_loop()
    return _LOOP


@dataclass
class Parsed:
    head: RequestHead | None  # None: a clean end of stream
    body: bytes | None  # None: the body was refused
    refusal: BadCall | None


def serialize(head: RequestHead) -> bytes:
    lines = [f"{head.method} {head.target} {head.version}"]
    lines += [f"{k}: {v}" for k, v in head.headers]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


async def _parse(data: bytes, cuts: list[int], eof: bool, wait: float) -> Parsed:
    reader = asyncio.StreamReader(limit=MAX_HEAD)

    async def feed() -> None:
        last = 0
        for cut in sorted({c % (len(data) + 1) for c in cuts}):
            reader.feed_data(data[last:cut])
            last = cut
            await asyncio.sleep(0)  # the parser sees the stream arrive in pieces
        reader.feed_data(data[last:])
        if eof:
            reader.feed_eof()

    feeder = asyncio.ensure_future(feed())
    try:
        try:
            head = await read_head(reader, timeout=wait)
        except BadCall as exc:
            return Parsed(None, None, exc)
        if head is None:
            return Parsed(None, None, None)
        try:
            body = await read_body(reader, head, BODY_LIMIT, idle=wait)
        except BadCall as exc:
            return Parsed(head, None, exc)
        return Parsed(head, body, None)
    finally:
        await feeder


def parse(
    data: bytes, cuts: list[int] | None = None, *, eof: bool = True, wait: float = 1.0
) -> Parsed:
    """Feed ``data`` (cut into pieces at ``cuts``) through a real StreamReader; the
    parser's own timeouts are ``wait`` seconds (they fire only without EOF)."""
    coro = asyncio.wait_for(_parse(data, cuts or [], eof, wait), 10)
    return _loop().run_until_complete(coro)


def check(
    data: bytes, cuts: list[int] | None = None, *, eof: bool = True, wait: float = 1.0
) -> Parsed:
    """Parse ``data`` and assert every property of the outcome; returns it."""
    out = parse(data, cuts, eof=eof, wait=wait)
    end = data.find(b"\r\n\r\n")
    if out.refusal is not None:
        assert out.refusal.status in (400, 408, 413), out.refusal.status
        assert out.refusal.message and out.refusal.code == "bad_request"
        if out.refusal.status == 413:
            assert out.head is not None
    if out.head is None:
        if out.refusal is None:
            assert data == b"", "only an empty stream is a clean end"
        return out
    head = out.head
    assert 0 <= end <= MAX_HEAD, "a head was parsed beyond the bound"
    assert head.method and set(head.method) <= set("ABCDEFGHIJKLMNOPQRSTUVWXYZ")
    assert head.version in ("HTTP/1.1", "HTTP/1.0")
    assert head.target and not any(ord(c) < 0x21 or ord(c) == 0x7F for c in head.target)
    for name, value in head.headers:
        assert name and set(name) <= _TOKEN, name
        assert not any(c in value for c in "\r\n\0"), value
        assert value == value.strip(" \t")
    # Serialized again, the head parses to the same head: nothing was dropped or
    # reinterpreted that a second parser (the proxy, an upstream) would read otherwise.
    again = parse(serialize(head))
    assert again.head == head, (again.head, head)
    if any(k.lower() == "transfer-encoding" for k, _ in head.headers):
        _check_chunked(head, data[end + 4 :], out, eof)
    elif out.body is not None:
        lengths = {v for k, v in head.headers if k.lower() == "content-length"}
        expected = int(lengths.pop()) if lengths else 0
        assert len(out.body) == expected <= BODY_LIMIT
        assert out.body == data[end + 4 : end + 4 + expected], "the body is not the next bytes"
    elif out.refusal is not None and out.refusal.status == 413:
        lengths = {v for k, v in head.headers if k.lower() == "content-length"}
        assert len(lengths) == 1
        digits = lengths.pop().lstrip("0")
        assert len(digits) > len(str(BODY_LIMIT)) or int(digits) > BODY_LIMIT
    return out


# -- chunked bodies: a reference decoder, written from RFC 9112 7.1, not from _http.py --

_SIZE_LINE = re.compile(rb"([0-9A-Fa-f]{1,16})[ \t]*(?:;[^\x00-\x08\x0a-\x1f\x7f]*)?")
_TRAILER = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+:[^\x00\r\n]*")
_LINE_MAX = 8193  # a chunk or trailer line, CRLF included


@dataclass(frozen=True)
class Reference:
    """What a strict chunked reader makes of the bytes after a head: the content
    (``body``), a refusal (``status``), or neither because the bytes ran out first."""

    body: bytes | None = None
    status: int | None = None

    @property
    def short(self) -> bool:
        return self.body is None and self.status is None


def _line(rest: bytes, at: int) -> tuple[bytes | None, int, bool]:
    """(the line at ``at`` without its CRLF, where the next starts, malformed?)."""
    nl = rest.find(b"\n", at)
    cr = rest.find(b"\r", at)
    window = rest[at : at + _LINE_MAX]
    if nl < 0:
        # No end yet: malformed already if the line is past the bound, or if a CR
        # has two bytes after it (so neither of them ended the line). A CR with one
        # byte after it is not known bad until the next byte arrives.
        bad = (0 <= cr <= len(rest) - 3) or len(window) >= _LINE_MAX
        return None, at, bad
    if nl == at or rest[nl - 1 : nl] != b"\r" or rest.find(b"\r", at, nl - 1) >= 0:
        return None, at, True  # a bare LF, or a CR not right before the LF
    if nl + 1 - at > _LINE_MAX:
        return None, at, True
    return rest[at : nl - 1], nl + 1, False


def reference_chunked(head: RequestHead, rest: bytes, limit: int) -> Reference:
    """The outcome RFC 9112 gives a chunked body in ``rest``, with the broker's rules:
    no Content-Length beside it, the one coding ``chunked``, HTTP/1.1 only, at most
    ``limit`` bytes of content (refused on the size line that passes it)."""
    te = [v for k, v in head.headers if k.lower() == "transfer-encoding"]
    cl = [v for k, v in head.headers if k.lower() == "content-length"]
    if cl or len(te) != 1 or te[0].lower() != "chunked" or head.version != "HTTP/1.1":
        return Reference(status=400)
    at, body = 0, bytearray()
    while True:
        line, at, bad = _line(rest, at)
        if bad:
            return Reference(status=400)
        if line is None:
            return Reference()
        match = _SIZE_LINE.fullmatch(line)
        if match is None:
            return Reference(status=400)
        size = int(match.group(1), 16)
        if len(body) + size > limit:
            return Reference(status=413)
        if size == 0:
            break
        if len(rest) < at + size + 2:
            return Reference()
        body += rest[at : at + size]
        if rest[at + size : at + size + 2] != b"\r\n":
            return Reference(status=400)
        at += size + 2
    for _ in range(101):
        line, at, bad = _line(rest, at)
        if bad:
            return Reference(status=400)
        if line is None:
            return Reference()
        if line == b"":
            return Reference(body=bytes(body))
        if not _TRAILER.fullmatch(line):
            return Reference(status=400)
    return Reference(status=400)


def _check_chunked(head: RequestHead, rest: bytes, out: Parsed, eof: bool) -> None:
    ref = reference_chunked(head, rest, BODY_LIMIT)
    got = out.refusal.status if out.refusal is not None else None
    if ref.body is not None:
        assert out.body == ref.body, (out.body, ref.body, got)
    elif ref.status is not None:
        # 413 is answered on the size line that passes the limit, before its data
        # (none of which need have arrived): never a wait for more.
        assert got == ref.status, (got, ref.status, out.refusal)
    else:
        # The bytes ran out before a verdict: an early end, or (no EOF) a stall;
        # without EOF, a malformed line may be seen before its end arrives.
        assert got in ((400,) if eof else (400, 408)), (got, out.refusal)
