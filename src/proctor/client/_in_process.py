"""The SDK's way to an API application in the same process (the web console and the
MCP server): ``Client(IN_PROCESS_BASE, credential, transport=InProcessTransport(app,
address))`` makes every call through the application's own middleware, authentication,
decisions and events, as over the network.

Callers run in worker threads (the SDK is synchronous); each request is carried back
onto the event loop that serves the application with ``anyio.from_thread.run`` and
answered by ``httpx.ASGITransport``. The whole answer is read before it is returned,
so a caller never asks for a stream that does not end (a log's ``follow``; a run's
stream ends with the run).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import httpx

ASGIApp = Callable[
    [MutableMapping[str, Any], Callable[[], Awaitable[Any]], Callable[[Any], Awaitable[None]]],
    Awaitable[None],
]

#: The base URL an in-process client is given; nothing is resolved or dialled.
IN_PROCESS_BASE = "http://proctor-api.internal"


class InProcessTransport(httpx.BaseTransport):
    """Hands each request to ``app`` on its event loop, as from ``client`` (an address)."""

    def __init__(self, app: ASGIApp, client: tuple[str, int]) -> None:
        self._inner = httpx.ASGITransport(app=app, client=client)

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        # Imported here: a program using the SDK over the network never loads it.
        import anyio.from_thread

        body = request.read()
        forwarded = httpx.Request(request.method, request.url, headers=request.headers,
                                  content=body)  # fmt: skip

        async def call() -> tuple[int, httpx.Headers, bytes]:
            resp = await self._inner.handle_async_request(forwarded)
            assert isinstance(resp.stream, httpx.AsyncByteStream)
            # The raw bytes, still encoded as the headers say: the SDK's client decodes.
            raw = b"".join([chunk async for chunk in resp.stream])
            await resp.stream.aclose()
            return resp.status_code, resp.headers, raw

        status, headers, raw = anyio.from_thread.run(call)
        return httpx.Response(status, headers=headers, stream=httpx.ByteStream(raw))
