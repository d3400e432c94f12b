"""Retention, legal holds, pruning and erasure in an evidence pack and its report.

The pack carries ``governance/retention.json``: the rule in force, every legal
hold (removed ones too), and the retention record of the log (each
``retention.set``, ``hold.*``, ``retention.prune`` and ``erasure.request`` event's
seq, time, actor and details). ``evidence verify`` holds every entry of that record
that falls inside the pack's proven events to the event itself.

The report maps each control these features bear on (EU AI Act, SOC 2, ISO/IEC
27001:2022, NIST SP 800-53, GDPR) to the evidence that shows it, the checks that
test it (each the name of a function in this code base: ``tests/unit`` resolves
every one) and what the operator must still do.
"""

from __future__ import annotations

import html
from typing import Any

from proctor.errors import VerificationFailed
from proctor.governance import LEGAL_MINIMUM_DAYS, Home, Retention
from proctor.ledger import Action

#: A check's name -> the function that performs it, as ``module:qualified.name``.
CHECKS: dict[str, str] = {
    "verify_log": "proctor.ledger:verify_log",
    "verify_export": "proctor.ledger:verify_export",
    "verify_pack": "proctor.evidence:verify_pack",
    "open_checkpoint": "proctor.ledger:open_checkpoint",
    "require_cosignatures": "proctor.ledger:require_cosignatures",
    "unbacked_rows": "proctor.governance:unbacked_rows",
    "control_authorize": "proctor.governance:ControlPlane.authorize",
    "policy_decide": "proctor.policy:decide",
    "retention_set": "proctor.governance:Retention.set",
    "retention_prune": "proctor.governance:Retention.prune",
    "legal_holds": "proctor.governance:Retention.add_hold",
    "erase_key": "proctor.governance:erase_key",
    "check_lineage_object": "proctor.ledger:check_lineage_object",
    "check_erased_object": "proctor.ledger:check_erased_object",
    "erasure_check": "proctor.ledger:ErasureCheck.object",
    "unbacked_erasures": "proctor.governance:unbacked_erasures",
    "check_retention_record": "proctor.evidence._retention:check_retention_record",
    "ropa": "proctor.evidence:ropa",
    "dpa_annex": "proctor.evidence:dpa_annex",
    "lineage": "proctor.evidence:lineage",
}

#: (id, control, what the evidence shows, checks, what the operator must still do)
RETENTION_CONTROLS: list[tuple[str, str, str, tuple[str, ...], str]] = [
    ("EUAIA-12", "EU AI Act Art. 12: record-keeping",
     "Every call out of the sandbox and every control-plane action is logged automatically, "
     "before it is answered, in a signed Merkle log.",
     ("verify_log", "verify_pack"),
     "Keep serve running and the store durable; run the AI system only through Proctor."),
    ("EUAIA-19", "EU AI Act Art. 19(1): logs kept at least six months (providers)",
     "The rule in force (retention.json); a period under 183 days is refused unless a reason "
     "is given, and that reason is recorded.",
     ("retention_set", "check_retention_record"),
     "Set a period of 183 days or more; keep backups of the store for as long."),
    ("EUAIA-26.6", "EU AI Act Art. 26(6): deployers keep logs at least six months",
     "As Art. 19: the rule, the holds and every prune in the record, with the events pruned.",
     ("retention_set", "retention_prune", "check_retention_record"),
     "Keep the logs under your control; export packs before a tenant is removed."),
    ("SOC2-CC6", "SOC 2 CC6: logical access",
     "Retention, holds and erasure are admin-only Cedar actions (auditors read); each decision "
     "is recorded.",
     ("control_authorize", "policy_decide"),
     "Give the admin role to few people; review the tokens issued."),
    ("SOC2-CC7", "SOC 2 CC7: system operations and monitoring",
     "Verification tells a pruned entry from a tampered one and counts both; a prune and an "
     "erasure are events.",
     ("verify_log", "verify_pack"),
     "Run audit verify on a schedule and alert on a failure."),
    ("ISO27001-A.8.15", "ISO/IEC 27001:2022 A.8.15: logging",
     "Logs produced, stored and protected: signed checkpoints, witnessed where configured, "
     "retention per tenant.",
     ("verify_log", "open_checkpoint", "require_cosignatures"),
     "Protect the signing key and the store; configure witnesses."),
    ("ISO27001-A.8.16", "ISO/IEC 27001:2022 A.8.16: monitoring activities",
     "Refusals and their reasons are in the log and the report; pruning never removes a "
     "held run's events.",
     ("policy_decide", "legal_holds"),
     "Watch refusals and holds; place a hold when an incident is opened."),
    ("NIST-AU-2", "NIST SP 800-53 AU-2: event logging",
     "The event types logged are listed, field by field, in docs/compliance.md.",
     ("verify_log",),
     "Decide which events you must log beyond these (your own applications)."),
    ("NIST-AU-9.3", "NIST SP 800-53 AU-9(3): cryptographic protection of audit information",
     "RFC 6962 Merkle log, Ed25519-signed checkpoints; a pruned marker is bound to its prune "
     "event, an altered one fails verification.",
     ("verify_log", "open_checkpoint"),
     "Keep the signing key offline from the store's writers where possible."),
    ("NIST-AU-10", "NIST SP 800-53 AU-10: non-repudiation",
     "Each event names its actor; checkpoints are signed and can be cosigned by witnesses.",
     ("open_checkpoint", "require_cosignatures"),
     "Use witnesses you do not operate."),
    ("NIST-AU-11", "NIST SP 800-53 AU-11: audit record retention",
     "The retention rule, legal holds and the prune history; nothing under hold is pruned.",
     ("retention_prune", "legal_holds", "check_retention_record"),
     "Set the period your policy requires; place holds for litigation and investigations."),
    ("GDPR-5.1.e", "GDPR Art. 5(1)(e): storage limitation",
     "Past the period, event payloads are pruned (their leaf hashes stay); pruned lineage "
     "index rows go with them.",
     ("retention_prune", "verify_log"),
     "Choose a period no longer than your purposes need; run serve (or prune) regularly."),
    ("GDPR-17", "GDPR Art. 17: right to erasure",
     "Each erasure.request event names the request and commits to the lineage entries it "
     "erased; the subject's keyed hash is gone from lineage objects and index; counts and "
     "roots still verify, and every erased entry is held to the erasure that lists it.",
     ("erase_key", "check_erased_object", "erasure_check", "unbacked_erasures", "lineage"),
     "Answer the request (identify the key, run proctor erase); erase the person's data in "
     "your own datasets, which Proctor does not hold."),
    ("GDPR-28", "GDPR Art. 28: processor",
     "Deployments bind instructions; subprocessors registered; the pack is the information "
     "to demonstrate compliance.",
     ("dpa_annex", "verify_pack"),
     "Sign the DPA; keep the subprocessor register current."),
    ("GDPR-30", "GDPR Art. 30: records of processing",
     "Records derived from deployments, datasets and purposes; retention rule per tenant.",
     ("ropa",),
     "Keep the controller-side records; add the retention period to them."),
    ("GDPR-32", "GDPR Art. 32: security of processing",
     "Isolation, deny-by-default mediation, integrity of the record, erasure that keeps "
     "proofs.",
     ("verify_log", "policy_decide", "check_lineage_object"),
     "Patch the host; protect keys and backups; test restores."),
]  # fmt: skip


def retention_record(rt: Home, tenant: str) -> dict[str, Any]:
    """``governance/retention.json``: the rule, the holds, the retention record."""
    r = Retention(rt.store, rt.ledger)
    rule = r.rule(tenant)
    history = r.history(tenant)
    return {
        "legal_minimum_days": LEGAL_MINIMUM_DAYS,
        "rule": None if rule is None else rule.as_json(),
        "holds": [h.as_json() for h in r.holds(tenant, all_=True)],
        "history": history,
        "pruned": sum(
            int(e["details"].get("count") or 0)
            for e in history
            if e["action"] == Action.RETENTION_PRUNE
        ),
        "erasures": [
            e["details"].get("request_ref")
            for e in history
            if e["action"] == Action.ERASURE_REQUEST
        ],
    }


def check_retention_record(doc: Any, events: dict[int, dict[str, Any]]) -> None:
    """Every entry of the record that falls among the pack's proven ``events`` must be
    that event (action, actor, time and details): the record cannot be edited for the
    period the pack proves."""
    if not isinstance(doc, dict) or not isinstance(doc.get("history"), list):
        raise VerificationFailed("governance/retention.json: not a retention record")
    for item in doc["history"]:
        seq = item.get("seq") if isinstance(item, dict) else None
        ev = events.get(seq) if isinstance(seq, int) else None
        if ev is None:
            continue
        actor = (ev.get("actor") or {}).get("id")
        if (item.get("action"), item.get("time"), item.get("actor"), item.get("details")) != (
            ev.get("action"), ev.get("time"), actor, ev.get("details"),
        ):  # fmt: skip
            raise VerificationFailed(
                f"governance/retention.json: its entry for event seq {seq} does not match "
                "the proven event"
            )


def render_markdown(doc: dict[str, Any] | None) -> str:
    out = ["", "## Retention, legal holds, pruning and erasure", ""]
    if doc is None:
        return "\n".join([*out, "No retention record in this pack.", ""])
    rule = doc.get("rule")
    if rule is None:
        out.append("No retention rule: events are kept for as long as the tenant exists.")
    else:
        below = rule.get("below_legal_minimum")
        out.append(
            f"Rule in force: {rule['rule']} (set by {rule['set_by']} at {rule['set_at']})"
            + (f"; below the legal minimum of 183 days because: {below}" if below else "")
            + "."
        )
    out.append(
        f"Entries pruned: {doc.get('pruned', 0)}; erasure requests: "
        f"{', '.join(str(x) for x in doc.get('erasures', [])) or 'none'}."
    )
    out += ["", "| hold | on | reason | by | since | removed |", "|---|---|---|---|---|---|"]
    for h in doc.get("holds", []):
        out.append(
            f"| {h['id']} | {h['scope']} {_md(h['target'])} | {_md(h['reason'])} | "
            f"{h['created_by']} | {h['created_at']} | {h.get('removed_at') or '—'} |"
        )
    out += ["", "| seq | time | action | by |", "|---|---|---|---|"]
    for e in doc.get("history", []):
        out.append(f"| {e['seq']} | {e['time']} | `{e['action']}` | {e['actor']} |")
    out += [
        "",
        "## Control mapping: retention, integrity and erasure",
        "",
        "| control | evidence | checks | the operator must still |",
        "|---|---|---|---|",
    ]
    for _cid, title, evidence, checks, operator in RETENTION_CONTROLS:
        names = ", ".join(f"`{CHECKS[c]}`" for c in checks)
        out.append(f"| {title} | {_md(evidence)} | {names} | {_md(operator)} |")
    return "\n".join(out) + "\n"


def render_html(doc: dict[str, Any] | None) -> str:
    e = html.escape
    md = render_markdown(doc)
    # One section, as a preformatted copy of the Markdown plus the mapping as a table.
    rows = "".join(
        f"<tr><td>{e(title)}</td><td>{e(evidence)}</td>"
        f"<td>{e(', '.join(CHECKS[c] for c in checks))}</td><td>{e(operator)}</td></tr>"
        for _cid, title, evidence, checks, operator in RETENTION_CONTROLS
    )
    head = md.split("\n## Control mapping")[0]
    return (
        "<h2>Retention, legal holds, pruning and erasure</h2>"
        f"<pre>{e(head.split('## Retention, legal holds, pruning and erasure', 1)[-1].strip())}"
        "</pre><h2>Control mapping: retention, integrity and erasure</h2>"
        "<table><thead><tr><th>control</th><th>evidence</th><th>checks</th>"
        f"<th>the operator must still</th></tr></thead><tbody>{rows}</tbody></table>"
    )


def _md(value: Any) -> str:
    return str(value).replace("|", "\\|").replace("\n", " ")
