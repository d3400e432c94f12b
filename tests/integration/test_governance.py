"""Principals, control-plane authorization, approvals and deployments on a real store."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from proctor.broker import locate_dataset
from proctor.errors import AlreadyExists, NotFound, UsageError
from proctor.evidence import to_ocsf
from proctor.governance import KeyRing, Lifecycle, Manifest, Resources, SyntheticOnly, Tenants
from proctor.governance._approvals import ApprovalRequired, Approvals
from proctor.governance._control import ControlDenied, ControlPlane
from proctor.governance._deployments import Deployments
from proctor.governance._principals import AuthenticationFailed, Principals
from proctor.ledger import SYSTEM_LOG, Actor, EventDraft, read_objects, utc_now
from tests.conftest import LedgerEnv

OP = Actor("operator", "local-operator:test")


@dataclass(frozen=True)
class Art:
    """Stands in for the artifacts module's Artifact (tested on its own)."""

    digest: str
    capabilities_hash: str
    purpose: str
    author: str
    capabilities: dict[str, Any] = field(default_factory=dict)
    lifecycle: Lifecycle = field(default_factory=Lifecycle)

    @property
    def manifest(self) -> Manifest:
        return Manifest(self.purpose, ("true",), self.purpose, self.capabilities,
                        lifecycle=self.lifecycle)  # fmt: skip


@dataclass
class Gov:
    env: LedgerEnv
    principals: Principals
    control: ControlPlane
    approvals: Approvals
    deployments: Deployments
    resources: Resources
    artifacts: dict[tuple[str, str], Art]

    def events(self, tenant: str) -> list[dict[str, Any]]:
        return [json.loads(e) for e in self.env.ledger.entries(tenant)]


@pytest.fixture
def gov(ledger_env: LedgerEnv, tmp_path: Path) -> Gov:
    ledger_env.ledger.create_log(SYSTEM_LOG, EventDraft(OP, "runtime.init", "runtime/test"))
    tenants = Tenants(ledger_env.store, ledger_env.ledger)
    tenants.create("acme", OP)
    tenants.create("globex", OP)
    artifacts: dict[tuple[str, str], Art] = {}

    def lookup(tenant: str, digest: str) -> Art:
        try:
            return artifacts[(tenant, digest)]
        except KeyError:
            raise NotFound(f"no artifact {digest}") from None

    control = ControlPlane(ledger_env.ledger)
    approvals = Approvals(ledger_env.store, ledger_env.ledger, control, lookup)
    keys = KeyRing(b"k" * 32)
    resources = Resources(ledger_env.store, ledger_env.ledger, keys, tmp_path / "buckets",
                          locate=locate_dataset)  # fmt: skip
    return Gov(
        ledger_env,
        Principals(ledger_env.store, ledger_env.ledger),
        control,
        approvals,
        Deployments(ledger_env.store, ledger_env.ledger, approvals, resources),
        resources,
        artifacts,
    )


def _people(gov: Gov, tenant: str = "acme") -> dict[str, Any]:
    out = {}
    for name, roles in [
        ("dev", ["developer"]),
        ("alice", ["approver"]),
        ("bob", ["approver"]),
        ("audrey", ["auditor"]),
        ("root", ["admin"]),
    ]:
        out[name] = gov.principals.create(tenant, name, "user", roles, OP)[0]
    return out


def _artifact(gov: Gov, tenant: str, author: str, n: int = 1, mode: str = "job",
              **caps: Any) -> Art:  # fmt: skip
    art = Art(f"sha256:{n:064x}", f"sha256:{'c' * 64}", "churn report", author, caps,
              Lifecycle(mode))  # fmt: skip
    gov.artifacts[(tenant, art.digest)] = art
    # What counts is read from the record: the artifact's submission is in the log.
    kind = "operator" if author.startswith("local-operator:") else "user"
    gov.env.ledger.append(tenant, EventDraft(
        Actor(kind, author), "artifact.submit", f"artifact/{art.digest}", artifact=art.digest,
        details={"digest": art.digest, "capabilities_hash": art.capabilities_hash,
                 "purpose": art.purpose},
    ))  # fmt: skip
    return art


def test_tokens_are_shown_once_and_stored_hashed(gov: Gov) -> None:
    p, token = gov.principals.create("acme", "alice", "user", ["approver"], OP)
    assert gov.principals.authenticate(token) == p
    with gov.env.store.read() as conn:
        rows = conn.query("SELECT token_hash FROM principals")
    assert all(token.encode() not in bytes(r[0]) for r in rows)
    assert token not in json.dumps(gov.events("acme"))
    new = gov.principals.rotate("acme", "alice", OP)
    with pytest.raises(AuthenticationFailed):
        gov.principals.authenticate(token)
    assert gov.principals.authenticate(new).name == "alice"
    gov.principals.set_disabled("acme", "alice", True, OP)
    with pytest.raises(AuthenticationFailed, match="disabled"):
        gov.principals.authenticate(new)
    for bad in ("", "pt_nope", "hello"):
        with pytest.raises(AuthenticationFailed):
            gov.principals.authenticate(bad)
    with pytest.raises(AlreadyExists):
        gov.principals.create("acme", "alice", "user", ["approver"], OP)
    with pytest.raises(UsageError):
        gov.principals.create("acme", "eve", "user", ["god"], OP)


def test_quorum_approval_by_another_principal(gov: Gov) -> None:
    ppl = _people(gov)
    art = _artifact(gov, "acme", ppl["dev"].id)
    with pytest.raises(ApprovalRequired, match="0 valid approval"):
        gov.approvals.require_quorum("acme", art)
    a = gov.approvals.grant("acme", art.digest, ppl["alice"], comment="looks fine")
    assert [x.id for x in gov.approvals.require_quorum("acme", art)] == [a.id]
    ev = gov.events("acme")[-1]
    assert (ev["action"], ev["decision"], ev["approvals"]) == ("approval.grant", "allow", [a.id])
    assert ev["actor"] == {"type": "user", "id": "acme/alice"}
    # What allowed it, as a refusal of the same action names what refused it: the role
    # policy's permit and the version of its text, which is stored with the event.
    role = gov.control.role_policy_object("acme")
    assert ev["policies"] and all(p.startswith("control:") for p in ev["policies"])
    assert ev["details"]["policy_version"] == role.digest
    assert read_objects(gov.env.store, "acme", [role.digest]) == {role.digest: role.data}
    line = to_ocsf(ev, "test.local/tenant/acme")
    assert line["policy"]["uid"] in ev["policies"] and line["policy"]["version"] == role.digest


def test_self_approval_is_refused_by_policy_and_recorded(gov: Gov) -> None:
    ppl = _people(gov)
    art = _artifact(gov, "acme", ppl["alice"].id)  # alice wrote it
    with pytest.raises(ControlDenied, match="separation-of-duties"):
        gov.approvals.grant("acme", art.digest, ppl["alice"])
    ev = gov.events("acme")[-1]
    assert ev["decision"] == "deny" and ev["policies"] == ["control:separation-of-duties"]
    assert gov.approvals.for_artifact("acme", art.digest) == []


@pytest.mark.parametrize("who", ["dev", "audrey"])
def test_roles_without_approval_rights_are_refused(gov: Gov, who: str) -> None:
    ppl = _people(gov)
    art = _artifact(gov, "acme", "acme/someone-else")
    with pytest.raises(ControlDenied, match="no role"):
        gov.approvals.grant("acme", art.digest, ppl[who])
    assert gov.events("acme")[-1]["decision"] == "deny"


def test_approvals_from_another_tenant_are_refused(gov: Gov) -> None:
    _people(gov)
    outsiders = _people(gov, "globex")
    art = _artifact(gov, "acme", "acme/dev")
    with pytest.raises(ControlDenied):
        gov.approvals.grant("acme", art.digest, outsiders["alice"])
    with pytest.raises(ControlDenied):
        gov.approvals.grant("acme", art.digest, outsiders["root"])
    assert gov.approvals.for_artifact("acme", art.digest) == []
    # The refusal is recorded where the outsider lives, naming the target tenant.
    ev = gov.events("globex")[-1]
    assert ev["decision"] == "deny" and ev["details"]["target_tenant"] == "acme"


def test_expired_and_revoked_approvals_do_not_count(gov: Gov) -> None:
    ppl = _people(gov)
    art = _artifact(gov, "acme", ppl["dev"].id)
    short = gov.approvals.grant("acme", art.digest, ppl["alice"], expires=timedelta(seconds=1))
    before = utc_now()
    assert gov.approvals.require_quorum("acme", art, at=before)
    later = "9999-01-01T00:00:00.000000Z"
    with pytest.raises(ApprovalRequired):
        gov.approvals.require_quorum("acme", art, at=later)
    b = gov.approvals.grant("acme", art.digest, ppl["bob"])
    gov.approvals.revoke("acme", b.id, ppl["root"].actor, ppl["root"])
    with pytest.raises(ApprovalRequired):
        gov.approvals.require_quorum("acme", art, at=later)
    assert gov.events("acme")[-1]["action"] == "approval.revoke"
    # History: at the time between, the revoked approval still stood.
    granted = next(e["time"] for e in gov.events("acme")
                   if e["action"] == "approval.grant" and e["approvals"] == [b.id])  # fmt: skip
    assert gov.approvals.valid("acme", art, at=granted)[-1].id == b.id
    del short


def test_changed_capabilities_or_code_need_new_approvals(gov: Gov) -> None:
    ppl = _people(gov)
    art = _artifact(gov, "acme", ppl["dev"].id, n=1)
    gov.approvals.grant("acme", art.digest, ppl["alice"])
    changed = Art(art.digest, f"sha256:{'d' * 64}", art.purpose, art.author)
    with pytest.raises(ApprovalRequired):
        gov.approvals.require_quorum("acme", changed)
    other = _artifact(gov, "acme", ppl["dev"].id, n=2)
    with pytest.raises(ApprovalRequired):
        gov.approvals.require_quorum("acme", other)


def test_quorum_of_two_and_rejection_blocks(gov: Gov) -> None:
    ppl = _people(gov)
    gov.approvals.set_quorum("acme", 2, ["approver"], OP)
    art = _artifact(gov, "acme", ppl["dev"].id)
    gov.approvals.grant("acme", art.digest, ppl["alice"])
    gov.approvals.grant("acme", art.digest, ppl["alice"])  # same person twice: one vote
    with pytest.raises(ApprovalRequired, match="1 valid approval"):
        gov.approvals.require_quorum("acme", art)
    gov.approvals.grant("acme", art.digest, ppl["bob"])
    assert len(gov.approvals.require_quorum("acme", art)) == 2
    r = gov.approvals.reject("acme", art.digest, ppl["bob"], "no")
    with pytest.raises(ApprovalRequired, match="rejected"):
        gov.approvals.require_quorum("acme", art)
    gov.approvals.revoke("acme", r.id, OP)
    assert len(gov.approvals.require_quorum("acme", art)) == 2


def test_production_deploy_needs_quorum_and_records_the_instruction(gov: Gov) -> None:
    ppl = _people(gov)
    art = _artifact(gov, "acme", ppl["dev"].id)
    kw = dict(
        environment="production",
        mode="job",
        instruction="monthly churn report",
        actor=ppl["dev"].actor,
        reference="TICKET-1",
    )
    with pytest.raises(ApprovalRequired):
        gov.deployments.deploy("acme", art, "churn", **kw)  # type: ignore[arg-type]
    a = gov.approvals.grant("acme", art.digest, ppl["alice"])
    dep = gov.deployments.deploy("acme", art, "churn", **kw)  # type: ignore[arg-type]
    assert (dep.version, dep.approvals, dep.status) == (1, (a.id,), "active")
    ev = gov.events("acme")[-1]
    assert ev["action"] == "deployment.create"
    assert ev["details"]["instruction"] == "monthly churn report"
    assert ev["approvals"] == [a.id] and ev["artifact"] == art.digest
    with pytest.raises(UsageError, match="instruction"):
        gov.deployments.deploy(
            "acme", art, "x", environment="production", mode="job", instruction=" ", actor=OP
        )


def test_sandbox_deploy_needs_no_approval_but_only_synthetic_data(gov: Gov, tmp_path: Path) -> None:
    import sqlite3

    for name in ("fake", "real"):
        db = sqlite3.connect(tmp_path / f"{name}.db")
        db.execute("CREATE TABLE t (id INTEGER PRIMARY KEY)")
        db.close()
    gov.resources.add_dataset("acme", "fake", tmp_path / "fake.db", OP, synthetic=True)
    gov.resources.add_dataset("acme", "real", tmp_path / "real.db", OP)
    ok = _artifact(gov, "acme", "acme/dev", n=1, datasets={"fake": {}})
    bad = _artifact(gov, "acme", "acme/dev", n=2, datasets={"real": {}})
    dep = gov.deployments.deploy(
        "acme", ok, "try", environment="sandbox", mode="job", instruction="build loop", actor=OP
    )
    assert dep.approvals == ()
    with pytest.raises(SyntheticOnly, match="real"):
        gov.deployments.deploy(
            "acme",
            bad,
            "try",
            environment="sandbox",
            mode="job",
            instruction="build loop",
            actor=OP,
        )


def test_an_environment_that_is_neither_is_refused_and_records_nothing(gov: Gov) -> None:
    art = _artifact(gov, "acme", "acme/dev", n=1)
    before = len(gov.events("acme"))
    for wrong in ("staging", "Production", "production "):
        with pytest.raises(UsageError, match="--env must be one of sandbox, production"):
            gov.deployments.deploy(
                "acme", art, "churn", environment=wrong, mode="job", instruction="x", actor=OP
            )
    assert len(gov.events("acme")) == before
    assert gov.deployments.current("acme") == []


def test_versions_and_history(gov: Gov) -> None:
    a1 = _artifact(gov, "acme", "acme/dev", n=1, mode="service")
    a2 = _artifact(gov, "acme", "acme/dev", n=2, mode="service")
    d1 = gov.deployments.deploy(
        "acme", a1, "svc", environment="sandbox", mode="service", instruction="i", actor=OP
    )
    d2 = gov.deployments.deploy(
        "acme", a2, "svc", environment="sandbox", mode="service", instruction="i", actor=OP
    )
    versions = gov.deployments.versions("acme", "svc")
    assert [(v.version, v.status) for v in versions] == [(1, "superseded"), (2, "active")]
    assert gov.deployments.at("acme", d1.created_at)[0].digest == a1.digest
    assert gov.deployments.at("acme", d2.created_at)[0].digest == a2.digest
    assert gov.deployments.at("acme", "2000-01-01") == []
