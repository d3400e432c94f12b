"""What an evidence pack says about the tenant's witnesses, and how a verifier holds
the pack to a witness policy.

Files (listed in the manifest like every other):

- ``witness/status.json``: the tenant's witnesses, its witness policy, and how old
  the newest checkpoint with the policy's quorum of cosignatures is (the tenant
  setting ``max_age_seconds`` bounds it);
- ``witness/checkpoint.note``: that checkpoint, with the cosignatures (when there is one);
- ``witness/consistency.json``: the consistency proof between it and the pack's end
  checkpoint (the smaller size first), when their sizes differ.
"""

from __future__ import annotations

import json
import zipfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from proctor.errors import VerificationFailed
from proctor.evidence._tree import decode_hashes
from proctor.governance import Home
from proctor.ledger import (
    Verifier,
    canonical_json,
    open_checkpoint,
    require_cosignatures,
)
from proctor.witness import TenantWitnesses, require_extends

STATUS = "witness/status.json"
CHECKPOINT = "witness/checkpoint.note"
CONSISTENCY = "witness/consistency.json"


def witness_files(rt: Home, tenant: str, end_size: int) -> dict[str, bytes]:
    """The pack's witness files for a pack whose end checkpoint has ``end_size``."""
    witnesses = TenantWitnesses(rt.store, rt.ledger)
    status = witnesses.status(tenant)
    files = {STATUS: canonical_json(status) + b"\n"}
    newest = witnesses.newest_cosigned(tenant, int(status["policy"]["quorum"]))
    if newest is None:
        return files
    size, note = newest
    files[CHECKPOINT] = note.encode()
    if size != end_size:
        old, new = sorted((size, end_size))
        proof = rt.ledger.consistency_proof(tenant, old, new)
        files[CONSISTENCY] = canonical_json(proof.as_json()) + b"\n"
    return files


def verify_pack_witnesses(
    path: Path, vkey: str | None, witnesses: Sequence[str], quorum: int
) -> dict[str, Any]:
    """Hold a pack (already checked by ``verify_pack``) to a witness policy: its
    witnessed checkpoint carries ``quorum`` valid cosignatures of ``witnesses``, is
    signed by the log's key, and is consistent with the end checkpoint, which it must
    cover (the whole period witnessed). Returns the pack's witness status."""
    with zipfile.ZipFile(path) as zf:
        names = set(zf.namelist())
        meta = json.loads(zf.read("pack.json"))
        key = vkey or zf.read("verifier.key").decode()
        verifier = Verifier.parse(key)
        origin = str(meta["origin"])
        end = open_checkpoint(zf.read("checkpoints/end.note").decode(), verifier, origin)
        if CHECKPOINT not in names:
            raise VerificationFailed(
                f"the pack carries no witnessed checkpoint ({CHECKPOINT}): no checkpoint of "
                f"{origin} had been cosigned when it was exported"
            )
        note = zf.read(CHECKPOINT).decode()
        witnessed = open_checkpoint(note, verifier, origin)
        require_cosignatures(note, list(witnesses), quorum)
        if witnessed.size < end.size:
            raise VerificationFailed(
                f"the pack's period ends at size {end.size} but its witnesses cosigned only up "
                f"to size {witnessed.size}: the last {end.size - witnessed.size} events are "
                "not witnessed",
                hint="submit the log to its witnesses ('proctor witness submit') and export again",
            )
        hashes: list[bytes] = []
        if witnessed.size != end.size:
            if CONSISTENCY not in names:
                raise VerificationFailed(f"{CONSISTENCY} is missing")
            proof = json.loads(zf.read(CONSISTENCY))
            if proof.get("old") != end.size or proof.get("new") != witnessed.size:
                raise VerificationFailed(f"{CONSISTENCY}: its sizes are not the checkpoints'")
            hashes = decode_hashes(proof.get("hashes"), CONSISTENCY)
        # The same check as `audit verify --witness` makes of a live log.
        require_extends((end.size, end.root), (witnessed.size, witnessed.root), hashes,
                        old_name="the pack's end checkpoint",
                        new_name="the witnessed checkpoint")  # fmt: skip
        status: dict[str, Any] = json.loads(zf.read(STATUS)) if STATUS in names else {}
    status["witnessed_size"] = witnessed.size
    return status
