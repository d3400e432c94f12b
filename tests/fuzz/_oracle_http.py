"""The oracle for the broker socket's HTTP parser (``proctor.broker._http``), shared by
the hypothesis tests and the atheris harness: bytes in, and either a well-formed
request that round-trips or a clean 4xx refusal out; anything else is an AssertionError."""

from __future__ import annotations

import asyncio
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
    if out.body is not None:
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
