"""Issue 31, item 5: a guest cannot grow the ledger without bound.

The rate limit bounds events per second, not their total (1,500 calls of one run
were all recorded). Two bounds hold the total, on a real broker and real sockets:
a run's calls in all (``limits.calls``), and the tenant's events per UTC day (its
ledger quota). Past either, every call is refused, the refusal is recorded once
(once per run; once per tenant and day, a restarted broker included) and every
refused answer names that one event. Control-plane actions are never refused by
the quota. The same with a real sandbox: ``test_lifecycle_totals.py``.
"""

from __future__ import annotations

import json
import os
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from proctor.broker import Broker, BrokerError, RunScope
from proctor.broker._scope import CALL_BOUND_RULE, DEFAULT_CALL_BOUND, LEDGER_QUOTA_RULE
from proctor.errors import UsageError
from proctor.governance import Tenants
from proctor.governance._manifest import DEFAULT_CALLS
from proctor.governance._tenants import DEFAULT_LEDGER_QUOTA, MAX_LEDGER_QUOTA
from proctor.ledger import SYSTEM_LOG, Ledger
from tests.conftest import OPERATOR, LedgerEnv, draft
from tests.e2e.conftest_gov import Gov, build_gov
from tests.integration.test_broker_core import NO_CALLS, _scope


def _call(path: Path, token: str) -> tuple[int, dict[str, str], dict[str, Any]]:
    """One whoami on a run's socket, a connection of its own: (status, headers, body)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(30)
        s.connect(str(path))
        s.sendall(f"GET /v1/whoami HTTP/1.1\r\nProctor-Token: {token}\r\n\r\n".encode())
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    raw_head, _, body = data.partition(b"\r\n\r\n")
    lines = raw_head.decode().split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:])
    headers[":status-line"] = lines[0]
    return int(lines[0].split(" ")[1]), headers, json.loads(body)


def _events(led: Ledger, log: str = "acme") -> list[dict[str, Any]]:
    return [json.loads(e) for e in led.entries(log)]


@pytest.fixture
def gov(tmp_path: Path) -> Iterator[Gov]:
    g = build_gov(tmp_path)
    yield g
    g.rt.close()


def test_the_default_bound_is_the_manifests_and_a_broker_refuses_a_nonsensical_one() -> None:
    assert DEFAULT_CALL_BOUND == DEFAULT_CALLS == 10_000
    for bad in (0, -1, True, 2.5):
        with pytest.raises(BrokerError, match="call bound"):
            Broker(NO_CALLS, os.urandom(32), call_bound=bad)  # type: ignore[arg-type]


def test_a_run_past_its_bound_is_refused_and_recorded_once(gov: Gov) -> None:
    led = gov.rt.ledger
    with Broker(NO_CALLS, os.urandom(32)) as b:
        channel = b.open_run(_scope(led, "r1", call_bound=5), ttl=60)
        # Every call on a connection of its own: reconnecting does not reset the count.
        first = [_call(channel.socket, channel.token) for _ in range(8)]
        # A burst of concurrent calls past the bound, and forged tokens (charged too).
        results: list[int] = []
        lock = threading.Lock()

        def worker(token: str) -> None:
            for _ in range(10):
                status = _call(channel.socket, token)[0]
                with lock:
                    results.append(status)

        threads = [threading.Thread(target=worker, args=(t,))
                   for t in (channel.token, channel.token, "pt1.r1.1.forged")]  # fmt: skip
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        b.close_run("r1")

    assert [s for s, _, _ in first] == [200] * 5 + [403] * 3
    assert results == [403] * 30
    evs = [e for e in _events(led) if e.get("run") == "r1"]
    assert [e["action"] for e in evs] == ["broker.whoami"] * 5 + ["broker.call_bound"]
    (bound,) = [e for e in evs if e["action"] == "broker.call_bound"]
    assert bound["decision"] == "deny" and bound["policies"] == [CALL_BOUND_RULE]
    assert bound["details"] == {"bound": 5, "calls": 5, "policy_version": bound["details"][
        "policy_version"]}  # fmt: skip
    assert bound["reason"].startswith("refused: run r1 made all of its 5 calls (limits.calls)")
    # Every refused answer names the one event, in the body, the header and the status line.
    for _, headers, body in first[5:]:
        assert body["error"] == "denied" and body["policies"] == [CALL_BOUND_RULE]
        assert "5 calls" in body["message"] and "limits.calls" in body["message"]
        assert (body["seq"], body["reason"]) == (bound["seq"], bound["reason"])
        assert headers["X-Proctor-Refusal"].startswith(f"seq={bound['seq']}; ")
        assert f"proctor refusal seq={bound['seq']}" in headers[":status-line"]
    assert led.verify("acme").size == len(_events(led))


def test_a_tenant_past_its_ledger_quota_is_refused_once_a_day_even_across_a_restart(
    gov: Gov,
) -> None:
    rt, led = gov.rt, gov.rt.ledger
    root = gov.principal("root")
    with pytest.raises(UsageError, match="ledger quota"):
        rt.tenants.set_ledger_quota("acme", 0, root.actor)
    rt.tenants.set_ledger_quota("acme", 10**9, root.actor)  # its own event counts
    today = rt.tenants.ledger_day("acme")
    assert today.events == len(_events(led)), "every event of the tenant's log is today's"
    # Room for exactly three more events after the setting's own.
    rt.tenants.set_ledger_quota("acme", today.events + 1 + 3, root.actor)

    def scope(run: str) -> RunScope:
        return _scope(led, run, ledger_quota=lambda: rt.tenants.ledger_day("acme"),
                      quota_refused=lambda d, s, r: rt.tenants.ledger_quota_refused(
                          "acme", d, s, r))  # fmt: skip

    with Broker(NO_CALLS, os.urandom(32)) as b:
        c1 = b.open_run(scope("r1"), ttl=60)
        c2 = b.open_run(scope("r2"), ttl=60)
        one = [_call(c1.socket, c1.token) for _ in range(6)]
        two = [_call(c2.socket, c2.token) for _ in range(3)]
        # The control plane is never refused by the quota: an admin acts, and is recorded.
        rt.tenants.set_frozen("acme", True, root.actor)
        rt.tenants.set_frozen("acme", False, root.actor)
        b.close_run("r1")
        b.close_run("r2")
    assert [s for s, _, _ in one] == [200] * 3 + [403] * 3
    assert [s for s, _, _ in two] == [403] * 3
    evs = _events(led)
    (quota,) = [e for e in evs if e["action"] == "broker.ledger_quota"]
    assert quota["decision"] == "deny" and quota["policies"] == [LEDGER_QUOTA_RULE]
    assert quota["resource"] == "tenant/acme" and quota["run"] == "r1"
    assert quota["details"]["quota"] == today.events + 4
    assert quota["details"]["events"] == today.events + 4
    for _, headers, body in one[3:] + two:
        assert body["error"] == "denied" and body["policies"] == [LEDGER_QUOTA_RULE]
        assert "ledger quota" in body["message"] and "00:00 UTC" in body["message"]
        assert (body["seq"], body["reason"]) == (quota["seq"], quota["reason"])
        assert headers["X-Proctor-Refusal"].startswith(f"seq={quota['seq']}; ")
    assert [e["action"] for e in evs if e.get("run") in ("r1", "r2")] == [
        "broker.whoami"] * 3 + ["broker.ledger_quota"]  # fmt: skip
    assert [e["action"] for e in evs[-2:]] == ["tenant.freeze", "tenant.unfreeze"]

    # A restarted broker (a new `proctor serve`) counts the day from the store, and
    # names the day's refusal instead of recording another.
    with Broker(NO_CALLS, os.urandom(32)) as b:
        c3 = b.open_run(scope("r3"), ttl=60)
        three = [_call(c3.socket, c3.token) for _ in range(3)]
        b.close_run("r3")
    assert [s for s, _, _ in three] == [403] * 3
    assert all(body["seq"] == quota["seq"] for _, _, body in three)
    after = _events(led)
    assert [e for e in after if e.get("run") == "r3"] == []
    assert len(after) == len(evs)

    # A higher quota is taken at the next reading: the tenant's calls go through again.
    rt.tenants.set_ledger_quota("acme", 10**9, root.actor)
    with Broker(NO_CALLS, os.urandom(32)) as b:
        c4 = b.open_run(scope("r4"), ttl=60)
        assert _call(c4.socket, c4.token)[0] == 200
        b.close_run("r4")
    assert led.verify("acme").size == len(_events(led))


def test_the_days_count_and_refusal_are_read_alike_on_both_engines(
    ledger_env: LedgerEnv,
) -> None:
    """What a (restarted) broker counts from: the day's first event by the time index,
    the log's size, the quota (or the default), the day's one refusal, on either store."""
    led, store = ledger_env.ledger, ledger_env.store
    tenants = Tenants(store, led)
    led.create_log(SYSTEM_LOG, draft(0))
    tenants.create("acme", OPERATOR)
    for i in range(3):
        led.append("acme", draft(i))
    today = tenants.ledger_day("acme")
    assert (today.quota, today.first, today.size, today.refusal) == (
        DEFAULT_LEDGER_QUOTA, 0, 4, None)  # fmt: skip
    assert today.day == led.now()[:10]
    tenants.set_ledger_quota("acme", 7, OPERATOR)
    tenants.ledger_quota_refused("acme", today.day, 5, "refused: over")
    tenants.ledger_quota_refused("acme", today.day, 9, "refused: again")  # the first is kept
    again = tenants.ledger_day("acme")
    assert (again.quota, again.events, again.refusal) == (7, 5, (5, "refused: over"))
    assert tenants.ledger_quota("acme").set_by == OPERATOR.id
    for bad in (0, -3, MAX_LEDGER_QUOTA + 1, True, 2.5):
        with pytest.raises(UsageError, match="a ledger quota is a number of events a day"):
            tenants.set_ledger_quota("acme", bad, OPERATOR)  # type: ignore[arg-type]
    assert tenants.ledger_quota("acme").events_per_day == 7, "a refused setting changes nothing"
    assert led.head("acme").size == 5


def test_a_bound_whose_refusal_cannot_be_recorded_is_answered_503(gov: Gov) -> None:
    """Fail closed: past the bound with the ledger gone, the answer is 503 not_recorded,
    never an unrecorded refusal nor a call."""
    led = gov.rt.ledger
    with Broker(NO_CALLS, os.urandom(32)) as b:
        channel = b.open_run(_scope(led, "r1", call_bound=1), ttl=60)
        assert _call(channel.socket, channel.token)[0] == 200
        size = led.head("acme").size
        led.close()
        answers = [_call(channel.socket, channel.token) for _ in range(3)]
        b.close_run("r1")
    assert {(s, body["error"]) for s, _, body in answers} == {(503, "not_recorded")}
    assert all("seq" not in body for _, _, body in answers)
    assert [json.loads(e)["action"] for e in led.entries("acme")][size - 1 :] == ["broker.whoami"]
