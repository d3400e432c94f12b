"""One durable event on a call's hot path: the decision is durable before the
upstream is contacted, the answer goes out whole, and only then the completion
record is written. A broker killed in between leaves a decision whose completion
the next owner records as incomplete (``Runtime.close_orphaned_runs``)."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, ClassVar

import pytest

from proctor.runtime import Runtime
from tests.e2e.conftest_gov import build_gov

CHILD = Path(__file__).with_name("_completion_child.py")


class _Up(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    served: ClassVar[list[str]] = []

    def log_message(self, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        _Up.served.append(self.path)
        body = b"the answer"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture
def upstream() -> Iterator[int]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Up)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


def test_a_broker_killed_between_answer_and_completion_leaves_it_marked_incomplete(
    tmp_path: Path, upstream: int
) -> None:
    gov = build_gov(tmp_path)
    gov.rt.close()
    child = subprocess.run(
        [sys.executable, str(CHILD), str(gov.home), str(upstream)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert child.returncode == -9, child.stderr[-2000:]
    # The guest had the whole answer, and its end, before the completion record.
    assert "ANSWER HTTP/1.1 200 OK the answer" in child.stdout, child.stderr[-2000:]
    assert _Up.served == ["/crash"]
    rt = Runtime.open(gov.home)  # opening a home closes its dead owners' runs
    try:
        events = [json.loads(e) for e in rt.ledger.entries("acme")]
        decisions = [e for e in events if e["action"] == "http.request" and e["run"] == "r-crash"]
        assert [e["decision"] for e in decisions] == ["allow"]
        ends = [e for e in events if e["action"] == "http.request.end"]
        assert len(ends) == 1
        assert ends[0]["details"]["decision_seq"] == decisions[0]["seq"]
        assert ends[0]["details"]["incomplete"] is True
        assert ends[0]["reason"].startswith("incomplete:")
        # Then the run's end: the completion comes first, inside the run.
        run_end = next(e for e in events if e["action"] == "run.end" and e["run"] == "r-crash")
        assert run_end["seq"] > ends[0]["seq"]
        # A second sweep adds nothing.
        assert rt.close_orphaned_runs(other_hosts=True) == []
    finally:
        rt.close()
