"""Pruned entries: an event's payload removed past its retention period, its leaf kept.

A pruned entry's stored bytes are replaced by a *marker*, canonical JSON::

    {"action": "ledger.pruned", "pruned": {"at": T, "by": ID, "leaf_hash": B64,
     "rule": R}, "seq": N, "tenant": X, "time": T0, "v": 1}

``leaf_hash`` is the RFC 6962 leaf hash of the event that was there (the tile's
level-0 hash, which never changes), so every tile, root, checkpoint, inclusion and
consistency proof stays what it was. The marker cannot be hashed back to its leaf:
what vouches for it is the ``retention.prune`` event ``ID`` names, appended in the
same transaction that wrote the markers, which commits to all of them (the SHA-256
of their bytes in order, their count, the rule, the time and the cut-off). A
verifier (:func:`proctor.ledger.verify_log`) takes a marker's leaf from the marker,
holds it to the tiles and the signed roots, and holds the marker itself to its
prune event: an altered leaf hash breaks the root, an altered field breaks the
prune event's digest, a marker no prune event names was not made by pruning.

``time`` is the pruned event's own signed ``time`` (read from the event's bytes,
never from the ``ledger_entries.time`` column, which a store writer can change), so
the prune event's digest commits to it. A verifier holds it to what the log still
signs: it must be before the prune's cut-off, and, as a log's times never go
backwards, not before the time of any event signed earlier in the log nor after
that of any signed later. Markers written before the time was taken from the event
carry the column's copy (equal to it unless the column was altered); they verify
under the same checks, which is what catches one made from a back-dated column
whenever a later-dated event was signed before it.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from proctor.errors import UsageError
from proctor.ledger._actions import Action
from proctor.ledger._canonical import canonical_json
from proctor.ledger._event import Actor, EventDraft
from proctor.ledger._merkle import leaf_hash

#: The action of a marker (never of an appended event) and of the event that prunes.
PRUNED_ACTION = Action.LEDGER_PRUNED
PRUNE_ACTION = Action.RETENTION_PRUNE
_MARKER_KEYS = frozenset({"action", "pruned", "seq", "tenant", "time", "v"})
_PRUNED_KEYS = frozenset({"at", "by", "leaf_hash", "rule"})
#: At most this many seq ranges in one prune event (it must stay under the event bound).
MAX_RANGES = 256
#: At most this many markers per prune event: one transaction rewrites them all.
MAX_PER_EVENT = 20_000


def is_marker(event: Any) -> bool:
    return isinstance(event, dict) and "pruned" in event


def marker_bytes(
    seq: int, tenant: str, time: str, leaf: bytes, *, at: str, by: str, rule: str
) -> bytes:
    return canonical_json(
        {
            "action": PRUNED_ACTION,
            "pruned": {
                "at": at,
                "by": by,
                "leaf_hash": base64.b64encode(leaf).decode(),
                "rule": rule,
            },
            "seq": seq,
            "tenant": tenant,
            "time": time,
            "v": 1,
        }
    )


def ranges_of(seqs: Sequence[int]) -> list[list[int]]:
    """Sorted seqs as half-open ``[start, end)`` runs."""
    out: list[list[int]] = []
    for s in seqs:
        if out and out[-1][1] == s:
            out[-1][1] = s + 1
        else:
            out.append([s, s + 1])
    return out


def signed_time(data: bytes) -> str:
    """The ``time`` an event's bytes carry (what its leaf hash commits to)."""
    try:
        ev = json.loads(data)
    except ValueError:
        ev = None
    time = ev.get("time") if isinstance(ev, dict) else None
    if not isinstance(time, str):
        raise UsageError("an entry without a signed time cannot be pruned")
    return time


@dataclass(frozen=True)
class PrunePlan:
    """One prune event's worth of entries: (seq, stored bytes) in seq order. Each
    marker's time is read from the entry's bytes, never given by the caller."""

    tenant: str
    entries: tuple[tuple[int, bytes], ...]
    rule: str
    at: str
    cutoff: str
    extra: dict[str, Any] = field(default_factory=dict)


def prune_draft(plan: PrunePlan, actor: Actor) -> tuple[EventDraft, list[tuple[bytes, str, int]]]:
    """The ``retention.prune`` event for ``plan`` and the rows to rewrite with it
    ((marker, log, seq)); the caller appends the event with a hook that writes them,
    so the markers exist exactly when their event does. Refuses an entry whose own
    signed time is not before the cut-off, whatever the caller chose it by."""
    if not plan.entries:
        raise UsageError("nothing to prune")
    by = secrets.token_hex(8)
    digest = hashlib.sha256()
    rows: list[tuple[bytes, str, int]] = []
    for seq, data in plan.entries:
        time = signed_time(data)
        if not time < plan.cutoff:
            raise UsageError(
                f"event seq {seq} is not past the retention period (signed at {time},"
                f" the cut-off is {plan.cutoff})"
            )
        m = marker_bytes(seq, plan.tenant, time, leaf_hash(data), at=plan.at, by=by, rule=plan.rule)
        digest.update(m + b"\n")
        rows.append((m, plan.tenant, seq))
    ranges = ranges_of([s for s, _ in plan.entries])
    details: dict[str, Any] = {
        "prune_id": by,
        "rule": plan.rule,
        "at": plan.at,
        "cutoff": plan.cutoff,
        "count": len(rows),
        "first": ranges[0][0],
        "last": ranges[-1][1] - 1,
        "ranges": ranges[:MAX_RANGES],
        "markers": "sha256:" + digest.hexdigest(),
        **plan.extra,
    }
    if len(ranges) > MAX_RANGES:
        details["ranges_cut"] = len(ranges) - MAX_RANGES
    draft = EventDraft(
        actor,
        PRUNE_ACTION,
        f"tenant/{plan.tenant}",
        reason=f"retention: {len(rows)} events pruned past {plan.cutoff} under {plan.rule}",
        details=details,
    )
    return draft, rows


@dataclass
class _Prune:
    """The markers naming one prune, as far as the stream has read them."""

    digest: Any
    count: int
    at: str
    rule: str
    latest: tuple[str, int]  # the latest marker time, and its seq
    first: int


class MarkerCheck:
    """What :func:`verify_log` holds pruned markers to, as it streams a log: each
    marker's own shape, its time against the times the log signs around it, and,
    once its prune event comes, the event's commitment and cut-off."""

    def __init__(self) -> None:
        self._open: dict[str, _Prune] = {}
        # The latest time a real (signed) event carried so far, and its seq; the
        # latest marker time not yet followed by a signed event, and its seq.
        self._signed: tuple[str, int] | None = None
        self._ahead: tuple[str, int] | None = None
        self.pruned = 0
        self.problems: list[str] = []

    def marker(self, seq: int, event: dict[str, Any], data: bytes) -> bytes | None:
        """The marker's leaf hash, or None (and a problem noted) if it is malformed."""
        p = event.get("pruned")
        if (
            set(event) != _MARKER_KEYS
            or event.get("action") != PRUNED_ACTION
            or event.get("v") != 1
            or not isinstance(p, dict)
            or set(p) != _PRUNED_KEYS
            or not all(isinstance(p[k], str) for k in _PRUNED_KEYS)
            or not isinstance(event.get("time"), str)
        ):
            self.problems.append(f"event seq {seq}: a malformed pruned marker")
            return None
        try:
            leaf = base64.b64decode(p["leaf_hash"], validate=True)
        except (binascii.Error, ValueError):
            leaf = b""
        if len(leaf) != 32:
            self.problems.append(f"event seq {seq}: a pruned marker without a leaf hash")
            return None
        by, at, rule, time = p["by"], p["at"], p["rule"], str(event["time"])
        # A log's times never go back (the writer gives each event at least the last
        # one's), so the pruned event was signed no earlier than any event before it.
        if self._signed is not None and time < self._signed[0]:
            self.problems.append(
                f"event seq {seq}: pruned marker's time {time} is before the time"
                f" {self._signed[0]} of event seq {self._signed[1]}, signed before it:"
                " the pruned event was not as old as its marker says"
            )
        if self._ahead is None or time > self._ahead[0]:
            self._ahead = (time, seq)
        cur = self._open.get(by)
        if cur is None:
            cur = self._open[by] = _Prune(hashlib.sha256(), 0, at, rule, (time, seq), seq)
        if (cur.at, cur.rule) != (at, rule):
            self.problems.append(
                f"event seq {seq}: pruned marker's time or rule differs from its prune's"
            )
        cur.digest.update(data + b"\n")
        cur.count += 1
        cur.latest = max(cur.latest, (time, seq))
        self.pruned += 1
        return leaf

    def event(self, seq: int, event: dict[str, Any]) -> None:
        """A real event: its time bounds the markers around it; if it is a prune
        event, settle the markers it names."""
        time = event.get("time")
        if isinstance(time, str):
            if self._ahead is not None and time < self._ahead[0]:
                self.problems.append(
                    f"event seq {self._ahead[1]}: pruned marker's time {self._ahead[0]} is"
                    f" after the time {time} of event seq {seq}, signed after it"
                )
            self._ahead = None
            if self._signed is None or time > self._signed[0]:
                self._signed = (time, seq)
        if event.get("action") != PRUNE_ACTION:
            return
        d = event.get("details")
        if not isinstance(d, dict):
            return
        by = d.get("prune_id")
        cur = self._open.pop(str(by), None)
        if cur is None:
            # A prune whose entries were all restored from a copy is no tampering.
            return
        if (
            d.get("markers") != "sha256:" + cur.digest.hexdigest()
            or cur.count != d.get("count")
            or cur.at != d.get("at")
            or cur.rule != d.get("rule")
        ):
            self.problems.append(
                f"event seq {cur.first}: pruned markers do not match their prune event"
                f" (seq {seq}): a marker was altered, added or removed"
            )
        cutoff = d.get("cutoff")
        latest, late = cur.latest
        if not isinstance(cutoff, str) or not latest < cutoff:
            self.problems.append(
                f"event seq {late}: pruned marker's time {latest} is not before the cut-off"
                f" {cutoff} of its prune (event seq {seq}): the event was not past the"
                " retention period"
            )

    def finish(self) -> None:
        for by, cur in self._open.items():
            self.problems.append(
                f"event seq {cur.first}: pruned marker(s) naming prune {by!r}, which no prune"
                " event in the log records: not pruned by the runtime"
            )
        self._open.clear()


def marker_leaf(event: dict[str, Any]) -> bytes:
    """The leaf hash a pruned marker keeps (what a proof of its entry uses); a pack or
    an export holds it to the tree, and :class:`MarkerCheck` to its prune event."""
    p = event.get("pruned")
    raw = p.get("leaf_hash") if isinstance(p, dict) else None
    try:
        leaf = base64.b64decode(str(raw), validate=True)
    except (binascii.Error, ValueError):
        leaf = b""
    if len(leaf) != 32:
        raise UsageError(f"event seq {event.get('seq')}: a pruned marker without a leaf hash")
    return leaf
