"""The subprocessor forbid, decided by Cedar itself: no register, no egress."""

from __future__ import annotations

from pathlib import Path

import pytest

from proctor.errors import AlreadyExists, NotFound, UsageError
from proctor.governance._subprocessors import (
    FORBID_ID,
    Subprocessor,
    Subprocessors,
    covers,
    subprocessor_forbid,
)
from proctor.ledger import Actor
from proctor.policy import (
    Decision,
    Entity,
    EntityRef,
    EntitySet,
    Request,
    capability_policies,
    compile_policies,
    decide,
)
from proctor.runtime import Runtime, init_home

WORKLOAD = "spiffe://proctor.test/tenant/acme/deployment/churn/run/r1"
CAPS = {"egress": ["api.example.com:443", "*.example.org", "api.unlisted.example:443"]}


def sp(name: str, *hosts: str) -> Subprocessor:
    return Subprocessor("acme", name, "p", "EU", hosts, "t", "op")


def http(text: str, host: str, port: int = 443) -> Decision:
    request = Request(
        EntityRef.workload(WORKLOAD),
        "http.request",
        EntityRef.host(host),
        {"method": "GET", "port": port, "path": "/"},
    )
    entities = EntitySet(
        [Entity.workload(WORKLOAD, tenant="acme", deployment="churn"), Entity.host(host)]
    )
    return decide(compile_policies(text), request, entities)


def with_permits(forbid: str) -> str:
    return capability_policies("acme", "churn", CAPS) + "\n" + forbid


def test_empty_register_refuses_every_host() -> None:
    text = with_permits(subprocessor_forbid("acme", []))
    for host in ("api.example.com", "a.example.org", "api.unlisted.example"):
        d = http(text, host)
        assert not d.allowed
        assert d.policies == (FORBID_ID,)


def test_covered_host_allowed_only_with_a_permit() -> None:
    forbid = subprocessor_forbid("acme", [sp("stripe", "api.example.com:443")])
    assert http(with_permits(forbid), "api.example.com").allowed
    # Covered by the register but no deployment permit: still deny by default.
    assert not http(forbid, "api.example.com").allowed
    # Wrong port: not covered.
    assert not http(with_permits(forbid), "api.example.com", 8443).allowed


def test_uncovered_host_refused_even_with_a_permit() -> None:
    forbid = subprocessor_forbid("acme", [sp("stripe", "api.example.com:443")])
    d = http(with_permits(forbid), "api.unlisted.example")
    assert not d.allowed
    assert FORBID_ID in d.policies


def test_wildcard_coverage() -> None:
    forbid = subprocessor_forbid("acme", [sp("cdn", "*.example.org")])
    text = with_permits(forbid)
    assert http(text, "a.example.org").allowed
    assert http(text, "deep.b.example.org").allowed
    # "*.domain" never covers the domain itself, nor a look-alike suffix.
    assert not http(text, "example.org").allowed
    assert not http(text, "evilexample.org").allowed


def test_other_tenants_register_does_not_count() -> None:
    other = Subprocessor("globex", "x", "p", "EU", ("api.example.com:443",), "t", "op")
    assert not http(with_permits(subprocessor_forbid("acme", [other])), "api.example.com").allowed


def test_covers_matches_the_cedar_rule() -> None:
    assert covers("api.example.com:443", "api.example.com", 443)
    assert not covers("api.example.com:443", "api.example.com", 80)
    assert covers("*.example.org:443", "a.example.org", 443)
    assert not covers("*.example.org:443", "example.org", 443)
    assert covers("[2001:db8::1]:443", "2001:db8::1", 443)


def test_ipv6_entry_compiles() -> None:
    forbid = subprocessor_forbid("acme", [sp("v6", "[2001:db8::1]:443")])
    compile_policies(forbid)


def test_register_is_recorded_and_enforced(tmp_path: Path) -> None:
    init_home(tmp_path / "h", "proctor.test")
    with Runtime.open(tmp_path / "h") as rt:
        rt.tenants.create("acme", rt.operator)
        reg = Subprocessors(rt.store, rt.ledger)
        actor = Actor("operator", "op")
        s = reg.add("acme", "stripe", purpose="payments", location="IE",
                    hosts=["API.Example.com", "*.example.org:8443"], actor=actor)  # fmt: skip
        assert s.hosts == ("*.example.org:8443", "api.example.com:443")
        with pytest.raises(AlreadyExists):
            reg.add("acme", "stripe", purpose="p", location="IE", hosts=["x.example"], actor=actor)
        with pytest.raises(UsageError):
            reg.add("acme", "bad", purpose="p", location="IE", hosts=["http://x/"], actor=actor)
        assert [x.name for x in reg.list("acme")] == ["stripe"]
        assert [x.name for x in reg.covering("acme", "a.example.org", 8443)] == ["stripe"]
        compile_policies(reg.forbid("acme"))
        reg.remove("acme", "stripe", actor)
        with pytest.raises(NotFound):
            reg.remove("acme", "stripe", actor)
        assert reg.list("acme") == []
        actions = [e for e in rt.ledger.entries("acme")]
        assert b"subprocessor.add" in actions[-2] and b"subprocessor.remove" in actions[-1]
