"""A production run's signed receipt, as the supervisor wrote it at the run's end (made
again against a checkpoint the tenant's witnesses cosigned since, when there is one)."""

from __future__ import annotations

from proctor.errors import NotFound
from proctor.governance import Home, Runs, is_production
from proctor.witness import TenantWitnesses, witnessed_receipt

RECEIPT_NAME = "receipt.tlog-proof"


def run_receipt(rt: Home, tenant: str, run_id: str) -> str:
    """The receipt (C2SP tlog-proof) of the run ``run_id`` names (an id or a unique
    prefix). The caller authorizes the read first."""
    record = Runs(rt.store).get(tenant, run_id)
    path = rt.home / "runs" / record.id / RECEIPT_NAME
    try:
        written = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        pass
    else:
        # Made again against the newest checkpoint the tenant's witnesses cosigned, if
        # it holds the run's end: the receipt then carries their cosignatures.
        return witnessed_receipt(TenantWitnesses(rt.store, rt.ledger), rt.ledger, tenant, written)
    if record.status == "running":
        why, hint = "is still running", "its receipt is written when it ends"
    elif not is_production(record.environment):
        why, hint = (
            f"ran in the {record.environment} environment",
            "only production runs get a signed receipt",
        )
    else:
        why, hint = (
            f"ended ({record.status}) without one",
            "`proctor audit events` shows its run.end event",
        )
    raise NotFound(f"run {record.id} has no receipt: it {why}", hint=hint)
