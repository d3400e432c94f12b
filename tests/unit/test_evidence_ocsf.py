"""OCSF output holds the required attributes of its classes (vendored schema subset)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from proctor.evidence import to_ocsf

SCHEMA = json.loads((Path(__file__).parents[1] / "data" / "ocsf" / "classes.json").read_text())


def base(action: str, decision: str = "allow", **details: Any) -> dict[str, Any]:
    return {
        "v": 1,
        "seq": 7,
        "time": "2026-12-02T12:38:20.566531Z",
        "tenant": "acme",
        "actor": {"type": "workload", "id": "spiffe://p/tenant/acme/deployment/d/run/r"},
        "action": action,
        "resource": "host/api.example.com:443",
        "decision": decision,
        "policies": ["deploy:d:egress:api.example.com:443"] if decision == "allow" else [],
        "reason": "r",
        "deployment": "d",
        "run": "r",
        "artifact": "sha256:00",
        "approvals": ["apr_1"],
        "details": details,
    }


CASES = [
    (base("http.request", host="api.example.com", port=443, method="POST", path="/x"), 4002),
    (base("http.request", "deny", host="x.example", port=80, method="GET"), 4002),
    (base("http.request.end", host="api.example.com", port=443, bytes_up=1), 4001),
    (base("sql.select", dataset="crm", tables=[{"table": "customers", "columns": ["id"]}]), 6005),
    (base("sql.write", "deny", dataset="crm", tables=[]), 6005),
    (base("file.write", bucket="reports", key="k"), 6003),
    (base("approval.grant"), 6003),
    (base("run.start"), 6003),
]


def check(obj: dict[str, Any], name: str) -> None:
    for attr in SCHEMA["objects"][name]["required"]:
        assert attr in obj, f"{name}.{attr} missing"


@pytest.mark.parametrize(("event", "class_uid"), CASES)
def test_required_attributes(event: dict[str, Any], class_uid: int) -> None:
    out = to_ocsf(event, "proctor.test/tenant/acme")
    cls = SCHEMA["classes"][str(class_uid)]
    assert out["class_uid"] == class_uid and out["category_uid"] == cls["category_uid"]
    for attr in SCHEMA["base_event"]["required"] + cls["required"]:
        assert attr in out, f"{attr} missing from class {class_uid}"
    for attr, kind in SCHEMA["base_event"]["types"].items():
        if attr in out:
            assert isinstance(out[attr], int if kind == "integer" else str), attr
    assert out["activity_id"] in cls["activity_ids"]
    assert out["type_uid"] == class_uid * 100 + out["activity_id"]
    assert out["action_id"] == (1 if event["decision"] == "allow" else 2)
    assert out["severity_id"] in SCHEMA["enums"]["severity_id"]
    assert out["status_id"] in SCHEMA["enums"]["status_id"]
    check(out["metadata"], "metadata")
    check(out["metadata"]["product"], "product")
    if "api" in out:
        check(out["api"], "api")
    assert out["policy"]["uid"] == (event["policies"][0] if event["policies"] else "default-deny")
    assert out["time"] == 1796215100566
    assert out["unmapped"]["seq"] == 7
    json.dumps(out)
