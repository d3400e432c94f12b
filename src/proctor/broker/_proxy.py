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
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlsplit

from proctor.broker._admission import (
    Admitted,
    Outcome,
    RelayState,
    Resolver,
    admit,
    record_bad,
    record_refusal,
    resource_of,
    settle,
    system_resolver,
)
from proctor.broker._egress import Host, UpstreamFailed, parse_host, split_authority
from proctor.broker._http import (
    HOP_BY_HOP,
    TOKEN,
    Framing,
    check_headers,
    error_bytes,
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
    misplaced,
    placeholder_refusal,
    walk_scanned,
)
from proctor.broker._mitm import TenantCA, upstream_context
from proctor.broker._scope import BadCall, BrokerError, CallRefused, RunScope

__all__ = ["SECRET_BINDING_RULE", "EgressProxy", "Resolver", "system_resolver"]

# Tunnels read big: asyncio hands over up to 256 KiB per socket read, and
# fewer, larger writes keep a tunnel close to a direct connection's speed.
_TUNNEL_CHUNK = 1 << 20


class EgressProxy:
    """The egress proxy for every run of one runtime.

    ``ca_root`` holds one directory per tenant with that tenant's CA (needed
    only for credential injection). ``upstream_cafile`` is the bundle real
    upstreams are verified against when TLS is terminated (default: the
    system's). ``resolver`` exists for tests; production uses getaddrinfo.
    """

    def __init__(
        self,
        ca_root: Path | None = None,
        *,
        upstream_cafile: str | None = None,
        resolver: Resolver | None = None,
        connect_timeout: float = 10.0,
        response_timeout: float = 300.0,
    ) -> None:
        self.ca_root = ca_root
        self.upstream_cafile = upstream_cafile
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

    async def handle_connect(
        self,
        scope: RunScope,
        target: str,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
    ) -> None:
        """Answer one CONNECT: a tunnel, TLS termination with injection, or a refusal."""
        try:
            try:
                host_text, port = split_authority(target, None)
                host = parse_host(host_text)
            except BadCall as exc:
                await record_bad(scope, "CONNECT", target, exc)
                raise
            bindings = bindings_for(scope, host, port)
            admitted = await admit(
                scope, self.resolver, host, port, "CONNECT", None, None, bindings
            )
        except BrokerError as exc:
            await _send_error(writer, exc)
            return
        outcome = Outcome()
        try:
            if bindings:
                await self._injector.run(scope, admitted, bindings, reader, writer, outcome)
            else:
                await self._tunnel(admitted, reader, writer, outcome)
        finally:
            await _finish(scope, admitted, outcome, writer)

    async def _tunnel(
        self,
        admitted: Admitted,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        outcome: Outcome,
    ) -> None:
        try:
            up_reader, up_writer = await self._dial(admitted, None)
        except UpstreamFailed as exc:
            outcome.answer = exc
            return
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

        up, down = await asyncio.gather(
            _relay(reader, up_writer, abort), _relay(up_reader, writer, abort)
        )
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
    ) -> None:
        """Forward one plain-HTTP request (absolute form) and relay the response."""
        try:
            try:
                host, port, origin, authority = _parse_url(url)
                check_headers(headers)
                if not method or not set(method) <= TOKEN:
                    raise BadCall(f"invalid method {method!r}")
                framing = request_framing(headers, method)
            except BadCall as exc:
                await record_bad(scope, method, url, exc)
                raise
            # Placeholders in the head are refused before anything is decided
            # or dialed; injection happens only inside TLS (CONNECT).
            found = misplaced(scope.secrets.values(), [], method, url, headers)
            if found is not None:
                refusal = placeholder_refusal(scope, found[0], host, port, plain=True)
                await record_refusal(
                    scope, "secret.use", resource_of(host, port), refusal, SECRET_BINDING_RULE,
                    {"secret": found[0], "where": found[1]},
                )  # fmt: skip
                raise refusal
            path = origin.split("?", 1)[0]
            admitted = await admit(scope, self.resolver, host, port, method, "http", path)
        except BrokerError as exc:
            await _send_error(writer, exc)
            return
        outcome = Outcome(requests=1)
        try:
            await self._forward(
                scope, admitted, method, origin, authority, headers, framing, reader, writer,
                outcome,
            )  # fmt: skip
        finally:
            await _finish(scope, admitted, outcome, writer)

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
    ) -> None:
        """Send the request and relay the response; an error still to answer (after
        the completion event) is left in ``outcome.answer``."""
        try:
            up_reader, up_writer = await self._dial(admitted, None)
        except UpstreamFailed as exc:
            outcome.answer = exc
            return
        relay = RelayState()
        try:
            expect = any(
                k.lower() == "expect" and v.strip().lower() == "100-continue" for k, v in headers
            )
            if expect and framing.kind != "none":
                # We answer 100 ourselves and send the body at once, so the
                # client does not wait for an interim response that the
                # upstream would send to us.
                writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            out = forward_headers(headers, authority)
            head = serialize_head(f"{method} {origin} HTTP/1.1", out)
            up_writer.write(head)
            outcome.bytes_up = len(head)
            placeholders = {b.placeholder: b.name for b in scope.secrets.values()}

            async def put(data: bytes) -> None:
                outcome.bytes_up += len(data)
                up_writer.write(data)
                await up_writer.drain()

            try:
                await walk_scanned(reader, framing, placeholders, put)
            except PlaceholderFound as exc:
                up_writer.transport.abort()
                refusal = placeholder_refusal(
                    scope, exc.name, admitted.host, admitted.port, plain=True
                )
                await record_refusal(
                    scope, "secret.use", admitted.resource, refusal, SECRET_BINDING_RULE,
                    {"secret": exc.name, "where": "body"},
                )  # fmt: skip
                outcome.answer = refusal
                return
            await up_writer.drain()
            status, down = await _relay_response(up_reader, writer, method, relay)
            outcome.status, outcome.bytes_down = status, down
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
            if tls_name is None:
                return await asyncio.wait_for(
                    asyncio.open_connection(str(admitted.address), admitted.port),
                    self.connect_timeout,
                )
            return await asyncio.wait_for(
                asyncio.open_connection(
                    str(admitted.address),
                    admitted.port,
                    ssl=self._upstream_tls(),
                    server_hostname=tls_name,
                ),
                self.connect_timeout,
            )
        except ssl.SSLCertVerificationError as exc:
            raise UpstreamFailed(
                f"the certificate of {admitted.host.display} did not verify: "
                f"{exc.verify_message or exc.reason}"
            ) from exc
        except (OSError, ssl.SSLError, TimeoutError) as exc:
            what = "timed out" if isinstance(exc, TimeoutError) else type(exc).__name__
            raise UpstreamFailed(
                f"could not connect to {admitted.resource} ({admitted.address}): {what}"
            ) from exc


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
    up: asyncio.StreamReader, writer: asyncio.StreamWriter, method: str, relay: RelayState
) -> tuple[int, int]:
    """Relay the upstream's response (interim ones too); (final status, bytes relayed)."""
    total = 0
    while True:
        try:
            head = await up.readuntil(b"\r\n\r\n")
        except (asyncio.LimitOverrunError, asyncio.IncompleteReadError) as exc:
            raise UpstreamFailed("the upstream sent no valid response head") from exc
        first, status, headers = parse_response_head(head)
        framing = response_framing(method, status, headers)
        out = [(k, v) for k, v in headers if k.lower() not in HOP_BY_HOP - {"upgrade"}]
        if status >= 200:
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

        await walk_body(up, framing, put)
        await writer.drain()
        return status, total


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


async def _finish(
    scope: RunScope, admitted: Admitted, outcome: Outcome, writer: asyncio.StreamWriter
) -> None:
    """End a connection: the completion event goes first, as the record of any answer
    still owed (a 502 from dialing, say), then that answer."""
    answer = await settle(scope, admitted, outcome)
    if answer is not None:
        await _send_error(writer, answer)
    await _close(writer)


async def _send_error(writer: asyncio.StreamWriter, exc: BrokerError) -> None:
    try:
        writer.write(error_bytes(exc))
        await writer.drain()
    except (ConnectionError, OSError, RuntimeError):
        pass
    await _close(writer)


async def _close(writer: asyncio.StreamWriter) -> None:
    if writer.is_closing():
        return
    writer.close()
    with contextlib.suppress(ConnectionError, OSError, ssl.SSLError):
        await writer.wait_closed()
