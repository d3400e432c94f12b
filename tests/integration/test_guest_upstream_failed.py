"""The guest library turns the broker's answer to an upstream failure into its own
exception (issue 33, item 1): a real Unix socket serving the broker's own error bytes
for an :class:`UpstreamFailed` whose event is recorded, read by ``proctor_guest``'s
client; the exception is ``UpstreamFailed``, names the cause and the event's seq."""

from __future__ import annotations

import socket
import threading
from pathlib import Path

import pytest

from proctor.broker import UpstreamFailed as BrokerUpstreamFailed
from proctor.broker._http import error_bytes
from proctor.guest import GuestError, UpstreamFailed
from proctor.guest._client import _call
from proctor.guest.protocol import SOCKET_ENV


def test_the_guest_exception_names_the_cause_and_its_event(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    failed = BrokerUpstreamFailed(
        "could not connect to host/db.internal:5432 (10.0.0.7): connection refused"
    )
    failed.seq = 41
    answer = error_bytes(failed)
    assert b"502 Bad Gateway (proctor upstream failure seq=41: could not connect" in answer
    path = tmp_path / "broker.sock"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    server.listen(1)

    def serve() -> None:
        conn, _ = server.accept()
        with conn:
            conn.recv(65536)
            conn.sendall(answer)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    monkeypatch.setenv(SOCKET_ENV, str(path))
    try:
        with pytest.raises(UpstreamFailed) as info:
            _call("GET", "/v1/whoami")
    finally:
        thread.join(10)
        server.close()
    exc = info.value
    assert isinstance(exc, GuestError) and exc.code == "upstream_failed" and exc.seq == 41
    assert "connection refused" in str(exc) and "[ledger event seq=41]" in str(exc)
    assert exc.reason is not None and "connection refused" in exc.reason
