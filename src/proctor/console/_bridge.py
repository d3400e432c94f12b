"""The console's way to the API: the SDK's own ``Client``, over a transport that
hands each request to the API application in this process.

The console decides nothing itself. Every read and every click is one SDK call,
so it goes through the same authentication, Cedar decision, request budget and
ledger event as the CLI's ``--server`` mode; the console can only do what the SDK
can (it imports nothing else of Proctor).

Console pages run in worker threads (the SDK is synchronous); the SDK's
``InProcessTransport`` carries each request back onto the event loop and reads the
whole answer (the MCP server uses the same).
"""

from __future__ import annotations

from proctor.client import IN_PROCESS_BASE, ASGIApp, Client, InProcessTransport

__all__ = ["ASGIApp", "client_for"]


def client_for(
    app: ASGIApp, credential: str, *, address: tuple[str, int], request_id: str
) -> Client:
    """An SDK client that acts as the person whose ``credential`` it holds, from the
    person's own address, under the console request's id (one id in both log lines)."""
    return Client(
        IN_PROCESS_BASE, credential, transport=InProcessTransport(app, address), timeout=120.0,
        headers={"X-Request-Id": request_id, "User-Agent": "proctor-console"},
    )  # fmt: skip
