"""``proctor mcp``: the server over stdio, for a coding agent on this machine.

The agent's token (``PROCTOR_TOKEN``) is the identity of every call, never the
operator's: with a server URL the SDK talks to a running API; without one, the CLI
hands in the API application over the local home and the calls are served in this
process, through the same authentication, decisions and ledger as over the network.
"""

from __future__ import annotations

import threading

import anyio.to_thread
from mcp.server.mcpserver import Context

from proctor.client import IN_PROCESS_BASE, ASGIApp, Client, InProcessTransport
from proctor.errors import UsageError
from proctor.mcp._server import Json, build_server

#: The address the API records for a local agent served in this process.
LOCAL = ("127.0.0.1", 0)


class LocalGateway:
    """One agent, one token, for the life of the process."""

    def __init__(
        self, token: str, *, url: str | None = None, verify: bool | str = True,
        app: ASGIApp | None = None,
    ) -> None:  # fmt: skip
        if not token:
            raise UsageError(
                "proctor mcp needs the agent's token in PROCTOR_TOKEN (or --token)",
                hint="an admin creates one: proctor principal create -t TENANT NAME --kind agent",
            )
        if (url is None) == (app is None):
            raise UsageError("give the MCP server either a server URL or the local API")
        self._token, self._url, self._verify, self._app = token, url, verify, app
        self._tenant: str | None = None
        self._lock = threading.Lock()

    def _open(self, headers: dict[str, str]) -> Client:
        h = {"User-Agent": "proctor-mcp", **headers}
        if self._app is not None:
            transport = InProcessTransport(self._app, LOCAL)
            return Client(IN_PROCESS_BASE, self._token, transport=transport, headers=h,
                          timeout=120.0)  # fmt: skip
        assert self._url is not None
        return Client(self._url, self._token, verify=self._verify, headers=h)

    def client(self, ctx: Context, headers: dict[str, str]) -> Client:
        del ctx
        return self._open(headers)

    def tenant(self, ctx: Context, client: Client) -> str:
        del ctx
        with self._lock:
            if self._tenant is None:
                self._tenant = str(client.whoami()["tenant"])
            return self._tenant

    def whoami(self) -> Json:
        """The principal the token names (an error if it names none): checked once at
        start, so a wrong token is one line on stderr, not a server that fails later."""
        with self._open({}) as client:
            doc = client.whoami()
        with self._lock:
            self._tenant = str(doc["tenant"])
        return doc


async def serve_stdio(gateway: LocalGateway) -> None:
    """Check the token, then serve MCP on stdin/stdout until the client closes it."""
    await anyio.to_thread.run_sync(gateway.whoami)
    await build_server(gateway).run_stdio_async()
