"""AI agents as principals (issue 35), against the real API on loopback and the real
CLI: what an agent may do (describe data, submit, deploy to the sandbox, ask for
approval, read the approval state) and every refusal of what it may never do
(approve, deploy to production, manage principals, freeze, read another tenant),
each recorded with the agent's identity and explained; the MCP client's name and
version on its events; a revoked agent token refused."""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterator
from pathlib import Path

import pytest

from proctor.client import Client
from proctor.errors import AuthenticationFailed, NotFound, UsageError
from proctor.governance import ControlDenied
from tests.conftest import run_cli
from tests.integration.test_api_support import ApiEnv, artifact_dir, build_env

CLIENT = {"X-Proctor-Client": "claude-code/1.0.42"}


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ApiEnv]:
    tmp = tmp_path_factory.mktemp("agents")
    e = build_env(tmp)
    for t in ("acme", "globex"):
        _, tok = e.rt.principals.create(t, "coder", "agent", [], e.rt.operator,
                                        responsible=f"{t}/dev")  # fmt: skip
        e.tokens[(t, "coder")] = tok
    db = tmp / "crm.db"
    with sqlite3.connect(db) as conn:
        conn.execute("CREATE TABLE customers (id INTEGER PRIMARY KEY, email TEXT NOT NULL,"
                     " plan TEXT)")  # fmt: skip
        conn.execute("INSERT INTO customers VALUES (1, 'secret-row@example.com', 'gold')")
        conn.execute("CREATE VIEW gold AS SELECT id FROM customers WHERE plan = 'gold'")
    e.rt.resources.add_dataset("acme", "crm", db, e.rt.operator)
    yield e
    e.server.stop()
    e.rt.close()


def agent(env: ApiEnv, tenant: str = "acme") -> Client:
    return Client(env.url, env.token(tenant, "coder"), headers=CLIENT)


def person(env: ApiEnv, name: str) -> Client:
    return Client(env.url, env.token("acme", name))


def _denials(env: ApiEnv, action: str, by: str = "acme/coder") -> list[dict[str, object]]:
    return [
        e for e in env.events("acme")
        if e["decision"] == "deny" and e["actor"] == {"type": "agent", "id": by}  # type: ignore[index]
        and (e["details"] or {}).get("action", e["action"]) == action  # type: ignore[attr-defined]
    ]  # fmt: skip


def _submit(env: ApiEnv, tmp: Path, name: str, who: Client) -> str:
    return str(who.submit_artifact("acme", artifact_dir(tmp, name))["digest"])


# -- creating an agent ------------------------------------------------------------------


def test_an_admin_creates_an_agent_with_the_person_responsible_recorded(env: ApiEnv) -> None:
    root = person(env, "root")
    p, token = root.create_agent("acme", "helper", "acme/alice")
    assert p["kind"] == "agent" and p["roles"] == ["agent"]
    assert p["responsible"] == "acme/alice" and token.startswith("pt_")
    created = [e for e in env.events("acme") if e["action"] == "principal.create"
               and e["resource"] == "principal/acme/helper"]  # fmt: skip
    assert created[-1]["details"] == {"kind": "agent", "roles": ["agent"],
                                      "responsible": "acme/alice"}  # fmt: skip
    assert Client(env.url, token).whoami()["kind"] == "agent"


def test_an_agent_with_an_approver_or_admin_role_is_refused_with_why(env: ApiEnv) -> None:
    with env.http("acme", "root") as http:
        for roles in (["approver"], ["admin"], ["agent", "approver"]):
            r = http.post("/tenants/acme/principals",
                          json={"name": "greedy", "kind": "agent", "roles": roles,
                                "responsible": "acme/alice"})  # fmt: skip
            assert r.status_code == 400, r.text
            assert "a person approves" in r.json()["error"]["message"]
        # No one responsible: refused; a person holding the agent role: refused.
        r = http.post("/tenants/acme/principals", json={"name": "orphan", "kind": "agent"})
        assert r.status_code == 400 and "responsible" in r.json()["error"]["message"]
        r = http.post("/tenants/acme/principals",
                      json={"name": "pretender", "kind": "user", "roles": ["agent"]})  # fmt: skip
        assert r.status_code == 400 and "agent role" in r.json()["error"]["message"]
    names = {p["name"] for p in person(env, "root").principals("acme")}
    assert not names & {"greedy", "orphan", "pretender"}
    # A developer cannot make one either (principal management is an admin's).
    with pytest.raises(ControlDenied):
        person(env, "dev").create_agent("acme", "sneaky", "acme/dev")
    with pytest.raises(UsageError, match="a person approves"):
        env.rt.principals.create("acme", "greedy", "agent", ["approver"], env.rt.operator,
                                 responsible="acme/alice")  # fmt: skip


# -- what an agent may never do ---------------------------------------------------------


def test_an_agent_approving_is_refused_recorded_and_explained(env: ApiEnv, tmp_path: Path) -> None:
    digest = _submit(env, tmp_path, "never-approve", person(env, "dev"))
    with pytest.raises(ControlDenied) as refused:
        agent(env).approve("acme", digest)
    assert "a person approves" in refused.value.message
    assert "GDPR Art. 28(3)(a)" in refused.value.message
    with pytest.raises(ControlDenied):
        agent(env).reject("acme", digest, "no")
    a = person(env, "alice").approve("acme", digest, comment="fine")
    with pytest.raises(ControlDenied, match="a person approves"):
        agent(env).revoke("acme", a["id"])
    for action in ("approval.grant", "approval.reject", "approval.revoke"):
        [ev] = _denials(env, action)[-1:]
        assert "control:agent-never-approves" in ev["policies"]  # type: ignore[operator]
        assert "a person approves" in str(ev["reason"])
        assert ev["details"]["client"] == {"name": "claude-code", "version": "1.0.42"}  # type: ignore[index]
    # Nothing was approved by it: the approval state names alice's alone.
    state = agent(env).approval_state("acme", digest)
    assert [x["principal"] for x in state["approvals"]] == ["acme/alice"]


def test_an_agent_approving_with_the_cli_is_refused_and_recorded(
    env: ApiEnv, tmp_path: Path
) -> None:
    digest = _submit(env, tmp_path, "cli-approve", person(env, "dev"))
    before = len(_denials(env, "approval.grant"))
    res = run_cli("approve", digest, "-t", "acme", "--yes", "--token", env.token("acme", "coder"),
                  home=env.home, check=False)  # fmt: skip
    assert res.code != 0
    assert "a person approves" in res.err and "Traceback" not in res.err
    found = _denials(env, "approval.grant")
    assert len(found) == before + 1
    assert found[-1]["actor"] == {"type": "agent", "id": "acme/coder"}
    # Over the API through the CLI's --server form too.
    res = run_cli("--server", env.url, "approve", digest, "-t", "acme", "--yes",
                  "--token", env.token("acme", "coder"), check=False)  # fmt: skip
    assert res.code != 0 and "a person approves" in res.err
    assert len(_denials(env, "approval.grant")) == before + 2


def test_an_agent_deploying_to_production_is_refused(env: ApiEnv, tmp_path: Path) -> None:
    coder = agent(env)
    digest = _submit(env, tmp_path, "to-prod", coder)
    person(env, "alice").approve("acme", digest, comment="ok")  # approved: still not the agent's
    with pytest.raises(ControlDenied) as refused:
        coder.deploy("acme", digest, "to-prod", environment="production", instruction="go")
    assert "sandbox only" in refused.value.message
    [ev] = _denials(env, "deployment.create")[-1:]
    assert ev["policies"] == ["control:agent-sandbox-only"]
    assert "to-prod" not in {d["name"] for d in coder.deployments("acme")}
    # A person deploys it; the agent may not roll it back or stop it either.
    person(env, "dev").deploy("acme", digest, "to-prod", environment="production",
                              instruction="monthly (RET-1)")  # fmt: skip
    with pytest.raises(ControlDenied, match="sandbox only"):
        coder.stop_deployment("acme", "to-prod")
    with pytest.raises(ControlDenied, match="sandbox only"):
        coder.rollback("acme", "to-prod")


def test_an_agent_managing_principals_or_the_tenant_is_refused(env: ApiEnv) -> None:
    coder = agent(env)
    with pytest.raises(ControlDenied, match="a person administers"):
        coder.create_principal("acme", "minion", ["developer"])
    with pytest.raises(ControlDenied, match="a person administers"):
        coder.create_agent("acme", "minion", "acme/coder")
    with pytest.raises(ControlDenied, match="a person administers"):
        coder.rotate_token("acme", "alice")
    with pytest.raises(ControlDenied, match="a person administers"):
        coder.disable_principal("acme", "alice")
    with pytest.raises(ControlDenied, match="a person administers"):
        coder.freeze("acme", "agent says so")
    with pytest.raises(ControlDenied, match="a person administers"):
        coder.set_policy("acme", "")
    assert person(env, "root").tenant("acme")["status"] == "active"
    assert len(_denials(env, "principal.create")) >= 3
    assert _denials(env, "tenant.freeze")


def test_an_agent_reading_another_tenant_is_refused_as_unknown(env: ApiEnv) -> None:
    coder = agent(env)
    for read in (lambda: coder.artifacts("globex"), lambda: coder.deployments("globex"),
                 lambda: coder.describe_dataset("globex", "crm"),
                 lambda: coder.approval_state("globex", "sha256:00")):  # fmt: skip
        with pytest.raises(NotFound):
            read()
    ev = _denials(env, "artifact.read")[-1]
    assert ev["details"]["target_tenant"] == "globex"  # type: ignore[index]
    # Nothing of acme's is recorded in globex's log.
    assert not [e for e in env.events("globex") if e["actor"]["id"] == "acme/coder"]  # type: ignore[index]


def test_a_revoked_agent_token_is_refused(env: ApiEnv) -> None:
    root = person(env, "root")
    _, token = root.create_agent("acme", "shortlived", "acme/dev")
    assert Client(env.url, token).whoami()["name"] == "shortlived"
    new = root.rotate_token("acme", "shortlived")
    with pytest.raises(AuthenticationFailed):
        Client(env.url, token).whoami()
    root.disable_principal("acme", "shortlived")
    with pytest.raises(AuthenticationFailed):
        Client(env.url, new).artifacts("acme")


# -- what an agent may do ---------------------------------------------------------------


def test_an_agent_describes_a_dataset_never_a_row(env: ApiEnv) -> None:
    doc = agent(env).describe_dataset("acme", "crm")
    assert doc["name"] == "crm" and doc["kind"] == "sqlite"
    tables = {t["name"]: t for t in doc["tables"]}
    assert set(tables) == {"customers", "gold"} and tables["gold"]["kind"] == "view"
    assert tables["customers"]["columns"] == [
        {"name": "id", "type": "INTEGER", "nullable": True, "primary_key": True},
        {"name": "email", "type": "TEXT", "nullable": False, "primary_key": False},
        {"name": "plan", "type": "TEXT", "nullable": True, "primary_key": False},
    ]
    text = json.dumps(doc)
    assert "secret-row" not in text and "crm.db" not in text  # no row, no location
    ev = [e for e in env.events("acme") if e["action"] == "dataset.describe"][-1]
    assert ev["actor"] == {"type": "agent", "id": "acme/coder"}
    assert ev["details"]["client"] == {"name": "claude-code", "version": "1.0.42"}  # type: ignore[index]
    with pytest.raises(NotFound):
        agent(env).describe_dataset("acme", "nope")
    # An approver has no dataset.describe: refused and recorded.
    with pytest.raises(ControlDenied):
        person(env, "alice").describe_dataset("acme", "crm")


def test_an_agent_submits_deploys_to_the_sandbox_and_asks_for_approval(
    env: ApiEnv, tmp_path: Path
) -> None:
    coder = agent(env)
    digest = _submit(env, tmp_path, "agent-work", coder)
    dep = coder.deploy("acme", digest, "agent-work", environment="sandbox",
                       instruction="try it")  # fmt: skip
    assert dep["environment"] == "sandbox"
    req = coder.request_approval("acme", digest, "reads crm.customers(email) for the report")
    assert req["principal"] == "acme/coder" and req["digest"] == digest
    ev = [e for e in env.events("acme") if e["action"] == "approval.request"][-1]
    assert ev["seq"] == req["seq"] and ev["actor"] == {"type": "agent", "id": "acme/coder"}
    assert ev["details"]["comment"] == "reads crm.customers(email) for the report"  # type: ignore[index]
    assert ev["details"]["client"] == {"name": "claude-code", "version": "1.0.42"}  # type: ignore[index]
    state = coder.approval_state("acme", digest)
    assert state["approved"] is False and "0 valid approval" in state["why"]
    assert [r["principal"] for r in state["requests"]] == ["acme/coder"]
    assert state["quorum"] == {"required": 1, "roles": ["approver", "admin"]}
    # A person approves: the state says who, that it counts, and that it is approved.
    person(env, "alice").approve("acme", digest, comment="read the review")
    state = coder.approval_state("acme", digest)
    assert state["approved"] is True and state["why"] is None
    assert [a["principal"] for a in state["approvals"]] == ["acme/alice"]
    assert state["counted"] == ["acme/alice"]
    # A developer asks too; an auditor may not ask (no approval.request).
    person(env, "dev").request_approval("acme", digest, "me too")
    with pytest.raises(ControlDenied):
        person(env, "aud").request_approval("acme", digest, "no")
    assert len(coder.approval_state("acme", digest)["requests"]) == 2


def test_the_client_header_is_on_every_event_of_the_request_and_bounded(
    env: ApiEnv, tmp_path: Path
) -> None:
    coder = agent(env)
    before = env.rt.ledger.head("acme").size
    coder.artifacts("acme")
    new = [e for e in env.events("acme") if e["seq"] >= before]  # type: ignore[operator]
    assert new and all(
        e["details"]["client"] == {"name": "claude-code", "version": "1.0.42"}  # type: ignore[index]
        for e in new
    )
    # The governance events of its requests carry it too (the submission's own event).
    digest = coder.submit_artifact("acme", artifact_dir(tmp_path, "with-client"))["digest"]
    [sub] = [e for e in env.events("acme") if e["action"] == "artifact.submit"
             and e["artifact"] == digest]  # fmt: skip
    assert sub["details"]["client"] == {"name": "claude-code", "version": "1.0.42"}  # type: ignore[index]
    assert sub["actor"] == {"type": "agent", "id": "acme/coder"}
    with env.http("acme", "coder") as http:
        for bad in ("no-version", "a b/1", "x" * 65 + "/1", "n/" + "9" * 33, "/1", "n/",
                    "n/1\x7f"):  # fmt: skip
            r = http.get("/tenants/acme/artifacts", headers={"X-Proctor-Client": bad})
            assert r.status_code == 400, bad
            assert "X-Proctor-Client" in r.json()["error"]["message"]
        # Without the header: nothing claimed, nothing recorded of it.
        size = env.rt.ledger.head("acme").size
        assert http.get("/tenants/acme/artifacts").status_code == 200
    last = [e for e in env.events("acme") if e["seq"] >= size]  # type: ignore[operator]
    assert last and all("client" not in e["details"] for e in last)  # type: ignore[operator]


def test_the_pg_dataset_is_described_from_its_catalog(pg_dsn: str, tmp_path: Path) -> None:
    import psycopg

    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute("REVOKE ALL ON SCHEMA public FROM PUBLIC")
        conn.execute("CREATE TABLE invoices (id bigint PRIMARY KEY, amount numeric(10,2),"
                     " note varchar(40) NOT NULL)")  # fmt: skip
        conn.execute("INSERT INTO invoices VALUES (1, 9.99, 'secret-row')")
        conn.execute("CREATE SCHEMA billing")
        conn.execute("CREATE TABLE billing.plans (code text)")
    e = build_env(tmp_path)
    try:
        _, tok = e.rt.principals.create("acme", "coder", "agent", [], e.rt.operator,
                                        responsible="acme/dev")  # fmt: skip
        e.rt.resources.add_dataset("acme", "pay", pg_dsn, e.rt.operator)
        doc = Client(e.url, tok).describe_dataset("acme", "pay")
    finally:
        e.server.stop()
        e.rt.close()
    tables = {t["name"]: t["columns"] for t in doc["tables"]}
    assert tables == {
        "billing.plans": [{"name": "code", "type": "text", "nullable": True,
                           "primary_key": False}],
        "invoices": [
            {"name": "id", "type": "bigint", "nullable": False, "primary_key": True},
            {"name": "amount", "type": "numeric(10,2)", "nullable": True, "primary_key": False},
            {"name": "note", "type": "character varying(40)", "nullable": False,
             "primary_key": False},
        ],
    }  # fmt: skip
    assert "secret-row" not in json.dumps(doc) and "postgresql://" not in json.dumps(doc)


def test_the_cli_describes_a_dataset_and_asks_for_approval_as_the_agent(
    env: ApiEnv, tmp_path: Path
) -> None:
    token = env.token("acme", "coder")
    res = run_cli("dataset", "describe", "-t", "acme", "crm", "--json", "--token", token,
                  home=env.home)  # fmt: skip
    doc = json.loads(res.out)
    assert [t["name"] for t in doc["tables"]] == ["customers", "gold"]
    res = run_cli("dataset", "describe", "-t", "acme", "crm", "--token", token, home=env.home)
    assert "customers" in res.out and "email" in res.out and "not null" in res.out
    assert "secret-row" not in res.out
    ev = [e for e in env.events("acme") if e["action"] == "dataset.describe"][-1]
    assert ev["actor"] == {"type": "agent", "id": "acme/coder"}
    # Through the API (--server) too; another tenant's is unknown.
    res = run_cli("--server", env.url, "dataset", "describe", "-t", "acme", "crm", "--json",
                  "--token", token)  # fmt: skip
    assert json.loads(res.out)["tables"] == doc["tables"]
    res = run_cli("--server", env.url, "dataset", "describe", "-t", "globex", "crm",
                  "--token", token, check=False)  # fmt: skip
    assert res.code != 0 and "unknown tenant" in res.err
    digest = _submit(env, tmp_path, "cli-ask", agent(env))
    res = run_cli("approval", "request", digest, "-t", "acme", "--comment", "please look",
                  "--json", "--token", token, home=env.home)  # fmt: skip
    req = json.loads(res.out)
    assert req["principal"] == "acme/coder" and req["comment"] == "please look"
    person(env, "alice").approve("acme", digest, comment="looked")
    res = run_cli("approval", "state", digest, "-t", "acme", "--token", token, home=env.home)
    assert "approved:    yes" in res.out and "requested by acme/coder" in res.out
    assert "approved by acme/alice" in res.out and "(counts)" in res.out
    res = run_cli("--server", env.url, "approval", "state", digest, "-t", "acme", "--json",
                  "--token", token)  # fmt: skip
    assert json.loads(res.out)["approved"] is True
    # The CLI's agent creation: --kind agent --responsible, by the local operator.
    res = run_cli("principal", "create", "-t", "acme", "cli-agent", "--kind", "agent",
                  "--responsible", "acme/alice", "--json", home=env.home)  # fmt: skip
    made = json.loads(res.out)
    assert made["kind"] == "agent" and made["roles"] == ["agent"]
    assert made["responsible"] == "acme/alice"
    res = run_cli("principal", "create", "-t", "acme", "cli-agent2", "--kind", "agent",
                  "--role", "approver", "--responsible", "acme/alice", home=env.home,
                  check=False)  # fmt: skip
    assert res.code == 2 and "a person approves" in res.err


@pytest.mark.sandbox
def test_an_agent_runs_in_the_sandbox_and_a_persons_production_deployment(
    env: ApiEnv, tmp_path: Path
) -> None:
    """The loop's runs: the agent deploys its code to the sandbox and runs it; a person
    deploys the approved code to production and the agent starts that run; the agent
    reads the events of the runs it started, and not of a run a person started."""
    from tests.sandbox_conftest_helpers import any_backend

    any_backend()
    coder, dev = agent(env), person(env, "dev")
    digest = _submit(env, tmp_path, "loop", coder)
    coder.deploy("acme", digest, "loop-sandbox", environment="sandbox", instruction="try")
    run = coder.run("acme", "loop-sandbox")
    assert run["status"] == "succeeded" and run["environment"] == "sandbox", run
    assert b"".join(coder.run_logs("acme", run["id"])) == b"hello\n"
    events = [json.loads(e) for e in coder.events("acme", run=run["id"])]
    assert any(e["action"] == "run.start" for e in events)
    person(env, "alice").approve("acme", digest, comment="looked")
    dev.deploy("acme", digest, "loop-prod", environment="production",
               instruction="the monthly report (RET-7)")  # fmt: skip
    prod = coder.run("acme", "loop-prod")
    assert prod["status"] == "succeeded" and prod["environment"] == "production", prod
    start = [json.loads(e) for e in coder.events("acme", run=prod["id"])]
    start = [e for e in start if e["action"] == "run.start"]
    assert start[0]["actor"] == {"type": "agent", "id": "acme/coder"}
    assert start[0]["details"]["client"] == {"name": "claude-code", "version": "1.0.42"}
    # A run a person started, of a deployment a person made: not the agent's to read.
    other = dev.run("acme", "loop-prod")
    with pytest.raises(ControlDenied):
        coder.events("acme", run=other["id"])
    assert _denials(env, "run.events.read")
    # Nor its output, which holds what the production run wrote (its data); the
    # production run the agent started is its own to read.
    assert b"".join(coder.run_logs("acme", prod["id"])) == b"hello\n"
    with pytest.raises(ControlDenied):
        b"".join(coder.run_logs("acme", other["id"]))
    assert _denials(env, "run.output.read")
    assert b"".join(dev.run_logs("acme", other["id"])) == b"hello\n"


def test_an_approval_recorded_as_an_agents_never_counts(env: ApiEnv, tmp_path: Path) -> None:
    """Should an approval by an agent ever reach the record (a bug, a forged entry
    claiming the approver role), the quorum does not count it."""
    from proctor.ledger import Action, Actor, EventDraft

    digest = _submit(env, tmp_path, "forged", person(env, "dev"))
    art = env.rt.artifacts.get("acme", digest)
    env.rt.ledger.append("acme", EventDraft(
        Actor("agent", "acme/coder"), Action.APPROVAL_GRANT, f"artifact/{digest}",
        reason="approved", artifact=digest, approvals=("apr_forged",),
        details={"approval": "apr_forged", "capabilities_hash": art.capabilities_hash,
                 "purpose": art.purpose, "roles": ["approver"], "expires_at": None,
                 "comment": ""},
    ))  # fmt: skip
    state = agent(env).approval_state("acme", digest)
    assert [a["principal"] for a in state["approvals"]] == ["acme/coder"]
    assert state["counted"] == [] and state["approved"] is False
    with pytest.raises(UsageError, match="a person approves"):
        env.rt.approvals.set_quorum("acme", 1, ["agent"], env.rt.operator)
