"""The witness's HTTP interface (C2SP tlog-witness): ``POST /add-checkpoint`` and
the monitoring read ``GET /<hex SHA-256 of the origin>/checkpoint``.

The standard library's threading server is enough: a witness answers a few logs
every few seconds, and each decision is one short SQLite transaction.
"""

from __future__ import annotations

import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from proctor.errors import UsageError
from proctor.witness._witness import MAX_BODY, Answer, Witness

_CHECKPOINT_PATH = re.compile(r"^/([0-9a-f]{64})/checkpoint$")


def _handler(witness: Witness) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        server_version = "proctor-witness"
        # Head and body are two writes: without this, Nagle's algorithm and the
        # client's delayed ACK hold every answer on a kept-alive connection ~40 ms.
        disable_nagle_algorithm = True

        def log_message(self, format: str, *args: object) -> None:
            pass  # one line per request would be noise; the state holds what matters

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
            self._answer(witness.add_checkpoint(body))

        def do_GET(self) -> None:
            match = _CHECKPOINT_PATH.match(self.path)
            note = witness.checkpoint(match.group(1)) if match else None
            if note is None:
                self._answer(Answer(404, b"not found\n"))
                return
            self._answer(Answer(200, note.encode()))

    return Handler


class WitnessServer:
    """A witness served over HTTP on ``host:port`` (port 0: any free port)."""

    def __init__(self, witness: Witness, host: str, port: int) -> None:
        try:
            self._httpd = ThreadingHTTPServer((host, port), _handler(witness))
        except OSError as exc:
            raise UsageError(f"cannot listen on {host}:{port}: {exc.strerror}") from exc
        self._httpd.daemon_threads = True
        self._thread: threading.Thread | None = None

    @property
    def address(self) -> tuple[str, int]:
        host, port = self._httpd.server_address[:2]
        return str(host), int(port)

    def serve_forever(self) -> None:
        self._httpd.serve_forever(poll_interval=0.2)

    def start(self) -> None:
        self._thread = threading.Thread(target=self.serve_forever, name="witness", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)


def parse_listen(listen: str) -> tuple[str, int]:
    host, sep, port = listen.rpartition(":")
    if not sep or not port.isdigit() or int(port) > 65535:
        raise UsageError(f"--listen {listen!r}: give HOST:PORT", hint="e.g. 127.0.0.1:7380")
    return host.strip("[]") or "127.0.0.1", int(port)
