"""Retention and legal holds through the CLI, the API and the SDK (issue 20).

Managing them is ``retention.manage`` (admins, and the local operator); reading
them is ``retention.read`` (auditors and admins). A developer is refused and the
refusal is recorded; bad input is a clear error that changes nothing.

Issue 31, against the real program on a real SQLite home whose tenant's events are
a year old: every kind of hold (tenant, deployment, run), given every way (full id,
unique prefix; CLI, CLI through the server, SDK), keeps what it names through a
prune; an unknown or ambiguous id is refused. A recent run's time column back-dated
with SQL is pruned by nobody, and a marker whose time is not its event's fails
``audit verify`` naming its seq.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from proctor.api import ApiServer, serve_api
from proctor.client import Client
from proctor.errors import ControlDenied, NotFound, UsageError
from proctor.governance import Principal
from proctor.ledger import Actor, EventDraft
from proctor.runtime import Runtime, init_home
from tests.conftest import run_cli
from tests.e2e.conftest_gov import Gov, build_gov
from tests.integration.test_retention import add_run, prune_as_before


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Gov, ApiServer, str]]:
    gov = build_gov(tmp_path_factory.mktemp("retention"))
    _, auditor = gov.rt.principals.create("acme", "carol", "user", ["auditor"], gov.op)
    _deploy(gov, "nightly")
    add_run(gov.rt.store, "r-run1aaaa0001", "nightly", tenant="acme")
    server = serve_api(gov.rt, "127.0.0.1", 0)
    yield gov, server, auditor
    server.stop()
    gov.rt.close()


def _denials(gov: Gov, action: str) -> list[dict[str, object]]:
    out = []
    for raw in gov.rt.ledger.entries("acme"):
        ev = json.loads(raw)
        if ev["decision"] == "deny" and ev.get("details", {}).get("action") == action:
            out.append(ev)
    return out


def test_admins_manage_auditors_read_developers_are_refused(
    served: tuple[Gov, ApiServer, str],
) -> None:
    gov, server, auditor = served
    with Client(server.url, gov.token("dev")) as dev:
        for call in (lambda: dev.set_retention("acme", 365), lambda: dev.retention("acme"),
                     lambda: dev.add_hold("acme", "x", run="r1"), lambda: dev.prune("acme")):  # fmt: skip
            with pytest.raises(ControlDenied):
                call()
    assert len(_denials(gov, "retention.manage")) == 3
    assert len(_denials(gov, "retention.read")) == 1
    with Client(server.url, auditor) as aud:
        assert aud.retention("acme")["rule"] is None
        with pytest.raises(ControlDenied):
            aud.set_retention("acme", 365)
    with Client(server.url, gov.token("root")) as admin:
        with pytest.raises(UsageError, match="legal minimum"):
            admin.set_retention("acme", 30)
        assert admin.retention("acme")["rule"] is None  # refused: nothing changed
        rule = admin.set_retention("acme", 30, below_legal_minimum="sandbox tenant, no AI Act")
        assert rule["days"] == 30 and rule["below_legal_minimum"] == "sandbox tenant, no AI Act"
        hold = admin.add_hold("acme", "case 17", run="r-run1")
        assert hold["target"] == "r-run1aaaa0001"  # the full id, whatever was typed
        assert [h["id"] for h in admin.holds("acme")] == [hold["id"]]
        # Nothing is past 30 days yet; the prune is still recorded as a request.
        assert admin.prune("acme")["pruned"] == 0
        assert admin.remove_hold("acme", hold["id"])["removed_by"] == "acme/root"
        assert admin.holds("acme") == [] and len(admin.holds("acme", include_removed=True)) == 1
    # Another tenant's admin cannot touch acme's retention (nor learn that acme exists).
    with Client(server.url, gov.token("globex-root")) as other, pytest.raises(NotFound):
        other.set_retention("acme", 400)
    # Erasure: admins only; the event names the request, never the key.
    with Client(server.url, gov.token("dev")) as dev, pytest.raises(ControlDenied):
        dev.erase("acme", "crm", "42", "DSR-1")
    with Client(server.url, gov.token("root")) as admin:
        with pytest.raises(UsageError, match="request reference"):
            admin.erase("acme", "crm", "42", "Jane Doe")
        done = admin.erase("acme", "crm", "42", "DSR-1")
        assert done["request_ref"] == "DSR-1" and done["events"] == 0
    doc = Client(server.url, gov.token("root")).retention("acme")
    actions = [e["action"] for e in doc["history"]]
    assert actions == ["retention.set", "hold.add", "hold.remove", "erasure.request"]
    set_event = doc["history"][0]
    assert set_event["details"]["below_legal_minimum"] == "sandbox tenant, no AI Act"


def test_cli_local_and_through_the_server(served: tuple[Gov, ApiServer, str]) -> None:
    gov, server, _ = served
    home: Path = gov.home
    bad = run_cli("retention", "set", "-t", "acme", "--days", "10", home=home, check=False)
    assert bad.code != 0 and "legal minimum" in bad.err and "--below-legal-minimum" in bad.err
    res = run_cli("retention", "set", "-t", "acme", "--days", "400", "--json", home=home)
    assert json.loads(res.out)["rule"] == "retention/400d"
    held = json.loads(run_cli("hold", "add", "-t", "acme", "--deployment", "nightly",
                              "--reason", "audit 2026-3", "--json", home=home).out)  # fmt: skip
    shown = json.loads(run_cli("retention", "show", "-t", "acme", "--json", home=home).out)
    assert shown["rule"]["days"] == 400 and [h["id"] for h in shown["holds"]] == [held["id"]]
    # Through the API: the developer is refused, the admin lists the hold.
    refused = run_cli("--server", server.url, "retention", "prune", "-t", "acme",
                      "--token", gov.token("dev"), check=False)  # fmt: skip
    assert refused.code == 5 and "retention.manage" in refused.err
    listed = run_cli("--server", server.url, "hold", "list", "-t", "acme", "--json",
                     "--token", gov.token("root"))  # fmt: skip
    assert [h["id"] for h in json.loads(listed.out)] == [held["id"]]
    erased = run_cli("erase", "-t", "acme", "--dataset", "crm", "--key", "7",
                     "--request-ref", "DSR-2", "--json", home=home)  # fmt: skip
    assert json.loads(erased.out)["request_ref"] == "DSR-2"
    # A hold's id, like every id, by any unique prefix; "hold-" names both holds.
    second = json.loads(run_cli("hold", "add", "-t", "acme", "--run", "r-run1", "--reason",
                                "audit 2026-4", "--json", home=home).out)  # fmt: skip
    before = gov.rt.ledger.head("acme").size
    ambiguous = run_cli("hold", "remove", "-t", "acme", "hold-", home=home, check=False)
    assert ambiguous.code == 2 and "ambiguous" in ambiguous.err, ambiguous.err
    assert gov.rt.ledger.head("acme").size == before  # refused: nothing recorded
    removed = run_cli("hold", "remove", "-t", "acme", held["id"][:13], "--json", home=home)
    assert json.loads(removed.out)["id"] == held["id"] and json.loads(removed.out)["removed_at"]
    again = run_cli("hold", "remove", "-t", "acme", held["id"][:13], home=home, check=False)
    assert again.code == 2 and "removed already" in again.err
    run_cli("hold", "remove", "-t", "acme", second["id"], home=home)
    verified = json.loads(run_cli("audit", "verify", "-t", "acme", "--json", home=home).out)
    assert verified["verified"] and verified["pruned"] == 0


def _deploy(gov: Gov, *names: str) -> None:
    """Sandbox deployments of one artifact (no approval needed), through the library."""
    art = gov.artifact_dir("job", "print('hi')\n")
    artifact = gov.rt.artifacts.get("acme", gov.submit("acme", art))
    for name in names:
        gov.rt.deployments.deploy("acme", artifact, name, environment="sandbox",
                                  instruction=f"{name} (RET-31)", actor=gov.op)  # fmt: skip


YEAR_AGO = datetime(2025, 3, 1, tzinfo=UTC)
#: A year-old run a day, each with its deployment; the comment says which hold keeps it.
OLD = (
    ("r-aaaa00000001", "omega"),  # run, full id, CLI
    ("r-bbbb00000002", "omega"),  # run, unique prefix, CLI
    ("r-cccc00000003", "omega"),  # run, full id, SDK
    ("r-dddd00000004", "omega"),  # run, unique prefix, CLI through the server
    ("r-eeee00000005", "alpha"),  # deployment, full name, CLI
    ("r-ffff00000006", "batch-daily"),  # deployment, unique prefix, CLI
    ("r-1111aaaa0007", "gamma-sync"),  # deployment, full name, SDK
    ("r-2222bbbb0008", "nightly-report"),  # deployment, unique prefix, SDK
    ("r-9999aaaa0009", "omega"),  # no hold: pruned
    ("r-9999bbbb0010", "omega"),  # no hold: pruned
)
RECENT = "r-eecf0a1b2c3d"


@pytest.fixture
def aged(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Gov, ApiServer]]:
    """A home whose tenant was made a year ago: OLD's runs (rows and events) signed
    then, through the runtime's own ledger on a back-dated clock; its deployments."""
    home = tmp_path / "home"
    init_home(home)
    rt = Runtime.open(home)
    now = [YEAR_AGO]
    monkeypatch.setattr(rt.ledger, "_clock", lambda: now[0].strftime("%Y-%m-%dT%H:%M:%S.%fZ"))
    rt.tenants.create("acme", rt.operator)
    people: dict[str, tuple[Principal, str]] = {}
    for name, roles in (("root", ["admin"]), ("dev", ["developer"])):
        people[name] = rt.principals.create("acme", name, "user", roles, rt.operator)
    gov = Gov(home, rt, people)
    for day, (run, dep) in enumerate(OLD):
        now[0] = YEAR_AGO + timedelta(days=day, hours=1)
        add_run(rt.store, run, dep, tenant="acme")
        rt.ledger.append_many("acme", [
            EventDraft(Actor("workload", run), "sql.select", "table/customers", run=run,
                       deployment=dep, details={"rows": day}),
            EventDraft(rt.operator, "run.end", f"run/{run}", run=run, deployment=dep),
        ])  # fmt: skip
    monkeypatch.undo()  # the runtime's own clock from here on: today
    # Made today: a deployment's row keeps the wall clock's time, held to its event's.
    _deploy(gov, "omega", "alpha", "batch-daily", "batch-weekly", "gamma-sync", "nightly-report")
    server = serve_api(rt, "127.0.0.1", 0)
    yield gov, server
    server.stop()
    rt.close()


def _entries(gov: Gov) -> dict[int, bytes]:
    return dict(enumerate(gov.rt.ledger.entries("acme")))


def _runs_changed(before: dict[int, bytes], after: dict[int, bytes]) -> set[str]:
    return {json.loads(before[s]).get("run") for s in before if after[s] != before[s]}


def test_every_kind_of_hold_given_every_way_keeps_what_it_names(
    aged: tuple[Gov, ApiServer],
) -> None:
    gov, server = aged
    root = gov.token("root")

    def cli(*args: str, check: bool = True) -> Any:
        return run_cli(*args, home=gov.home, check=check)

    def hold(*flags: str) -> dict[str, Any]:
        out = cli("hold", "add", "-t", "acme", *flags, "--reason", "case 31", "--json").out
        return dict(json.loads(out))

    size = gov.rt.ledger.head("acme").size
    # Refused, with one clear line, nothing stored: unknown, ambiguous, too short, empty.
    for flags, why in (
        (("--run", "r-zzzz9999"), "no run 'r-zzzz9999' in tenant 'acme'"),
        (("--run", "r-9999"), "'r-9999' is ambiguous: 2 run ids"),
        (("--run", "r-"), "'r-' is ambiguous: "),
        (("--run", ""), "a hold on a run names it"),
        (("--deployment", "batch"), "'batch' is ambiguous: 2 deployment names"),
        (("--deployment", "nope"), "no deployment 'nope'"),
    ):
        bad = cli("hold", "add", "-t", "acme", *flags, "--reason", "x", check=False)
        assert bad.code != 0 and why in bad.err, (flags, bad.err)
    with Client(server.url, root) as admin:
        with pytest.raises(NotFound, match="no run 'r-zzzz9999'"):
            admin.add_hold("acme", "x", run="r-zzzz9999")
        with pytest.raises(UsageError, match="ambiguous: 2 deployment names"):
            admin.add_hold("acme", "x", deployment="batch")
        assert admin.holds("acme", include_removed=True) == []
    added = [json.loads(e)["action"] for e in gov.rt.ledger.entries("acme", start=size)]
    assert "hold.add" not in added and set(added) == {"api.request"}

    # Every kind, every way; each hold stores the full id.
    assert hold("--run", "r-aaaa00000001")["target"] == "r-aaaa00000001"
    assert hold("--run", "r-bbbb")["target"] == "r-bbbb00000002"
    assert hold("--deployment", "alpha")["target"] == "alpha"
    assert hold("--deployment", "batch-d")["target"] == "batch-daily"
    through = cli("--server", server.url, "hold", "add", "-t", "acme", "--run", "r-dddd",
                  "--reason", "case 31", "--json", "--token", root)  # fmt: skip
    assert json.loads(through.out)["target"] == "r-dddd00000004"
    with Client(server.url, root) as admin:
        assert admin.add_hold("acme", "case 31", run="r-cccc00000003")["target"] == "r-cccc00000003"
        assert admin.add_hold("acme", "case 31", deployment="gamma-sync")["target"] == "gamma-sync"
        assert admin.add_hold("acme", "case 31", deployment="nigh")["target"] == "nightly-report"

    # A hold on the tenant (CLI, then SDK) suspends every prune until it is removed.
    cli("retention", "set", "-t", "acme", "--days", "200")
    whole = hold()
    assert whole["scope"] == "tenant" and whole["target"] == "acme"
    assert "the tenant is under legal hold" in cli("retention", "prune", "-t", "acme").out
    cli("hold", "remove", "-t", "acme", whole["id"])
    with Client(server.url, root) as admin:
        again = admin.add_hold("acme", "case 31")
        assert admin.prune("acme")["why_none"] == "the tenant is under legal hold"
        admin.remove_hold("acme", again["id"])

    before = _entries(gov)
    out = cli("retention", "prune", "-t", "acme").out
    assert "4 events of acme pruned" in out and "16 kept under legal hold" in out
    assert _runs_changed(before, _entries(gov)) == {"r-9999aaaa0009", "r-9999bbbb0010"}
    verified = json.loads(cli("audit", "verify", "-t", "acme", "--json").out)
    assert verified["verified"] and verified["pruned"] == 4


def test_a_back_dated_time_column_prunes_nothing_and_a_false_marker_fails_verify(
    aged: tuple[Gov, ApiServer],
) -> None:
    gov, _ = aged
    rt = gov.rt

    def cli(*args: str, check: bool = True) -> Any:
        return run_cli(*args, home=gov.home, check=check)

    # A run minutes old: 14 events, signed now.
    add_run(rt.store, RECENT, "nightly-report", tenant="acme")
    recent = [
        rt.ledger.append(
            "acme",
            EventDraft(
                rt.operator, "run.start", f"run/{RECENT}", run=RECENT, deployment="nightly-report"
            ),
        ).seq
    ]
    for i in range(12):
        recent.append(
            rt.ledger.append(
                "acme",
                EventDraft(
                    Actor("workload", RECENT),
                    "sql.select",
                    "table/customers",
                    run=RECENT,
                    deployment="nightly-report",
                    details={"rows": i},
                ),
            ).seq
        )
    recent.append(rt.ledger.append("acme", EventDraft(rt.operator, "run.end", f"run/{RECENT}",
                                                      run=RECENT, deployment="nightly-report")).seq)  # fmt: skip
    cli("retention", "set", "-t", "acme", "--days", "200")
    # A store writer back-dates the time column of the recent run's entries.
    with sqlite3.connect(gov.home / "proctor.db", timeout=30) as db:
        db.execute(
            "UPDATE ledger_entries SET time = '2025-03-02T00:00:00.000000Z'"
            " WHERE log = 'acme' AND seq BETWEEN ? AND ?",
            (recent[0], recent[-1]),
        )
    db.close()
    before = _entries(gov)
    res = cli("retention", "prune", "-t", "acme")
    # The year-old runs go; the minutes-old one stays, and the prune says what it saw.
    assert "20 events of acme pruned" in res.out and "0 kept under legal hold" in res.out
    assert "14 entries whose stored time column is not the time they were signed" in res.err
    after = _entries(gov)
    assert RECENT not in _runs_changed(before, after)
    assert all(after[s] == before[s] for s in recent)
    assert json.loads(cli("audit", "verify", "-t", "acme", "--json").out)["pruned"] == 20

    # A store writer moves a marker's time before the events signed ahead of it.
    markers = sorted(s for s, d in after.items() if json.loads(d)["action"] == "ledger.pruned")
    seq = markers[5]
    forged = json.loads(after[seq])
    forged["time"] = "2024-12-31T00:00:00.000000Z"
    _write(gov, seq, json.dumps(forged, sort_keys=True, separators=(",", ":")).encode())
    bad = cli("audit", "verify", "-t", "acme", check=False)
    assert bad.code == 3 and f"event seq {seq}: pruned marker's time 2024-12-31" in bad.err
    _write(gov, seq, after[seq])
    assert cli("audit", "verify", "-t", "acme").code == 0

    # What the runtime wrote before this fix from a back-dated column: a real, signed
    # prune whose markers say the minutes-old events are a year old.
    prune_as_before(rt.ledger, rt.store, recent, "2025-09-01T00:00:00.000000Z")
    bad = cli("audit", "verify", "-t", "acme", check=False)
    assert bad.code == 3
    assert f"event seq {recent[0]}: pruned marker's time 2025-03-02T00:00:00.000000Z is" in bad.err


def _write(gov: Gov, seq: int, data: bytes) -> None:
    with sqlite3.connect(gov.home / "proctor.db", timeout=30) as db:
        db.execute("UPDATE ledger_entries SET data = ? WHERE log = 'acme' AND seq = ?", (data, seq))
    db.close()


def test_serves_prune_goes_by_the_signed_time_and_warns_of_a_back_dated_column(
    aged: tuple[Gov, ApiServer], caplog: pytest.LogCaptureFixture
) -> None:
    """What ``proctor serve`` runs at start and every six hours, for every tenant."""
    import logging

    from proctor.governance import Retention
    from proctor.lifecycle._serve import prune_all

    gov, _ = aged
    rt = gov.rt
    add_run(rt.store, RECENT, "omega", tenant="acme")
    recent = [rt.ledger.append("acme", EventDraft(Actor("workload", RECENT), "sql.select",
                                                  "table/customers", run=RECENT,
                                                  deployment="omega")).seq
              for _ in range(3)]  # fmt: skip
    Retention(rt.store, rt.ledger).set("acme", 200, rt.operator)
    with sqlite3.connect(gov.home / "proctor.db", timeout=30) as db:
        db.execute(
            "UPDATE ledger_entries SET time = '2025-03-02T00:00:00.000000Z'"
            " WHERE log = 'acme' AND seq BETWEEN ? AND ?",
            (recent[0], recent[-1]),
        )
    db.close()
    before = _entries(gov)
    with caplog.at_level(logging.INFO, logger="proctor"):
        prune_all(rt, Actor("runtime", "supervisor:test"))
    assert _runs_changed(before, _entries(gov)) == {run for run, _ in OLD}
    warned = [
        r for r in caplog.records if getattr(r, "proctor_event", "") == "retention.prune_tampering"
    ]
    assert len(warned) == 1 and warned[0].levelno == logging.WARNING
    assert warned[0].proctor_fields["misdated"] == recent  # type: ignore[attr-defined]
