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

import itertools
import socket
import ssl
from collections.abc import Iterator
from pathlib import Path

import dns.flags
import dns.message
import dns.name
import dns.rcode
import dns.rdatatype
import pytest

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
from tests.integration.test_broker_proxy import UpstreamCA

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
