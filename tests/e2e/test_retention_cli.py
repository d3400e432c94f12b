"""Retention and legal holds through the CLI, the API and the SDK (issue 20).

Managing them is ``retention.manage`` (admins, and the local operator); reading
them is ``retention.read`` (auditors and admins). A developer is refused and the
refusal is recorded; bad input is a clear error that changes nothing.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from proctor.api import ApiServer, serve_api
from proctor.client import Client
from proctor.errors import ControlDenied, NotFound, UsageError
from tests.conftest import run_cli
from tests.e2e.conftest_gov import Gov, build_gov


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Gov, ApiServer, str]]:
    gov = build_gov(tmp_path_factory.mktemp("retention"))
    _, auditor = gov.rt.principals.create("acme", "carol", "user", ["auditor"], gov.op)
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
        hold = admin.add_hold("acme", "case 17", run="run-1")
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
    removed = run_cli("hold", "remove", "-t", "acme", held["id"], "--json", home=home)
    assert json.loads(removed.out)["removed_at"]
    verified = json.loads(run_cli("audit", "verify", "-t", "acme", "--json", home=home).out)
    assert verified["verified"] and verified["pruned"] == 0
