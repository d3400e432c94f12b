""" "What ran here at time T?", answered from the store and the ledger."""

from __future__ import annotations

import json
from datetime import datetime, timedelta
from typing import Any

from proctor.governance import Home, Runs


def _shift(at: str, seconds: float) -> str:
    dt = datetime.strptime(at, "%Y-%m-%dT%H:%M:%S.%fZ") + timedelta(seconds=seconds)
    return dt.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def what_ran(rt: Home, tenant: str, at: str, window: float = 3600.0) -> dict[str, Any]:
    """The state of ``tenant`` at ``at``: deployments in force (with their artifacts,
    approvers and instructions), the policy version, and the runs in progress or
    within ``window`` seconds of it, with the data and hosts each touched."""
    rt.tenants.get(tenant)
    policy = "sha256:" + "0" * 64
    for pv in rt.policies.history(tenant):
        if pv.set_at <= at:
            policy = pv.version
    if policy.endswith("0" * 64):
        from proctor.governance import EMPTY_POLICY

        policy = EMPTY_POLICY.version
    deployments = []
    for dep in rt.deployments.at(tenant, at):
        approvers = []
        for approval_id in dep.approvals:
            a = rt.approvals.get(tenant, approval_id)
            standing = a.standing(at)
            approvers.append(a.principal + ("" if standing else " (no longer standing)"))
        artifact = rt.artifacts.get(tenant, dep.digest)
        deployments.append(
            {
                "name": dep.name, "version": dep.version, "environment": dep.environment,
                "mode": dep.mode, "artifact": dep.digest, "purpose": artifact.purpose,
                "instruction": dep.instruction, "reference": dep.reference,
                "approved_by": approvers, "deployed_at": dep.created_at,
                "deployed_by": dep.created_by,
            }
        )  # fmt: skip
    runs = []
    for r in Runs(rt).between(tenant, _shift(at, -window), _shift(at, window)):
        data: set[str] = set()
        hosts: set[str] = set()
        denied = 0
        end = r.ended_at or _shift(at, window)
        for raw in rt.ledger.events_between(tenant, r.started_at, _shift(end, 1)):
            ev = json.loads(raw)
            if ev.get("run") != r.id:
                continue
            if ev["decision"] == "deny":
                denied += 1
                continue
            if ev["action"] in ("sql.select", "sql.write"):
                dataset = ev["details"].get("dataset", "?")
                for t in ev["details"].get("tables", []):
                    cols = ",".join(t.get("columns", []))
                    data.add(f"{dataset}.{t.get('table')}({cols})")
            elif ev["action"] == "http.request":
                hosts.add(ev["resource"])
            elif ev["action"] in ("file.read", "file.write"):
                data.add(ev["resource"])
        runs.append(
            {
                "id": r.id, "deployment": r.deployment, "version": r.version,
                "artifact": r.digest, "environment": r.environment, "status": r.status,
                "reason": r.reason, "started_at": r.started_at, "ended_at": r.ended_at,
                "in_progress_at_t": r.started_at <= at and (r.ended_at is None or r.ended_at >= at),
                "approvals": list(r.approvals), "data": sorted(data), "hosts": sorted(hosts),
                "denied": denied,
            }
        )  # fmt: skip
    return {
        "tenant": tenant,
        "at": at,
        "policy_version": policy,
        "deployments": deployments,
        "runs": runs,
    }
