"""The broker socket's request parser, fed random, structured and mutated bytes.

Two levels: ``read_head``/``read_body`` on a real asyncio StreamReader that gets
the bytes in random pieces (every property in ``_oracle_http.check``), and a
subset through a real Broker on a Unix socket with every real handler (SQL on a
real SQLite file, buckets, the egress proxy), where the property is an answer:
a 2xx or a clean 4xx, never a 500, never silence on a non-empty request, never a
hang, the broker still serving afterwards, and an event in the ledger for every
answer but a rate-limited one.
"""

from __future__ import annotations

import json
import re
import socket
import sqlite3
import threading
import time
from collections.abc import Iterator

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from proctor.broker import DatasetBinding, EgressProxy
from proctor.broker._egress import IPAddress, UpstreamFailed
from proctor.broker._http import MAX_HEAD
from tests.fuzz._oracle_http import check
from tests.fuzz._support import TIMEOUT, Served, exchange, fuzz_settings, one_in, served_broker

pytestmark = pytest.mark.timeout(TIMEOUT)

TOKEN_SLOT = "\x00TOKEN\x00"  # replaced by the run's real token at the socket level

METHODS = ["GET", "POST", "PUT", "CONNECT", "DELETE", "get", "", "G T", "GÉT", "GET\t", "\x00"]
TARGETS = [
    "/v1/whoami",
    "/v1/sql",
    "/v1/files/reports/a.txt",
    "/v1/files/reports/%2e%2e/%2e%2e/etc/passwd",
    "/v1/files/x",
    "/v1/nope",
    "*",
    "http://example.com/",
    "http://127.0.0.1:80/x",
    "http://[::1]/",
    "https://example.com/",
    "example.com:443",
    "",
    "/v1/sql?x=1",
    "/\x00",
    "/\x0b",
    "/é",
]
VERSIONS = ["HTTP/1.1", "HTTP/1.0", "HTTP/2", "HTTP/1.", "http/1.1", "HTTP/1.1 x", ""]
NAMES = [
    "Host",
    "Content-Length",
    "content-length",
    "Transfer-Encoding",
    "Proctor-Token",
    "X",
    " Content-Length",
    "Content-Length ",
    "Con tent",
    "",
    "X\x00",
    "Proxy-Authorization",
]
VALUES = [
    "0",
    "5",
    "17",
    "-1",
    "+5",
    "05",
    "5, 5",
    "²",
    "٣",
    "9" * 5000,
    "18446744073709551616",
    " 5 ",
    "0x5",
    "",
    "chunked",
    "gzip, chunked",
    TOKEN_SLOT,
    "a\rb",
    "a\nContent-Length: 0",
    "\xa05",
]
EOLS = ["\r\n", "\r\n", "\r\n", "\n", "\r"]
SQL_BODIES = [
    b'{"dataset": "crm", "sql": "SELECT name FROM customers"}',
    b'{"dataset": "crm", "sql": "SELECT email FROM customers"}',
    b'{"dataset": "crm", "sql": "SELECT 1"}',
    b'{"dataset": "nope", "sql": "SELECT 1"}',
    b"[1, 2]",
    b"{",
    b'{"dataset": "crm", "sql": 5, "params": {"a": [1]}}',
]

BODY_S = st.sampled_from(SQL_BODIES) | st.binary(max_size=64)
METHOD_S = st.sampled_from(METHODS) | st.text(max_size=8)
TARGET_S = st.sampled_from(TARGETS) | st.text(max_size=40)
NAME_S = st.sampled_from(NAMES) | st.text(max_size=12)
VALUE_S = st.sampled_from(VALUES) | st.text(max_size=20)


@st.composite
def wellformed(draw: st.DrawFn) -> bytes:
    """A request every parser should take, to each endpoint, with the run's token
    (usually), and a framing header drawn from the awkward values now and then."""
    method, target, body = draw(
        st.sampled_from(
            [
                ("GET", "/v1/whoami", b""),
                ("POST", "/v1/sql", None),
                ("PUT", "/v1/files/reports/a.txt", None),
                ("GET", "/v1/files/reports/a.txt", b""),
                ("GET", "/v1/files/reports/%2e%2e%2f%2e%2e%2fetc%2fpasswd", b""),
                ("GET", "http://example.com/x?y=1", b""),
                ("POST", "http://example.com/x", None),
                ("GET", "http://127.0.0.1:8080/", b""),
                ("CONNECT", "example.com:443", b""),
                ("CONNECT", "[::1]:443", b""),
                ("DELETE", "/v1/sql", b""),
            ]
        )
    )
    if body is None:
        body = draw(BODY_S)
    headers = [("Host", "broker")]
    if not draw(one_in(10)):
        headers.append(("Proctor-Token", TOKEN_SLOT))
    if not draw(one_in(4)):
        headers.append(("Content-Length", str(len(body))))
    else:
        headers.append((draw(st.sampled_from(NAMES)), draw(st.sampled_from(VALUES))))
    draw(st.randoms(use_true_random=False)).shuffle(headers)
    head = f"{method} {target} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers)
    return (head + "\r\n").encode("utf-8") + body


@st.composite
def structured(draw: st.DrawFn) -> bytes:
    """A request built from the pieces parsers trip over, each line with its own end."""
    method = draw(METHOD_S)
    target = draw(TARGET_S)
    version = draw(st.sampled_from(VERSIONS))
    lines = [f"{method} {target} {version}"]
    if draw(st.booleans()):
        lines.append(f"Proctor-Token: {TOKEN_SLOT}")
    for _ in range(draw(st.integers(0, 6))):
        name = draw(NAME_S)
        value = draw(VALUE_S)
        sep = draw(st.sampled_from([": ", ":", " : ", ":\t"]))
        lines.append(name + sep + value)
        if draw(one_in(10)):
            lines.append(" folded continuation")  # obs-fold
    head = "".join(line + draw(st.sampled_from(EOLS)) for line in lines) + "\r\n"
    body = draw(BODY_S)
    return head.encode("utf-8", "surrogatepass") + body


#: Chunk-size lines: the well-formed spellings first, then what parsers read apart.
SIZE_LINES = [
    "{n:x}",
    "{n:X}",
    "00{n:x}",
    "{n:x} ",
    "{n:x}\t",
    "{n:x};ext",
    '{n:x} ;a=b;c="d e"',
    "{n:x};\xe9",
    " {n:x}",
    "0x{n:x}",
    "+{n:x}",
    "-{n:x}",
    "{n:x}\x00",
    "{n:x};\x01",
    "{n:x} {n:x}",
    "0000000000000000{n:x}",
    "",
    "{n:x}" + "0" * 40,
]
CHUNK_EOLS = ["\r\n"] * 6 + ["\n", "\r", "\r\r\n", "", "\r\n\r\n"]
TRAILERS = ["X-Sum: 1\r\n", "X:y\r\n", "Bad Name: y\r\n", "X: a\x00b\r\n", "nocolon\r\n"]
CODINGS = ["chunked"] * 6 + [
    "Chunked",
    "chunked, chunked",
    "gzip, chunked",
    "identity",
    "chunked;q=1",
]


@st.composite
def chunked(draw: st.DrawFn) -> bytes:
    """A chunked request to an endpoint that takes a body: its content cut into chunks
    whose size lines, line ends, data lengths and trailers are well formed most of the
    time and spelled the ways parsers disagree on the rest."""
    method, target = draw(
        st.sampled_from(
            [
                ("PUT", "/v1/files/reports/a.txt"),
                ("POST", "/v1/sql"),
                ("PUT", "/v1/files/reports/c/d.bin"),
            ]
        )
    )
    content = draw(BODY_S) if target == "/v1/sql" else draw(st.binary(max_size=300))
    cuts = sorted(draw(st.lists(st.integers(0, len(content)), max_size=5)))
    pieces = [content[a:b] for a, b in zip([0, *cuts], [*cuts, len(content)], strict=True)]
    odd = draw(st.booleans())  # half are well formed, so they reach a handler

    def pick(options: list[str]) -> str:
        return draw(st.sampled_from(options)) if odd and draw(one_in(3)) else options[0]

    wire = b""
    for piece in pieces:
        if not piece:
            continue
        # A size that lies about its data, or one that passes the body limit.
        n = len(piece) + (draw(st.sampled_from([-1, 1, 4096])) if odd and draw(one_in(5)) else 0)
        wire += pick(SIZE_LINES).format(n=max(n, 1)).encode("latin-1")
        wire += pick(CHUNK_EOLS).encode() + piece + pick(CHUNK_EOLS).encode()
    if not (odd and draw(one_in(8))):  # the last chunk, trailers and the end, or not
        wire += pick(["0", "000", "0;x", "0 "]).encode() + pick(CHUNK_EOLS).encode()
        if draw(one_in(4)):
            wire += pick(TRAILERS).encode()
        wire += pick(CHUNK_EOLS).encode()
    headers = [("Host", "broker"), ("Transfer-Encoding", pick(CODINGS))]
    if not draw(one_in(10)):
        headers.append(("Proctor-Token", TOKEN_SLOT))
    if odd and draw(one_in(10)):
        headers.append(("Content-Length", str(len(content))))
    draw(st.randoms(use_true_random=False)).shuffle(headers)
    version = "HTTP/1.0" if odd and draw(one_in(12)) else "HTTP/1.1"
    head = f"{method} {target} {version}\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers)
    return (head + "\r\n").encode("latin-1") + wire


@st.composite
def mutated(draw: st.DrawFn) -> bytes:
    """A structured request with bytes flipped, inserted, deleted or duplicated."""
    data = bytearray(draw(structured() | wellformed() | chunked()))
    for _ in range(draw(st.integers(1, 6))):
        op = draw(st.sampled_from(["flip", "insert", "delete", "dup"]))
        at = draw(st.integers(0, len(data)))
        if op == "flip" and at < len(data):
            data[at] = draw(st.integers(0, 255))
        elif op == "insert":
            data[at:at] = draw(st.sampled_from([b"\r\n", b"\n", b"\r", b"\x00", b" ", b":"]))
        elif op == "delete":
            del data[at : at + draw(st.integers(1, 4))]
        else:
            data[at:at] = data[at : at + draw(st.integers(1, 16))]
    return bytes(data)


requests = st.one_of(wellformed(), structured(), chunked(), mutated(), st.binary(max_size=512))


def _for_parser(data: bytes) -> bytes:
    return data.replace(TOKEN_SLOT.encode(), b"pt1.r1.x.y")


@fuzz_settings(600)
@given(data=requests, cuts=st.lists(st.integers(0, 1 << 16), max_size=4))
@example(data=b"GET / HTTP/1.1\r\nContent-Length: \xb2\r\n\r\n", cuts=[])
@example(data=b"POST / HTTP/1.1\r\nContent-Length: " + b"9" * 5000 + b"\r\n\r\n", cuts=[])
@example(data=b"\xc0 / HTTP/1.1\r\n\r\n", cuts=[])
@example(data=b"GET /\x0b HTTP/1.1\r\n\r\n", cuts=[])
@example(data=b"GET / HTTP/1.1\r\nContent-Length: 3\r\nContent-Length: 4\r\n\r\nabcd", cuts=[])
def test_parser_returns_a_request_or_a_clean_refusal(data: bytes, cuts: list[int]) -> None:
    check(_for_parser(data), cuts)


@fuzz_settings(400)
@given(data=chunked(), cuts=st.lists(st.integers(0, 1 << 12), max_size=6))
@example(
    data=b"PUT / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n 5\r\nhello\r\n0\r\n\r\n", cuts=[]
)
@example(data=b"PUT / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n1001\r\n", cuts=[])
def test_a_chunked_body_is_the_content_a_strict_reader_finds_or_refused(
    data: bytes, cuts: list[int]
) -> None:
    """Chunked bodies against the oracle's own reference reader (RFC 9112 7.1): the
    same content, or the same refusal (400 for framing, 413 on the size line that
    passes the limit), wherever the bytes are cut."""
    check(_for_parser(data), cuts)


@fuzz_settings(60)
@given(data=chunked())
@example(data=b"PUT / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n1001\r\n")
def test_a_chunked_body_past_the_limit_is_refused_without_waiting_for_it(data: bytes) -> None:
    """No EOF: a size line that passes the limit is answered 413 at once, not after
    the idle timeout that the chunk's missing data would otherwise run into."""
    check(_for_parser(data), eof=False, wait=0.05)


@fuzz_settings(40)
@given(data=requests)
def test_a_stream_that_stops_without_ending_is_refused_in_time(data: bytes) -> None:
    """No EOF: the head's and the body's own timeouts answer; nothing waits forever."""
    started = time.monotonic()
    out = check(_for_parser(data), eof=False, wait=0.05)
    if out.head is None or out.body is None:
        assert out.refusal is not None
    assert time.monotonic() - started < 5


def test_an_oversized_head_is_refused_at_the_bound() -> None:
    out = check(b"GET /" + b"a" * (MAX_HEAD + 10) + b" HTTP/1.1\r\n\r\n")
    assert out.refusal is not None and "larger than" in out.refusal.message
    out = check(b"GET / HTTP/1.1\r\n" + b"X: y\r\n" * 101 + b"\r\n")
    assert out.refusal is not None and "too many headers" in out.refusal.message


# -- the same through a real broker -------------------------------------------------


async def _no_dns(name: str, port: int) -> list[IPAddress]:
    raise UpstreamFailed(f"no resolver in this test ({name})")


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    tmp = tmp_path_factory.mktemp("broker-http")
    db = tmp / "crm.db"
    conn = sqlite3.connect(db)
    conn.executescript(
        "CREATE TABLE customers (id INTEGER PRIMARY KEY, name TEXT, email TEXT);"
        "INSERT INTO customers VALUES (1, 'Ada', 'ada@example.com');"
    )
    conn.commit()
    conn.close()
    (tmp / "buckets" / "reports").mkdir(parents=True)
    caps = {
        "datasets": {"crm": {"tables": {"customers": {"columns": ["id", "name"]}}}},
        "buckets": {"reports": "read-write"},
        "egress": ["example.com:80"],
    }
    proxy = EgressProxy(tmp / "ca", resolver=_no_dns, connect_timeout=1)
    with served_broker(
        tmp,
        caps,
        proxy,
        datasets={"crm": DatasetBinding("crm", "sqlite", str(db))},
        buckets_dir=tmp / "buckets",
    ) as s:
        yield s


STATUS = re.compile(rb"^HTTP/1\.1 (\d{3}) [^\r\n]*\r\n")
# 502: example.com is permitted, and this test's resolver refuses every name.
CLEAN = {200, 400, 401, 403, 404, 405, 408, 413, 429, 502}


@fuzz_settings(300)
@given(data=requests)
@example(
    data=b"POST /v1/sql HTTP/1.1\r\nProctor-Token: \x00TOKEN\x00\r\nContent-Length: \xb2\r\n\r\n"
)
@example(
    data=b"GET http://example.com/ HTTP/1.1\r\nProctor-Token: \x00TOKEN\x00\r\n"
    b"Content-Length: " + b"9" * 5000 + b"\r\n\r\n"
)
def test_the_broker_answers_every_request_cleanly(served: Served, data: bytes) -> None:
    wire = data.replace(TOKEN_SLOT.encode(), served.token.encode())
    before = sum(1 for _ in served.ledger.entries("acme"))
    answer = exchange(served.socket, wire)
    if not wire:
        assert answer == b""
        return
    # Every answer but a rate-limited one (counted) is recorded before it is sent.
    recorded = sum(1 for _ in served.ledger.entries("acme")) - before
    assert recorded >= 1 or answer.startswith(b"HTTP/1.1 429 "), (wire[:200], answer[:200])
    match = STATUS.match(answer)
    assert match, f"no HTTP answer to {wire[:200]!r}: {answer[:200]!r}"
    status = int(match.group(1))
    assert status in CLEAN, f"{status} for {wire[:200]!r}: {answer[:400]!r}"
    head, _, body = answer.partition(b"\r\n\r\n")
    if status != 200 or b"application/json" in head:
        json.loads(body)  # errors have the one JSON shape
    assert not served.errors, [r.getMessage() for r in served.errors]


def test_a_huge_head_is_cut_off_not_buffered(served: Served) -> None:
    """8 MiB without a head's end: refused once the 64 KiB bound is passed, and the
    broker stops reading (the sender is cut off long before it is done)."""
    total = 8 << 20
    sent = 0
    answer = b""
    with socket.socket(socket.AF_UNIX) as sock:
        sock.connect(str(served.socket))
        sock.settimeout(10)
        block = b"GET /" + b"a" * 65531
        try:
            while sent < total:
                sent += sock.send(block)
        except (BrokenPipeError, ConnectionResetError):
            pass
        try:
            while chunk := sock.recv(65536):
                answer += chunk
        except ConnectionResetError:
            pass
    assert answer.startswith(b"HTTP/1.1 400 "), answer[:200]
    assert b"larger than" in answer
    assert sent < total // 2, f"the broker read {sent} bytes of an unbounded head"


def test_many_slow_connections_do_not_stop_the_others(served: Served) -> None:
    """Twenty connections that send half a head and stall; a whoami still answers."""
    stalled = []
    try:
        for _ in range(20):
            sock = socket.socket(socket.AF_UNIX)
            sock.connect(str(served.socket))
            sock.sendall(b"GET /v1/whoami HTTP/1.1\r\nProctor-To")
            stalled.append(sock)
        done = threading.Event()
        result: list[bytes] = []

        def ask() -> None:
            wire = f"GET /v1/whoami HTTP/1.1\r\nProctor-Token: {served.token}\r\n\r\n"
            result.append(exchange(served.socket, wire.encode()))
            done.set()

        threading.Thread(target=ask, daemon=True).start()
        assert done.wait(10), "a whoami waited behind stalled connections"
        assert result[0].startswith(b"HTTP/1.1 200 "), result[0][:200]
    finally:
        for sock in stalled:
            sock.close()
