"""Streamable HTTP at ``/mcp`` of the API: every request authenticated by the agent's
bearer token, every tool call made with that token.

With sessions, not stateless: the MCP client names itself (clientInfo) only in its
``initialize`` request, and every later call must carry that name to the API
(``X-Proctor-Client``); a session keeps it. A session is bound to the principal that
opened it (the SDK refuses a request for it with another principal's token as if it
did not exist), and every request, of a session or not, is authenticated again with
the API (``GET /whoami`` through the SDK, in this process): a token revoked or a
principal disabled mid-session is refused at its next request, 401.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, MutableMapping
from contextlib import AbstractAsyncContextManager
from typing import Any

import anyio
import anyio.to_thread
from mcp.server.auth.middleware.bearer_auth import AuthenticatedUser
from mcp.server.auth.provider import AccessToken
from mcp.server.mcpserver import Context
from mcp.server.transport_security import TransportSecuritySettings

from proctor.client import IN_PROCESS_BASE, ASGIApp, Client, InProcessTransport
from proctor.errors import AuthenticationFailed, ProctorError
from proctor.mcp._server import Json, build_server, one_line

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]

_TOKEN = "proctor.mcp.token"  # noqa: S105 - the scope key, not a token
_PRINCIPAL = "proctor.mcp.principal"
_LOOPBACK = ("127.0.0.1", 0)
#: Requests authenticated at once; more wait their turn.
AUTH_THREADS = 8


def _address(scope: Scope) -> tuple[str, int]:
    client = scope.get("client")
    if isinstance(client, (tuple, list)) and len(client) == 2:
        return str(client[0]), int(client[1])
    return _LOOPBACK


def _open(api: ASGIApp, scope: Scope, token: str, headers: dict[str, str]) -> Client:
    h = {"User-Agent": "proctor-mcp", **headers}
    # The MCP request's id on the API requests it leads to: one id in every log line.
    rid = (scope.get("state") or {}).get("request_id")
    if isinstance(rid, str):
        h["X-Request-Id"] = rid
    transport = InProcessTransport(api, _address(scope))
    return Client(IN_PROCESS_BASE, token, transport=transport, headers=h, timeout=120.0)


class _HttpGateway:
    def __init__(self, api: ASGIApp) -> None:
        self._api = api

    @staticmethod
    def _scope(ctx: Context) -> Scope:
        request = ctx.request_context.request
        scope = getattr(request, "scope", None)
        if not isinstance(scope, MutableMapping) or not scope.get(_TOKEN):
            raise AuthenticationFailed("this MCP request carries no agent token")
        return scope

    def client(self, ctx: Context, headers: dict[str, str]) -> Client:
        scope = self._scope(ctx)
        return _open(self._api, scope, str(scope[_TOKEN]), headers)

    def tenant(self, ctx: Context, client: Client) -> str:
        del client
        return str(self._scope(ctx)[_PRINCIPAL]["tenant"])


class HttpEndpoint:
    """The ASGI application the API mounts at ``/mcp``; ``running()`` is entered in
    the API's lifespan (it holds the sessions' tasks)."""

    def __init__(self, api: ASGIApp) -> None:
        self._api = api
        self._server = build_server(_HttpGateway(api))
        # No DNS-rebinding check: it guards servers a browser reaches with ambient
        # credentials (cookies); here every request carries the agent's bearer token,
        # which a page cannot add, and the API's own Host is whatever serve listens on.
        self._server.streamable_http_app(
            transport_security=TransportSecuritySettings(enable_dns_rebinding_protection=False)
        )
        self._manager = self._server.session_manager
        # Their own threads, as the tools have (see _server._guarded): never the pool the
        # API serves its requests from, whoami included.
        self._auth_threads = anyio.CapacityLimiter(AUTH_THREADS)

    def running(self) -> AbstractAsyncContextManager[None]:
        return self._manager.run()

    def _whoami(self, token: str, scope: Scope) -> Json:
        with _open(self._api, scope, token, {}) as client:
            return client.whoami()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope.get("type") != "http":
            return
        token = _bearer(scope)
        if token is None:
            await _refuse(send, AuthenticationFailed(
                "the MCP endpoint needs the agent's token",
                hint="send the header 'Authorization: Bearer <token>'",
            ))  # fmt: skip
            return
        try:
            who = await anyio.to_thread.run_sync(
                self._whoami, token, scope, limiter=self._auth_threads
            )
        except ProctorError as exc:
            await _refuse(send, exc)
            return
        scope[_TOKEN] = token
        scope[_PRINCIPAL] = who
        # The principal, not the token, owns a session: a rotated token of the same
        # principal continues it, another principal's token never reaches it.
        owner = f"{who.get('tenant')}/{who.get('name')}"
        scope["user"] = AuthenticatedUser(AccessToken(token="", client_id=owner, scopes=[]))
        await self._manager.handle_request(scope, receive, send)


def _bearer(scope: Scope) -> str | None:
    for key, value in scope.get("headers") or ():
        if key.lower() == b"authorization":
            text = bytes(value).decode("latin-1")
            scheme, _, token = text.partition(" ")
            if scheme.lower() == "bearer" and token.strip():
                return str(token.strip())
            return None
    return None


async def _refuse(send: Send, exc: ProctorError) -> None:
    status = exc.status if isinstance(exc.status, int) and 400 <= exc.status < 600 else 500
    doc = {"error": {"code": exc.code, "message": one_line(exc), "hint": None}}
    headers = [(b"content-type", b"application/json")]
    if status == 401:
        headers.append((b"www-authenticate", b'Bearer realm="proctor"'))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": json.dumps(doc).encode()})
