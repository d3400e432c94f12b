"""Transparent egress: whatever a program in the run does with the network reaches
the broker, with no proxy setting honoured or needed.

The run's network (:class:`proctor.sandbox.GuestNetwork`) hands this module two
sockets in its relay namespace: every TCP connection the guest opens, and every
UDP datagram it sends.

- **DNS** (UDP, any server, port 53): answered here, never forwarded. An ``A``
  question gets an address from a reserved range (198.18.0.0/15, benchmarking,
  never a real destination), one per name and run, that maps back to the name;
  ``AAAA`` and other types get no data, so clients use the IPv4 answer. No real
  lookup happens until a connection to the name is decided, so a name the run
  may not reach is never looked up, and the guest never learns a real address.
- **Other UDP**: refused, recorded once per destination (at most
  :data:`MAX_UDP_RECORDED` a run, counted after that).
- **TCP**: the original destination is read back. An address from the reserved
  range stands for its name; any other address is a literal, decided on the
  address (special-purpose ranges refused as on the proxy). The first bytes
  are peeked, not read: a TLS ClientHello's SNI, or a plain HTTP request's
  ``Host``, must name what is decided (else refused with
  :data:`NAME_MISMATCH_RULE`). Plain HTTP is then forwarded exactly as the
  proxy's absolute-form requests are (``egress.forward``: method and path
  decided, one request per connection); anything else is a tunnel decided as
  ``CONNECT host:port`` would be. Same Cedar question, same ``http.request``
  event and ``http.request.end`` completion, with ``details.via`` =
  ``transparent``.

A refused TLS or raw connection is closed without an answer (an HTTP error
written into a TLS stream helps no one); a refused plain-HTTP request gets the
proxy's error response.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import re
import socket
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

import dns.exception
import dns.flags
import dns.message
import dns.rcode
import dns.rdataclass
import dns.rdatatype
import dns.rrset

from proctor.broker._admission import (
    Admitted,
    Outcome,
    bad_request,
    record_refusal,
    refused,
    resource_of,
    rule,
)
from proctor.broker._admission import admitted as admitted_of
from proctor.broker._calls import Acted, Call, Ruling, register
from proctor.broker._egress import EgressDenied, Host, UpstreamFailed, parse_host
from proctor.broker._http import check_headers, parse_request_head, request_framing
from proctor.broker._inject import bindings_for
from proctor.broker._proxy import ConnectRequest, EgressProxy, _close, _relay
from proctor.broker._record import complete
from proctor.broker._rules import rules_for
from proctor.broker._scope import (
    BadCall,
    BrokerError,
    Exhausted,
    RateLimited,
    RunScope,
    SecretBinding,
)
from proctor.broker._splice import wait_ready
from proctor.broker._telemetry import finished
from proctor.ledger import Action
from proctor.policy import normalize_host
from proctor.sandbox import GuestNetwork

if TYPE_CHECKING:
    from proctor.broker._proxy import ForwardRequest

#: Where DNS answers point: one address per name and run, mapped back on connect.
NAME_RANGE: Final = ipaddress.IPv4Network("198.18.0.0/15")
#: Names one run may have addresses for (a lookup past it is SERVFAIL).
MAX_NAMES: Final = 4096
#: Refusals of non-DNS UDP recorded per run (one per destination); later ones counted.
MAX_UDP_RECORDED: Final = 32
#: Datagrams (DNS and others) read for one run a second. Past it the run's UDP socket
#: is left unread until the second is over and the kernel drops what overflows: every
#: run is served on the broker's one event loop, and each DNS answer costs it tens of
#: microseconds, so one run's flood would otherwise hold the loop from all others.
MAX_UDP_PER_SECOND: Final = 500
#: How long a connection may stay silent before it is decided as raw TCP (a
#: protocol whose server speaks first: SMTP, SSH, MySQL). Long enough for a slow
#: client's ClientHello (a JVM under gVisor), whose late first flight is held to
#: the name all the same; short enough that a server-first protocol barely waits.
PEEK_WAIT: Final = 0.5
#: The most of a connection's first bytes looked at (a ClientHello, an HTTP head).
PEEK_BYTES: Final = 16 * 1024
NAME_MISMATCH_RULE: Final = "proctor:egress:name-mismatch"
#: The SNI of a ClientHello that cannot be read (malformed, not whole within
#: :data:`PEEK_BYTES`, or still coming when the wait ended): it names no host, so
#: it matches none; a server may still read a name in it that was never decided.
UNREADABLE: Final = ""
UDP_RULE: Final = "proctor:egress:udp"
UNKNOWN_NAME_RULE: Final = "proctor:egress:unknown-address"
DNS_TTL: Final = 60
#: DNS servers (addresses the guest sent a query to) one run is answered from.
MAX_REPLY_SOCKETS: Final = 8


class NamePool:
    """The run's names and the reserved addresses standing for them."""

    def __init__(self) -> None:
        self._by_name: dict[str, ipaddress.IPv4Address] = {}
        self._by_address: dict[ipaddress.IPv4Address, str] = {}
        self._next = int(NAME_RANGE.network_address) + 1

    def address(self, name: str) -> ipaddress.IPv4Address | None:
        known = self._by_name.get(name)
        if known is not None or len(self._by_name) >= MAX_NAMES:
            return known
        address = ipaddress.IPv4Address(self._next)
        self._next += 1
        self._by_name[name] = address
        self._by_address[address] = name
        return address

    def name(self, address: ipaddress.IPv4Address) -> str | None:
        return self._by_address.get(address)


def dns_answer(query: bytes, pool: NamePool) -> bytes | None:
    """The answer to one DNS query (None: not a query, dropped)."""
    try:
        msg = dns.message.from_wire(query)
    except (dns.exception.DNSException, ValueError):
        return None
    if msg.flags & dns.flags.QR or len(msg.question) != 1:
        return None
    reply = dns.message.make_response(msg, recursion_available=True)
    question = msg.question[0]
    text = question.name.to_text(omit_final_dot=True)
    try:
        name = normalize_host(text)
    except Exception:
        reply.set_rcode(dns.rcode.NXDOMAIN)
        return reply.to_wire()
    if question.rdclass != dns.rdataclass.IN:
        reply.set_rcode(dns.rcode.REFUSED)
    elif question.rdtype == dns.rdatatype.A:
        if name == "localhost":
            address: ipaddress.IPv4Address | None = ipaddress.IPv4Address("127.0.0.1")
        else:
            address = pool.address(name)
        if address is None:
            reply.set_rcode(dns.rcode.SERVFAIL)
        else:
            reply.answer.append(
                dns.rrset.from_text(question.name, DNS_TTL, "IN", "A", str(address))
            )
    # AAAA and every other type: no data (NOERROR, empty answer).
    return reply.to_wire()


def client_hello_sni(data: bytes) -> tuple[bool, str | None]:
    """(complete, SNI) of a TLS ClientHello at the start of ``data``; (True, None)
    when there is no server name, (False, None) when more bytes are needed, and
    (True, :data:`UNREADABLE`) for one that cannot be read.

    The handshake message is put together from every record it spans, as a
    server does (a name in its second record is the name the server reads); a
    record of another type inside it, a message not whole within
    :data:`PEEK_BYTES`, or any length pointing past what is there is unreadable.
    """
    message = b""
    pos = 0
    while len(message) < 4 or len(message) < 4 + int.from_bytes(message[1:4], "big"):
        if len(data) < pos + 5:
            return _short(data)
        if data[pos] != 0x16:
            return True, UNREADABLE
        end = pos + 5 + int.from_bytes(data[pos + 3 : pos + 5], "big")
        if len(data) < end:
            return _short(data)
        message += data[pos + 5 : end]
        pos = end
    try:
        return True, _sni(message[: 4 + int.from_bytes(message[1:4], "big")])
    except (IndexError, UnicodeDecodeError):
        return True, UNREADABLE


def _short(data: bytes) -> tuple[bool, str | None]:
    return (True, UNREADABLE) if len(data) >= PEEK_BYTES else (False, None)


def _sni(body: bytes) -> str | None:
    """The first host_name of a ClientHello's server_name extension (IndexError if
    a length points past the end)."""
    if body[0] != 1:  # not a ClientHello
        return None
    pos = 4 + 2 + 32  # handshake header, version, random
    pos += 1 + body[pos]  # session id
    pos += 2 + int.from_bytes(body[pos : pos + 2], "big")  # cipher suites
    pos += 1 + body[pos]  # compression methods
    end = min(pos + 2 + int.from_bytes(body[pos : pos + 2], "big"), len(body))
    pos += 2
    while pos + 4 <= end:
        kind = int.from_bytes(body[pos : pos + 2], "big")
        size = int.from_bytes(body[pos + 2 : pos + 4], "big")
        ext = body[pos + 4 : pos + 4 + size]
        pos += 4 + size
        if kind == 0:
            # server_name_list: (type, length, name) entries.
            at = 2
            while at + 3 <= len(ext):
                name_size = int.from_bytes(ext[at + 1 : at + 3], "big")
                name = ext[at + 3 : at + 3 + name_size]
                if ext[at] == 0 and len(name) == name_size:
                    return name.decode("ascii")
                at += 3 + name_size
            return None
    return None


@dataclass
class Origin:
    """What a redirected connection was: where it was going and how it began."""

    address: ipaddress.IPv4Address
    port: int
    name: str | None  # the DNS name its address stands for
    peeked: bytes
    protocol: str  # "tls", "http", "tcp"
    sni: str | None = None
    http_host: str | None = None
    #: A kept-alive connection's next request: its head already read off, not peeked.
    head_read: bool = False


@dataclass
class TransparentEgress:
    """One run's transparent egress, served on the broker's event loop."""

    proxy: EgressProxy
    scope: RunScope
    network: GuestNetwork
    max_connections: int
    pool: NamePool = field(default_factory=NamePool)
    udp_recorded: set[tuple[str, int]] = field(default_factory=set)
    udp_refused: int = 0
    _tcp: socket.socket | None = None
    _udp: socket.socket | None = None
    _accepting: asyncio.Task[None] | None = None
    #: Sockets answering from a datagram's original destination, by that address.
    _replies: dict[tuple[str, int], socket.socket] = field(default_factory=dict)
    _tasks: set[asyncio.Task[None]] = field(default_factory=set)
    #: UDP refusals still being written: awaited when the run closes, not cancelled.
    _recording: set[asyncio.Task[None]] = field(default_factory=set)
    #: The UDP budget: when the second began, datagrams read in it, the wake-up.
    _udp_second: float = 0.0
    _udp_read: int = 0
    _udp_paused: asyncio.TimerHandle | None = None

    async def start(self) -> None:
        tcp, udp = self.network.relay_sockets()
        tcp.setblocking(False)
        udp.setblocking(False)
        self._tcp, self._udp = tcp, udp
        loop = asyncio.get_running_loop()
        loop.add_reader(udp.fileno(), self._on_udp)
        self._accepting = loop.create_task(self._accept(tcp))

    async def close(self) -> None:
        loop = asyncio.get_running_loop()
        if self._accepting is not None:
            self._accepting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._accepting
            self._accepting = None
        for sock in (self._tcp, self._udp, *self._replies.values()):
            if sock is not None:
                with contextlib.suppress(ValueError, OSError):
                    loop.remove_reader(sock.fileno())
                sock.close()
        self._tcp = self._udp = None
        self._replies.clear()
        if self._udp_paused is not None:
            self._udp_paused.cancel()
        if self._recording:
            await asyncio.gather(*self._recording, return_exceptions=True)
        if self.udp_refused:
            # What went past the cap (or again to a destination recorded) is one
            # event: a flood is on the record, not a count that dies with the run.
            error = EgressDenied(f"{self.udp_refused} more udp datagrams refused: only DNS "
                                 "leaves a run by UDP", policies=(UDP_RULE,))  # fmt: skip
            await self._record_udp("udp/*", error, {"protocol": "udp", "via": "transparent",
                                                    "unrecorded": self.udp_refused})  # fmt: skip
            self.udp_refused = 0
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)

    # -- UDP -------------------------------------------------------------------

    def _on_udp(self) -> None:
        assert self._udp is not None
        loop = asyncio.get_running_loop()
        if loop.time() - self._udp_second >= 1.0:
            self._udp_second, self._udp_read = loop.time(), 0
        for _ in range(64):  # a burst, then back to the loop
            if self._udp_read >= MAX_UDP_PER_SECOND:
                loop.remove_reader(self._udp.fileno())
                self._udp_paused = loop.call_at(self._udp_second + 1.0, self._resume_udp)
                return
            try:
                data, ancillary, _flags, source = self._udp.recvmsg(4096, 256)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return
            self._udp_read += 1
            destination = GuestNetwork.datagram_destination(ancillary)
            if destination is None:
                continue
            if destination[1] == 53:
                answer = dns_answer(data, self.pool)
                if answer is not None:
                    self._send_from(destination, source, answer)
            else:
                self._refuse_udp(destination)

    def _resume_udp(self) -> None:
        self._udp_paused = None
        if self._udp is not None:
            asyncio.get_running_loop().add_reader(self._udp.fileno(), self._on_udp)

    def _send_from(self, source: tuple[str, int], to: tuple[str, int], data: bytes) -> None:
        with contextlib.suppress(OSError):
            out = self._replies.get(source)
            if out is None:
                if len(self._replies) >= MAX_REPLY_SOCKETS:
                    return  # a run asking a new server each time gets no more answers
                out = self.network.reply_socket(source)
                out.setblocking(False)
                self._replies[source] = out
            out.sendto(data, to)

    def _refuse_udp(self, destination: tuple[str, int]) -> None:
        if destination in self.udp_recorded or len(self.udp_recorded) >= MAX_UDP_RECORDED:
            self.udp_refused += 1
            return
        self.udp_recorded.add(destination)
        address, port = destination
        resource = f"udp/{address}:{port}"
        error = EgressDenied(f"udp to {address}:{port} refused: only DNS leaves a run by UDP",
                             policies=(UDP_RULE,))  # fmt: skip
        task = asyncio.get_running_loop().create_task(
            self._record_udp(resource, error, {"address": address, "port": port,
                                               "protocol": "udp", "via": "transparent"})
        )  # fmt: skip
        self._recording.add(task)
        task.add_done_callback(self._recording.discard)

    async def _record_udp(self, resource: str, error: BrokerError, details: dict[str, Any]) -> None:
        with contextlib.suppress(BrokerError):
            await record_refusal(self.scope, Action.HTTP_REQUEST, resource, error, UDP_RULE,
                                 details)  # fmt: skip

    # -- TCP -------------------------------------------------------------------

    async def _accept(self, listener: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            conn, _ = await loop.sock_accept(listener)
            if len(self._tasks) >= self.max_connections:
                conn.close()  # over the run's connections: refused unread, like the socket's
                continue
            task = loop.create_task(self._connection(conn))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _connection(self, conn: socket.socket) -> None:
        try:
            address_text, port = GuestNetwork.original_destination(conn)
            address = ipaddress.IPv4Address(address_text)
            if str(address) == GuestNetwork.relay_address:
                conn.close()  # the relay itself: nothing here for the guest
                return
            peeked = await _peek(conn)
            reader, writer = await asyncio.open_connection(sock=conn, limit=64 * 1024)
        except OSError:
            conn.close()
            return
        name = self.pool.name(address) if address in NAME_RANGE else None
        origin = Origin(address, port, name, peeked, _protocol(peeked))
        if origin.protocol == "tls":
            complete, origin.sni = client_hello_sni(peeked)
            if not complete:
                origin.sni = UNREADABLE  # still coming when the wait ended
        elif origin.protocol == "http":
            origin.http_host = _http_host(peeked)
        from proctor.broker._pipeline import serve_kind  # it imports the kinds

        while True:
            call = Call(self.scope, reader, writer, None, proxy=self.proxy,
                        speaks_http=origin.protocol == "http", origin=origin)  # fmt: skip
            if not await self._admitted(call, origin, reader, writer):
                return
            await serve_kind(call, TRANSPARENT)
            if not call.keep_alive or writer.is_closing():
                return
            # The next request on a kept-alive connection: read, then decided and
            # recorded on its own, its Host held to the same name as the first's.
            head = await _next_head(reader)
            if head is None:
                writer.close()
                return
            origin = Origin(address, port, name, head, "http", http_host=_http_host(head),
                            head_read=True)  # fmt: skip

    async def _admitted(
        self,
        call: Call,
        origin: Origin,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
    ) -> bool:
        try:
            # A call, as each request on the run's socket is: charged to the run's
            # rate, its bound (limits.calls) and its tenant's ledger quota first.
            self.scope.admit_call()
        except BrokerError as exc:
            from proctor.broker._answer import refuse, send_error

            with contextlib.suppress(BrokerError, ConnectionError, OSError, EOFError):
                if not origin.head_read:
                    # The peeked bytes read first: closing on unread ones resets the
                    # answer away.
                    await reader.readexactly(len(origin.peeked))
                await (refuse(call, exc) if isinstance(exc, RateLimited | Exhausted)
                       else send_error(call, exc))  # fmt: skip
            writer.close()
            finished(call, refused=True)
            return False
        return True


#: How long a kept-alive redirected connection may sit idle between requests (the
#: run socket's first-byte timeout).
KEPT_IDLE = 10.0


async def _next_head(reader: asyncio.StreamReader) -> bytes | None:
    """A kept-alive connection's next request head, or None: the guest closed it,
    stayed silent past :data:`KEPT_IDLE`, or sent a head over the reader's limit."""
    try:
        return await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), KEPT_IDLE)
    except (TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError,
            ConnectionError, OSError):  # fmt: skip
        return None


async def _peek(conn: socket.socket) -> bytes:
    """The connection's first bytes, left unread (``MSG_PEEK``): a whole ClientHello
    or HTTP head if one comes in time, else what came within :data:`PEEK_WAIT` of
    silence (a protocol whose server speaks first sends nothing)."""
    loop = asyncio.get_running_loop()
    if not await _readable(conn, PEEK_WAIT):
        return b""
    deadline = loop.time() + 5.0
    while True:
        data = conn.recv(PEEK_BYTES, socket.MSG_PEEK)
        if not data or _whole(data) or loop.time() >= deadline:
            return data
        # The rest of a head is coming: look again shortly (the socket stays
        # readable while anything is unread, so waiting on it would spin).
        await asyncio.sleep(0.005)


def _whole(data: bytes) -> bool:
    """Whether ``data`` holds all there is to look at: a whole ClientHello, a whole
    HTTP head, or bytes that are neither."""
    if len(data) >= PEEK_BYTES:
        return True
    if data[:1] == b"\x16":
        return client_hello_sni(data)[0]
    if data[:1].isalpha():
        return b"\r\n\r\n" in data or b"\n\n" in data
    return True


async def _readable(conn: socket.socket, timeout: float) -> bool:
    try:
        await asyncio.wait_for(wait_ready(conn.fileno(), readable=True), timeout)
    except TimeoutError:
        return False
    return True


#: What a lenient server reads as an HTTP request though the strict reading does
#: not (empty lines or blanks first, runs of spaces or tabs, bare LF, any case),
#: and a first line still cut short when the wait ended ("GET / HT", "G", empty
#: lines alone). Both are read as HTTP, so the strict parser refuses them:
#: tunnelled as raw bytes, their Host would reach the upstream unchecked. So is a
#: first byte of a TLS record whatever follows it (the rest of a ClientHello sent
#: after the wait is still a ClientHello to the server).
_HTTP_LIKE: Final = re.compile(rb"[A-Za-z]+[ \t]+\S+[ \t]+HTTP/", re.IGNORECASE)
_LINE_START: Final = re.compile(rb"([A-Za-z]*)(?:[ \t]+\S*(?:[ \t]+\S*)?)?")
_METHODS: Final = (b"GET", b"HEAD", b"POST", b"PUT", b"DELETE", b"OPTIONS", b"PATCH", b"TRACE")


def _protocol(peeked: bytes) -> str:
    if peeked[:1] == b"\x16":
        return "tls"
    line = peeked.split(b"\r\n", 1)[0]
    parts = line.split(b" ")
    if len(parts) == 3 and parts[2].startswith(b"HTTP/1.") and parts[0].isalpha():
        return "http"
    rest = peeked.lstrip(b"\r\n \t")
    if _HTTP_LIKE.match(rest):
        return "http"
    cut = _LINE_START.fullmatch(rest) if peeked and b"\n" not in rest else None
    if cut is not None and any(m.startswith(cut[1].upper()) for m in _METHODS):
        return "http"
    return "tcp"


def _http_host(peeked: bytes) -> str | None:
    head_end = peeked.find(b"\r\n\r\n")
    if head_end < 0:
        return None
    for line in peeked[:head_end].split(b"\r\n")[1:]:
        key, _, value = line.partition(b":")
        if key.strip().lower() == b"host":
            return value.strip().decode("latin-1")
    return None


def _named(origin: Origin) -> tuple[Host, str | None]:
    """The host decided for ``origin``, and what the guest named in its first bytes."""
    if origin.address in NAME_RANGE:
        if origin.name is None:
            raise _Unknown(origin)
        host = parse_host(origin.name)
    else:
        host = parse_host(str(origin.address))
    named = origin.sni if origin.protocol == "tls" else origin.http_host
    return host, named


class _Unknown(Exception):
    def __init__(self, origin: Origin) -> None:
        self.origin = origin


def _mismatch(host: Host, named: str | None, port: int) -> str | None:
    """Why ``named`` (SNI or Host) is not the host decided, or None."""
    if named is None:
        return None
    if named == UNREADABLE:
        return "cannot be read"
    text = named
    if text.startswith("["):
        text = text[1 : text.find("]")] if "]" in text else text
    elif text.count(":") == 1:
        text, _, given = text.partition(":")
        if given.isdigit() and int(given) != port:
            return f"names port {given}, the connection is to {port}"
    try:
        other = parse_host(text)
    except BadCall:
        return f"names {named!r}, which is not a host"
    if other.name != host.name:
        return f"names {other.name}, the connection is to {host.name}"
    return None


@dataclass(frozen=True)
class TransparentRequest:
    origin: Origin
    host: Host
    #: Set for plain HTTP: forwarded as the proxy forwards absolute-form requests.
    forward: ForwardRequest | None = None
    #: The secrets bound to the host (TLS): injected as on a CONNECT.
    bindings: tuple[SecretBinding, ...] = ()
    #: Plain HTTP whose request lets the connection carry another (HTTP/1.1).
    persistent: bool = False


@dataclass(frozen=True)
class Transparent:
    """A connection the guest opened itself, redirected to the broker: a tunnel, or
    one plain-HTTP request; decided on the name its address stands for."""

    name: str = "egress.transparent"
    method: str = "-"
    path: str = "transparent"  # matched by no request on the socket (not a path)
    records_first: bool = True

    async def parse(self, call: Call) -> TransparentRequest | Ruling:
        origin = call.origin
        assert isinstance(origin, Origin)
        scope = call.scope
        target = f"{origin.address}:{origin.port}"
        try:
            host, named = _named(origin)
        except _Unknown:
            error = EgressDenied(
                f"http.request to {target} refused: {origin.address} is a DNS answer "
                "this run was never given", policies=(UNKNOWN_NAME_RULE,))  # fmt: skip
            return refused(scope, Action.HTTP_REQUEST, f"host/{target}", error,
                           _details(origin), UNKNOWN_NAME_RULE)  # fmt: skip
        except BadCall as exc:
            return bad_request(scope, "CONNECT", target, exc)
        why = _mismatch(host, named, origin.port)
        if why is not None:
            what = "SNI" if origin.protocol == "tls" else "Host"
            error = EgressDenied(
                f"http.request to {resource_of(host, origin.port)} refused: its {what} {why}",
                policies=(NAME_MISMATCH_RULE,))  # fmt: skip
            return refused(scope, Action.HTTP_REQUEST, resource_of(host, origin.port), error,
                           _details(origin), NAME_MISMATCH_RULE)  # fmt: skip
        if origin.protocol == "tls":
            return TransparentRequest(
                origin, host, None, tuple(bindings_for(scope, host, origin.port))
            )
        if origin.protocol != "http":
            return TransparentRequest(origin, host)
        return _forward_request(call, origin, host)

    async def decide(self, call: Call, request: TransparentRequest | Ruling) -> Ruling | None:
        if isinstance(request, Ruling):
            return request
        proxy = call.proxy
        assert proxy is not None
        origin = request.origin
        if request.forward is not None:
            fwd = request.forward
            ruling = await rule(call.scope, proxy.resolver, request.host, origin.port,
                                fwd.method, "http", fwd.origin.split("?", 1)[0])  # fmt: skip
        else:
            ruling = await rule(call.scope, proxy.resolver, request.host, origin.port,
                                "CONNECT", None, None, request.bindings)  # fmt: skip
        ruling.details.update(_details(origin))
        return ruling

    async def done(self, call: Call, request: object) -> None:
        return None

    async def act(self, call: Call, request: TransparentRequest, ruling: Ruling | None) -> Acted:
        proxy = call.proxy
        assert proxy is not None and ruling is not None
        assert call.reader is not None and call.writer is not None
        reader, writer = call.reader, call.writer
        admitted = admitted_of(ruling)
        fwd = request.forward
        outcome = Outcome(requests=1) if fwd is not None else Outcome()
        try:
            if fwd is not None:
                if not request.origin.head_read:
                    # The head was peeked, not read: read it off, so what is forwarded as
                    # the body (metered, hashed, scanned) is the body, not the head again.
                    await reader.readexactly(request.origin.peeked.find(b"\r\n\r\n") + 4)
                await proxy._forward(call.scope, admitted, fwd.method, fwd.origin, fwd.authority,
                                     fwd.headers, fwd.framing, reader, writer, outcome,
                                     request.persistent)  # fmt: skip
            elif (
                request.origin.peeked
                or request.bindings
                or rules_for(call.scope.egress_rules, request.host, request.origin.port)
            ):
                # As a CONNECT is carried (a tunnel by splice, or TLS ended with a
                # secret injected and request rules held): the checked first bytes
                # are still unread, for the upstream or the broker's TLS.
                connect = ConnectRequest(request.host, request.origin.port, list(request.bindings))
                await proxy.connect(call, connect, admitted, outcome)
            else:
                await _late_tunnel(proxy, call, request, admitted, outcome)
        finally:
            owed = await complete(call.scope, admitted, outcome)
        # A plain-HTTP response relayed whole on a connection both sides keep: the
        # guest's next request on it is a call of its own (_connection).
        call.keep_alive = (
            fwd is not None and outcome.kept and outcome.error is None and owed is None
        )
        return Acted(answer=owed, inside=outcome.inside)


def _details(origin: Origin) -> dict[str, Any]:
    out: dict[str, Any] = {"via": "transparent", "protocol": origin.protocol,
                           "original_address": str(origin.address)}  # fmt: skip
    if origin.sni is not None:
        out["sni"] = origin.sni[:255]
    if origin.http_host is not None:
        out["http_host"] = origin.http_host[:255]
    return out


def _forward_request(call: Call, origin: Origin, host: Host) -> TransparentRequest | Ruling:
    """A plain-HTTP connection's first request, read as the proxy reads one."""
    from proctor.broker._proxy import ForwardRequest, _persistent

    scope = call.scope
    end = origin.peeked.find(b"\r\n\r\n")
    try:
        if end < 0:
            raise BadCall("the request head is incomplete or too large")
        head = parse_request_head(origin.peeked[: end + 4])
        if not head.target.startswith("/"):
            raise BadCall("a request on a redirected connection must be origin-form")
        check_headers(head.headers)
        framing = request_framing(head.headers, head.method)
    except BadCall as exc:
        return bad_request(scope, "GET", f"{host.display}:{origin.port}", exc)
    authority = host.display if origin.port == 80 else f"{host.display}:{origin.port}"
    headers = [(k, v) for k, v in head.headers if k.lower() != "host"]
    fwd = ForwardRequest(head.method, host, origin.port, head.target, authority, headers, framing)
    return TransparentRequest(origin, host, fwd, persistent=_persistent(head))


async def _late_tunnel(
    proxy: EgressProxy,
    call: Call,
    request: TransparentRequest,
    admitted: Admitted,
    outcome: Outcome,
) -> None:
    """A connection that said nothing before it was decided (a server that speaks
    first, or a client slow to start its TLS), relayed as it is and still held to
    its name: its first bytes, when they come, are read whole and checked like a
    peeked ClientHello or HTTP head before any of them goes on
    (:func:`_first_flight`)."""
    assert call.reader is not None and call.writer is not None
    reader, writer = call.reader, call.writer
    try:
        up_reader, up_writer = await proxy._dial(admitted, None)
    except UpstreamFailed as exc:
        outcome.answer = exc
        return

    def abort() -> None:
        up_writer.transport.abort()
        writer.transport.abort()

    async def up() -> int:
        first = await _first_flight(reader)
        why = _late_mismatch(request, first)
        if why is not None:
            abort()
            outcome.error = why
            await _record_mismatch(call, request, first, why)
            return 0
        try:
            up_writer.write(first)
            await up_writer.drain()
        except (ConnectionError, OSError, RuntimeError):
            abort()
            return 0
        return len(first) + await _relay(reader, up_writer, abort)

    sent, received = await asyncio.gather(up(), _relay(up_reader, writer, abort))
    outcome.bytes_up, outcome.bytes_down = sent, received
    await _close(up_writer)


async def _first_flight(reader: asyncio.StreamReader) -> bytes:
    """The guest's first bytes: a whole ClientHello or HTTP head if they begin one
    (bounded by :data:`PEEK_BYTES` and 5 s), else the first read."""
    data = await reader.read(PEEK_BYTES)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 5.0
    while data and not _whole(data) and loop.time() < deadline:
        try:
            more = await asyncio.wait_for(reader.read(PEEK_BYTES - len(data)),
                                          deadline - loop.time())  # fmt: skip
        except TimeoutError:
            break
        if not more:
            break
        data += more
    return data


def _late_mismatch(request: TransparentRequest, first: bytes) -> str | None:
    """Why a late first flight names another host than the one decided, or None."""
    protocol = _protocol(first)
    if protocol == "tls":
        complete, named = client_hello_sni(first)
        named = named if complete else UNREADABLE
    elif protocol == "http":
        named = _strict_host(first)
    else:
        return None
    why = _mismatch(request.host, named, request.origin.port)
    return None if why is None else f"its {'SNI' if protocol == 'tls' else 'Host'} {why}"


def _strict_host(first: bytes) -> str | None:
    """The one Host of a whole head the strict parser reads; else :data:`UNREADABLE`.
    A late flight is relayed as it is, so a head a lenient server reads otherwise
    (bare LF, a second Host, cut short) would take it a name never checked."""
    end = first.find(b"\r\n\r\n")
    try:
        if end < 0:
            raise BadCall("the request head is incomplete")
        head = parse_request_head(first[: end + 4])
        check_headers(head.headers)
    except BadCall:
        return UNREADABLE
    hosts = [v for k, v in head.headers if k.lower() == "host"]
    return UNREADABLE if len(hosts) > 1 else (hosts[0] if hosts else None)


async def _record_mismatch(call: Call, request: TransparentRequest, first: bytes, why: str) -> None:
    resource = resource_of(request.host, request.origin.port)
    error = EgressDenied(f"http.request to {resource} refused: {why}",
                         policies=(NAME_MISMATCH_RULE,))  # fmt: skip
    late = Origin(request.origin.address, request.origin.port, request.origin.name, first,
                  _protocol(first))  # fmt: skip
    if late.protocol == "tls":
        late.sni = client_hello_sni(first)[1]
    else:
        late.http_host = _http_host(first)
    details = {**_details(late), "late": True}
    with contextlib.suppress(BrokerError):
        await record_refusal(call.scope, Action.HTTP_REQUEST, resource, error,
                             NAME_MISMATCH_RULE, details)  # fmt: skip


TRANSPARENT = register(Transparent())

__all__ = ["NAME_RANGE", "TRANSPARENT", "NamePool", "TransparentEgress", "client_hello_sni",
           "dns_answer"]  # fmt: skip
