"""The role policy's forbids on the Agent type hold whatever roles an agent's row
claims (a tampered store, a future role), and an agent deploys only where the Cedar
context says "sandbox": without the environment it is refused (fails closed)."""

from __future__ import annotations

import pytest

from proctor.governance import Principal, explain_refusal, role_policy
from proctor.ledger import Action
from proctor.policy import Entity, EntityRef, EntitySet, Request, compile_policies, decide

POLICY = compile_policies(role_policy("acme"))


def _decide(p: Principal, action: str, resource: EntityRef, context: dict[str, object]) -> object:
    ref = (EntityRef.agent if p.kind == "agent" else EntityRef.user)(p.tenant, p.name)
    roles = tuple(EntityRef.role("acme", r) for r in p.roles)
    entities = [
        Entity(ref, {}, (*roles, EntityRef.tenant("acme"))),
        *(Entity(r, {}, (EntityRef.tenant("acme"),)) for r in roles),
        Entity(EntityRef.tenant("acme"), {}),
        Entity(resource, {}, (EntityRef.tenant("acme"),)),
    ]
    return decide(POLICY, Request(ref, action, resource, context), EntitySet(entities))


@pytest.mark.parametrize("roles", [("agent",), ("admin",), ("approver", "admin", "agent")])
def test_an_agent_never_approves_whatever_roles_it_claims(roles: tuple[str, ...]) -> None:
    agent = Principal("acme", "coder", "agent", roles)
    art = EntityRef.artifact("acme", "sha256:" + "a" * 64)
    for action in (Action.APPROVAL_GRANT, Action.APPROVAL_REJECT):
        d = _decide(agent, action, art, {"principal_is_author": False})
        assert not d.allowed  # type: ignore[attr-defined]
        assert d.policies == ("control:agent-never-approves",)  # type: ignore[attr-defined]
    d = _decide(agent, Action.PRINCIPAL_CREATE, EntityRef.user("acme", "x"), {})
    assert not d.allowed  # type: ignore[attr-defined]
    assert "a person administers" in (explain_refusal(d.policies) or "")  # type: ignore[attr-defined]
    # A person with the same roles is allowed: the forbid is the Agent type's.
    person = Principal("acme", "alice", "user", tuple(r for r in roles if r != "agent"))
    if "admin" in person.roles:
        d = _decide(person, Action.APPROVAL_GRANT, art, {"principal_is_author": False})
        assert d.allowed  # type: ignore[attr-defined]


def test_an_agent_deploys_to_the_sandbox_only_and_fails_closed() -> None:
    for roles in (("agent",), ("admin",)):
        agent = Principal("acme", "coder", "agent", roles)
        dep = EntityRef.deployment("acme", "job")
        for action in (Action.DEPLOYMENT_CREATE, Action.DEPLOYMENT_ROLLBACK):
            for context, allowed in (
                ({"environment": "sandbox"}, action == Action.DEPLOYMENT_CREATE
                 or "admin" in roles),
                ({"environment": "production"}, False),
                ({"environment": "Sandbox"}, False),
                ({}, False),
            ):  # fmt: skip
                d = _decide(agent, action, dep, context)
                assert d.allowed is allowed, (roles, action, context)  # type: ignore[attr-defined]
                if context.get("environment") != "sandbox":
                    assert d.policies == ("control:agent-sandbox-only",)  # type: ignore[attr-defined]
    # A developer (a person) is not held by it.
    dev = Principal("acme", "dev", "user", ("developer",))
    d = _decide(dev, Action.DEPLOYMENT_CREATE, EntityRef.deployment("acme", "job"), {})
    assert d.allowed  # type: ignore[attr-defined]
