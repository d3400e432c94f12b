"""Chunked uploads through a run's socket: a real Broker on a Unix socket, real files
under a bucket, real Cedar, a real SQLite ledger.

A chunked body (Node's default for a request without a Content-Length) is taken,
streamed to disk, held to the same cap, and recorded exactly as the same bytes sent
with a Content-Length; every framing a strict reader could read two ways is one 400,
with nothing written."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import socket
import sqlite3
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from proctor.broker import BadCall, Broker, DatasetBinding, EgressProxy, Handlers, RunScope
from proctor.broker._connectors import MAX_SQL_BODY
from proctor.broker._http import parse_request_head, read_body
from proctor.governance import MAX_OBJECT_BYTES
from proctor.ledger import Ledger
from proctor.policy import capability_policies, compile_policies
from tests.fuzz._support import exchange, served_broker, sqlite_ledger

CAPS = {"buckets": {"reports": "read-write"}}
# A tenant's size rule on uploads: a body's size decides it, so a chunked body
# (whose size Cedar cannot know up front) must not slip past it.
SIZE_RULE = """
@id("tenant:small-uploads")
forbid (principal, action == Proctor::Action::"file.write", resource)
when { context has bytes && context.bytes > 1000 };
"""


@dataclass
class Socket:
    path: Path
    token: str
    ledger: Ledger
    bucket: Path

    def put(self, key: str, body: bytes, headers: str) -> tuple[int, dict[str, Any]]:
        head = f"PUT /v1/files/reports/{key} HTTP/1.1\r\nProctor-Token: {self.token}\r\n{headers}"
        answer = exchange(self.path, (head + "\r\n").encode() + body)
        status = int(answer.split(b" ", 2)[1])
        return status, json.loads(answer.partition(b"\r\n\r\n")[2])

    def events(self) -> list[dict[str, Any]]:
        out = [json.loads(e) for e in self.ledger.entries("acme")]
        return [e for e in out if e["action"] != "tenant.create"]

    def tree(self) -> list[str]:
        """Every name under the bucket, temporaries included."""
        return sorted(str(p.relative_to(self.bucket)) for p in self.bucket.rglob("*"))


def _serve(tmp: Path, policies: str) -> Iterator[Socket]:
    bucket = tmp / "buckets" / "reports"
    bucket.mkdir(parents=True)
    proxy = EgressProxy(tmp / "ca")
    with sqlite_ledger(tmp) as ledger, Broker(Handlers.for_proxy(proxy), os.urandom(32)) as b:
        scope = RunScope(
            tenant="acme",
            run_id="r1",
            workload="spiffe://test.local/tenant/acme/deployment/churn/run/r1",
            deployment="churn",
            artifact="sha256:" + "ab" * 32,
            approvals=("approval-1",),
            environment="production",
            policies=compile_policies(policies),
            ledger=ledger,
            lineage_key=b"k" * 32,
            buckets_dir=tmp / "buckets",
        )
        channel = b.open_run(scope, ttl=3600)
        yield Socket(channel.socket, channel.token, ledger, bucket)


@pytest.fixture
def sock(tmp_path: Path) -> Iterator[Socket]:
    yield from _serve(tmp_path, capability_policies("acme", "churn", CAPS))


def chunked(data: bytes, sizes: list[int]) -> bytes:
    """``data`` as chunks of the given sizes in turn (the last repeated), then the end."""
    out, at, i = bytearray(), 0, 0
    while at < len(data):
        size = sizes[min(i, len(sizes) - 1)]
        piece = data[at : at + size]
        out += f"{len(piece):x}\r\n".encode() + piece + b"\r\n"
        at, i = at + size, i + 1
    return bytes(out + b"0\r\n\r\n")


TE = "Transfer-Encoding: chunked\r\n"
# Fields that differ between any two events (their place in the log and time).
_PLACE = {"seq", "time", "id", "prev", "timestamp", "request_id"}


def _same_fields(event: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in event.items() if k not in _PLACE}


def test_a_chunked_upload_is_recorded_exactly_as_a_content_length_one(sock: Socket) -> None:
    data = os.urandom(700 * 1024 + 3)  # several of the broker's 256 KiB pieces
    digest = hashlib.sha256(data).hexdigest()
    status, by_length = sock.put("same.bin", data, f"Content-Length: {len(data)}\r\n")
    assert status == 200 and by_length == {"sha256": digest, "bytes": len(data)}
    first = sock.events()[-1]
    # Odd chunk sizes on purpose: one byte, a prime, one larger than a piece.
    status, by_chunks = sock.put("same.bin", chunked(data, [1, 7919, 300_000, 65536]), TE)
    assert status == 200 and by_chunks == by_length
    second = sock.events()[-1]
    assert (sock.bucket / "same.bin").read_bytes() == data
    assert first["action"] == second["action"] == "file.write"
    assert first["details"] == second["details"]
    assert {k: first["details"][k] for k in ("bucket", "key", "bytes", "sha256")} == {
        "bucket": "reports", "key": "same.bin", "bytes": len(data), "sha256": digest,
    }  # fmt: skip
    assert _same_fields(first) == _same_fields(second)
    assert sock.tree() == ["same.bin"]


def test_an_empty_chunked_upload_is_an_empty_object(sock: Socket) -> None:
    status, answer = sock.put("empty", b"0\r\n\r\n", TE)
    assert status == 200 and answer == {"sha256": hashlib.sha256(b"").hexdigest(), "bytes": 0}
    assert (sock.bucket / "empty").read_bytes() == b""


def test_extensions_and_trailers_are_taken_and_not_stored(sock: Socket) -> None:
    body = b"5;name=value\r\nhello\r\n6 ;x\r\n world\r\n0\r\nX-Checksum: abc\r\n\r\n"
    status, answer = sock.put("ext.txt", body, TE)
    assert status == 200, answer
    assert (sock.bucket / "ext.txt").read_bytes() == b"hello world"


@pytest.mark.parametrize(
    ("headers", "body", "why"),
    [
        (TE, b"5\nhello\r\n0\r\n\r\n", "bare CR or LF"),
        (TE, b"5\r\nhello\n0\r\n\r\n", "not followed by CRLF"),
        (TE, b"5\r\nhel\rlo\r\n0\r\n\r\n", "not followed by CRLF"),
        (TE, b"5\r\nhello\r\n0\r\n\r\r\n", "bare CR or LF"),
        (TE, b" 5\r\nhello\r\n0\r\n\r\n", "invalid chunk size"),
        (TE, b"0x5\r\nhello\r\n0\r\n\r\n", "invalid chunk size"),
        (TE, b"5;\x01\r\nhello\r\n0\r\n\r\n", "invalid chunk extension"),
        (TE, b"1" + b"0" * 16 + b"\r\nhello\r\n0\r\n\r\n", "invalid chunk size"),
        (TE, b"5\r\nhello\r\n0\r\nBad Name: x\r\n\r\n", "malformed trailer"),
        (TE, b"5\r\nhello\r\n0\r\n" + b"X: y\r\n" * 101 + b"\r\n", "trailer fields"),
        (TE, b"5\r\nhello\r\n", "ended early"),
        (TE + "Content-Length: 5\r\n", b"hello", "both Transfer-Encoding and Content-Length"),
        ("Transfer-Encoding: gzip, chunked\r\n", b"0\r\n\r\n", "only Transfer-Encoding: chunked"),
        (TE + TE, b"0\r\n\r\n", "only Transfer-Encoding: chunked"),
    ],
)
def test_each_misframed_chunked_upload_is_one_400_and_writes_nothing(
    sock: Socket, headers: str, body: bytes, why: str
) -> None:
    (sock.bucket / "kept.txt").write_bytes(b"before")
    before = len(sock.events())
    # The data comes first, so a reader that wrote as it went would leave some behind.
    status, answer = sock.put("kept.txt", b"ff\r\n" + b"x" * 255 + b"\r\n" + body, headers)
    assert status == 400, answer
    assert why in answer["message"], answer
    assert (sock.bucket / "kept.txt").read_bytes() == b"before"
    assert sock.tree() == ["kept.txt"], "a refused upload left a file behind"
    new = sock.events()[before:]
    assert len(new) == 1 and new[0]["decision"] == "deny", new


def test_a_chunked_upload_past_the_cap_is_refused_on_its_size_line(sock: Socket) -> None:
    """413 as soon as the running total passes the cap: the chunk that would pass it
    is never sent, and the broker does not wait for it."""
    first = 3 << 20
    passing = MAX_OBJECT_BYTES - first + 1
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(20)
        s.connect(str(sock.path))
        head = f"PUT /v1/files/reports/big.bin HTTP/1.1\r\nProctor-Token: {sock.token}\r\n{TE}\r\n"
        s.sendall(head.encode() + f"{first:x}\r\n".encode())
        s.sendall(b"\0" * first + b"\r\n")
        s.sendall(f"{passing:x}\r\n".encode())  # and nothing after it: no data, no EOF
        started = time.monotonic()
        answer = b""
        while chunk := s.recv(65536):
            answer += chunk
        waited = time.monotonic() - started
    assert answer.startswith(b"HTTP/1.1 413 "), answer[:300]
    assert waited < 15, "the refusal waited for the chunk's data (the idle timeout)"
    assert sock.tree() == []
    event = sock.events()[-1]
    assert event["action"] == "file.write" and event["decision"] == "deny"
    assert "larger than" in event["reason"]


def test_a_chunked_upload_is_streamed_to_disk_not_held(sock: Socket) -> None:
    """Half an upload sent: most of it is already in the staged file, not in memory;
    the rest sent, the object is whole and its digest right."""
    data = os.urandom(4 << 20)
    wire = chunked(data, [65536])
    half = len(wire) // 2
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(20)
        s.connect(str(sock.path))
        head = f"PUT /v1/files/reports/s.bin HTTP/1.1\r\nProctor-Token: {sock.token}\r\n{TE}\r\n"
        s.sendall(head.encode() + wire[:half])
        staged = 0
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            temps = [p for p in sock.bucket.iterdir() if p.name.startswith(".tmp-")]
            staged = max([p.stat().st_size for p in temps] or [0])
            if staged >= 1 << 20:
                break
            time.sleep(0.05)
        assert staged >= 1 << 20, f"only {staged} bytes staged with half the body sent"
        assert not (sock.bucket / "s.bin").exists(), "visible before its event"
        s.sendall(wire[half:])
        s.shutdown(socket.SHUT_WR)
        answer = b""
        while chunk := s.recv(65536):
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 200 "), answer[:300]
    assert (
        json.loads(answer.partition(b"\r\n\r\n")[2])["sha256"] == hashlib.sha256(data).hexdigest()
    )
    assert (sock.bucket / "s.bin").read_bytes() == data


def test_a_size_rule_is_not_bypassed_by_chunking(tmp_path: Path) -> None:
    """A tenant forbids uploads over 1000 bytes. A Content-Length upload is decided on
    its length; a chunked one has none when it is decided, so it is decided as large
    as it may grow (the cap): the forbid holds, chunking is no way around it."""
    policies = capability_policies("acme", "churn", CAPS) + SIZE_RULE
    gen = _serve(tmp_path, policies)
    s = next(gen)
    try:
        status, _ = s.put("small", b"x" * 10, "Content-Length: 10\r\n")
        assert status == 200
        status, _ = s.put("large", b"x" * 2000, "Content-Length: 2000\r\n")
        assert status == 403
        for name, body in (("large-chunked", b"x" * 2000), ("small-chunked", b"x" * 10)):
            status, answer = s.put(name, chunked(body, [500]), TE)
            assert status == 403, answer
            assert not (s.bucket / name).exists()
        assert sorted(s.tree()) == ["small"]
    finally:
        gen.close()


def test_a_chunked_sql_call_answers_as_a_content_length_one(tmp_path: Path) -> None:
    """The SQL endpoint reads its body with the same reader: chunked is taken, and held
    to the same 1 MiB bound (413 on the size line that passes it)."""
    db = tmp_path / "crm.db"
    conn = sqlite3.connect(db)
    conn.executescript(
        "CREATE TABLE customers (id INTEGER PRIMARY KEY, name TEXT);"
        "INSERT INTO customers VALUES (1, 'Ada'), (2, 'Grace');"
    )
    conn.commit()
    conn.close()
    caps = {"datasets": {"crm": {"tables": {"customers": {"columns": ["id", "name"]}}}}}
    proxy = EgressProxy(tmp_path / "ca")
    datasets = {"crm": DatasetBinding("crm", "sqlite", str(db))}
    with served_broker(tmp_path, caps, proxy, datasets=datasets) as s:
        body = json.dumps({"dataset": "crm", "sql": "SELECT id, name FROM customers"}).encode()

        def post(framing: str, wire: bytes) -> bytes:
            head = f"POST /v1/sql HTTP/1.1\r\nProctor-Token: {s.token}\r\n{framing}\r\n"
            return exchange(s.socket, head.encode() + wire)

        by_length = post(f"Content-Length: {len(body)}\r\n", body)
        by_chunks = post(TE, chunked(body, [3, 10]))
        assert by_length.startswith(b"HTTP/1.1 200 ") and by_chunks.startswith(b"HTTP/1.1 200 ")
        rows = [json.loads(a.partition(b"\r\n\r\n")[2])["rows"] for a in (by_length, by_chunks)]
        assert rows[0] == rows[1] == [[1, "Ada"], [2, "Grace"]]
        too_big = post(TE, f"{MAX_SQL_BODY + 1:x}\r\n".encode())
        assert too_big.startswith(b"HTTP/1.1 413 "), too_big[:200]


def _read(wire: bytes, limit: int) -> bytes:
    async def go() -> bytes:
        reader = asyncio.StreamReader()
        reader.feed_data(wire)
        reader.feed_eof()
        head = parse_request_head(f"PUT /x HTTP/1.1\r\n{TE}\r\n".encode())
        return await read_body(reader, head, limit)

    return asyncio.run(go())


def test_framing_that_outweighs_its_content_is_refused() -> None:
    """A chunk line may carry an extension of up to 8 KiB; a body of one byte per chunk,
    each with such an extension, would have the broker read gigabytes for a body
    inside its limit. The framing may cost 64 KiB plus 8 bytes per byte of content."""
    ext = b";" + b"e" * 8000
    wire = b"".join(b"1" + ext + b"\r\nx\r\n" for _ in range(20)) + b"0\r\n\r\n"
    with pytest.raises(BadCall, match="framing is too large"):
        _read(wire, 1 << 20)
    # One byte per chunk with no extension costs 5 bytes a byte: taken.
    plain = b"".join(b"1\r\nx\r\n" for _ in range(4096)) + b"0\r\n\r\n"
    assert _read(plain, 4096) == b"x" * 4096
    with pytest.raises(BadCall) as over:
        _read(plain, 4095)
    assert over.value.status == 413
