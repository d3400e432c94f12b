"""Control-plane actions through the real API (uvicorn on loopback), as OCSF (issue 31, item 8).

Every request the API decides is an ``api.request`` event naming the role policy
that decided it and the client's address; a submission's own event cites no
policy, an approval's cites the role policy's permit and its version. The lines:
valid against the vendored schema, the API's record with the client as
``src_endpoint.ip`` and its role policy, a submission's line naming no policy (not
the default deny), an approval's naming its permit, refusals by the role policy's
default deny or its forbid.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from proctor.client import Client
from proctor.errors import ControlDenied
from proctor.evidence._ocsf import ocsf_line
from tests.integration.test_api_support import ApiEnv, artifact_dir, build_env
from tests.integration.test_ocsf_valid import _errors, _untruths


@pytest.fixture(scope="module")
def api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ApiEnv]:
    env = build_env(tmp_path_factory.mktemp("ocsf-api"))
    yield env
    env.server.stop()
    env.rt.close()


def test_control_plane_actions_say_who_decided_and_where_from(api: ApiEnv, tmp_path: Path) -> None:
    dev = Client(api.url, api.token("acme", "dev"))
    alice = Client(api.url, api.token("acme", "alice"))
    digest = dev.submit_artifact("acme", artifact_dir(tmp_path))["digest"]
    with pytest.raises(ControlDenied):
        dev.approve("acme", digest)  # the author: forbidden by separation of duties
    with pytest.raises(ControlDenied):
        dev.events("acme")  # a developer has no audit.read: no role permits it
    alice.approve("acme", digest, comment="read it", expires_seconds=3600)
    events: list[dict[str, Any]] = [json.loads(e) for e in api.rt.ledger.entries("acme")]
    origin = api.rt.ledger.origin("acme")
    lines = [ocsf_line(ev, origin) for ev in events]
    assert _errors(lines) == {}
    assert _untruths(events, lines) == []
    pairs = [(e, json.loads(line)) for e, line in zip(events, lines, strict=True)]

    asked = [(e, o) for e, o in pairs if e["action"] == "api.request"]
    allowed = [(e, o) for e, o in asked if e["decision"] == "allow"]
    assert allowed and all(o["src_endpoint"] == {"ip": "127.0.0.1"} for _, o in asked)
    for e, o in allowed:
        assert o["policy"]["uid"] == e["policies"][0] and e["policies"][0].startswith("control:")
    assert {o["api"]["operation"] for _, o in allowed} >= {"artifact.submit", "approval.grant"}
    refused = [o for e, o in asked if e["decision"] == "deny"]
    assert [(o["api"]["operation"], o["policy"]["uid"]) for o in refused] == [
        ("approval.grant", "control:separation-of-duties"),
        ("audit.read", "default-deny"),
    ]

    # A submission's own event cites no policy, and its line names none; an approval's
    # records the role policy's permit and its text's version, and its line names both.
    own = [(e, o) for e, o in pairs if e["action"] in ("artifact.submit", "approval.grant")]
    granted = [(e, o) for e, o in own if e["decision"] == "allow"]
    assert [e["action"] for e, _ in granted] == ["artifact.submit", "approval.grant"]
    (_, submitted), (approval, approved) = granted
    assert "policy" not in submitted and submitted["action"] == "Allowed"
    assert approved["action"] == "Allowed" and approval["policies"][0].startswith("control:")
    assert approved["policy"]["uid"] == approval["policies"][0]
    assert approved["policy"]["version"] == approval["details"]["policy_version"]
    assert all(o["src_endpoint"]["type"] == "Unknown" for _, o in granted)
