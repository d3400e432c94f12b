"""An OCSF line says only what its event records (issue 31, item 8).

Each test builds the event a component records (the details as the broker, the
control plane and the supervisor write them) and checks the OCSF field a SIEM
reads: what decided (``policy``, ``authorizations``), where the action came from
(``src_endpoint``), where it went (``hostname`` against ``ip``) and how it ended
(``status``, ``http_response``). Every line is also held to the vendored schema.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from proctor.evidence import to_ocsf
from tests.ocsf_validate import validate
from tests.unit.test_evidence_ocsf import USER, base

VERSION = "sha256:" + "ab" * 32
ROLE_VERSION = "sha256:" + "cd" * 32
OPERATOR = ("operator", "local-operator:root@build-7.example")


def ocsf(event: dict[str, Any]) -> dict[str, Any]:
    out = to_ocsf(event, "proctor.test/tenant/acme")
    assert validate(out).errors == [], event["action"]
    assert "not recorded" not in json.dumps(out)
    return out


def control(action: str, actor: tuple[str, str] = USER, **details: Any) -> dict[str, Any]:
    event = base(action, actor=actor, resource=f"tenant/acme/{action}", **details)
    event.update(run=None, deployment=None, artifact=None, approvals=[], reason="created")
    return event


# -- what decided ---------------------------------------------------------------


@pytest.mark.parametrize("action", ["tenant.create", "run.start", "approval.grant", "run.end"])
def test_an_allowed_event_citing_no_policy_names_no_default_deny(action: str) -> None:
    # The control plane's events record no policy: before, each line said
    # "default-deny", "no policy permits it" beside "Allowed".
    event = control(action, policy_version=VERSION)
    event["policies"] = []
    out = ocsf(event)
    assert out["action"] == "Allowed"
    text = json.dumps(out)
    assert "default-deny" not in text and "no policy permits it" not in text
    assert "policy" not in out and "authorizations" not in out


def test_cedars_default_deny_is_named_with_the_set_that_permitted_nothing() -> None:
    event = base("sql.select", "deny", resource="dataset/crm/table/customers",
                 dataset="crm", policy_version=VERSION)  # fmt: skip
    event["reason"] = "denied: sql.select on customers (email, id): no policy permits it"
    out = ocsf(event)
    assert out["policy"] == {
        "uid": "default-deny",
        "name": "default-deny",
        "is_applied": True,
        "version": VERSION,
        "desc": "no policy permits it",
    }
    assert out["authorizations"] == [{"decision": "deny", "policy": out["policy"]}]


def test_a_control_plane_default_deny_cites_the_role_policys_version() -> None:
    event = control("policy.set", policy_version=ROLE_VERSION)
    event.update(decision="deny", policies=[], reason="no role of acme/alice permits it")
    out = ocsf(event)
    assert (out["policy"]["uid"], out["policy"]["version"]) == ("default-deny", ROLE_VERSION)


@pytest.mark.parametrize(
    "reason",
    [
        "refused: the request is malformed",  # the broker's own refusal, before any policy
        "tenant acme is frozen",  # the supervisor's refusal of a run
    ],
)
def test_a_denial_not_decided_by_cedar_names_no_policy(reason: str) -> None:
    event = base("broker.request", "deny", resource="run/r", policy_version=VERSION)
    event["reason"] = reason
    out = ocsf(event)
    assert out["action"] == "Denied" and out["message"] == reason
    assert "policy" not in out and "authorizations" not in out


def test_a_rule_of_proctors_own_carries_no_cedar_version() -> None:
    event = base("http.request", "deny", host="10.0.0.1", port=80, method="GET",
                 address="10.0.0.1", policy_version=VERSION)  # fmt: skip
    event["policies"] = ["proctor:egress:special-purpose-address"]
    out = ocsf(event)
    assert out["policy"]["uid"] == "proctor:egress:special-purpose-address"
    assert "version" not in out["policy"]


def test_cited_policies_are_named_with_their_sets_version() -> None:
    event = base("file.write", resource="bucket/reports/k", bucket="reports", key="k",
                 policy_version=VERSION)  # fmt: skip
    event["policies"] = ["deploy:d:file:reports", "tenant:extra"]
    out = ocsf(event)
    assert [(a["decision"], a["policy"]["uid"], a["policy"]["version"])
            for a in out["authorizations"]] == [
        ("allow", "deploy:d:file:reports", VERSION), ("allow", "tenant:extra", VERSION),
    ]  # fmt: skip


def test_a_role_policy_on_run_start_takes_its_own_version_not_the_runs_set() -> None:
    # run.start's policy_version is the run's effective set; a role policy cited
    # there is versioned only by control_policy_version.
    event = control("run.start", policy_version=VERSION)
    event["policies"] = ["control:developer"]
    assert "version" not in ocsf(event)["policy"]
    event["details"]["control_policy_version"] = ROLE_VERSION
    out = ocsf(event)
    assert out["policy"]["version"] == ROLE_VERSION
    assert ROLE_VERSION not in json.dumps(out.get("unmapped", {}))


def test_a_control_plane_refusal_keeps_the_role_policys_version() -> None:
    event = control("approval.grant", policy_version=ROLE_VERSION)
    event.update(decision="deny", policies=["control:separation-of-duties"],
                 reason="forbidden by control:separation-of-duties")  # fmt: skip
    assert ocsf(event)["policy"]["version"] == ROLE_VERSION


# -- hostnames and addresses ----------------------------------------------------


@pytest.mark.parametrize(
    ("host", "address", "url"),
    [
        ("127.0.0.1", "127.0.0.1", "http://127.0.0.1:8080/x"),
        ("169.254.169.254", None, "http://169.254.169.254:8080/x"),
        ("2001:db8::1", "2001:db8::1", "http://[2001:db8::1]:8080/x"),
    ],
)
def test_an_ip_literal_is_an_ip_never_a_hostname(host: str, address: str | None, url: str) -> None:
    details: dict[str, Any] = {"host": host, "port": 8080, "method": "GET", "scheme": "http"}
    details.update(path="/x", **({"address": address} if address else {}))
    out = ocsf(base("http.request", **details))
    assert out["dst_endpoint"] == {"port": 8080, "ip": host}
    assert out["http_request"]["url"]["url_string"] == url
    assert "hostname" not in out["http_request"]["url"]
    seen = {o["name"]: (o["type_id"], o["value"]) for o in out["observables"]}
    assert seen["dst_endpoint.ip"] == (2, host)
    assert "dst_endpoint.hostname" not in seen


def test_a_name_is_a_hostname_and_its_address_an_ip() -> None:
    out = ocsf(base("http.request", host="api.example.com", port=443, method="GET",
                    scheme="https", address="93.184.215.14"))  # fmt: skip
    assert out["dst_endpoint"] == {"hostname": "api.example.com", "port": 443,
                                   "ip": "93.184.215.14"}  # fmt: skip
    assert out["http_request"]["url"]["hostname"] == "api.example.com"
    seen = {o["name"]: (o["type_id"], o["value"]) for o in out["observables"]}
    assert seen["dst_endpoint.hostname"] == (1, "api.example.com")
    assert seen["dst_endpoint.ip"] == (2, "93.184.215.14")


# -- where it came from ---------------------------------------------------------


def test_the_local_operator_acts_from_its_host() -> None:
    out = ocsf(control("tenant.create", actor=OPERATOR))
    assert out["src_endpoint"] == {"hostname": "build-7.example"}
    seen = {o["name"]: (o["type_id"], o["value"]) for o in out["observables"]}
    assert seen["src_endpoint.hostname"] == (1, "build-7.example")


def test_the_supervisor_acts_from_its_host() -> None:
    out = ocsf(control("run.start", actor=("runtime", "supervisor:node-3:4242:987654")))
    assert out["src_endpoint"] == {"hostname": "node-3", "svc_name": "proctor"}


def test_a_principal_whose_address_is_not_recorded_gets_no_made_up_one() -> None:
    out = ocsf(control("approval.grant"))
    src = out["src_endpoint"]
    assert src == {"name": "client of acme/alice", "type_id": 0, "type": "Unknown"}
    assert not any(o["name"].startswith("src_endpoint") for o in out["observables"])


def test_a_workload_calls_from_its_runs_sandbox() -> None:
    out = ocsf(base("broker.whoami", resource="run/r"))
    assert out["src_endpoint"] == {"uid": "r", "name": "sandbox of run r", "svc_name": "d"}


def test_http_activity_of_an_unknown_source_has_no_src_endpoint() -> None:
    # HTTP and Network Activity do not require one: none is better than a placeholder.
    event = base("http.request", "deny", actor=USER, method="GET", host="x.example", port=80)
    assert "src_endpoint" not in ocsf(event)


# -- how it ended ---------------------------------------------------------------


def completion(**details: Any) -> dict[str, Any]:
    return base("http.request.end", host="api.example.com", port=443, address="93.184.215.14",
                bytes_up=300, bytes_down=2000, duration_ms=12.5, decision_seq=6,
                policy_version=VERSION, **details)  # fmt: skip


def test_a_completion_with_the_upstreams_status_is_http_activity_with_its_response() -> None:
    out = ocsf(completion(status=503, requests=1))
    assert (out["class_uid"], out["activity_id"], out["activity_name"]) == (4002, 99, "Close")
    assert out["http_response"] == {"code": 503, "length": 2000}
    assert out["traffic"] == {"bytes_out": 300, "bytes_in": 2000, "bytes": 2300}
    assert out["status"] == "Success"  # the exchange happened; 503 is the upstream's answer
    assert "status" not in out["unmapped"]["details"]


def test_a_tunnel_of_several_requests_gives_the_last_status_and_no_length() -> None:
    out = ocsf(completion(status=200, requests=3))
    assert out["http_response"] == {"code": 200}
    assert out["unmapped"]["details"]["requests"] == 3


def test_a_completion_proctor_answered_itself_carries_that_answer() -> None:
    out = ocsf(completion(answered=502, error="the upstream did not answer within 5 s",
                          requests=0))  # fmt: skip
    assert out["http_response"] == {"code": 502}
    assert (out["status_id"], out["status_detail"]) == (2, "the upstream did not answer within 5 s")


def test_an_opaque_tunnels_end_stays_network_activity() -> None:
    out = ocsf(completion(requests=0))
    assert (out["class_uid"], out["activity_id"]) == (4001, 2)
    assert "http_response" not in out


def test_a_request_refused_inside_a_tunnel_carries_the_status_answered() -> None:
    out = ocsf(base("http.request", "deny", method="GET", status=400, host="api.example.com",
                    port=443))  # fmt: skip
    assert out["http_response"] == {"code": 400}


def test_a_refused_broker_request_carries_the_status_answered() -> None:
    event = base("broker.request", "deny", resource="run/r", status=404, error="not_found",
                 target_hmac="00")  # fmt: skip
    event["reason"] = "refused: no such broker endpoint"
    out = ocsf(event)
    assert (out["class_uid"], out["http_response"]) == (6003, {"code": 404})


@pytest.mark.parametrize(
    ("ended", "status_id", "status"),
    [("succeeded", 1, "Success"), ("failed", 2, "Failure"), ("interrupted", 2, "Failure"),
     ("stopped", 99, "Stopped")],
)  # fmt: skip
def test_a_runs_end_says_how_it_ended(ended: str, status_id: int, status: str) -> None:
    event = control("run.end", status=ended, exit_code=0)
    event["reason"] = "exit"
    out = ocsf(event)
    assert (out["action"], out["status_id"], out["status"]) == ("Allowed", status_id, status)
    if ended != "succeeded":
        assert out["status_detail"] == ended


def test_an_allowed_statement_that_failed_is_a_failure() -> None:
    event = base("sql.select", resource="dataset/crm", dataset="crm", outcome="timeout")
    out = ocsf(event)
    assert (out["action"], out["status"], out["status_detail"]) == ("Allowed", "Failure", "timeout")
    ok = ocsf(base("sql.select", resource="dataset/crm", dataset="crm", outcome="ok"))
    assert ok["status"] == "Success"


def test_an_address_that_is_not_one_is_kept_not_mapped_to_ip() -> None:
    out = ocsf(base("http.request", host="api.example.com", port=443, method="GET",
                    address="api.example.com"))  # fmt: skip
    assert "ip" not in out["dst_endpoint"]
    assert out["unmapped"]["details"]["address"] == "api.example.com"


def api_request(decision: str = "allow", source: str | None = "203.0.113.7") -> dict[str, Any]:
    """An ``api.request`` as the API records each request it decides (api/_context.py)."""
    event = control("api.request", request_id="req_0123456789abcdef", source=source,
                    method="POST", path="/tenants/acme/artifacts")  # fmt: skip
    event["details"]["action"] = "artifact.submit"
    event["resource"] = "tenant/acme"
    if decision == "allow":
        event.update(policies=["control:developer"], reason="artifact.submit allowed")
    else:
        event.update(decision="deny", policies=[],
                     reason="no role of acme/alice permits artifact.submit")  # fmt: skip
    return event


def test_the_apis_record_of_a_request_names_its_client_and_the_role_policy() -> None:
    out = ocsf(api_request())
    assert out["src_endpoint"] == {"ip": "203.0.113.7"}
    seen = {o["name"]: (o["type_id"], o["value"]) for o in out["observables"]}
    assert seen["src_endpoint.ip"] == (2, "203.0.113.7")
    assert out["api"] == {"operation": "artifact.submit", "service": {"name": "proctor"},
                          "request": {"uid": "req_0123456789abcdef"}}  # fmt: skip
    assert out["http_request"] == {"http_method": "POST",
                                   "url": {"path": "/tenants/acme/artifacts"}}  # fmt: skip
    # The role policy that permitted; the event records no version of it, so none.
    assert out["policy"] == {"uid": "control:developer", "name": "control:developer",
                             "is_applied": True}  # fmt: skip
    assert "unmapped" not in out


def test_the_apis_refusal_is_the_role_policys_default_deny() -> None:
    out = ocsf(api_request("deny"))
    assert out["policy"]["uid"] == "default-deny" and out["action"] == "Denied"


def test_an_api_request_without_a_client_address_says_it_is_unknown() -> None:
    out = ocsf(api_request(source=None))
    assert out["src_endpoint"] == {"name": "client of acme/alice", "type_id": 0, "type": "Unknown"}
