"""OCSF lines are valid OCSF 1.8.0, and the validator catches each kind of violation."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from typing import Any

import pytest

from proctor.evidence import OCSF_VERSION, to_ocsf
from proctor.evidence._ocsf import ocsf_line
from tests.ocsf_validate import VERSION, validate

WORKLOAD = ("workload", "spiffe://proctor.local/tenant/acme/deployment/d/run/r")


def base(
    action: str,
    decision: str = "allow",
    actor: tuple[str, str] = WORKLOAD,
    resource: str = "host/api.example.com:443",
    **details: Any,
) -> dict[str, Any]:
    return {
        "v": 1,
        "seq": 7,
        "time": "2026-12-02T12:38:20.566531Z",
        "tenant": "acme",
        "actor": {"type": actor[0], "id": actor[1]},
        "action": action,
        "resource": resource,
        "decision": decision,
        "policies": ["deploy:d:egress:api.example.com:443"] if decision == "allow" else [],
        "reason": "r",
        "deployment": "d",
        "run": "r",
        "artifact": "sha256:00",
        "approvals": ["apr_1"],
        "details": details,
    }


USER = ("user", "acme/alice")


def _unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    keys = [k for k, _ in pairs]
    assert len(keys) == len(set(keys)), keys
    return dict(pairs)


# One event of each shape the broker and the control plane record (the details
# as src/proctor/broker writes them), allowed and refused.
CASES = [
    (
        base(
            "http.request",
            host="api.example.com",
            port=443,
            method="POST",
            path="/x",
            scheme="https",
            address="93.184.215.14",
            policy_version="sha256:ab",
        ),
        4002,
        6,
    ),
    (base("http.request", host="api.example.com", port=443, method="PATCH", path="/x"), 4002, 9),
    (base("http.request", "deny", host="x.example", port=443, method="CONNECT"), 4002, 1),
    (base("http.request", "deny", method="BREW", target="coffee://pot"), 4002, 99),
    (
        base(
            "http.request",
            "deny",
            host="10.0.0.1",
            port=80,
            method="GET",
            address="10.0.0.1",
            special_ranges=["10.0.0.0/8"],
            error="private",
        ),
        4002,
        3,
    ),
    (
        base(
            "http.request.end",
            host="api.example.com",
            port=443,
            address="93.184.215.14",
            bytes_up=10,
            bytes_down=2000,
            duration_ms=12.5,
            status=200,
            requests=1,
            decision_seq=6,
            secrets=["stripe"],
        ),
        4002,
        99,
    ),
    (
        base(
            "http.request.end",
            host="api.example.com",
            port=443,
            address="93.184.215.14",
            bytes_up=10,
            bytes_down=2000,
            duration_ms=12.5,
            requests=0,
            decision_seq=6,
        ),
        4001,
        2,
    ),
    (
        base(
            "sql.select",
            resource="dataset/crm",
            dataset="crm",
            sql_hmac="ab" * 32,
            tables=[{"table": "customers", "columns": ["id"]}],
            row_count=2,
            truncated=False,
            lineage="rows",
        ),
        6005,
        4,
    ),
    (base("sql.write", "deny", resource="dataset/crm", dataset="crm", tables=[]), 6005, 5),
    (base("sql.select", "deny", resource="dataset/?", dataset="?", error="bad"), 6005, 4),
    (
        base(
            "file.write",
            resource="bucket/reports/a/k.txt",
            bucket="reports",
            key="a/k.txt",
            bytes=3,
            sha256="00" * 32,
        ),
        6005,
        5,
    ),
    (base("file.read", "deny", resource="bucket/inbox/x", bucket="inbox", key="x"), 6005, 1),
    (
        base(
            "secret.use",
            resource="secret/stripe",
            secret="stripe",
            host="api.example.com",
            port=443,
        ),
        6003,
        2,
    ),
    (base("secret.use", "deny", resource="secret/stripe", secret="stripe", where="url"), 6003, 2),
    (base("approval.grant", actor=USER, resource="artifact/sha256:00"), 6003, 1),
    (base("run.start", actor=("runtime", "proctor"), resource="run/r"), 6003, 1),
    (base("tenant.freeze", actor=("operator", "root"), resource="tenant/acme"), 6003, 4),
    (base("deployment.rollback", actor=("service", "acme/ci"), resource="deployment/d"), 6003, 3),
    (base("broker.whoami", resource="run/r"), 6003, 99),
]
MARKER = {
    "action": "ledger.pruned",
    "pruned": {"at": "2027-01-01T00:00:00.000000Z", "by": "prn_1", "leaf_hash": "AAAA", "rule": "r"},
    "seq": 7,
    "tenant": "acme",
    "time": "2026-12-02T12:38:20.566531Z",
    "v": 1,
}  # fmt: skip


@pytest.mark.parametrize(("event", "class_uid", "activity_id"), CASES)
def test_every_shape_is_valid_ocsf(event: dict[str, Any], class_uid: int, activity_id: int) -> None:
    out = to_ocsf(event, "proctor.test/tenant/acme")
    line = ocsf_line(event, "proctor.test/tenant/acme")
    # The line is the event, once: one JSON object without a repeated member.
    assert json.loads(line, object_pairs_hook=_unique) == out
    result = validate(out)
    assert result.errors == []
    assert OCSF_VERSION == VERSION == out["metadata"]["version"]
    assert (out["class_uid"], out["activity_id"]) == (class_uid, activity_id)
    allowed = event["decision"] == "allow"
    assert (out["action_id"], out["disposition_id"], out["status_id"]) == (
        (1, 1, 1) if allowed else (2, 2, 2)
    )
    cited = event["policies"]
    if cited:
        assert [a["policy"]["uid"] for a in out["authorizations"]] == cited
        assert out["policy"]["uid"] == cited[0]
        assert {a["decision"] for a in out["authorizations"]} == {event["decision"]}
    else:
        # No policy cited, and the reason is not Cedar's default deny: none is named.
        assert "policy" not in out and "authorizations" not in out
    meta = out["metadata"]
    assert (meta["sequence"], meta["uid"], meta["tenant_uid"]) == (7, "acme:7", "acme")
    assert meta["log_name"] == "proctor.test/tenant/acme" and meta["correlation_uid"] == "r"
    assert meta["event_code"] == event["action"] and meta["product"]["version"]
    assert out["time"] == meta["logged_time"] == 1796215100566
    user = out["actor"]["user"]
    assert user["uid"] == event["actor"]["id"] and user["name"] and "type_id" in user
    names = {o["name"]: o["value"] for o in out["observables"]}
    assert names["actor.user.uid"] == event["actor"]["id"]
    dst = out.get("dst_endpoint", {})
    for attr in ("hostname", "ip"):
        if attr in dst:
            assert names[f"dst_endpoint.{attr}"] == dst[attr]
    if event["actor"]["type"] == "workload":
        # The run, deployment and artifact have standard homes for a workload.
        assert (out["actor"]["app_name"], out["actor"]["app_uid"]) == ("d", "sha256:00")
        assert out["src_endpoint"]["uid"] == "r"
    else:
        # Not an identity passed off as a network endpoint's address or id.
        src = out["src_endpoint"]
        assert "ip" not in src and "hostname" not in src and src.get("uid") is None
        uids = [r["uid"] for r in out["resources"]]
        assert "deployment/d" in uids or event["resource"] == "deployment/d"
    assert out["unmapped"]["approvals"] == ["apr_1"]
    # Nothing of the event is lost: each detail is mapped or kept in unmapped.
    text = json.dumps(out)
    for key, value in event["details"].items():
        assert json.dumps(value) in text or str(value) in text, key


def test_a_pruned_marker_is_valid_ocsf_and_keeps_its_leaf() -> None:
    out = to_ocsf(MARKER, "o")
    assert validate(json.loads(json.dumps(out))).errors == []
    assert (out["class_uid"], out["metadata"]["event_code"]) == (6003, "ledger.pruned")
    assert out["unmapped"]["pruned"] == MARKER["pruned"]


def _planted() -> list[tuple[str, Callable[[dict[str, Any]], None], str]]:
    def drop_profile(o: dict[str, Any]) -> None:
        o["metadata"]["profiles"] = ["host"]

    return [
        ("missing required", lambda o: o.pop("severity_id"), "'severity_id' is a required"),
        ("missing nested", lambda o: o["metadata"].pop("product"), "'product' is a required"),
        ("undefined", lambda o: o.__setitem__("spiffe_id", "x"), "'spiffe_id' was unexpected"),
        ("undefined nested", lambda o: o["actor"]["user"].__setitem__("kind", 1), "'kind'"),
        ("undeclared profile", drop_profile, "'policy'"),
        ("unknown profile", lambda o: o["metadata"]["profiles"].append("incident"), "incident"),
        ("bad enum", lambda o: o.__setitem__("action_id", 7), "action_id: 7 is not one of"),
        ("bad nested enum", lambda o: o["actor"]["user"].__setitem__("type_id", 9), "type_id"),
        ("bad method", lambda o: o["http_request"].__setitem__("http_method", "BREW"), "BREW"),
        ("caption", lambda o: o.__setitem__("activity_name", "Get"), "not the caption"),
        ("status caption", lambda o: o.__setitem__("status", "Failure"), "not the caption"),
        ("type_uid", lambda o: o.__setitem__("type_uid", 400203), "class_uid * 100"),
        ("category", lambda o: o.__setitem__("category_uid", 6), "category_uid"),
        ("class", lambda o: o.__setitem__("class_uid", 4003), "class_uid"),
        ("wrong type", lambda o: o.__setitem__("time", "2026-12-02"), "time: '2026-12-02'"),
        ("wrong nested type", lambda o: o["dst_endpoint"].__setitem__("port", "443"), "port"),
        ("wrong array", lambda o: o.__setitem__("observables", {}), "observables"),
        ("constraint", lambda o: o["actor"].__setitem__("user", {"type_id": 1}), "actor.user"),
        ("version", lambda o: o["metadata"].__setitem__("version", "1.1.0"), "metadata.version"),
    ]


@pytest.mark.parametrize(("label", "plant", "expect"), _planted())
def test_planted_violations_are_caught(
    label: str, plant: Callable[[dict[str, Any]], None], expect: str
) -> None:
    good = to_ocsf(CASES[0][0], "o")
    assert validate(good).errors == []
    bad = copy.deepcopy(good)
    plant(bad)
    errors = validate(bad).errors
    assert any(expect in e for e in errors), (label, errors)


def test_recommended_attributes_are_filled() -> None:
    # What the official validator warns about, limited to what Proctor cannot know.
    unknowable = {
        "confidence_id", "device", "http_cookies", "http_response", "http_status", "proxy",
        "status_code", "status_detail", "connection_info", "traffic", "query_info",
        "is_src_dst_assignment_known", "url", "databucket", "database", "table", "dst_endpoint",
        "http_request", "metadata.data_classification", "metadata.data_classifications",
        "metadata.reporter",
    }  # fmt: skip
    for event, _, _ in CASES:
        warned = {w.split(":")[0] for w in validate(to_ocsf(event, "o")).warnings}
        assert warned <= unknowable, (event["action"], warned - unknowable)
