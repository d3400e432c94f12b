"""Calls that ask a person (capabilities marked ``ask``), on a real broker.

A real broker on its Unix socket with its egress proxy, a real ledger and store,
real Cedar, and a real HTTP upstream on loopback; the guest's side is a raw
socket, so the test sees exactly what crosses it. The answers are given through
``governance.Asks``, as the CLI and the API give them.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import socket
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from proctor.broker import Broker, CallDenied, EgressProxy, Handlers, RunScope, write_object
from proctor.broker._ask import AskGate, AskRules
from proctor.broker._fair import run_blocking
from proctor.errors import AlreadyAnswered, ControlDenied
from proctor.governance import Ask, Asks, ControlPlane
from proctor.governance._principals import Principal
from proctor.guest.protocol import TOKEN_HEADER
from proctor.ledger import Action, Actor, EventDraft
from proctor.policy import capability_policies, compile_policies
from tests.conftest import LedgerEnv, draft
from tests.integration.test_broker_core import _scope
from tests.integration.test_broker_sql import default_caps, events, make_dataset, make_scope, sql

DIGEST = "sha256:" + "ab" * 32
AUTHOR = Actor("user", "acme/bob")
ALICE = Principal("acme", "alice", "user", ("approver",))
CAROL = Principal("acme", "carol", "user", ("approver",))
BOB = Principal("acme", "bob", "user", ("approver", "developer"))


class _Up(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    seen: list[str]

    def log_message(self, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        self.seen.append(self.path)
        body = f"got {self.path}".encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture
def upstream() -> Iterator[tuple[int, list[str]]]:
    seen: list[str] = []
    handler = type("Up", (_Up,), {"seen": seen})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1], seen
    server.shutdown()
    server.server_close()


class World:
    """A broker serving runs whose calls to the upstream ask, and the asks' people."""

    def __init__(self, env: LedgerEnv, port: int, seen: list[str], broker: Broker) -> None:
        self.env, self.port, self.seen, self.broker = env, port, seen, broker
        self.entry = f"127.0.0.1:{port}"
        self.asks = Asks(env.store, env.ledger, ControlPlane(env.ledger))

    def open(self, run: str, timeout: float = 60.0) -> tuple[RunScope, str, Any]:
        scope = _scope(self.env.ledger, run, allowed_ranges=("127.0.0.0/8",))
        scope.policies = compile_policies(
            capability_policies("acme", "churn", {"egress": [self.entry]})
        )
        scope.asks = AskGate(AskRules(egress=(self.entry,), timeout=timeout), self.env.store)
        channel = self.broker.open_run(scope, ttl=120)
        return scope, channel.token, channel

    def get(self, channel: Any, path: str) -> tuple[str, dict[str, str], bytes]:
        with socket.socket(socket.AF_UNIX) as s:
            s.settimeout(60)
            s.connect(str(channel.socket))
            s.sendall(f"GET http://{self.entry}{path} HTTP/1.1\r\nHost: {self.entry}\r\n"
                      f"{TOKEN_HEADER}: {channel.token}\r\nConnection: close\r\n\r\n".encode())  # fmt: skip
            return _read_response(s.makefile("rb"))

    def pending(self, run: str, n: int = 1) -> list[Ask]:
        return _until(lambda: (a if len(a := self.asks.find("acme", run=run, state="pending")) >= n
                               else None))  # fmt: skip

    def events(self) -> list[dict[str, Any]]:
        return [json.loads(e) for e in self.env.ledger.entries("acme")]


def _until(probe: Callable[[], Any], timeout: float = 30.0) -> Any:
    deadline = time.monotonic() + timeout
    while (found := probe()) is None:
        assert time.monotonic() < deadline, "not there in time"
        time.sleep(0.02)
    return found


def _read_response(f: Any) -> tuple[str, dict[str, str], bytes]:
    status = f.readline().decode().strip()
    headers: dict[str, str] = {}
    while (line := f.readline()) not in (b"\r\n", b""):
        k, _, v = line.decode().partition(":")
        headers[k.strip().lower()] = v.strip()
    return status, headers, f.read()


@pytest.fixture
def world(ledger_env: LedgerEnv, upstream: tuple[int, list[str]]) -> Iterator[World]:
    ledger_env.ledger.create_log("acme", draft(0))
    # The code's author, as the signed record names them.
    ledger_env.ledger.append("acme", EventDraft(AUTHOR, Action.ARTIFACT_SUBMIT, f"artifact/{DIGEST}",
                                                artifact=DIGEST))  # fmt: skip
    proxy = EgressProxy(None, connect_timeout=5)
    with Broker(Handlers.for_proxy(proxy), os.urandom(32)) as broker:
        yield World(ledger_env, upstream[0], upstream[1], broker)


def _in_thread(fn: Callable[[], Any]) -> Any:
    pool = ThreadPoolExecutor(1)
    future = pool.submit(fn)
    pool.shutdown(wait=False)
    return future


def test_an_approved_call_reaches_the_upstream_only_after_approval_one_chain(world: World) -> None:
    _, _, channel = world.open("q1")
    try:
        answer = _in_thread(lambda: world.get(channel, "/asked/one?x=1"))
        (ask,) = world.pending("q1")
        assert ask.action == "http.request" and ask.run == "q1"
        assert ask.arguments == {"host": "127.0.0.1", "port": world.port, "method": "GET",
                                 "scheme": "http", "path": "/asked/one", "address": "127.0.0.1",
                                 "target": "/asked/one?x=1",
                                 "body": {"framing": "none", "bytes": 0}}  # fmt: skip
        time.sleep(0.3)
        assert world.seen == [] and not answer.done()  # it waits: nothing went out
        done = world.asks.answer("acme", ask.id, True, actor=ALICE.actor, principal=ALICE,
                                 comment="ok for the report", trust_domain="test.local")  # fmt: skip
        assert done.state == "approved" and done.answered_by == "acme/alice"
        status, _, body = answer.result(timeout=30)
    finally:
        world.broker.close_run("q1")
    assert status == "HTTP/1.1 200 OK" and body == b"got /asked/one?x=1"
    assert world.seen == ["/asked/one?x=1"]
    events = world.events()
    (asked,) = [e for e in events if e["action"] == "call.ask"]
    (answered,) = [e for e in events if e["action"] == "call.answer"]
    (call,) = [e for e in events if e["action"] == "http.request"]
    assert asked["seq"] < answered["seq"] < call["seq"]
    assert (
        asked["details"]["ask"] == ask.id
        and asked["details"]["arguments"]["target"] == "/asked/one?x=1"
    )
    assert (
        answered["actor"] == {"type": "user", "id": "acme/alice"}
        and answered["decision"] == "allow"
    )
    assert (
        answered["details"]["answer"] == "approved"
        and answered["details"]["ask_seq"] == asked["seq"]
    )
    assert answered["details"]["comment"] == "ok for the report"
    assert call["decision"] == "allow"
    assert call["details"]["ask"] == {"id": ask.id, "seq": asked["seq"], "answer": "approved",
                                      "answer_seq": answered["seq"], "answered_by": "acme/alice"}  # fmt: skip
    final = world.asks.get("acme", ask.id)
    assert (final.ask_seq, final.answer_seq) == (asked["seq"], answered["seq"])


def test_a_denied_call_never_reaches_the_upstream_refused_naming_its_event(world: World) -> None:
    _, _, channel = world.open("q2")
    try:
        answer = _in_thread(lambda: world.get(channel, "/asked/two"))
        (ask,) = world.pending("q2")
        world.asks.answer("acme", ask.id, False, actor=ALICE.actor, principal=ALICE,
                          trust_domain="test.local")  # fmt: skip
        status, headers, body = answer.result(timeout=30)
    finally:
        world.broker.close_run("q2")
    assert status.startswith("HTTP/1.1 403") and world.seen == []
    call = [e for e in world.events() if e["action"] == "http.request"][-1]
    answered = [e for e in world.events() if e["action"] == "call.answer"][-1]
    assert call["decision"] == "deny" and call["policies"] == ["proctor:ask"]
    assert (
        "denied by acme/alice" in call["reason"]
        and call["details"]["ask"]["answer_seq"] == answered["seq"]
    )
    refusal = json.loads(body)
    assert refusal["seq"] == call["seq"] and str(call["seq"]) in headers["x-proctor-refusal"]


def test_an_unanswered_call_times_out_refused(world: World) -> None:
    _, _, channel = world.open("q3", timeout=0.5)
    try:
        status, _, body = world.get(channel, "/asked/three")
    finally:
        world.broker.close_run("q3")
    assert status.startswith("HTTP/1.1 403") and world.seen == []
    events = world.events()
    (answered,) = [e for e in events if e["action"] == "call.answer"]
    assert answered["details"]["answer"] == "timed_out" and answered["actor"]["type"] == "runtime"
    call = [e for e in events if e["action"] == "http.request"][-1]
    assert call["decision"] == "deny" and "timed out" in call["reason"]
    assert json.loads(body)["seq"] == call["seq"]
    (ask,) = world.asks.find("acme", run="q3")
    assert ask.state == "timed_out" and ask.answer_seq == answered["seq"]
    # A late answer does not count, and is not recorded as one.
    with pytest.raises(AlreadyAnswered, match="already answered: timed out"):
        world.asks.answer("acme", ask.id, True, actor=ALICE.actor, principal=ALICE,
                          trust_domain="test.local")  # fmt: skip
    assert len([e for e in world.events() if e["action"] == "call.answer"]) == 1


def test_the_author_and_an_agent_may_not_answer_refused_and_recorded(world: World) -> None:
    _, _, channel = world.open("q4")
    agent = Principal("acme", "coder", "agent", ("agent",), responsible="acme/bob")
    try:
        answer = _in_thread(lambda: world.get(channel, "/asked/four"))
        (ask,) = world.pending("q4")
        with pytest.raises(ControlDenied, match="separation-of-duties"):
            world.asks.answer("acme", ask.id, True, actor=BOB.actor, principal=BOB,
                              trust_domain="test.local")  # fmt: skip
        with pytest.raises(ControlDenied, match="an agent never answers"):
            world.asks.answer("acme", ask.id, True, actor=agent.actor, principal=agent,
                              trust_domain="test.local")  # fmt: skip
        # The local operator is not decided by Cedar, but is held to the same rule.
        with pytest.raises(ControlDenied, match="author of the code"):
            world.asks.answer("acme", ask.id, True, actor=AUTHOR)
        assert world.asks.get("acme", ask.id).state == "pending" and world.seen == []
        world.asks.answer("acme", ask.id, False, actor=ALICE.actor, principal=ALICE,
                          trust_domain="test.local")  # fmt: skip
        assert answer.result(timeout=30)[0].startswith("HTTP/1.1 403")
    finally:
        world.broker.close_run("q4")
    refused = [
        e for e in world.events() if e["action"] == "call.answer" and e["decision"] == "deny"
    ]
    assert [e["actor"]["id"] for e in refused] == ["acme/bob", "acme/coder", "acme/bob"]
    assert refused[0]["policies"] == ["control:separation-of-duties-calls"]
    assert refused[1]["policies"] == ["proctor:ask:people-answer"]
    assert refused[2]["policies"] == ["proctor:ask:not-the-author"]
    assert world.seen == []


def test_two_approvers_racing_exactly_one_answer_counts(world: World) -> None:
    _, _, channel = world.open("q5")
    try:
        answer = _in_thread(lambda: world.get(channel, "/asked/five"))
        (ask,) = world.pending("q5")
        start = threading.Barrier(2)

        def give(who: Principal, approve: bool) -> str:
            start.wait()
            try:
                world.asks.answer("acme", ask.id, approve, actor=who.actor, principal=who,
                                  trust_domain="test.local")  # fmt: skip
            except AlreadyAnswered:
                return "lost"
            return "won"

        with ThreadPoolExecutor(2) as pool:
            outcomes = list(pool.map(give, (ALICE, CAROL), (True, False)))
        status = answer.result(timeout=30)[0]
    finally:
        world.broker.close_run("q5")
    assert sorted(outcomes) == ["lost", "won"]
    answers = [e for e in world.events() if e["action"] == "call.answer"]
    assert len(answers) == 1  # the loser recorded nothing
    winner = (ALICE, CAROL)[outcomes.index("won")]
    assert answers[0]["actor"]["id"] == winner.id
    final = world.asks.get("acme", ask.id)
    assert final.answered_by == winner.id and final.answer_seq == answers[0]["seq"]
    assert status.startswith("HTTP/1.1 200" if winner is ALICE else "HTTP/1.1 403")


def test_waiting_calls_hold_no_worker_nor_the_loop(world: World) -> None:
    """More calls wait than the fair pool gives one run (4) and one tenant (8): if a
    wait held a worker, the same run's and another run's work would not be served."""
    _, _, channel = world.open("q6")
    _, _, other = world.open("q7")
    waiting = 10
    try:
        answers = [
            _in_thread(lambda i=i: world.get(channel, f"/asked/w{i}")) for i in range(waiting)
        ]
        asks = world.pending("q6", waiting)
        scope = world.broker._runs["q6"].scope  # the same run's blocking work, on the fair pool
        done = asyncio.run_coroutine_threadsafe(run_blocking(scope, lambda: "served"),
                                                world.broker._loop)  # fmt: skip
        assert done.result(timeout=10) == "served"
        # The loop serves the same run's and another run's calls meanwhile.
        with socket.socket(socket.AF_UNIX) as s:
            s.settimeout(10)
            s.connect(str(channel.socket))
            s.sendall(f"GET /v1/whoami HTTP/1.1\r\n{TOKEN_HEADER}: {channel.token}\r\n"
                      "Connection: close\r\n\r\n".encode())  # fmt: skip
            assert _read_response(s.makefile("rb"))[0] == "HTTP/1.1 200 OK"
        other_answer = _in_thread(lambda: world.get(other, "/asked/other"))
        (other_ask,) = world.pending("q7")
        world.asks.answer("acme", other_ask.id, True, actor=ALICE.actor, principal=ALICE,
                          trust_domain="test.local")  # fmt: skip
        assert other_answer.result(timeout=30)[2] == b"got /asked/other"
        assert all(not a.done() for a in answers)  # still waiting, every one
        for ask in asks:
            world.asks.answer("acme", ask.id, True, actor=ALICE.actor, principal=ALICE,
                              trust_domain="test.local")  # fmt: skip
        assert sorted(a.result(timeout=30)[2] for a in answers) == sorted(
            f"got /asked/w{i}".encode() for i in range(waiting)
        )
    finally:
        world.broker.close_run("q6")
        world.broker.close_run("q7")


# -- a bucket write (asked once staged: its SHA-256 named) and a table write ------------


@pytest.fixture
def held(ledger_env: LedgerEnv, tmp_path: Path) -> Iterator[tuple[RunScope, Path, Asks]]:
    root = tmp_path / "buckets"
    (root / "reports").mkdir(parents=True)
    scope = make_scope(ledger_env, make_dataset(tmp_path / "crm.db"), caps=default_caps("read-write"),
                       buckets_dir=root)  # fmt: skip
    rules = AskRules(
        buckets=frozenset({"reports"}), tables=frozenset({"crm.customers"}), timeout=60
    )
    scope.asks = AskGate(rules, ledger_env.store)
    yield scope, root, Asks(ledger_env.store, ledger_env.ledger, ControlPlane(ledger_env.ledger))


def _answer_when_asked(asks: Asks, approve: bool) -> Any:
    def answer() -> Ask:
        (ask,) = _until(lambda: asks.find("acme", state="pending") or None)
        return asks.answer("acme", ask.id, approve, actor=ALICE.actor, principal=ALICE,
                           trust_domain="test.local")  # fmt: skip

    return _in_thread(answer)


def test_a_bucket_write_is_asked_with_its_digest_and_written_only_if_approved(
    held: tuple[RunScope, Path, Asks], ledger_env: LedgerEnv
) -> None:
    scope, root, asks = held
    data = b"the quarterly numbers\n"
    digest = hashlib.sha256(data).hexdigest()
    denied = _answer_when_asked(asks, False)
    with pytest.raises(CallDenied, match="asked call denied by acme/alice"):
        asyncio.run(write_object(scope, "reports", "q1.md", data))
    ask = denied.result(timeout=30)
    assert ask.arguments == {
        "bucket": "reports",
        "key": "q1.md",
        "sha256": digest,
        "bytes": len(data),
    }
    assert sorted(p.name for p in (root / "reports").iterdir()) == []  # staged, then removed
    approved = _answer_when_asked(asks, True)
    assert asyncio.run(write_object(scope, "reports", "q1.md", data))["sha256"] == digest
    approved.result(timeout=30)
    assert (root / "reports" / "q1.md").read_bytes() == data
    writes = [e for e in events(ledger_env) if e["action"] == "file.write"]
    assert [w["decision"] for w in writes] == ["deny", "allow"]
    assert writes[1]["details"]["ask"]["answer"] == "approved"


def test_a_table_write_is_asked_the_statement_kept_out_of_the_log(
    held: tuple[RunScope, Path, Asks], ledger_env: LedgerEnv, tmp_path: Path
) -> None:
    scope, _, asks = held
    statement = "UPDATE customers SET plan = ? WHERE id = ?"
    denied = _answer_when_asked(asks, False)
    with pytest.raises(CallDenied):
        sql(scope, statement, ["secret-plan-value", 1])
    ask = denied.result(timeout=30)
    assert ask.arguments["statement"] == statement and ask.arguments["tables"] == ["customers"]
    assert ask.arguments["params"] == ["secret-plan-value", 1]
    logged = [e for e in events(ledger_env) if e["action"] == "call.ask"][-1]
    assert logged["details"]["arguments"]["statement_sha256"] == hashlib.sha256(
        statement.encode()).hexdigest()  # fmt: skip
    assert "secret-plan-value" not in json.dumps(events(ledger_env))  # the value: the row only
    with sqlite3.connect(tmp_path / "crm.db") as db:
        assert (
            db.execute("SELECT plan FROM customers WHERE id = 1").fetchone()[0]
            != "secret-plan-value"
        )
    # A table the manifest does not mark ask is written at once.
    assert (
        sql(scope, "INSERT INTO events (customer, kind) VALUES (?, ?)", [1, "x"])["rows_affected"]
        == 1
    )
    approved = _answer_when_asked(asks, True)
    assert sql(scope, statement, ["gold", 1])["rows_affected"] == 1
    approved.result(timeout=30)
    with sqlite3.connect(tmp_path / "crm.db") as db:
        assert db.execute("SELECT plan FROM customers WHERE id = 1").fetchone()[0] == "gold"


def test_an_approved_call_whose_guest_went_away_is_not_made(world: World) -> None:
    _, _, channel = world.open("q8")
    try:
        with socket.socket(socket.AF_UNIX) as s:
            s.connect(str(channel.socket))
            s.sendall(f"GET http://{world.entry}/asked/gone HTTP/1.1\r\nHost: {world.entry}\r\n"
                      f"{TOKEN_HEADER}: {channel.token}\r\n\r\n".encode())  # fmt: skip
            (ask,) = world.pending("q8")
        # The guest has gone; the approver, not knowing, approves.
        world.asks.answer("acme", ask.id, True, actor=ALICE.actor, principal=ALICE,
                          trust_domain="test.local")  # fmt: skip
        call = _until(lambda: next((e for e in world.events() if e["action"] == "http.request"),
                                   None))  # fmt: skip
    finally:
        world.broker.close_run("q8")
    assert call["decision"] == "deny" and "closed its connection" in call["reason"]
    assert call["details"]["ask"]["answer"] == "approved"
    assert world.seen == []


def test_a_run_cannot_bury_its_approvers_in_asks(world: World) -> None:
    _, _, channel = world.open("q9")
    gate = world.broker._runs["q9"].scope.asks
    assert gate is not None
    gate.max_waiting = 2
    try:
        waiting = [_in_thread(lambda i=i: world.get(channel, f"/asked/b{i}")) for i in range(2)]
        asks = world.pending("q9", 2)
        status, _, body = world.get(channel, "/asked/one-too-many")  # answered at once
        assert status.startswith("HTTP/1.1 403")
        assert "wait for an answer already (at most 2)" in json.loads(body)["message"]
        for ask in asks:
            world.asks.answer("acme", ask.id, False, actor=ALICE.actor, principal=ALICE,
                              trust_domain="test.local")  # fmt: skip
        assert all(w.result(timeout=30)[0].startswith("HTTP/1.1 403") for w in waiting)
    finally:
        world.broker.close_run("q9")
    assert len([e for e in world.events() if e["action"] == "call.ask"]) == 2
    assert world.seen == []


def test_a_tunnel_is_asked_by_host_and_port_and_opened_only_once_approved(world: World) -> None:
    _, _, channel = world.open("q10")

    def tunnel() -> tuple[bytes, bytes]:
        with socket.socket(socket.AF_UNIX) as s:
            s.settimeout(60)
            s.connect(str(channel.socket))
            s.sendall(f"CONNECT {world.entry} HTTP/1.1\r\nHost: {world.entry}\r\n"
                      f"{TOKEN_HEADER}: {channel.token}\r\n\r\n".encode())  # fmt: skip
            f = s.makefile("rb")
            status = f.readline()
            while f.readline() not in (b"\r\n", b""):
                pass
            s.sendall(b"GET /through HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            return status, f.read()

    try:
        answer = _in_thread(tunnel)
        (ask,) = world.pending("q10")
        assert ask.arguments == {"host": "127.0.0.1", "port": world.port, "method": "CONNECT",
                                 "address": "127.0.0.1"}  # fmt: skip
        assert world.seen == []
        world.asks.answer("acme", ask.id, True, actor=ALICE.actor, principal=ALICE,
                          trust_domain="test.local")  # fmt: skip
        status, body = answer.result(timeout=30)
    finally:
        world.broker.close_run("q10")
    assert status.startswith(b"HTTP/1.1 200") and body.endswith(b"got /through")
    assert world.seen == ["/through"]
