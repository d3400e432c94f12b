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

Format 2 (``proctor-lineage/2``) gives each key a random salt of its own, and the
Merkle leaf is ``SHA-256(0x00 || salt || key)``: erasing a key replaces the pair by
that leaf, and without the salt (destroyed with it) no one, the holder of the
tenant's lineage key included, can compute the leaf from a candidate record key.
Format 1 objects (unsalted leaves) already in a store keep verifying.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
import secrets
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

LINEAGE_FORMAT = "proctor-lineage/2"
#: The unsalted format written before per-entry salts; read and verified, never written.
LINEAGE_FORMAT_V1 = "proctor-lineage/1"
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


def lineage_leaf(key: str, salt: str | None = None) -> bytes:
    """The RFC 6962 leaf of ``key`` in a lineage object: ``SHA-256(0x00 || salt ||
    key)`` with the salt's 16 raw bytes and the key's 32 ASCII hex digits (format 2),
    or ``SHA-256(0x00 || key)`` without a salt (format 1)."""
    prefix = bytes.fromhex(salt) if salt is not None else b""
    return leaf_hash(prefix + key.encode("ascii"))


def _root(keys: Sequence[str], salts: Sequence[str] | None = None) -> bytes:
    """RFC 6962 MTH over the keys' leaves, level by level: pairing neighbours and
    carrying an odd last node up unchanged gives the same root as MTH's split at the
    largest power of two, without a call per node."""
    if not keys:
        return EMPTY_ROOT
    sha = hashlib.sha256
    if salts is None:
        level = [sha(b"\x00" + k.encode("ascii")).digest() for k in keys]
    else:
        level = [
            sha(b"\x00" + bytes.fromhex(s) + k.encode("ascii")).digest()
            for k, s in zip(keys, salts, strict=True)
        ]
    return _fold(level)


def _fold(level: list[bytes]) -> bytes:
    sha = hashlib.sha256
    while len(level) > 1:
        nxt = [sha(b"\x01" + level[i] + level[i + 1]).digest() for i in range(0, len(level) - 1, 2)]
        if len(level) % 2:
            nxt.append(level[-1])
        level = nxt
    return level[0]


def _encode(keys: Sequence[str], salts: Sequence[str] | None = None) -> bytes:
    # Canonical JSON (RFC 8785) of {"format": ..., "keys": [...]}: the keys and salts
    # are lowercase hex, so no escaping, and "format" sorts before "keys". Format 2's
    # entries are [key, salt] pairs, format 1's bare keys.
    if salts is None:
        inner = '"' + '","'.join(keys) + '"' if keys else ""
        return f'{{"format":"{LINEAGE_FORMAT_V1}","keys":[{inner}]}}'.encode()
    inner = ",".join(f'["{k}","{s}"]' for k, s in zip(keys, salts, strict=True))
    return f'{{"format":"{LINEAGE_FORMAT}","keys":[{inner}]}}'.encode()


def _raw(key: str) -> bytes:
    try:
        raw = bytes.fromhex(key)
    except (ValueError, TypeError):
        raw = b""
    if len(raw) != 16 or raw.hex() != key:
        raise ValueError(f"not a lineage key: {str(key)[:40]!r}")
    return raw


def keyed_hash(lineage_key: bytes, key: str) -> str:
    """A row key's keyed hash, as lineage records it: HMAC-SHA256 under the tenant's
    lineage key, its first 16 bytes in hex. The broker hashes the keys a read
    returned, ``proctor lineage`` and ``proctor erase`` a key given by a person."""
    return hmac.new(lineage_key, key.encode(), hashlib.sha256).hexdigest()[:32]


def lineage_object(
    hmacs: Iterable[str], *, salted: bool = True
) -> tuple[LedgerObject, dict[str, Any]]:
    """The object holding ``hmacs`` (deduplicated, sorted), each with a fresh random
    salt (format 2; ``salted=False`` writes format 1, for tests of old logs only), and
    the reference the event carries: ``{"digest", "count", "root"}``. Two reads of the
    same rows get two objects: a salt shared between them would outlive an erasure in
    whichever object was not rewritten."""
    keys = sorted(set(hmacs))
    raws = tuple(_raw(k) for k in keys)
    salts = [secrets.token_hex(16) for _ in keys] if salted else None
    data = _encode(keys, salts)
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    ref = {"digest": digest, "count": len(keys), "root": _root(keys, salts).hex()}
    return LedgerObject(digest, data, raws), ref


_H32 = rb'"[0-9a-f]{32}"'
#: A canonical object of either format, checked in one pass of the regex engine: a
#: check per entry in Python costs more than all the rest of a verification.
_WELL_FORMED = {
    LINEAGE_FORMAT: re.compile(
        rb'\{"format":"proctor-lineage/2","keys":\[(?:\[%s,%s\](?:,\[%s,%s\])*)?\]\}'
        % ((_H32,) * 4)
    ),
    LINEAGE_FORMAT_V1: re.compile(
        rb'\{"format":"proctor-lineage/1","keys":\[(?:%s(?:,%s)*)?\]\}' % (_H32, _H32)
    ),
}


def _entries(data: bytes) -> tuple[list[str], list[str] | None]:
    """The keys of a plain lineage object and, for format 2, their salts."""
    for known, pattern in _WELL_FORMED.items():
        if pattern.fullmatch(data):
            found = json.loads(data)["keys"]
            bare = known == LINEAGE_FORMAT_V1
            ks = [str(k) for k in found] if bare else [str(p[0]) for p in found]
            if ks != sorted(set(ks)):
                raise ValueError("a lineage object's keys must be sorted and distinct")
            return ks, None if bare else [str(p[1]) for p in found]
    # Not canonical, or not one: the slow path names what is wrong.
    doc = json.loads(data)
    fmt = doc.get("format") if isinstance(doc, dict) else None
    if fmt not in (LINEAGE_FORMAT, LINEAGE_FORMAT_V1):
        raise ValueError("not a lineage object")
    items = doc.get("keys")
    if not isinstance(items, list):
        raise ValueError("a lineage object's keys must be a list")
    salts: list[str] | None = None
    if fmt == LINEAGE_FORMAT:
        if not all(
            isinstance(p, list)
            and len(p) == 2
            and all(isinstance(x, str) and _KEY_RE.match(x) for x in p)
            for p in items
        ):
            raise ValueError("a lineage object's entries must be [key, salt], 32 hex digits each")
        keys = [str(p[0]) for p in items]
        salts = [str(p[1]) for p in items]
    else:
        if not all(isinstance(k, str) and _KEY_RE.match(k) for k in items):
            raise ValueError("a lineage object's keys must be 32 hex digits each")
        keys = [str(k) for k in items]
    if keys != sorted(set(keys)):
        raise ValueError("a lineage object's keys must be sorted and distinct")
    if _encode(keys, salts) != data:
        raise ValueError("a lineage object must be canonical JSON")
    return keys, salts


def lineage_keys(data: bytes) -> list[str]:
    """The keys of a lineage object (format 1 or 2); ValueError if the bytes are not
    one."""
    return _entries(data)[0]


def lineage_salt(data: bytes, key: str) -> str | None:
    """The salt of ``key`` in the lineage object ``data`` (None for format 1): what a
    proof of that one key reveals, beside its path. ValueError if the object does not
    hold ``key``."""
    keys, salts = _entries(data)
    at = keys.index(key)
    return None if salts is None else salts[at]


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
        keys, salts = _entries(data)
    except ValueError as exc:
        return f"lineage object {digest}: {exc}"
    if ref.get("count") != len(keys):
        return f"lineage object {digest} holds {len(keys)} keys, the event says {ref.get('count')}"
    if ref.get("root") != _root(keys, salts).hex():
        return f"lineage object {digest}: the Merkle root of its keys differs from the event's"
    return None


def lineage_proof(source: bytes | Sequence[str], key: str) -> tuple[int, list[bytes]]:
    """An RFC 6962 inclusion proof of ``key`` in a lineage object (its bytes; or, for
    format 1, its sorted keys): (index, path), checked with ``verify_inclusion(index,
    count, lineage_leaf(key, lineage_salt(data, key)), path, root)``. Reveals no other
    key, nor any other salt."""
    if isinstance(source, bytes):
        keys, salts = _entries(source)
    else:
        keys, salts = list(source), None
    index = keys.index(key)
    if salts is None:
        leaves = [lineage_leaf(k) for k in keys]
    else:
        leaves = [lineage_leaf(k, s) for k, s in zip(keys, salts, strict=True)]

    def mth(start: int, end: int) -> bytes:
        if end - start == 1:
            return leaves[start]
        k = 1 << ((end - start - 1).bit_length() - 1)
        return node_hash(mth(start, start + k), mth(start + k, end))

    return index, path_from_ranges(mth, index, len(keys))


def store_objects(
    conn: Conn,
    staged: Sequence[tuple[str, int, Sequence[LedgerObject]]],
    bulk_insert: bool = False,
) -> None:
    """Write the objects of a batch's events, given as (log, seq, objects), and their
    key index rows, in the append's transaction. An object already stored (the same
    rows read again) is kept. ``bulk_insert``: the store's
    ``capabilities.bulk_insert`` (one statement over arrays per log)."""
    if not staged:
        return
    conn.executemany(
        "INSERT INTO ledger_objects (log, digest, data) VALUES (?, ?, ?)"
        " ON CONFLICT (log, digest) DO NOTHING",
        [(log, o.digest, o.data) for log, _, objects in staged for o in objects],
    )
    if bulk_insert:
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
    with store.read() as conn:
        return objects_in(conn, log, digests)


def objects_in(conn: Conn, log: str, digests: Iterable[str]) -> dict[str, bytes]:
    """``read_objects`` inside a transaction the caller holds open."""
    found: dict[str, bytes] = {}
    for digest in sorted(set(digests)):
        row = conn.query_one(
            "SELECT data FROM ledger_objects WHERE log = ? AND digest = ?", (log, digest)
        )
        if row is not None:
            found[digest] = bytes(row[0])
    return found


# -- erasure of one data subject (issue 20) ----------------------------------------

ERASED_FORMAT_V1 = "proctor-lineage-erased/1"
#: An erased format-2 object: kept entries are [key, salt], erased ones their leaf.
ERASED_FORMAT = "proctor-lineage-erased/2"
_LEAF_RE = re.compile(r"^[0-9a-f]{64}$")
#: An entry of an erased object: a kept key (format 1), a kept [key, salt] pair
#: (format 2), or the 64-hex leaf hash of an erased one.
LineageEntry = str | tuple[str, str]


def erase_from_object(data: bytes, key: str, erasure: str) -> bytes | None:
    """``data`` (a lineage object, plain or already erased) with ``key`` (and, in
    format 2, its salt) replaced by its RFC 6962 leaf hash, at its place, and
    ``erasure`` (the erasure's id) noted; None if the object does not hold ``key``.
    The count and the Merkle root the event signed stay what they were; the key and
    its salt are gone, so the leaf cannot be computed again from a candidate key."""
    erased = erase_entry(data, key, erasure)
    return None if erased is None else erased[0]


def erase_entry(data: bytes, key: str, erasure: str) -> tuple[bytes, int] | None:
    """``erase_from_object``, and the index of the entry it erased: what the erasure's
    event commits to (``erasure_list``)."""
    entries: list[LineageEntry]
    if is_erased_object(data):
        entries, erasures = erased_entries(data)
        salted = json.loads(data).get("format") == ERASED_FORMAT
    else:
        keys, salts = _entries(data)
        salted = salts is not None
        entries = list(keys) if salts is None else list(zip(keys, salts, strict=True))
        erasures = []
    at = next((i for i, e in enumerate(entries) if _entry_key(e) == key), None)
    if at is None:
        return None
    entry = entries[at]
    entries[at] = _entry_leaf(entry).hex()
    return canonical_json_bytes({
        "erasures": [*erasures, erasure],
        "format": ERASED_FORMAT if salted else ERASED_FORMAT_V1,
        "keys": [list(e) if isinstance(e, tuple) else e for e in entries],
    }), at  # fmt: skip


def _entry_key(entry: LineageEntry) -> str | None:
    if isinstance(entry, tuple):
        return entry[0]
    return entry if len(entry) == 32 else None


def _entry_leaf(entry: LineageEntry) -> bytes:
    if isinstance(entry, tuple):
        return lineage_leaf(entry[0], entry[1])
    return bytes.fromhex(entry) if len(entry) == 64 else lineage_leaf(entry)


def canonical_json_bytes(doc: Mapping[str, Any]) -> bytes:
    # Plain ASCII strings and lists only: sorted keys, no spaces is RFC 8785 here.
    return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()


def erased_entries(data: bytes) -> tuple[list[LineageEntry], list[str]]:
    """An erased object's entries (kept keys, or [key, salt] pairs in format 2, and
    leaf hashes where keys were erased) and the ids of the erasures that made it;
    ValueError if it is not one."""
    doc = json.loads(data)
    fmt = doc.get("format") if isinstance(doc, dict) else None
    if fmt not in (ERASED_FORMAT, ERASED_FORMAT_V1):
        raise ValueError("not an erased lineage object")
    items, erasures = doc.get("keys"), doc.get("erasures")
    if not isinstance(items, list):
        raise ValueError("an erased lineage object's entries are keys or leaf hashes")
    entries: list[LineageEntry] = []
    for item in items:
        # A bare key is format 1's kept entry; format 2 keeps [key, salt] pairs.
        bare = _KEY_RE if fmt == ERASED_FORMAT_V1 else _LEAF_RE
        if isinstance(item, str) and (_LEAF_RE.match(item) or bare.match(item)):
            entries.append(item)
        elif (
            fmt == ERASED_FORMAT
            and isinstance(item, list)
            and len(item) == 2
            and all(isinstance(x, str) and _KEY_RE.match(x) for x in item)
        ):
            entries.append((str(item[0]), str(item[1])))
        else:
            raise ValueError("an erased lineage object's entries are keys or leaf hashes")
    if (
        not isinstance(erasures, list)
        or not erasures
        or not all(isinstance(e, str) for e in erasures)
    ):
        raise ValueError("an erased lineage object names the erasures that made it")
    if canonical_json_bytes(doc) != data:
        raise ValueError("an erased lineage object must be canonical JSON")
    return entries, [str(e) for e in erasures]


def kept_keys(data: bytes | None) -> list[str]:
    """The keys a lineage object (plain or erased, any format) still holds; none if
    the bytes are not one."""
    if data is None:
        return []
    try:
        if is_erased_object(data):
            return [k for k in map(_entry_key, erased_entries(data)[0]) if k is not None]
        return lineage_keys(data)
    except ValueError:
        return []


def erased_root(entries: Sequence[LineageEntry]) -> bytes:
    """The RFC 6962 root over an erased object's entries: a key (or [key, salt]) hashes
    to its leaf, a leaf hash is taken as it is, so the root is the one the event
    signed."""
    if not entries:
        return EMPTY_ROOT
    return _fold([_entry_leaf(e) for e in entries])


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
    return data is not None and b'"format":"proctor-lineage-erased/' in data
