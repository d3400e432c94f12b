"""Full verification of a log from its events and signed checkpoints alone.

Used both on the live store and on an export directory, so an auditor runs
exactly the code the operator runs, with nothing but the verifier key.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from proctor.errors import VerificationFailed
from proctor.ledger._actions import INDEXED_ACTIONS, event_ref
from proctor.ledger._canonical import parse_canonical
from proctor.ledger._merkle import EMPTY_ROOT, HASH_SIZE, CompactRange, leaf_hash
from proctor.ledger._note import Checkpoint, Verifier, open_checkpoint
from proctor.ledger._prune import MarkerCheck, is_marker
from proctor.ledger._tiles import TILE_WIDTH, tile_path

TileFn = Callable[[int, int], bytes]
_sha256 = hashlib.sha256


@dataclass(frozen=True)
class VerifyReport:
    origin: str
    size: int
    root: bytes
    checkpoints: int
    #: Entries whose payload was pruned past retention (markers held to their prune).
    pruned: int = 0


class _TileCheck:
    """Compares recomputed hashes with a stored or exported copy of the tree."""

    def __init__(self, tiles: TileFn) -> None:
        self._tiles = tiles
        self._current: dict[int, tuple[int, bytes]] = {}

    def check(self, level: int, index: int, h: bytes, seq: int) -> None:
        tile_index, offset = divmod(index, TILE_WIDTH)
        cur = self._current.get(level)
        if cur is None or cur[0] != tile_index:
            cur = (tile_index, self._tiles(level, tile_index))
            self._current[level] = cur
        stored = cur[1][offset * HASH_SIZE : (offset + 1) * HASH_SIZE]
        if stored != h:
            what = "is missing from" if not stored else "does not match"
            raise VerificationFailed(
                f"event seq {seq}: its hash {what} the stored tree "
                f"({tile_path(level, tile_index)}); the event or the tree was altered"
            )


def verify_log(
    *,
    origin: str,
    tenant: str,
    entries: Iterable[bytes],
    checkpoints: Sequence[str],
    verifier: Verifier,
    head: tuple[int, bytes] | None = None,
    tiles: TileFn | None = None,
    refs: Mapping[int, str] | None = None,
) -> VerifyReport:
    """Recompute every leaf and root; check every signed checkpoint against them.

    Raises :class:`VerificationFailed` naming the first bad sequence number.
    ``checkpoints`` are signed notes; any the caller holds from elsewhere (an
    auditor's copy) can be added, which is what catches a truncated log whose
    later checkpoints were deleted too. ``refs`` are the store's ``ref`` column
    (seq to resource, where not NULL): each must be what the event at that seq
    says (:func:`event_ref`), and no governance event may lack its own, or the
    runtime's look-ups by resource (governance/_backing.py) would miss it.
    """
    by_size: dict[int, Checkpoint] = {}
    for note in checkpoints:
        cp = open_checkpoint(note, verifier, origin)
        seen = by_size.get(cp.size)
        if seen is not None and seen.root != cp.root:
            raise VerificationFailed(
                f"two signed checkpoints of size {cp.size} with different roots: the log was forked"
            )
        by_size[cp.size] = cp
    if 0 in by_size and by_size[0].root != EMPTY_ROOT:
        raise VerificationFailed("the signed checkpoint of size 0 has a non-empty root")
    pending = sorted(s for s in by_size if s > 0)
    check = _TileCheck(tiles) if tiles is not None else None
    tree = CompactRange()
    peaks = tree.peaks
    marks = MarkerCheck()
    found: dict[int, str | None] = {}  # seq -> its row's ref, of the governance events
    verified = 0
    pi = 0
    seq = -1
    tile0_index, tile0 = -1, b""

    for seq, data in enumerate(entries):
        try:
            event, canonical = parse_canonical(data)
        except (ValueError, UnicodeDecodeError) as exc:
            raise VerificationFailed(f"event seq {seq}: not valid JSON ({exc})") from exc
        got = event.get("seq") if isinstance(event, dict) else None
        if type(got) is not int or got != seq:
            raise VerificationFailed(
                f"event seq {seq}: found an event with seq {got!r} in its place; events "
                "were removed, inserted or reordered"
            )
        if event.get("tenant") != tenant:
            raise VerificationFailed(
                f"event seq {seq}: belongs to tenant {event.get('tenant')!r}, not {tenant!r}"
            )
        if not canonical:
            raise VerificationFailed(f"event seq {seq}: bytes are not canonical JSON")
        if is_marker(event):
            leaf = marks.marker(seq, event, data) or leaf_hash(data)
            if check is not None:
                try:
                    check.check(0, seq, leaf, seq)
                except VerificationFailed as exc:
                    raise VerificationFailed(
                        f"event seq {seq}: a pruned marker whose leaf hash does not match "
                        "the tree: the marker or the tree was altered"
                    ) from exc
        else:
            marks.event(seq, event)
            if refs is not None:
                action = event.get("action")
                if type(action) is str and action in INDEXED_ACTIONS:
                    found[seq] = event_ref(action, event.get("resource"))
            leaf = leaf_hash(data)
            if tiles is not None:
                # The leaf against its level-0 tile, inline: once per event; a
                # mismatch goes to the check, which names it.
                if seq >> 8 != tile0_index:
                    tile0_index, tile0 = seq >> 8, tiles(0, seq >> 8)
                off = (seq & 0xFF) * HASH_SIZE
                if tile0[off : off + HASH_SIZE] != leaf and check is not None:
                    check.check(0, seq, leaf, seq)
        # CompactRange.push, inline (once per event): a node at a tile level (every
        # 8th height) is held to the stored tree as it forms.
        height, h = 0, leaf
        while peaks and peaks[-1][0] == height:
            h = _sha256(b"\x01" + peaks.pop()[1] + h).digest()
            height += 1
            if check is not None and not height & 7:
                check.check(height >> 3, (seq + 1 - (1 << height)) >> height, h, seq)
        peaks.append((height, h))
        tree.size += 1
        while pi < len(pending) and pending[pi] == tree.size:
            if tree.root() != by_size[tree.size].root:
                raise VerificationFailed(
                    f"event seq {verified} to {tree.size - 1}: these events do not hash to "
                    f"the signed checkpoint of size {tree.size}; one of them was altered"
                )
            verified = tree.size
            pi += 1
    if pi < len(pending):
        raise VerificationFailed(
            f"event seq {tree.size}: missing; the log holds {tree.size} events but a "
            f"signed checkpoint commits to {pending[pi]}"
        )
    root = tree.root()
    if head is not None and (head[0] != tree.size or head[1] != root):
        raise VerificationFailed(
            f"the log's head (size {head[0]}) does not match its {tree.size} events"
        )
    if pending and pending[-1] != tree.size:
        raise VerificationFailed(
            f"event seq {pending[-1]}: the events from here on are covered by no signed checkpoint"
        )
    if not pending and tree.size:
        raise VerificationFailed("event seq 0: no signed checkpoint covers the log")
    if refs is not None:
        _check_refs(refs, found)
    marks.finish()
    if marks.problems:
        # The leaves all hash to the signed roots; what fails is a marker's own record.
        raise VerificationFailed(
            f"{len(marks.problems)} tampered pruned marker(s) among {marks.pruned} pruned "
            f"entries: {marks.problems[0]}"
        )
    return VerifyReport(origin, tree.size, root, len(by_size), marks.pruned)


def _check_refs(refs: Mapping[int, str], found: Mapping[int, str | None]) -> None:
    """Each row's ``ref`` against its event: ``found`` holds what ``event_ref`` gives
    each governance event, by seq; ``refs`` the column where it is not NULL."""
    for seq in sorted(set(refs) | set(found)):
        want, got = found.get(seq), refs.get(seq)
        if got != want:
            raise VerificationFailed(
                f"event seq {seq}: its row's ref column says {got!r}, its event"
                f" {want!r}: the store's index of governance events was altered"
                " (a governance event would be hidden from, or shown to, the runtime's"
                " checks by resource)"
            )
