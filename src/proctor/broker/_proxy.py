"""The egress proxy: CONNECT tunnels and absolute-form HTTP, each decided and recorded.

Order of a connection, and why:

1. Cedar decides ``http.request`` on the host *name* the guest asked for,
   before any DNS lookup, so a denied name never reaches a resolver (names
   are a way to smuggle data out through DNS).
2. The name is resolved once; every address is unmapped and checked against
   the special-purpose registries (:mod:`._egress`), and Cedar decides again
   with the address in the context, so a forbid on an address range applies.
3. The decision event is appended; if the ledger cannot record it, the call
   is refused (503) and no connection is made.
4. Exactly the checked address is dialed: no second lookup, so a DNS answer
   that changes between check and use (rebinding) changes nothing.
5. A completion event (bytes each way, duration, status) follows.

Redirects are the client's business: each hop is a new request through the
proxy, decided like the first.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import ipaddress
import json
import logging
import socket
import ssl
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote, quote_plus, urlsplit

from proctor.broker._egress import (
    SPECIAL_ADDRESS_RULE,
    EgressDenied,
    Host,
    IPAddress,
    UpstreamFailed,
    check_address,
    host_matches,
    parse_host,
    split_authority,
    unmap,
)
from proctor.broker._http import (
    HOP_BY_HOP,
    MAX_HEAD,
    TOKEN,
    Framing,
    Source,
    check_headers,
    error_bytes,
    forward_headers,
    parse_request_head,
    parse_response_head,
    request_framing,
    response_framing,
    response_headers,
    serialize_head,
    walk_body,
)
from proctor.broker._mitm import CAError, TenantCA, TlsStream, upstream_context
from proctor.broker._scope import (
    BadCall,
    BrokerError,
    CallRefused,
    RateLimited,
    RunScope,
    SecretBinding,
)
from proctor.policy import CedarValue, Decision, Entity, EntityRef, IpAddr

log = logging.getLogger("proctor.broker.egress")

#: The rule named when a secret's placeholder is sent where the secret is not bound.
SECRET_BINDING_RULE = "proctor:secret:bound-hosts"  # noqa: S105 - a rule id, not a secret
#: The rule named when an upstream's response carries an injected secret's value back.
ECHO_RULE = "proctor:secret:echo"

Resolver = Callable[[str, int], Awaitable[list[IPAddress]]]

# Tunnels read big: asyncio hands over up to 256 KiB per socket read, and
# fewer, larger writes keep a tunnel close to a direct connection's speed.
_TUNNEL_CHUNK = 1 << 20


async def system_resolver(name: str, port: int) -> list[IPAddress]:
    """Every address ``getaddrinfo`` gives for ``name``, in its order, once each."""
    loop = asyncio.get_running_loop()
    try:
        infos = await loop.getaddrinfo(
            name, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP
        )
    except (socket.gaierror, UnicodeError) as exc:
        raise UpstreamFailed(f"could not resolve {name}: {exc}") from exc
    out: list[IPAddress] = []
    for _family, _type, _proto, _canon, sockaddr in infos:
        text = str(sockaddr[0]).split("%", 1)[0]
        address = unmap(ipaddress.ip_address(text))
        if address not in out:
            out.append(address)
    if not out:
        raise UpstreamFailed(f"could not resolve {name}: no addresses")
    return out


@dataclass
class _Admitted:
    """A connection the policy and the address check let through, recorded."""

    host: Host
    port: int
    address: IPAddress
    decision: Decision
    seq: int
    resource: str
    started: float = field(default_factory=time.monotonic)


@dataclass
class _Outcome:
    bytes_up: int = 0
    bytes_down: int = 0
    status: int | None = None
    requests: int = 0
    error: str | None = None
    injected: tuple[str, ...] = ()
    answer: BrokerError | None = None  # the error still to answer, after the event
    answered: int | None = None  # the status of the proxy's own answer, if it gave one
    completed: bool = False


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

    # -- CONNECT ------------------------------------------------------------

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
                await _record_bad(scope, "CONNECT", target, exc)
                raise
            bindings = _bindings(scope, host, port)
            admitted = await self._admit(scope, host, port, "CONNECT", None, None)
        except BrokerError as exc:
            await _send_error(writer, exc)
            return
        outcome = _Outcome()
        try:
            if bindings:
                await self._inject(scope, admitted, bindings, reader, writer, outcome)
            else:
                await self._tunnel(admitted, reader, writer, outcome)
        finally:
            # The completion event goes first: it is the record of any answer that
            # follows (a 502 from dialing, say).
            answer = await _settle(scope, admitted, outcome)
            if answer is not None:
                await _send_error(writer, answer)
            await _close(writer)

    async def _tunnel(
        self,
        admitted: _Admitted,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        outcome: _Outcome,
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

    async def _inject(
        self,
        scope: RunScope,
        admitted: _Admitted,
        bindings: list[SecretBinding],
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        outcome: _Outcome,
    ) -> None:
        host = admitted.host
        try:
            for binding in bindings:
                ref = EntityRef.secret(scope.tenant, binding.name)
                await scope.decide_and_record(
                    "secret.use",
                    ref,
                    f"secret/{binding.name}",
                    {"host": host.name},
                    details={"secret": binding.name, "host": host.name, "port": admitted.port},
                    entities=(Entity.in_tenant(ref, scope.tenant),),
                )
            try:
                server_ctx = self.tenant_ca(scope.tenant).server_context(host.name)
            except CAError as exc:
                raise UpstreamFailed(f"the tenant CA cannot be used: {exc.message}") from exc
            # The first upstream connection is made before the guest is answered, so
            # that an unreachable host or a certificate that does not verify is a 502
            # to the CONNECT itself. It carries the first request and no other.
            first = await self._dial(admitted, host.name)
        except BrokerError as exc:
            outcome.answer = exc
            return
        outcome.injected = tuple(b.name for b in bindings)
        writer.write(b"HTTP/1.1 200 Connection Established\r\n\r\n")
        guest = TlsStream(reader, writer, server_ctx, server_side=True)
        try:
            await writer.drain()
            await asyncio.wait_for(guest.handshake(), self.connect_timeout)
        except (ssl.SSLError, ConnectionError, OSError, TimeoutError) as exc:
            # Usually a guest that does not trust the tenant CA.
            outcome.error = f"guest TLS handshake failed: {type(exc).__name__}"
            first[1].transport.abort()
            return
        outcome.answer = await self._inject_loop(scope, admitted, bindings, guest, first, outcome)
        # Inside TLS, the answer is sent here, after the completion event that records it.
        answer = await _settle(scope, admitted, outcome)
        if answer is not None:
            await _send_error_tls(guest, answer)
        await guest.close()

    async def _inject_loop(
        self,
        scope: RunScope,
        admitted: _Admitted,
        bindings: list[SecretBinding],
        guest: TlsStream,
        first: tuple[asyncio.StreamReader, asyncio.StreamWriter],
        outcome: _Outcome,
    ) -> BrokerError | None:
        """Forward the guest's requests one at a time, each on an upstream connection of
        its own, until the guest is done (None) or a refusal (the error to answer).

        One upstream connection per injected request, never reused: bytes the
        upstream reads differently from us (a body it leaves unread, read as a
        request of its own) find nothing after them on that connection, neither
        the next request's secret nor anything of the guest's.
        """
        host = admitted.host
        authority = {host.display, f"{host.display}:{admitted.port}"}
        needles = _echo_needles(bindings)
        upstream: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = first
        try:
            while True:
                try:
                    head = await guest.readuntil(b"\r\n\r\n", MAX_HEAD)
                except asyncio.IncompleteReadError:
                    return None
                except asyncio.LimitOverrunError:
                    return await _record_tunnel_refusal(
                        scope, admitted, BadCall("request head too large"), "?"
                    )
                method = "?"
                try:
                    if outcome.requests:
                        # The CONNECT was charged as one call; each further request is one too.
                        scope.admit_call()
                    parsed = parse_request_head(head)
                    method, target, headers = parsed.method, parsed.target, parsed.headers
                    framing = _check_injected_head(
                        scope, admitted, bindings, authority, method, target, headers
                    )
                except RateLimited as exc:
                    return exc  # counted, recorded in the run's broker.rate_limited events
                except BrokerError as exc:
                    return await _record_tunnel_refusal(scope, admitted, exc, method)
                if upstream is None:
                    try:
                        upstream = await self._dial(admitted, host.name)
                    except UpstreamFailed as exc:
                        return exc
                conn, upstream = upstream, None
                answer, more = await self._exchange(
                    scope, admitted, bindings, needles, guest, conn,
                    (method, target, headers, framing), outcome,
                )  # fmt: skip
                if answer is not None or not more:
                    return answer
        finally:
            if upstream is not None:
                upstream[1].transport.abort()

    async def _exchange(
        self,
        scope: RunScope,
        admitted: _Admitted,
        bindings: list[SecretBinding],
        needles: list[tuple[bytes, str]],
        guest: TlsStream,
        conn: tuple[asyncio.StreamReader, asyncio.StreamWriter],
        request: tuple[str, str, list[tuple[str, str]], Framing],
        outcome: _Outcome,
    ) -> tuple[BrokerError | None, bool]:
        """One injected request and its response: (the error to answer, whether the
        guest's connection may carry another request)."""
        up_reader, up_writer = conn
        method, target, headers, framing = request
        relay = _RelayState()
        head = serialize_head(f"{method} {target} HTTP/1.1", _inject_headers(headers, bindings))
        up_writer.write(head)
        outcome.requests += 1
        outcome.bytes_up += len(head)
        placeholders = {b.placeholder: b.name for b in scope.secrets.values()}
        body = asyncio.create_task(_send_body(guest, up_writer, framing, placeholders, outcome))
        response = asyncio.create_task(
            _relay_injected(up_reader, guest, method, needles, outcome, relay,
                            self.response_timeout)
        )  # fmt: skip
        try:
            pending: set[asyncio.Task[Any]] = {body, response}
            while pending:
                _, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                if response.done() or (body.done() and body.exception() is not None):
                    break
            failed = body.exception() if body.done() else None
            if isinstance(failed, (ConnectionError, OSError)):
                # The upstream stopped reading: it may still have answered.
                await asyncio.wait({response})
                failed = None
            if failed is not None:
                response.cancel()
                up_writer.transport.abort()
                if isinstance(failed, _PlaceholderFound):
                    failed = _misplaced_refusal(scope, admitted, bindings, failed.name, "body")
                if not isinstance(failed, BrokerError):
                    return None, False  # the guest went away mid-body
                answer = await _record_tunnel_refusal(scope, admitted, failed, method)
                return (None if relay.started else answer), False
            error = response.exception()
            if isinstance(error, _EchoFound):
                error = _echo_refusal(admitted, error.name, error.where)
            if error is not None:
                up_writer.transport.abort()
                if isinstance(error, BrokerError):
                    answer = await _record_tunnel_refusal(scope, admitted, error, method)
                    if not relay.started:
                        return answer, False
                outcome.error = f"upstream failed: {type(error).__name__}"
                return None, False
            # Whatever of the body the upstream did not take before answering is
            # still in the guest's stream: the next request would start inside it.
            more: bool = response.result() and body.done()
            return None, more
        finally:
            for task in (body, response):
                task.cancel()
            await asyncio.gather(body, response, return_exceptions=True)
            up_writer.close()

    # -- absolute-form HTTP -------------------------------------------------

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
                await _record_bad(scope, method, url, exc)
                raise
            # Placeholders in the head are refused before anything is decided
            # or dialed; injection happens only inside TLS (CONNECT).
            found = _misplaced(scope.secrets.values(), [], method, url, headers)
            if found is not None:
                refusal = _placeholder_refusal(scope, found[0], host, port, plain=True)
                await _record_refusal(
                    scope, "secret.use", _resource(host, port), refusal, SECRET_BINDING_RULE,
                    {"secret": found[0], "where": found[1]},
                )  # fmt: skip
                raise refusal
            path = origin.split("?", 1)[0]
            admitted = await self._admit(scope, host, port, method, "http", path)
        except BrokerError as exc:
            await _send_error(writer, exc)
            return
        outcome = _Outcome(requests=1)
        try:
            await self._forward(
                scope, admitted, method, origin, authority, headers, framing, reader, writer,
                outcome,
            )  # fmt: skip
        finally:
            answer = await _settle(scope, admitted, outcome)
            if answer is not None:
                await _send_error(writer, answer)
            await _close(writer)

    async def _forward(
        self,
        scope: RunScope,
        admitted: _Admitted,
        method: str,
        origin: str,
        authority: str,
        headers: list[tuple[str, str]],
        framing: Framing,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        outcome: _Outcome,
    ) -> None:
        """Send the request and relay the response; an error still to answer (after
        the completion event) is left in ``outcome.answer``."""
        try:
            up_reader, up_writer = await self._dial(admitted, None)
        except UpstreamFailed as exc:
            outcome.answer = exc
            return
        relay = _RelayState()
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
                await _walk_scanned(reader, framing, placeholders, put)
            except _PlaceholderFound as exc:
                up_writer.transport.abort()
                refusal = _placeholder_refusal(
                    scope, exc.name, admitted.host, admitted.port, plain=True
                )
                await _record_refusal(
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

    # -- deciding, checking, dialing ----------------------------------------

    async def _admit(
        self,
        scope: RunScope,
        host: Host,
        port: int,
        method: str,
        scheme: str | None,
        path: str | None,
    ) -> _Admitted:
        """Decide, resolve once, check, decide with the address, record. Raises on refusal."""
        resource = _resource(host, port)
        context: dict[str, CedarValue] = {"method": method, "port": port}
        if scheme is not None:
            context["scheme"] = scheme
        if path is not None:
            context["path"] = path
        details: dict[str, Any] = {"host": host.name, "port": port, "method": method}
        if scheme is not None:
            details["scheme"] = scheme
        if path is not None:
            details["path"] = path[:512]
        if host.address is not None:
            context["address"] = IpAddr(str(host.address))
            details["address"] = str(host.address)
        try:
            entities = (Entity.host(host.name),)
            ref = EntityRef.host(host.name)
        except Exception as exc:  # PolicyError: a name Cedar's side refuses
            bad = BadCall(f"invalid host {host.name!r}")
            await _record_bad(scope, method, host.name, bad)
            raise bad from exc
        decision = scope.decide("http.request", ref, context, entities)
        if not decision.allowed:
            reason = decision.reason
            await scope.record("http.request", resource, decision, reason=reason, details=details)
            raise EgressDenied(f"http.request to {resource} {reason}", policies=decision.policies)

        if host.address is not None:
            addresses = [host.address]
        else:
            try:
                addresses = await self.resolver(host.name, port)
            except UpstreamFailed as exc:
                details["error"] = exc.message
                await scope.record(
                    "http.request",
                    resource,
                    decision,
                    reason=decision.reason + "; not resolved",
                    details=details,
                )
                raise
            details["resolved"] = [str(a) for a in addresses]

        for address in addresses:
            refusal = check_address(address, scope.allowed_ranges)
            if refusal is not None:
                details["address"] = str(refusal.address)
                details["special_ranges"] = [cidr for cidr, _ in refusal.ranges]
                details["permitted_by"] = list(decision.policies)
                denied = Decision(False, (SPECIAL_ADDRESS_RULE,), decision.version)
                reason = f"refused: {refusal.reason}"
                await scope.record("http.request", resource, denied, reason=reason, details=details)
                raise EgressDenied(
                    f"http.request to {resource} refused: {host.name} is or resolves to "
                    f"{refusal.address}, a special-purpose address ({refusal.ranges[0][1]})",
                    policies=(SPECIAL_ADDRESS_RULE,),
                )

        address = addresses[0]
        details["address"] = str(address)
        if host.address is None:
            # Again with the address known, so forbids on address ranges apply.
            context["address"] = IpAddr(str(address))
            decision = scope.decide("http.request", ref, context, entities)
        reason = decision.reason
        appended = await scope.record(
            "http.request", resource, decision, reason=reason, details=details
        )
        if not decision.allowed:
            raise EgressDenied(f"http.request to {resource} {reason}", policies=decision.policies)
        return _Admitted(host, port, address, decision, appended.seq, resource)

    async def _dial(
        self, admitted: _Admitted, tls_name: str | None
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


# -- events -------------------------------------------------------------------


def _resource(host: Host, port: int) -> str:
    return f"host/{host.display}:{port}"


async def _record_bad(scope: RunScope, method: str, target: str, exc: BadCall) -> None:
    """A malformed request is recorded too; raises CallRefused if it cannot be."""
    shown = target[:256].encode("ascii", "backslashreplace").decode()
    await scope.record(
        "http.request",
        f"host/{shown}",
        Decision(False, (), scope.policies.version),
        reason=f"refused: {exc.message}",
        details={"method": method[:32], "target": shown},
    )


async def _record_refusal(
    scope: RunScope,
    action: str,
    resource: str,
    exc: BrokerError,
    rule: str,
    details: Mapping[str, Any] | None = None,
) -> None:
    try:
        await scope.record(
            action,
            resource,
            Decision(False, (rule,), scope.policies.version),
            reason=f"refused: {exc.message}",
            details=details or {},
        )
    except CallRefused as refused:
        raise refused from exc


def _placeholder_refusal(
    scope: RunScope, name: str, host: Host, port: int, *, plain: bool = False
) -> EgressDenied:
    binding = scope.secrets.get(name)
    bound = binding is not None and any(host_matches(h, host, port) for h in binding.hosts)
    if bound and plain:
        message = (
            f"the placeholder of secret {name!r} was sent over plain HTTP; "
            "secrets are injected only inside TLS (use https)"
        )
    else:
        message = f"the placeholder of secret {name!r} was sent to {host.display}, " + (
            "which it is not bound to"
        )
    return EgressDenied(message, policies=(SECRET_BINDING_RULE,))


async def _complete(scope: RunScope, admitted: _Admitted, outcome: _Outcome) -> bool:
    """The completion event. The call already happened, so a failure here is logged
    (and the caller answers ``not_recorded`` instead of an error it still owed)."""
    details: dict[str, Any] = {
        "decision_seq": admitted.seq,
        "host": admitted.host.name,
        "port": admitted.port,
        "address": str(admitted.address),
        "bytes_up": outcome.bytes_up,
        "bytes_down": outcome.bytes_down,
        "duration_ms": round((time.monotonic() - admitted.started) * 1000, 3),
        "requests": outcome.requests,
    }
    if outcome.status is not None:
        details["status"] = outcome.status
    if outcome.injected:
        details["secrets"] = list(outcome.injected)
    if outcome.error is not None:
        details["error"] = outcome.error
    if outcome.answered is not None:
        details["answered"] = outcome.answered
    try:
        await scope.record(
            "http.request.end",
            admitted.resource,
            admitted.decision,
            reason="closed" if outcome.error is None else "failed",
            details=details,
        )
    except CallRefused as exc:
        log.error("egress completion event for %s not recorded: %s", admitted.resource, exc)
        return False
    return True


# -- secrets ------------------------------------------------------------------


def _bindings(scope: RunScope, host: Host, port: int) -> list[SecretBinding]:
    return [b for b in scope.secrets.values() if any(host_matches(h, host, port) for h in b.hosts)]


def _inject_headers(
    headers: list[tuple[str, str]], bindings: list[SecretBinding]
) -> list[tuple[str, str]]:
    """The guest's headers, with the bound headers set from their templates.

    Nothing is replaced anywhere else: a placeholder outside its bound header
    was refused before this (:func:`_misplaced`). The upstream is asked for an
    uncoded response, the only kind the echo check can read, and to close the
    connection after it (it carries this request alone).
    """
    replaced = {b.header.lower() for b in bindings}
    named = {
        token.strip().lower()
        for k, v in headers
        if k.lower() in ("connection", "proxy-connection")
        for token in v.split(",")
    } - {"host"}
    out = []
    for name, value in headers:
        lower = name.lower()
        if (
            lower in replaced
            or lower in HOP_BY_HOP
            or lower in named
            or lower.startswith("proxy-")
            or lower == "accept-encoding"
        ):
            continue
        out.append((name, value))
    out.append(("Accept-Encoding", "identity"))
    # str.replace, not format(): a template is data, not a format string.
    out.extend((b.header, b.template.replace("{secret}", b.value)) for b in bindings)
    out.append(("Connection", "close"))
    return out


def _misplaced(
    secrets: Iterable[SecretBinding],
    bindings: list[SecretBinding],
    method: str,
    target: str,
    headers: list[tuple[str, str]],
) -> tuple[str, str] | None:
    """(secret, where) of the first placeholder outside the header its secret is bound
    to on this connection, or None. Header names count: ``name:value`` is searched."""
    bound = {(b.name, b.header.lower()) for b in bindings}
    for secret in secrets:
        placeholder = secret.placeholder
        if placeholder in f"{method} {target}":
            return secret.name, "request line"
        for name, value in headers:
            if placeholder in f"{name}:{value}" and (
                placeholder in name or (secret.name, name.lower()) not in bound
            ):
                return secret.name, f"header {_shown_name(name)}"
    return None


def _shown_name(name: str) -> str:
    return name if len(name) <= 64 else name[:61] + "..."


def _check_injected_head(
    scope: RunScope,
    admitted: _Admitted,
    bindings: list[SecretBinding],
    authority: set[str],
    method: str,
    target: str,
    headers: list[tuple[str, str]],
) -> Framing:
    """Everything a request in an injected tunnel must be, before a byte goes upstream."""
    host = admitted.host
    if not target.startswith("/") and not (method == "OPTIONS" and target == "*"):
        raise BadCall("only origin-form requests may follow CONNECT")
    if "upgrade" in {k.lower() for k, _ in headers}:
        raise BadCall("protocol upgrades are not supported where a secret is injected")
    hosts = [v.strip().lower() for k, v in headers if k.lower() == "host"]
    # The Host header picks the virtual host behind the address we verified; a
    # different one would carry the secret elsewhere on a shared front end
    # (domain fronting).
    if len(hosts) != 1 or hosts[0] not in authority:
        raise EgressDenied(
            f"the Host header must name {host.display}, the host the secret is bound to",
            policies=(SECRET_BINDING_RULE,),
        )
    found = _misplaced(scope.secrets.values(), bindings, method, target, headers)
    if found is not None:
        raise _misplaced_refusal(scope, admitted, bindings, *found)
    return request_framing(headers, method)


class _Misplaced(EgressDenied):
    """A secret's placeholder where the secret is not bound (recorded as secret.use)."""

    def __init__(self, message: str, details: dict[str, Any]) -> None:
        super().__init__(message, policies=(SECRET_BINDING_RULE,))
        self.details = details


class _Echoed(UpstreamFailed):
    """The upstream sent an injected secret back (recorded as secret.use)."""

    def __init__(self, message: str, details: dict[str, Any]) -> None:
        super().__init__(message, policies=(ECHO_RULE,))
        self.details = details


def _misplaced_refusal(
    scope: RunScope, admitted: _Admitted, bindings: list[SecretBinding], name: str, where: str
) -> _Misplaced:
    host = admitted.host
    binding = next((b for b in bindings if b.name == name), None)
    if binding is None:
        message = (
            f"the placeholder of secret {name!r} was sent to {host.display}, "
            "which it is not bound to"
        )
    else:
        message = (
            f"the placeholder of secret {name!r} was sent in the {where}; it is replaced "
            f"only in {binding.header}, the header the secret is bound to"
        )
    details = {"secret": name, "where": where, "host": host.name, "port": admitted.port}
    return _Misplaced(message, details)


async def _record_tunnel_refusal(
    scope: RunScope, admitted: _Admitted, exc: BrokerError, method: str
) -> BrokerError:
    """Record why a request inside an injected tunnel is refused, before it is answered;
    the error to answer (``not_recorded`` if the event could not be written).

    Refusals of the secret rules are ``secret.use`` denies, malformed requests
    ``http.request`` denies; anything else (an upstream that failed) is recorded
    by the connection's completion event, written before the answer too."""
    version = scope.policies.version
    if isinstance(exc, (_Misplaced, _Echoed)):
        action, details = "secret.use", exc.details
    elif isinstance(exc, EgressDenied):
        action, details = "secret.use", {"host": admitted.host.name, "port": admitted.port}
    elif isinstance(exc, BadCall):
        action, details = "http.request", {"method": method[:32], "status": exc.status}
    else:
        return exc
    try:
        await scope.record(
            action,
            admitted.resource,
            Decision(False, exc.policies, version),
            reason=f"refused: {exc.message}",
            details=details,
        )
    except CallRefused as refused:
        return refused
    return exc


async def _settle(scope: RunScope, admitted: _Admitted, outcome: _Outcome) -> BrokerError | None:
    """Write the completion event, once; the answer still owed to the guest, if any."""
    if outcome.completed:
        return None
    outcome.completed = True
    answer, outcome.answer = outcome.answer, None
    if answer is not None:
        outcome.error = outcome.error or answer.message
        outcome.answered = answer.status
    recorded = await _complete(scope, admitted, outcome)
    if answer is not None and not recorded and not isinstance(answer, CallRefused):
        return CallRefused("the call was refused because the ledger cannot record it")
    return answer


class _PlaceholderFound(Exception):
    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.name = name


class _Scanner:
    """Finds placeholders in a byte stream, across chunk boundaries."""

    def __init__(self, needles: Mapping[str, str]) -> None:
        self._needles = {k.encode(): v for k, v in needles.items()}
        self._keep = max((len(k) for k in self._needles), default=1) - 1
        self._tail = b""

    def scan(self, data: bytes) -> str | None:
        if not self._needles:
            return None
        window = self._tail + data
        for needle, name in self._needles.items():
            if needle in window:
                return name
        self._tail = window[-self._keep :] if self._keep else b""
        return None


# -- what an upstream sends back where a secret was injected --------------------

#: Base64 runs shorter than this are not searched for: too likely by chance.
_MIN_B64_RUN = 8


def _secret_forms(value: str) -> list[bytes]:
    """The secret as an echo would carry it: as is, percent-encoded, JSON-escaped, in
    hex, and in base64 (standard and URL-safe) at each of the three alignments it
    can have inside a longer encoded value (``Basic`` credentials, a token blob)."""
    raw = value.encode()
    forms = {
        raw,
        quote(value, safe="").encode(),
        quote_plus(value, safe="").encode(),
        json.dumps(value)[1:-1].encode(),
        raw.hex().encode(),
        raw.hex().upper().encode(),
    }
    n = len(raw)
    for pad in range(3):
        encoded = base64.b64encode(b"\0" * pad + raw + b"\0\0")
        # The characters that depend on the secret's bytes alone.
        run = encoded[-(-8 * pad // 6) : (8 * (pad + n)) // 6]
        if len(run) >= _MIN_B64_RUN:
            forms.add(run)
            forms.add(run.replace(b"+", b"-").replace(b"/", b"_"))
    return sorted((f for f in forms if f), key=len, reverse=True)


def _echo_needles(bindings: list[SecretBinding]) -> list[tuple[bytes, str]]:
    return [(form, b.name) for b in bindings for form in _secret_forms(b.value)]


class _EchoFound(Exception):
    def __init__(self, name: str, where: str) -> None:
        super().__init__(name)
        self.name = name
        self.where = where


class _Guard:
    """Passes a response body on, holding back the bytes that could begin a secret's
    value until the next ones show they do not: a match is found before any byte
    of it has been passed on."""

    def __init__(self, needles: list[tuple[bytes, str]]) -> None:
        self._needles = needles
        self._keep = max((len(n) for n, _ in needles), default=1) - 1
        self._held = b""

    def feed(self, data: bytes) -> bytes:
        window = self._held + data
        for needle, name in self._needles:
            if needle in window:
                raise _EchoFound(name, "response body")
        if len(window) <= self._keep:
            self._held = window
            return b""
        cut = len(window) - self._keep
        self._held = window[cut:]
        return window[:cut]

    def finish(self) -> bytes:
        held, self._held = self._held, b""
        return held


@dataclass
class _RelayState:
    started: bool = False  # something of the response reached the guest


def _echo_refusal(admitted: _Admitted, name: str, where: str) -> _Echoed:
    return _Echoed(
        f"the response of {admitted.host.display} carried the value of secret {name!r} "
        f"back (in the {where}); it was withheld",
        {"secret": name, "where": where, "host": admitted.host.name, "port": admitted.port},
    )


def _find(needles: list[tuple[bytes, str]], data: bytes) -> str | None:
    return next((name for needle, name in needles if needle in data), None)


async def _send_body(
    guest: TlsStream,
    up_writer: asyncio.StreamWriter,
    framing: Framing,
    placeholders: Mapping[str, str],
    outcome: _Outcome,
) -> None:
    """Stream the request body upstream; a placeholder anywhere in it (the data, a
    chunk extension, a trailer) stops it before the upstream has a whole request."""

    async def put(data: bytes) -> None:
        outcome.bytes_up += len(data)
        up_writer.write(data)
        await up_writer.drain()

    await _walk_scanned(guest, framing, placeholders, put)


async def _walk_scanned(
    src: Source,
    framing: Framing,
    placeholders: Mapping[str, str],
    put: Callable[[bytes], Awaitable[None]],
) -> None:
    """:func:`walk_body` with every byte searched for placeholders before it is passed
    on: the raw stream (framing included), and the payload alone, so that one split
    across two chunks is found too."""
    raw = _Scanner(placeholders)
    payload = _Scanner(placeholders)

    async def scan_payload(data: bytes) -> None:
        found = payload.scan(data)
        if found is not None:
            raise _PlaceholderFound(found)

    async def scan_and_put(data: bytes) -> None:
        found = raw.scan(data)
        if found is not None:
            raise _PlaceholderFound(found)
        await put(data)

    await walk_body(src, framing, scan_and_put, payload=scan_payload)


async def _relay_injected(
    up: asyncio.StreamReader,
    guest: TlsStream,
    method: str,
    needles: list[tuple[bytes, str]],
    outcome: _Outcome,
    relay: _RelayState,
    timeout: float,
) -> bool:
    """Relay one response to an injected request, checked for the secret's value;
    True if the guest's connection may carry another request."""
    while True:
        try:
            head = await asyncio.wait_for(up.readuntil(b"\r\n\r\n"), timeout)
        except TimeoutError:
            raise UpstreamFailed(f"the upstream did not answer within {timeout:g} s") from None
        except (asyncio.LimitOverrunError, asyncio.IncompleteReadError) as exc:
            raise UpstreamFailed("the upstream sent no valid response head") from exc
        first, status, headers = parse_response_head(head)
        # Raw head bytes, so that a value split by the parser is still found.
        echoed = _find(needles, head)
        if echoed is not None:
            raise _EchoFound(echoed, "response head")
        if status == 101:
            raise UpstreamFailed("the upstream switched protocols where a secret is injected")
        if 100 <= status < 200:
            data = serialize_head(first, response_headers(headers))
            await guest.write(data)
            relay.started = True
            outcome.bytes_down += len(data)
            continue
        break
    outcome.status = status
    framing = response_framing(method, status, headers)
    if framing.kind != "none":
        coded = [
            v.strip().lower()
            for k, v in headers
            if k.lower() == "content-encoding" and v.strip().lower() not in ("", "identity")
        ]
        te = [v.strip().lower() for k, v in headers if k.lower() == "transfer-encoding"]
        if coded or (te and te != ["chunked"]):
            raise UpstreamFailed(
                "the upstream sent a coded response body where a secret is injected; "
                "it cannot be checked for the secret's value",
                hint="the proxy asks for Accept-Encoding: identity; the upstream ignored it",
            )
    out = response_headers(headers)
    if framing.kind == "eof":
        out.append(("Connection", "close"))
    data = serialize_head(first, out)
    await guest.write(data)
    relay.started = True
    outcome.bytes_down += len(data)
    guard = _Guard(needles)
    chunked = framing.kind == "chunked"

    async def send(piece: bytes) -> None:
        if not piece:
            return
        # A chunked body is framed anew: chunk lines and trailers are the
        # upstream's, and the bytes held back do not end where its chunks do.
        out = f"{len(piece):x}\r\n".encode() + piece + b"\r\n" if chunked else piece
        outcome.bytes_down += len(out)
        await guest.write(out)

    async def payload(piece: bytes) -> None:
        await send(guard.feed(piece))

    async def ignore(_: bytes) -> None:
        pass

    await walk_body(up, framing, ignore, payload=payload)
    await send(guard.finish())
    if chunked:
        outcome.bytes_down += 5
        await guest.write(b"0\r\n\r\n")
    return framing.kind != "eof"


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
    up: asyncio.StreamReader, writer: asyncio.StreamWriter, method: str, relay: _RelayState
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


async def _send_error(writer: asyncio.StreamWriter, exc: BrokerError) -> None:
    try:
        writer.write(error_bytes(exc))
        await writer.drain()
    except (ConnectionError, OSError, RuntimeError):
        pass
    await _close(writer)


async def _send_error_tls(stream: TlsStream, exc: BrokerError) -> None:
    with contextlib.suppress(ConnectionError, OSError, ssl.SSLError):
        await stream.write(error_bytes(exc))


async def _close(writer: asyncio.StreamWriter) -> None:
    if writer.is_closing():
        return
    writer.close()
    with contextlib.suppress(ConnectionError, OSError, ssl.SSLError):
        await writer.wait_closed()
