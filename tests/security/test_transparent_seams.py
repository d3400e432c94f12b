"""Seams of transparent egress: what the broker reads of a redirected connection
(SNI, Host, the first bytes), the run's DNS and its name pool, tried as an
attacker would.

The first half reads the broker's own pieces against a real TLS server (OpenSSL,
on loopback): each ClientHello that the broker might read differently from a
server is sent to one, and what the server reads is what the broker must check.
The second half runs a real sandbox whose guest opens every connection itself,
with no proxy settings, and checks the refusals in the ledger and what the
upstreams saw.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import socket
import ssl
import threading
from collections.abc import Iterator
from ipaddress import ip_address
from pathlib import Path
from typing import Any

import dns.flags
import dns.message
import dns.name
import dns.rcode
import dns.rdatatype
import pytest

from proctor.broker import Broker, EgressProxy, Handlers, RunScope
from proctor.broker._egress import parse_host
from proctor.broker._transparent import (
    MAX_NAMES,
    NAME_RANGE,
    PEEK_BYTES,
    UNREADABLE,
    NamePool,
    _mismatch,
    _protocol,
    client_hello_sni,
    dns_answer,
)
from proctor.lifecycle import brokered_spec
from proctor.policy import compile_policies
from proctor.sandbox import GuestNetwork, Limits, get_driver, network_available
from tests.conftest import LedgerEnv, draft
from tests.integration.test_broker_core import _scope
from tests.integration.test_broker_proxy import UpstreamCA
from tests.sandbox_conftest_helpers import any_backend

# -- ClientHellos, made by OpenSSL and reframed -------------------------------------


def client_hello(name: str | None) -> bytes:
    """A real ClientHello record (Python's ssl, OpenSSL) naming ``name``."""
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls = ctx.wrap_bio(incoming, outgoing, server_hostname=name)
    with pytest.raises(ssl.SSLWantReadError):
        tls.do_handshake()
    return outgoing.read()


def split_records(record: bytes, *cuts: int) -> bytes:
    """The one handshake message of ``record`` in several handshake records."""
    body = record[5:]
    edges = [0, *cuts, len(body)]
    return b"".join(
        record[:3] + (b - a).to_bytes(2, "big") + body[a:b] for a, b in itertools.pairwise(edges)
    )


def _extensions_at(body: bytes | bytearray) -> int:
    pos = 4 + 2 + 32
    pos += 1 + body[pos]
    pos += 2 + int.from_bytes(body[pos : pos + 2], "big")
    return pos + 1 + body[pos]


def with_extension(record: bytes, kind: int, data: bytes, first: bool = True) -> bytes:
    """``record`` with one more extension (first, pushing the SNI back, or last)."""
    body = bytearray(record[5:])
    pos = _extensions_at(body)
    size = int.from_bytes(body[pos : pos + 2], "big")
    old = bytes(body[pos + 2 : pos + 2 + size])
    ext = kind.to_bytes(2, "big") + len(data).to_bytes(2, "big") + data
    new = ext + old if first else old + ext
    body = body[:pos] + len(new).to_bytes(2, "big") + new
    body[1:4] = (len(body) - 4).to_bytes(3, "big")
    return record[:3] + len(body).to_bytes(2, "big") + bytes(body)


def replace_name(record: bytes, old: bytes, new: bytes) -> bytes:
    """``record`` with its SNI's bytes swapped for others of the same length."""
    assert len(old) == len(new) and record.count(old) == 1
    return record.replace(old, new)


GREASE = 0x4A4A  # an extension type servers must ignore (RFC 8701)


class SniServer:
    """A TLS server on loopback that records the name each ClientHello gave it."""

    def __init__(self, cert: Path) -> None:
        self.names: list[str | None] = []
        self.ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.ctx.load_cert_chain(cert)
        self.ctx.sni_callback = lambda _s, name, _c: self.names.append(name)
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]

    def read(self, data: bytes) -> list[str | None]:
        """What the server read as the name of ``data`` (empty: it refused it)."""
        self.names.clear()
        client = socket.create_connection(("127.0.0.1", self.port))
        conn, _ = self.sock.accept()
        client.sendall(data)
        client.shutdown(socket.SHUT_WR)  # the server reads the hello, then our end
        conn.settimeout(5)
        try:
            self.ctx.wrap_socket(conn, server_side=True).close()
        except (ssl.SSLError, OSError):
            conn.close()
        client.close()
        return list(self.names)


@pytest.fixture(scope="module")
def sni_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SniServer]:
    d = tmp_path_factory.mktemp("sni")
    server = SniServer(UpstreamCA.make().issue(["api.test"], d / "leaf.pem"))
    yield server
    server.sock.close()


def refused_for(named: str | None) -> str | None:
    return _mismatch(parse_host("api.test"), named, 443)


def test_a_client_hello_split_across_records_is_read_as_the_server_reads_it(
    sni_server: SniServer,
) -> None:
    record = client_hello("other.test")
    sni_at = record.find(b"other.test") - 5
    for cuts in ((40,), (sni_at - 9,), (sni_at + 3,), (1, 2, 3, 200), (300,)):
        data = split_records(record, *cuts)
        # OpenSSL puts the message together and reads the name in a later record ...
        assert sni_server.read(data) == ["other.test"], cuts
        # ... so the broker must too: reading the first record alone found no name.
        assert client_hello_sni(data) == (True, "other.test"), cuts
        assert refused_for(client_hello_sni(data)[1]) is not None


def test_a_client_hello_too_large_to_look_at_is_refused(sni_server: SniServer) -> None:
    record = client_hello("other.test")
    # One record of the largest size TLS allows, the name pushed to its end.
    big = with_extension(record, GREASE, bytes(16384 - (len(record) - 5) - 4))
    assert len(big) == 5 + 16384 > PEEK_BYTES
    assert sni_server.read(big) == ["other.test"]
    seen = big[:PEEK_BYTES]  # what the broker's peek holds
    assert client_hello_sni(seen) == (True, UNREADABLE)
    assert refused_for(UNREADABLE) == "cannot be read"
    # Split across records past the bytes looked at: the same.
    spread = split_records(big, 8000, 16000)
    assert sni_server.read(spread) == ["other.test"]
    assert client_hello_sni(spread[:PEEK_BYTES]) == (True, UNREADABLE)


def test_a_client_hello_still_coming_is_not_read_as_one_without_a_name() -> None:
    record = client_hello("other.test")
    for cut in (1, 5, 60, len(record) - 1):
        assert client_hello_sni(record[:cut]) == (False, None), cut
    assert _protocol(b"\x16") == "tls"  # one byte, then a pause: still TLS
    assert client_hello_sni(record) == (True, "other.test")


def test_malformed_or_odd_names_are_unreadable_or_the_servers_own(
    sni_server: SniServer,
) -> None:
    record = client_hello("aaaa.test")
    # Not ASCII: refused (a server may map it to a name never decided).
    odd = replace_name(record, b"aaaa.test", b"api.te\xe9st")
    assert client_hello_sni(odd) == (True, UNREADABLE)
    # An IP literal in the SNI names that address, not the decided name.
    literal = replace_name(record, b"aaaa.test", b"127.0.0.1")
    assert client_hello_sni(literal) == (True, "127.0.0.1")
    assert refused_for("127.0.0.1") is not None
    # Case and one trailing dot are the same name; a port in an SNI is no host.
    assert refused_for("API.TEST") is None
    assert refused_for("api.test.") is None
    assert refused_for("api.test:443") is None
    assert refused_for("api.test:8443") is not None
    assert refused_for("api.test..") is not None
    assert refused_for("other.test") is not None
    # A record of another type where the message goes on: unreadable.
    alert = split_records(record, 40)
    alert = alert[:45] + b"\x15" + alert[46:]
    assert client_hello_sni(alert) == (True, UNREADABLE)


def test_two_names_in_one_client_hello_are_read_as_the_server_reads_them(
    sni_server: SniServer,
) -> None:
    record = client_hello("aaaa.test")
    body = record[5:]
    pos = _extensions_at(body) + 2
    # Rebuild the server_name extension with two host_name entries.
    while int.from_bytes(body[pos : pos + 2], "big") != 0:
        pos += 4 + int.from_bytes(body[pos + 2 : pos + 4], "big")
    size = int.from_bytes(body[pos + 2 : pos + 4], "big")

    def entry(name: bytes) -> bytes:
        return b"\x00" + len(name).to_bytes(2, "big") + name

    for first, second in ((b"api.test", b"other.test"), (b"other.test", b"api.test")):
        names = entry(first) + entry(second)
        ext = b"\x00\x00" + (len(names) + 2).to_bytes(2, "big") + len(names).to_bytes(2, "big")
        new_body = bytearray(body[:pos] + ext + names + body[pos + 4 + size :])
        at = _extensions_at(new_body)
        total = int.from_bytes(new_body[at : at + 2], "big") + len(ext + names) - 4 - size
        new_body[at : at + 2] = total.to_bytes(2, "big")
        new_body[1:4] = (len(new_body) - 4).to_bytes(3, "big")
        data = record[:3] + len(new_body).to_bytes(2, "big") + bytes(new_body)
        read = sni_server.read(data)
        # The broker checks the first name: the one OpenSSL takes, or none it accepts.
        assert read in ([first.decode()], []), read
        assert client_hello_sni(data) == (True, first.decode())


# A mutated name that is not ASCII fails in Python's SNI callback (the server refuses).
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_mutated_client_hellos_name_what_the_server_reads(sni_server: SniServer) -> None:
    # Differential: lengths and bytes of a real ClientHello changed at random (seeded);
    # wherever OpenSSL still reads a name, the broker reads the same one, or calls
    # the hello unreadable (refused). None, or another name, would go unchecked.
    import random

    record = client_hello("other.test")
    sni_at = record.find(b"other.test")
    ext_at = _extensions_at(record[5:]) + 5
    lengths = [3, 4, 6, 7, 8, ext_at, ext_at + 1, *range(sni_at - 9, sni_at)]
    rng = random.Random(17)
    checked = 0
    for _ in range(1500):
        data = bytearray(record)
        pick = rng.random()
        if pick < 0.5:
            data[rng.choice(lengths)] = rng.randrange(256)
        elif pick < 0.8:
            data[rng.randrange(5, len(data))] = rng.randrange(256)
        else:
            data = data[: rng.randrange(5, len(data))]
        complete, name = client_hello_sni(bytes(data))
        if not complete:
            continue  # the broker waits for more, then calls it unreadable
        checked += 1
        read = sni_server.read(bytes(data))
        if read and read[0] is not None:
            assert name in (read[0], UNREADABLE), (bytes(data).hex(), name, read)
    assert checked > 500


@pytest.mark.parametrize(
    "first_bytes",
    [
        b"GET  / HTTP/1.1\r\nHost: other.test\r\n\r\n",  # two spaces
        b"GET\t/\tHTTP/1.1\r\nHost: other.test\r\n\r\n",  # tabs
        b"\r\nGET / HTTP/1.1\r\nHost: other.test\r\n\r\n",  # an empty line first
        b" GET / HTTP/1.1\r\nHost: other.test\r\n\r\n",  # a blank first
        b"get / http/1.1\r\nHost: other.test\r\n\r\n",  # lower case
        b"GET / HTTP/1.1\nHost: other.test\n\n",  # bare LF
        b"GET / HT",  # cut short when the wait ended; the rest comes later
        b"GET",
        b"\r\n",
        b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",  # h2c prior knowledge: its :authority unread
    ],
)
def test_what_a_lenient_server_reads_as_http_is_read_as_http(first_bytes: bytes) -> None:
    # Python's http.server, nginx and others read these as requests: tunnelled as
    # raw bytes, their Host (or the one that follows) would reach the upstream
    # unchecked. Read as HTTP, the strict parser refuses them (400, recorded).
    assert _protocol(first_bytes) == "http"


@pytest.mark.parametrize(
    "first_bytes", [b"", b"ping", b"\x00ping", b"SSH-2.0-OpenSSH_9.6\r\n", b"*1\r\n$4\r\nPING\r\n"]
)
def test_other_protocols_stay_raw(first_bytes: bytes) -> None:
    assert _protocol(first_bytes) == "tcp"


# -- the run's DNS -----------------------------------------------------------------


def ask(pool: NamePool, name: str, kind: str = "A", **kw: object) -> dns.message.Message | None:
    query = dns.message.make_query(name, kind, **kw)  # type: ignore[arg-type]
    wire = dns_answer(query.to_wire(), pool)
    return None if wire is None else dns.message.from_wire(wire)


def a_of(reply: dns.message.Message | None) -> list[str]:
    assert reply is not None
    return [r.address for rrset in reply.answer for r in rrset]


def test_dns_never_gives_a_real_address() -> None:
    pool = NamePool()
    first = a_of(ask(pool, "api.test"))
    assert len(first) == 1 and first[0] != "0.0.0.0"
    from ipaddress import ip_address

    assert ip_address(first[0]) in NAME_RANGE
    # Spellings of one name are one name: one address, decided as that name.
    for spelling in ("API.TEST", "Api.Test.", "api.test."):
        assert a_of(ask(pool, spelling)) == first, spelling
    assert pool.name(ip_address(first[0])) == "api.test"
    # Every other type: nothing (AAAA too, so clients use the IPv4 answer).
    for kind in ("AAAA", "TXT", "MX", "ANY", "CNAME", "NS", "SOA", "SRV", "PTR", "HTTPS"):
        reply = ask(pool, "api.test", kind)
        assert reply is not None and reply.rcode() == dns.rcode.NOERROR, kind
        assert reply.answer == [] and reply.additional == [] and reply.authority == [], kind
    assert a_of(ask(pool, "localhost")) == ["127.0.0.1"]
    assert a_of(ask(pool, "LOCALHOST.")) == ["127.0.0.1"]
    # Reverse lookups of a real address learn nothing either.
    reply = ask(pool, "1.0.0.127.in-addr.arpa", "PTR")
    assert reply is not None and reply.answer == []


def test_dns_names_are_normalized_as_cedar_reads_them() -> None:
    pool = NamePool()
    # An IDN as its A-label is a name; the same name in raw UTF-8 is none.
    assert len(a_of(ask(pool, "xn--bcher-kva.test"))) == 1
    assert pool.name(NAME_RANGE.network_address + 1) == "xn--bcher-kva.test"
    raw = dns.message.make_query("x.test", "A")
    wire = raw.to_wire().replace(b"\x01x\x04test", b"\x07b\xc3\xbccher\x04test")
    reply = dns_answer(wire, pool)
    assert reply is not None and dns.message.from_wire(reply).rcode() == dns.rcode.NXDOMAIN
    for refused in ("under_score.test", "-lead.test", "a b.test", "0x7f.1", "2130706433",
                    "127.1"):  # fmt: skip
        reply = dns.message.from_wire(dns_answer(ask_wire(refused), pool) or b"")
        assert reply.rcode() == dns.rcode.NXDOMAIN, refused
    # A canonical literal gets an address standing for it: decided as the literal
    # (special-purpose ranges refused), never a second meaning.
    literal = a_of(ask(pool, "10.0.0.1"))
    from ipaddress import ip_address

    assert pool.name(ip_address(literal[0])) == "10.0.0.1"
    assert parse_host("10.0.0.1").address is not None
    # Only 2 + 1 names were given out; the refused ones took no address.
    assert pool.name(NAME_RANGE.network_address + 3) is None


def ask_wire(name: str) -> bytes:
    return dns.message.make_query(dns.name.from_text(name), "A").to_wire()


def test_dns_that_is_not_one_question_is_dropped_or_refused() -> None:
    pool = NamePool()
    assert dns_answer(b"\x00" * 3, pool) is None
    assert dns_answer(b"", pool) is None
    response = dns.message.make_query("api.test", "A")
    response.flags |= dns.flags.QR
    assert dns_answer(response.to_wire(), pool) is None
    two = dns.message.make_query("api.test", "A")
    two.question.append(dns.message.make_query("b.test", "A").question[0])
    assert dns_answer(two.to_wire(), pool) is None
    chaos = dns.message.make_query("version.bind", "TXT", rdclass="CH")
    reply = dns_answer(chaos.to_wire(), pool)
    assert reply is not None and dns.message.from_wire(reply).rcode() == dns.rcode.REFUSED
    assert pool.name(NAME_RANGE.network_address + 1) is None


def test_the_name_pool_is_bounded_and_each_runs_own() -> None:
    pool = NamePool()
    given = [a_of(ask(pool, f"n{i}.test"))[0] for i in range(MAX_NAMES)]
    assert len(set(given)) == MAX_NAMES
    from ipaddress import ip_address

    assert all(ip_address(a) in NAME_RANGE for a in given)
    reply = ask(pool, "one-more.test")
    assert reply is not None and reply.rcode() == dns.rcode.SERVFAIL and reply.answer == []
    # Names already given are still answered, the same.
    assert a_of(ask(pool, "n7.test")) == [given[7]]
    # Another run's pool maps nothing of this one's: its address is unknown there.
    other = NamePool()
    assert other.name(ip_address(given[1])) is None
    assert a_of(ask(other, "x.test")) == [given[0]]
    assert other.name(ip_address(given[0])) == "x.test"
    assert pool.name(ip_address(given[0])) == "n0.test"


# -- in a real sandbox: the guest opens every connection itself --------------------


@pytest.fixture
def store_engine() -> str:
    # The ledger's engine is not what these tests attack (both are tested elsewhere
    # with the same events): SQLite alone keeps the sandboxed runs few.
    return "sqlite"


SEAMS_POLICY = """
@id("api")
permit(principal, action == Proctor::Action::"http.request", resource == Proctor::Host::"api.test");
"""

SEAMS_GUEST = r"""
import json, os, socket, ssl, sys, threading, time
import dns.message, dns.query, dns.rcode
S, H = int(os.environ["UP_HTTPS"]), int(os.environ["UP_HTTP"])
res = {}
A = socket.getaddrinfo("api.test", S, socket.AF_INET)[0][4][0]
res["api"] = A

# DNS: any server is answered by the broker, from the reserved range, and nothing else.
def q(name, kind, server="169.254.77.1"):
    r = dns.query.udp(dns.message.make_query(name, kind), server, timeout=3)
    return [dns.rcode.to_text(r.rcode()), sorted(x.to_text() for rr in r.answer for x in rr)]
res["dns"] = {f"{n} {k}": q(n, k) for n, k in [
    ("api.test", "A"), ("API.TEST.", "A"), ("api.test", "AAAA"), ("api.test", "TXT"),
    ("api.test", "MX"), ("api.test", "ANY"), ("localhost", "A"), ("deny.test", "A"),
    ("xn--bcher-kva.test", "A"), ("under_score.test", "A")]}
res["dns_elsewhere"] = q("api.test", "A", "9.9.9.9")

def hello(name):
    ctx = ssl.create_default_context(); ctx.check_hostname = False; ctx.verify_mode = ssl.CERT_NONE
    i, o = ssl.MemoryBIO(), ssl.MemoryBIO()
    t = ctx.wrap_bio(i, o, server_hostname=name)
    try:
        t.do_handshake()
    except ssl.SSLWantReadError:
        pass
    return o.read()

def split(rec, cut):
    body = rec[5:]
    return (rec[:3] + cut.to_bytes(2, "big") + body[:cut]
            + rec[:3] + (len(body) - cut).to_bytes(2, "big") + body[cut:])

def padded(rec, n):
    body = bytearray(rec[5:])
    pos = 4 + 2 + 32; pos += 1 + body[pos]; pos += 2 + int.from_bytes(body[pos:pos + 2], "big")
    pos += 1 + body[pos]
    size = int.from_bytes(body[pos:pos + 2], "big")
    new = (0x4A4A).to_bytes(2, "big") + n.to_bytes(2, "big") + bytes(n) + bytes(body[pos + 2:pos + 2 + size])
    body = body[:pos] + len(new).to_bytes(2, "big") + new
    body[1:4] = (len(body) - 4).to_bytes(3, "big")
    return rec[:3] + len(body).to_bytes(2, "big") + bytes(body)

def send_raw(addr, port, parts, pause=0.0, wait=0.0):
    # Each part after the first comes `pause` seconds later; the answer is what
    # came back before the connection closed (b"": closed unanswered).
    s = socket.create_connection((addr, port), timeout=15)
    try:
        if wait:
            time.sleep(wait)
        for n, part in enumerate(parts):
            if n:
                time.sleep(pause)
            s.sendall(part)
        data = b""
        while len(data) < 65536:
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
            if data.startswith(b"\x16") or b"\r\n\r\n" in data:
                break
        return data
    except OSError as e:
        return ("error " + type(e).__name__).encode()
    finally:
        s.close()

def tls_answer(data):
    return "server hello" if data.startswith(b"\x16\x03") else ("closed" if not data else data[:60].decode(errors="replace"))

def http_answer(data):
    return data.split(b"\r\n", 1)[0].decode(errors="replace") or "closed"

other = hello("other.test")
lit = hello("aaaa.test").replace(b"aaaa.test", b"127.0.0.1")
good = hello("api.test")
tls = {
    "case": [hello("API.TEST")], "other": [other], "literal": [lit],
    "split": [split(other, 60)], "big": [padded(other, 16384 - (len(other) - 5) - 4)],
    "segments_good": [good[:50], good[50:]], "segments_other": [other[:50], other[50:]],
}
for key, parts in tls.items():
    res["tls " + key] = tls_answer(send_raw(A, S, parts, pause=0.2))
http = {
    "port_ok": b"GET / HTTP/1.1\r\nHost: api.test:%d\r\n\r\n" % H,
    "port_other": b"GET / HTTP/1.1\r\nHost: api.test:1\r\n\r\n",
    "dup_good_first": b"GET / HTTP/1.1\r\nHost: api.test\r\nHost: other.test\r\n\r\n",
    "dup_other_first": b"GET / HTTP/1.1\r\nHost: other.test\r\nHost: api.test\r\n\r\n",
    "absolute": b"GET http://other.test/ HTTP/1.1\r\nHost: api.test\r\n\r\n",
    "two_spaces": b"GET  / HTTP/1.1\r\nHost: other.test\r\n\r\n",
    "tabs": b"GET\t/\tHTTP/1.1\r\nHost: other.test\r\n\r\n",
    "empty_line_first": b"\r\nGET / HTTP/1.1\r\nHost: other.test\r\n\r\n",
    "lower_case": b"get / http/1.1\r\nHost: other.test\r\n\r\n",
    "bare_lf": b"GET / HTTP/1.1\nHost: other.test\n\n",
    "pipelined": b"GET / HTTP/1.1\r\nHost: api.test\r\n\r\nGET / HTTP/1.1\r\nHost: other.test\r\n\r\n",
    "body_on_get": b"GET / HTTP/1.1\r\nHost: api.test\r\nContent-Length: 39\r\n\r\n"
                   b"GET / HTTP/1.1\r\nHost: other.test\r\n\r\n",
    "connect": b"CONNECT other.test:80 HTTP/1.1\r\nHost: api.test\r\n\r\n",
    "h2_prior_knowledge": b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
}
for key, data in http.items():
    res["http " + key] = http_answer(send_raw(A, H, [data]))

# Slow ones, side by side: one byte or one word, then the rest past the broker's wait
# (5 s); and the same after a silence that gets the connection decided as raw TCP.
slow = {
    "tls_one_byte": (S, [other[:1], other[1:]], 0.0),
    "http_one_word": (H, [b"GET", b" / HTTP/1.1\r\nHost: other.test\r\n\r\n"], 0.0),
    "late_tls_one_byte": (S, [other[:1], other[1:]], 1.0),
    "late_http_one_word": (H, [b"GET", b" / HTTP/1.1\r\nHost: other.test\r\n\r\n"], 1.0),
    "late_http_bare_lf": (H, [b"GET / HTTP/1.1\nHost: other.test\n\r\n\r\n"], 1.0),
    "late_http_dup_host": (H, [b"GET / HTTP/1.1\r\nHost: api.test\r\nHost: other.test\r\n\r\n"], 1.0),
}
def run_slow(key, port, parts, wait):
    res["slow " + key] = send_raw(A, port, parts, pause=5.6, wait=wait)[:80].decode(errors="replace") or "closed"
threads = [threading.Thread(target=run_slow, args=(k, *v)) for k, v in slow.items()]
for t in threads:
    t.start()

# Addresses the run was never given, and the relay itself.
for key, addr, port in [("unknown_low", "198.18.200.1", H), ("unknown_high", "198.19.255.254", S)]:
    res[key] = http_answer(send_raw(addr, port, [b"GET / HTTP/1.1\r\nHost: api.test\r\n\r\n"]))
for port in (15001, 15053, 53, 80):
    res[f"relay {port}"] = send_raw("169.254.77.1", port, [b"\x00\x1c" + dns.message.make_query("api.test", "A").to_wire()]).decode(errors="replace") or "closed"
# IPv6 beyond the link: no route out of the guest.
try:
    socket.create_connection(("2001:4860:4860::8888", 443), timeout=3)
    res["ipv6"] = "connected"
except OSError as e:
    res["ipv6"] = "error " + type(e).__name__
# A name the policy denies: dialed, never looked up on the host.
res["deny"] = http_answer(send_raw(socket.gethostbyname("deny.test"), H, [b"GET / HTTP/1.1\r\nHost: deny.test\r\n\r\n"]))

# A UDP flood to many destinations: refused; only the first 32 are recorded.
u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
for rnd in range(2):
    for i in range(40):
        u.sendto(b"x", ("203.0.113.%d" % (i + 1), 1000 + i))
for t in threads:
    t.join()
print(json.dumps(res), flush=True)
"""


class _Recorder:
    """What each upstream saw: the SNIs its TLS server read, the Hosts its HTTP one did."""

    def __init__(self) -> None:
        self.snis: list[str | None] = []
        self.hosts: list[list[str]] = []


def _upstreams(tmp: Path, rec: _Recorder) -> tuple[int, int, Path, list[object]]:
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Hello(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: object) -> None:
            pass

        def do_GET(self) -> None:
            rec.hosts.append(self.headers.get_all("Host") or [])
            body = b"hello"
            self.send_response(200)
            self.send_header("Content-Length", "5")
            self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(body)

    ca = UpstreamCA.make()
    (tmp / "ca.pem").write_bytes(ca.pem())
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(ca.issue(["api.test"], tmp / "leaf.pem"))
    ctx.sni_callback = lambda _s, name, _c: rec.snis.append(name)
    tls = ThreadingHTTPServer(("127.0.0.1", 0), Hello)
    # The handshake in each handler's thread, not in accept: a stalled one holds
    # only its own connection.
    tls.socket = ctx.wrap_socket(tls.socket, server_side=True, do_handshake_on_connect=False)
    plain = ThreadingHTTPServer(("127.0.0.1", 0), Hello)
    servers: list[object] = [tls, plain]
    for s in (tls, plain):
        s.daemon_threads = True
        threading.Thread(target=s.serve_forever, daemon=True).start()
    return tls.server_address[1], plain.server_address[1], tmp / "ca.pem", servers


class _Resolver:
    """The broker's resolver: api.test is the host's loopback; every lookup recorded."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    async def __call__(self, name: str, port: int) -> list[Any]:
        from ipaddress import ip_address

        from proctor.broker._egress import UpstreamFailed

        self.calls.append(name)
        if name != "api.test":
            raise UpstreamFailed(f"could not resolve {name}")
        return [ip_address("127.0.0.1")]


def _code(tmp: Path, main: str) -> Path:
    code = tmp / "code"
    code.mkdir()
    (code / "main.py").write_text(main)
    os.chmod(code, 0o755)
    (code / "main.py").chmod(0o644)
    return code


def _run_guest(
    broker: Broker, scope: RunScope, code: Path, backend: str, env: dict[str, str]
) -> tuple[dict[str, Any], Any]:
    from tests.e2e.test_transparent_egress import _site_packages

    out: list[bytes] = []
    err: list[bytes] = []
    channel = broker.open_run(scope, ttl=300)
    network = GuestNetwork.create()
    try:
        broker.attach_network(scope.run_id, network)
        spec = brokered_spec(channel, ("python3", "/code/main.py"), code_dir=code, env=env,
                             limits=Limits(wall_seconds=120, memory_bytes=1 << 30, pids=128),
                             network=network)  # fmt: skip
        site = _site_packages()
        spec = dataclasses.replace(
            spec,
            ro_dirs={**spec.ro_dirs, site: "/opt/site"},
            env={**spec.env, "PYTHONPATH": spec.env["PYTHONPATH"] + ":/opt/site"},
        )
        result = get_driver(backend).run(spec, on_stdout=out.append, on_stderr=err.append)
        run = broker._runs[scope.run_id]  # the run's own counter of UDP refusals unrecorded
        udp_refused = run.transparent.udp_refused if run.transparent is not None else None
    finally:
        broker.close_run(scope.run_id)
        network.close()
    stderr = b"".join(err).decode(errors="replace")
    assert result.exit_code == 0, stderr[-3000:]
    return json.loads(b"".join(out).decode().strip().splitlines()[-1]), udp_refused


@pytest.mark.host
@pytest.mark.skipif(not network_available(), reason="needs root, iproute2 and nftables")
def test_seams_of_a_redirected_connection_in_a_real_sandbox(
    ledger_env: LedgerEnv, tmp_path: Path
) -> None:
    backend = any_backend()[0]
    rec = _Recorder()
    https, http, _ca, servers = _upstreams(tmp_path, rec)
    resolver = _Resolver()
    ledger_env.ledger.create_log("acme", draft(0))
    scope = _scope(ledger_env.ledger, "seams", allowed_ranges=("127.0.0.0/8",))
    scope.policies = compile_policies(SEAMS_POLICY)
    proxy = EgressProxy(tmp_path / "ca", resolver=resolver, connect_timeout=5)
    code = _code(tmp_path, SEAMS_GUEST)
    try:
        with Broker(Handlers.for_proxy(proxy), os.urandom(32)) as broker:
            res, udp_refused = _run_guest(broker, scope, code, backend,
                                          {"UP_HTTPS": str(https), "UP_HTTP": str(http)})  # fmt: skip
    finally:
        for s in servers:
            s.shutdown()  # type: ignore[attr-defined]
            s.server_close()  # type: ignore[attr-defined]

    # DNS: the reserved range, one address a name, nothing for other types.
    api = res["api"]
    assert ip_address(api) in NAME_RANGE
    d = res["dns"]
    assert d["api.test A"] == d["API.TEST. A"] == ["NOERROR", [api]]
    for kind in ("AAAA", "TXT", "MX", "ANY"):
        assert d[f"api.test {kind}"] == ["NOERROR", []], kind
    assert d["localhost A"] == ["NOERROR", ["127.0.0.1"]]
    assert ip_address(d["deny.test A"][1][0]) in NAME_RANGE
    assert ip_address(d["xn--bcher-kva.test A"][1][0]) in NAME_RANGE
    assert d["under_score.test A"] == ["NXDOMAIN", []]
    assert res["dns_elsewhere"] == ["NOERROR", [api]]  # any server: the broker answers

    # TLS: a name differing only in case goes on; every other the upstream never reads.
    assert res["tls case"] == "server hello"
    assert res["tls segments_good"] == "server hello"
    for key in ("other", "literal", "split", "big", "segments_other"):
        assert res[f"tls {key}"] in ("closed", "error ConnectionResetError"), (key, res)
    assert {n.lower() for n in rec.snis if n is not None} == {"api.test"}, rec.snis
    # HTTP: the Host the upstream reads is the decided name, always.
    assert res["http port_ok"] == "HTTP/1.1 200 OK"
    assert res["http port_other"].startswith("HTTP/1.1 403")
    assert res["http dup_other_first"].startswith("HTTP/1.1 403")
    assert res["http absolute"].startswith("HTTP/1.1 400")
    for key in ("two_spaces", "tabs", "empty_line_first", "lower_case", "bare_lf"):
        assert res[f"http {key}"].startswith(("HTTP/1.1 400", "HTTP/1.1 403")), (key, res)
    # A second request behind the first, or in a GET's body, never reaches the
    # upstream: one request per connection, no body on GET.
    assert res["http pipelined"] == "HTTP/1.1 200 OK"
    assert res["http body_on_get"].startswith("HTTP/1.1 400")
    assert res["http connect"].startswith("HTTP/1.1 400")
    assert res["http h2_prior_knowledge"].startswith("HTTP/1.1 400")
    assert res["ipv6"].startswith("error"), res["ipv6"]
    # Two Hosts, the decided one first: the broker forwards with its own Host alone.
    assert res["http dup_good_first"].startswith(("HTTP/1.1 200", "HTTP/1.1 400"))
    # Slow: one byte or word, then the rest after the wait; and after a silence.
    for key in ("tls_one_byte", "late_tls_one_byte"):
        assert not res[f"slow {key}"].startswith("\x16"), (key, res)
    for key in ("http_one_word", "late_http_one_word", "late_http_bare_lf",
                "late_http_dup_host"):  # fmt: skip
        assert not res[f"slow {key}"].startswith("HTTP/1.1 200"), (key, res[f"slow {key}"])
    assert all(hosts == [f"api.test:{http}"] or hosts == ["api.test"] for hosts in rec.hosts), (
        rec.hosts
    )
    assert {n.lower() for n in rec.snis if n is not None} == {"api.test"}, rec.snis

    # Addresses never given, and the relay itself: nothing there.
    assert res["unknown_low"].startswith("HTTP/1.1 403")
    assert res["unknown_high"].startswith("HTTP/1.1 403")
    for port in (15001, 15053, 53, 80):
        assert res[f"relay {port}"] in ("closed", "error ConnectionResetError"), (port, res)
    assert res["deny"].startswith("HTTP/1.1 403")
    # Nothing looked up on the host but the one name permitted and dialed.
    assert set(resolver.calls) == {"api.test"}, resolver.calls

    events = [json.loads(e) for e in ledger_env.ledger.entries("acme")]
    decisions = [e for e in events if e["action"] == "http.request"]
    by_rule: dict[str, list[dict[str, Any]]] = {}
    for e in decisions:
        if e["decision"] != "allow":
            for p in e["policies"] or ["-"]:
                by_rule.setdefault(p, []).append(e)
    unknown = by_rule["proctor:egress:unknown-address"]
    assert {e["details"]["original_address"] for e in unknown} == {"198.18.200.1",
                                                                   "198.19.255.254"}  # fmt: skip
    mismatch = by_rule["proctor:egress:name-mismatch"]
    tls_refused = [e for e in mismatch if e["details"].get("protocol") == "tls"]
    # other, literal, split, big, segments_other, and the slow one-byte ones.
    assert len(tls_refused) >= 6, [e["details"] for e in tls_refused]
    assert {e["details"].get("sni") for e in tls_refused} >= {"other.test", "127.0.0.1", ""}
    udp = [e for e in by_rule["proctor:egress:udp"] if e["resource"] != "udp/*"]
    assert len(udp) == 32  # the recording cap; the rest counted, in one event
    assert len({e["resource"] for e in udp}) == 32
    assert udp_refused == 80 - 32, udp_refused
    (more,) = [e for e in by_rule["proctor:egress:udp"] if e["resource"] == "udp/*"]
    assert more["details"]["unrecorded"] == 80 - 32
    # The relay's own address is recorded nowhere: nothing reached a decision.
    assert not [e for e in decisions if "169.254.77.1" in json.dumps(e)]
    assert [e["resource"] for e in decisions if e["resource"].startswith("host/deny.test")] == [
        f"host/deny.test:{http}"
    ]


RUN_A = r"""
import json, os, socket
H = int(os.environ["UP_HTTP"])
res = {n: socket.gethostbyname(n) for n in ("x.test", "api.test")}
s = socket.create_connection(("api.test", H), timeout=10)
s.sendall(b"GET / HTTP/1.1\r\nHost: api.test\r\nConnection: close\r\n\r\n")
res["get"] = s.recv(200).split(b"\r\n", 1)[0].decode()
print(json.dumps(res), flush=True)
"""

RUN_B = r"""
import json, os, socket
H = int(os.environ["UP_HTTP"])
A_API = os.environ["A_API"]
def get(addr, host):
    s = socket.create_connection((addr, H), timeout=10)
    s.sendall(b"GET / HTTP/1.1\r\nHost: %s\r\nConnection: close\r\n\r\n" % host.encode())
    return s.recv(200).split(b"\r\n", 1)[0].decode() or "closed"
res = {"y": socket.gethostbyname("y.test")}
res["a_api_unresolved"] = get(A_API, "api.test")  # run A's address for api.test
res["y_get"] = get(res["y"], "y.test")
res["api"] = socket.gethostbyname("api.test")
res["api_get"] = get(res["api"], "api.test")
print(json.dumps(res), flush=True)
"""


@pytest.mark.host
@pytest.mark.skipif(not network_available(), reason="needs root, iproute2 and nftables")
def test_one_runs_name_addresses_mean_nothing_in_another(
    ledger_env: LedgerEnv, tmp_path: Path
) -> None:
    # Both runs open at once in one broker: B dials the address A was given for an
    # allowed name without asking for it, and gets the same numbers for its own names.
    from tests.e2e.test_transparent_egress import _site_packages

    backend = any_backend()[0]
    rec = _Recorder()
    _https, http, _ca, servers = _upstreams(tmp_path, rec)
    ledger_env.ledger.create_log("acme", draft(0))
    scopes = {}
    for run in ("run-a", "run-b"):
        scopes[run] = _scope(ledger_env.ledger, run, allowed_ranges=("127.0.0.0/8",))
        scopes[run].policies = compile_policies(SEAMS_POLICY)
    proxy = EgressProxy(tmp_path / "ca", resolver=_Resolver(), connect_timeout=5)
    results: dict[str, dict[str, Any]] = {}
    networks = []
    try:
        with Broker(Handlers.for_proxy(proxy), os.urandom(32)) as broker:
            channels = {run: broker.open_run(scope, ttl=300) for run, scope in scopes.items()}
            try:
                for run in scopes:
                    network = GuestNetwork.create()
                    networks.append(network)
                    broker.attach_network(run, network)
                for (run, main), network in zip(
                    (("run-a", RUN_A), ("run-b", RUN_B)), networks, strict=True
                ):
                    (tmp_path / run).mkdir()
                    code = _code(tmp_path / run, main)
                    env = {"UP_HTTP": str(http)}
                    if run == "run-b":
                        env["A_API"] = results["run-a"]["api.test"]
                    spec = brokered_spec(channels[run], ("python3", "/code/main.py"),
                                         code_dir=code, env=env, network=network)  # fmt: skip
                    spec = dataclasses.replace(
                        spec, ro_dirs={**spec.ro_dirs, _site_packages(): "/opt/site"}
                    )
                    out: list[bytes] = []
                    err: list[bytes] = []
                    done = get_driver(backend).run(spec, on_stdout=out.append, on_stderr=err.append)
                    assert done.exit_code == 0, b"".join(err).decode(errors="replace")[-2000:]
                    results[run] = json.loads(b"".join(out).decode().strip().splitlines()[-1])
            finally:
                for run in scopes:
                    broker.close_run(run)
                for network in networks:
                    network.close()
    finally:
        for s in servers:
            s.shutdown()  # type: ignore[attr-defined]
            s.server_close()  # type: ignore[attr-defined]
    a, b = results["run-a"], results["run-b"]
    assert a["get"] == "HTTP/1.1 200 OK"
    # The same numbers, another meaning: each run's pool is its own.
    assert b["y"] == a["x.test"]
    assert b["a_api_unresolved"].startswith("HTTP/1.1 403"), b
    assert b["y_get"].startswith("HTTP/1.1 403"), b
    assert b["api_get"] == "HTTP/1.1 200 OK"
    events = [json.loads(e) for e in ledger_env.ledger.entries("acme")]
    b_decisions = [
        e for e in events
        if e["action"] == "http.request" and e["actor"]["id"].endswith("/run/run-b")
    ]  # fmt: skip
    unknown = [e for e in b_decisions if e["policies"] == ["proctor:egress:unknown-address"]]
    assert [e["details"]["original_address"] for e in unknown] == [a["api.test"]]
    # y.test's address is decided as y.test (denied), never as A's x.test.
    assert [e["resource"] for e in b_decisions if e["details"].get("original_address") == b["y"]
            ] == [f"host/y.test:{http}"]  # fmt: skip
    assert not [e for e in b_decisions if "x.test" in json.dumps(e)]


UDP_THEN_EXIT = r"""
import socket
u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
for n in range(3):
    for i in range(40):
        u.sendto(b"x", ("203.0.113.%d" % (i + 1), 2000 + i))
"""


@pytest.mark.host
@pytest.mark.skipif(not network_available(), reason="needs root, iproute2 and nftables")
def test_a_udp_flood_just_before_the_run_ends_is_on_the_record(
    ledger_env: LedgerEnv, tmp_path: Path
) -> None:
    # The guest floods and exits at once: the run closes while the refusals are
    # still being written. Each of the first 32 destinations is recorded all the
    # same, and what is over the cap is counted in one event, not lost.
    backend = any_backend()[0]
    ledger_env.ledger.create_log("acme", draft(0))
    scope = _scope(ledger_env.ledger, "flood")
    proxy = EgressProxy(tmp_path / "ca", resolver=_Resolver(), connect_timeout=5)
    code = _code(tmp_path, UDP_THEN_EXIT)
    with Broker(Handlers.for_proxy(proxy), os.urandom(32)) as broker:
        _run_guest_plain(broker, scope, code, backend)
    events = [json.loads(e) for e in ledger_env.ledger.entries("acme")]
    udp = [e for e in events if e["policies"] == ["proctor:egress:udp"]]
    each = [e for e in udp if e["resource"] != "udp/*"]
    assert len(each) == 32, len(each)
    assert {e["decision"] for e in udp} == {"deny"}
    (more,) = [e for e in udp if e["resource"] == "udp/*"]
    assert more["details"]["unrecorded"] == 3 * 40 - 32


def _run_guest_plain(broker: Broker, scope: RunScope, code: Path, backend: str) -> None:
    channel = broker.open_run(scope, ttl=300)
    network = GuestNetwork.create()
    err: list[bytes] = []
    try:
        broker.attach_network(scope.run_id, network)
        spec = brokered_spec(channel, ("python3", "/code/main.py"), code_dir=code,
                             network=network)  # fmt: skip
        result = get_driver(backend).run(spec, on_stdout=lambda _b: None, on_stderr=err.append)
    finally:
        broker.close_run(scope.run_id)
        network.close()
    assert result.exit_code == 0, b"".join(err).decode(errors="replace")[-2000:]


DNS_FLOOD = r"""
import json, socket, struct, time
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.setblocking(False)
def query(i):
    name = b"\x02n%d\x04test\x00" % (i % 10)
    name = bytes([len(name) - 7]) + name[1:]
    return struct.pack(">HHHHHH", i & 0xFFFF, 0x100, 1, 0, 0, 0) + name + b"\x00\x01\x00\x01"
answers = sent = 0
start = time.monotonic()
while time.monotonic() - start < 2.0:
    try:
        s.sendto(query(sent), ("169.254.77.1", 53))
        sent += 1
    except BlockingIOError:
        pass
    while True:
        try:
            s.recv(512)
            answers += 1
        except BlockingIOError:
            break
    if sent % 64 == 0:
        time.sleep(0.001)
end = time.monotonic() + 0.5
while time.monotonic() < end:
    try:
        s.recv(512)
        answers += 1
    except BlockingIOError:
        time.sleep(0.01)
print(json.dumps({"sent": sent, "answers": answers, "seconds": time.monotonic() - start}))
"""


@pytest.mark.host
@pytest.mark.skipif(not network_available(), reason="needs root, iproute2 and nftables")
def test_a_dns_flood_gets_a_bounded_share_of_the_brokers_loop(
    ledger_env: LedgerEnv, tmp_path: Path
) -> None:
    # Every run's DNS is answered on the broker's one event loop: a run sending
    # queries as fast as it can must not have them all parsed and answered (each
    # costs the loop tens of microseconds, so one run could hold it for all). Past
    # its budget a second, its datagrams are left to the kernel, which drops them.
    from proctor.broker._transparent import MAX_UDP_PER_SECOND

    backend = any_backend()[0]
    ledger_env.ledger.create_log("acme", draft(0))
    scope = _scope(ledger_env.ledger, "dns-flood")
    proxy = EgressProxy(tmp_path / "ca", resolver=_Resolver(), connect_timeout=5)
    code = _code(tmp_path, DNS_FLOOD)
    with Broker(Handlers.for_proxy(proxy), os.urandom(32)) as broker:
        res, _ = _run_guest(broker, scope, code, backend, {})
    # However fast this machine is, no more than the budget of each second begun
    # (and one read's burst) is answered: an upper bound, never a speed asked for.
    bound = MAX_UDP_PER_SECOND * (int(res["seconds"]) + 2) + 64
    assert res["answers"] <= bound, res
    assert res["answers"] > 0, res  # DNS still works under the budget
    assert res["sent"] > bound, res  # the guest did send past it


MANY_CONNECTIONS = r"""
import json, socket
addr = socket.gethostbyname("deny.test")
out = []
for i in range(12):
    s = socket.create_connection((addr, 80), timeout=10)
    s.sendall(b"GET / HTTP/1.1\r\nHost: deny.test\r\n\r\n")
    data = b""
    while chunk := s.recv(4096):
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    out.append([head.split(b"\r\n", 1)[0].decode(), json.loads(body or b"{}").get("policies")])
    s.close()
print(json.dumps(out))
"""


@pytest.mark.host
@pytest.mark.skipif(not network_available(), reason="needs root, iproute2 and nftables")
def test_redirected_connections_are_calls_charged_to_the_run(
    ledger_env: LedgerEnv, tmp_path: Path
) -> None:
    # Each connection is a call as each request on the socket is: held to the run's
    # bound (limits.calls) and its rate, so a guest cannot decide, and write to the
    # ledger, without end by opening connections instead of calling the proxy.
    from proctor.broker import RateLimit
    from proctor.broker._scope import CALL_BOUND_RULE, RATE_LIMIT_RULE

    backend = any_backend()[0]
    ledger_env.ledger.create_log("acme", draft(0))
    bounded = _scope(ledger_env.ledger, "bounded", call_bound=5)
    slowed = _scope(ledger_env.ledger, "slowed", rate_limit=RateLimit(per_second=0.5, burst=3))
    proxy = EgressProxy(tmp_path / "ca", resolver=_Resolver(), connect_timeout=5)
    code = _code(tmp_path, MANY_CONNECTIONS)
    with Broker(Handlers.for_proxy(proxy), os.urandom(32)) as broker:
        over_bound, _ = _run_guest(broker, bounded, code, backend, {})
        over_rate, _ = _run_guest(broker, slowed, code, backend, {})
    events = [json.loads(e) for e in ledger_env.ledger.entries("acme")]

    def of(run: str) -> list[dict[str, Any]]:
        return [e for e in events if e["actor"]["id"].endswith(f"/run/{run}")]

    decided = [e for e in of("bounded") if e["action"] == "http.request"]
    assert len(decided) == 5, len(decided)
    assert [e["action"] for e in of("bounded")].count("broker.call_bound") == 1
    # Five decided (denied by policy: no permit), then refused naming the bound.
    assert over_bound[:5] == [["HTTP/1.1 403 Forbidden", []]] * 5, over_bound
    assert over_bound[5:] == [["HTTP/1.1 403 Forbidden", [CALL_BOUND_RULE]]] * 7, over_bound
    decided = [e for e in of("slowed") if e["action"] == "http.request"]
    assert len(decided) <= 4, len(decided)
    assert "broker.rate_limited" in [e["action"] for e in of("slowed")]
    limited = [a for a in over_rate if a == ["HTTP/1.1 429 Too Many Requests", [RATE_LIMIT_RULE]]]
    assert len(limited) >= 8, over_rate


POST_GUEST = r"""
import json, os, socket
H = int(os.environ["UP_HTTP"])
out = {}
for name, body in (("short", b"0123456789"), ("long", b"x" * 3000)):
    s = socket.create_connection(("api.test", H), timeout=10)
    s.sendall(b"POST /in HTTP/1.1\r\nHost: api.test\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
    data = b""
    while chunk := s.recv(4096):
        data += chunk
    out[name] = data.split(b"\r\n", 1)[0].decode()
print(json.dumps(out))
"""


@pytest.mark.host
@pytest.mark.skipif(not network_available(), reason="needs root, iproute2 and nftables")
def test_a_redirected_posts_body_is_its_body(ledger_env: LedgerEnv, tmp_path: Path) -> None:
    # The head is peeked to be decided; what goes upstream as the body must be the
    # body, not the head's own bytes read again (which would carry the guest's Host
    # and anything else in its head to the upstream, unchecked, as a payload).
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    bodies: list[bytes] = []

    class Take(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: object) -> None:
            pass

        def do_POST(self) -> None:
            bodies.append(self.rfile.read(int(self.headers["Content-Length"])))
            self.send_response(204)
            self.send_header("Connection", "close")
            self.end_headers()

    server = ThreadingHTTPServer(("127.0.0.1", 0), Take)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    backend = any_backend()[0]
    ledger_env.ledger.create_log("acme", draft(0))
    scope = _scope(ledger_env.ledger, "post", allowed_ranges=("127.0.0.0/8",))
    scope.policies = compile_policies(SEAMS_POLICY)
    proxy = EgressProxy(tmp_path / "ca", resolver=_Resolver(), connect_timeout=5)
    code = _code(tmp_path, POST_GUEST)
    try:
        with Broker(Handlers.for_proxy(proxy), os.urandom(32)) as broker:
            res, _ = _run_guest(broker, scope, code, backend,
                                {"UP_HTTP": str(server.server_address[1])})  # fmt: skip
    finally:
        server.shutdown()
        server.server_close()
    assert res == {"short": "HTTP/1.1 204 No Content", "long": "HTTP/1.1 204 No Content"}, res
    assert bodies == [b"0123456789", b"x" * 3000], bodies


KEPT_GUEST = r"""
import json, os, socket
H = int(os.environ["UP_HTTP"])
s = socket.create_connection(("api.test", H), timeout=10)
f = s.makefile("rb")
out = []
def ask(path, host="api.test", close=False):
    s.sendall(f"GET {path} HTTP/1.1\r\nHost: {host}\r\n".encode()
              + (b"Connection: close\r\n" if close else b"") + b"\r\n")
    status = f.readline().decode().strip()
    length = 0
    while (line := f.readline()) not in (b"\r\n", b""):
        k, _, v = line.decode().partition(":")
        if k.lower() == "content-length":
            length = int(v)
    out.append([status, f.read(length).decode()])
# Three requests on one kept-alive connection, then one naming another host on it.
for p in ("/one", "/two", "/three"):
    ask(p)
ask("/four", host="other.test", close=True)
out.append(f.read().decode() or "closed")
print(json.dumps(out))
"""


@pytest.mark.host
@pytest.mark.skipif(not network_available(), reason="needs root, iproute2 and nftables")
def test_a_kept_alive_redirected_connection_decides_each_request_and_holds_its_host(
    ledger_env: LedgerEnv, tmp_path: Path
) -> None:
    # A guest's HTTP/1.1 client keeps its connection for the next request: each one
    # is a call (decided, recorded, charged) and each Host must still name what the
    # connection's address stands for, or a first request to an allowed name could
    # carry the next ones anywhere the upstream would route them.
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    seen: list[tuple[str, str | None]] = []

    class Hello(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: object) -> None:
            pass

        def do_GET(self) -> None:
            seen.append((self.path, self.headers.get("Host")))
            body = f"hello {self.path}".encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Hello)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    backend = any_backend()[0]
    ledger_env.ledger.create_log("acme", draft(0))
    scope = _scope(ledger_env.ledger, "kept", allowed_ranges=("127.0.0.0/8",))
    scope.policies = compile_policies(SEAMS_POLICY)
    proxy = EgressProxy(tmp_path / "ca", resolver=_Resolver(), connect_timeout=5)
    code = _code(tmp_path, KEPT_GUEST)
    try:
        with Broker(Handlers.for_proxy(proxy), os.urandom(32)) as broker:
            res, _ = _run_guest(broker, scope, code, backend,
                                {"UP_HTTP": str(server.server_address[1])})  # fmt: skip
    finally:
        server.shutdown()
        server.server_close()
    assert res[:3] == [["HTTP/1.1 200 OK", f"hello /{p}"] for p in ("one", "two", "three")], res
    assert res[3][0].startswith("HTTP/1.1 403"), res
    assert [path for path, _ in seen] == ["/one", "/two", "/three"], seen
    events = [json.loads(e) for e in ledger_env.ledger.entries("acme")]
    decided = [e for e in events if e["action"] == "http.request"]
    assert [(e["decision"], e["details"].get("path")) for e in decided[:3]] == [
        ("allow", "/one"),
        ("allow", "/two"),
        ("allow", "/three"),
    ], decided
    assert all(e["details"]["via"] == "transparent" for e in decided)
    assert decided[3]["decision"] == "deny"
    assert decided[3]["policies"] == ["proctor:egress:name-mismatch"]
    assert sum(e["action"] == "http.request.end" for e in events) == 3
