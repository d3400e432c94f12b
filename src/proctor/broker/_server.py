"""One asyncio server per runtime; one Unix socket per run.

The broker runs its event loop in a thread of its own, so the supervisor (and
the CLI) can open and close runs from ordinary code. A run's socket lives in a
private directory (0700) and is removed when the run closes; once the broker
stops, no socket remains and the sandbox has no way out at all.

Each request is charged to the run's call budget (:class:`RateLimit`) before it
is authenticated: over the limit it is answered 429 and only counted, so a
guest cannot flood the ledger with calls, nor with refusals of calls.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
import os
import shutil
import tempfile
import threading
import time
import uuid
from collections.abc import Awaitable, Callable
from concurrent.futures import Future
from dataclasses import dataclass
from http import HTTPStatus
from pathlib import Path
from typing import Any
from urllib.parse import unquote

from proctor.broker._http import RequestHead, read_body, read_head, respond, respond_json
from proctor.broker._scope import BadCall, BrokerError, RateLimit, RateLimited, RunScope
from proctor.broker._tokens import RunTokens
from proctor.errors import ProctorError
from proctor.ledger import EventDraft

log = logging.getLogger("proctor.broker")

TOKEN_HEADER = "Proctor-Token"  # noqa: S105 - a header name, not a secret
MAX_SQL_BODY = 1024 * 1024
MAX_OBJECT = 64 * 1024 * 1024
#: How long closing a run waits for its cancelled connections to finish writing.
_CLOSE_GRACE = 10.0

SqlHandler = Callable[[RunScope, dict[str, Any]], Awaitable[dict[str, Any]]]
ReadHandler = Callable[[RunScope, str, str], Awaitable[bytes]]
WriteHandler = Callable[[RunScope, str, str, bytes], Awaitable[dict[str, Any]]]
ConnectHandler = Callable[
    [RunScope, str, asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]
]
ForwardHandler = Callable[
    [RunScope, str, str, list[tuple[str, str]], asyncio.StreamReader, asyncio.StreamWriter],
    Awaitable[None],
]


@dataclass(frozen=True)
class Handlers:
    """What the broker does with each kind of call; each decides and records itself."""

    sql: SqlHandler
    read_object: ReadHandler
    write_object: WriteHandler
    connect: ConnectHandler
    forward: ForwardHandler


@dataclass(frozen=True)
class RunChannel:
    """What a run's sandbox gets: the socket to expose, and the token to present."""

    run_id: str
    socket: Path
    token: str


@dataclass
class _Run:
    scope: RunScope
    server: asyncio.AbstractServer
    socket: Path
    connections: set[asyncio.Task[None]]
    opening: str


class Broker:
    """The runtime's broker. ``rate_limit`` is the call budget of every run whose
    scope names none of its own; it is read when a run opens."""

    def __init__(
        self,
        handlers: Handlers,
        token_key: bytes,
        socket_root: Path | None = None,
        *,
        rate_limit: RateLimit | None = None,
    ):
        self._handlers = handlers
        self._tokens = RunTokens(token_key)
        self.rate_limit = rate_limit or RateLimit()
        self._root = Path(tempfile.mkdtemp(prefix="proctor-broker-", dir=socket_root))
        self._root.chmod(0o700)
        self._runs: dict[str, _Run] = {}
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._serve, name="proctor-broker", daemon=True)
        self._started = False
        self._stopped = False

    # -- lifecycle (called from any thread) ---------------------------------

    def start(self) -> Broker:
        if not self._started:
            self._started = True
            self._thread.start()
        return self

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_forever()

    def _call(self, coro: Awaitable[Any]) -> Any:
        if not self._started or self._stopped:
            raise BrokerError("the broker is not running")
        fut: Future[Any] = asyncio.run_coroutine_threadsafe(coro, self._loop)  # type: ignore[arg-type]
        return fut.result()

    def open_run(self, scope: RunScope, ttl: float) -> RunChannel:
        """Start serving ``scope``'s run on a socket of its own."""
        # Drawn per opening and forgotten at close: the token dies with its socket.
        opening = base64.urlsafe_b64encode(os.urandom(18)).decode()
        token = self._tokens.issue(scope.run_id, scope.artifact or "", ttl, opening)
        path: Path = self._call(self._open(scope, opening))
        return RunChannel(scope.run_id, path, token)

    def socket_path(self, run_id: str) -> Path | None:
        """Where ``run_id``'s socket is on the host while the run is open, else None."""
        run = self._runs.get(run_id)
        return run.socket if run is not None else None

    def close_run(self, run_id: str) -> None:
        if self._started and not self._stopped:
            self._call(self._close(run_id))

    def stop(self) -> None:
        """Close every run's socket; from here on no sandbox has a way out."""
        if self._stopped:
            return
        if self._started:
            for run_id in list(self._runs):
                self._call(self._close(run_id))
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
        self._stopped = True
        self._loop.close()
        shutil.rmtree(self._root, ignore_errors=True)

    def __enter__(self) -> Broker:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- inside the loop -----------------------------------------------------

    async def _open(self, scope: RunScope, opening: str) -> Path:
        if scope.run_id in self._runs:
            raise BrokerError(f"run {scope.run_id} already has a socket")
        if scope.rate_limit is None:
            scope.rate_limit = self.rate_limit
        path = self._root / f"{uuid.uuid4().hex[:12]}.sock"
        connections: set[asyncio.Task[None]] = set()

        async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            task = asyncio.current_task()
            assert task is not None
            connections.add(task)
            try:
                await self._connection(scope, reader, writer)
            finally:
                connections.discard(task)
                writer.close()

        server = await asyncio.start_unix_server(on_connect, path=str(path), limit=64 * 1024)
        # The guest's uid differs from ours; the 0700 directory is what guards the socket.
        os.chmod(path, 0o666)  # noqa: S103
        self._runs[scope.run_id] = _Run(scope, server, path, connections, opening)
        return path

    async def _close(self, run_id: str) -> None:
        run = self._runs.pop(run_id, None)
        if run is None:
            return
        run.server.close()
        tasks = list(run.connections)
        for task in tasks:
            task.cancel()
        if tasks:
            # Their finally blocks still write (a tunnel's completion event): wait for
            # them, or a broker stopping next would drop those events with its loop.
            await asyncio.wait(tasks, timeout=_CLOSE_GRACE)
        await run.server.wait_closed()
        run.socket.unlink(missing_ok=True)
        # After the last connection: every refusal counted is in the run's ledger.
        await run.scope.close_rate_limit()

    async def _connection(
        self, scope: RunScope, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        try:
            head = await read_head(reader)
            if head is None:
                return
            # Before anything that costs a ledger write, the refusal of a bad token included.
            scope.admit_call()
            problem = self._authenticate(scope, head)
            if problem is not None:
                await self._record_refusal(scope, head, problem)
                await respond_json(
                    writer,
                    401,
                    {"error": "unauthenticated", "message": problem, "policies": []},
                )
                return
            await self._route(scope, head, reader, writer)
        except RateLimited as exc:
            await self._send_error(writer, exc, extra=[("Retry-After", "1")])
        except BrokerError as exc:
            await self._send_error(writer, exc)
        except (ConnectionError, asyncio.IncompleteReadError):
            return
        except asyncio.CancelledError:
            raise
        except Exception:  # a bug must not kill the broker, nor reach the guest
            log.exception("broker: unexpected failure in run %s", scope.run_id)
            await self._send_error(writer, BrokerError("internal broker error"), status=500)

    async def _send_error(
        self,
        writer: asyncio.StreamWriter,
        exc: BrokerError,
        status: int | None = None,
        extra: list[tuple[str, str]] | None = None,
    ) -> None:
        if writer.is_closing():
            return
        code = status or exc.status
        body = json.dumps(exc.as_json(), sort_keys=True).encode()
        head = [
            f"HTTP/1.1 {code} {HTTPStatus(code).phrase}",
            "Content-Type: application/json",
            f"Content-Length: {len(body)}",
            "Connection: close",
            *(f"{k}: {v}" for k, v in extra or []),
        ]
        with contextlib.suppress(ConnectionError):
            writer.write(("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body)
            await writer.drain()

    def _authenticate(self, scope: RunScope, head: RequestHead) -> str | None:
        token = head.header(TOKEN_HEADER)
        if not token:
            return f"missing {TOKEN_HEADER} header"
        run = self._runs.get(scope.run_id)
        problem = self._tokens.check(
            token, scope.run_id, scope.artifact or "", run.opening if run is not None else ""
        )
        if problem is None or token.count(".") != 3:
            return problem
        # Say so when it is the token of another open run (replayed here), which
        # only that run's opening can show; an ended run's token reads as forged.
        other = self._runs.get(token.split(".")[1])
        if other is not None and other is not run:
            again = self._tokens.check(token, other.scope.run_id, other.scope.artifact or "",
                                       other.opening)  # fmt: skip
            if again is None:
                return "token belongs to another run"
        return problem

    async def _record_refusal(self, scope: RunScope, head: RequestHead, problem: str) -> None:
        # The call is refused either way; a failed record of the refusal changes nothing.
        with contextlib.suppress(ProctorError):
            await scope.ledger.append_async(
                scope.tenant,
                EventDraft(
                    scope.actor,
                    "broker.auth",
                    f"run/{scope.run_id}",
                    decision="deny",
                    reason=problem,
                    deployment=scope.deployment,
                    run=scope.run_id,
                    artifact=scope.artifact,
                    details={"method": head.method},
                ),
            )

    async def _route(
        self,
        scope: RunScope,
        head: RequestHead,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
    ) -> None:
        h = self._handlers
        if head.method == "CONNECT":
            await h.connect(scope, head.target, reader, writer)
            return
        if head.target.startswith(("http://", "https://")):
            headers = head.without(TOKEN_HEADER, "Proxy-Authorization", "Proxy-Connection")
            await h.forward(scope, head.method, head.target, headers, reader, writer)
            return
        path = head.target.split("?", 1)[0]
        if path == "/v1/whoami" and head.method == "GET":
            await respond_json(
                writer,
                200,
                {
                    "tenant": scope.tenant,
                    "run": scope.run_id,
                    "workload": scope.workload,
                    "deployment": scope.deployment,
                    "artifact": scope.artifact,
                    "environment": scope.environment,
                },
            )
            return
        if path == "/v1/sql":
            if head.method != "POST":
                raise BadCall("use POST for /v1/sql")
            body = await read_body(reader, head, MAX_SQL_BODY)
            try:
                request = json.loads(body)
            except ValueError as exc:
                raise BadCall(f"the body is not JSON: {exc}") from exc
            if not isinstance(request, dict):
                raise BadCall("the body must be a JSON object")
            await respond_json(writer, 200, await h.sql(scope, request))
            return
        if path.startswith("/v1/files/"):
            bucket, sep, key = path.removeprefix("/v1/files/").partition("/")
            if not sep or not bucket or not key:
                raise BadCall("use /v1/files/<bucket>/<key>")
            key = unquote(key)
            if head.method == "GET":
                data = await h.read_object(scope, bucket, key)
                await respond(writer, 200, data, "application/octet-stream")
                return
            if head.method == "PUT":
                data = await read_body(reader, head, MAX_OBJECT)
                await respond_json(writer, 200, await h.write_object(scope, bucket, key, data))
                return
            raise BadCall("use GET or PUT for /v1/files")
        err = BadCall(f"no such broker endpoint: {head.method} {path}")
        err.status = 404
        raise err


def wait_for_socket(path: Path, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise BrokerError(f"broker socket {path} did not appear")
        time.sleep(0.01)
