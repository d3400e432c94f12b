"""The egress proxy's parsers: request heads, framing, chunked bodies, URLs and hosts.

Properties (``_oracle_proxy``): a clear BadCall or a head that round-trips; framing
that h11 (an independent, strict parser) reads the same way from the bytes the proxy
sends upstream, with nothing left over for a second request (smuggling); an accepted
host that is the very address the OS would read from the same text (SSRF spellings).
Then the same framing cases through a real Broker, the real proxy and a real loopback
upstream that records every byte it gets: one request per connection, the path the
ledger says was decided, never a second request.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import re
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import h11
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from proctor.broker import EgressProxy
from proctor.broker._egress import IPAddress, UpstreamFailed
from proctor.broker._http import Framing, parse_request_head, walk_body
from proctor.broker._scope import BadCall
from tests.fuzz._oracle_proxy import (
    check_authority,
    check_forward,
    check_host,
    check_request_head,
    check_url,
)
from tests.fuzz._support import TIMEOUT, Served, exchange, fuzz_settings, one_in, served_broker

pytestmark = pytest.mark.timeout(TIMEOUT)

# -- heads -----------------------------------------------------------------------------

HEAD_LINES = [
    "GET /x HTTP/1.1",
    "POST /x HTTP/1.1",
    "GET /x HTTP/1.0",
    "GET  /x HTTP/1.1",
    "GET /x\x0b HTTP/1.1",
    "G\x00T /x HTTP/1.1",
    "GET /x HTTP/2",
    "OPTIONS * HTTP/1.1",
    "GET http://a/ HTTP/1.1",
    "GET /é HTTP/1.1",
]
FIELDS = [
    "Host: upstream.test",
    "Content-Length: 5",
    "Transfer-Encoding: chunked",
    "Content-Length : 5",
    " Content-Length: 5",
    "Content-Length:\t5\t",
    "X: a\x00b",
    "X: a\x01b",
    "X:",
    ": x",
    "X-é: 1",
    "X: é",
    "\tfolded",
    "X: " + "a" * 9000,
]

HEAD_LINE_S = st.sampled_from(HEAD_LINES) | st.text(max_size=30)
FIELD_LINES_S = st.lists(st.sampled_from(FIELDS) | st.text(max_size=30), max_size=8)


@st.composite
def heads(draw: st.DrawFn) -> bytes:
    lines = [draw(HEAD_LINE_S)]
    lines += draw(FIELD_LINES_S)
    eols = st.sampled_from(["\r\n", "\r\n", "\r\n", "\n", "\r"])
    text = "".join(line + draw(eols) for line in lines) + "\r\n"
    data = bytearray(text.encode("utf-8", "surrogatepass"))
    for _ in range(draw(st.integers(0, 3))):
        at = draw(st.integers(0, len(data)))
        data[at:at] = draw(st.sampled_from([b"\r", b"\n", b"\x00", b" ", b":", b"\x85"]))
    return bytes(data)


@fuzz_settings(300)
@given(head=heads() | st.binary(max_size=300))
@example(head=b"GET /x HTTP/1.1\r\nX: a\rb\r\n\r\n")
@example(head=b"GET /x\x0b HTTP/1.1\r\n\r\n")
@example(head=b"GET  /x HTTP/1.1\r\n\r\n")
def test_request_heads_round_trip_or_are_refused(head: bytes) -> None:
    check_request_head(head)


# -- framing: the proxy and h11 must read one request, the same one ---------------------

SMUGGLED = b"GET /smuggled HTTP/1.1\r\nHost: upstream.test\r\n\r\n"
CL_VALUES = ["0", "5", "10", "005", "5 ", "5, 5", "-1", "+5", "0x5", "²", "1e3", "9" * 30, ""]
CL_VALUES.append(str(len(SMUGGLED)))  # a body that is exactly a second request
TE_VALUES = [
    "chunked",
    "Chunked",
    " chunked",
    "gzip",
    "gzip, chunked",
    "chunked, gzip",
    "identity",
    "chunked;q=1",
    "",
]
CONNECTION = ["close", "keep-alive", "Content-Length", "transfer-encoding, close", "x-foo"]


FRAMING_HEADER_S = st.sampled_from(
    [
        *(("Content-Length", v) for v in CL_VALUES),
        *(("content-length", v) for v in CL_VALUES[:3]),
        *(("Transfer-Encoding", v) for v in TE_VALUES),
        *(("Connection", v) for v in CONNECTION),
        ("Expect", "100-continue"),
        ("X-Foo", "bar"),
    ]
)


@st.composite
def framing_headers(draw: st.DrawFn) -> list[tuple[str, str]]:
    headers = [("Host", "upstream.test")]
    for _ in range(draw(st.integers(0, 4))):
        headers.append(draw(FRAMING_HEADER_S))
    return headers


SIZE_SPELLINGS = ["{:x}", "{:X}", "{:04x}", "0x{:x}", " {:x}", "{:x} ", "+{:x}", "{:x}\x0b"]


@st.composite
def chunked_stream(draw: st.DrawFn) -> bytes:
    """A chunked body with the spellings parsers disagree on, then a smuggled request."""
    out = bytearray()
    for _ in range(draw(st.integers(0, 3))):
        data = draw(st.binary(min_size=1, max_size=24))
        spelled = draw(st.sampled_from(SIZE_SPELLINGS[:1] * 6 + SIZE_SPELLINGS))
        declared = len(data) + draw(st.sampled_from([0, 0, 0, 0, 1, -1]))
        ext = draw(st.sampled_from(["", "", ";a=b", ' ;a="x"', ";\x01"]))
        eol = draw(st.sampled_from([b"\r\n"] * 6 + [b"\n", b"\r"]))
        out += spelled.format(max(declared, 0)).encode() + ext.encode() + eol + data
        out += draw(st.sampled_from([b"\r\n"] * 6 + [b"\n", b"XY", b""]))
    out += draw(st.sampled_from([b"0", b"00", b"0x0", b"0 "])) + b"\r\n"
    for _ in range(draw(st.integers(0, 2))):
        out += draw(st.sampled_from([b"X-T: 1\r\n", b"X-T 1\r\n", b"X-T: 1\n", b": x\r\n"]))
    out += b"\r\n"
    return bytes(out) + SMUGGLED


STREAM_S = st.one_of(
    chunked_stream(),
    st.binary(max_size=40).map(lambda b: b + SMUGGLED),
    st.binary(max_size=40).map(lambda b: SMUGGLED + b),
)


@st.composite
def forward_cases(draw: st.DrawFn) -> tuple[str, list[tuple[str, str]], bytes]:
    method = draw(st.sampled_from(["GET", "POST", "PUT", "HEAD", "DELETE", "PATCH"]))
    headers = draw(framing_headers())
    stream = draw(STREAM_S)
    if draw(st.booleans()):
        data = bytearray(stream)
        at = draw(st.integers(0, len(data)))
        data[at:at] = draw(st.sampled_from([b"\r\n", b"\n", b"0\r\n\r\n", b"\x00"]))
        stream = bytes(data)
    return method, headers, stream


@fuzz_settings(600)
@given(case=forward_cases())
@example(case=("POST", [("Transfer-Encoding", "chunked")], b"0x10\r\n" + b"a" * 16 + SMUGGLED))
@example(case=("POST", [("Transfer-Encoding", "chunked")], b" 5\r\nhello\r\n0\r\n\r\n" + SMUGGLED))
@example(case=("POST", [("Transfer-Encoding", "chunked")], b"5\r\nhelloXY0\r\n\r\n" + SMUGGLED))
@example(case=("POST", [("Content-Length", "5"), ("Connection", "content-length")], SMUGGLED))
@example(case=("POST", [("Content-Length", "9" * 5000)], b""))
def test_framing_is_never_read_two_ways(case: tuple[str, list[tuple[str, str]], bytes]) -> None:
    method, headers, stream = case
    check_forward(method, headers, stream)


@fuzz_settings(60)
@given(stream=chunked_stream() | st.binary(max_size=200), cut=st.integers(0, 400))
def test_a_chunked_body_cut_short_ends_cleanly(stream: bytes, cut: int) -> None:
    """Whatever the guest stops sending, the walk ends with a BadCall or an early end."""

    async def walk() -> None:
        reader = asyncio.StreamReader()
        reader.feed_data(stream[:cut])
        reader.feed_eof()

        async def put(data: bytes) -> None:
            pass

        await walk_body(reader, Framing("chunked"), put)

    with contextlib.suppress(BadCall, asyncio.IncompleteReadError):
        asyncio.run(asyncio.wait_for(walk(), 5))


def test_a_chunk_line_cannot_grow_without_bound() -> None:
    async def walk(data: bytes) -> None:
        reader = asyncio.StreamReader()
        reader.feed_data(data)
        reader.feed_eof()

        async def put(chunk: bytes) -> None:
            pass

        await walk_body(reader, Framing("chunked"), put)

    for data in (b"5;" + b"x" * 100_000 + b"\r\n", b"0\r\n" + b"X-T: 1\r\n" * 200 + b"\r\n"):
        with pytest.raises(BadCall):
            asyncio.run(walk(data))


# -- URLs and hosts ---------------------------------------------------------------------


@st.composite
def ipv4_spellings(draw: st.DrawFn) -> str:
    """One address the way inet_aton reads them: 1 to 4 parts, each decimal, octal or hex."""
    number = draw(
        st.sampled_from([0x7F000001, 0xA9FEA9FE, 0x0A000001, 0, 0xFFFFFFFF, 0x08080808])
        | st.integers(0, 0xFFFFFFFF)
    )
    parts = draw(st.integers(1, 4))
    values = [(number >> (8 * (3 - i))) & 0xFF for i in range(parts - 1)]
    values.append(number & ((1 << (8 * (5 - parts))) - 1))
    if draw(one_in(6)):
        values[draw(st.integers(0, parts - 1))] += 256  # out of range for its place
    spelled = []
    for v in values:
        form = draw(st.sampled_from(["d", "o", "x", "X", "0d"]))
        spelled.append(
            {"d": str(v), "o": "0" + oct(v)[2:], "x": hex(v), "X": "0X" + hex(v)[2:].upper()}.get(
                form, "0" + str(v)
            )
        )
    return ".".join(spelled) + draw(st.sampled_from(["", "", ".", ".."]))


@st.composite
def ipv6_spellings(draw: st.DrawFn) -> str:
    address = ipaddress.IPv6Address(
        draw(
            st.sampled_from(
                [
                    1,
                    0xFFFF7F000001,
                    0xFFFFA9FEA9FE,
                    0x7F000001,
                    0xFE800000000000000000000000000001,
                    0x20014860486000000000000000008888,
                    0x0064FF9B00000000000000007F000001,
                    0x20020A00000100000000000000000000,
                ]
            )
            | st.integers(0, (1 << 128) - 1)
        )
    )
    text = draw(st.sampled_from([address.compressed, address.exploded, str(address).upper()]))
    if address.ipv4_mapped is not None and draw(st.booleans()):
        text = f"::ffff:{address.ipv4_mapped}"
    zone = draw(st.sampled_from(["", "", "%25eth0", "%eth0", "%", "%25"]))
    return text + zone if draw(one_in(5)) else f"[{text}{zone}]"


NAMES = [
    "example.com",
    "EXAMPLE.com.",
    "a..b",
    "-a.com",
    "xn--bcher-kva.example",
    "bücher.example",
    "exa%6dple.com",
    "%31%32%37.0.0.1",
    "example.com\x00.evil",
    "a" * 64 + ".com",
    ".".join(["a" * 63] * 5),
    "localhost",
    "1.2.3.4.5",
    "0x",
    "0x.0x.0x.0x",
    "[example.com]",
    "[1.2.3.4]",
    "127.0.0.1 ",
    "127.0.0.1\t",
]
hosts = st.one_of(st.sampled_from(NAMES), ipv4_spellings(), ipv6_spellings(), st.text(max_size=20))


@fuzz_settings(500)
@given(text=hosts)
@example(text="0177.1")
@example(text="2130706433")
@example(text="[::ffff:127.0.0.1]")
@example(text="[abc]")
@example(text="1.1.0.0..")  # found by fuzz/fuzz_proxy_url.py: an address taken for a name
def test_a_host_is_the_address_the_os_would_dial(text: str) -> None:
    check_host(text)


PORTS = ["", ":80", ":", ":0", ":65535", ":65536", ":8080", ":+80", ":0x50", ":٨٠", ":0080"]


@st.composite
def urls(draw: st.DrawFn) -> str:
    scheme = draw(st.sampled_from(["http", "HTTP", "https", "ftp", "", "http:"]))
    sep = draw(st.sampled_from(["://", "://", "://", ":/", ":///", ":\\\\"]))
    userinfo = draw(st.sampled_from(["", "", "", "user@", "u:p@", "@", "a@b@", "a%40b@"]))
    host = draw(hosts)
    if ":" in host and not host.startswith("[") and draw(st.booleans()):
        host = f"[{host}]"
    port = draw(st.sampled_from(PORTS) | st.just(":" + "9" * 5000))
    path = draw(
        st.sampled_from(["", "/", "/a", "/a b", "/%2e%2e/", "/?q=1", "#frag", "\\evil", "/\x7f"])
        | st.text(max_size=10).map(lambda t: "/" + t)
    )
    return f"{scheme}{sep}{userinfo}{host}{port}{path}"


@fuzz_settings(400)
@given(url=urls() | st.text(max_size=60))
@example(url="http://[abc/")
@example(url="http://[::1")
@example(url="http://a:" + "9" * 5000 + "/")
@example(url="http://evil.com\\@good.com/")
@example(url="http://good.com#@evil.com/")
def test_urls_parse_to_one_host_or_are_refused(url: str) -> None:
    check_url(url)


@fuzz_settings(150)
@given(
    text=st.text(max_size=40) | hosts.map(lambda h: h + ":443"), default=st.sampled_from([None, 80])
)
def test_authorities_split_or_are_refused(text: str, default: int | None) -> None:
    check_authority(text, default)


# -- the same framing cases through a real proxy, to a real upstream --------------------


@dataclass
class Recorder:
    """A loopback HTTP server that reads each connection with h11 and keeps every byte."""

    sock: socket.socket = field(default_factory=socket.socket)
    connections: list[bytes] = field(default_factory=list)
    active: int = 0
    lock: threading.Condition = field(default_factory=threading.Condition)

    def start(self) -> int:
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        threading.Thread(target=self._accept, daemon=True).start()
        return int(self.sock.getsockname()[1])

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with self.lock:
                self.active += 1
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        raw = bytearray()
        parser = h11.Connection(h11.SERVER)
        answered = False
        conn.settimeout(5)
        try:
            while True:
                try:
                    data = conn.recv(65536)
                except (TimeoutError, OSError):
                    break
                raw += data
                if not answered:
                    parser.receive_data(data)
                    try:
                        while (event := parser.next_event()) not in (h11.NEED_DATA, h11.PAUSED):
                            if isinstance(event, (h11.EndOfMessage, h11.ConnectionClosed)):
                                break
                        done = isinstance(event, (h11.EndOfMessage, h11.ConnectionClosed))
                    except h11.RemoteProtocolError:
                        done = True
                    if done or not data:
                        answered = True
                        reply = (
                            b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok"
                        )
                        try:
                            conn.sendall(reply)
                            conn.shutdown(socket.SHUT_WR)
                        except OSError:
                            break
                if not data:
                    break
        finally:
            conn.close()
            with self.lock:
                self.connections.append(bytes(raw))
                self.active -= 1
                self.lock.notify_all()

    def settle(self, count: int) -> None:
        """Wait until ``count`` connections were served in all (a dialed connection
        may still sit in the listen backlog when the guest has its answer)."""
        with self.lock:
            done = self.lock.wait_for(
                lambda: self.active == 0 and len(self.connections) >= count, timeout=10
            )
            assert done, f"{len(self.connections)} upstream connections, {count} expected"


@dataclass
class ProxyEnv:
    served: Served
    upstream: Recorder
    port: int


@pytest.fixture(scope="module")
def proxy_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ProxyEnv]:
    tmp: Path = tmp_path_factory.mktemp("proxy")
    upstream = Recorder()
    port = upstream.start()

    async def resolver(name: str, port: int) -> list[IPAddress]:
        raise UpstreamFailed(f"no resolver in this test ({name})")

    proxy = EgressProxy(tmp / "ca", resolver=resolver, connect_timeout=5, response_timeout=10)
    caps = {"egress": [f"127.0.0.1:{port}"]}
    with served_broker(tmp, caps, proxy, allowed_ranges=("127.0.0.1/32",)) as served:
        yield ProxyEnv(served, upstream, port)
    upstream.sock.close()


def _events(served: Served) -> list[dict[str, object]]:
    return [json.loads(e) for e in served.ledger.entries("acme")]


@fuzz_settings(150)
@given(case=forward_cases(), path=st.sampled_from(["/a", "/a?b=c", "/%2e%2e/x", "/é"]))
@example(
    case=("POST", [("Transfer-Encoding", "chunked")], b"0x10\r\n" + b"a" * 16 + b"\r\n" + SMUGGLED),
    path="/a",
)
@example(
    case=(
        "POST",
        [("Content-Length", str(len(SMUGGLED))), ("Connection", "content-length")],
        SMUGGLED,
    ),
    path="/a",
)
def test_a_real_upstream_gets_one_request_the_decided_one(
    proxy_env: ProxyEnv, case: tuple[str, list[tuple[str, str]], bytes], path: str
) -> None:
    method, headers, stream = case
    env = proxy_env
    before = len(env.upstream.connections)
    seq_before = len(_events(env.served))
    head = f"{method} http://127.0.0.1:{env.port}{path} HTTP/1.1\r\n"
    head += f"Proctor-Token: {env.served.token}\r\n"
    head += "".join(f"{k}: {v}\r\n" for k, v in headers)
    answer = exchange(env.served.socket, head.encode("latin-1") + b"\r\n" + stream)
    status = re.match(rb"HTTP/1\.1 (\d{3}) ", answer)
    assert status, answer[:300]
    assert int(status.group(1)) in (100, 200, 400, 403, 502), answer[:300]
    assert not env.served.errors, [r.getMessage() for r in env.served.errors]
    decided = [
        e
        for e in _events(env.served)[seq_before:]
        if e["action"] == "http.request" and e["decision"] == "allow"
    ]
    assert len(decided) <= 1
    # One permitted decision, one connection upstream; none without one.
    env.upstream.settle(before + len(decided))
    reached = env.upstream.connections[before:]
    assert len(reached) == len(decided), "one guest request, one upstream connection"
    if not reached:
        return
    parser = h11.Connection(h11.SERVER)
    parser.receive_data(reached[0])
    parser.receive_data(b"")
    requests = []
    try:
        while (event := parser.next_event()) not in (h11.NEED_DATA, h11.PAUSED):
            if isinstance(event, h11.Request):
                requests.append(event)
            if isinstance(event, (h11.EndOfMessage, h11.ConnectionClosed)):
                break
    except h11.RemoteProtocolError:
        return  # refused by a strict server: nothing read two ways
    assert len(requests) == 1
    assert requests[0].target.decode("latin-1").split("?")[0] == decided[0]["details"]["path"]  # type: ignore[index]
    leftover, _ = parser.trailing_data
    assert leftover == b"", f"a second request reached the upstream: {leftover[:100]!r}"
    assert b"/smuggled" not in reached[0].split(b"\r\n\r\n", 1)[0]


def test_the_parsed_head_is_what_goes_upstream() -> None:
    """A fixed point: what parse_request_head takes it gives back unchanged."""
    head = parse_request_head(
        b"POST /p?q HTTP/1.1\r\nHost: h\r\nContent-Length: 3\r\nX:  v \r\n\r\n"
    )
    method, target, headers = head.method, head.target, head.headers
    assert (method, target, headers) == (
        "POST",
        "/p?q",
        [("Host", "h"), ("Content-Length", "3"), ("X", "v")],
    )
