"""The MCP server's way to an API application in this process: the SDK's own
``Client`` over a transport that hands each request to the application, as the
console does (the layering keeps the console's module out of reach, so this is its
own copy of the same few lines).

Tools run in worker threads (the SDK is synchronous); each request is carried back
onto the event loop that serves the application with ``anyio.from_thread.run`` and
answered by ``httpx.ASGITransport``. The whole answer is read before it is returned
(a run's stream ends with the run).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import anyio.from_thread
import httpx

ASGIApp = Callable[
    [MutableMapping[str, Any], Callable[[], Awaitable[Any]], Callable[[Any], Awaitable[None]]],
    Awaitable[None],
]

#: The base URL an in-process client is given; nothing is resolved or dialled.
BASE = "http://proctor-api.internal"


class InProcess(httpx.BaseTransport):
    def __init__(self, app: ASGIApp, client: tuple[str, int]) -> None:
        self._inner = httpx.ASGITransport(app=app, client=client)

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        body = request.read()
        forwarded = httpx.Request(request.method, request.url, headers=request.headers,
                                  content=body)  # fmt: skip

        async def call() -> tuple[int, httpx.Headers, bytes]:
            resp = await self._inner.handle_async_request(forwarded)
            assert isinstance(resp.stream, httpx.AsyncByteStream)
            raw = b"".join([chunk async for chunk in resp.stream])
            await resp.stream.aclose()
            return resp.status_code, resp.headers, raw

        status, headers, raw = anyio.from_thread.run(call)
        return httpx.Response(status, headers=headers, stream=httpx.ByteStream(raw))
