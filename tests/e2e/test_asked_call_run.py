"""An asked call in a real run (issue 35, item 3): guest code in a real sandbox calls a
loopback API through the real shim and the runtime's broker; the manifest marks the
host ``ask``. The call waits until a person answers; the run's end or a stopping
supervisor closes a pending ask (abandoned, recorded), never leaving it waiting."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import threading
import time
import zipfile
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from proctor.client import Client
from proctor.governance import Ask, Asks, RunRecord
from proctor.lifecycle import Runs, Supervisor
from tests.conftest import PROCTOR, run_cli, wait_until
from tests.e2e.conftest_gov import Gov, build_gov

pytestmark = pytest.mark.sandbox

BACKEND = "bubblewrap"

GUEST = r"""
import json, os, urllib.request, urllib.error
port = int(os.environ["UP_PORT"])
try:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/asked?n=1", timeout=120) as r:
        print(json.dumps({"status": r.status, "body": r.read().decode()}), flush=True)
except urllib.error.HTTPError as e:
    print(json.dumps({"status": e.code, "body": json.loads(e.read())}), flush=True)
"""


class _Up(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    seen: list[str]

    def log_message(self, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        self.seen.append(self.path)
        body = b"reached"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture
def upstream() -> Iterator[tuple[int, list[str]]]:
    seen: list[str] = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), type("Up", (_Up,), {"seen": seen}))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1], seen
    server.shutdown()
    server.server_close()


@pytest.fixture
def gov(tmp_path: Path) -> Iterator[Gov]:
    g = build_gov(tmp_path)
    yield g
    g.rt.close()


def _allow(gov: Gov, port: int) -> None:
    gov.rt.resources.allow_sandbox_host("acme", f"127.0.0.1:{port}", gov.op)
    gov.rt.allow_egress_range("acme", "127.0.0.1/32", gov.op)


def _deploy(gov: Gov, port: int, name: str, extra: str = "") -> None:
    rt, op = gov.rt, gov.op
    host = f"127.0.0.1:{port}"
    art = gov.artifact_dir(name, GUEST, f"""
        [egress]
        hosts = ["{host}"]
        [ask]
        egress = ["{host}"]
        timeout = "2m"
        {extra}
        """)  # fmt: skip
    digest = gov.submit("acme", art)
    rt.deployments.deploy("acme", rt.artifacts.get("acme", digest), name,
                          environment="sandbox", mode="job", instruction="test", actor=op)  # fmt: skip


def _start(gov: Gov, sup: Supervisor, name: str, port: int, out: list[bytes]) -> Future[RunRecord]:
    pool = ThreadPoolExecutor(1)
    future = pool.submit(sup.start, "acme", name, gov.principal("dev").actor,
                         on_stdout=out.append, env={"UP_PORT": str(port)})  # fmt: skip
    pool.shutdown(wait=False)
    return future


def _pending(asks: Asks) -> Ask:
    deadline = time.monotonic() + 90
    while not (found := asks.find("acme", state="pending")):
        assert time.monotonic() < deadline, "no ask came"
        time.sleep(0.1)
    return found[0]


def _events(gov: Gov, run: str) -> list[dict[str, Any]]:
    return [e for e in map(json.loads, gov.rt.ledger.entries("acme")) if e.get("run") == run]


def test_an_asked_call_in_a_real_run_waits_for_the_approver(
    gov: Gov, upstream: tuple[int, list[str]]
) -> None:
    port, seen = upstream
    _allow(gov, port)
    _deploy(gov, port, "asker")
    asks = Asks(gov.rt.store, gov.rt.ledger, gov.rt.control)
    out: list[bytes] = []
    with gov.rt.make_broker() as broker:
        sup = Supervisor(gov.rt, broker, BACKEND)
        running = _start(gov, sup, "asker", port, out)
        ask = _pending(asks)
        assert ask.arguments["target"] == "/asked?n=1" and seen == []
        alice = gov.principal("alice")
        asks.answer("acme", ask.id, True, actor=alice.actor, principal=alice,
                    trust_domain=gov.rt.config.trust_domain)  # fmt: skip
        record = running.result(timeout=120)
    assert record.status == "succeeded", record
    assert json.loads(b"".join(out)) == {"status": 200, "body": "reached"}
    assert seen == ["/asked?n=1"]
    events = _events(gov, record.id)
    (asked,) = [e for e in events if e["action"] == "call.ask"]
    (answered,) = [e for e in events if e["action"] == "call.answer"]
    (call,) = [e for e in events if e["action"] == "http.request"]
    assert asked["seq"] < answered["seq"] < call["seq"]
    assert call["details"]["ask"]["seq"] == asked["seq"]
    assert call["details"]["ask"]["answer_seq"] == answered["seq"]
    # runs show shows the chain: the ask, its answer, the call that followed.
    shown = run_cli("runs", "show", record.id, "-t", "acme", home=gov.home).out
    assert (
        f"asked {ask.id} (event {asked['seq']}): http.request {call['resource']}: approved"
        f" by acme/alice (event {answered['seq']}), then event {call['seq']}"
    ) in shown
    doc = json.loads(run_cli("runs", "show", record.id, "-t", "acme", "--json", home=gov.home).out)
    (shown_call,) = [c for c in doc["calls"] if c["seq"] == call["seq"]]
    assert shown_call["ask"]["answer_seq"] == answered["seq"]
    # The evidence pack holds the chain, and verifies (the answer's role policy with it).
    pack = gov.home.parent / "asked-pack.zip"
    run_cli("evidence", "export", "-t", "acme", "--from", "2000-01-01", "--to", "2100-01-01",
            "-o", str(pack), home=gov.home)  # fmt: skip
    run_cli("evidence", "verify", str(pack), "--key", gov.rt.ledger.vkey(), home=gov.home)
    with zipfile.ZipFile(pack) as z:
        packed = [json.loads(line) for line in z.read("events/events.jsonl").splitlines()]
    assert [e["seq"] for e in packed if e.get("run") == record.id
            and e["action"] in ("call.ask", "call.answer", "http.request")] == [
        asked["seq"], answered["seq"], call["seq"]]  # fmt: skip


def test_a_run_that_ends_or_is_stopped_while_a_call_waits_abandons_its_ask(
    gov: Gov, upstream: tuple[int, list[str]]
) -> None:
    port, seen = upstream
    _allow(gov, port)
    _deploy(gov, port, "timedout", '[limits]\ntimeout = "4s"')
    _deploy(gov, port, "stopped")
    asks = Asks(gov.rt.store, gov.rt.ledger, gov.rt.control)
    with gov.rt.make_broker() as broker:
        sup = Supervisor(gov.rt, broker, BACKEND)
        # Its wall clock ends the run while the call waits.
        ended = _start(gov, sup, "timedout", port, []).result(timeout=120)
        # A serve told to stop stops its runs, a waiting one too.
        running = _start(gov, sup, "stopped", port, [])
        waiting = _pending(asks)
        sup.shutdown("serve is stopping")
        stopped = running.result(timeout=120)
    assert seen == []
    assert stopped.status == "interrupted"
    for record in (ended, stopped):
        events = _events(gov, record.id)
        actions = [e["action"] for e in events]
        assert actions.index("call.ask") < actions.index("call.answer") < actions.index("run.end")
        (answered,) = [e for e in events if e["action"] == "call.answer"]
        assert (
            answered["details"]["answer"] == "abandoned" and answered["actor"]["type"] == "runtime"
        )
        (ask,) = asks.find("acme", run=record.id)
        assert ask.state == "abandoned" and ask.answer_seq == answered["seq"]
    assert waiting.run == stopped.id
    assert asks.find("acme", state="pending") == []


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_serve_killed_while_a_call_waits_is_restarted_and_closes_the_run_and_its_ask(
    gov: Gov, upstream: tuple[int, list[str]]
) -> None:
    """`proctor serve` SIGKILLed while its run's call waits for an answer: the next
    serve records the run interrupted and the ask abandoned; nothing is left waiting
    and the call never went out."""
    port, seen = upstream
    _allow(gov, port)
    # Started through serve's API: the guest is told its port in its code, not its env.
    baked = GUEST.replace('int(os.environ["UP_PORT"])', str(port))
    art = gov.artifact_dir("killed", baked, f"""
        [egress]
        hosts = ["127.0.0.1:{port}"]
        [ask]
        egress = ["127.0.0.1:{port}"]
        """)  # fmt: skip
    digest = gov.submit("acme", art)
    gov.rt.deployments.deploy("acme", gov.rt.artifacts.get("acme", digest), "killed",
                              environment="sandbox", mode="job", instruction="test",
                              actor=gov.op)  # fmt: skip
    asks = Asks(gov.rt.store, gov.rt.ledger, gov.rt.control)
    env = dict(os.environ, PROCTOR_HOME=str(gov.home))
    api = _free_port()
    first = subprocess.Popen([PROCTOR, "serve", "--backend", BACKEND, "--api-port", str(api)],
                             env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    runner = None
    try:
        url = f"http://127.0.0.1:{api}"
        wait_until(lambda: _up(url, gov.token("dev")), "serve's API", 60)
        runner = subprocess.Popen([PROCTOR, "--server", url, "run", "killed", "-t", "acme",
                                   "--token", gov.token("dev")], env=env,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
        waiting = _pending(asks)
        first.kill()  # SIGKILL: nothing of serve's own ending runs
        first.wait(timeout=30)
        assert asks.get("acme", waiting.id).state == "pending"  # left by the dead serve
        second = subprocess.Popen([PROCTOR, "serve", "--backend", BACKEND, "--no-api"], env=env,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
        try:
            wait_until(lambda: asks.get("acme", waiting.id).state == "abandoned",
                       "the ask closed by the next serve", 60)  # fmt: skip
        finally:
            second.send_signal(signal.SIGTERM)
            second.wait(timeout=60)
    finally:
        for proc in (first, runner):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)
    assert seen == []
    run = waiting.run
    assert Runs(gov.rt).get("acme", run).status == "interrupted"
    events = _events(gov, run)
    actions = [e["action"] for e in events]
    assert actions.count("run.end") == 1 and actions.count("call.answer") == 1
    (answered,) = [e for e in events if e["action"] == "call.answer"]
    assert answered["details"]["answer"] == "abandoned" and "interrupted" in answered["reason"]
    assert actions.index("call.ask") < actions.index("call.answer")
    assert asks.find("acme", state="pending") == []


def _up(url: str, token: str) -> bool:
    try:
        Client(url, token).health()
    except Exception:
        return False
    return True
