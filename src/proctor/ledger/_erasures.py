"""What an erasure changed, and the check that an erased lineage object shows no more.

An erasure (``governance.erase_key``) turns one entry of each lineage object that
holds the subject's keyed hash into its leaf hash. The object cannot be held to
its digest any longer (the bytes it named are gone), only to its count and root,
and those a store writer keeps by turning *any* entry into its leaf: without more,
one real erasure's id, written into every object, hides every run's reads.

So the ``erasure.request`` event commits to exactly what the erasure changed: a
ledger object stored beside it (``erasure_list``: canonical JSON of its id, its
dataset and the sorted (lineage object digest, entry index) pairs it turned into
leaves), whose digest and count the signed event carries (``details.entries``).
An erased entry is then backed only by an erasure that the object names and whose
list names that very entry (``ErasureCheck``).

Erasures recorded before this (no ``entries`` in their event) list nothing; each
erased exactly one key, so at most one entry of each object it changed, of its
dataset, read before it, in as many objects as its event counts. ``ErasureCheck``
holds them to that: a forger who points more entries at such an erasure needs more
objects, or more erased entries per object, than it accounts for.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from proctor.ledger._objects import (
    LedgerObject,
    erased_entries,
    is_erased_object,
)

ERASURE_LIST_FORMAT = "proctor-erasure/1"
_DIGEST_RE = re.compile(r"^sha256:[0-9a-f]{64}$")


def erasure_list(
    erasure: str, dataset: str, entries: Iterable[tuple[str, int]]
) -> tuple[LedgerObject, dict[str, Any]]:
    """The ledger object listing the (lineage object digest, entry index) pairs an
    erasure turned into leaves, and the reference its event carries: ``{"digest",
    "count"}``. No key and no hash of one: only where the leaves are, which each erased
    object shows anyway."""
    pairs = sorted(set(entries))
    doc = {
        "dataset": dataset,
        "entries": [[d, i] for d, i in pairs],
        "erasure": erasure,
        "format": ERASURE_LIST_FORMAT,
    }
    data = _canonical(doc)
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    return LedgerObject(digest, data), {"digest": digest, "count": len(pairs)}


def _canonical(doc: Mapping[str, Any]) -> bytes:
    # A dataset name may be any text: RFC 8785 keeps it as UTF-8, unescaped.
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def read_erasure_list(data: bytes) -> tuple[str, str, list[tuple[str, int]]]:
    """(erasure id, dataset, pairs) of an erasure's list; ValueError if it is not one."""
    try:
        doc = json.loads(data)
    except ValueError as exc:
        raise ValueError("its entry list is not JSON") from exc
    if not isinstance(doc, dict) or doc.get("format") != ERASURE_LIST_FORMAT:
        raise ValueError("its entry list is not an erasure's list")
    erasure, dataset, items = doc.get("erasure"), doc.get("dataset"), doc.get("entries")
    if not isinstance(erasure, str) or not isinstance(dataset, str) or not isinstance(items, list):
        raise ValueError("its entry list lacks the erasure, the dataset or the entries")
    pairs: list[tuple[str, int]] = []
    for item in items:
        if not (
            isinstance(item, list)
            and len(item) == 2
            and isinstance(item[0], str)
            and _DIGEST_RE.match(item[0])
            and type(item[1]) is int
            and item[1] >= 0
        ):
            raise ValueError("its entry list holds an entry that is not [digest, index]")
        pairs.append((item[0], item[1]))
    if pairs != sorted(set(pairs)) or _canonical(doc) != data:
        raise ValueError("its entry list is not canonical (sorted, distinct, RFC 8785)")
    return erasure, dataset, pairs


@dataclass(frozen=True)
class ErasureRecord:
    """One recorded erasure: its signed ``erasure.request`` event and, since erasures
    commit to them, the (object digest, entry index) pairs it erased."""

    erasure: str
    seq: int
    dataset: str
    objects: int  # how many objects its event says it changed
    entries: frozenset[tuple[str, int]] | None  # None: recorded before the lists

    @property
    def committed(self) -> bool:
        return self.entries is not None


def erasure_record(event: Mapping[str, Any], lists: Mapping[str, bytes]) -> ErasureRecord:
    """The erasure an allowed ``erasure.request`` event records, its list read from
    ``lists`` (ledger objects by digest); ValueError naming why it backs nothing (its
    list missing, altered, or not the event's)."""
    d = event.get("details") or {}
    erasure, dataset = str(d.get("erasure")), str(d.get("dataset"))
    objects = d.get("objects")
    ref = d.get("entries")
    seq = int(event["seq"])
    if ref is None:
        return ErasureRecord(erasure, seq, dataset, objects if type(objects) is int else 0, None)
    digest = ref.get("digest") if isinstance(ref, dict) else None
    if not isinstance(digest, str) or not _DIGEST_RE.match(digest):
        raise ValueError("its event's entry list reference has no valid digest")
    data = lists.get(digest)
    if data is None:
        raise ValueError(f"its entry list {digest} is missing")
    if "sha256:" + hashlib.sha256(data).hexdigest() != digest:
        raise ValueError(f"its entry list {digest} does not hash to its digest (altered)")
    got_erasure, got_dataset, pairs = read_erasure_list(data)
    if (got_erasure, got_dataset) != (erasure, dataset):
        raise ValueError(f"its entry list {digest} is another erasure's")
    if ref.get("count") != len(pairs):
        raise ValueError(
            f"its entry list holds {len(pairs)} entries, the event says {ref.get('count')}"
        )
    return ErasureRecord(
        erasure, seq, dataset, objects if type(objects) is int else 0, frozenset(pairs)
    )


class ErasureCheck:
    """Holds each erased lineage object to the erasures it names: every leaf in place
    of an entry must be one that a named erasure lists (or, for an erasure recorded
    before the lists, one of the single entries it may have erased), of the object's
    dataset, after the object was written. ``object`` per object, then ``finish``."""

    def __init__(self, records: Iterable[ErasureRecord]) -> None:
        self._by_id: dict[str, ErasureRecord] = {}
        # digest -> entry index -> the erasure that lists it
        self._claims: dict[str, dict[int, str]] = {}
        for r in records:
            self._by_id[r.erasure] = r
            for digest, index in r.entries or ():
                self._claims.setdefault(digest, {})[index] = r.erasure
        self._old_uses: Counter[str] = Counter()

    @property
    def records(self) -> int:
        return len(self._by_id)

    @property
    def uncommitted(self) -> int:
        """Erasures recorded before erasures listed their entries."""
        return sum(1 for r in self._by_id.values() if not r.committed)

    def object(
        self, digest: str, data: bytes, readers: Sequence[tuple[int, str]] = ()
    ) -> list[str]:
        """Why the lineage object ``digest`` (its bytes as stored, and the (seq,
        dataset) of each event that references it) shows more erased than its
        erasures account for; empty if nothing."""
        claims = self._claims.get(digest, {})
        if not is_erased_object(data):
            return [
                f"entry {i} of lineage object {digest}: erasure {e!r} erased it, but the object"
                " holds its key again (restored from a copy made before the erasure?)"
                for i, e in sorted(claims.items())[:1]
            ]
        try:
            entries, names = erased_entries(data)
        except ValueError as exc:
            return [f"lineage object {digest}: {exc}"]
        problems: list[str] = []
        if len(set(names)) != len(names):
            problems.append(f"lineage object {digest} names an erasure twice")
        leaves = [i for i, e in enumerate(entries) if isinstance(e, str) and len(e) == 64]
        datasets = sorted({ds for _, ds in readers})
        written = min((s for s, _ in readers), default=None)
        covered: set[int] = set()
        old = 0
        for name in dict.fromkeys(names):
            r = self._by_id.get(name)
            if r is None:
                problems.append(
                    f"lineage object {digest} says erasure {name!r} made it; no erasure.request"
                    " event records one"
                )
                continue
            if datasets and r.dataset not in datasets:
                problems.append(
                    f"lineage object {digest} (a read of dataset {datasets[0]!r}) names erasure"
                    f" {name!r}, which erased dataset {r.dataset!r}"
                )
            if written is not None and written > r.seq:
                problems.append(
                    f"lineage object {digest} (event seq {written}) names erasure {name!r},"
                    f" recorded before it (seq {r.seq})"
                )
            if r.entries is None:
                old += 1
                self._old_uses[name] += 1
                continue
            mine = {i for i, e in claims.items() if e == name}
            if not mine:
                problems.append(
                    f"lineage object {digest} names erasure {name!r}, which erased none of its"
                    " entries"
                )
            covered |= mine
        leafset = set(leaves)
        for i, e in sorted(claims.items()):
            if i not in leafset:
                problems.append(
                    f"entry {i} of lineage object {digest}: erasure {e!r} erased it, but the"
                    " object holds a key there (restored from a copy made before the erasure?)"
                )
                break
        uncovered = [i for i in leaves if i not in covered]
        if len(uncovered) > old:
            # First: what was hidden matters more than which names are wrong.
            problems.insert(
                0,
                f"entry {uncovered[0]} of lineage object {digest} is erased, but no erasure the"
                f" object names lists it ({len(uncovered) - old} of its {len(entries)} entries"
                " erased without an erasure that accounts for them)",
            )
        elif len(uncovered) < old:
            problems.append(
                f"lineage object {digest} names {old} erasure(s) recorded before erasures listed"
                f" their entries, each of which erased one entry, but shows {len(uncovered)}"
            )
        return problems

    def finish(self) -> list[str]:
        """An erasure recorded before the lists names no more objects than it changed."""
        problems: list[str] = []
        for name, uses in sorted(self._old_uses.items()):
            r = self._by_id[name]
            if uses > r.objects:
                problems.append(
                    f"{uses} lineage objects name erasure {name!r} (seq {r.seq}), which changed"
                    f" {r.objects}: entries were erased in its name by hand"
                )
        return problems
