"""Approved capabilities become exactly the permits of one deployment's workloads."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proctor.errors import PolicyError
from proctor.policy import (
    CompiledPolicies,
    Decision,
    Entity,
    EntityRef,
    EntitySet,
    Request,
    capability_policies,
    compile_policies,
    decide,
    normalize_host,
)

CAPS = {
    "datasets": {
        "crm": {
            "tables": {
                "customers": {"columns": ["id", "country"], "access": "read"},
                "notes": {"columns": ["body"], "access": "read-write"},
            }
        }
    },
    "egress": ["api.example.com:443", "*.example.org", "127.0.0.1:8080"],
    "secrets": ["crm_token"],
    "buckets": {"reports": "write", "inputs": "read"},
}
WORKLOAD = "spiffe://proctor.test/tenant/acme/deployment/churn/run/r1"
OTHER_DEPLOYMENT = "spiffe://proctor.test/tenant/acme/deployment/other/run/r9"
GLOBEX = "spiffe://proctor.test/tenant/globex/deployment/churn/run/r2"


@pytest.fixture(scope="module")
def compiled() -> CompiledPolicies:
    return compile_policies(capability_policies("acme", "churn", CAPS))


def run_entities(
    workload: str = WORKLOAD, tenant: str = "acme", deployment: str = "churn"
) -> EntitySet:
    return EntitySet([Entity.workload(workload, tenant=tenant, deployment=deployment)])


def sql(
    compiled: CompiledPolicies,
    columns: list[str],
    *,
    table: str = "customers",
    action: str = "sql.select",
    tenant: str = "acme",
    workload: str = WORKLOAD,
    dataset: str = "crm",
    entities: EntitySet | None = None,
) -> Decision:
    request = Request(
        EntityRef.workload(workload),
        action,
        EntityRef.table(tenant, dataset, table),
        {"dataset": dataset, "columns": columns},
    )
    return decide(compiled, request, entities or run_entities())


def http(
    compiled: CompiledPolicies, host: str, port: int = 443, workload: str = WORKLOAD
) -> Decision:
    request = Request(
        EntityRef.workload(workload),
        "http.request",
        EntityRef.host(host),
        {"method": "GET", "port": port, "path": "/"},
    )
    return decide(compiled, request, run_entities(workload).with_added([Entity.host(host)]))


def test_ids_name_the_capability_entries(compiled: CompiledPolicies) -> None:
    assert set(compiled.policy_ids) == {
        "deploy:churn:sql:crm.customers",
        "deploy:churn:sql:crm.notes",
        "deploy:churn:egress:api.example.com:443",
        "deploy:churn:egress:*.example.org:443",
        "deploy:churn:egress:127.0.0.1:8080",
        "deploy:churn:secret:crm_token",
        "deploy:churn:file:reports",
        "deploy:churn:file:inputs",
    }


def test_same_capabilities_give_the_same_version() -> None:
    reordered = {
        "buckets": {"inputs": "read", "reports": "write"},
        "secrets": ["crm_token", "crm_token"],
        "egress": list(reversed(CAPS["egress"])),  # type: ignore[call-overload]
        "datasets": CAPS["datasets"],
    }
    a = compile_policies(capability_policies("acme", "churn", CAPS))
    b = compile_policies(capability_policies("acme", "churn", reordered))
    assert a.version == b.version


def test_empty_capabilities_permit_nothing() -> None:
    assert capability_policies("acme", "churn", {}) == ""


# ---- SQL ---------------------------------------------------------------------


def test_approved_columns_are_allowed(compiled: CompiledPolicies) -> None:
    for columns in (["id"], ["country"], ["id", "country"], []):
        decision = sql(compiled, columns)
        assert decision.allowed, columns
        assert decision.policies == ("deploy:churn:sql:crm.customers",)


def test_one_column_more_is_denied(compiled: CompiledPolicies) -> None:
    # SELECT * reports every column, including the one nobody approved.
    decision = sql(compiled, ["id", "country", "email"])
    assert not decision.allowed
    assert decision.policies == ()


def test_column_names_are_exact(compiled: CompiledPolicies) -> None:
    for column in ("ID", "id ", "countr", "country\x00"):
        assert not sql(compiled, [column]).allowed, column


def test_read_grant_does_not_write(compiled: CompiledPolicies) -> None:
    assert not sql(compiled, ["id"], action="sql.write").allowed


def test_read_write_grant_does_both(compiled: CompiledPolicies) -> None:
    assert sql(compiled, ["body"], table="notes").allowed
    assert sql(compiled, ["body"], table="notes", action="sql.write").allowed
    assert not sql(compiled, ["body", "author"], table="notes", action="sql.write").allowed


def test_unapproved_table_and_dataset_are_denied(compiled: CompiledPolicies) -> None:
    assert not sql(compiled, ["id"], table="invoices").allowed
    assert not sql(compiled, ["id"], dataset="billing").allowed


def test_dataset_in_context_must_match(compiled: CompiledPolicies) -> None:
    request = Request(
        EntityRef.workload(WORKLOAD),
        "sql.select",
        EntityRef.table("acme", "crm", "customers"),
        {"dataset": "billing", "columns": ["id"]},
    )
    assert not decide(compiled, request, run_entities()).allowed


def test_other_tenants_resources_are_denied(compiled: CompiledPolicies) -> None:
    # Same dataset, table and column names, another tenant's table.
    assert not sql(compiled, ["id"], tenant="globex").allowed


def test_other_tenants_workload_is_denied(compiled: CompiledPolicies) -> None:
    globex = run_entities(GLOBEX, tenant="globex", deployment="churn")
    assert not sql(compiled, ["id"], workload=GLOBEX, entities=globex).allowed


def test_other_deployment_of_the_same_tenant_is_denied(compiled: CompiledPolicies) -> None:
    other = run_entities(OTHER_DEPLOYMENT, deployment="other")
    assert not sql(compiled, ["id"], workload=OTHER_DEPLOYMENT, entities=other).allowed


def test_unknown_workload_is_denied(compiled: CompiledPolicies) -> None:
    # A workload the caller did not put in the entity set is in no deployment.
    assert not sql(compiled, ["id"], entities=EntitySet()).allowed


def test_tenant_wide_forbid_still_applies() -> None:
    text = capability_policies("acme", "churn", CAPS) + (
        '\n@id("tenant:no-country")\n'
        'forbid (principal, action == Proctor::Action::"sql.select", resource)\n'
        'when { context.columns.contains("country") };\n'
    )
    compiled = compile_policies(text)
    assert sql(compiled, ["id"]).allowed
    denied = sql(compiled, ["id", "country"])
    assert not denied.allowed
    assert denied.policies == ("tenant:no-country",)


@settings(max_examples=40, deadline=None)
@given(
    approved=st.lists(
        st.text(st.characters(blacklist_categories=["Cs", "Cc"]), min_size=1, max_size=12).filter(
            str.isprintable
        ),
        min_size=1,
        max_size=5,
        unique=True,
    ),
    extra=st.text(min_size=1, max_size=12),
)
def test_column_subset_property(approved: list[str], extra: str) -> None:
    """Any approved subset is allowed; adding any unapproved name denies.

    Column names go through Cedar's string escaping, so quotes, backslashes
    and unicode in names cannot change the policy's meaning.
    """
    caps = {"datasets": {"d": {"tables": {"t": {"columns": approved, "access": "read"}}}}}
    compiled = compile_policies(capability_policies("acme", "churn", caps))
    assert sql(compiled, approved, table="t", dataset="d").allowed
    assert sql(compiled, approved[:1], table="t", dataset="d").allowed
    if extra not in approved:
        assert not sql(compiled, [*approved, extra], table="t", dataset="d").allowed


# ---- egress --------------------------------------------------------------------


def test_exact_host_and_port(compiled: CompiledPolicies) -> None:
    allowed = http(compiled, "api.example.com", 443)
    assert allowed.allowed
    assert allowed.policies == ("deploy:churn:egress:api.example.com:443",)
    assert http(compiled, "API.Example.COM.", 443).allowed
    assert not http(compiled, "api.example.com", 80).allowed
    assert not http(compiled, "api.example.com", 8443).allowed
    assert not http(compiled, "other.example.com", 443).allowed
    assert not http(compiled, "sub.api.example.com", 443).allowed


def test_ip_literal_entry(compiled: CompiledPolicies) -> None:
    assert http(compiled, "127.0.0.1", 8080).allowed
    assert http(compiled, "[::ffff:127.0.0.1]", 8080).allowed
    assert not http(compiled, "127.0.0.1", 8081).allowed
    assert not http(compiled, "127.0.0.2", 8080).allowed


@pytest.mark.parametrize("host", ["127.1", "2130706433", "0x7f.0.0.1", "0177.0.0.1", "127.0.0.01"])
def test_other_spellings_of_an_address_are_refused(host: str) -> None:
    with pytest.raises(PolicyError, match="canonical IPv4"):
        normalize_host(host)


@pytest.mark.parametrize(
    ("host", "allowed"),
    [
        ("a.example.org", True),
        ("a.b.example.org", True),
        ("A.EXAMPLE.ORG.", True),
        ("example.org", False),
        ("evilexample.org", False),
        ("example.org.evil.com", False),
        ("a.example.org.evil.com", False),
        ("a-example.org", False),
        ("example.orgx", False),
        ("xexample.org", False),
    ],
)
def test_wildcard_edges(compiled: CompiledPolicies, host: str, allowed: bool) -> None:
    decision = http(compiled, host)
    assert decision.allowed is allowed
    if allowed:
        assert decision.policies == ("deploy:churn:egress:*.example.org:443",)


def test_wildcard_port_defaults_to_443(compiled: CompiledPolicies) -> None:
    assert not http(compiled, "a.example.org", 80).allowed


@pytest.mark.parametrize(
    "host",
    [
        ".example.org",
        "a..example.org",
        "*.example.org",
        "a.example.org%00",
        "exa mple.org",
        "é.org",
        "",
    ],
)
def test_hosts_that_could_smuggle_past_a_wildcard_are_refused(host: str) -> None:
    with pytest.raises(PolicyError):
        normalize_host(host)


@settings(max_examples=200, deadline=None)
@given(st.from_regex(r"[a-z0-9.-]{1,30}", fullmatch=True))
def test_wildcard_matches_only_names_below_the_domain(name: str) -> None:
    try:
        host = normalize_host(name)
    except PolicyError:
        return
    compiled = _wildcard_only()
    expected = host.endswith(".example.org")
    assert http(compiled, host).allowed is expected


_WILDCARD: list[CompiledPolicies] = []


def _wildcard_only() -> CompiledPolicies:
    if not _WILDCARD:
        _WILDCARD.append(
            compile_policies(capability_policies("acme", "churn", {"egress": ["*.example.org"]}))
        )
    return _WILDCARD[0]


@pytest.mark.parametrize(
    "entry",
    [
        "*.org",
        "*.*.example.org",
        "api.*.example.org",
        "*example.org",
        "a.example.org:0",
        "a:b:c",
        "a:99999",
    ],
)
def test_bad_egress_entries_are_refused(entry: str) -> None:
    with pytest.raises(PolicyError):
        capability_policies("acme", "churn", {"egress": [entry]})


# ---- secrets and buckets -------------------------------------------------------


def test_secrets(compiled: CompiledPolicies) -> None:
    def use(tenant: str, name: str) -> Decision:
        request = Request(
            EntityRef.workload(WORKLOAD),
            "secret.use",
            EntityRef.secret(tenant, name),
            {"host": "api.example.com"},
        )
        return decide(compiled, request, run_entities())

    assert use("acme", "crm_token").policies == ("deploy:churn:secret:crm_token",)
    assert use("acme", "crm_token").allowed
    assert not use("acme", "stripe_key").allowed
    assert not use("globex", "crm_token").allowed


def test_buckets(compiled: CompiledPolicies) -> None:
    def file(action: str, bucket: str, tenant: str = "acme") -> bool:
        request = Request(
            EntityRef.workload(WORKLOAD),
            action,
            EntityRef.bucket(tenant, bucket),
            {"key": "report.csv", "bytes": 10},
        )
        return decide(compiled, request, run_entities()).allowed

    assert file("file.write", "reports")
    assert not file("file.read", "reports")  # write-only, as approved
    assert file("file.read", "inputs")
    assert not file("file.write", "inputs")
    assert not file("file.write", "other")
    assert not file("file.write", "reports", tenant="globex")


# ---- malformed capability sets ----------------------------------------------------


@pytest.mark.parametrize(
    ("caps", "message"),
    [
        ({"network": []}, "unknown capability keys"),
        ({"datasets": []}, "must be a mapping"),
        ({"datasets": {"crm": {"tables": {"t": {"columns": []}}}}}, "list the columns"),
        ({"datasets": {"crm": {"tables": {"t": {"columns": "id"}}}}}, "list of strings"),
        ({"datasets": {"crm": {"tables": {"t": {"columns": ["id"], "access": "all"}}}}}, "access"),
        ({"datasets": {"crm": {"tables": {"t": {"columns": ["id"], "rows": 5}}}}}, "unknown keys"),
        ({"datasets": {"crm": {"views": {}}}}, "unknown keys"),
        ({"datasets": {"a/b": {"tables": {"t": {"columns": ["id"]}}}}}, "no '/'"),
        ({"secrets": "crm_token"}, "list of strings"),
        ({"buckets": {"reports": "delete"}}, "access"),
    ],
)
def test_malformed_capabilities_are_refused(caps: dict[str, object], message: str) -> None:
    with pytest.raises(PolicyError, match=message):
        capability_policies("acme", "churn", caps)


def test_injection_through_names_is_impossible() -> None:
    evil = 'x"); permit (principal, action, resource); //'
    caps = {"datasets": {"crm": {"tables": {"customers": {"columns": [evil]}}}}}
    compiled = compile_policies(capability_policies("acme", "churn", caps))
    assert len(compiled) == 1
    assert sql(compiled, [evil]).allowed
    assert not sql(compiled, ["id"]).allowed
