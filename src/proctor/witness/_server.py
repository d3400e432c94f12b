"""The witness's HTTP interface (C2SP tlog-witness): ``POST /add-checkpoint`` and
the read ``GET /<hex SHA-256 of the origin>/checkpoint`` (the newest checkpoint
it cosigned, which verifiers ask for).

The standard library's threading server is enough: a witness answers a few logs
every few seconds, and each decision is one short SQLite transaction. What one
client may hold of it is bounded (``_limits.py``): connections per address and in
total, and the time a request has to arrive whole.
"""

from __future__ import annotations

import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from proctor.errors import UsageError
from proctor.witness._limits import (
    PER_ADDRESS,
    REQUEST_TIMEOUT,
    ConnectionGate,
    Deadlines,
    raise_nofile,
    total_for,
)
from proctor.witness._witness import MAX_BODY, Answer, Witness

#: What a connection over a bound gets before it is closed, unread.
_BUSY_TEXT = b"too many connections from your address, try later\n"
_BUSY = (
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: text/plain; charset=utf-8\r\n"
    b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(_BUSY_TEXT), _BUSY_TEXT)
)

_CHECKPOINT_PATH = re.compile(r"^/([0-9a-f]{64})/checkpoint$")


class _Server(ThreadingHTTPServer):
    """A threading server that admits a connection only within the gate's bounds,
    and arms the deadline of each request its handlers wait for."""

    daemon_threads = True
    # Stopping must not wait for clients that hold their connections: the threads
    # are daemons and end with the process.
    block_on_close = False
    request_queue_size = 128

    def __init__(self, address: tuple[str, int], handler: Any, gate: ConnectionGate,
                 timeout: float) -> None:  # fmt: skip
        self.gate = gate
        self.deadlines = Deadlines()
        self.request_timeout = timeout
        super().__init__(address, handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        host = str(client_address[0])
        if not self.gate.admit(host):
            try:
                request.setblocking(False)
                request.send(_BUSY)  # best effort, never waiting on the client
            except OSError:
                pass
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self.gate.release(host)
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.deadlines.forget(request)
            self.gate.release(str(client_address[0]))

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # a client that went away (or was closed at its deadline) is no error of ours


def _handler(witness: Witness) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        server_version = "proctor-witness"
        # Head and body are two writes: without this, Nagle's algorithm and the
        # client's delayed ACK hold every answer on a kept-alive connection ~40 ms.
        disable_nagle_algorithm = True
        server: _Server

        def setup(self) -> None:
            super().setup()
            # Each read (and write) waits at most this long; the deadline below bounds
            # the whole request whatever the pace of its bytes.
            self.connection.settimeout(self.server.request_timeout)

        def log_message(self, format: str, *args: object) -> None:
            pass  # one line per request would be noise; the state holds what matters

        def handle_one_request(self) -> None:
            # From here the request line, the headers and the body must all arrive
            # in time; between requests, this is how long a connection may idle.
            self.server.deadlines.arm(self.connection, self.server.request_timeout)
            try:
                super().handle_one_request()
            finally:
                self.server.deadlines.disarm(self.connection)

        def _late(self) -> bool:
            """The request was cut at its deadline: drop it, answer nothing."""
            if self.server.deadlines.expired(self.connection):
                self.close_connection = True
                return True
            return False

        def parse_request(self) -> bool:
            return super().parse_request() and not self._late()

        def _answer(self, answer: Answer) -> None:
            self.send_response(answer.status)
            self.send_header("Content-Type", answer.content_type)
            self.send_header("Content-Length", str(len(answer.body)))
            self.end_headers()
            self.wfile.write(answer.body)

        def do_POST(self) -> None:
            if self.path != "/add-checkpoint":
                self.close_connection = True
                self._answer(Answer(404, b"not found\n"))
                return
            length = self.headers.get("Content-Length", "")
            if not length.isdigit() or int(length) > MAX_BODY:
                # Unread body: the connection cannot be reused.
                self.close_connection = True
                self._answer(Answer(400 if not length.isdigit() else 413, b"bad length\n"))
                return
            body = self.rfile.read(int(length))
            if self._late() or len(body) != int(length):
                self.close_connection = True
                return
            self.server.deadlines.disarm(self.connection)  # the decision may wait on SQLite
            self._answer(witness.add_checkpoint(body))

        def do_GET(self) -> None:
            self.server.deadlines.disarm(self.connection)
            match = _CHECKPOINT_PATH.match(self.path)
            note = witness.checkpoint(match.group(1)) if match else None
            if note is None:
                self._answer(Answer(404, b"not found\n"))
                return
            self._answer(Answer(200, note.encode()))

    return Handler


class WitnessServer:
    """A witness served over HTTP on ``host:port`` (port 0: any free port).

    ``per_address`` bounds the connections one client holds; ``request_timeout`` the
    seconds a request has to arrive whole (or an idle connection to send the next);
    the total follows the descriptor limit (see ``_limits``)."""

    def __init__(
        self,
        witness: Witness,
        host: str,
        port: int,
        *,
        per_address: int = PER_ADDRESS,
        request_timeout: float = REQUEST_TIMEOUT,
    ) -> None:
        if per_address < 1 or not request_timeout > 0:
            raise UsageError("the connection bound and the request timeout must be positive")
        gate = ConnectionGate(per_address, total_for(raise_nofile()))
        try:
            self._httpd = _Server((host, port), _handler(witness), gate, request_timeout)
        except OSError as exc:
            raise UsageError(f"cannot listen on {host}:{port}: {exc.strerror}") from exc
        self._thread: threading.Thread | None = None

    @property
    def gate(self) -> ConnectionGate:
        return self._httpd.gate

    @property
    def address(self) -> tuple[str, int]:
        host, port = self._httpd.server_address[:2]
        return str(host), int(port)

    def serve_forever(self) -> None:
        self._httpd.deadlines.start()
        self._httpd.serve_forever(poll_interval=0.2)

    def start(self) -> None:
        self._thread = threading.Thread(target=self.serve_forever, name="witness", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._httpd.deadlines.stop()
        if self._thread is not None:
            self._thread.join(timeout=5)


def parse_listen(listen: str) -> tuple[str, int]:
    host, sep, port = listen.rpartition(":")
    if not sep or not port.isdigit() or int(port) > 65535:
        raise UsageError(f"--listen {listen!r}: give HOST:PORT", hint="e.g. 127.0.0.1:7380")
    return host.strip("[]") or "127.0.0.1", int(port)
