"""The store cannot vouch for what the record does not (issue 13, item 5).

The attacker can write the store file but holds no signing key. Each test
tampers with the real SQLite store of a real home the way such an attacker
would, then: the run is refused before any sandbox starts, with a recorded
``run.start`` deny; and ``proctor audit verify`` exits non-zero naming the row.
"""

from __future__ import annotations

import contextlib
import json
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from proctor.governance import ApprovalRequired, ControlDenied, capabilities_hash, unbacked_rows
from proctor.lifecycle import RunRefused, Supervisor
from tests.conftest import run_cli
from tests.e2e.conftest_gov import Gov, build_gov
from tests.sandbox_conftest_helpers import any_backend, working

WORKING = working()
BACKEND = WORKING[0] if WORKING else None
CAPS = """
[datasets.crm.tables.customers]
columns = ["id", "country"]
access = "read"
"""
GOOD = "print('approved code')\n"
EVIL = "print('other code')\n"


@pytest.fixture
def gov(tmp_path: Path) -> Iterator[Gov]:
    g = build_gov(tmp_path)
    yield g
    g.rt.close()


def _approved(gov: Gov, name: str = "job", main: str = GOOD) -> str:
    """An artifact by dev, approved by alice, deployed to production as ``name``."""
    rt = gov.rt
    digest = gov.submit("acme", gov.artifact_dir(name, main, CAPS))
    rt.approvals.grant("acme", digest, gov.principal("alice"))
    rt.deployments.deploy("acme", rt.artifacts.get("acme", digest), name,
                          environment="production", instruction="nightly (RET-1)",
                          actor=gov.op)  # fmt: skip
    return digest


def _sql(gov: Gov, statement: str, params: tuple[Any, ...] = ()) -> None:
    """The attacker: the store file opened directly, no Proctor code involved."""
    db = sqlite3.connect(gov.home / "proctor.db")
    db.execute(statement, params)
    db.commit()
    db.close()


def _start(gov: Gov, name: str = "job") -> Any:
    out: list[bytes] = []
    with gov.rt.make_broker() as broker:
        rec = Supervisor(gov.rt, broker, BACKEND).start(
            "acme", name, gov.principal("dev").actor, on_stdout=out.append
        )
    return rec, b"".join(out).decode()


def _refused(gov: Gov, match: str, name: str = "job") -> dict[str, Any]:
    with pytest.raises(RunRefused, match=match):
        _start(gov, name)
    last = json.loads(list(gov.rt.ledger.entries("acme"))[-1])
    assert (last["action"], last["decision"]) == ("run.start", "deny"), last
    with gov.rt.store.read() as conn:
        assert conn.query_one("SELECT count(*) FROM runs")[0] == 0  # type: ignore[index]
    return last


def _audit(gov: Gov) -> Any:
    return run_cli("audit", "verify", "-t", "acme", home=gov.home, check=False)


@pytest.mark.host
def test_an_untouched_store_runs_and_verifies(gov: Gov) -> None:
    any_backend()
    _approved(gov)
    rec, out = _start(gov)
    assert rec.status == "succeeded" and "approved code" in out
    res = _audit(gov)
    assert res.code == 0, res.out + res.err
    assert "backed" in res.out


def test_a_swapped_blob_and_row_never_runs_under_the_approved_digest(gov: Gov) -> None:
    digest = _approved(gov)
    # Other code, stored by a harmless submission: its blob is now in the blob store.
    other = gov.submit("acme", gov.artifact_dir("other", EVIL, CAPS))
    evil = next(f for f in gov.rt.artifacts.files("acme", other) if f.path == "main.py")
    _sql(gov, "UPDATE artifact_files SET sha256 = ?, size = ? WHERE digest = ? AND"
         " path = 'main.py'", (evil.sha256, evil.size, digest))  # fmt: skip
    last = _refused(gov, "digest")
    assert last["artifact"] == digest and digest[:19] in last["reason"]
    # materialize itself refuses it too.
    with pytest.raises(Exception, match="digest"):
        gov.rt.artifacts.materialize("acme", digest, gov.home.parent / "code")
    res = _audit(gov)
    assert res.code == 3, res.out + res.err
    assert digest in res.out + res.err


def test_a_widened_stored_manifest_is_refused_and_named(gov: Gov) -> None:
    digest = _approved(gov)
    with gov.rt.store.read() as conn:
        row = conn.query_one("SELECT manifest FROM artifacts WHERE digest = ?", (digest,))
    manifest = json.loads(str(row[0]))  # type: ignore[index]
    manifest["capabilities"]["datasets"]["crm"]["tables"]["customers"]["columns"].append("email")
    caps = capabilities_hash(manifest["capabilities"])
    # Everything the store holds is made consistent with the widened manifest.
    _sql(gov, "UPDATE artifacts SET manifest = ?, capabilities_hash = ? WHERE digest = ?",
         (json.dumps(manifest), caps, digest))  # fmt: skip
    _sql(gov, "UPDATE approvals SET capabilities_hash = ? WHERE digest = ?", (caps, digest))
    last = _refused(gov, "digest")
    assert last["artifact"] == digest
    res = _audit(gov)
    assert res.code == 3 and digest in res.out + res.err


def test_a_forged_approval_row_does_not_count_and_is_named(gov: Gov) -> None:
    rt = gov.rt
    digest = gov.submit("acme", gov.artifact_dir("job", GOOD, CAPS))
    art = rt.artifacts.get("acme", digest)
    _sql(gov, "INSERT INTO approvals (id, tenant, digest, capabilities_hash, purpose, principal,"
         " roles, decision, comment, created_at, expires_at, revoked_at, revoked_by, seq)"
         " VALUES ('apr_forged', 'acme', ?, ?, ?, 'acme/alice', 'approver', 'approve', '',"
         " '2024-01-01T00:00:00.000000Z', '2100-01-01T00:00:00.000000Z', NULL, NULL, 3)",
         (digest, art.capabilities_hash, art.purpose))  # fmt: skip
    with pytest.raises(ApprovalRequired, match="0 valid approval"):
        rt.deployments.deploy("acme", art, "job", environment="production",
                              instruction="x", actor=gov.op)  # fmt: skip
    res = _audit(gov)
    assert res.code == 3 and "apr_forged" in res.out + res.err


def test_a_forged_row_behind_an_existing_deployment_does_not_run(gov: Gov) -> None:
    digest = _approved(gov)
    # The real approval is revoked (recorded), then the row is made to look standing
    # again and a forged one is added: neither counts, the ledger says why.
    real = gov.rt.approvals.for_artifact("acme", digest)[0]
    gov.rt.approvals.revoke("acme", real.id, gov.op)
    _sql(gov, "UPDATE approvals SET revoked_at = NULL, revoked_by = NULL WHERE id = ?", (real.id,))
    _refused(gov, "approval")
    res = _audit(gov)
    assert res.code == 3 and real.id in res.out + res.err


def test_a_deleted_rejection_still_blocks(gov: Gov) -> None:
    digest = _approved(gov)
    gov.rt.approvals.reject("acme", digest, gov.principal("bob"), "leaks emails")
    _sql(gov, "DELETE FROM approvals WHERE decision = 'reject'")
    _refused(gov, "rejected")
    res = _audit(gov)
    assert res.code == 3 and "reject" in res.out + res.err


def test_a_deployment_row_without_its_event_is_named(gov: Gov) -> None:
    digest = _approved(gov)
    _sql(gov, "INSERT INTO deployments (tenant, name, version, digest, environment, mode,"
         " every_seconds, instruction, reference, approvals, created_by, created_at, status, seq)"
         " VALUES ('acme', 'ghost', 1, ?, 'production', 'job', NULL, 'x', '', '[]',"
         " 'acme/dev', '2024-01-01T00:00:00.000000Z', 'active', 0)", (digest,))  # fmt: skip
    _refused(gov, "deployment", name="ghost")
    res = _audit(gov)
    assert res.code == 3 and "ghost" in res.out + res.err


def test_the_author_row_cannot_be_changed_to_make_a_self_approval_count(gov: Gov) -> None:
    # carol writes and approves; the store then names someone else as the author.
    carol, _ = gov.rt.principals.create("acme", "carol", "user", ["developer", "approver"], gov.op)
    digest = gov.rt.artifacts.submit(
        "acme", gov.artifact_dir("job", GOOD, CAPS), carol.actor
    ).digest
    _sql(gov, "UPDATE artifacts SET author = 'acme/dev' WHERE digest = ?", (digest,))
    with contextlib.suppress(ControlDenied):  # refused up front, or not counted
        gov.rt.approvals.grant("acme", digest, carol)
    with pytest.raises(ApprovalRequired):
        gov.rt.deployments.deploy("acme", gov.rt.artifacts.get("acme", digest), "job",
                                  environment="production", instruction="x",
                                  actor=gov.op)  # fmt: skip
    res = _audit(gov)
    assert res.code == 3 and digest in res.out + res.err


def test_a_schedule_given_in_whole_seconds_is_backed_by_its_record(gov: Gov) -> None:
    """``every_seconds=3600`` (an int, as a Python caller writes it) once signed "3600"
    while the row read back 3600.0: every run of the deployment was then refused."""
    rt = gov.rt
    caps = CAPS + '[lifecycle]\nmode = "schedule"\nevery = "1h"\n'
    digest = gov.submit("acme", gov.artifact_dir("hourly", GOOD, caps))
    rt.approvals.grant("acme", digest, gov.principal("alice"))
    rt.deployments.deploy("acme", rt.artifacts.get("acme", digest), "hourly",
                          environment="production", mode="schedule", every_seconds=3600,
                          instruction="hourly (RET-1)", actor=gov.op)  # fmt: skip
    problems, counts = unbacked_rows(
        rt.store, rt.ledger, rt.artifacts, rt.approvals, rt.deployments, "acme"
    )
    assert counts["deployments"] == 1
    assert problems == []
