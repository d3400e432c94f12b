"""Issue 31, item 5, with real sandboxes: a guest cannot grow the ledger without bound.

A real governed run (the supervisor, a real sandbox, the shim, the guest library)
calls more than its manifest's ``limits.calls`` allows: the first N calls are
answered, every later one is refused naming the bound and the one event that
records it, and the log holds exactly N call events and one refusal. A tenant
past its ledger quota of the day: its runs' calls are refused and recorded once,
set and shown with the real CLI, and the control plane still works.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from proctor.lifecycle import RunRecord, Supervisor
from tests.conftest import run_cli
from tests.e2e.conftest_gov import Gov, build_gov
from tests.sandbox_conftest_helpers import working

pytestmark = pytest.mark.sandbox
ONE = ([b for b in ("bubblewrap", "gvisor") if b in working()] or ["bubblewrap"])[:1]
CALL_BOUND_RULE = "proctor:broker:call-bound"
LEDGER_QUOTA_RULE = "proctor:broker:ledger-quota"

# Twelve calls, one connection each; every answer and refusal on a line of its own.
CALLER = """
import json, proctor_guest as g
for i in range(12):
    try:
        g.whoami()
        print(json.dumps({"i": i, "ok": True}), flush=True)
    except g.GuestError as exc:
        print(json.dumps({"i": i, "code": exc.code, "seq": exc.seq, "reason": exc.reason,
                          "policies": list(exc.policies), "message": str(exc)}), flush=True)
"""


@pytest.fixture
def gov(tmp_path: Path) -> Iterator[Gov]:
    g = build_gov(tmp_path)
    yield g
    g.rt.close()


def _deploy(gov: Gov, name: str, limits: str = "") -> None:
    digest = gov.submit("acme", gov.artifact_dir(name, CALLER, limits))
    gov.rt.approvals.grant("acme", digest, gov.principal("alice"))
    gov.rt.deployments.deploy("acme", gov.rt.artifacts.get("acme", digest), name,
                              environment="production", instruction="calls (RET-1)",
                              actor=gov.principal("dev").actor)  # fmt: skip


def _run(gov: Gov, sup: Supervisor, name: str) -> tuple[RunRecord, list[dict[str, Any]]]:
    out: list[bytes] = []
    record = sup.start("acme", name, gov.principal("dev").actor, on_stdout=out.append)
    lines = b"".join(out).decode().splitlines()
    return record, [json.loads(line) for line in lines]


def _events(gov: Gov) -> list[dict[str, Any]]:
    return [json.loads(e) for e in gov.rt.ledger.entries("acme")]


@pytest.mark.parametrize("backend", ONE)
def test_a_run_past_its_manifests_call_bound_gets_n_calls_and_one_recorded_refusal(
    gov: Gov, backend: str
) -> None:
    _deploy(gov, "bounded", "[limits]\ncalls = 5\n")
    with gov.rt.make_broker() as broker:
        record, answers = _run(gov, Supervisor(gov.rt, broker, backend), "bounded")
    assert record.status == "succeeded", record.reason
    assert [a["i"] for a in answers] == list(range(12))
    assert [a.get("ok", False) for a in answers] == [True] * 5 + [False] * 7
    evs = [e for e in _events(gov) if e.get("run") == record.id]
    actions = [e["action"] for e in evs]
    assert actions == ["run.start"] + ["broker.whoami"] * 5 + ["broker.call_bound", "run.end"]
    start, *_, bound, end = evs
    assert start["details"]["limits"]["calls"] == 5
    assert bound["decision"] == "deny" and bound["policies"] == [CALL_BOUND_RULE]
    assert bound["details"]["bound"] == 5
    # Every refusal names the bound and the one event, to the guest.
    for refused in answers[5:]:
        assert refused["code"] == "denied" and refused["policies"] == [CALL_BOUND_RULE]
        assert "5 calls" in refused["message"] and "limits.calls" in refused["message"]
        assert (refused["seq"], refused["reason"]) == (bound["seq"], bound["reason"])
        assert f"[ledger event seq={bound['seq']}]" in refused["message"]
    assert end["details"]["calls"] == {
        "made": 5, "bound": 5, "refused_over_bound": 7, "refused_over_quota": 0,
    }  # fmt: skip


@pytest.mark.parametrize("backend", ONE)
def test_a_tenant_past_its_ledger_quota_is_refused_once_and_admins_still_act(
    gov: Gov, backend: str
) -> None:
    _deploy(gov, "caller")
    root = gov.token("root")
    # Set with the real CLI; a nonsensical value is one clear error and changes nothing.
    bad = run_cli("tenant", "quota", "acme", "--events-per-day", "0", "--token", root,
                  home=gov.home, check=False)  # fmt: skip
    assert bad.code != 0 and "a ledger quota is a number of events a day" in bad.err
    assert gov.rt.tenants.ledger_quota("acme").set_by is None
    # A developer may not set it.
    dev = run_cli("tenant", "quota", "acme", "--events-per-day", "5", "--token",
                  gov.token("dev"), home=gov.home, check=False)  # fmt: skip
    assert dev.code != 0 and gov.rt.tenants.ledger_quota("acme").set_by is None
    events = gov.rt.tenants.ledger_day("acme").events
    # Room after the setting's own event for the run's start and three calls.
    quota = events + 1 + 1 + 3
    shown = run_cli("tenant", "quota", "acme", "--events-per-day", str(quota), "--json",
                    "--token", root, home=gov.home)  # fmt: skip
    assert json.loads(shown.out)["events_per_day"] == quota
    with gov.rt.make_broker() as broker:
        sup = Supervisor(gov.rt, broker, backend)
        first, answers = _run(gov, sup, "caller")
        # Another run of the tenant starts (control plane), and its calls are refused.
        second, again = _run(gov, sup, "caller")
    assert [a.get("ok", False) for a in answers] == [True] * 3 + [False] * 9
    assert [a.get("ok", False) for a in again] == [False] * 12
    evs = _events(gov)
    (refusal,) = [e for e in evs if e["action"] == "broker.ledger_quota"]
    assert refusal["policies"] == [LEDGER_QUOTA_RULE] and refusal["run"] == first.id
    assert refusal["details"]["quota"] == quota
    for refused in answers[3:] + again:
        assert refused["code"] == "denied" and refused["policies"] == [LEDGER_QUOTA_RULE]
        assert "ledger quota" in refused["message"]
        assert refused["seq"] == refusal["seq"]
    calls = [e["action"] for e in evs if e.get("run") == second.id]
    assert calls == ["run.start", "run.end"], "the second run's refusals: none recorded"
    assert (first.status, second.status) == ("succeeded", "succeeded")
    # The control plane is never refused by the quota: an admin freezes and unfreezes.
    run_cli("tenant", "freeze", "acme", "--token", root, home=gov.home)
    run_cli("tenant", "unfreeze", "acme", "--token", root, home=gov.home)
    assert [e["action"] for e in _events(gov)[-2:]] == ["tenant.freeze", "tenant.unfreeze"]
    shown = run_cli("tenant", "quota", "acme", "--json", "--token", root, home=gov.home)
    doc = json.loads(shown.out)
    assert doc["events_today"] == len(_events(gov)) and doc["events_per_day"] == quota
