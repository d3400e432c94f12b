"""The policy engine: compile once, decide fail-closed, name decisions by @id.

cedarpy is the real engine in every test; nothing is mocked.
"""

from __future__ import annotations

import hashlib
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import proctor.policy as policy
from proctor.errors import PolicyError, ProctorError
from proctor.policy import (
    CompiledPolicies,
    Decision,
    Entity,
    EntityRef,
    EntitySet,
    IpAddr,
    Request,
    compile_policies,
    decide,
    evaluate_request,
    normalize_text,
    policy_version,
)

WORKLOAD = "spiffe://proctor.test/tenant/acme/deployment/churn/run/r1"
CUSTOMERS = EntityRef.table("acme", "crm", "customers")
PRINCIPAL = EntityRef.workload(WORKLOAD)


@pytest.fixture(scope="module")
def base() -> EntitySet:
    return EntitySet(
        [
            Entity.workload(WORKLOAD, tenant="acme", deployment="churn", environment="production"),
            Entity.table("acme", "crm", "customers"),
        ]
    )


def select(*columns: str, resource: EntityRef = CUSTOMERS) -> Request:
    return Request(PRINCIPAL, "sql.select", resource, {"dataset": "crm", "columns": set(columns)})


PERMIT_SELECT = """
@id("select-customers")
permit (
  principal in Proctor::Deployment::"acme/churn",
  action == Proctor::Action::"sql.select",
  resource == Proctor::Table::"acme/crm/customers"
);
"""


def test_public_surface_is_exactly_all() -> None:
    public = {name for name in vars(policy) if not name.startswith("_")}
    # Submodules appear as attributes once imported; they are private by name.
    assert public == set(policy.__all__)


def test_policy_error_is_under_the_root() -> None:
    assert issubclass(PolicyError, ProctorError)


def test_empty_policy_set_denies_everything(base: EntitySet) -> None:
    compiled = compile_policies("")
    assert len(compiled) == 0
    decision = decide(compiled, select("id"), base)
    assert decision == Decision(False, (), compiled.version)
    assert decision.decision == "deny"


def test_permit_allows_and_names_the_policy(base: EntitySet) -> None:
    compiled = compile_policies(PERMIT_SELECT)
    decision = decide(compiled, select("id", "email"), base)
    assert decision.allowed
    assert decision.decision == "allow"
    assert decision.policies == ("select-customers",)
    assert decision.version == compiled.version
    assert decision.errors == ()


def test_permit_for_one_action_does_not_allow_another(base: EntitySet) -> None:
    compiled = compile_policies(PERMIT_SELECT)
    write = Request(PRINCIPAL, "sql.write", CUSTOMERS, {"dataset": "crm", "columns": ["id"]})
    assert not decide(compiled, write, base).allowed


def test_forbid_overrides_permit(base: EntitySet) -> None:
    compiled = compile_policies(
        PERMIT_SELECT
        + """
@id("no-email")
forbid (principal, action == Proctor::Action::"sql.select", resource)
when { context.columns.contains("email") };
"""
    )
    assert decide(compiled, select("id"), base).allowed
    denied = decide(compiled, select("id", "email"), base)
    assert not denied.allowed
    assert denied.policies == ("no-email",)


def test_policy_without_id_is_refused_and_named() -> None:
    text = PERMIT_SELECT + '\npermit (principal, action == Proctor::Action::"file.read", resource);'
    with pytest.raises(PolicyError) as info:
        compile_policies(text)
    assert "policy #2 has no @id" in info.value.message
    assert "file.read" in info.value.message


def test_empty_id_is_refused() -> None:
    with pytest.raises(PolicyError, match="no @id"):
        compile_policies('@id("") permit (principal, action, resource);')


def test_duplicate_ids_are_refused() -> None:
    with pytest.raises(PolicyError, match="share @id"):
        compile_policies(PERMIT_SELECT + PERMIT_SELECT)


def test_syntax_error_is_refused_with_cedars_message() -> None:
    with pytest.raises(PolicyError, match="does not parse") as info:
        compile_policies('@id("x") permit (principal, action, resource) when { 1 + };')
    assert "unexpected token" in info.value.message


def test_schema_invalid_policy_is_refused_with_cedars_message() -> None:
    text = """
@id("bad-attr")
permit (principal, action == Proctor::Action::"sql.select", resource)
when { principal.favourite_colour == "blue" };
"""
    with pytest.raises(PolicyError) as info:
        compile_policies(text)
    message = info.value.message
    assert "does not validate" in message
    # Cedar's own words, with its positional id replaced by ours.
    assert "favourite_colour" in message
    assert "`bad-attr`" in message
    assert "policy0" not in message


def test_unknown_entity_type_is_refused() -> None:
    with pytest.raises(PolicyError, match="unrecognized entity type"):
        compile_policies('@id("x") permit (principal == Proctor::Robot::"r", action, resource);')


def test_templates_are_refused() -> None:
    with pytest.raises(PolicyError, match="templates"):
        compile_policies('@id("t") permit (principal == ?principal, action, resource);')


def test_evaluation_error_denies_even_when_a_permit_matches(base: EntitySet) -> None:
    overflow = """
@id("overflow")
permit (principal, action == Proctor::Action::"file.write", resource)
when { context has bytes && context.bytes + 9223372036854775807 > 0 };
@id("plain")
permit (principal, action == Proctor::Action::"file.write", resource);
"""
    compiled = compile_policies(overflow)
    request = Request(
        PRINCIPAL, "file.write", EntityRef.bucket("acme", "reports"), {"key": "a", "bytes": 1}
    )
    decision = decide(compiled, request, base)
    assert not decision.allowed
    assert decision.policies == ("overflow",)
    assert len(decision.errors) == 1
    assert "overflow" in decision.errors[0]


def test_missing_entity_is_an_error_and_a_deny(base: EntitySet) -> None:
    compiled = compile_policies(
        """
@id("wild")
permit (principal, action == Proctor::Action::"http.request", resource)
when { resource.name like "*.example.org" };
"""
    )
    request = Request(
        PRINCIPAL, "http.request", EntityRef.host("a.example.org"), {"method": "GET", "port": 443}
    )
    missing = decide(compiled, request, base)
    assert not missing.allowed
    assert "does not exist" in missing.errors[0]
    present = decide(compiled, request, base.with_added([Entity.host("a.example.org")]))
    assert present.allowed


def test_context_that_does_not_fit_the_schema_denies(base: EntitySet) -> None:
    compiled = compile_policies(PERMIT_SELECT)
    no_columns = Request(PRINCIPAL, "sql.select", CUSTOMERS, {"dataset": "crm"})
    decision = decide(compiled, no_columns, base)
    assert not decision.allowed
    assert decision.errors


def test_wrong_resource_type_for_action_denies(base: EntitySet) -> None:
    compiled = compile_policies(
        '@id("any") permit (principal, action == Proctor::Action::"sql.select", resource);'
    )
    wrong = Request(
        PRINCIPAL, "sql.select", EntityRef.bucket("acme", "b"), {"dataset": "crm", "columns": []}
    )
    assert not decide(compiled, wrong, base).allowed


def test_entities_that_do_not_fit_the_schema_deny_not_raise() -> None:
    compiled = compile_policies(PERMIT_SELECT)
    bogus = Entity(EntityRef.host("x.example"), {"name": 7})
    decision = decide(compiled, select("id"), [bogus])
    assert not decision.allowed
    assert decision.errors and "PolicyError" in decision.errors[0]


def test_entity_list_is_accepted_in_place_of_an_entity_set() -> None:
    compiled = compile_policies(PERMIT_SELECT)
    entities = [Entity.workload(WORKLOAD, tenant="acme", deployment="churn")]
    assert decide(compiled, select("id"), entities).allowed


def test_entity_set_is_immutable_when_extended(base: EntitySet) -> None:
    extended = base.with_added([Entity.host("api.example.com")])
    assert len(extended) == len(base) + 1


def test_ip_address_context(base: EntitySet) -> None:
    compiled = compile_policies(
        """
@id("loopback-test-server")
permit (principal, action == Proctor::Action::"http.request", resource)
when { context has address && context.address.isInRange(ip("127.0.0.0/8")) };
"""
    )
    entities = base.with_added([Entity.host("localhost")])

    def ask(address: str) -> bool:
        request = Request(
            PRINCIPAL,
            "http.request",
            EntityRef.host("localhost"),
            {"method": "GET", "port": 80, "address": IpAddr(address)},
        )
        return decide(compiled, request, entities).allowed

    assert ask("127.0.0.1")
    assert not ask("10.0.0.1")


def test_control_plane_decision_with_separation_of_duties() -> None:
    compiled = compile_policies(
        """
@id("approvers-approve")
permit (
  principal in Proctor::Role::"acme/approver",
  action == Proctor::Action::"approval.grant",
  resource in Proctor::Tenant::"acme"
);
@id("no-self-approval")
forbid (principal, action == Proctor::Action::"approval.grant", resource)
when { context.principal_is_author };
"""
    )
    alice = EntityRef.user("acme", "alice")
    artifact = EntityRef.artifact("acme", "sha256:ab")
    entities = EntitySet(
        [
            Entity(alice, {}, (EntityRef.role("acme", "approver"), EntityRef.tenant("acme"))),
            Entity.in_tenant(artifact, "acme"),
        ]
    )

    def grant(is_author: bool) -> Decision:
        return decide(
            compiled,
            Request(alice, "approval.grant", artifact, {"principal_is_author": is_author}),
            entities,
        )

    assert grant(False).policies == ("approvers-approve",)
    assert grant(True).policies == ("no-self-approval",)
    assert not grant(True).allowed
    # The author flag is required: forgetting it is refused, not waved through.
    forgot = decide(compiled, Request(alice, "approval.grant", artifact), entities)
    assert not forgot.allowed


def test_unknown_action_and_entity_type_are_refused_at_construction() -> None:
    with pytest.raises(PolicyError, match="unknown action"):
        Request(PRINCIPAL, "sql.drop", CUSTOMERS)
    with pytest.raises(PolicyError, match="unknown entity type"):
        EntityRef("Robot", "r2")


def test_entity_ref_forms() -> None:
    assert EntityRef("Proctor::Table", "x") == EntityRef("Table", "x")
    assert str(EntityRef.table("acme", "crm", "t")) == 'Proctor::Table::"acme/crm/t"'
    with pytest.raises(PolicyError):
        EntityRef.table("acme", "crm/x", "t")
    assert Request(PRINCIPAL, 'Proctor::Action::"sql.select"', CUSTOMERS).action == "sql.select"


def test_out_of_range_integer_is_refused_not_truncated(base: EntitySet) -> None:
    compiled = compile_policies(PERMIT_SELECT)
    request = Request(
        PRINCIPAL, "sql.select", CUSTOMERS, {"dataset": "crm", "columns": [], "row_limit": 2**64}
    )
    decision = decide(compiled, request, base)
    assert not decision.allowed
    assert "Long" in decision.errors[0]


# ---- versions -----------------------------------------------------------


def test_version_is_sha256_of_normalized_text() -> None:
    compiled = compile_policies(PERMIT_SELECT)
    assert compiled.text == normalize_text(PERMIT_SELECT)
    assert compiled.version == "sha256:" + hashlib.sha256(compiled.text.encode()).hexdigest()


def test_version_is_stable_for_identical_text_and_changes_with_text() -> None:
    a = compile_policies(PERMIT_SELECT)
    assert compile_policies(PERMIT_SELECT).version == a.version
    # Line endings and trailing blanks are not content.
    assert compile_policies(PERMIT_SELECT.replace("\n", "  \r\n")).version == a.version
    changed = PERMIT_SELECT.replace("select-customers", "select-customers-2")
    assert compile_policies(changed).version != a.version


@settings(max_examples=50, deadline=None)
@given(st.text(alphabet=st.characters(blacklist_categories=["Cs"]), max_size=200))
def test_normalization_is_idempotent(text: str) -> None:
    once = normalize_text(text)
    assert normalize_text(once) == once
    assert policy_version(text) == policy_version(once)


# ---- proctor policy test ---------------------------------------------------


def test_evaluate_request_from_json() -> None:
    compiled = compile_policies(PERMIT_SELECT)
    payload = {
        "principal": {"type": "Workload", "id": WORKLOAD},
        "action": "sql.select",
        "resource": {"type": "Proctor::Table", "id": "acme/crm/customers"},
        "context": {"dataset": "crm", "columns": ["id"]},
        "entities": [
            {
                "uid": {"type": "Workload", "id": WORKLOAD},
                "attrs": {"environment": "production"},
                "parents": [{"type": "Deployment", "id": "acme/churn"}],
            }
        ],
    }
    out = evaluate_request(compiled, json.dumps(payload)).to_json()
    assert out == {
        "decision": "allow",
        "allowed": True,
        "policies": ["select-customers"],
        "version": compiled.version,
        "errors": [],
    }
    payload["entities"] = []
    assert evaluate_request(compiled, payload).to_json()["decision"] == "deny"


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        ("not json", "not valid JSON"),
        ("[]", "JSON object"),
        ({"action": "sql.select"}, "no 'principal'"),
        (
            {"principal": {"type": "Workload"}, "action": "sql.select", "resource": {}},
            "principal must be",
        ),
        (
            {
                "principal": {"type": "Workload", "id": "w"},
                "action": "sql.nope",
                "resource": {"type": "Table", "id": "t"},
            },
            "unknown action",
        ),
        ({"principal": 1, "surprise": True}, "unknown fields"),
    ],
)
def test_evaluate_request_refuses_malformed_input(payload: object, message: str) -> None:
    compiled = compile_policies("")
    with pytest.raises(PolicyError, match=message):
        evaluate_request(compiled, payload)  # type: ignore[arg-type]


def test_compiled_policies_repr_and_ids() -> None:
    compiled = compile_policies(PERMIT_SELECT)
    assert isinstance(compiled, CompiledPolicies)
    assert compiled.policy_ids == ("select-customers",)
    assert "sha256:" in repr(compiled)


def test_schema_is_packaged_and_lists_every_action() -> None:
    text = policy.schema_text()
    for action in policy.ACTIONS:
        assert f'"{action}"' in text
    for entity_type in policy.ENTITY_TYPES:
        assert f"entity {entity_type}" in text
