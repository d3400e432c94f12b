"""The console's way to the API: the SDK's own ``Client``, over a transport that
hands each request to the API application in this process.

The console decides nothing itself. Every read and every click is one SDK call,
so it goes through the same authentication, Cedar decision, request budget and
ledger event as the CLI's ``--server`` mode; the console can only do what the SDK
can (it imports nothing else of Proctor).

Console pages run in worker threads (the SDK is synchronous); each request is
carried back onto the event loop with ``anyio.from_thread.run`` and served by
``httpx.ASGITransport``. The whole answer is read before it is returned, so the
console never asks for a stream that does not end (a log's ``follow``).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import anyio.from_thread
import httpx

from proctor.client import Client

ASGIApp = Callable[
    [MutableMapping[str, Any], Callable[[], Awaitable[Any]], Callable[[Any], Awaitable[None]]],
    Awaitable[None],
]

#: The base URL the in-process client is given; nothing is resolved or dialled.
BASE = "http://proctor-api.internal"


class _InProcess(httpx.BaseTransport):
    def __init__(self, app: ASGIApp, client: tuple[str, int]) -> None:
        self._inner = httpx.ASGITransport(app=app, client=client)

    def handle_request(self, request: httpx.Request) -> httpx.Response:
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


def client_for(
    app: ASGIApp, credential: str, *, address: tuple[str, int], request_id: str
) -> Client:
    """An SDK client that acts as the person whose ``credential`` it holds, from the
    person's own address, under the console request's id (one id in both log lines)."""
    return Client(
        BASE, credential, transport=_InProcess(app, address), timeout=120.0,
        headers={"X-Request-Id": request_id, "User-Agent": "proctor-console"},
    )  # fmt: skip
