""" "What ran here at time T?", answered from the store and the ledger."""

from __future__ import annotations

import json
from datetime import datetime, timedelta
from typing import Any

from proctor.errors import NotFound
from proctor.governance import Home, Runs, effective_policies, environment_forbid
from proctor.ledger import Action, EventFilter, query_events

_RECORDED_RUNS = 50


def _shift(at: str, seconds: float) -> str:
    dt = datetime.strptime(at, "%Y-%m-%dT%H:%M:%S.%fZ") + timedelta(seconds=seconds)
    return dt.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def what_ran(rt: Home, tenant: str, at: str, window: float = 3600.0) -> dict[str, Any]:
    """The state of ``tenant`` at ``at``: deployments in force (with their artifacts,
    approvers and instructions), the policy versions, and the runs in progress or
    within ``window`` seconds of it, with the data and hosts each touched.

    A run's calls are decided under its effective set (the tenant's own set, its
    deployment's permits and its environment's forbid), whose version its
    ``run.start`` records: that is ``policy_version`` of a run, and of a deployment
    the versions its runs here used. ``tenant_policy_version`` is the tenant's own
    set alone (the empty set's hash when it has none), which decides nothing alone."""
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
        effective = None
        for raw in rt.ledger.events_between(tenant, r.started_at, _shift(end, 1)):
            ev = json.loads(raw)
            if ev.get("run") != r.id:
                continue
            if ev["action"] == Action.RUN_START:
                effective = ev["details"].get("policy_version")
                continue
            if ev["decision"] == "deny":
                denied += 1
                continue
            if ev["action"] in (Action.SQL_SELECT, Action.SQL_WRITE):
                dataset = ev["details"].get("dataset", "?")
                for t in ev["details"].get("tables", []):
                    cols = ",".join(t.get("columns", []))
                    data.add(f"{dataset}.{t.get('table')}({cols})")
            elif ev["action"] == Action.HTTP_REQUEST:
                hosts.add(ev["resource"])
            elif ev["action"] in (Action.FILE_READ, Action.FILE_WRITE):
                data.add(ev["resource"])
        runs.append(
            {
                "id": r.id, "deployment": r.deployment, "version": r.version,
                "artifact": r.digest, "environment": r.environment, "status": r.status,
                "reason": r.reason, "started_at": r.started_at, "ended_at": r.ended_at,
                "in_progress_at_t": r.started_at <= at and (r.ended_at is None or r.ended_at >= at),
                "approvals": list(r.approvals), "data": sorted(data), "hosts": sorted(hosts),
                "denied": denied, "policy_version": effective,
            }
        )  # fmt: skip
    for d in deployments:
        d["policy_versions"] = sorted(
            {r["policy_version"] for r in runs
             if r["deployment"] == d["name"] and r["version"] == d["version"]
             and r["policy_version"]}
        )  # fmt: skip
    return {
        "tenant": tenant,
        "at": at,
        "tenant_policy_version": policy,
        "policy_versions": sorted({r["policy_version"] for r in runs if r["policy_version"]}),
        "deployments": deployments,
        "runs": runs,
    }


def effective_policy(
    rt: Home, tenant: str, deployment: str, version: int | None = None
) -> dict[str, Any]:
    """The whole policy set a run of ``deployment`` (its current version, or
    ``version``) is decided under if it starts now, composed exactly as the supervisor
    composes it: the tenant's own set, the permits of the deployment's approved
    capabilities, and its environment's forbid. ``policy_version`` is what each call
    of such a run records; ``recorded`` the versions its runs recorded."""
    versions = rt.deployments.versions(tenant, deployment)
    if version is None:
        dep = versions[-1]
    else:
        found = [d for d in versions if d.version == version]
        if not found:
            raise NotFound(
                f"deployment {deployment!r} of {tenant!r} has no version {version}",
                hint=f"its versions are {', '.join(str(d.version) for d in versions)}",
            )
        dep = found[0]
    caps = rt.artifacts.get(tenant, dep.digest).manifest.capabilities
    forbid = environment_forbid(rt.resources, rt.subprocessors, tenant, dep.environment)
    compiled = effective_policies(rt.policies, tenant, dep.name, caps, forbid)
    own = rt.policies.current(tenant)
    recorded: set[str] = set()
    # The latest runs' (a service's runs are many; what changed shows in the last ones).
    mine = [r for r in Runs(rt).all(tenant, deployment=dep.name) if r.version == dep.version]
    for r in mine[-_RECORDED_RUNS:]:
        flt = EventFilter(run=r.id, action=Action.RUN_START, since=r.started_at)
        for raw in query_events(rt.ledger, tenant, flt, limit=1, newest=False):
            value = json.loads(raw)["details"].get("policy_version")
            if isinstance(value, str):
                recorded.add(value)
    return {
        "tenant": tenant,
        "deployment": dep.name,
        "version": dep.version,
        "environment": dep.environment,
        "artifact": dep.digest,
        "policy_version": compiled.version,
        "policy_ids": list(compiled.policy_ids),
        "tenant_policy_version": own.version,
        "text": compiled.text,
        "recorded": sorted(recorded),
    }
