"""Request rules of egress hosts: the manifest's syntax, their place in the approved
capabilities and their digest, the Cedar context, and the broker's matcher and byte
accounting (``broker/_rules.py``), pure logic."""

from __future__ import annotations

import hashlib

import pytest

from proctor.broker._egress import parse_host
from proctor.broker._rules import (
    MAX_LISTED_BODIES,
    BodyDigests,
    Meter,
    check_request,
    decoded_path,
    rules_context,
    rules_for,
)
from proctor.broker._scope import EgressTotals
from proctor.errors import PolicyError, UsageError
from proctor.governance._manifest import Manifest, parse_manifest
from proctor.policy import (
    EgressRule,
    Entity,
    EntityRef,
    EntitySet,
    Request,
    capability_policies,
    compile_policies,
    decide,
    egress_rules,
)

HEAD = """
[artifact]
name = "crm-sync"
entrypoint = ["python3", "main.py"]
purpose = "Read customers from the CRM's REST API"
[egress]
hosts = ["api.example.com", "other.example.com:8443"]
"""

READ_ONLY = """
[egress.rules."api.example.com"]
methods = ["GET"]
paths = ["/v1/customers/*"]
"""


def _rule(**kw: object) -> EgressRule:
    return EgressRule.from_json("api.example.com:443", kw)


# -- the manifest -------------------------------------------------------------------


def test_rules_are_parsed_into_the_capabilities() -> None:
    m = parse_manifest(
        HEAD
        + READ_ONLY
        + """response_bytes = "1M"
run_response_bytes = "10M"
request_bytes = 0
body_digests = true
"""
    )
    assert m.capabilities["egress_rules"] == {
        "api.example.com:443": {
            "methods": ["GET"],
            "paths": ["/v1/customers/*"],
            "request_bytes": 0,
            "response_bytes": 1 << 20,
            "run_response_bytes": 10 << 20,
            "body_digests": True,
        }
    }
    # Stored and read back unchanged (the store keeps to_json()).
    back = Manifest.from_json(m.to_json())
    assert back.capabilities == m.capabilities
    assert back.capabilities_hash == m.capabilities_hash


def test_a_manifest_without_rules_keeps_its_digest() -> None:
    # No "egress_rules" key at all: every manifest approved before rules existed
    # has the capabilities_hash it had.
    m = parse_manifest(HEAD)
    assert "egress_rules" not in m.capabilities
    assert "egress_rules" not in Manifest.from_json(m.to_json()).capabilities


def test_every_change_of_a_rule_changes_the_digest() -> None:
    base = parse_manifest(HEAD + READ_ONLY).capabilities_hash
    assert base != parse_manifest(HEAD).capabilities_hash
    for extra in ('methods = ["GET", "DELETE"]\npaths = ["/v1/customers/*"]',
                  'methods = ["GET"]\npaths = ["/v1/**"]',
                  'methods = ["GET"]\npaths = ["/v1/customers/*"]\nresponse_bytes = 10',
                  'methods = ["GET"]\npaths = ["/v1/customers/*"]\nbody_digests = true'):  # fmt: skip
        other = parse_manifest(HEAD + '[egress.rules."api.example.com"]\n' + extra)
        assert other.capabilities_hash != base, extra


def test_two_spellings_of_the_same_rules_hash_the_same() -> None:
    a = parse_manifest(HEAD + READ_ONLY)
    b = parse_manifest(
        HEAD
        + """
[egress.rules."API.Example.com:443"]
paths = ["/v1/customers/*", "/v1/customers/*"]
methods = ["GET", "GET"]
body_digests = false
"""
    )
    assert a.capabilities_hash == b.capabilities_hash


@pytest.mark.parametrize(
    ("rules", "message"),
    [
        ('[egress.rules."nowhere.example.com"]\nmethods = ["GET"]',
         'egress.rules."nowhere.example.com": nowhere.example.com:443 is not one of egress.hosts'),
        ('[egress.rules."api.example.com"]\nmethods = ["get"]',
         "'get' is not a method name"),
        ('[egress.rules."api.example.com"]\nmethods = ["CONNECT"]', "CONNECT is not a request"),
        ('[egress.rules."api.example.com"]\nmethods = []', "methods is empty"),
        ('[egress.rules."api.example.com"]\nmethods = "GET"', "must be an array of strings"),
        ('[egress.rules."api.example.com"]\npaths = ["v1/*"]', "must start with '/'"),
        ('[egress.rules."api.example.com"]\npaths = ["/v1/x?y=1"]', "'?'"),
        ('[egress.rules."api.example.com"]\npaths = ["/v1/%2e%2e"]', "'%'"),
        ('[egress.rules."api.example.com"]\npaths = ["/v1/../admin"]', "'..' segment"),
        ('[egress.rules."api.example.com"]\npaths = ["/v1//x"]', "empty segment"),
        ('[egress.rules."api.example.com"]\npaths = ["/**/x"]', "'**' may only be"),
        ('[egress.rules."api.example.com"]\nmethod = ["GET"]', "unknown key 'method'"),
        ('[egress.rules."api.example.com"]\nresponse_bytes = "lots"', "is not a size"),
        ('[egress.rules."api.example.com"]\nresponse_bytes = -1', "must not be negative"),
        ('[egress.rules."api.example.com"]\nresponse_bytes = "2M"\nrun_response_bytes = "1M"',
         "response_bytes (2097152) is larger than run_response_bytes (1048576)"),
        ('[egress.rules."api.example.com"]\nbody_digests = "yes"', "must be true or false"),
        ('[egress.rules."api.example.com"]\nbody_digests = false', "sets no rule"),
        ('[egress.rules."api.example.com"]\nmethods = ["GET"]\n'
         '[egress.rules."API.example.com:443"]\nmethods = ["PUT"]', "has rules already"),
        ('[egress.rules."https://api.example.com"]\nmethods = ["GET"]', "is not a host"),
        ("[egress]\nrules = 1", "egress.rules must be a table"),
    ],
)  # fmt: skip
def test_bad_rules_are_refused_in_one_line(rules: str, message: str) -> None:
    text = (
        HEAD + rules
        if not rules.startswith("[egress]")
        else HEAD.split("[egress]", maxsplit=1)[0] + rules
    )
    with pytest.raises(UsageError) as info:
        parse_manifest(text)
    assert message in info.value.message
    assert "\n" not in info.value.message


def test_sixteen_patterns_at_most() -> None:
    paths = ", ".join(f'"/p{i}"' for i in range(17))
    with pytest.raises(UsageError, match="more than 16 path patterns"):
        parse_manifest(HEAD + f'[egress.rules."api.example.com"]\npaths = [{paths}]')


# -- the approved capabilities and Cedar ---------------------------------------------


def test_capability_policies_check_the_rules() -> None:
    caps = {"egress": ["api.example.com:443"],
            "egress_rules": {"api.example.com:443": {"methods": ["GET"]}}}  # fmt: skip
    # No permit of their own: the permits are those of the hosts alone.
    assert capability_policies("t", "d", caps) == capability_policies(
        "t", "d", {"egress": ["api.example.com:443"]}
    )
    with pytest.raises(PolicyError, match="not an egress host"):
        capability_policies("t", "d", {"egress": [], "egress_rules": caps["egress_rules"]})
    with pytest.raises(PolicyError, match="unknown key 'verbs'"):
        capability_policies(
            "t", "d", {**caps, "egress_rules": {"api.example.com:443": {"verbs": ["GET"]}}}
        )
    assert egress_rules(caps)["api.example.com:443"].methods == ("GET",)


def _ask(text: str, context: dict[str, object]) -> tuple[bool, tuple[str, ...]]:
    workload = "spiffe://proctor.test/tenant/t/deployment/d/run/r"
    entities = EntitySet(
        [
            Entity.workload(workload, tenant="t", deployment="d", environment="production",
                            artifact=None, run="r"),
            Entity.deployment("t", "d"),
            Entity(EntityRef.tenant("t")),
            Entity.host("api.example.com"),
        ]
    )  # fmt: skip
    request = Request(
        EntityRef.workload(workload), "http.request", EntityRef.host("api.example.com"),
        context,  # type: ignore[arg-type]
    )  # fmt: skip
    decision = decide(compile_policies(text), request, entities)
    return decision.allowed, decision.policies


def test_the_rules_reach_cedar_as_context() -> None:
    caps = {"egress": ["api.example.com:443"]}
    # A tenant rule: this API only read-only, whatever a manifest asks.
    text = capability_policies("t", "d", caps) + (
        '@id("tenant:crm-read-only")\n'
        'forbid (principal, action == Proctor::Action::"http.request", '
        'resource == Proctor::Host::"api.example.com")\n'
        "unless { context has rules && context.rules has methods && "
        '["GET", "HEAD"].containsAll(context.rules.methods) };\n'
    )
    read_only = _rule(methods=["GET"], paths=["/v1/customers/*"], response_bytes=100)
    writes = _rule(methods=["GET", "DELETE"])
    base = {"method": "CONNECT", "port": 443}
    assert _ask(text, {**base, "rules": read_only.context()}) == (
        True, ("deploy:d:egress:api.example.com:443",)
    )  # fmt: skip
    assert _ask(text, {**base, "rules": writes.context()}) == (False, ("tenant:crm-read-only",))
    assert _ask(text, base) == (False, ("tenant:crm-read-only",))
    # Every key a rule can hold validates against the schema.
    full = _rule(methods=["GET"], paths=["/a"], request_bytes=1, response_bytes=2,
                 run_request_bytes=3, run_response_bytes=4, body_digests=True)  # fmt: skip
    assert _ask(text, {**base, "rules": full.context()})[0]


# -- methods and paths ---------------------------------------------------------------


RO = _rule(methods=["GET"], paths=["/v1/customers/*"])


@pytest.mark.parametrize(
    "target",
    ["/v1/customers/42", "/v1/customers/42?expand=orders", "/v1/customers/cus_9f",
     "/v1/%63ustomers/42"],  # decoded once, as the upstream reads it
)  # fmt: skip
def test_a_path_inside_the_pattern_is_allowed(target: str) -> None:
    assert check_request([RO], "GET", target) is None


@pytest.mark.parametrize(
    "target",
    [
        "/v1/customers", "/v1/customers/", "/v1/customers/42/orders", "/v1/customersX/1",
        "/v1/invoices/1", "/v2/customers/1", "*", "/",
        # Spellings an upstream normalizes into a path outside the pattern.
        "/v1/customers/../invoices", "/v1/customers/%2e%2e/x", "/v1/customers/..%2finvoices",
        "/v1/customers/1%2F..%2F..%2Fadmin", "/v1/customers/%252e%252e", "/v1//customers/1",
        "/v1/customers/1;/../../admin", "/v1/customers/1%3b", "/v1/customers/1\\..\\x",
        "/v1/customers/%ff", "/v1/customers/%00", "/v1/customers/./1",
        "http://api.example.com/v1/customers/1",
    ],
)  # fmt: skip
def test_a_path_outside_the_pattern_is_refused_naming_the_rule(target: str) -> None:
    breach = check_request([RO], "GET", target)
    assert breach is not None
    assert breach.rule == "proctor:egress:rule:api.example.com:443:paths"


@pytest.mark.parametrize("method", ["DELETE", "POST", "get", "HEAD", "PUT"])
def test_a_method_not_allowed_is_refused_naming_the_rule(method: str) -> None:
    breach = check_request([RO], method, "/v1/customers/42")
    assert breach is not None
    assert breach.rule == "proctor:egress:rule:api.example.com:443:methods"
    assert method in breach.message


def test_double_star_matches_whole_segments() -> None:
    rule = _rule(paths=["/v1/**", "/files/*.json"])
    for ok in ("/v1/a", "/v1/a/b/c", "/files/x.json"):
        assert check_request([rule], "POST", ok) is None, ok
    for bad in ("/v1", "/v1/", "/files/.json", "/files/a/b.json", "/files/x.jsonx"):
        assert check_request([rule], "POST", bad) is not None, bad


def test_decoded_path_reads_once() -> None:
    assert decoded_path("/a%20b?x=%2f") == ("/a b", "")  # the query is not the path
    assert decoded_path("/a%2Fb")[0] is None


def test_every_rule_of_a_host_applies() -> None:
    wild = EgressRule.from_json("*.example.com:443", {"methods": ["GET", "POST"]})
    exact = EgressRule.from_json("api.example.com:443", {"paths": ["/v1/**"]})
    rules = {"*.example.com:443": wild, "api.example.com:443": exact}
    host = parse_host("api.example.com")
    both = rules_for(rules, host, 443)
    assert [r.entry for r in both] == ["*.example.com:443", "api.example.com:443"]
    assert rules_for(rules, host, 8443) == ()
    assert [r.entry for r in rules_for(rules, parse_host("x.example.com"), 443)] == [
        "*.example.com:443"
    ]
    assert check_request(both, "GET", "/v1/a") is None
    assert check_request(both, "DELETE", "/v1/a").rule.endswith("*.example.com:443:methods")  # type: ignore[union-attr]
    assert check_request(both, "GET", "/v2/a").rule.endswith("api.example.com:443:paths")  # type: ignore[union-attr]
    # Cedar sees the exact entry's rules.
    assert rules_context(both) == exact.context()
    assert rules_context(()) is None


# -- bytes ---------------------------------------------------------------------------


def test_an_announced_request_body_over_the_bound_is_refused_whole() -> None:
    totals: dict[str, EgressTotals] = {}
    rule = _rule(request_bytes=10, run_request_bytes=15)
    meter = Meter([rule], totals)
    breach = meter.announce_request(11)
    assert breach is not None and breach.rule.endswith(":request_bytes")
    assert totals["api.example.com:443"].request == 0  # nothing charged, nothing sent
    assert Meter([rule], totals).announce_request(10) is None
    # The run's total: 10 sent, 5 left.
    breach = Meter([rule], totals).announce_request(6)
    assert breach is not None and breach.rule.endswith(":run_request_bytes")
    assert Meter([rule], totals).announce_request(5) is None
    assert totals["api.example.com:443"].request == 15
    assert Meter([rule], totals).announce_request(0) is None


def test_a_streamed_request_body_is_stopped_before_the_bound() -> None:
    totals: dict[str, EgressTotals] = {}
    meter = Meter([_rule(request_bytes=10)], totals)
    assert meter.request(4) is None
    assert meter.request(6) is None
    breach = meter.request(1)
    assert breach is not None and breach.rule.endswith(":request_bytes")
    assert meter.up == 10 and totals["api.example.com:443"].request == 10


def test_an_announced_body_is_not_charged_twice() -> None:
    totals: dict[str, EgressTotals] = {}
    meter = Meter([_rule(run_request_bytes=100)], totals)
    assert meter.announce_request(60) is None
    assert meter.request(30) is None and meter.request(30) is None
    assert totals["api.example.com:443"].request == 60


def test_a_response_is_cut_at_the_bound() -> None:
    totals: dict[str, EgressTotals] = {}
    meter = Meter([_rule(response_bytes=10)], totals)
    assert meter.response(6) == (6, None)
    passed, breach = meter.response(6)
    assert passed == 4
    assert breach is not None and breach.rule.endswith(":response_bytes")
    assert "cut" in breach.message


def test_an_announced_response_over_the_bound_is_withheld() -> None:
    totals: dict[str, EgressTotals] = {}
    meter = Meter([_rule(response_bytes=10)], totals)
    breach = meter.announce_response(11)
    assert breach is not None and "withheld" in breach.message
    assert totals["api.example.com:443"].response == 0
    assert meter.announce_response(10) is None
    assert meter.response(10, announced=True) == (10, None)
    assert totals["api.example.com:443"].response == 10


def test_the_run_total_of_responses_holds_across_calls() -> None:
    totals: dict[str, EgressTotals] = {}
    rule = _rule(run_response_bytes=25)
    for _ in range(2):
        assert Meter([rule], totals).response(10) == (10, None)
    passed, breach = Meter([rule], totals).response(10)
    assert passed == 5
    assert breach is not None and breach.rule.endswith(":run_response_bytes")
    # Spent: the next call passes nothing, and an announced body is withheld.
    assert Meter([rule], totals).response(1)[0] == 0
    assert Meter([rule], totals).announce_response(1) is not None


def test_no_bound_no_breach() -> None:
    meter = Meter([_rule(methods=["GET"])], {})
    assert not meter.bounded
    assert meter.allowance() is None
    assert meter.announce_request(1 << 40) is None
    assert meter.response(1 << 30) == (1 << 30, None)


def test_body_digests_list_and_chain() -> None:
    bodies = BodyDigests()
    bodies.finish(200)  # nothing started: nothing recorded
    for i in range(MAX_LISTED_BODIES + 3):
        bodies.start("POST")
        bodies.request(b"req%d" % i)
        bodies.response(b"resp")
        bodies.response(b"onse")
        bodies.finish(201)
        bodies.finish(201)  # once
    doc = bodies.to_json()
    assert doc["bodies_count"] == MAX_LISTED_BODIES + 3
    assert len(doc["bodies"]) == MAX_LISTED_BODIES
    first = doc["bodies"][0]
    assert first["request_sha256"] == hashlib.sha256(b"req0").hexdigest()
    assert first["response_sha256"] == hashlib.sha256(b"response").hexdigest()
    assert first["method"] == "POST" and first["status"] == 201
    chain = hashlib.sha256()
    for i in range(MAX_LISTED_BODIES + 3):
        req = hashlib.sha256(b"req%d" % i).hexdigest()
        chain.update((req + hashlib.sha256(b"response").hexdigest()).encode())
    assert doc["bodies_chain"] == "sha256:" + chain.hexdigest()


def test_the_verifier_decides_an_event_again_with_its_rules() -> None:
    from proctor.evidence._policies import redecide

    caps = {"egress": ["api.example.com:443"]}
    text = capability_policies("t", "d", caps) + (
        '@id("tenant:crm-read-only")\n'
        'forbid (principal, action == Proctor::Action::"http.request", resource)\n'
        "unless { context has rules && context.rules has methods && "
        '["GET"].containsAll(context.rules.methods) };\n'
    )
    compiled = compile_policies(text)
    rules = _rule(methods=["GET"], paths=["/v1/customers/*"]).context()

    def event(decision: str, policies: list[str], **extra: object) -> dict[str, object]:
        details = {
            "host": "api.example.com",
            "port": 443,
            "method": "CONNECT",
            "address": "93.184.215.14",
            "policy_version": compiled.version,
            **extra,
        }
        return {"tenant": "t", "deployment": "d", "run": "r", "artifact": None,
                "actor": {"type": "workload",
                          "id": "spiffe://td/tenant/t/deployment/d/run/r"},
                "action": "http.request", "resource": "host/api.example.com:443",
                "decision": decision, "policies": policies, "details": details}  # fmt: skip

    allowed = event("allow", ["deploy:d:egress:api.example.com:443"], rules=rules)
    assert redecide(compiled, allowed, "production", 10_000) is None
    # Rules taken out of the record: decided again, the forbid applies and it is named.
    stripped = event("allow", ["deploy:d:egress:api.example.com:443"])
    assert "tenant:crm-read-only" in str(redecide(compiled, stripped, "production", 10_000))


def test_an_approver_sees_the_rules_and_what_loosens_them() -> None:
    from proctor.governance._artifact_diff import capability_words, manifest_changes

    none, ro = parse_manifest(HEAD), parse_manifest(HEAD + READ_ONLY)
    wider = parse_manifest(HEAD + READ_ONLY.replace('["GET"]', '["GET", "DELETE"]'))
    assert (
        "requests to api.example.com:443 only as its rules allow: methods GET; paths "
        "/v1/customers/*" in capability_words(ro.capabilities)
    )
    [added] = manifest_changes(none, ro)
    assert not added.widens and added.subject == "rules of api.example.com:443"
    [dropped] = manifest_changes(ro, none)
    assert dropped.widens and "drops the request rules" in dropped.text
    [changed] = manifest_changes(ro, wider)
    assert changed.widens and "methods DELETE, GET" in changed.text


def test_the_example_in_docs_egress_is_a_manifest_that_parses() -> None:
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "egress.md").read_text()
    block = text.split("## Request rules", 1)[1].split("```toml", 1)[1].split("```", 1)[0]
    m = parse_manifest(HEAD.split("[egress]", maxsplit=1)[0] + block)
    rule = EgressRule.from_json("api.example.com:443", m.capabilities["egress_rules"]
                                ["api.example.com:443"])  # fmt: skip
    assert check_request([rule], "GET", "/v1/customers/42") is None
    assert check_request([rule], "DELETE", "/v1/customers/42") is not None
    assert check_request([rule], "GET", "/v1/invoices/1") is not None
