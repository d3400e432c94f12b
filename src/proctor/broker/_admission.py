"""Admission of one egress connection: decided, resolved, checked, decided again,
recorded; and the completion event that closes its record.

Order, and why:

1. Cedar decides ``http.request`` on the host *name* the guest asked for,
   before any DNS lookup, so a denied name never reaches a resolver (names
   are a way to smuggle data out through DNS). Where the broker injects a
   secret, ``secret.use`` of each secret is asked with it: one decision for
   the request (:mod:`._decide`), one event naming the secrets and headers.
2. The name is resolved once; every address is unmapped and checked against
   the special-purpose registries (:mod:`._egress`), and Cedar decides again
   with the address in the context, so a forbid on an address range applies.
3. The decision event is appended; if the ledger cannot record it, the call
   is refused (503) and no connection is made.
4. The caller dials exactly the checked address (:class:`Admitted`): no
   second lookup, so a DNS answer that changes between check and use
   (rebinding) changes nothing.
5. A completion event (bytes each way, duration, status) follows
   (:func:`settle`), written before any answer the proxy itself still owes
   the guest, so that answer is on the record too.
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
from typing import Any

from proctor.broker._decide import Question, decide
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
from proctor.broker._scope import BadCall, BrokerError, CallRefused, RunScope, SecretBinding
from proctor.policy import CedarValue, Decision, Entity, EntityRef, IpAddr

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


async def admit(
    scope: RunScope,
    resolver: Resolver,
    host: Host,
    port: int,
    method: str,
    scheme: str | None,
    path: str | None,
    bindings: Sequence[SecretBinding] = (),
) -> Admitted:
    """Decide, resolve once, check, decide with the address, record. Raises on refusal.

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
    except Exception as exc:  # PolicyError: a name Cedar's side refuses
        bad = BadCall(f"invalid host {host.name!r}")
        await record_bad(scope, method, host.name, bad)
        raise bad from exc
    if bindings:
        details["inject"] = [{"secret": b.name, "header": b.header} for b in bindings]
    secrets = _secret_questions(scope, host, bindings)
    verdict = decide(scope, [Question("http.request", ref, context, entities), *secrets])
    decision = verdict.decision
    if not decision.allowed:
        reason = verdict.reason
        await scope.record("http.request", resource, decision, reason=reason, details=details)
        raise EgressDenied(f"http.request to {resource} {reason}", policies=decision.policies)

    if host.address is not None:
        addresses = [host.address]
    else:
        try:
            addresses = await resolve_as(scope, resolver, host.name, port)
        except UpstreamFailed as exc:
            details["error"] = exc.message
            await scope.record(
                "http.request",
                resource,
                decision,
                reason=verdict.reason + "; not resolved",
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
            await scope.record_refusal(
                "http.request",
                resource,
                refusal.reason,
                policies=(SPECIAL_ADDRESS_RULE,),
                details=details,
            )
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
        verdict = decide(scope, [Question("http.request", ref, context, entities), *secrets])
        decision = verdict.decision
    reason = verdict.reason
    appended = await scope.record(
        "http.request", resource, decision, reason=reason, details=details
    )
    if not decision.allowed:
        raise EgressDenied(f"http.request to {resource} {reason}", policies=decision.policies)
    return Admitted(host, port, address, decision, appended.seq, resource)


def _secret_questions(
    scope: RunScope, host: Host, bindings: Sequence[SecretBinding]
) -> list[Question]:
    out = []
    for binding in bindings:
        ref = EntityRef.secret(scope.tenant, binding.name)
        out.append(
            Question("secret.use", ref, {"host": host.name},
                     (Entity.in_tenant(ref, scope.tenant),),
                     f"with secret.use of secret/{binding.name}")
        )  # fmt: skip
    return out


# -- events -------------------------------------------------------------------


def resource_of(host: Host, port: int) -> str:
    return f"host/{host.display}:{port}"


async def record_bad(scope: RunScope, method: str, target: str, exc: BadCall) -> None:
    """A malformed request is recorded too; raises CallRefused if it cannot be."""
    shown = target[:256].encode("ascii", "backslashreplace").decode()
    await scope.record_refusal(
        "http.request",
        f"host/{shown}",
        exc.message,
        details={"method": method[:32], "target": shown},
    )


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


async def settle(scope: RunScope, admitted: Admitted, outcome: Outcome) -> BrokerError | None:
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


async def _complete(scope: RunScope, admitted: Admitted, outcome: Outcome) -> bool:
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
