"""Oracles for the egress proxy's parsers (``proctor.broker._http``, ``._proxy``, ``._egress``),
shared by the hypothesis tests and the atheris harnesses.

Each takes untrusted input and returns what was parsed, raising AssertionError when a
property breaks: a refusal must be a BadCall (or the stream ending early); an accepted
head must round-trip; framing must never be ambiguous, judged against h11, an
independent strict parser, reading the bytes the proxy would send upstream; and an
accepted host must be the address the operating system would read from the same text.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from dataclasses import dataclass

import h11

from proctor.broker._egress import Host, parse_host, split_authority
from proctor.broker._http import (
    Framing,
    forward_headers,
    parse_request_head,
    request_framing,
    serialize_head,
    walk_body,
)
from proctor.broker._proxy import _parse_url
from proctor.broker._scope import BadCall

BODYLESS = frozenset({"GET", "HEAD", "DELETE", "OPTIONS", "TRACE"})
TOKEN = frozenset("!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")
_LOOP: asyncio.AbstractEventLoop | None = None


def _loop() -> asyncio.AbstractEventLoop:
    global _LOOP
    if _LOOP is None or _LOOP.is_closed():
        _LOOP = asyncio.new_event_loop()
    return _LOOP


def _no_ctl(text: str) -> bool:
    return not any(ord(c) < 0x21 or ord(c) == 0x7F for c in text)


# -- heads ---------------------------------------------------------------------------


def check_request_head(head: bytes) -> tuple[str, str, list[tuple[str, str]]] | None:
    """``parse_request_head`` on ``head``: None for a refusal, else the parsed head."""
    try:
        parsed = parse_request_head(head)
        method, target, headers = parsed.method, parsed.target, parsed.headers
    except BadCall as exc:
        assert exc.status == 400 and exc.message
        return None
    assert method and set(method) <= TOKEN
    assert target and _no_ctl(target), target
    for name, value in headers:
        assert name and set(name) <= TOKEN, name
        assert not any(c in value for c in "\r\n\0"), value
        assert value == value.strip(" \t")
    text = head.decode("latin-1")
    assert "\r" not in text.replace("\r\n", "") and "\n" not in text.replace("\r\n", "")
    again = parse_request_head(serialize_head(f"{method} {target} HTTP/1.1", headers))
    assert (again.method, again.target, again.headers) == (method, target, headers), again
    return method, target, headers


# -- framing, judged by h11 -----------------------------------------------------------


@dataclass
class Forwarded:
    framing: Framing
    upstream: bytes  # what the proxy writes upstream: the head it builds, the body as walked
    body_raw: bytes


async def _walk(framing: Framing, stream: bytes) -> bytes:
    reader = asyncio.StreamReader()
    reader.feed_data(stream)
    reader.feed_eof()
    out = bytearray()

    async def put(data: bytes) -> None:
        out.extend(data)

    await walk_body(reader, framing, put)
    return bytes(out)


def check_forward(method: str, headers: list[tuple[str, str]], stream: bytes) -> Forwarded | None:
    """What ``handle_forward`` would send upstream for a request with ``headers`` whose
    body (and whatever follows it) is ``stream``; None when the proxy refuses it.

    Property: if h11 accepts the upstream bytes, it reads exactly one request, with
    the proxy's method, target and body, and no byte left over for a second request."""
    try:
        framing = request_framing(headers, method)
    except BadCall as exc:
        assert exc.status == 400
        return None
    if method in BODYLESS:
        # A body an upstream may leave unread would be read as the next request.
        assert framing.kind == "none" or (framing.kind == "length" and framing.length == 0)
    te = [v for k, v in headers if k.lower() == "transfer-encoding"]
    cl = {v.strip() for k, v in headers if k.lower() == "content-length"}
    assert not (te and cl), "both framings accepted"
    assert len(cl) <= 1, "conflicting lengths accepted"
    if framing.kind == "chunked":
        assert te == ["chunked"] or [t.lower().strip() for t in te] == ["chunked"]
    if framing.kind == "length":
        assert int(cl.pop()) == framing.length
    try:
        body_raw = _loop().run_until_complete(asyncio.wait_for(_walk(framing, stream), 10))
    except BadCall as exc:
        assert exc.status == 400
        return None
    except asyncio.IncompleteReadError:
        return None  # the guest stopped early: the proxy's copy fails, nothing is framed
    assert stream.startswith(body_raw), "the proxy forwarded bytes it did not read"
    out = forward_headers(headers, "upstream.test")
    upstream = serialize_head(f"{method} /x HTTP/1.1", out) + body_raw
    _judge_with_h11(method, upstream, framing, body_raw)
    return Forwarded(framing, upstream, body_raw)


def _judge_with_h11(method: str, upstream: bytes, framing: Framing, body_raw: bytes) -> None:
    conn = h11.Connection(h11.SERVER)
    conn.receive_data(upstream)
    conn.receive_data(b"")  # the proxy sends nothing more on this connection
    events = []
    try:
        while True:
            event = conn.next_event()
            if event in (h11.NEED_DATA, h11.PAUSED):
                break
            events.append(event)
            if isinstance(event, (h11.EndOfMessage, h11.ConnectionClosed)):
                break
    except h11.RemoteProtocolError:
        return  # a strict server refuses it: not read two ways, just refused
    assert events and isinstance(events[0], h11.Request), events
    assert isinstance(events[-1], h11.EndOfMessage), f"h11 saw an unfinished request: {events}"
    assert events[0].method.decode() == method
    body = b"".join(bytes(e.data) for e in events if isinstance(e, h11.Data))
    if framing.kind == "length":
        assert body == body_raw
    elif framing.kind == "none":
        assert body == b""
    data, _closed = conn.trailing_data
    assert data == b"", f"bytes after the request, a second request to h11: {data[:80]!r}"


# -- URLs and hosts -----------------------------------------------------------------


def _inet_aton(text: str) -> ipaddress.IPv4Address | None:
    """What glibc's inet_aton reads ``text`` as, the way getaddrinfo would."""
    try:
        packed = socket.inet_aton(text)
    except (OSError, ValueError, UnicodeError):
        return None
    return ipaddress.IPv4Address(packed)


def check_host(text: str) -> Host | None:
    """``parse_host`` on ``text``: None for a refusal, else the canonical host."""
    try:
        host = parse_host(text)
    except BadCall as exc:
        # Refusing a spelling of an address is fine; taking it as a name is not.
        assert exc.status == 400
        return None
    assert parse_host(host.name) == host, "the canonical name is not a fixpoint"
    assert parse_host(host.display) == host
    raw = text.strip()
    bare = raw[1:-1] if raw.startswith("[") and raw.endswith("]") else raw
    candidate = bare[:-1] if bare.endswith(".") else bare
    aton = _inet_aton(candidate) if candidate.isascii() and candidate else None
    if aton is not None and "%" not in candidate:
        # Whatever the OS would dial for this text is what the proxy decides on.
        assert host.address == aton, (text, host, aton)
    if ":" in candidate:
        packed = socket.inet_pton(socket.AF_INET6, candidate.split("%", 1)[0])
        v6 = ipaddress.IPv6Address(packed)
        assert host.address == (v6.ipv4_mapped or v6), (text, host)
    if host.address is None:
        assert _inet_aton(host.name) is None, f"{host.name!r} is an address in disguise"
        assert host.name.isascii() and host.name == host.name.lower()
    else:
        assert str(host.address) == host.name
        assert not (isinstance(host.address, ipaddress.IPv6Address) and host.address.ipv4_mapped)
    return host


def check_authority(text: str, default_port: int | None) -> tuple[str, int] | None:
    try:
        host, port = split_authority(text, default_port)
    except BadCall as exc:
        assert exc.status == 400
        return None
    assert 1 <= port <= 65535 or port == default_port
    return host, port


def check_url(url: str) -> tuple[Host, int, str, str] | None:
    """``_parse_url`` on ``url``: None for a refusal, else (host, port, origin, authority),
    which must be rebuilt into a URL that parses to the same four."""
    try:
        host, port, origin, authority = _parse_url(url)
    except BadCall as exc:
        assert exc.status == 400 and exc.message
        return None
    assert url.lower().startswith("http://")
    assert origin.startswith("/") and _no_ctl(origin) and " " not in origin, origin
    assert "@" not in authority and _no_ctl(authority)
    assert 1 <= port <= 65535
    assert check_host(host.name) == host
    again = _parse_url(f"http://{authority}{origin}")
    assert again == (host, port, origin, authority), (again, (host, port, origin, authority))
    return host, port, origin, authority
