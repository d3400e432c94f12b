"""Asked calls (issue 35, item 3) through the real API on loopback, the SDK and the real
CLI: list, show, approve, deny; the author, an agent and another tenant's approver
refused and recorded; exactly one answer counts, over HTTP and from the CLI at once.

The asks are made as the broker makes them (a ``call.ask`` event and its pending row in
one transaction, ``broker/_ask.py``); tests/integration/test_broker_ask.py drives the
broker itself, tests/e2e/test_asked_call_run.py a real run."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from proctor.client import Client
from proctor.errors import AlreadyAnswered, ControlDenied, NotFound
from proctor.governance import Ask, Runs, insert_pending
from proctor.ledger import Action, Actor, EventDraft
from proctor.sandbox import process_start_time
from tests.conftest import PROCTOR, run_cli
from tests.integration.test_api_support import ApiEnv, artifact_dir, build_env


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ApiEnv]:
    tmp = tmp_path_factory.mktemp("asks")
    e = build_env(tmp)
    rt = e.rt
    _, tok = rt.principals.create("acme", "coder", "agent", [], rt.operator,
                                  responsible="acme/dev")  # fmt: skip
    e.tokens[("acme", "coder")] = tok
    # An approver who also writes code: the author of the artifact the runs run.
    eve, tok = rt.principals.create("acme", "eve", "user", ["developer", "approver"], rt.operator)
    e.tokens[("acme", "eve")] = tok
    digest = rt.artifacts.submit("acme", artifact_dir(tmp, "asker"), eve.actor).digest
    e.__dict__["digest"] = digest
    yield e
    e.server.stop()
    e.rt.close()


def _ask(env: ApiEnv, run: str, path: str = "/v1/report") -> Ask:
    """A pending ask of run ``run``, recorded as the broker records one."""
    digest = env.__dict__["digest"]
    ask = Ask(id=f"ask_{run}", tenant="acme", run=run, deployment="asker", artifact=digest,
              action="http.request", resource="host/api.example.com:443",
              arguments={"host": "api.example.com", "port": 443, "method": "POST", "path": path},
              state="pending", created_at="2026-12-05T10:00:00.000Z",
              deadline="2026-12-05T10:05:00.000Z")  # fmt: skip
    workload = Actor("workload", f"spiffe://x/tenant/acme/deployment/asker/run/{run}")
    appended = env.rt.ledger.append(
        "acme",
        EventDraft(workload, Action.CALL_ASK, ask.resource, run=run, deployment="asker",
                   artifact=digest, details={"ask": ask.id, "arguments": ask.arguments}),
        hook=lambda conn: insert_pending(conn, ask),
    )  # fmt: skip
    with env.rt.store.write() as conn:
        conn.execute("UPDATE asks SET ask_seq = ? WHERE id = ?", (appended.seq, ask.id))
        # Its run, running in this (live) process: a home opened meanwhile (the CLI's)
        # closes the asks of runs that are over, never of one still running.
        owner = f"{os.uname().nodename}:{os.getpid()}:{process_start_time(os.getpid())}"
        Runs.insert(conn, (run, "acme", "asker", 1, digest, "production",
                           str(workload.id), "[]", "gvisor", "", "running", None, None, 1,
                           "{}", None, ask.created_at, None), owner)  # fmt: skip
    return ask


def _client(env: ApiEnv, name: str, tenant: str = "acme") -> Client:
    return Client(env.url, env.token(tenant, name))


def _answers(env: ApiEnv, ask: Ask) -> list[dict[str, Any]]:
    return [e for e in env.events("acme")  # type: ignore[misc]
            if e["action"] == "call.answer" and e["resource"] == f"ask/{ask.id}"]  # fmt: skip


def test_list_show_and_approve_through_the_api_and_the_sdk(env: ApiEnv) -> None:
    ask = _ask(env, "r-api1")
    alice = _client(env, "alice")
    listed = alice.asked_calls("acme", state="pending", run="r-api1")
    assert [a["id"] for a in listed] == [ask.id]
    one = _client(env, "aud").asked_call("acme", ask.id)  # an auditor reads it
    assert one["arguments"]["path"] == "/v1/report" and one["ask_seq"] is not None
    done = alice.answer_call("acme", ask.id, True, "fine")
    assert done["state"] == "approved" and done["answered_by"] == "acme/alice"
    (event,) = _answers(env, ask)
    assert event["decision"] == "allow" and event["details"]["answer"] == "approved"
    assert event["details"]["comment"] == "fine" and done["answer_seq"] == event["seq"]
    assert event["policies"] == ["control:approver"]
    # The second answer does not count, and is not recorded as one.
    with pytest.raises(AlreadyAnswered, match="already answered: approved by acme/alice"):
        _client(env, "bob").answer_call("acme", ask.id, False)
    assert len(_answers(env, ask)) == 1
    assert alice.asked_calls("acme", state="approved", run="r-api1")[0]["id"] == ask.id
    with env.http("acme", "alice") as http:
        r = http.post(f"/tenants/acme/asks/{ask.id}/deny", json={"comment": "late"})
        assert r.status_code == 409 and r.json()["error"]["code"] == "already_answered"
        assert http.get("/tenants/acme/asks", params={"state": "bogus"}).status_code == 422
        r = http.post(f"/tenants/acme/asks/{ask.id}/approve", json={"extra": 1})
        assert r.status_code == 422  # strict body


def test_the_author_an_agent_and_another_tenant_are_refused_and_recorded(env: ApiEnv) -> None:
    ask = _ask(env, "r-api2")
    with pytest.raises(ControlDenied, match="separation-of-duties-calls"):
        _client(env, "eve").answer_call("acme", ask.id, True)
    with pytest.raises(ControlDenied, match="an agent never answers"):
        _client(env, "coder").answer_call("acme", ask.id, True)
    with pytest.raises(ControlDenied):
        _client(env, "dev").answer_call("acme", ask.id, True)  # no role permits it
    with pytest.raises(NotFound):  # another tenant does not exist for the caller
        _client(env, "alice", "globex").answer_call("acme", ask.id, True)
    with pytest.raises(NotFound):
        _client(env, "alice").asked_call("acme", "ask_nosuch")
    refused = [e for e in env.events("acme") if e["action"] == "call.answer"  # type: ignore[misc]
               and e["decision"] == "deny"]  # fmt: skip
    by = {(e["actor"]["id"], tuple(e["policies"])) for e in refused}  # type: ignore[index]
    assert ("acme/eve", ("control:separation-of-duties-calls",)) in by
    assert ("acme/coder", ("proctor:ask:people-answer",)) in by
    assert any(who == "acme/dev" for who, _ in by)
    globex = [
        e
        for e in env.events("globex")  # type: ignore[misc]
        if (e["details"] or {}).get("action") == "call.answer"
    ]  # type: ignore[attr-defined]
    assert globex and globex[-1]["decision"] == "deny"  # recorded in the caller's own log
    assert _client(env, "alice").asked_call("acme", ask.id)["state"] == "pending"
    # An agent reads asked calls of its runs (the contract), it may not answer them.
    assert _client(env, "coder").asked_call("acme", ask.id)["id"] == ask.id


def test_the_cli_and_the_api_racing_exactly_one_answer_counts(env: ApiEnv) -> None:
    ask = _ask(env, "r-api3", "/v1/a\x1b[2Jb")
    home = str(env.home)
    shown = run_cli("ask", "list", "-t", "acme", "--run", "r-api3", home=env.home).out
    assert (
        ask.id in shown and "\\u001b[2J" in shown and "\x1b" not in shown
    )  # no escape reaches a terminal
    show = run_cli("ask", "show", ask.id, "-t", "acme", "--json", home=env.home)
    assert json.loads(show.out)["state"] == "pending"

    def by_cli() -> int:
        proc = subprocess.run([PROCTOR, "ask", "deny", ask.id, "-t", "acme", "--token",
                               env.token("acme", "bob"), "--home", home],
                              capture_output=True, timeout=120)  # fmt: skip
        return proc.returncode

    def by_api() -> int:
        try:
            _client(env, "alice").answer_call("acme", ask.id, True)
        except AlreadyAnswered:
            return 5
        return 0

    with ThreadPoolExecutor(2) as pool:
        codes = sorted(f.result() for f in [pool.submit(by_cli), pool.submit(by_api)])
    assert codes == [0, 5]
    assert len(_answers(env, ask)) == 1
    final = run_cli("ask", "show", ask.id, "-t", "acme", "--json", home=env.home)
    assert json.loads(final.out)["state"] in ("approved", "denied")
    again = run_cli("ask", "approve", ask.id, "-t", "acme", "--token", env.token("acme", "alice"),
                    home=env.home, check=False)  # fmt: skip
    assert again.code == 5 and "already answered" in again.err
    assert len(_answers(env, ask)) == 1


def test_an_ask_whose_run_ended_takes_no_answer_and_is_closed(env: ApiEnv) -> None:
    """A run recorded ended (its owner killed, swept by a process that is not serve)
    leaves its ask pending in the store: the next answer closes it instead of counting."""
    ask = _ask(env, "r-api4")
    with env.rt.store.write() as conn:
        conn.execute("UPDATE runs SET status = 'interrupted' WHERE id = 'r-api4'")
    with pytest.raises(AlreadyAnswered, match=r"already answered: abandoned \(event \d+\)"):
        _client(env, "alice").answer_call("acme", ask.id, True)
    (closed,) = _answers(env, ask)
    assert closed["details"]["answer"] == "abandoned" and "interrupted" in closed["reason"]
    assert closed["actor"] == {"type": "runtime", "id": "asks"}


def test_opening_the_home_closes_the_asks_of_runs_that_are_over(env: ApiEnv) -> None:
    """Any process that opens the home (a CLI command, not only serve) closes the asks
    of runs that are over, each with its event; a running run's ask is left waiting."""
    over, running = _ask(env, "r-api5"), _ask(env, "r-api6")
    with env.rt.store.write() as conn:
        conn.execute("UPDATE runs SET status = 'interrupted' WHERE id = 'r-api5'")
    shown = run_cli("ask", "show", over.id, "-t", "acme", "--json", home=env.home)
    assert json.loads(shown.out)["state"] == "abandoned"
    (closed,) = _answers(env, over)
    assert closed["details"]["answer"] == "abandoned"
    still = run_cli("ask", "show", running.id, "-t", "acme", "--json", home=env.home)
    assert json.loads(still.out)["state"] == "pending" and _answers(env, running) == []
