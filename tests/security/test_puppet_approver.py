"""Separation of duties through a puppet (issue 13, item 6).

An admin who creates a principal, or issues it a token, holds that principal's
token: its approval is the admin's own. An approval counts only from a principal
independent of the author, derived from the record (``principal.create`` and
``token.issue`` events), and ``approve`` refuses a puppet up front, recorded.
Every attack is tried for real on a real home (SQLite, ledger, signatures).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from proctor.governance import ApprovalRequired, ControlDenied
from proctor.ledger import Actor
from tests.conftest import run_cli
from tests.e2e.conftest_gov import Gov, build_gov


@pytest.fixture
def gov(tmp_path: Path) -> Iterator[Gov]:
    g = build_gov(tmp_path)
    yield g
    g.rt.close()


def _create(gov: Gov, name: str, roles: list[str], by: Actor) -> None:
    gov.people[name] = gov.rt.principals.create("acme", name, "user", roles, by)


def _artifact(gov: Gov, author: str) -> Any:
    digest = gov.submit("acme", gov.artifact_dir("job", f"print('{author}')"), author=author)
    return gov.rt.artifacts.get("acme", digest)


def _deploy(gov: Gov, artifact: Any) -> Any:
    return gov.rt.deployments.deploy("acme", artifact, "job", environment="production",
                                     instruction="nightly (RET-1)", actor=gov.op)  # fmt: skip


def _last(gov: Gov) -> dict[str, Any]:
    return json.loads(list(gov.rt.ledger.entries("acme"))[-1])


def test_an_approver_the_author_created_is_refused_and_recorded(gov: Gov) -> None:
    root = gov.principal("root")
    _create(gov, "puppet", ["approver"], root.actor)
    artifact = _artifact(gov, "root")
    with pytest.raises(ControlDenied, match=r"acme/puppet.*acme/root"):
        gov.rt.approvals.grant("acme", artifact.digest, gov.principal("puppet"))
    last = _last(gov)
    assert (last["action"], last["decision"]) == ("approval.grant", "deny")
    assert "acme/root" in last["reason"]
    assert not gov.rt.approvals.for_artifact("acme", artifact.digest)
    with pytest.raises(ApprovalRequired):
        _deploy(gov, artifact)


def test_the_cli_refuses_a_puppet_up_front(gov: Gov) -> None:
    _create(gov, "puppet", ["approver"], gov.principal("root").actor)
    artifact = _artifact(gov, "root")
    res = run_cli("approve", artifact.digest, "-t", "acme", "--yes", "--token", gov.token("puppet"),
                  home=gov.home, check=False)  # fmt: skip
    assert res.code == 5, res.out + res.err
    assert "independent" in res.err and "acme/root" in res.err
    assert (_last(gov)["action"], _last(gov)["decision"]) == ("approval.grant", "deny")


def test_a_puppet_made_through_another_principal_is_refused(gov: Gov) -> None:
    # root makes admin2, admin2 makes the approver: root still holds it.
    _create(gov, "admin2", ["admin"], gov.principal("root").actor)
    _create(gov, "deputy", ["admin"], gov.principal("admin2").actor)
    _create(gov, "puppet", ["approver"], gov.principal("deputy").actor)
    artifact = _artifact(gov, "root")
    with pytest.raises(ControlDenied, match="independent"):
        gov.rt.approvals.grant("acme", artifact.digest, gov.principal("puppet"))


def test_an_approver_whose_token_the_author_issued_later_does_not_count(gov: Gov) -> None:
    artifact = _artifact(gov, "root")
    gov.rt.approvals.grant("acme", artifact.digest, gov.principal("alice"))
    assert _deploy(gov, artifact).approvals
    # Afterwards root issues alice a new token: root holds it, so alice's vote is root's.
    gov.rt.principals.rotate("acme", "alice", gov.principal("root").actor)
    with pytest.raises(ApprovalRequired, match="0 valid approval"):
        _deploy(gov, artifact)


def test_the_store_row_is_not_what_decides(gov: Gov) -> None:
    # The principals row says the operator made the puppet; the record says root did.
    _create(gov, "puppet", ["approver"], gov.principal("root").actor)
    with gov.rt.store.write() as conn:
        conn.execute("UPDATE principals SET created_by = ? WHERE name = 'puppet'", (gov.op.id,))
    artifact = _artifact(gov, "root")
    with pytest.raises(ControlDenied, match="independent"):
        gov.rt.approvals.grant("acme", artifact.digest, gov.principal("puppet"))


def test_an_approver_cannot_approve_the_code_of_a_developer_it_created(gov: Gov) -> None:
    # The mirror: root holds dev2's token, submits as dev2 and approves as root.
    _create(gov, "dev2", ["developer"], gov.principal("root").actor)
    artifact = _artifact(gov, "dev2")
    with pytest.raises(ControlDenied, match="independent"):
        gov.rt.approvals.grant("acme", artifact.digest, gov.principal("root"))


def test_an_independent_approver_counts(gov: Gov) -> None:
    _create(gov, "puppet", ["approver"], gov.principal("root").actor)
    artifact = _artifact(gov, "root")
    # alice and bob were made by the operator, not by root.
    gov.rt.approvals.grant("acme", artifact.digest, gov.principal("alice"))
    dep = _deploy(gov, artifact)
    assert len(dep.approvals) == 1
    # A developer's artifact approved by an approver made by an admin: independent.
    _create(gov, "carol", ["approver"], gov.principal("root").actor)
    art2 = _artifact(gov, "dev")
    gov.rt.approvals.grant("acme", art2.digest, gov.principal("carol"))
    assert gov.rt.approvals.require_quorum("acme", art2)
