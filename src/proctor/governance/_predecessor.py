"""What an approver compares a new version with: the newest other version of the
same artifact name that is approved now. One rule for the CLI, the API and the
console, over the JSON forms of artifacts and approvals."""

from __future__ import annotations

from typing import Any

from proctor.governance._approvals import Approvals
from proctor.governance._artifacts import Artifacts
from proctor.ledger import utc_now


def standing_approvals(
    approvals: list[dict[str, Any]], artifact: dict[str, Any]
) -> list[dict[str, Any]]:
    """The approvals of ``artifact`` in force now: approve, not revoked, not expired, of
    its capabilities and purpose (what a deployment's quorum check counts, less the
    quorum itself: `approve` and `deploy` say whether enough of them do)."""
    now = utc_now()
    return [
        ap for ap in approvals
        if ap["digest"] == artifact["digest"] and ap["decision"] == "approve"
        and ap.get("revoked_at") is None and (ap.get("expires_at") or "~") > now
        and ap["capabilities_hash"] == artifact["capabilities_hash"]
        and ap["purpose"] == artifact["purpose"]
    ]  # fmt: skip


def approved_predecessor(
    doc: dict[str, Any], artifacts: list[dict[str, Any]], approvals: list[dict[str, Any]]
) -> dict[str, Any] | None:
    """The newest other version of ``doc``'s artifact (same name, submitted before it)
    that is approved now, with its approvals: what an approver compares a new one with."""
    older = [a for a in artifacts if a["name"] == doc["name"] and a["digest"] != doc["digest"]
             and a["submitted_at"] <= doc["submitted_at"]]  # fmt: skip
    for a in sorted(older, key=lambda a: a["submitted_at"], reverse=True):
        standing = standing_approvals(approvals, a)
        if standing:
            return {"digest": a["digest"], "submitted_at": a["submitted_at"],
                    "approvals": [{"id": ap["id"], "principal": ap["principal"],
                                   "created_at": ap["created_at"]} for ap in standing]}  # fmt: skip
    return None


def predecessor_of(
    artifacts: Artifacts, approvals: Approvals, tenant: str, doc: dict[str, Any]
) -> dict[str, Any] | None:
    """:func:`approved_predecessor` of ``doc`` (an artifact's JSON) from the store."""
    found = artifacts.list(tenant)
    given = [ap.as_json() for a in found for ap in approvals.for_artifact(tenant, a.digest)]
    return approved_predecessor(doc, [a.to_json() for a in found], given)
