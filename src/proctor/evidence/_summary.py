"""What a period's events show, per control: one deterministic JSON document.

Built in one streaming pass (a million events fit), at export and again by the
verifier from the proven events alone, so the counts in the report are checked,
not trusted.
"""

from __future__ import annotations

import bisect
from collections import Counter, defaultdict
from typing import Any

from proctor.governance import covers, is_production, split_entry
from proctor.ledger import Action

DATA_ACTIONS = frozenset(
    {Action.SQL_SELECT, Action.SQL_WRITE, Action.FILE_READ, Action.FILE_WRITE, Action.SECRET_USE}
)
EGRESS_ACTIONS = frozenset({Action.HTTP_REQUEST})
_LINKS = 20  # event links kept per item: enough to sample, small enough to read

CONTROLS: list[tuple[str, str, str]] = [
    (
        "SOC2-CC6.1",
        "SOC 2 CC6.1: logical access",
        "Every data-plane call by a workload was decided by policy (deny by default) under a "
        "workload identity, and recorded before it was answered.",
    ),
    (
        "SOC2-CC6.6",
        "SOC 2 CC6.6: boundary protection",
        "Egress leaves only through the broker's proxy; requests to hosts outside the approved "
        "capabilities (or the subprocessor register) were refused.",
    ),
    (
        "SOC2-CC7.2",
        "SOC 2 CC7.2: monitoring",
        "Refusals are recorded with their reason and deciding policy; the log is signed and "
        "verifiable offline, so gaps or edits are detected.",
    ),
    (
        "SOC2-CC8.1",
        "SOC 2 CC8.1: change management",
        "Code runs in production only as an approved artifact digest, approved before the run by "
        "a principal other than its author.",
    ),
    (
        "GDPR-28.3.a",
        "GDPR Art. 28(3)(a): documented instructions",
        "Each production deployment records the controller's instruction and purpose; each run "
        "names its deployment.",
    ),
    (
        "GDPR-28.3.h",
        "GDPR Art. 28(3)(h): information to demonstrate compliance",
        "This pack: the events, their proofs against signed checkpoints, and the governance "
        "records, verifiable with the verifier key alone.",
    ),
    (
        "GDPR-28.2-4",
        "GDPR Art. 28(2)/(4): subprocessors",
        "Egress is refused to any host no registered subprocessor covers; hosts reached are "
        "listed per subprocessor.",
    ),
    (
        "GDPR-30.2",
        "GDPR Art. 30(2): records of processing",
        "Deployments, purposes, datasets and recipients give the records of processing.",
    ),
    (
        "GDPR-32",
        "GDPR Art. 32: security of processing",
        "Isolation, deny-by-default mediation of every call, refusals recorded, integrity of the "
        "record proved by a Merkle log.",
    ),
]


def _host_of(ev: dict[str, Any]) -> str:
    return str(ev["resource"]).removeprefix("host/")


def host_port(ev: dict[str, Any]) -> tuple[str, int]:
    d = ev.get("details") or {}
    host = str(d.get("host") or "")
    port = int(d.get("port") or 0)
    if not host:
        entry = _host_of(ev)
        host, _, p = entry.rpartition(":")
        port = int(p) if p.isdigit() else 0
        host = host.strip("[]")
    return host, port


class Summary:
    """Accumulates the period's events; :meth:`finish` gives the report document."""

    def __init__(self) -> None:
        self.events = 0
        self.first_seq: int | None = None
        self.last_seq: int | None = None
        self.actions: Counter[str] = Counter()
        self.decisions: Counter[str] = Counter()
        self.denied: dict[str, list[Any]] = {}
        self.data: dict[str, Counter[str]] = defaultdict(Counter)
        self.hosts: Counter[str] = Counter()
        self.denied_hosts: Counter[str] = Counter()
        self.minutes: dict[str, list[int]] = {}
        self.runs: dict[str, dict[str, Any]] = {}
        self.control_links: dict[str, list[int]] = {c[0]: [] for c in CONTROLS}
        self.control_counts: Counter[str] = Counter()

    def _link(self, control: str, seq: int) -> None:
        self.control_counts[control] += 1
        links = self.control_links[control]
        if len(links) < _LINKS:
            links.append(seq)

    def add(self, ev: dict[str, Any]) -> None:
        seq = int(ev["seq"])
        action = str(ev["action"])
        decision = str(ev["decision"])
        if self.first_seq is None:
            self.first_seq = seq
        self.last_seq = seq
        self.events += 1
        self.actions[action] += 1
        self.decisions[decision] += 1
        details = ev.get("details") or {}
        data_plane = action in DATA_ACTIONS or action in EGRESS_ACTIONS
        if data_plane:
            minute = str(ev["time"])[:16]
            slot = self.minutes.get(minute)
            if slot is None:
                slot = self.minutes[minute] = [0, 0]
            slot[0] += 1
            if decision == "deny":
                slot[1] += 1
            self._link("SOC2-CC6.1", seq)
        if decision == "deny":
            reason = str(ev["reason"]) or "denied"
            item = self.denied.get(reason)
            if item is None:
                item = self.denied[reason] = [0, []]
            item[0] += 1
            if len(item[1]) < _LINKS:
                item[1].append(seq)
            self._link("SOC2-CC7.2", seq)
            if data_plane:
                self._link("GDPR-32", seq)
        if action in EGRESS_ACTIONS:
            host, port = host_port(ev)
            key = f"{host}:{port}"
            if decision == "allow":
                self.hosts[key] += 1
            else:
                self.denied_hosts[key] += 1
            self._link("SOC2-CC6.6", seq)
            self._link("GDPR-28.2-4", seq)
        elif action in (Action.SQL_SELECT, Action.SQL_WRITE) and decision == "allow":
            dataset = str(details.get("dataset", "?"))
            for t in details.get("tables") or []:
                for c in t.get("columns") or []:
                    self.data[dataset][f"{t.get('table')}.{c}"] += 1
            self._link("GDPR-30.2", seq)
        elif action in (Action.FILE_READ, Action.FILE_WRITE) and decision == "allow":
            self.data[f"bucket:{details.get('bucket', '?')}"][action] += 1
        elif action in (
            Action.ARTIFACT_SUBMIT,
            Action.APPROVAL_GRANT,
            Action.APPROVAL_REJECT,
            Action.APPROVAL_REVOKE,
            Action.DEPLOYMENT_CREATE,
            Action.DEPLOYMENT_ROLLBACK,
        ):
            self._link("SOC2-CC8.1", seq)
            if action.startswith("deployment."):
                self._link("GDPR-28.3.a", seq)
        elif action.startswith("subprocessor."):
            self._link("GDPR-28.2-4", seq)
        elif action == Action.POLICY_SET:
            self._link("GDPR-32", seq)
        if action == Action.RUN_START and ev.get("run") and decision == "allow":
            self.runs[str(ev["run"])] = {
                "run": ev["run"],
                "deployment": ev.get("deployment"),
                "artifact": ev.get("artifact"),
                "environment": details.get("environment"),
                "purpose": details.get("purpose"),
                "started_at": ev["time"],
                "start_seq": seq,
                "approvals": list(ev.get("approvals") or []),
                # Who started it: a principal (user or service), the local operator
                # (its id names the OS user and host), or the runtime (a service or
                # schedule of ``proctor serve``; then ``deployed_by`` says who asked).
                "started_by": ev["actor"]["id"],
                "started_by_type": ev["actor"]["type"],
                "status": "running",
                "ended_at": None,
                "end_seq": None,
                "calls": 0,
                "denied": 0,
            }
            self._link("GDPR-28.3.a", seq)
            if is_production(str(details.get("environment"))):
                self._link("SOC2-CC8.1", seq)
        elif action == Action.RUN_END and ev.get("run") in self.runs:
            run = self.runs[str(ev["run"])]
            run.update(status=details.get("status"), ended_at=ev["time"], end_seq=seq)
        elif data_plane and ev.get("run") in self.runs:
            run = self.runs[str(ev["run"])]
            run["calls"] += 1
            if decision == "deny":
                run["denied"] += 1

    def finish(
        self,
        *,
        context: list[dict[str, Any]],
        period_events: list[dict[str, Any]],
        subprocessors: list[dict[str, Any]],
    ) -> dict[str, Any]:
        """The report document. ``context`` and ``period_events`` are the governance
        events (approvals, submissions, deployments) that the approval chains cite."""
        approvals: dict[str, dict[str, Any]] = {}
        authors: dict[str, str] = {}
        instructions: dict[str, dict[str, Any]] = {}
        deploys: dict[str, list[tuple[int, str]]] = defaultdict(list)
        for ev in [*context, *period_events]:
            details = ev.get("details") or {}
            if ev["action"] == Action.APPROVAL_GRANT and ev["decision"] == "allow":
                approvals[str(details.get("approval"))] = {
                    "id": details.get("approval"),
                    "principal": ev["actor"]["id"],
                    "at": ev["time"],
                    "seq": ev["seq"],
                    "expires_at": details.get("expires_at"),
                }
            elif ev["action"] == Action.ARTIFACT_SUBMIT and ev["decision"] == "allow":
                authors[str(ev.get("artifact"))] = str(ev["actor"]["id"])
            elif ev["action"] in (Action.DEPLOYMENT_CREATE, Action.DEPLOYMENT_ROLLBACK):
                deploys[str(ev.get("deployment"))].append((int(ev["seq"]), str(ev["actor"]["id"])))
                instructions[str(ev.get("deployment"))] = {
                    "instruction": details.get("instruction"),
                    "reference": details.get("reference"),
                    "purpose": details.get("purpose"),
                    "environment": details.get("environment"),
                    "seq": ev["seq"],
                }
        for versions in deploys.values():
            versions.sort()
        runs = []
        for run in sorted(self.runs.values(), key=lambda r: int(r["start_seq"])):
            chain = [
                approvals.get(a, {"id": a, "principal": None, "at": None, "seq": None})
                for a in run["approvals"]
            ]
            # The deployment the run started under: its latest version before the start.
            versions = deploys.get(str(run["deployment"]), [])
            i = bisect.bisect_left(versions, (int(run["start_seq"]), ""))
            deployed = versions[i - 1] if i else (None, None)
            runs.append(
                {
                    **run,
                    "deployed_by": deployed[1],
                    "deployed_seq": deployed[0],
                    "author": authors.get(str(run["artifact"])),
                    "approval_chain": chain,
                    "instruction": instructions.get(str(run["deployment"]), {}).get("instruction"),
                }
            )
        register = []
        seen_hosts = dict(self.hosts)
        uncovered = dict(seen_hosts)
        for sp in subprocessors:
            reached = {}
            for key, count in seen_hosts.items():
                host, _, port = key.rpartition(":")
                if any(covers(h, host, int(port or 0)) for h in sp.get("hosts", [])):
                    reached[key] = count
                    uncovered.pop(key, None)
            register.append(
                {
                    "name": sp.get("name"),
                    "purpose": sp.get("purpose"),
                    "location": sp.get("location"),
                    "hosts": sp.get("hosts", []),
                    "reached": dict(sorted(reached.items())),
                }
            )
        controls = [
            {
                "id": cid,
                "title": title,
                "statement": text,
                "count": self.control_counts[cid],
                "events": self.control_links[cid],
            }
            for cid, title, text in CONTROLS
        ]
        production = [r for r in runs if is_production(str(r["environment"]))]
        return {
            "events": self.events,
            "first_seq": self.first_seq,
            "last_seq": self.last_seq,
            "decisions": dict(sorted(self.decisions.items())),
            "actions": dict(sorted(self.actions.items())),
            "controls": controls,
            "runs": runs,
            "production_runs": len(production),
            "denied": [
                {"reason": reason, "count": item[0], "events": item[1]}
                for reason, item in sorted(self.denied.items(), key=lambda kv: (-kv[1][0], kv[0]))
            ],
            "data": {ds: dict(sorted(cols.items())) for ds, cols in sorted(self.data.items())},
            "hosts": dict(sorted(self.hosts.items())),
            "denied_hosts": dict(sorted(self.denied_hosts.items())),
            "subprocessors": register,
            "uncovered_hosts": dict(sorted(uncovered.items())),
            "timeline": {m: v for m, v in sorted(self.minutes.items())},
        }


__all__ = ["CONTROLS", "Summary", "host_port", "split_entry"]
