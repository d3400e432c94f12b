"""The least-privilege manifest from a run's calls, over ledgers the real broker wrote:
real SQLite datasets, real bucket files, the real egress proxy and loopback upstreams,
real Cedar. The run's calls: columns it was not given, a host not listed, a bucket
not granted, the metadata address; lines of its manifest it never used."""

from __future__ import annotations

import asyncio
import json
import urllib.error
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from proctor.broker import BrokerError, SecretBinding
from proctor.broker._files import read_object, write_object
from proctor.errors import ProctorError
from proctor.governance import Manifest, RunRecord, parse_manifest, suggest
from proctor.governance._suggest import UNUSED
from proctor.policy import capability_policies
from tests.conftest import LedgerEnv
from tests.integration.test_broker_ask import World, upstream, world  # noqa: F401
from tests.integration.test_broker_proxy import TENANT, Env, proxy_env
from tests.integration.test_broker_sql import make_dataset, make_scope, sql


def _manifest(http_port: int) -> Manifest:
    return parse_manifest(f"""
[artifact]
name = "churn"
entrypoint = ["python3", "main.py"]
purpose = "Churn report"

[datasets.crm.tables.customers]
columns = ["id", "name", "country", "plan", "mrr"]

[datasets.crm.tables.events]
columns = ["customer", "kind"]

[egress]
hosts = ["127.0.0.1:{http_port}", "*.unused.example.org"]

[buckets]
reports = "read-write"
inbox = "read"

[limits]
memory = "256M"
timeout = "90s"
""")


def _run(status: str = "succeeded") -> RunRecord:
    return RunRecord(
        "r1", TENANT, "churn", 1, "sha256:" + "ab" * 32, "sandbox",
        "spiffe://proctor.test/tenant/acme/deployment/churn/run/r1", (), "bubblewrap", None,
        status, "exit", 0, 1, {}, None, "2026-01-01T00:00:00.000000Z", None,
    )  # fmt: skip


def _events(ledger_env: LedgerEnv) -> list[dict[str, Any]]:
    ledger_env.ledger.flush()
    return [ev for d in ledger_env.ledger.entries(TENANT) if (ev := json.loads(d)).get("run")]


@pytest.fixture
def proxy(ledger_env: LedgerEnv, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Env]:
    yield from proxy_env(ledger_env, tmp_path, monkeypatch)


def _calls(proxy: Env, ledger_env: LedgerEnv, tmp_path: Path, manifest: Manifest) -> None:
    """The run's calls, each through the broker's own stages."""
    root = tmp_path / "buckets"
    for bucket in ("reports", "inbox", "other"):
        (root / bucket).mkdir(parents=True)
    (root / "other" / "brief.txt").write_bytes(b"x")
    scope = make_scope(ledger_env, make_dataset(tmp_path / "crm.db"),
                       caps=manifest.capabilities, buckets_dir=root)  # fmt: skip
    sql(scope, "SELECT id, country FROM customers WHERE plan = 'pro'")
    with pytest.raises(BrokerError):
        sql(scope, "SELECT id, email FROM customers")
    asyncio.run(write_object(scope, "reports", "churn.md", b"# churn\n"))
    with pytest.raises(BrokerError):
        asyncio.run(read_object(scope, "other", "brief.txt"))
    proxy.scope(policy_text=capability_policies(TENANT, "churn", manifest.capabilities))
    with proxy.opener().open(f"http://127.0.0.1:{proxy.http.port}/ok", timeout=10) as resp:
        assert resp.status == 200
    for url in (f"http://api.test:{proxy.http.port}/v1/score",
                "http://169.254.169.254/latest/meta-data/"):  # fmt: skip
        with pytest.raises(urllib.error.HTTPError) as info:
            proxy.opener().open(url, timeout=10)
        assert info.value.code == 403
    proxy.harness.settle()


def test_the_suggestion_allows_exactly_what_the_calls_used(
    proxy: Env, ledger_env: LedgerEnv, tmp_path: Path
) -> None:
    manifest = _manifest(proxy.http.port)
    _calls(proxy, ledger_env, tmp_path, manifest)
    events = _events(ledger_env)
    seq = {(e["action"], e["decision"], e["resource"]): e["seq"] for e in events}
    email_seq = seq[("sql.select", "deny", "dataset/crm/table/customers")]
    api_seq = seq[("http.request", "deny", f"host/api.test:{proxy.http.port}")]
    meta_seq = seq[("http.request", "deny", "host/169.254.169.254:80")]
    other_seq = seq[("file.read", "deny", "bucket/other/brief.txt")]

    got = suggest(_run(), manifest, events, allowed_ranges=("127.0.0.0/8",))
    again = parse_manifest(got.manifest)
    assert again.capabilities == {
        "datasets": {"crm": {"tables": {"customers": {
            "columns": ["country", "email", "id", "plan"], "access": "read"}}}},
        "egress": [f"127.0.0.1:{proxy.http.port}", f"api.test:{proxy.http.port}"],
        "secrets": [],
        "buckets": {"other": "read", "reports": "write"},
        # A host the suggestion adds gets the methods and paths its calls used, exactly.
        "egress_rules": {f"api.test:{proxy.http.port}": {
            "methods": ["GET"], "paths": ["/v1/score"]}},
    }  # fmt: skip
    # What says what the code is, and how it runs, is kept as submitted.
    assert (again.name, again.entrypoint, again.purpose) == ("churn", ("python3", "main.py"),
                                                             "Churn report")  # fmt: skip
    assert again.limits == manifest.limits and again.lifecycle == manifest.lifecycle

    lines = {(x.change, x.line.strip()): x for x in got.lines}
    email = lines[("added", '"email",')]
    assert email.seq == email_seq and email.where == "datasets.crm.tables.customers"
    assert "reads column email" in email.reason and "no policy permits it" in email.reason
    host = lines[("added", f'"api.test:{proxy.http.port}",')]
    assert host.seq == api_seq and "refused" in host.reason
    assert lines[("added", 'other = "read"')].seq == other_seq
    assert lines[("added", 'reports = "write"')].seq is not None
    # Unused lines are removable, each with the reason.
    for removed in ('"name",', '"mrr",', '"kind",', '"customer",', 'inbox = "read"',
                    '"*.unused.example.org:443",', "[datasets.crm.tables.events]"):  # fmt: skip
        line = lines[("removed", removed)]
        assert line.reason == UNUSED and line.seq is None, removed
    narrowed = lines[("removed", 'reports = "read-write"')]
    assert narrowed.reason == "no call of this run needed read access to bucket reports"
    # Nothing else changed, and nothing the calls used is removed.
    assert set(lines) == {
        ("added", '"email",'), ("added", f'"api.test:{proxy.http.port}",'),
        ("added", 'other = "read"'), ("added", 'reports = "write"'),
        ("removed", '"name",'), ("removed", '"mrr",'), ("removed", '"kind",'),
        ("removed", '"customer",'), ("removed", 'inbox = "read"'),
        ("removed", '"*.unused.example.org:443",'), ("removed", "[datasets.crm.tables.events]"),
        ("removed", 'reports = "read-write"'), ("removed", 'access = "read"'),
        ("added", f'[egress.rules."api.test:{proxy.http.port}"]'),
        ("added", 'methods = ["GET"]'), ("added", 'paths = ["/v1/score"]'),
    }  # fmt: skip
    assert lines[("added", 'paths = ["/v1/score"]')].seq == api_seq
    # The metadata address is no line of any manifest: listed with why.
    (meta,) = got.not_suggestable
    assert meta.seq == meta_seq and "link-local" in meta.why
    assert '+  "email",\n' in got.diff and '-inbox = "read"\n' in got.diff
    assert got.partial is False and got.notes == ()


def test_a_special_address_stays_unsuggestable_unless_its_range_is_allowed(
    proxy: Env, ledger_env: LedgerEnv, tmp_path: Path
) -> None:
    manifest = _manifest(proxy.http.port)
    _calls(proxy, ledger_env, tmp_path, manifest)
    events = _events(ledger_env)
    # Without the tenant's loopback range, the loopback host the run reached (allowed
    # by Cedar, and recorded so) is still kept: a recorded call used it.
    got = suggest(_run(), manifest, events)
    assert f"127.0.0.1:{proxy.http.port}" in parse_manifest(got.manifest).capabilities["egress"]
    assert [u.resource for u in got.not_suggestable] == ["host/169.254.169.254:80"]
    allowed = suggest(_run(), manifest, events, allowed_ranges=("169.254.0.0/16",))
    assert "169.254.169.254:80" in parse_manifest(allowed.manifest).capabilities["egress"]


def test_a_tenant_forbid_is_not_suggestable_and_adds_nothing(
    ledger_env: LedgerEnv, tmp_path: Path
) -> None:
    manifest = parse_manifest("""
[artifact]
name = "churn"
entrypoint = ["python3", "-c", "pass"]
purpose = "Churn report"

[datasets.crm.tables.customers]
columns = ["id"]
""")
    forbid = ('@id("tenant:no-email")\nforbid (principal, action, resource)'
              ' when { context has columns && context.columns.contains("email") };')  # fmt: skip
    scope = make_scope(ledger_env, make_dataset(tmp_path / "crm.db"),
                       caps=manifest.capabilities, extra_policies=forbid)  # fmt: skip
    sql(scope, "SELECT id FROM customers")
    with pytest.raises(BrokerError):
        sql(scope, "SELECT id, email FROM customers")
    got = suggest(_run(), manifest, _events(ledger_env))
    assert parse_manifest(got.manifest).capabilities == manifest.capabilities
    assert got.lines == () and got.diff == ""
    (forbidden,) = got.not_suggestable
    assert "tenant:no-email" in forbidden.why


def test_a_running_run_is_partial_and_a_write_asks_for_read_write(
    ledger_env: LedgerEnv, tmp_path: Path
) -> None:
    manifest = parse_manifest("""
[artifact]
name = "churn"
entrypoint = ["python3", "-c", "pass"]
purpose = "Churn report"

[datasets.crm.tables.customers]
columns = ["id", "plan"]
""")
    scope = make_scope(ledger_env, make_dataset(tmp_path / "crm.db"), caps=manifest.capabilities)
    with pytest.raises(BrokerError):
        sql(scope, "UPDATE customers SET plan = 'pro' WHERE id = 1")
    got = suggest(_run("running"), manifest, _events(ledger_env))
    assert got.partial and "still running" in got.notes[0]
    grant = parse_manifest(got.manifest).capabilities["datasets"]["crm"]["tables"]["customers"]
    assert grant == {"columns": ["id", "plan"], "access": "read-write"}
    (access,) = [x for x in got.lines if x.change == "added"]
    assert access.line == 'access = "read-write"' and "writes it" in access.reason


def test_a_suggestion_that_would_not_parse_is_refused(tmp_path: Path) -> None:
    manifest = parse_manifest(
        '[artifact]\nname = "x"\nentrypoint = ["python3", "-c", "1"]\npurpose = "p"\n'
    )
    # More hosts than a manifest may ask for: one event each, all refused for want of a
    # permit. A manifest past the recorded size is no suggestion; the error says so.
    events = [
        {"seq": i + 1, "run": "r1", "action": "http.request", "decision": "deny",
         "policies": [], "reason": "denied: no policy permits it",
         "resource": f"host/h{i}.example.com:443",
         "details": {"host": f"h{i}-{'x' * 40}.example.com", "port": 443, "method": "CONNECT"}}
        for i in range(300)
    ]  # fmt: skip
    with pytest.raises(ProctorError, match="does not parse"):
        suggest(_run(), manifest, events)


def test_an_asked_call_stays_asked_and_a_persons_refusal_is_not_suggestable(
    world: World,  # noqa: F811 - the fixture imported above
) -> None:
    """A call of a capability marked ask that timed out unanswered: the capability was
    used (it got as far as the ask), stays asked in the suggestion (dropping the mark
    would widen), and the refusal is a person's, which no manifest line lifts."""
    _, _, channel = world.open("r1", timeout=0.5)
    try:
        status, _, _ = world.get(channel, "/asked")
    finally:
        world.broker.close_run("r1")
    assert status.startswith("HTTP/1.1 403")
    manifest = parse_manifest(f"""
[artifact]
name = "churn"
entrypoint = ["python3", "main.py"]
purpose = "Churn report"

[egress]
hosts = ["{world.entry}", "unused.example.com"]

[ask]
egress = ["{world.entry}", "unused.example.com"]
timeout = "500ms"
""")
    events = [e for e in world.events() if e.get("run") == "r1"]
    (call,) = [e for e in events if e["action"] == "http.request"]
    got = suggest(_run(), manifest, events, allowed_ranges=("127.0.0.0/8",))
    assert parse_manifest(got.manifest).capabilities == {
        "datasets": {}, "egress": [world.entry], "secrets": [], "buckets": {},
        "ask": {"egress": [world.entry], "timeout_seconds": 0.5},
    }  # fmt: skip
    assert {(x.change, x.line.strip()) for x in got.lines} == {
        ("removed", '"unused.example.com:443",')
    }  # two lines: the host's and its ask's
    assert len(got.lines) == 2 and all(x.reason == UNUSED for x in got.lines)
    (refused,) = got.not_suggestable
    assert refused.seq == call["seq"] and "a person" in refused.why


def test_the_secret_injected_is_kept_and_the_one_never_injected_is_removable(proxy: Env) -> None:
    entry = f"api.test:{proxy.api.port}"
    manifest = parse_manifest(f"""
[artifact]
name = "churn"
entrypoint = ["python3", "main.py"]
purpose = "Churn report"

[egress]
hosts = ["{entry}"]

[secrets]
names = ["crm_token", "spare_token"]
""")
    proxy.scope([entry], secrets=["crm_token", "spare_token"],
                bindings=[SecretBinding("crm_token", "v-" + "x" * 20, ("api.test",)),
                          SecretBinding("spare_token", "w-" + "y" * 20, ("nowhere.test",))])  # fmt: skip
    opener = proxy.opener(trust=proxy.proxy.tenant_ca(TENANT).ca_pem())
    with opener.open(f"https://{entry}/one", timeout=10) as resp:
        assert resp.status == 200
    events = [e for e in proxy.events() if e.get("run")]
    (request,) = [e for e in events if e["action"] == "http.request"]
    got = suggest(_run(), manifest, events)
    assert parse_manifest(got.manifest).capabilities["secrets"] == ["crm_token"]
    (removed,) = got.lines
    assert (removed.change, removed.line.strip(), removed.reason) == (
        "removed", '"spare_token",', UNUSED,
    )  # fmt: skip
    # Kept because the request carried it: its event is the one that used it.
    assert request["details"]["inject"] == [{"secret": "crm_token", "header": "Authorization"}]


def test_a_table_read_without_a_column_keeps_one_or_is_left_to_a_person(
    ledger_env: LedgerEnv, tmp_path: Path
) -> None:
    manifest = parse_manifest("""
[artifact]
name = "churn"
entrypoint = ["python3", "-c", "pass"]
purpose = "Churn report"

[datasets.crm.tables.customers]
columns = ["plan", "id", "mrr"]
""")
    scope = make_scope(ledger_env, make_dataset(tmp_path / "crm.db"), caps=manifest.capabilities)
    sql(scope, "SELECT count(*) FROM customers")
    with pytest.raises(BrokerError):
        sql(scope, "SELECT count(*) FROM events")
    got = suggest(_run(), manifest, _events(ledger_env))
    # Any one column allows count(*): the fewest the submitted grant had, one.
    tables = parse_manifest(got.manifest).capabilities["datasets"]["crm"]["tables"]
    assert tables == {"customers": {"columns": ["id"], "access": "read"}}
    (events_read,) = got.not_suggestable
    assert events_read.resource == "dataset/crm/table/events"
    assert "names no column of crm.events" in events_read.why
