"""The ruling on one egress connection: decided, resolved, checked, decided again
(the kinds ``_proxy.Connect`` and ``_proxy.Forward`` ask it in the decide stage).

Order, and why:

1. Cedar decides ``http.request`` on the host *name* the guest asked for,
   before any DNS lookup, so a denied name never reaches a resolver (names
   are a way to smuggle data out through DNS). Where the broker injects a
   secret, ``secret.use`` of each secret is asked with it: one decision for
   the request (:mod:`._decide`), one event naming the secrets and headers.
2. The name is resolved once; every address is unmapped and checked against
   the special-purpose registries (:mod:`._egress`), and Cedar decides again
   with the address in the context, so a forbid on an address range applies.
3. The decision event is appended (the record stage, :mod:`._record`); if the
   ledger cannot record it, the call is refused (503) and no connection is made.
4. The caller dials exactly the checked address (:class:`Admitted`): no
   second lookup, so a DNS answer that changes between check and use
   (rebinding) changes nothing.
5. A completion event (bytes each way, duration, status) follows
   (``_record.complete``), written before any answer the proxy itself still
   owes the guest, so that answer is on the record too.
"""

from __future__ import annotations

import asyncio
import contextvars
import ipaddress
import logging
import socket
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from proctor.broker._calls import Ruling
from proctor.broker._decide import Question, Verdict, decide
from proctor.broker._egress import (
    SPECIAL_ADDRESS_RULE,
    EgressDenied,
    Host,
    IPAddress,
    UpstreamFailed,
    check_address,
    unmap,
)
from proctor.broker._fair import run_blocking
from proctor.broker._rules import (
    BodyDigests,
    Breach,
    RuleRefused,
    check_request,
    rules_context,
    rules_for,
)
from proctor.broker._scope import BadCall, BrokerError, CallRefused, RunScope, SecretBinding
from proctor.ledger import Action
from proctor.policy import CedarValue, Decision, Entity, EntityRef, IpAddr

if TYPE_CHECKING:
    from proctor.broker._mitm import TlsStream, UpstreamTrust

log = logging.getLogger("proctor.broker.egress")

Resolver = Callable[[str, int], Awaitable[list[IPAddress]]]


# The run a lookup is made for. A resolver keeps its (name, port) signature; the
# system one reads the run from here so that its blocking getaddrinfo is a job of
# that run's share of the fair pool: a tenant whose permitted names resolve slowly
# then holds only its own workers, not the loop's shared executor.
_LOOKUP_FOR: contextvars.ContextVar[RunScope | None] = contextvars.ContextVar(
    "proctor_lookup_for", default=None
)


async def system_resolver(name: str, port: int) -> list[IPAddress]:
    """Every address ``getaddrinfo`` gives for ``name``, in its order, once each."""
    scope = _LOOKUP_FOR.get()
    kind = {"type": socket.SOCK_STREAM, "proto": socket.IPPROTO_TCP}
    try:
        if scope is None:
            infos = await asyncio.get_running_loop().getaddrinfo(name, port, **kind)
        else:
            infos = await run_blocking(scope, socket.getaddrinfo, name, port, **kind)
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
class Admitted:
    """A connection the policy and the address check let through, recorded."""

    host: Host
    port: int
    address: IPAddress
    decision: Decision
    seq: int
    resource: str
    started: float = field(default_factory=time.monotonic)
    #: What the upstream's certificate is verified against when the broker ends TLS
    #: (set by the act before it dials: a CA the tenant registered for the host, or
    #: the default trust); None for a connection the broker does not verify.
    trust: UpstreamTrust | None = None


@dataclass
class Outcome:
    bytes_up: int = 0
    bytes_down: int = 0
    status: int | None = None
    requests: int = 0
    error: str | None = None
    injected: tuple[str, ...] = ()
    answer: BrokerError | None = None  # the error still to answer, after the event
    answered: int | None = None  # the status of the proxy's own answer, if it gave one
    completed: bool = False
    #: The guest's TLS, when the act ended it to inject a secret: what is still owed
    #: is answered inside it, after the completion record (the answer stage).
    inside: TlsStream | None = None
    #: The trust anchor that verified the upstream's certificate (``system``,
    #: ``upstream-cafile``, ``tenant-ca:<sha256>``), where the broker verified one.
    trust: str | None = None
    #: The digests of each request's and response's body, where a rule of the host
    #: asks for them (``body_digests``): named in the completion record.
    bodies: BodyDigests | None = None
    #: The guest's connection carries its next request (plain HTTP kept alive).
    kept: bool = False


async def resolve_as(scope: RunScope, resolver: Resolver, name: str, port: int) -> list[IPAddress]:
    """``resolver(name, port)``, made for ``scope``'s run (see ``_LOOKUP_FOR``)."""
    token = _LOOKUP_FOR.set(scope)
    try:
        return await resolver(name, port)
    finally:
        _LOOKUP_FOR.reset(token)


@dataclass
class RelayState:
    started: bool = False  # something of the response reached the guest
    #: The guest's request lets its connection stay open (HTTP/1.1, no close).
    persistent: bool = False
    #: The response went out whole with a framing of its own: the guest's
    #: connection may carry its next request (keep-alive).
    kept: bool = False


async def rule(
    scope: RunScope,
    resolver: Resolver,
    host: Host,
    port: int,
    method: str,
    scheme: str | None,
    path: str | None,
    bindings: Sequence[SecretBinding] = (),
) -> Ruling:
    """Decide, resolve once, check, decide with the address: the call's ruling, which
    the record stage makes durable before anything is dialed (a refusal is raised
    once it is). ``found`` is the checked address.

    ``bindings`` are the secrets the request will carry: each one's ``secret.use``
    is part of the request's one decision and named in its one event."""
    resource = resource_of(host, port)
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
    except Exception:  # PolicyError: a name Cedar's side refuses
        return bad_request(scope, method, host.name, BadCall(f"invalid host {host.name!r}"))
    if bindings:
        details["inject"] = [{"secret": b.name, "header": b.header} for b in bindings]
    breach = _with_rules(scope, host, port, method, path, context, details)
    questions = [Question(Action.HTTP_REQUEST, ref, context, entities),
                 *_secret_questions(scope, host, bindings)]  # fmt: skip
    verdict = decide(scope, questions)
    if not verdict.allowed or breach is not None:
        return _refused_first(scope, resource, verdict, details, breach)
    if host.address is not None:
        addresses = [host.address]
    else:
        try:
            addresses = await resolve_as(scope, resolver, host.name, port)
        except UpstreamFailed as exc:
            details["error"] = exc.message
            return Ruling(Action.HTTP_REQUEST, resource, verdict.decision,
                          verdict.reason + "; not resolved", details, refusal=exc)  # fmt: skip
        details["resolved"] = [str(a) for a in addresses]
    for address in addresses:
        refusal = check_address(address, scope.allowed_ranges)
        if refusal is not None:
            details["address"] = str(refusal.address)
            details["special_ranges"] = [cidr for cidr, _ in refusal.ranges]
            details["permitted_by"] = list(verdict.decision.policies)
            denied = Decision(False, (SPECIAL_ADDRESS_RULE,), scope.policies.version)
            error = EgressDenied(
                f"http.request to {resource} refused: {host.name} is or resolves to "
                f"{refusal.address}, a special-purpose address ({refusal.ranges[0][1]})",
                policies=(SPECIAL_ADDRESS_RULE,),
            )
            return Ruling(Action.HTTP_REQUEST, resource, denied, f"refused: {refusal.reason}",
                          details, refusal=error)  # fmt: skip
    address = addresses[0]
    details["address"] = str(address)
    if host.address is None:
        # Again with the address known, so forbids on address ranges apply.
        context["address"] = IpAddr(str(address))
        verdict = decide(scope, questions)
        if not verdict.allowed:
            return _denied(resource, verdict, details)
    return Ruling(Action.HTTP_REQUEST, resource, verdict.decision, verdict.reason, details,
                  found=(host, port, address))  # fmt: skip


def _with_rules(
    scope: RunScope,
    host: Host,
    port: int,
    method: str,
    path: str | None,
    context: dict[str, CedarValue],
    details: dict[str, Any],
) -> Breach | None:
    """Put the host's request rules into the context and the event: Cedar sees them (a
    tenant may require some), and the verifier decides the event again with them.
    For plain HTTP (a path known now) the rule the request breaks, if any: refused
    before any lookup. Inside TLS the broker checks each request (``_inject``)."""
    rules = rules_for(scope.egress_rules, host, port)
    cedar_rules = rules_context(rules)
    if cedar_rules is None:
        return None
    context["rules"] = cedar_rules
    details["rules"] = cedar_rules
    if method == "CONNECT" or path is None:
        return None
    return check_request(rules, method, path)


def _refused_first(
    scope: RunScope,
    resource: str,
    verdict: Verdict,
    details: dict[str, Any],
    breach: Breach | None,
) -> Ruling:
    """Cedar's refusal if it refused, else the refusal of the rule ``breach`` names."""
    if not verdict.allowed or breach is None:
        return _denied(resource, verdict, details)
    error = RuleRefused(breach, {})
    return refused(scope, Action.HTTP_REQUEST, resource, error,
                   {**details, **breach.details()}, breach.rule)  # fmt: skip


def _denied(resource: str, verdict: Verdict, details: dict[str, Any]) -> Ruling:
    error = EgressDenied(f"http.request to {resource} {verdict.reason}",
                         policies=verdict.decision.policies)  # fmt: skip
    return Ruling(Action.HTTP_REQUEST, resource, verdict.decision, verdict.reason, details,
                  refusal=error)  # fmt: skip


def admitted(ruling: Ruling) -> Admitted:
    """The connection a recorded, allowed ruling lets through."""
    assert ruling.seq is not None
    host, port, address = ruling.found
    return Admitted(host, port, address, ruling.decision, ruling.seq, ruling.resource)


def _secret_questions(
    scope: RunScope, host: Host, bindings: Sequence[SecretBinding]
) -> list[Question]:
    out = []
    for binding in bindings:
        ref = EntityRef.secret(scope.tenant, binding.name)
        out.append(
            Question(Action.SECRET_USE, ref, {"host": host.name},
                     (Entity.in_tenant(ref, scope.tenant),),
                     f"with secret.use of secret/{binding.name}")
        )  # fmt: skip
    return out


# -- events -------------------------------------------------------------------


def resource_of(host: Host, port: int) -> str:
    return f"host/{host.display}:{port}"


def refused(
    scope: RunScope,
    action: str,
    resource: str,
    exc: BrokerError,
    details: Mapping[str, Any],
    rule: str | None = None,
) -> Ruling:
    """A call refused before or instead of its Cedar decision (``rule`` the broker's
    rule named): the ruling the record stage records as its event, then raises."""
    denied = Decision(False, (rule,) if rule is not None else (), scope.policies.version)
    return Ruling(action, resource, denied, f"refused: {exc.message}", dict(details),
                  refusal=exc)  # fmt: skip


def bad_request(scope: RunScope, method: str, target: str, exc: BadCall) -> Ruling:
    """A malformed request is recorded too (by the record stage, from this ruling)."""
    shown = target[:256].encode("ascii", "backslashreplace").decode()
    details = {"method": method[:32], "target": shown}
    return refused(scope, Action.HTTP_REQUEST, f"host/{shown}", exc, details)


async def record_refusal(
    scope: RunScope,
    action: str,
    resource: str,
    exc: BrokerError,
    rule: str,
    details: Mapping[str, Any] | None = None,
) -> None:
    try:
        await scope.record_refusal(
            action, resource, exc.message, policies=(rule,), details=details or {}
        )
    except CallRefused as refused:
        raise refused from exc
