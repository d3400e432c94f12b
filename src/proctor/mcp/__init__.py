"""The MCP server (docs/agents.md): Proctor's write-run-approve loop as tools a coding
agent calls over the Model Context Protocol, each one an API operation made through
the SDK as the agent's principal, so it decides and records nothing itself.

``LocalGateway`` and ``serve_stdio`` are ``proctor mcp`` (stdio); ``HttpEndpoint`` is
streamable HTTP, which the API mounts at ``/mcp``; ``build_server`` makes the tools
over any ``Gateway``.
"""

from proctor.mcp._http import HttpEndpoint
from proctor.mcp._server import CLIENT_HEADER, Gateway, build_server
from proctor.mcp._stdio import LocalGateway, serve_stdio

__all__ = [
    "CLIENT_HEADER",
    "Gateway",
    "HttpEndpoint",
    "LocalGateway",
    "build_server",
    "serve_stdio",
]
