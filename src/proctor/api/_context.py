"""Per-request context: the authenticated principal, and the one way to authorize.

Every request a principal makes is decided by Cedar (the control plane's role
policy, on the principal and the tenant that owns the resource) and recorded in
the principal's tenant log as an ``api.request`` event, allowed or denied, with
the request id and source address, before anything is answered (reads through the
tlog-tiles paths are counted in the system log instead: ``_log_reads``). A request the
ledger cannot record is refused (503). A principal asking about another tenant
gets the same 404 as for a tenant that does not exist, so tenants cannot be
enumerated across the boundary.
"""

from __future__ import annotations

import ipaddress
import re
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request, Security
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from proctor.api._auth import Authenticator
from proctor.api._errors import ApiError, not_found
from proctor.api._limits import PrincipalLimits
from proctor.api._log_reads import LogReads
from proctor.errors import PolicyError, UsageError
from proctor.governance import Principal, explain_refusal
from proctor.ledger import REQUEST_DETAILS, Action, EventDraft
from proctor.policy import Decision, EntityRef, IpAddr
from proctor.runtime import Runtime

_REQUEST_ID_RE = re.compile(r"^[A-Za-z0-9._:-]{1,64}$")
#: ``X-Proctor-Client: <name>/<version>``: the MCP client an agent works through (the
#: MCP server sets it from the client's ``initialize``), recorded on the request's
#: events. Printable ASCII without spaces, name up to 64 and version up to 32.
CLIENT_HEADER = "x-proctor-client"
_CLIENT_RE = re.compile(r"([\x21-\x2e\x30-\x7e]{1,64})/([\x21-\x7e]{1,32})")
_PATH_MAX = 512


@dataclass(frozen=True)
class Limits:
    """Request size limits (bytes), and what one principal or address may hold."""

    json_body: int = 1 << 20
    artifact_upload: int = 64 << 20
    artifact_files: int = 10_000
    #: Each principal's request budget: sustained per second, and at once.
    requests_per_second: float = 50.0
    request_burst: int = 500
    #: Log follows (``logs?follow=true``) one principal may hold open at once.
    follows_per_principal: int = 8
    #: Connections the server holds from one client address (an IPv6 /64), and in all
    #: (None: a quarter of the process's descriptor limit; never over half of it).
    connections_per_source: int = 64
    connections_total: int | None = None
    #: A connection that sends no byte of a request head for this long is closed, and
    #: one whose head is not whole this long after it opened or after its last
    #: response (slow headers); both counted.
    first_byte_timeout: float = 10.0
    head_timeout: float = 20.0


@dataclass
class ApiState:
    rt: Runtime
    auth: Authenticator
    limits: Limits
    backend: str | None = None
    supervisor: Any = None  # proctor.lifecycle.Supervisor, made on the first run
    own_broker: Any = None
    #: Tenants whose tlog-tiles read paths are served without a token (a mirror).
    public_logs: frozenset[str] = frozenset()
    #: The operator's scrape token for ``/metrics`` (None: the API serves no metrics).
    metrics_token: str | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)
    principals: PrincipalLimits = field(init=False)
    log_reads: LogReads = field(init=False)

    def __post_init__(self) -> None:
        self.principals = PrincipalLimits(
            lambda: self.rt.ledger,
            self.limits.requests_per_second,
            self.limits.request_burst,
            self.limits.follows_per_principal,
        )
        self.log_reads = LogReads(lambda: self.rt.ledger)

    def get_supervisor(self) -> Any:
        with self.lock:
            if self.supervisor is None:
                broker = self.rt.make_broker().start()
                try:
                    supervisor = self.rt.supervisor(broker, self.backend)
                except BaseException:
                    # No sandbox on this host (or no such backend): the broker goes
                    # too, so the next run tries afresh and close has nothing half-made.
                    broker.stop()
                    raise
                self.own_broker, self.supervisor = broker, supervisor
            return self.supervisor

    def stop_own_runs(self) -> None:
        """End the runs of the API's own supervisor (there is no `serve` around it),
        each recorded: a run's stream then ends, and the server need not wait for it."""
        with self.lock:
            if self.supervisor is not None:
                self.supervisor.shutdown()

    def close(self) -> None:
        self.principals.flush()
        self.log_reads.flush()
        self.stop_own_runs()
        with self.lock:
            if self.own_broker is not None:
                self.own_broker.stop()
                self.own_broker = None
                self.supervisor = None


def request_id_for(header: str | None) -> str:
    """The caller's X-Request-Id when it is short and plain (it goes into the ledger),
    else a fresh one."""
    import os

    if header and _REQUEST_ID_RE.match(header):
        return header
    return "req_" + os.urandom(8).hex()


def client_of(header: str | None) -> dict[str, str] | None:
    """The ``X-Proctor-Client`` header as ``{"name", "version"}``; None without one.
    A malformed one is refused (400), not dropped: an agent's events would otherwise
    lose what it worked through without anyone noticing."""
    if header is None:
        return None
    match = _CLIENT_RE.fullmatch(header)
    if match is None:
        raise UsageError(
            "X-Proctor-Client must be <name>/<version>: printable ASCII without spaces,"
            " a name of at most 64 characters (no '/') and a version of at most 32"
        )
    return {"name": match.group(1), "version": match.group(2)}


def _source(request: Request) -> str | None:
    host = request.client.host if request.client else None
    if host is None:
        return None
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        return None


@dataclass(frozen=True)
class Ctx:
    state: ApiState
    principal: Principal
    request_id: str
    source: str | None
    method: str
    path: str
    #: The MCP client's name and version (``X-Proctor-Client``), if the request said.
    client: dict[str, str] | None = None

    def event_details(self) -> dict[str, Any]:
        """What every event this request records carries of it beyond its own details."""
        return {"client": dict(self.client)} if self.client is not None else {}

    def bind(self) -> None:
        """Have every event the principal records from here on in this context (this
        thread, and a run's thread started from it) carry :meth:`event_details`. Each
        handler's thread runs in its own copy of the request's context, so nothing is
        left behind for another request."""
        details = self.event_details()
        if details:
            REQUEST_DETAILS.set(details)

    @property
    def rt(self) -> Runtime:
        return self.state.rt

    def authorize(
        self,
        action: str,
        tenant: str,
        event_resource: str,
        resource: EntityRef | None = None,
        context: Mapping[str, Any] | None = None,
        *,
        log: str | None = None,
        record_allowed: bool = True,
    ) -> Decision:
        """Decide ``action`` on ``resource`` (default: the tenant) for this request's
        principal, record the decision, and raise unless it is allowed. ``log``: where
        the decision is recorded (default: the principal's tenant log);
        ``record_allowed=False``: the caller counts an allowed decision itself (reads
        of a log through the tlog-tiles paths, see ``_log_reads``)."""
        p = self.principal
        self.bind()
        cedar_context: dict[str, Any] = {"request_id": self.request_id, **(context or {})}
        if self.source is not None:
            cedar_context["source"] = IpAddr(self.source)
        try:
            ref = resource if resource is not None else EntityRef.tenant(tenant)
            decision = self.rt.control.decide(p, action, ref, tenant, cedar_context)
        except PolicyError:
            # A name Cedar cannot even hold (e.g. with a '/') is nobody's tenant.
            decision = Decision(False, (), "", ("invalid name",))
        details: dict[str, Any] = {
            "request_id": self.request_id,
            "source": self.source,
            "method": self.method,
            "path": self.path[:_PATH_MAX],
            "action": action,
            **self.event_details(),
        }
        if tenant != p.tenant or log is not None:
            details["target_tenant"] = tenant[:64]
        if log is not None:
            details["principal_tenant"] = p.tenant
        if decision.allowed:
            reason = f"{action} allowed"
        elif decision.policies:
            reason = f"{action} forbidden by {', '.join(decision.policies)}"
        else:
            reason = f"no role of {p.id} permits {action}"
        because = None if decision.allowed else explain_refusal(decision.policies)
        if because is not None:
            # An agent's refusal says why an agent may not, recorded and answered alike.
            reason = f"{reason}: {because}"
        if decision.allowed and not record_allowed:
            return decision
        self.rt.ledger.append(
            log if log is not None else p.tenant,
            EventDraft(
                p.actor,
                Action.API_REQUEST,
                event_resource[:_PATH_MAX],
                decision="allow" if decision.allowed else "deny",
                policies=decision.policies,
                reason=reason,
                details=details,
            ),
        )
        if decision.allowed:
            return decision
        if tenant != p.tenant:
            raise not_found(f"unknown tenant {tenant!r}")
        raise ApiError(403, "forbidden", f"{p.id} may not {action} {event_resource}: {reason}")


_bearer = HTTPBearer(auto_error=False, description="A principal's pt_… token or an OIDC JWT")


def current(
    request: Request,
    credentials: HTTPAuthorizationCredentials | None = Security(_bearer),  # noqa: B008
) -> Ctx:
    """The FastAPI dependency every authenticated route takes."""
    state: ApiState = request.app.state.proctor
    principal = state.auth.authenticate(request.headers.get("authorization"))
    client = client_of(request.headers.get(CLIENT_HEADER))
    request.state.actor = principal.id  # for serve's log line of the request
    # Before the request is decided (and recorded): over its budget it costs no event.
    state.principals.admit(principal)
    return Ctx(
        state,
        principal,
        request.state.request_id,
        _source(request),
        request.method,
        request.url.path,
        client,
    )


async def bound(
    request: Request,
    credentials: HTTPAuthorizationCredentials | None = Security(_bearer),  # noqa: B008
) -> Ctx:
    """:func:`current`, with the request's details bound (:meth:`Ctx.bind`) in the
    request's own context: every event its handler records carries them, in the
    handler's thread, a worker's and a run's thread alike."""
    from fastapi.concurrency import run_in_threadpool

    ctx = await run_in_threadpool(current, request, credentials)
    ctx.bind()
    return ctx
