"""Lineage objects: per-row data kept beside an event instead of inside it.

An event must stay small whatever a call reads (``MAX_EVENT_BYTES``, so that
every entry fits a C2SP tlog-tiles entry bundle). The keyed hashes of the rows a
SQL read returned are one per row, so they go into a content-addressed object,
and the event carries only its reference: the object's digest, how many keys it
holds, and the RFC 6962 Merkle root over the sorted keys. The digest binds the
whole object to the signed log; the root lets one key's presence be proven with
an inclusion proof that reveals none of the others.

The object is written in the same transaction as its event (``Ledger``), with
one index row per key (``ledger_lineage``) so that "which events read key K"
is an index search, not a walk through every object.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from proctor.ledger._merkle import (
    EMPTY_ROOT,
    leaf_hash,
    node_hash,
    path_from_ranges,
)
from proctor.store import Conn, Store

LINEAGE_FORMAT = "proctor-lineage/1"
#: A lineage key as the broker records it: the first 16 bytes of an HMAC, in hex.
_KEY_RE = re.compile(r"^[0-9a-f]{32}$")
_DIGEST_RE = re.compile(r"^sha256:[0-9a-f]{64}$")


@dataclass(frozen=True)
class LedgerObject:
    """Bytes stored with an event, named by their SHA-256; ``keys`` are the index
    entries (raw 16-byte key hashes) that find the event again."""

    digest: str
    data: bytes
    keys: tuple[bytes, ...] = ()


def _root(keys: Sequence[str]) -> bytes:
    """RFC 6962 MTH over the keys' ASCII bytes, level by level: pairing neighbours and
    carrying an odd last node up unchanged gives the same root as MTH's split at the
    largest power of two, without a call per node."""
    if not keys:
        return EMPTY_ROOT
    sha = hashlib.sha256
    level = [sha(b"\x00" + k.encode("ascii")).digest() for k in keys]
    while len(level) > 1:
        nxt = [sha(b"\x01" + level[i] + level[i + 1]).digest() for i in range(0, len(level) - 1, 2)]
        if len(level) % 2:
            nxt.append(level[-1])
        level = nxt
    return level[0]


def _encode(keys: Sequence[str]) -> bytes:
    # Canonical JSON (RFC 8785) of {"format": ..., "keys": [...]}: the keys are
    # lowercase hex, so no escaping, and "format" sorts before "keys".
    inner = '"' + '","'.join(keys) + '"' if keys else ""
    return f'{{"format":"{LINEAGE_FORMAT}","keys":[{inner}]}}'.encode()


def _raw(key: str) -> bytes:
    try:
        raw = bytes.fromhex(key)
    except (ValueError, TypeError):
        raw = b""
    if len(raw) != 16 or raw.hex() != key:
        raise ValueError(f"not a lineage key: {str(key)[:40]!r}")
    return raw


def lineage_object(hmacs: Iterable[str]) -> tuple[LedgerObject, dict[str, Any]]:
    """The object holding ``hmacs`` (deduplicated, sorted) and the reference the
    event carries: ``{"digest", "count", "root"}``."""
    keys = sorted(set(hmacs))
    raws = tuple(_raw(k) for k in keys)
    data = _encode(keys)
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    ref = {"digest": digest, "count": len(keys), "root": _root(keys).hex()}
    return LedgerObject(digest, data, raws), ref


def lineage_keys(data: bytes) -> list[str]:
    """The keys of a lineage object; ValueError if the bytes are not one."""
    doc = json.loads(data)
    if not isinstance(doc, dict) or doc.get("format") != LINEAGE_FORMAT:
        raise ValueError("not a lineage object")
    keys = doc.get("keys")
    if not isinstance(keys, list) or not all(isinstance(k, str) and _KEY_RE.match(k) for k in keys):
        raise ValueError("a lineage object's keys must be 32 hex digits each")
    if keys != sorted(set(keys)):
        raise ValueError("a lineage object's keys must be sorted and distinct")
    if _encode(keys) != data:
        raise ValueError("a lineage object must be canonical JSON")
    return keys


def check_lineage_object(ref: Mapping[str, Any], data: bytes | None) -> str | None:
    """Why ``data`` is not the object ``ref`` (an event's reference) names, or None."""
    digest = ref.get("digest")
    if not isinstance(digest, str) or not _DIGEST_RE.match(digest):
        return f"the event's lineage reference has no valid digest: {digest!r}"
    if data is None:
        return f"lineage object {digest} is missing"
    if is_erased_object(data):
        # A data subject's key was erased: the bytes the digest named are gone, the
        # count and root are still the event's.
        return check_erased_object(ref, data)
    if "sha256:" + hashlib.sha256(data).hexdigest() != digest:
        return f"lineage object {digest} does not hash to its digest (altered)"
    try:
        keys = lineage_keys(data)
    except ValueError as exc:
        return f"lineage object {digest}: {exc}"
    if ref.get("count") != len(keys):
        return f"lineage object {digest} holds {len(keys)} keys, the event says {ref.get('count')}"
    if ref.get("root") != _root(keys).hex():
        return f"lineage object {digest}: the Merkle root of its keys differs from the event's"
    return None


def lineage_proof(keys: Sequence[str], key: str) -> tuple[int, list[bytes]]:
    """An RFC 6962 inclusion proof of ``key`` among the sorted ``keys``: (index,
    path), checked with ``verify_inclusion(root, index, len(keys), leaf, path)``
    where ``leaf`` is ``leaf_hash(key.encode())``. Reveals no other key."""
    index = list(keys).index(key)
    leaves = [leaf_hash(k.encode("ascii")) for k in keys]

    def mth(start: int, end: int) -> bytes:
        if end - start == 1:
            return leaves[start]
        k = 1 << ((end - start - 1).bit_length() - 1)
        return node_hash(mth(start, start + k), mth(start + k, end))

    return index, path_from_ranges(mth, index, len(keys))


def store_objects(
    conn: Conn,
    staged: Sequence[tuple[str, int, Sequence[LedgerObject]]],
    engine: str = "sqlite",
) -> None:
    """Write the objects of a batch's events, given as (log, seq, objects), and their
    key index rows, in the append's transaction. An object already stored (the same
    rows read again) is kept."""
    if not staged:
        return
    conn.executemany(
        "INSERT INTO ledger_objects (log, digest, data) VALUES (?, ?, ?)"
        " ON CONFLICT (log, digest) DO NOTHING",
        [(log, o.digest, o.data) for log, _, objects in staged for o in objects],
    )
    if engine == "postgresql":
        # One statement per log with two arrays: row by row, 100,000 keys take
        # seconds of the one writer's time (bench/lineage.py).
        by_log: dict[str, tuple[list[bytes], list[int]]] = {}
        for log, seq, objects in staged:
            keys, seqs = by_log.setdefault(log, ([], []))
            for o in objects:
                keys.extend(o.keys)
                seqs.extend([seq] * len(o.keys))
        for log, (keys, seqs) in by_log.items():
            if keys:
                conn.execute(
                    "INSERT INTO ledger_lineage (log, key, seq)"
                    " SELECT ?, u.k, u.s FROM unnest(?::bytea[], ?::bigint[]) AS u(k, s)",
                    (log, keys, seqs),
                )
        return
    conn.executemany(
        "INSERT INTO ledger_lineage (log, key, seq) VALUES (?, ?, ?)",
        [(log, k, seq) for log, seq, objects in staged for o in objects for k in o.keys],
    )


def lineage_seqs(store: Store, log: str, key: str) -> set[int]:
    """The sequence numbers of the events of ``log`` whose lineage object holds
    ``key`` (32 hex digits): one index search, no object is read."""
    with store.read() as conn:
        rows = conn.query(
            "SELECT seq FROM ledger_lineage WHERE log = ? AND key = ?", (log, bytes.fromhex(key))
        )
    return {int(r[0]) for r in rows}


def read_objects(store: Store, log: str, digests: Iterable[str]) -> dict[str, bytes]:
    """The stored objects of ``log`` among ``digests``; a digest not stored is absent."""
    found: dict[str, bytes] = {}
    with store.read() as conn:
        for digest in sorted(set(digests)):
            row = conn.query_one(
                "SELECT data FROM ledger_objects WHERE log = ? AND digest = ?", (log, digest)
            )
            if row is not None:
                found[digest] = bytes(row[0])
    return found


# -- erasure of one data subject (issue 20) ----------------------------------------

ERASED_FORMAT = "proctor-lineage-erased/1"
_LEAF_RE = re.compile(r"^[0-9a-f]{64}$")


def erase_from_object(data: bytes, key: str, erasure: str) -> bytes | None:
    """``data`` (a lineage object, plain or already erased) with ``key`` replaced by
    its RFC 6962 leaf hash, at its place, and ``erasure`` (the erasure's id) noted;
    None if the object does not hold ``key``. The count and the Merkle root the
    event signed stay what they were; the key itself is gone."""
    doc = json.loads(data)
    if doc.get("format") == LINEAGE_FORMAT:
        entries, erasures = list(lineage_keys(data)), list[str]()
    else:
        entries, erasures = erased_entries(data)
    if key not in entries:
        return None
    at = entries.index(key)
    entries[at] = leaf_hash(key.encode("ascii")).hex()
    return canonical_json_bytes(
        {"erasures": [*erasures, erasure], "format": ERASED_FORMAT, "keys": entries}
    )


def canonical_json_bytes(doc: Mapping[str, Any]) -> bytes:
    # Plain ASCII strings and lists only: sorted keys, no spaces is RFC 8785 here.
    return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()


def erased_entries(data: bytes) -> tuple[list[str], list[str]]:
    """An erased object's entries (kept keys, and leaf hashes where keys were erased)
    and the ids of the erasures that made it; ValueError if it is not one."""
    doc = json.loads(data)
    if not isinstance(doc, dict) or doc.get("format") != ERASED_FORMAT:
        raise ValueError("not an erased lineage object")
    entries, erasures = doc.get("keys"), doc.get("erasures")
    if not isinstance(entries, list) or not all(
        isinstance(k, str) and (_KEY_RE.match(k) or _LEAF_RE.match(k)) for k in entries
    ):
        raise ValueError("an erased lineage object's entries are keys or leaf hashes")
    if (
        not isinstance(erasures, list)
        or not erasures
        or not all(isinstance(e, str) for e in erasures)
    ):
        raise ValueError("an erased lineage object names the erasures that made it")
    if canonical_json_bytes(doc) != data:
        raise ValueError("an erased lineage object must be canonical JSON")
    return [str(k) for k in entries], [str(e) for e in erasures]


def erased_root(entries: Sequence[str]) -> bytes:
    """The RFC 6962 root over an erased object's entries: a key hashes to its leaf, a
    leaf hash is taken as it is, so the root is the one the event signed."""
    if not entries:
        return EMPTY_ROOT
    level = [bytes.fromhex(k) if len(k) == 64 else leaf_hash(k.encode("ascii")) for k in entries]
    while len(level) > 1:
        nxt = [node_hash(level[i], level[i + 1]) for i in range(0, len(level) - 1, 2)]
        if len(level) % 2:
            nxt.append(level[-1])
        level = nxt
    return level[0]


def check_erased_object(
    ref: Mapping[str, Any], data: bytes, erasures: Iterable[str] | None = None
) -> str | None:
    """Why ``data`` is not the erased form of the object ``ref`` names, or None: its
    count and Merkle root must be the event's (the digest was of the bytes before
    erasure, which are gone); given ``erasures`` (the ids the log's ``erasure.request``
    events record), each erasure it names must be one of them."""
    digest = ref.get("digest")
    try:
        entries, names = erased_entries(data)
    except ValueError as exc:
        return f"lineage object {digest}: {exc}"
    if ref.get("count") != len(entries):
        n = ref.get("count")
        return f"lineage object {digest} holds {len(entries)} entries, the event says {n}"
    if ref.get("root") != erased_root(entries).hex():
        return f"lineage object {digest}: the Merkle root of its entries differs from the event's"
    if erasures is not None:
        known = set(erasures)
        unknown = [n for n in names if n not in known]
        if unknown:
            return (
                f"lineage object {digest} was erased by {unknown[0]!r}, which no erasure"
                " event records"
            )
    return None


def is_erased_object(data: bytes | None) -> bool:
    return data is not None and b'"format":"' + ERASED_FORMAT.encode() + b'"' in data
