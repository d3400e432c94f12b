"""Questions a controller asks of the log: lineage of one record, a sample of
production runs, the subprocessor annex, the records of processing."""

from __future__ import annotations

import json
import random
from typing import Any

from proctor.errors import UsageError
from proctor.evidence._summary import host_port
from proctor.governance import Home, Runs, Subprocessors, covers, is_production, record_key_hmac
from proctor.ledger import Action, keyed_hash, lineage_seqs

#: What the broker records for row key ``key`` (see ``RunScope.key_hmacs``).
key_hmac = keyed_hash


def _runs_index(rt: Home, tenant: str) -> dict[str, dict[str, Any]]:
    return {r.id: r.as_json() for r in Runs(rt).all(tenant)}


def lineage(rt: Home, tenant: str, dataset: str, key: str) -> dict[str, Any]:
    """Every run that read the record ``key`` of ``dataset`` (row-level lineage), and
    every run that wrote to or read the dataset where rows were not recorded."""
    rt.tenants.get(tenant)
    wanted = record_key_hmac(rt.keys.lineage_key(tenant), key)
    needle = wanted.encode()
    # Events since lineage objects name their rows through the key index; older
    # events (before store migration 9) listed the hashes inline, found by the scan.
    indexed = lineage_seqs(rt.store, tenant, wanted)
    ds = json.dumps(dataset).encode()
    hits: dict[str, dict[str, Any]] = {}
    maybe: dict[str, dict[str, Any]] = {}
    for data in rt.ledger.entries(tenant):
        # Byte filters first: a log is mostly events about other records.
        if b'"action":"sql.' not in data or b'"dataset":' + ds not in data:
            continue
        ev = json.loads(data)
        d = ev.get("details") or {}
        if ev["decision"] != "allow" or d.get("dataset") != dataset or not ev.get("run"):
            continue
        run = str(ev["run"])
        if ev["seq"] in indexed or (needle in data and wanted in (d.get("keys_hmac") or [])):
            item = hits.setdefault(run, {"run": run, "events": [], "first": ev["time"]})
            item["events"].append(ev["seq"])
            item["last"] = ev["time"]
            item.setdefault("deployment", ev.get("deployment"))
            item.setdefault("artifact", ev.get("artifact"))
            item.setdefault("approvals", ev.get("approvals"))
        elif ev["action"] == Action.SQL_WRITE or d.get("lineage") == "table":
            item = maybe.setdefault(run, {"run": run, "events": [], "first": ev["time"]})
            item["events"].append(ev["seq"])
            item["last"] = ev["time"]
            item.setdefault("deployment", ev.get("deployment"))
            item.setdefault("artifact", ev.get("artifact"))
            item.setdefault("approvals", ev.get("approvals"))
    runs = _runs_index(rt, tenant)
    for item in [*hits.values(), *maybe.values()]:
        r = runs.get(item["run"], {})
        item["environment"] = r.get("environment")
        item["started_at"] = r.get("started_at")
        item["approved_by"] = [
            rt.approvals.get(tenant, a).principal for a in item.get("approvals") or []
        ]
    return {
        "tenant": tenant,
        "dataset": dataset,
        "key_hmac": wanted,
        "read": sorted(hits.values(), key=lambda x: str(x["first"])),
        # Writes and multi-table reads record tables and columns, not rows: these runs
        # may have touched the record; the log cannot say more.
        "possibly": sorted(maybe.values(), key=lambda x: str(x["first"])),
    }


def sample_runs(rt: Home, tenant: str, n: int, seed: str) -> dict[str, Any]:
    """A reproducible random sample of production runs, each with its full chain."""
    if n < 1:
        raise UsageError("--n must be at least 1")
    population = [r for r in Runs(rt).all(tenant) if is_production(r.environment)]
    population.sort(key=lambda r: (r.started_at, r.id))
    # random.Random with a string seed is stable across runs and platforms (SHA-512
    # of the seed), so the same seed gives the auditor the same sample.
    picked = random.Random(f"proctor-sample/v1:{seed}").sample(population, min(n, len(population)))
    starters = _starters(rt, tenant, {r.id for r in picked})
    items = []
    for r in sorted(picked, key=lambda r: (r.started_at, r.id)):
        artifact = rt.artifacts.get(tenant, r.digest)
        dep = next(
            (d for d in rt.deployments.versions(tenant, r.deployment) if d.version == r.version),
            None,
        )
        approvals = [rt.approvals.get(tenant, a).as_json() for a in r.approvals]
        items.append(
            {
                "run": r.as_json(),
                # Who started it (the run.start event's actor): {"type", "id"}.
                "started_by": starters.get(r.id, {}).get("id"),
                "started_by_type": starters.get(r.id, {}).get("type"),
                "artifact": {
                    "digest": artifact.digest,
                    "name": artifact.name,
                    "author": artifact.author,
                    "submitted_at": artifact.submitted_at,
                    "purpose": artifact.purpose,
                    "capabilities_hash": artifact.capabilities_hash,
                    "capabilities": artifact.capabilities,
                },
                "deployment": None if dep is None else dep.as_json(),
                "approvals": approvals,
            }
        )
    return {
        "tenant": tenant,
        "seed": seed,
        "population": len(population),
        "n": len(items),
        "runs": items,
    }


def _starters(rt: Home, tenant: str, runs: set[str]) -> dict[str, dict[str, str]]:
    """The actor of each of ``runs``' run.start event: the store's run rows do not
    keep it, the record does."""
    found: dict[str, dict[str, str]] = {}
    if not runs:
        return found
    entries = rt.ledger.entries(tenant)
    try:
        for data in entries:
            if b'"action":"run.start"' not in data or b'"decision":"allow"' not in data:
                continue
            ev = json.loads(data)
            if ev.get("run") in runs:
                actor = ev["actor"]
                found[str(ev["run"])] = {"type": str(actor["type"]), "id": str(actor["id"])}
                if len(found) == len(runs):
                    break
    finally:
        # A generator: closing it ends its read transaction now, not at collection.
        getattr(entries, "close", lambda: None)()
    return found


def egress_seen(rt: Home, tenant: str) -> dict[str, int]:
    seen: dict[str, int] = {}
    for data in rt.ledger.entries(tenant):
        if b'"action":"http.request"' not in data or b'"decision":"allow"' not in data:
            continue
        host, port = host_port(json.loads(data))
        key = f"{host}:{port}"
        seen[key] = seen.get(key, 0) + 1
    return dict(sorted(seen.items()))


def dpa_annex(rt: Home, tenant: str) -> dict[str, Any]:
    """The subprocessor annex of a DPA: the register, and the egress actually seen."""
    rt.tenants.get(tenant)
    register = Subprocessors(rt.store, rt.ledger).list(tenant)
    seen = egress_seen(rt, tenant)
    rows = []
    uncovered = dict(seen)
    for sp in register:
        reached = {}
        for key, count in seen.items():
            host, _, port = key.rpartition(":")
            if any(covers(h, host, int(port)) for h in sp.hosts):
                reached[key] = count
                uncovered.pop(key, None)
        rows.append({**sp.as_json(), "reached": reached})
    return {"tenant": tenant, "subprocessors": rows, "uncovered": uncovered}


def ropa(rt: Home, tenant: str) -> dict[str, Any]:
    """Records of processing (GDPR Art. 30(2)) as the processor keeps them."""
    rt.tenants.get(tenant)
    register = Subprocessors(rt.store, rt.ledger).list(tenant)
    datasets = {d.name: d for d in rt.resources.datasets(tenant)}
    records = []
    for dep in rt.deployments.current(tenant):
        if not is_production(dep.environment):
            continue
        artifact = rt.artifacts.get(tenant, dep.digest)
        caps = artifact.capabilities
        categories = []
        for name, spec in sorted((caps.get("datasets") or {}).items()):
            ds = datasets.get(name)
            for table, grant in sorted((spec.get("tables") or {}).items()):
                categories.append(
                    {
                        "dataset": name,
                        "table": table,
                        "columns": list(grant.get("columns") or []),
                        "access": grant.get("access", "read"),
                        "kind": None if ds is None else ds.kind,
                    }
                )
        recipients = []
        for entry in caps.get("egress") or []:
            host, _, port = str(entry).rpartition(":")
            names = [
                s.name
                for s in register
                if any(covers(h, host.strip("[]"), int(port or 443)) for h in s.hosts)
            ]
            recipients.append({"host": entry, "subprocessors": names})
        records.append(
            {
                "processing": dep.name,
                "status": dep.status,
                "controller_instruction": dep.instruction,
                "reference": dep.reference,
                "purpose": artifact.purpose,
                "categories_of_data": categories,
                "recipients": recipients,
                "artifact": dep.digest,
                "approvals": [rt.approvals.get(tenant, a).principal for a in dep.approvals],
                "since": dep.created_at,
            }
        )
    return {
        "tenant": tenant,
        "processor": rt.config.trust_domain,
        "records": records,
        "subprocessors": [
            {"name": s.name, "purpose": s.purpose, "location": s.location} for s in register
        ],
        "security_measures": [
            "each run isolated in a gVisor or bubblewrap sandbox without network",
            "every call mediated by the broker and decided by Cedar policy (deny by default)",
            "every decision recorded in a signed, append-only Merkle log before it is answered",
            "production code runs only as an approved, content-addressed digest",
        ],
    }
