"""Run receipts (C2SP tlog-proof, made and checked in ``proctor.ledger``) for an
auditor's tools: made from a ledger, or from anything that holds one (the runtime).

Where the tenant's witnesses have cosigned a checkpoint that holds the event, the
receipt is made against the newest such checkpoint and carries its cosignatures
(extra signature lines on the note), so ``receipt verify --witness`` can hold it
to a witness policy offline; otherwise against the current checkpoint."""

from __future__ import annotations

from typing import Protocol

from proctor.ledger import Ledger, Receipt, verify_receipt
from proctor.ledger import make_receipt as _ledger_receipt
from proctor.store import Store
from proctor.witness import TenantWitnesses, witnessed_receipt

__all__ = ["Receipt", "make_receipt", "verify_receipt"]


class _HasLedger(Protocol):
    @property
    def ledger(self) -> Ledger: ...

    @property
    def store(self) -> Store: ...


def make_receipt(source: Ledger | _HasLedger, tenant: str, seq: int) -> str:
    """The receipt of event ``seq`` of ``tenant``'s log, against the newest cosigned
    checkpoint that holds it (given the runtime), or the current checkpoint."""
    if isinstance(source, Ledger):
        return _ledger_receipt(source, tenant, seq)
    receipt = _ledger_receipt(source.ledger, tenant, seq)
    return witnessed_receipt(TenantWitnesses(source.store, source.ledger), source.ledger,
                             tenant, receipt)  # fmt: skip
