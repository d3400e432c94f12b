"""A broker owner that dies between a call's answer and its completion record.

``python _completion_child.py HOME PORT``: opens the runtime at HOME, records a
running run owned by this process, and through the runtime's real broker sends
one plain-HTTP GET to the upstream on 127.0.0.1:PORT. The completion record is
wrapped: it waits until the guest's side has read the whole answer (printed as
``ANSWER <status> <body>``), then this process SIGKILLs itself, with no clean-up.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
from pathlib import Path
from typing import Any

from proctor.broker import RunScope, _record
from proctor.guest.protocol import TOKEN_HEADER
from proctor.ledger import utc_now
from proctor.policy import capability_policies, compile_policies
from proctor.runtime import Runtime
from proctor.sandbox import process_start_time


def main() -> None:
    home, port = Path(sys.argv[1]), int(sys.argv[2])
    rt = Runtime.open(home)
    me = f"{os.uname().nodename}:{os.getpid()}:{process_start_time(os.getpid())}"
    with rt.store.write() as conn:
        conn.execute(
            "INSERT INTO runs (id, tenant, deployment, version, digest, environment,"
            " workload, approvals, backend, platform, status, reason, exit_code, attempt,"
            " limits, output_digest, started_at, ended_at, supervisor) VALUES"
            " ('r-crash', 'acme', 'svc', 1, 'sha256:00', 'sandbox', 'w', '[]', 'gvisor', NULL,"
            " 'running', NULL, NULL, 1, '{}', NULL, ?, NULL, ?)",
            (utc_now(), me),
        )
    entry = f"127.0.0.1:{port}"
    scope = RunScope(
        tenant="acme", run_id="r-crash", workload="spiffe://test/run/r-crash",
        deployment="svc", artifact="sha256:00", approvals=(), environment="sandbox",
        policies=compile_policies(capability_policies("acme", "svc", {"egress": [entry]})),
        ledger=rt.ledger, allowed_ranges=("127.0.0.0/8",),
    )  # fmt: skip
    answered = threading.Event()
    real = _record._completion

    async def dying(*args: Any, **kwargs: Any) -> bool:
        answered.wait(10)
        os.kill(os.getpid(), signal.SIGKILL)
        return await real(*args, **kwargs)

    _record._completion = dying  # type: ignore[assignment]
    broker = rt.make_broker().start()
    channel = broker.open_run(scope, ttl=60)
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(10)
        s.connect(str(channel.socket))
        s.sendall(f"GET http://{entry}/crash HTTP/1.1\r\nHost: {entry}\r\nConnection: close\r\n"
                  f"{TOKEN_HEADER}: {channel.token}\r\n\r\n".encode())  # fmt: skip
        data = b""
        while chunk := s.recv(65536):  # to the end the broker sends before its record
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    print("ANSWER", head.split(b"\r\n")[0].decode(), body.decode(), flush=True)
    answered.set()
    threading.Event().wait(30)  # the kill comes from the broker's thread


if __name__ == "__main__":
    main()
