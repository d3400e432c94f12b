"""Run receipts: a C2SP tlog-proof (https://c2sp.org/tlog-proof) for one event.

Format::

    c2sp.org/tlog-proof@v1
    extra <base64 of the event's canonical bytes>
    index <seq>
    <base64 hash>            (the RFC 9162 inclusion proof, leaf side first)
    ...
    <blank line>
    <the signed checkpoint, verbatim>

The spec leaves ``extra`` unauthenticated; here it carries the event itself and
the verifier hashes it into the leaf, so it is authenticated by the proof.

In the ledger, below the runtime's components: a production run's end writes one;
``proctor.evidence`` re-exports both functions for auditors.
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from proctor.errors import ProctorError, VerificationFailed
from proctor.ledger._ledger import Ledger
from proctor.ledger._merkle import leaf_hash, verify_inclusion
from proctor.ledger._note import Verifier, open_checkpoint, require_cosignatures

HEADER = "c2sp.org/tlog-proof@v1"


@dataclass(frozen=True)
class Receipt:
    origin: str
    index: int
    size: int
    event: dict[str, Any]


def make_receipt(
    ledger: Ledger, tenant: str, seq: int, checkpoint: tuple[int, str] | None = None
) -> str:
    """The receipt of event ``seq`` of ``tenant``'s log, against the current checkpoint,
    or against ``checkpoint`` (size, note): a checkpoint its witnesses cosigned, whose
    cosignatures the receipt then carries."""
    head = ledger.head(tenant)
    if head.size == 0:
        raise VerificationFailed(f"the log of {tenant} is empty")
    data = next(iter(ledger.entries(tenant, seq, seq + 1)), None)
    if data is None:
        raise VerificationFailed(f"event seq {seq} is not in the log of {tenant}")
    size, note = checkpoint if checkpoint is not None else (head.size, head.checkpoint)
    if not seq < size <= head.size:
        raise VerificationFailed(f"the checkpoint of size {size} does not hold event seq {seq}")
    proof = ledger.inclusion_proof(tenant, seq, size)
    lines = [HEADER, "extra " + base64.b64encode(data).decode(), f"index {seq}"]
    lines += [base64.b64encode(h).decode() for h in proof.hashes]
    return "\n".join(lines) + "\n\n" + note


def verify_receipt(text: str, vkey: str, witnesses: Sequence[str] = (), quorum: int = 0) -> Receipt:
    """Check a receipt offline with the verifier key; returns what it proves.

    With ``witnesses`` (their cosignature verifier keys) and ``quorum``, the
    receipt's checkpoint must also carry ``quorum`` valid cosignatures of them."""
    try:
        verifier = Verifier.parse(vkey)
    except ProctorError as exc:
        raise VerificationFailed(f"verifier key: {exc.message}") from exc
    proof_part, sep, note = text.partition("\n\n")
    if not sep:
        raise VerificationFailed("receipt: no blank line before the checkpoint")
    lines = proof_part.split("\n")
    if not lines or lines[0] != HEADER:
        raise VerificationFailed(f"receipt: the first line must be {HEADER}")
    rest = lines[1:]
    data = None
    try:
        if rest and rest[0].startswith("extra "):
            data = base64.b64decode(rest[0][6:], validate=True)
            rest = rest[1:]
        if not rest or not rest[0].startswith("index "):
            raise VerificationFailed("receipt: no index line")
        index_text = rest[0][6:]
        if not index_text.isdigit() or (index_text != "0" and index_text.startswith("0")):
            raise VerificationFailed("receipt: malformed index")
        index = int(index_text)
        hashes = [base64.b64decode(h, validate=True) for h in rest[1:]]
    except binascii.Error as exc:
        raise VerificationFailed("receipt: a line is not base64") from exc
    if data is None:
        raise VerificationFailed("receipt: no event (extra line) to check")
    checkpoint = open_checkpoint(note, verifier)
    if witnesses or quorum:
        require_cosignatures(note, list(witnesses), quorum)
    verify_inclusion(index, checkpoint.size, leaf_hash(data), hashes, checkpoint.root)
    try:
        event = json.loads(data)
    except ValueError as exc:
        raise VerificationFailed("receipt: the event is not JSON") from exc
    if not isinstance(event, dict) or event.get("seq") != index:
        raise VerificationFailed("receipt: the event's seq is not the proved index")
    if not checkpoint.origin.endswith(f"/tenant/{event.get('tenant')}"):
        raise VerificationFailed(
            f"receipt: the event's tenant {event.get('tenant')!r} is not the log "
            f"{checkpoint.origin!r}"
        )
    return Receipt(checkpoint.origin, index, checkpoint.size, event)
