"""Roles x actions x own/other tenant: each request allowed or refused exactly as the
control-plane role policy says, and each recorded in the caller's tenant log.

The expectation below is written out by hand from the policy's intent (docs/policy.md),
not computed from it, so that a change to the policy shows up here."""

from __future__ import annotations

import io
import itertools
import sqlite3
import tarfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from proctor.governance import Runs
from proctor.ledger import utc_now
from tests.integration.test_api_support import ApiEnv, artifact_dir, build_env

ALLOWED = {
    "developer": {"tenant.read", "artifact.read", "artifact.submit", "deployment.read",
                  "deployment.create", "run.read", "bucket.read", "run.events.read@own",
                  "approval.request", "dataset.describe"},
    "approver": {"tenant.read", "artifact.read", "deployment.read", "run.read",
                 "approval.grant", "approval.reject"},
    "auditor": {"tenant.read", "artifact.read", "deployment.read", "run.read", "audit.read",
                "policy.read", "run.events.read", "run.events.read@own", "dataset.describe"},
    # An AI agent (issue 35): no bucket's objects, no other's run events, no approving,
    # no production (deployment.create@production), no administering.
    "agent": {"tenant.read", "artifact.read", "artifact.submit", "deployment.read",
              "deployment.create", "run.read", "approval.request", "dataset.describe"},
}  # fmt: skip
WHO = {"developer": "dev", "approver": "alice", "auditor": "aud", "admin": "root",
       "agent": "coder"}  # fmt: skip


@dataclass
class Fx:
    digest: str
    tar: bytes
    counter: Iterator[int]


Call = Callable[[httpx.Client, str, Fx], httpx.Response]


def _tar(directory: Path) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for p in sorted(directory.iterdir()):
            tar.add(p, arcname=p.name)
    return buf.getvalue()


ACTIONS: dict[str, Call] = {
    "tenant.read": lambda h, t, f: h.get(f"/tenants/{t}"),
    "artifact.read": lambda h, t, f: h.get(f"/tenants/{t}/artifacts"),
    "artifact.submit": lambda h, t, f: h.post(
        f"/tenants/{t}/artifacts", content=f.tar, headers={"Content-Type": "application/x-tar"}
    ),
    "deployment.read": lambda h, t, f: h.get(f"/tenants/{t}/deployments"),
    "deployment.create": lambda h, t, f: h.post(
        f"/tenants/{t}/deployments",
        json={"digest": f.digest, "name": "matrix", "instruction": "matrix test"},
    ),
    "run.read": lambda h, t, f: h.get(f"/tenants/{t}/runs"),
    "audit.read": lambda h, t, f: h.get(f"/tenants/{t}/events", params={"limit": 1}),
    # A run whose deployment no role created: a developer reads only their own runs'
    # events (tests/e2e/test_developer_view.py has the developer's own run).
    "run.events.read": lambda h, t, f: h.get(
        f"/tenants/{t}/events", params={"run": f"r-matrix-{t}", "limit": 1}
    ),
    # A run of a deployment the developer created: theirs to read, not an approver's.
    # (An action written `x@case` is Cedar's action x on another resource.)
    "run.events.read@own": lambda h, t, f: h.get(
        f"/tenants/{t}/events", params={"run": f"r-own-{t}", "limit": 1}
    ),
    # Production needs approvals first: an allowed one answers 409 (not approved).
    "deployment.create@production": lambda h, t, f: h.post(
        f"/tenants/{t}/deployments",
        json={
            "digest": f.digest,
            "name": "matrix-prod",
            "instruction": "matrix test",
            "environment": "production",
        },
    ),
    "approval.request": lambda h, t, f: h.post(
        f"/tenants/{t}/artifacts/{f.digest}/approval-requests", json={"comment": "matrix"}
    ),
    "dataset.describe": lambda h, t, f: h.get(f"/tenants/{t}/datasets/crm/schema"),
    "policy.read": lambda h, t, f: h.get(f"/tenants/{t}/policy"),
    "policy.set": lambda h, t, f: h.put(f"/tenants/{t}/quorum", json={"required": 1}),
    "approval.grant": lambda h, t, f: h.post(
        f"/tenants/{t}/artifacts/{f.digest}/approvals", json={"comment": "matrix"}
    ),
    "approval.reject": lambda h, t, f: h.post(
        f"/tenants/{t}/artifacts/{f.digest}/rejections", json={"comment": "matrix"}
    ),
    "principal.create": lambda h, t, f: h.post(
        f"/tenants/{t}/principals", json={"name": f"p{next(f.counter)}", "roles": ["auditor"]}
    ),
    "token.issue": lambda h, t, f: h.post(f"/tenants/{t}/principals/spare/token"),
    "secret.register": lambda h, t, f: h.put(
        f"/tenants/{t}/secrets/matrix_key", json={"value": "s3cret", "hosts": ["example.com"]}
    ),
    "tenant.freeze": lambda h, t, f: h.post(f"/tenants/{t}/freeze", json={}),
    "tenant.unfreeze": lambda h, t, f: h.post(f"/tenants/{t}/unfreeze", json={}),
    "bucket.read": lambda h, t, f: h.get(f"/tenants/{t}/buckets/reports/objects"),
    "bucket.write": lambda h, t, f: h.put(
        f"/tenants/{t}/buckets/reports/objects/in/m{next(f.counter)}.txt", content=b"matrix"
    ),
}


@pytest.fixture(scope="module")
def matrix_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ApiEnv, Fx]]:
    tmp = tmp_path_factory.mktemp("matrix")
    env = build_env(tmp)
    directory = artifact_dir(tmp)
    digest = ""
    for t in ("acme", "globex"):
        # Submitted by the operator, so that no role is its author (no SoD forbid).
        digest = env.rt.artifacts.submit(t, directory, env.rt.operator).digest
        env.rt.principals.create(t, "spare", "user", ["auditor"], env.rt.operator)
        _, env.tokens[(t, "coder")] = env.rt.principals.create(
            t, "coder", "agent", [], env.rt.operator, responsible=f"{t}/dev"
        )
        db = tmp / f"crm-{t}.db"
        with sqlite3.connect(db) as conn:
            conn.execute("CREATE TABLE customers (id INTEGER, email TEXT)")
        env.rt.resources.add_dataset(t, "crm", db, env.rt.operator)
        env.rt.resources.add_bucket(t, "reports", env.rt.operator)
        dev = env.rt.principals.get(t, "dev")
        env.rt.deployments.deploy(t, env.rt.artifacts.get(t, digest), "own",
                                  environment="sandbox", instruction="the developer's own",
                                  actor=dev.actor)  # fmt: skip
        with env.rt.store.write() as conn:
            Runs.insert(conn, _run_row(t, f"r-matrix-{t}"), "matrix")
            Runs.insert(conn, _run_row(t, f"r-own-{t}", "own"), "matrix")
    yield env, Fx(digest, _tar(directory), itertools.count())
    env.server.stop()
    env.rt.close()


def _run_row(tenant: str, run_id: str, deployment: str = "ops") -> tuple[Any, ...]:
    """A finished run's values in RunRecord's field order (version 1 of ``deployment``)."""
    return (run_id, tenant, deployment, 1, "sha256:" + "0" * 64, "sandbox",
            f"spiffe://proctor.local/tenant/{tenant}/deployment/{deployment}/run/{run_id}", "[]",
            "bubblewrap", None, "succeeded", None, 0, 1, "{}", None, utc_now(), utc_now())  # fmt: skip


def _allowed(role: str, action: str) -> bool:
    if action == "deployment.create@production":
        return role in ("admin", "developer")  # an agent deploys to the sandbox only
    return role == "admin" or action in ALLOWED[role]


@pytest.mark.parametrize("role", list(WHO))
def test_role_matrix(role: str, matrix_env: tuple[ApiEnv, Fx]) -> None:
    env, fx = matrix_env
    expected: dict[str, tuple[str, str]] = {}
    with env.http("acme", WHO[role]) as http:
        for action, call in ACTIONS.items():
            for target in ("acme", "globex"):
                rid = f"m-{role}-{action.replace('@', '.')}-{target}"
                resp = _call(http, call, target, fx, rid)
                cedar = action.partition("@")[0]
                own = target == "acme"
                if not own:
                    assert resp.status_code == 404, (role, action, target, resp.text)
                    assert resp.json()["error"]["code"] == "not_found"
                    expected[rid] = ("deny", cedar)
                elif _allowed(role, action):
                    # Production without a quorum: allowed by the role policy, refused
                    # by the approvals (409) after it.
                    ok = (409,) if action == "deployment.create@production" else (200, 201)
                    assert resp.status_code in ok, (role, action, resp.text)
                    expected[rid] = ("allow", cedar)
                else:
                    assert resp.status_code == 403, (role, action, resp.text)
                    assert resp.json()["error"]["code"] == "forbidden"
                    expected[rid] = ("deny", cedar)
    # Each request is in the caller's own tenant log, with its decision.
    recorded = {
        e["details"]["request_id"]: (e["decision"], e["details"]["action"])  # type: ignore[index]
        for e in env.events("acme")
        if e["action"] == "api.request"
    }
    for rid, want in expected.items():
        assert recorded.get(rid) == want, rid
    # And nothing of them in the other tenant's log.
    assert not any(
        str(e["details"].get("request_id", "")).startswith(f"m-{role}-")  # type: ignore[union-attr]
        for e in env.events("globex")
    )


def _call(http: httpx.Client, call: Call, target: str, fx: Fx, rid: str) -> httpx.Response:
    http.headers["X-Request-Id"] = rid
    return call(http, target, fx)


def test_other_tenant_is_indistinguishable_from_none(tmp_path: Path) -> None:
    """A principal of acme learns nothing about globex: its resources answer exactly as
    those of a tenant that does not exist."""
    env = build_env(tmp_path)
    try:
        with env.http("acme", "root") as http:
            for path in ("", "/artifacts", "/events", "/log/checkpoint", "/log/tile/0/000",
                         "/principals/dev", "/runs/r-1"):  # fmt: skip
                a = http.get(f"/tenants/globex{path}")
                b = http.get(f"/tenants/initech{path}")
                assert a.status_code == b.status_code == 404
                ea, eb = a.json()["error"], b.json()["error"]
                assert ea["message"].replace("globex", "X") == eb["message"].replace("initech", "X")
    finally:
        env.server.stop()
        env.rt.close()
