"""The FastAPI application: routes, the request-id and size-limit middleware, and the
handlers that turn every failure into the one error shape."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import replace
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.telemetry import TelemetryConfig
from starlette.exceptions import HTTPException as StarletteHTTPException

from proctor import __version__, telemetry
from proctor.api import (
    _agent_routes,
    _artifact_routes,
    _ask_routes,
    _egress_routes,
    _health,
    _log,
    _metrics_route,
    _operator_routes,
    _retention_routes,
    _routes,
    _suggest_routes,
)
from proctor.api._auth import Authenticator, OIDCIssuer
from proctor.api._console_shelf import StoreShelf
from proctor.api._context import ApiState, Limits, request_id_for
from proctor.api._errors import body, describe
from proctor.api._models import KeyOut
from proctor.console import Console, ConsoleConfig, SignInProvider
from proctor.errors import ProctorError
from proctor.lifecycle import REQUEST, log_event
from proctor.mcp import HttpEndpoint
from proctor.runtime import Runtime

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

_access = logging.getLogger("proctor.api.access")

#: FastAPI's own OpenTelemetry is on by default, on the global providers that tracing
#: sets, and records the query string (a caller may put anything there), the server's
#: address and more: off. The request's span is _Guard's, whose attributes are chosen.
_NO_FASTAPI_TELEMETRY: TelemetryConfig = {
    "tracing": False, "metrics": False, "logs": False, "operation_spans": False,
    "auto_configure": False,
}  # fmt: skip

_STATUS_CODES = {
    400: "invalid_request", 401: "unauthenticated", 403: "forbidden", 404: "not_found",
    405: "method_not_allowed", 406: "not_acceptable", 413: "too_large",
    415: "unsupported_media_type", 422: "invalid_request",
}  # fmt: skip


#: Methods named in metrics and spans; any other (a client may send any token) is
#: ``OTHER``, so that a caller cannot make a series per request.
_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})
#: Not traced: probes and scrapes come every few seconds and do no one's work.
_UNTRACED = frozenset({"/metrics", "/healthz", "/readyz"})


def route_template(scope: Scope, root: str = "") -> str:
    """The template of the route that answered (``/tenants/{tenant}/runs``), never the
    path (it holds tenants' names and ids), or ``unmatched``. Under a mount (the
    console's ``/ui``), the mount's prefix first: ``root`` is the app's own root path,
    and every mount of this app has a fixed path."""
    path = getattr(scope.get("route"), "path", None)
    if not isinstance(path, str):
        return "unmatched"
    return f"{scope.get('root_path', '')[len(root) :]}{path}"


class _RequestSpan:
    """The request's span (OTel HTTP semantic conventions), current while the request
    is served: a run the request starts copies the context into its thread (see
    ``start_run``), so the run's span is its child. The parent is the caller's W3C
    ``traceparent`` if it sent one. No query string, no header, no body."""

    __slots__ = ("_method", "_span", "_token")

    def __init__(self, method: str, path: str, headers: dict[str, str]) -> None:
        from opentelemetry import context, trace

        parent = telemetry.extract_context(headers)
        self._method = method
        self._span = telemetry.tracer().start_span(
            method, context=parent, kind=trace.SpanKind.SERVER,
            attributes={"http.request.method": method, "url.path": path[:512]},
        )  # fmt: skip
        self._token = context.attach(trace.set_span_in_context(self._span, parent))

    @property
    def trace_id(self) -> str:
        return f"{self._span.get_span_context().trace_id:032x}"

    def end(self, route: str, status: int) -> None:
        from opentelemetry import context, trace

        if route != "unmatched":
            self._span.update_name(f"{self._method} {route}")
            self._span.set_attribute("http.route", route)
        self._span.set_attribute("http.response.status_code", status)
        if status >= 500:
            self._span.set_status(trace.StatusCode.ERROR)
        self._span.end()
        context.detach(self._token)


class _Guard:
    """Gives each request its id (``X-Request-Id``, echoed on every response) and
    refuses bodies over the limit: by Content-Length before reading, and by counting
    when there is none (the artifact upload route counts its own, larger, stream).
    Counts and times each request by its route's template, and traces it when
    tracing is on."""

    def __init__(self, app: ASGIApp, limits: Limits) -> None:
        self._app = app
        self._limits = limits
        self._metrics: telemetry.Metrics | None = None
        self._requests: dict[tuple[str, str, int], Any] = {}
        self._seconds: dict[tuple[str, str], Any] = {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self._app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        rid = request_id_for(headers.get("x-request-id"))
        state = scope.setdefault("state", {})
        state["request_id"] = rid
        # The log line's context: what this request leads to (a run's start and end, in
        # the run's thread) carries the request id too.
        method = scope["method"] if scope["method"] in _METHODS else "OTHER"
        root = scope.get("root_path", "")
        span = None
        context: dict[str, Any] = {"request_id": rid}
        if telemetry.tracing_enabled() and scope["path"] not in _UNTRACED:
            span = _RequestSpan(method, scope["path"], headers)
            context["trace_id"] = span.trace_id  # a log line leads to its trace
        token = REQUEST.set(context)
        started = time.monotonic()
        try:
            await self._serve(scope, receive, send, headers, rid)
        finally:
            REQUEST.reset(token)
            elapsed = time.monotonic() - started
            status = state.get("status", 500)
            route = route_template(scope, root)
            self._observe(method, route, status, elapsed)
            if span is not None:
                span.end(route, status)
            # Only the path: no query string (a caller may put anything there), no header.
            log_event(
                _access, "api.request", method=scope["method"], path=scope["path"][:512],
                status=status, duration_ms=round(elapsed * 1000, 1), actor=state.get("actor"),
                **context,
            )  # fmt: skip

    def _observe(self, method: str, route: str, status: int, seconds: float) -> None:
        """Count the request; the labelled children are kept, so a request costs two
        dict lookups and two increments, not prometheus_client's label resolution."""
        m = telemetry.metrics()
        if m is not self._metrics:  # metrics turned on since: the no-op children go
            self._metrics, self._requests, self._seconds = m, {}, {}
        key = (method, route, status)
        counter = self._requests.get(key)
        if counter is None:
            counter = self._requests[key] = m.api_requests.labels(method, route, str(status))
        counter.inc()
        hist = self._seconds.get(key[:2])
        if hist is None:
            hist = self._seconds[key[:2]] = m.api_seconds.labels(method, route)
        hist.observe(seconds)

    async def _serve(
        self, scope: Scope, receive: Receive, send: Send, headers: dict[str, str], rid: str
    ) -> None:
        upload = (scope["method"] == "POST" and scope["path"].endswith("/artifacts")) or (
            # A bucket object's body is bytes, not JSON: the route counts its own.
            scope["method"] == "PUT" and "/objects/" in scope["path"]
        )
        limit = self._limits.artifact_upload if upload else self._limits.json_body

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                scope["state"]["status"] = message["status"]
                message.setdefault("headers", [])
                message["headers"] = [
                    *message["headers"], (b"x-request-id", rid.encode()),
                ]  # fmt: skip
            await send(message)

        async def refuse(status: int, code: str, message: str) -> None:
            resp = JSONResponse(body(code, message, None, rid), status_code=status,
                                headers={"Connection": "close"})  # fmt: skip
            await resp(scope, receive, send_with_id)

        length = headers.get("content-length")
        if length is not None:
            if not length.isdigit():
                await refuse(400, "invalid_request", "Content-Length is not a number")
                return
            if int(length) > limit:
                await refuse(413, "too_large", f"the request body is over {limit} bytes")
                return
            await self._app(scope, receive, send_with_id)
            return
        if upload or scope["method"] in ("GET", "HEAD", "DELETE", "OPTIONS"):
            await self._app(scope, receive, send_with_id)
            return
        # A chunked body on a JSON route: read it whole (it is small), then replay it.
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                break
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                await refuse(413, "too_large", f"the request body is over {limit} bytes")
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self._app(scope, replay, send_with_id)


def _rid(request: Request) -> str | None:
    rid: str | None = getattr(request.state, "request_id", None)
    return rid


def create_app(  # noqa: PLR0913 -- the API's options, each named
    rt: Runtime,
    *,
    oidc: Sequence[OIDCIssuer] = (),
    limits: Limits | None = None,
    supervisor: Any = None,
    backend: str | None = None,
    worker_threads: int = 40,
    public_logs: Sequence[str] = (),
    console: ConsoleConfig | None = None,
    metrics_token: str | None = None,
) -> FastAPI:
    """The API over ``rt``. ``supervisor`` (a ``proctor.lifecycle.Supervisor``) is used
    for runs when given (``proctor serve`` has one); otherwise the API makes its own
    broker and supervisor on the first run and stops them at shutdown. ``public_logs``:
    tenants whose tlog-tiles read paths need no token (a public mirror of their log).
    ``console``: serve the web console at ``/ui`` (its OIDC sign-in offers the
    issuers marked ``console`` in ``oidc``). ``metrics_token``: the operator's scrape
    token, which ``/metrics`` asks for (None: no metrics on the API); given one, the
    metrics are turned on if they are not yet."""
    limits = limits or Limits()
    state = ApiState(
        rt, Authenticator(rt, oidc), limits, backend=backend, supervisor=supervisor,
        public_logs=frozenset(public_logs), metrics_token=metrics_token,
    )  # fmt: skip
    if metrics_token is not None and not telemetry.metrics_enabled():
        telemetry.enable_metrics(tenant_labels=telemetry.tenant_labels())

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        import anyio.to_thread

        anyio.to_thread.current_default_thread_limiter().total_tokens = worker_threads
        try:
            async with mcp.running():  # the MCP sessions' tasks
                yield
        finally:
            state.close()

    app = FastAPI(
        lifespan=lifespan,
        title="Proctor API",
        version=__version__,
        description=(
            "The control plane of a Proctor runtime, for principals: artifacts, approvals, "
            "deployments, runs, policies and the audit ledger. Every request is decided by "
            "Cedar and recorded in the ledger. Errors share one shape: "
            '`{"error": {"code", "message", "hint", "request_id"}}`.'
        ),
        docs_url=None,
        redoc_url=None,
        telemetry=_NO_FASTAPI_TELEMETRY,
    )
    app.state.proctor = state

    async def on_error(request: Request, exc: Exception) -> JSONResponse:
        status, doc, headers = describe(exc, _rid(request))
        return JSONResponse(doc, status_code=status, headers=headers)

    # Proctor's own errors are answers (4xx, or 503 when the ledger cannot write);
    # anything else reaches the last handler, which logs it and says only "internal".
    app.add_exception_handler(ProctorError, on_error)
    app.add_exception_handler(Exception, on_error)

    @app.exception_handler(RequestValidationError)
    async def on_invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        problems = []
        for err in exc.errors()[:5]:
            where = ".".join(str(p) for p in err.get("loc", ()))
            problems.append(f"{where}: {err.get('msg', 'invalid')}")
        doc = body("invalid_request", "; ".join(problems) or "invalid request", None, _rid(request))
        return JSONResponse(doc, status_code=422)

    @app.exception_handler(StarletteHTTPException)
    async def on_http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = _STATUS_CODES.get(exc.status_code, "invalid_request")
        message = exc.detail if isinstance(exc.detail, str) else "request refused"
        doc = body(code, message, None, _rid(request))
        return JSONResponse(doc, status_code=exc.status_code, headers=exc.headers)

    @app.get("/key", response_model=KeyOut, tags=["meta"])
    def key() -> KeyOut:
        """The verifier key of the runtime's checkpoints: public by design."""
        return KeyOut(verifier_key=rt.ledger.vkey(), trust_domain=rt.config.trust_domain)

    app.include_router(_health.router)
    app.include_router(_metrics_route.router)
    app.include_router(_routes.router)
    app.include_router(_artifact_routes.router)
    app.include_router(_log.router)
    app.include_router(_operator_routes.router)
    app.include_router(_retention_routes.router)
    app.include_router(_egress_routes.router)
    app.include_router(_agent_routes.router)
    app.include_router(_ask_routes.router)
    app.include_router(_suggest_routes.router)
    # MCP over streamable HTTP (docs/agents.md): the agent's bearer token on every
    # request, each tool an SDK call through this app, like the console's clicks.
    mcp = HttpEndpoint(app)
    app.add_route("/mcp", mcp, include_in_schema=False)  # type: ignore[arg-type]
    if console is not None:
        providers = [SignInProvider(i.issuer, i.audience, i.console_client_secret,
                                    i.console_label) for i in oidc if i.console]  # fmt: skip
        config = replace(console, providers=[*console.providers, *providers])
        # The console calls the whole app (this one, middleware included), so its
        # requests are the API's own: same id, limits, decisions and log lines.
        # A store that several nodes share keeps the sessions, so any node answers.
        shelf = StoreShelf(rt) if rt.store.capabilities.advisory_lock else None
        app.mount("/ui", Console(app, config, shelf).app(), name="console")
    app.add_middleware(_Guard, limits=limits)

    return app


def openapi_document() -> dict[str, Any]:
    """The OpenAPI document of the API, as served at ``/openapi.json``; built without a
    runtime (no route touches it until a request comes)."""
    from typing import cast

    doc: dict[str, Any] = create_app(cast(Runtime, _NoRuntime())).openapi()
    return doc


class _NoRuntime:
    """Stands in for the runtime while only the document is built."""
