"""A witness policy, as a verifier applies it: the checkpoint it relies on must carry
a quorum of valid cosignatures from witnesses it names (C2SP tlog-cosignature)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from proctor.errors import UsageError, VerificationFailed
from proctor.ledger import CosignatureVerifier, parse_checkpoint, require_cosignatures, split_note


def check_policy(witness_keys: Sequence[str], quorum: int | None) -> int:
    """The quorum to apply (default: every named witness); refuses a policy that
    cannot be met before anything is read."""
    keys = set()
    for vkey in witness_keys:
        try:
            keys.add(CosignatureVerifier.parse(vkey).vkey())
        except UsageError as exc:
            raise UsageError(f"--witness: {exc.message}", hint=exc.hint) from exc
    k = len(keys) if quorum is None else quorum
    if not keys or not 1 <= k <= len(keys):
        raise UsageError(
            f"--witness-quorum {k} needs between 1 and {len(keys)} distinct --witness keys",
            hint="give one --witness KEY per witness you trust ('proctor witness show' prints "
            "it), and a quorum no larger than their number",
        )
    return k


def witnessed(notes: Iterable[str], witness_keys: Sequence[str], quorum: int) -> tuple[int, str]:
    """The largest of ``notes`` (signed checkpoints) that carries ``quorum`` valid
    cosignatures from ``witness_keys``: (its size, the note). Refuses when none does,
    naming why the largest candidate failed."""
    candidates: list[tuple[int, str]] = []
    for note in notes:
        try:
            candidates.append((parse_checkpoint(split_note(note)[0]).size, note))
        except VerificationFailed:
            continue
    why = "no checkpoint carries cosignatures from the given witnesses"
    for _size, note in sorted(candidates, key=lambda c: -c[0]):
        try:
            require_cosignatures(note, list(witness_keys), quorum)
        except VerificationFailed as exc:
            why = exc.message
            continue
        return _size, note
    raise VerificationFailed(
        f"no checkpoint of the log has {quorum} valid cosignature(s) from the witnesses you "
        f"trust: {why}",
        hint="a witness cosigns only checkpoints consistent with the ones it saw: a log "
        "rewritten or rolled back after it was witnessed gets none; an honest log may not "
        "have been submitted yet ('proctor witness submit')",
    )
