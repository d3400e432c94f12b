"""Request rules are approved capabilities: approvals given to an artifact with rules
do not carry to the same code with the rules loosened, and the store cannot loosen
them under an approval (the signed log holds the digest that was approved)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from proctor.governance._manifest import Manifest, capabilities_hash
from tests.e2e.conftest_gov import Gov, build_gov

MAIN = "print('hi')\n"
RULES = """
[egress]
hosts = ["api.example.com"]
[egress.rules."api.example.com"]
methods = ["GET"]
paths = ["/v1/customers/*"]
"""


@pytest.fixture
def gov(tmp_path: Path) -> Iterator[Gov]:
    g = build_gov(tmp_path)
    yield g
    g.rt.close()


def test_loosened_rules_are_not_approved(gov: Gov, tmp_path: Path) -> None:
    rt = gov.rt
    read_only = rt.artifacts.get("acme", gov.submit("acme", gov.artifact_dir("crm", MAIN, RULES)))
    for who in ("alice", "bob"):
        rt.approvals.grant("acme", read_only.digest, gov.principal(who))
    assert len(rt.approvals.valid("acme", read_only)) == 2
    looser = RULES.replace('["GET"]', '["GET", "DELETE"]')
    # The same code and name with DELETE allowed: a new digest, nothing approves it.
    other = rt.artifacts.get("acme", gov.submit("acme", gov.artifact_dir("crm2", MAIN, looser)))
    assert other.capabilities_hash != read_only.capabilities_hash
    assert rt.approvals.valid("acme", other) == []

    # The store rewritten under the approval (rules dropped, its hash made to match):
    # the log's submission holds the approved digest, so the approvals no longer count.
    stored = json.loads(_manifest_row(gov, read_only.digest))
    stored["capabilities"].pop("egress_rules")
    tampered = Manifest.from_json(stored)
    with rt.store.write() as conn:
        conn.execute(
            "UPDATE artifacts SET manifest = ?, capabilities_hash = ? WHERE digest = ?",
            (json.dumps(tampered.to_json()), capabilities_hash(tampered.capabilities),
             read_only.digest),
        )  # fmt: skip
    assert rt.approvals.valid("acme", rt.artifacts.get("acme", read_only.digest)) == []


def _manifest_row(gov: Gov, digest: str) -> str:
    with gov.rt.store.read() as conn:
        row = conn.query_one("SELECT manifest FROM artifacts WHERE digest = ?", (digest,))
    assert row is not None
    return str(row[0])
