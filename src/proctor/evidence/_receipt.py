"""Run receipts (C2SP tlog-proof, made and checked in ``proctor.ledger``) for an
auditor's tools: made from a ledger, or from anything that holds one (the runtime)."""

from __future__ import annotations

from typing import Protocol

from proctor.ledger import Ledger, Receipt, verify_receipt
from proctor.ledger import make_receipt as _ledger_receipt

__all__ = ["Receipt", "make_receipt", "verify_receipt"]


class _HasLedger(Protocol):
    @property
    def ledger(self) -> Ledger: ...


def make_receipt(source: Ledger | _HasLedger, tenant: str, seq: int) -> str:
    """The receipt of event ``seq`` of ``tenant``'s log, against the current checkpoint."""
    return _ledger_receipt(source if isinstance(source, Ledger) else source.ledger, tenant, seq)
