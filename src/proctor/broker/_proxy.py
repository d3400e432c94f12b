"""The egress proxy: CONNECT tunnels and absolute-form HTTP, each admitted and recorded.

The orchestration of one connection: its target parsed, admitted
(:mod:`._admission`: decided, resolved, checked, decided again, recorded),
exactly the checked address dialed, and then one of three paths: a plain
tunnel, TLS terminated with a secret injected (:mod:`._inject`), or one
absolute-form HTTP request forwarded with its body framed strictly
(:mod:`._http`). The completion event is written before any answer the proxy
still owes the guest.

Redirects are the client's business: each hop is a new request through the
proxy, decided like the first.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from proctor.broker._admission import (
    Admitted,
    Outcome,
    RelayState,
    Resolver,
    bad_request,
    record_refusal,
    refused,
    resource_of,
    rule,
    system_resolver,
)
from proctor.broker._admission import admitted as admitted_of
from proctor.broker._calls import Acted, Call, Ruling, register
from proctor.broker._egress import Host, UpstreamFailed, parse_host, split_authority
from proctor.broker._http import (
    HOP_BY_HOP,
    TOKEN,
    Framing,
    RequestHead,
    check_headers,
    forward_headers,
    parse_response_head,
    request_framing,
    response_framing,
    serialize_head,
    walk_body,
)
from proctor.broker._inject import (
    SECRET_BINDING_RULE,
    Injector,
    PlaceholderFound,
    bindings_for,
    counting,
    forward_meter,
    misplaced,
    placeholder_refusal,
    record_rule_refusal,
    walk_scanned,
)
from proctor.broker._mitm import (
    CAFILE_TRUST,
    SYSTEM_TRUST,
    TenantCA,
    TrustLookup,
    UpstreamTrust,
    registered_trust,
    upstream_context,
)
from proctor.broker._record import complete
from proctor.broker._rules import Meter, ResponseCut, RuleRefused, rules_for
from proctor.broker._scope import BadCall, CallRefused, RunScope, SecretBinding
from proctor.broker._splice import relay_pair
from proctor.guest.protocol import TOKEN_HEADER
from proctor.ledger import Action

__all__ = ["SECRET_BINDING_RULE", "EgressProxy", "Resolver", "system_resolver"]

# Tunnels read big: asyncio hands over up to 256 KiB per socket read, and
# fewer, larger writes keep a tunnel close to a direct connection's speed.
_TUNNEL_CHUNK = 1 << 20


class EgressProxy:
    """The egress proxy for every run of one runtime.

    ``ca_root`` holds one directory per tenant with that tenant's CA (needed
    only for credential injection). ``upstream_cafile`` is the bundle real
    upstreams are verified against when TLS is terminated (default: the
    system's), except for a host whose tenant registered CA certificates for it
    (``upstream_trust``, ``(tenant, host)`` -> PEM or None): those alone.
    ``resolver`` exists for tests; production uses getaddrinfo.
    """

    def __init__(
        self,
        ca_root: Path | None = None,
        *,
        upstream_cafile: str | None = None,
        upstream_trust: TrustLookup | None = None,
        resolver: Resolver | None = None,
        connect_timeout: float = 10.0,
        response_timeout: float = 300.0,
    ) -> None:
        self.ca_root = ca_root
        self.upstream_cafile = upstream_cafile
        self.upstream_trust = upstream_trust
        self.resolver: Resolver = resolver or system_resolver
        self.connect_timeout = connect_timeout
        self.response_timeout = response_timeout
        self._cas: dict[str, TenantCA] = {}
        self._upstream_ctx: ssl.SSLContext | None = None
        self._injector = Injector(
            self._dial,
            lambda tenant, host: self.tenant_ca(tenant).server_context(host),
            connect_timeout=connect_timeout,
            response_timeout=response_timeout,
            trust=self._trust_for,
        )

    def tenant_ca(self, tenant: str) -> TenantCA:
        """The tenant's CA (created on first use); its ``ca_pem()`` goes into the sandbox."""
        ca = self._cas.get(tenant)
        if ca is None:
            if self.ca_root is None:
                raise UpstreamFailed("credential injection needs a CA directory (ca_root)")
            ca = TenantCA(self.ca_root / tenant, tenant)
            self._cas[tenant] = ca
        return ca

    def _upstream_tls(self) -> ssl.SSLContext:
        if self._upstream_ctx is None:
            self._upstream_ctx = upstream_context(self.upstream_cafile)
        return self._upstream_ctx

    def _trust_for(self, tenant: str, host: str) -> UpstreamTrust:
        pem = None if self.upstream_trust is None else self.upstream_trust(tenant, host)
        if pem is not None:
            return registered_trust(pem)
        label = SYSTEM_TRUST if self.upstream_cafile is None else CAFILE_TRUST
        return UpstreamTrust(self._upstream_tls(), label)

    async def handle_connect(
        self,
        scope: RunScope,
        target: str,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
    ) -> None:
        """Answer one CONNECT (a tunnel, TLS termination with injection, or a refusal)
        through the call pipeline: for a caller that read the head itself."""
        from proctor.broker._pipeline import serve_kind  # it imports this module

        head = RequestHead("CONNECT", target, "HTTP/1.1", [])
        await serve_kind(Call(scope, reader, writer, head, proxy=self), CONNECT)

    async def connect(
        self, call: Call, request: ConnectRequest, admitted: Admitted, outcome: Outcome
    ) -> None:
        """The act of an admitted CONNECT, or of a redirected connection whose first
        bytes were checked (``call.origin``: no CONNECT to answer, they are still
        in the reader): a tunnel, or TLS ended with a secret injected."""
        assert call.reader is not None and call.writer is not None
        answer_connect = call.origin is None
        # TLS is ended where a secret is injected or the host has request rules
        # (each request inside is then checked against them, ``_inject``).
        if request.bindings or rules_for(call.scope.egress_rules, admitted.host, admitted.port):
            await self._injector.run(
                call.scope, admitted, request.bindings, call.reader, call.writer, outcome,
                answer_connect=answer_connect,
            )  # fmt: skip
        else:
            await self._tunnel(admitted, call.reader, call.writer, outcome, answer_connect)

    async def _tunnel(
        self,
        admitted: Admitted,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        outcome: Outcome,
        answer_connect: bool = True,
    ) -> None:
        try:
            up_reader, up_writer = await self._dial(admitted, None)
        except UpstreamFailed as exc:
            outcome.answer = exc
            return
        if answer_connect:
            writer.write(b"HTTP/1.1 200 Connection Established\r\n\r\n")
            try:
                await writer.drain()
            except (ConnectionError, OSError):
                await _close(up_writer)
                outcome.error = "guest went away"
                return

        def abort() -> None:
            up_writer.transport.abort()
            writer.transport.abort()

        # Bytes the broker does not look at: moved by the kernel (splice).
        up, down = await relay_pair(reader, writer, up_reader, up_writer, abort, _relay)
        outcome.bytes_up, outcome.bytes_down = up, down
        await _close(up_writer)

    async def handle_forward(
        self,
        scope: RunScope,
        method: str,
        url: str,
        headers: list[tuple[str, str]],
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        *,
        persistent: bool = False,
    ) -> bool:
        """Forward one plain-HTTP/1.1 request (absolute form) through the call pipeline:
        for a caller that read the head itself. With ``persistent`` the connection is
        kept where the request and the upstream allow it; True if it was (the caller
        reads the next request off it, a call of its own), else it is closed."""
        from proctor.broker._pipeline import serve_kind  # it imports this module

        head = RequestHead(method, url, "HTTP/1.1", headers)
        call = Call(scope, reader, writer, head, proxy=self, persistent=persistent)
        await serve_kind(call, FORWARD)
        return call.keep_alive

    async def _forward(
        self,
        scope: RunScope,
        admitted: Admitted,
        method: str,
        origin: str,
        authority: str,
        headers: list[tuple[str, str]],
        framing: Framing,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        outcome: Outcome,
        persistent: bool = False,
    ) -> None:
        """Send the request and relay the response; an error still to answer (after
        the completion event) is left in ``outcome.answer``. ``persistent``: the
        guest's request lets its connection stay open; ``outcome.kept`` says whether
        it did (the response went out whole, framed by its own length)."""
        meter = forward_meter(scope, admitted, method, origin, outcome)
        try:
            up_reader, up_writer = await self._dial(admitted, None)
        except UpstreamFailed as exc:
            outcome.answer = exc
            return
        relay = RelayState(persistent=persistent)
        try:
            expect = any(
                k.lower() == "expect" and v.strip().lower() == "100-continue" for k, v in headers
            )
            if expect and framing.kind != "none":
                # We answer 100 ourselves and send the body at once, so the
                # client does not wait for an interim response that the
                # upstream would send to us.
                writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            out = forward_headers(headers, authority, keep=persistent)
            head = serialize_head(f"{method} {origin} HTTP/1.1", out)
            up_writer.write(head)
            outcome.bytes_up = len(head)
            placeholders = {b.placeholder: b.name for b in scope.secrets.values()}

            async def put(data: bytes) -> None:
                outcome.bytes_up += len(data)
                up_writer.write(data)
                await up_writer.drain()

            try:
                await walk_scanned(reader, framing, placeholders, put, also=counting(meter))
            except PlaceholderFound as exc:
                up_writer.transport.abort()
                refusal = placeholder_refusal(
                    scope, exc.name, admitted.host, admitted.port, plain=True
                )
                await record_refusal(
                    scope, Action.SECRET_USE, admitted.resource, refusal, SECRET_BINDING_RULE,
                    {"secret": exc.name, "where": "body"},
                )  # fmt: skip
                outcome.answer = refusal
                return
            await up_writer.drain()
            status, down = await _relay_response(up_reader, writer, method, relay, meter)
            outcome.kept = relay.kept
            outcome.status, outcome.bytes_down = status, down
            _answered(writer, relay)
        except (RuleRefused, ResponseCut) as exc:  # a bound of the host's request rules
            up_writer.transport.abort()  # the upstream has no whole request, or no more
            answer = await record_rule_refusal(scope, admitted, exc)
            outcome.error = exc.message if relay.started else None
            outcome.answer = None if relay.started else answer
        except (BadCall, UpstreamFailed) as exc:
            if relay.started:
                outcome.error = exc.message  # the guest has part of a response: no answer
            else:
                outcome.answer = exc
        except CallRefused as exc:
            outcome.answer = exc
        except (ConnectionError, OSError, asyncio.IncompleteReadError) as exc:
            outcome.error = f"connection lost: {type(exc).__name__}"
        finally:
            await _close(up_writer)

    async def _dial(
        self, admitted: Admitted, tls_name: str | None
    ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """Connect to exactly the checked address; with TLS verified for ``tls_name``."""
        try:
            # asyncio.timeout, not wait_for: no task of its own on every request's path.
            async with asyncio.timeout(self.connect_timeout):
                if tls_name is None:
                    return await asyncio.open_connection(str(admitted.address), admitted.port)
                return await asyncio.open_connection(
                    str(admitted.address),
                    admitted.port,
                    ssl=self._upstream_tls() if admitted.trust is None else admitted.trust.context,
                    server_hostname=tls_name,
                )
        except ssl.SSLCertVerificationError as exc:
            # The answer to the guest names this (``_http.error_bytes``): OpenSSL's
            # words and the name the guest asked for, nothing the upstream sent.
            raise UpstreamFailed(
                f"upstream certificate did not verify: {exc.verify_message or exc.reason} "
                f"({admitted.host.display})"
            ) from exc
        except (OSError, ssl.SSLError, TimeoutError) as exc:
            raise UpstreamFailed(
                f"could not connect to {admitted.resource} ({admitted.address}): "
                f"{dial_failure(exc)}"
            ) from exc


def dial_failure(exc: BaseException) -> str:
    """Why a connection could not be made, in a person's words (``connection refused``):
    what the guest's exception and ``runs show`` say, not an exception class."""
    if isinstance(exc, TimeoutError):
        return "timed out"
    if isinstance(exc, ssl.SSLError):
        return f"TLS handshake failed: {exc.reason or type(exc).__name__}"
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused"
    if isinstance(exc, ConnectionResetError):
        return "connection reset"
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror[:1].lower() + exc.strerror[1:]
    return type(exc).__name__


def _parse_url(url: str) -> tuple[Host, int, str, str]:
    """(host, port, origin-form target, Host header value) of an absolute http:// URL."""
    if any(c.isspace() or ord(c) < 0x20 or ord(c) == 0x7F for c in url):
        raise BadCall("invalid URL")
    try:
        parts = urlsplit(url)
    except ValueError as exc:  # an unbalanced or invalid [IPv6] authority
        raise BadCall(f"invalid URL: {exc}") from None
    if parts.scheme.lower() != "http":
        raise BadCall(
            f"absolute-form requests must be http:// (got {parts.scheme or 'none'!r}); "
            "HTTPS goes through CONNECT"
        )
    if "@" in parts.netloc:
        raise BadCall("credentials in the URL are not forwarded")
    host_text, port = split_authority(parts.netloc, 80)
    host = parse_host(host_text)
    origin = parts.path or "/"
    if not origin.startswith("/"):
        raise BadCall("invalid URL path")
    if parts.query:
        origin += "?" + parts.query
    authority = host.display if port == 80 else f"{host.display}:{port}"
    return host, port, origin, authority


async def _relay_response(
    up: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    method: str,
    relay: RelayState,
    meter: Meter | None = None,
) -> tuple[int, int]:
    """Relay the upstream's response (interim ones too); (final status, bytes relayed).
    Held to ``meter``: a body announced over its bound is withheld before its head, one
    that grows past it is cut before the piece that would pass it."""
    total = 0
    while True:
        try:
            head = await up.readuntil(b"\r\n\r\n")
        except (asyncio.LimitOverrunError, asyncio.IncompleteReadError) as exc:
            raise UpstreamFailed("the upstream sent no valid response head") from exc
        first, status, headers = parse_response_head(head)
        framing = response_framing(method, status, headers)
        announced = framing.kind == "length" and status >= 200
        if meter is not None and announced and (cut := meter.announce_response(framing.length)):
            raise meter.cut(cut, status)
        out = [(k, v) for k, v in headers if k.lower() not in HOP_BY_HOP - {"upgrade"}]
        # Kept alive only where the guest asked, the upstream would have kept it
        # (a redirected guest thinks it speaks to the upstream itself), and the
        # response ends by its own framing (not by the upstream closing), so the next
        # request's bytes are never read as this response's.
        keep = (
            relay.persistent
            and status != 101
            and framing.kind != "eof"
            and _upstream_keeps(first, headers)
        )
        if status >= 200 and not keep:
            out.append(("Connection", "close"))
        data = serialize_head(first, out)
        writer.write(data)
        relay.started = True
        total += len(data)
        if 100 <= status < 200 and status != 101:
            continue

        async def put(chunk: bytes) -> None:
            nonlocal total
            total += len(chunk)
            writer.write(chunk)
            await writer.drain()

        async def count(chunk: bytes, announced: bool = announced, status: int = status) -> None:
            assert meter is not None
            breach = meter.response(len(chunk), announced)[1]
            if breach is not None:
                raise meter.cut(breach, status)
            meter.digest_response(chunk)

        await walk_body(up, framing, put, payload=count if meter is not None else None)
        await writer.drain()
        relay.kept = keep
        return status, total


def _upstream_keeps(first: str, headers: list[tuple[str, str]]) -> bool:
    """Whether the upstream's response lets its connection carry another request
    (RFC 9112 section 9.3: HTTP/1.1 unless ``close``; HTTP/1.0 only with ``keep-alive``)."""
    tokens = {
        t.strip().lower() for k, v in headers if k.lower() == "connection" for t in v.split(",")
    }
    if first.startswith("HTTP/1.0"):
        return "keep-alive" in tokens
    return "close" not in tokens


async def _relay(
    src: asyncio.StreamReader, dst: asyncio.StreamWriter, abort: Callable[[], None]
) -> int:
    total = 0
    try:
        while data := await src.read(_TUNNEL_CHUNK):
            total += len(data)
            dst.write(data)
            await dst.drain()
        if dst.can_write_eof():
            dst.write_eof()
        else:
            dst.close()
    except (ConnectionError, OSError, RuntimeError):
        # One side failed: end the other too, or its read would wait forever.
        abort()
    return total


# -- answers to the guest -----------------------------------------------------


async def _close(writer: asyncio.StreamWriter) -> None:
    if writer.is_closing():
        return
    writer.close()
    with contextlib.suppress(ConnectionError, OSError, ssl.SSLError):
        await writer.wait_closed()


# -- the kinds: CONNECT and absolute-form HTTP ---------------------------------


@dataclass(frozen=True)
class ConnectRequest:
    host: Host
    port: int
    #: The secrets bound to the host: injected, and asked with the request.
    bindings: list[SecretBinding]


@dataclass(frozen=True)
class EgressRefused:
    """An egress call refused in its parse (a malformed target, a placeholder in the
    head): its ruling is recorded by the record stage, then raised."""

    ruling: Ruling


@dataclass(frozen=True)
class ForwardRequest:
    method: str
    host: Host
    port: int
    origin: str
    authority: str
    headers: list[tuple[str, str]]
    framing: Framing


def _proxy_of(call: Call) -> EgressProxy | None:
    """The proxy whose stages serve ``call`` (handed in where the broker is built:
    ``Handlers.for_proxy``), or None: the test's own handler does it all."""
    return call.proxy


async def _carry(
    call: Call, ruling: Ruling | None, act: Callable[[Admitted, Outcome], Awaitable[None]],
    outcome: Outcome,
) -> Acted:  # fmt: skip
    """Act on an admitted connection; the completion record is written however the
    act ends, before the answer it still owes (:class:`Acted` ``answer``)."""
    assert ruling is not None
    admitted = admitted_of(ruling)
    try:
        await act(admitted, outcome)
    finally:
        owed = await complete(call.scope, admitted, outcome)
    return Acted(answer=owed, inside=outcome.inside)


@dataclass(frozen=True)
class Connect:
    """``CONNECT host:port``: a blind tunnel, or TLS ended with a secret injected."""

    name: str = "egress.connect"
    method: str = "CONNECT"
    path: str = "authority"
    records_first: bool = True

    async def parse(self, call: Call) -> ConnectRequest | EgressRefused | None:
        assert call.head is not None
        if _proxy_of(call) is None:
            return None  # a handler of the broker's own (tests) does it all
        target, scope = call.head.target, call.scope
        try:
            host_text, port = split_authority(target, None)
            host = parse_host(host_text)
        except BadCall as exc:
            return EgressRefused(bad_request(scope, "CONNECT", target, exc))
        return ConnectRequest(host, port, bindings_for(scope, host, port))

    async def decide(
        self, call: Call, request: ConnectRequest | EgressRefused | None
    ) -> Ruling | None:
        proxy = _proxy_of(call)
        if isinstance(request, EgressRefused):
            return request.ruling
        if request is None or proxy is None:
            return None
        return await rule(call.scope, proxy.resolver, request.host, request.port,
                          "CONNECT", None, None, request.bindings)  # fmt: skip

    async def done(self, call: Call, request: object) -> None:
        return None

    async def act(self, call: Call, request: ConnectRequest | None, ruling: Ruling | None) -> Acted:
        proxy = _proxy_of(call)
        if request is None or proxy is None:
            assert call.handlers is not None and call.head is not None
            assert call.reader is not None and call.writer is not None
            await call.handlers.connect(call.scope, call.head.target, call.reader, call.writer)
            return Acted()

        async def carry(admitted: Admitted, outcome: Outcome) -> None:
            await proxy.connect(call, request, admitted, outcome)

        return await _carry(call, ruling, carry, Outcome())


@dataclass(frozen=True)
class Forward:
    """``GET http://host/path`` (absolute form, any method): one plain-HTTP request."""

    name: str = "egress.forward"
    method: str = "*"
    path: str = "absolute-form"
    records_first: bool = True

    async def parse(self, call: Call) -> ForwardRequest | EgressRefused | None:
        assert call.head is not None
        if _proxy_of(call) is None:
            return None
        scope, head = call.scope, call.head
        method, url = head.method, head.target
        headers = head.without(TOKEN_HEADER, "Proxy-Authorization", "Proxy-Connection")
        try:
            host, port, origin, authority = _parse_url(url)
            check_headers(headers)
            if not method or not set(method) <= TOKEN:
                raise BadCall(f"invalid method {method!r}")
            framing = request_framing(headers, method)
        except BadCall as exc:
            return EgressRefused(bad_request(scope, method, url, exc))
        # Placeholders in the head are refused before anything is decided
        # or dialed; injection happens only inside TLS (CONNECT).
        found = misplaced(scope.secrets.values(), [], method, url, headers)
        if found is not None:
            refusal = placeholder_refusal(scope, found[0], host, port, plain=True)
            return EgressRefused(refused(
                scope, Action.SECRET_USE, resource_of(host, port), refusal,
                {"secret": found[0], "where": found[1]}, SECRET_BINDING_RULE,
            ))  # fmt: skip
        return ForwardRequest(method, host, port, origin, authority, headers, framing)

    async def decide(
        self, call: Call, request: ForwardRequest | EgressRefused | None
    ) -> Ruling | None:
        proxy = _proxy_of(call)
        if isinstance(request, EgressRefused):
            return request.ruling
        if request is None or proxy is None:
            return None
        path = request.origin.split("?", 1)[0]
        return await rule(call.scope, proxy.resolver, request.host, request.port,
                          request.method, "http", path)  # fmt: skip

    async def done(self, call: Call, request: object) -> None:
        return None

    async def act(self, call: Call, request: ForwardRequest | None, ruling: Ruling | None) -> Acted:
        proxy = _proxy_of(call)
        assert call.reader is not None and call.writer is not None and call.head is not None
        reader, writer = call.reader, call.writer
        if request is None or proxy is None:
            assert call.handlers is not None
            head = call.head
            headers = head.without(TOKEN_HEADER, "Proxy-Authorization", "Proxy-Connection")
            await call.handlers.forward(call.scope, head.method, head.target, headers,
                                        reader, writer)  # fmt: skip
            return Acted()
        req = request

        persistent = call.persistent and _persistent(call.head)
        outcome = Outcome(requests=1)

        async def carry(admitted: Admitted, outcome: Outcome) -> None:
            await proxy._forward(
                call.scope, admitted, req.method, req.origin, req.authority, req.headers,
                req.framing, reader, writer, outcome, persistent,
            )  # fmt: skip

        acted = await _carry(call, ruling, carry, outcome)
        call.keep_alive = outcome.kept and outcome.error is None and acted.answer is None
        return acted


def _answered(writer: asyncio.StreamWriter, relay: RelayState) -> None:
    """The answer is whole: unless the connection is kept for the next request, the
    guest sees its end now, not after the completion record (the one write left on
    the call's path, in the next group commit)."""
    if not relay.kept and writer.can_write_eof():
        with contextlib.suppress(ConnectionError, OSError, RuntimeError):
            writer.write_eof()


def _persistent(head: RequestHead) -> bool:
    """Whether the guest's request lets its connection carry another (HTTP/1.1 and
    no ``close`` in its Connection or Proxy-Connection header)."""
    if head.version != "HTTP/1.1":
        return False
    return not any(
        key.lower() in ("connection", "proxy-connection")
        and "close" in (t.strip().lower() for t in value.split(","))
        for key, value in head.headers
    )


CONNECT = register(Connect())
FORWARD = register(Forward())
