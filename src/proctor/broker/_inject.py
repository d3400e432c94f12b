"""TLS termination and secret injection: the CONNECTs to a host a secret is bound to.

The proxy ends the guest's TLS with a leaf of the tenant's CA (:mod:`._mitm`)
and forwards the requests inside one at a time, each on an upstream connection
of its own, with the bound header set from the secret. A placeholder is
honoured only in the header its secret is bound to: anywhere else in the head
it is refused before a byte goes upstream, in the body before the upstream has
a whole request; the Host header must name the host the secret is bound to.
These refusals are ``secret.use`` denies; a malformed request (a body on a
method an upstream may leave unread, say) is an ``http.request`` deny; each
is recorded before it is answered. A response is searched for the secret's
value (as is and in its usual encodings) before any byte of it reaches the
guest.
"""

from __future__ import annotations

import asyncio
import base64
import json
import ssl
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any, TypeVar
from urllib.parse import quote, quote_plus

from proctor.broker._admission import Admitted, Outcome, RelayState
from proctor.broker._decide import Question, decide
from proctor.broker._egress import EgressDenied, Host, UpstreamFailed, host_matches
from proctor.broker._fair import run_blocking
from proctor.broker._http import (
    HOP_BY_HOP,
    MAX_HEAD,
    Framing,
    Source,
    connection_named,
    parse_request_head,
    parse_response_head,
    request_framing,
    response_framing,
    response_headers,
    serialize_head,
    walk_body,
)
from proctor.broker._mitm import CAError, TlsStream, UpstreamTrust
from proctor.broker._rules import (
    BodyDigests,
    Breach,
    Meter,
    ResponseCut,
    RuleRefused,
    check_request,
    rules_context,
    rules_for,
    wants_digests,
)
from proctor.broker._scope import (
    BadCall,
    BrokerError,
    CallRefused,
    RateLimited,
    RunScope,
    SecretBinding,
)
from proctor.errors import ProctorError
from proctor.ledger import Action
from proctor.policy import Decision, EgressRule, Entity, EntityRef, IpAddr

_T = TypeVar("_T")

#: The rule named when a secret's placeholder is sent where the secret is not bound.
SECRET_BINDING_RULE = "proctor:secret:bound-hosts"  # noqa: S105 - a rule id, not a secret
#: The rule named when an upstream's response carries an injected secret's value back.
ECHO_RULE = "proctor:secret:echo"

#: Connects to an admitted address; with TLS verified for the name, if one is given
#: (against ``Admitted.trust``).
Dial = Callable[
    [Admitted, str | None], Awaitable[tuple[asyncio.StreamReader, asyncio.StreamWriter]]
]
#: ``(tenant, host)`` -> what the host's certificate is verified against: the CA
#: certificates the tenant registered for it alone, else the default trust.
TrustOf = Callable[[str, str], UpstreamTrust]


class Injector:
    """TLS termination with secret injection, for the CONNECTs of hosts a secret is
    bound to. ``dial`` connects to an admitted address (TLS verified for the name
    it is given); ``server_context(tenant, host)`` is the guest-facing TLS context,
    with a leaf certificate of the tenant's CA; ``trust(tenant, host)`` what the
    upstream's certificate is verified against (read from the store: a job of the
    run's share of the fair pool). None: the dial's default trust, unnamed."""

    def __init__(
        self,
        dial: Dial,
        server_context: Callable[[str, str], ssl.SSLContext],
        *,
        connect_timeout: float,
        response_timeout: float,
        trust: TrustOf | None = None,
    ) -> None:
        self._dial = dial
        self._server_context = server_context
        self._trust = trust
        self._connect_timeout = connect_timeout
        self._response_timeout = response_timeout

    async def run(
        self,
        scope: RunScope,
        admitted: Admitted,
        bindings: list[SecretBinding],
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        outcome: Outcome,
        answer_connect: bool = True,
    ) -> None:
        """``answer_connect`` False: the guest sent no CONNECT (a redirected connection,
        ``_transparent``), its ClientHello is already waiting in ``reader``."""
        host = admitted.host
        # The secrets' use was decided and recorded with the request (``admit``).
        try:
            try:
                server_ctx = self._server_context(scope.tenant, host.name)
            except CAError as exc:
                raise UpstreamFailed(f"the tenant CA cannot be used: {exc.message}") from exc
            admitted.trust = await self._trust_of(scope, host.name)
            # The first upstream connection is made before the guest is answered, so
            # that an unreachable host or a certificate that does not verify is a 502
            # to the CONNECT itself. It carries the first request and no other.
            first = await self._dial_trusted(admitted)
        except BrokerError as exc:
            outcome.answer = exc
            return
        if admitted.trust is not None:
            # Every later connection is verified against the same trust (``admitted``).
            tls = first[1].get_extra_info("ssl_object")
            peer = tls.getpeercert(binary_form=True) if tls is not None else None
            outcome.trust = admitted.trust.verified_by(peer)
        outcome.injected = tuple(b.name for b in bindings)
        if wants_digests(rules_for(scope.egress_rules, host, admitted.port)):
            outcome.bodies = BodyDigests()
        if answer_connect:
            writer.write(b"HTTP/1.1 200 Connection Established\r\n\r\n")
        guest = TlsStream(reader, writer, server_ctx, server_side=True)
        try:
            await writer.drain()
            await asyncio.wait_for(guest.handshake(), self._connect_timeout)
        except (ssl.SSLError, ConnectionError, OSError, TimeoutError) as exc:
            # Usually a guest that does not trust the tenant CA.
            outcome.error = f"guest TLS handshake failed: {type(exc).__name__}"
            first[1].transport.abort()
            return
        outcome.answer = await self._loop(scope, admitted, bindings, guest, first, outcome)
        # What is still owed is answered inside TLS by the answer stage, after the
        # completion record (the record stage's) that records it.
        outcome.inside = guest

    async def _trust_of(self, scope: RunScope, host: str) -> UpstreamTrust | None:
        """What ``host``'s certificate is verified against; a lookup that fails is a
        502 (fail closed: never the system's bundle in place of a registered CA)."""
        if self._trust is None:
            return None
        try:
            return await run_blocking(scope, self._trust, scope.tenant, host)
        except ProctorError as exc:
            raise UpstreamFailed(
                f"the trusted CAs of {host} cannot be read: {exc.message}"
            ) from exc

    async def _dial_trusted(
        self, admitted: Admitted
    ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        try:
            return await self._dial(admitted, admitted.host.name)
        except UpstreamFailed as exc:
            trust = admitted.trust
            if trust is None or not trust.anchors:
                raise
            # Say what it was held to: a private upstream is verified against its
            # registered CAs only, so "self-signed" may mean "another CA".
            shown = ", ".join(f"sha256:{fp[:16]}..." for fp, _ in trust.anchors)
            raise UpstreamFailed(
                f"{exc.message} (verified against the CA certificates registered for "
                f"{admitted.host.name} only: {shown})"
            ) from exc

    async def _loop(
        self,
        scope: RunScope,
        admitted: Admitted,
        bindings: list[SecretBinding],
        guest: TlsStream,
        first: tuple[asyncio.StreamReader, asyncio.StreamWriter],
        outcome: Outcome,
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
        rules = rules_for(scope.egress_rules, host, admitted.port)
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
                        scope, admitted, bindings, authority, method, target, headers, rules
                    )
                    meter = _metered(scope, admitted, rules, method, target, framing)
                except RateLimited as exc:
                    return exc  # counted, recorded in the run's broker.rate_limited events
                except BrokerError as exc:
                    return await _record_tunnel_refusal(scope, admitted, exc, method)
                if upstream is None:
                    try:
                        upstream = await self._dial_trusted(admitted)
                    except UpstreamFailed as exc:
                        return exc
                conn, upstream = upstream, None
                answer, more = await _digested(outcome, method, self._exchange(
                    scope, admitted, bindings, needles, guest, conn,
                    (method, target, headers, framing, meter), outcome,
                ))  # fmt: skip
                if answer is not None or not more:
                    return answer
        finally:
            if upstream is not None:
                upstream[1].transport.abort()

    async def _exchange(
        self,
        scope: RunScope,
        admitted: Admitted,
        bindings: list[SecretBinding],
        needles: list[tuple[bytes, str]],
        guest: TlsStream,
        conn: tuple[asyncio.StreamReader, asyncio.StreamWriter],
        request: tuple[str, str, list[tuple[str, str]], Framing, Meter],
        outcome: Outcome,
    ) -> tuple[BrokerError | None, bool]:
        """One injected request and its response: (the error to answer, whether the
        guest's connection may carry another request)."""
        up_reader, up_writer = conn
        method, target, headers, framing, meter = request
        relay = RelayState()
        head = serialize_head(f"{method} {target} HTTP/1.1", _inject_headers(headers, bindings))
        up_writer.write(head)
        outcome.requests += 1
        outcome.bytes_up += len(head)
        placeholders = {b.placeholder: b.name for b in scope.secrets.values()}
        body = asyncio.create_task(
            _send_body(guest, up_writer, framing, placeholders, outcome, meter)
        )
        response = asyncio.create_task(
            _relay_injected(up_reader, guest, method, needles, outcome, relay,
                            self._response_timeout, meter)
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
                if isinstance(failed, PlaceholderFound):
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
                # A response a rule cut: the guest has part of it, and no answer.
                outcome.error = (
                    error.message
                    if isinstance(error, ResponseCut)
                    else f"upstream failed: {type(error).__name__}"
                )
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


async def _digested(outcome: Outcome, method: str, exchange: Awaitable[_T]) -> _T:
    """Run one exchange; where a rule asks for the bodies' digests, record its own."""
    bodies = outcome.bodies
    if bodies is None:
        return await exchange
    bodies.start(method)
    outcome.status = None  # this exchange's, for its digests
    try:
        return await exchange
    finally:
        bodies.finish(outcome.status)


# -- the secret rules ---------------------------------------------------------


def bindings_for(scope: RunScope, host: Host, port: int) -> list[SecretBinding]:
    return [b for b in scope.secrets.values() if any(host_matches(h, host, port) for h in b.hosts)]


def _inject_headers(
    headers: list[tuple[str, str]], bindings: list[SecretBinding]
) -> list[tuple[str, str]]:
    """The guest's headers, with the bound headers set from their templates.

    Nothing is replaced anywhere else: a placeholder outside its bound header
    was refused before this (:func:`misplaced`). The upstream is asked for an
    uncoded response, the only kind the echo check can read, and to close the
    connection after it (it carries this request alone).
    """
    replaced = {b.header.lower() for b in bindings}
    named = connection_named(headers) - {"host"}
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


def misplaced(
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
    admitted: Admitted,
    bindings: list[SecretBinding],
    authority: set[str],
    method: str,
    target: str,
    headers: list[tuple[str, str]],
    rules: tuple[EgressRule, ...] = (),
) -> Framing:
    """Everything a request in a tunnel whose TLS the broker ended (a secret injected,
    request rules) must be, before a byte goes upstream."""
    host = admitted.host
    if not target.startswith("/") and not (method == "OPTIONS" and target == "*"):
        raise BadCall("only origin-form requests may follow CONNECT")
    if "upgrade" in {k.lower() for k, _ in headers}:
        raise BadCall("protocol upgrades are not supported where the broker ends TLS")
    hosts = [v.strip().lower() for k, v in headers if k.lower() == "host"]
    # The Host header picks the virtual host behind the address we verified; a
    # different one would carry the secret elsewhere on a shared front end
    # (domain fronting), or take the request out from under the host's rules.
    if len(hosts) != 1 or hosts[0] not in authority:
        if bindings or not rules:
            raise EgressDenied(
                f"the Host header must name {host.display}, the host the secret is bound to",
                policies=(SECRET_BINDING_RULE,),
            )
        fronted = Breach(rules[0].rule_id("host"),
                         f"the Host header must name {host.display}, the host whose rules apply",
                         "host")  # fmt: skip
        raise RuleRefused(fronted, _where(admitted, method, target))
    found = misplaced(scope.secrets.values(), bindings, method, target, headers)
    if found is not None:
        raise _misplaced_refusal(scope, admitted, bindings, *found)
    framing = request_framing(headers, method)
    breach = check_request(rules, method, target)
    if breach is not None:
        raise RuleRefused(breach, _where(admitted, method, target))
    if rules:
        _decide_request(scope, admitted, rules, method, target)
    return framing


class _RequestDenied(EgressDenied):
    """A request inside a tunnel with rules that Cedar denied: recorded as its own
    ``http.request`` decision (re-decidable from its details), then answered."""

    def __init__(self, decision: Decision, reason: str, details: dict[str, Any]) -> None:
        super().__init__(f"http.request to {details['host']} {reason}",
                         policies=decision.policies)  # fmt: skip
        self.decision = decision
        self.reason = reason
        self.details = details


def _decide_request(
    scope: RunScope,
    admitted: Admitted,
    rules: tuple[EgressRule, ...],
    method: str,
    target: str,
) -> None:
    """Ask Cedar about one request inside a tunnel whose host has rules, with what a
    plain-HTTP request is asked with (method, path, scheme, address, the rules): a
    tenant's forbid on ``context.method`` or ``context.path`` holds inside TLS too.
    An allowed request is covered by the tunnel's recorded decision and counted in
    its completion; a denied one raises :class:`_RequestDenied`, recorded before it
    is answered."""
    host = admitted.host
    path = target.split("?", 1)[0]
    cedar_rules = rules_context(rules) or {}
    context = {"method": method, "port": admitted.port, "scheme": "https", "path": path,
               "address": IpAddr(str(admitted.address)), "rules": cedar_rules}  # fmt: skip
    question = Question(Action.HTTP_REQUEST, EntityRef.host(host.name), context,
                        (Entity.host(host.name),))  # fmt: skip
    verdict = decide(scope, [question])
    if not verdict.allowed:
        details = {"host": host.name, "port": admitted.port, "method": method[:32],
                   "scheme": "https", "path": path[:512], "address": str(admitted.address),
                   "rules": cedar_rules, "tunnel_seq": admitted.seq}  # fmt: skip
        raise _RequestDenied(verdict.decision, verdict.reason, details)


def _where(admitted: Admitted, method: str, target: str) -> dict[str, Any]:
    """What a rule's refusal records of the request it refused."""
    return {"host": admitted.host.name, "port": admitted.port, "method": method[:32],
            "path": target.split("?", 1)[0][:512]}  # fmt: skip


def _metered(
    scope: RunScope,
    admitted: Admitted,
    rules: tuple[EgressRule, ...],
    method: str,
    target: str,
    framing: Framing,
) -> Meter:
    """The request's meter; a body whose announced length a rule refuses is refused
    (and nothing of it charged) before a byte goes upstream."""
    meter = Meter(rules, scope.egress_totals, _where(admitted, method, target))
    if framing.kind == "length":
        breach = meter.announce_request(framing.length)
        if breach is not None:
            raise meter.refused(breach)
    return meter


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
    scope: RunScope, admitted: Admitted, bindings: list[SecretBinding], name: str, where: str
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


def placeholder_refusal(
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


def forward_meter(
    scope: RunScope, admitted: Admitted, method: str, origin: str, outcome: Outcome | None = None
) -> Meter | None:
    """A plain-HTTP request's meter where its host has request rules (None: no rules).
    Its body is counted as it streams (:func:`counting`): the piece that would pass a
    bound is not sent, so the upstream never has a whole request. Its method and path
    were held to the rules at its decision. Where the rules ask for the bodies'
    digests, the exchange's go to ``outcome.bodies`` (the completion record)."""
    rules = rules_for(scope.egress_rules, admitted.host, admitted.port)
    if not rules:
        return None
    bodies = None
    if outcome is not None and wants_digests(rules):
        bodies = outcome.bodies = BodyDigests()
        bodies.start(method)
    return Meter(rules, scope.egress_totals, _where(admitted, method, origin), bodies)


def counting(meter: Meter | None) -> Callable[[bytes], Awaitable[None]] | None:
    """``walk_scanned``'s ``also`` for a plain-HTTP request body held to ``meter``."""
    if meter is None:
        return None

    async def count(data: bytes) -> None:
        breach = meter.request(len(data))
        if breach is not None:
            raise meter.refused(breach)
        meter.digest_request(data)

    return count


async def record_rule_refusal(
    scope: RunScope, admitted: Admitted, exc: RuleRefused | ResponseCut
) -> BrokerError:
    """Record a rule's refusal of a plain-HTTP request or response (an ``http.request``
    deny naming the rule); the error to answer (``not_recorded`` if it could not be)."""
    return await _record_tunnel_refusal(scope, admitted, exc, str(exc.details.get("method")))


async def _record_tunnel_refusal(
    scope: RunScope, admitted: Admitted, exc: BrokerError, method: str
) -> BrokerError:
    """Record why a request inside an injected tunnel is refused, before it is answered;
    the error to answer (``not_recorded`` if the event could not be written).

    Refusals of the secret rules are ``secret.use`` denies, malformed requests
    ``http.request`` denies; anything else (an upstream that failed) is recorded
    by the connection's completion event, written before the answer too."""
    if isinstance(exc, _RequestDenied):
        # Cedar's own decision (not a broker rule's refusal): recorded as decided.
        try:
            await scope.record(Action.HTTP_REQUEST, admitted.resource, exc.decision,
                               reason=exc.reason, details=exc.details)  # fmt: skip
        except CallRefused as refused:
            return refused
        return exc
    if isinstance(exc, (_Misplaced, _Echoed)):
        action, details = Action.SECRET_USE, exc.details
    elif isinstance(exc, (RuleRefused, ResponseCut)):
        action, details = Action.HTTP_REQUEST, exc.details
    elif isinstance(exc, EgressDenied):
        action, details = Action.SECRET_USE, {"host": admitted.host.name, "port": admitted.port}
    elif isinstance(exc, BadCall):
        action, details = Action.HTTP_REQUEST, {"method": method[:32], "status": exc.status}
    else:
        return exc
    try:
        await scope.record_refusal(
            action, admitted.resource, exc.message, policies=exc.policies, details=details
        )
    except CallRefused as refused:
        return refused
    return exc


class PlaceholderFound(Exception):
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


# -- what an upstream sends back where a secret was injected ------------------


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


def _echo_refusal(admitted: Admitted, name: str, where: str) -> _Echoed:
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
    outcome: Outcome,
    meter: Meter | None = None,
) -> None:
    """Stream the request body upstream; a placeholder anywhere in it (the data, a
    chunk extension, a trailer), or a byte over a rule's bound, stops it before the
    upstream has a whole request."""

    async def put(data: bytes) -> None:
        outcome.bytes_up += len(data)
        up_writer.write(data)
        await up_writer.drain()

    async def count(data: bytes) -> None:
        if meter is not None:
            breach = meter.request(len(data))
            if breach is not None:
                raise meter.refused(breach)
        if outcome.bodies is not None:
            outcome.bodies.request(data)

    await walk_scanned(guest, framing, placeholders, put, also=count)


async def walk_scanned(
    src: Source,
    framing: Framing,
    placeholders: Mapping[str, str],
    put: Callable[[bytes], Awaitable[None]],
    *,
    also: Callable[[bytes], Awaitable[None]] | None = None,
) -> None:
    """:func:`walk_body` with every byte searched for placeholders before it is passed
    on: the raw stream (framing included), and the payload alone, so that one split
    across two chunks is found too. ``also`` sees each piece of the payload, after
    the search and before it is passed on (a rule's byte count, a digest)."""
    raw = _Scanner(placeholders)
    payload = _Scanner(placeholders)

    async def scan_payload(data: bytes) -> None:
        found = payload.scan(data)
        if found is not None:
            raise PlaceholderFound(found)
        if also is not None:
            await also(data)

    async def scan_and_put(data: bytes) -> None:
        found = raw.scan(data)
        if found is not None:
            raise PlaceholderFound(found)
        await put(data)

    await walk_body(src, framing, scan_and_put, payload=scan_payload)


async def _relay_injected(
    up: asyncio.StreamReader,
    guest: TlsStream,
    method: str,
    needles: list[tuple[bytes, str]],
    outcome: Outcome,
    relay: RelayState,
    timeout: float,
    meter: Meter | None = None,
) -> bool:
    """Relay one response to an injected request, checked for the secret's value and
    held to the host's rules (withheld, or cut, past a bound); True if the guest's
    connection may carry another request."""
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
    announced = framing.kind == "length" and meter is not None
    if announced and meter is not None:
        breach = meter.announce_response(framing.length)
        if breach is not None:
            raise meter.cut(breach, status)
    if needles and framing.kind != "none":
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
        breach = None
        if meter is not None:
            passed, breach = meter.response(len(piece), announced)
            piece = piece[:passed]
        if outcome.bodies is not None:
            outcome.bodies.response(piece)
        await send(guard.feed(piece))
        if breach is not None and meter is not None:
            # Cut: the guest has the bytes the bound allows, and no end of the body.
            raise meter.cut(breach, status)

    async def ignore(_: bytes) -> None:
        pass

    await walk_body(up, framing, ignore, payload=payload)
    await send(guard.finish())
    if chunked:
        outcome.bytes_down += 5
        await guest.write(b"0\r\n\r\n")
    return framing.kind != "eof"
