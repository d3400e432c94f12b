"""Erasure of one data subject's record key from the lineage record (GDPR Art. 17).

A SQL read's event carries a reference to a lineage object (count, Merkle root and
digest of the sorted keyed hashes of the rows it returned); a key index row per
hash finds the events that read a key. Erasing key K of dataset D:

- in every lineage object of an event of D that holds HMAC(K), its entry (the hash
  and, in format 2, its random salt) is replaced by its RFC 6962 leaf hash at its
  place (``ledger.erase_from_object``): the count and the Merkle root the signed
  event carries still verify; without the salt, gone with the entry, the leaf
  cannot be computed again from a candidate key even with the tenant's lineage key
  (format-1 objects, written before salts, keep an unsalted leaf that can);
- the key index rows of HMAC(K) for those events are deleted, so ``proctor lineage``
  finds nothing for K;
- on SQLite the old bytes are overwritten (``secure_delete`` for the transaction)
  and the write-ahead log is truncated, so the file holds no copy of the hash;
- one ``erasure.request`` event records the request reference (never the key, nor
  its hash), the dataset, and how many events and objects were changed; each
  erased object names the erasure's id, which verification holds to that event.
"""

from __future__ import annotations

import hashlib
import json
import re
import secrets
from dataclasses import dataclass
from typing import Any

from proctor import telemetry
from proctor.errors import NotFound, UsageError
from proctor.ledger import (
    Action,
    Actor,
    ErasureCheck,
    ErasureRecord,
    EventDraft,
    Ledger,
    check_lineage_object,
    erase_entry,
    erased_entries,
    erasure_list,
    erasure_record,
    is_erased_object,
    is_pruned_marker,
    keyed_hash,
    lineage_keys,
    lineage_seqs,
    objects_in,
    read_objects,
)
from proctor.store import Conn, Store

_REF_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/#-]{0,127}$")
_HMAC_RE = re.compile(r"^[0-9a-f]{32}$")


@dataclass(frozen=True)
class ErasureResult:
    erasure: str
    tenant: str
    dataset: str
    request_ref: str
    events: int
    objects: int
    seq: int

    @property
    def found(self) -> bool:
        """Whether any lineage of the key was left to erase (False: erased already)."""
        return self.events > 0

    def as_json(self) -> dict[str, Any]:
        return {
            "found": self.found,
            "erasure": self.erasure,
            "tenant": self.tenant,
            "dataset": self.dataset,
            "request_ref": self.request_ref,
            "events": self.events,
            "objects": self.objects,
            "seq": self.seq,
        }


def key_text(value: str) -> str:
    """A key given by a person as the broker spells it: an integer key ``42`` is the
    text ``42``; a JSON array stands for a composite key."""
    text = value.strip()
    if text.startswith("["):
        try:
            parts = json.loads(text)
        except ValueError as exc:
            raise UsageError(f"--key {value!r}: not a JSON array") from exc
        return json.dumps(parts, separators=(",", ":"))
    return text


def record_key_hmac(lineage_key: bytes, key: str) -> str:
    """The keyed hash the broker records for row key ``key`` as given on a command
    line (``42``; a JSON array for a composite key): what ``proctor lineage`` looks up,
    so an erasure finds what lineage finds."""
    return keyed_hash(lineage_key, key_text(key))


def erase_key(
    store: Store,
    ledger: Ledger,
    tenant: str,
    dataset: str,
    key_hmac: str,
    request_ref: str,
    actor: Actor,
) -> ErasureResult:
    """Erase the keyed hash ``key_hmac`` (what the broker recorded for the subject's
    row key) from the lineage record of ``dataset``'s reads; see the module text."""
    if not _REF_RE.match(request_ref):
        raise UsageError(
            f"request reference {request_ref[:40]!r} is not 1-128 letters, digits and ._:/#-",
            hint="a ticket or case number, e.g. DSR-2026-0042; never the person's name",
        )
    if not _HMAC_RE.match(key_hmac):
        raise UsageError("not a lineage key hash")
    found = sorted(lineage_seqs(store, tenant, key_hmac))
    with store.read() as conn:
        if conn.query_one("SELECT 1 FROM tenants WHERE name = ?", (tenant,)) is None:
            raise NotFound(f"no tenant {tenant!r}")
        refs: dict[int, str] = {}
        for seq in found:
            row = conn.query_one(
                "SELECT data FROM ledger_entries WHERE log = ? AND seq = ?", (tenant, seq)
            )
            if row is None:
                continue
            ev = json.loads(bytes(row[0]))
            if is_pruned_marker(ev):
                continue
            d = ev.get("details") or {}
            ref = d.get("lineage_object")
            if d.get("dataset") == dataset and isinstance(ref, dict):
                refs[seq] = str(ref.get("digest"))
    erasure = "erasure-" + secrets.token_hex(6)
    changed: dict[str, bytes] = {}
    erased: list[tuple[str, int]] = []
    for digest, data in read_objects(store, tenant, set(refs.values())).items():
        done = erase_entry(data, key_hmac, erasure)
        if done is not None:
            changed[digest] = done[0]
            erased.append((digest, done[1]))
    # The event commits to exactly the entries it erased: verification holds every
    # leaf of an erased object to a list like this one (ledger.ErasureCheck).
    listed, listed_ref = erasure_list(erasure, dataset, erased)
    raw = bytes.fromhex(key_hmac)
    secure = store.capabilities.secure_delete

    def write(conn: Conn) -> None:
        if secure:
            # Freed and overwritten cells are zeroed, not left in free pages.
            conn.secure_delete()
        conn.executemany(
            "UPDATE ledger_objects SET data = ? WHERE log = ? AND digest = ?",
            [(new, tenant, digest) for digest, new in changed.items()],
        )
        conn.executemany(
            "DELETE FROM ledger_lineage WHERE log = ? AND key = ? AND seq = ?",
            [(tenant, raw, seq) for seq in refs],
        )

    appended = ledger.append(
        tenant,
        EventDraft(
            actor,
            Action.ERASURE_REQUEST,
            f"dataset/{dataset}",
            # A key nothing holds any more (erased by an earlier request, or never
            # returned by a recorded read) is still a request to answer: on record,
            # saying that nothing was changed rather than that a key was erased.
            reason=(
                f"erasure request {request_ref}: one record key erased from lineage"
                if refs
                else f"erasure request {request_ref}: nothing of the key was left in the "
                "lineage record (erased already, or never returned by a recorded read); "
                "nothing changed"
            ),
            details={
                "erasure": erasure,
                "request_ref": request_ref,
                "dataset": dataset,
                "events": len(refs),
                "objects": len(changed),
                "entries": listed_ref,
            },
            objects=(listed,),
        ),
        hook=write,
    )
    telemetry.metrics().erasures.labels(telemetry.tenant(tenant)).inc()
    if secure:
        # The write-ahead log may still hold page images from before the erasure; a
        # scrub that a reader's snapshot defeats is done again by the next one
        # (proctor erase is idempotent).
        store.scrub()
    return ErasureResult(erasure, tenant, dataset, request_ref, len(refs), len(changed),
                         appended.seq)  # fmt: skip


#: Problems named at most; a store rewritten wholesale would give one per object.
_MAX_PROBLEMS = 200


@dataclass(frozen=True)
class LineageCheck:
    """What ``check_lineage_record`` found: its problems (empty if none) and what it
    held to the signed log."""

    problems: list[str]
    objects: int  # lineage objects held to the events that reference them
    erasures: int  # erasure.request events
    uncommitted: int  # of which recorded before erasures listed their entries
    index_rows: int  # key index rows held to the objects' kept keys


def unbacked_erasures(store: Store, tenant: str) -> list[str]:
    """The problems of ``check_lineage_record``: erased entries no recorded erasure
    lists, objects that are not what their events reference, key index rows missing
    or added. ``audit verify --tenant`` reports them."""
    return check_lineage_record(store, tenant).problems


def check_lineage_record(store: Store, tenant: str) -> LineageCheck:
    """Hold ``tenant``'s lineage record in the store to its signed log:

    - each lineage object an event references exists and is that object (its digest,
      or for an erased one its count and root: ``check_lineage_object``);
    - each erased entry is one an erasure the object names lists, of the object's
      dataset and after it (``ledger.ErasureCheck``); an erasure's list is the one its
      event commits to; an erasure recorded before the lists is held to one entry per
      object, and to the number of objects its event counts;
    - the key index holds exactly one row per key each event's object still holds:
      a row deleted hides a read from ``proctor lineage``, a row added frames one.

    One pass over the log, the objects and the index (sorted by event); memory is one
    small record per lineage event.
    """
    problems: list[str] = []

    def note(problem: str) -> None:
        if len(problems) < _MAX_PROBLEMS:
            problems.append(problem)

    readers: dict[str, list[tuple[int, str, dict[str, Any]]]] = {}
    events: list[dict[str, Any]] = []
    with store.read() as conn:
        for seq, raw in conn.iterate(
            "SELECT seq, data FROM ledger_entries WHERE log = ? ORDER BY seq", (tenant,)
        ):
            data = bytes(raw)
            if b'"lineage_object"' in data:
                ev = json.loads(data)
                d = ev.get("details") or {}
                ref = d.get("lineage_object")
                if is_pruned_marker(ev) or ref is None:
                    continue
                if not isinstance(ref, dict) or not isinstance(ref.get("digest"), str):
                    note(f"event seq {seq}: its lineage_object is not a reference")
                    continue
                readers.setdefault(ref["digest"], []).append((int(seq), str(d.get("dataset")), ref))
            elif b'"erasure.request"' in data:
                ev = json.loads(data)
                if ev.get("action") == Action.ERASURE_REQUEST and ev.get("decision") == "allow":
                    events.append(ev)
        lists = objects_in(conn, tenant, _list_digests(events))
        records: list[ErasureRecord] = []
        for ev in events:
            try:
                records.append(erasure_record(ev, lists))
            except ValueError as exc:
                d = ev.get("details") or {}
                note(f"erasure {d.get('erasure')!r} (event seq {ev.get('seq')}): {exc}")
                # It backs no entry: every leaf in its name is then named too.
                records.append(ErasureRecord(str(d.get("erasure")), int(ev["seq"]),
                                             str(d.get("dataset")), 0, frozenset()))  # fmt: skip
        check = ErasureCheck(records)
        # seq -> (how many keys its object still holds, SHA-256 of them in order)
        expected: dict[int, tuple[int, bytes]] = {}
        objects = 0
        for digest, raw in conn.iterate(
            "SELECT digest, data FROM ledger_objects WHERE log = ? ORDER BY digest", (tenant,)
        ):
            data = bytes(raw)
            uses = readers.pop(str(digest), [])
            for seq, _, ref in uses:
                objects += 1
                why = check_lineage_object(ref, data)
                if why is not None:
                    note(f"event seq {seq}: {why}")
            if uses:
                # The object was just checked against its event: read, not validated.
                keys = [k for _, k in _kept(data, checked=True)]
                summary = (len(keys), hashlib.sha256("".join(keys).encode()).digest())
                for seq, _, _ in uses:
                    expected[seq] = summary
            for why in check.object(str(digest), data, [(s, ds) for s, ds, _ in uses]):
                note(why)
        for why in check.finish():
            note(why)
        for digest, uses in sorted(readers.items(), key=lambda x: x[1][0][0]):
            note(f"event seq {uses[0][0]}: its lineage object {digest} is missing")
        rows, differ = _index_differences(conn, tenant, expected)
        for seq in differ[:_MAX_PROBLEMS]:
            note(_index_problem(conn, tenant, seq))
    # A hidden or restored entry first: what was hidden matters more than a wrong name.
    problems.sort(key=lambda p: not _names_entry(p))
    return LineageCheck(problems, objects, check.records, check.uncommitted, rows)


def _names_entry(problem: str) -> bool:
    return problem.startswith("entry ") or ": entry " in problem


def _list_digests(events: list[dict[str, Any]]) -> set[str]:
    out: set[str] = set()
    for ev in events:
        ref = (ev.get("details") or {}).get("entries")
        if isinstance(ref, dict) and isinstance(ref.get("digest"), str):
            out.add(ref["digest"])
    return out


def _kept(data: bytes | None, *, checked: bool = False) -> list[tuple[int, str]]:
    """(entry index, key) of each key a lineage object, plain or erased, still holds;
    ``checked``: the bytes were already held to their event, only read them."""
    if data is None:
        return []
    if checked:
        try:
            items = json.loads(data).get("keys")
        except (ValueError, AttributeError):
            return []
        if not isinstance(items, list):
            return []
        return [
            (i, e if isinstance(e, str) else str(e[0]))
            for i, e in enumerate(items)
            if (isinstance(e, list) and e) or (isinstance(e, str) and len(e) == 32)
        ]
    try:
        if is_erased_object(data):
            entries, _ = erased_entries(data)
            return [
                (i, e if isinstance(e, str) else e[0])
                for i, e in enumerate(entries)
                if isinstance(e, tuple) or len(e) == 32
            ]
        return list(enumerate(lineage_keys(data)))
    except ValueError:
        return []


def _index_differences(
    conn: Conn, tenant: str, expected: dict[int, tuple[int, bytes]]
) -> tuple[int, list[int]]:
    """(index rows read, the seqs whose rows are not exactly their object's kept
    keys), streaming the index in (seq, key) order: a raw key's order is its hex's."""
    rows = 0
    differ: list[int] = []
    seen: set[int] = set()
    cur: int | None = None
    count, h = 0, hashlib.sha256()

    def close() -> None:
        if cur is not None:
            seen.add(cur)
            if expected.get(cur, (0, hashlib.sha256().digest())) != (count, h.digest()):
                differ.append(cur)

    for seq, key in conn.iterate(
        "SELECT seq, key FROM ledger_lineage WHERE log = ? ORDER BY seq, key", (tenant,)
    ):
        rows += 1
        if seq != cur:
            close()
            cur, count, h = int(seq), 0, hashlib.sha256()
        count += 1
        h.update(bytes(key).hex().encode())
    close()
    differ += [s for s, (n, _) in expected.items() if n and s not in seen]
    return rows, sorted(differ)


def _index_problem(conn: Conn, tenant: str, seq: int) -> str:
    """Name the first difference between event ``seq``'s index rows and its object."""
    row = conn.query_one("SELECT data FROM ledger_entries WHERE log = ? AND seq = ?", (tenant, seq))
    ref = None
    if row is not None:
        ev = json.loads(bytes(row[0]))
        if not is_pruned_marker(ev):
            ref = (ev.get("details") or {}).get("lineage_object")
    if not isinstance(ref, dict):
        return (
            f"the lineage key index holds rows for event seq {seq}, which references no lineage"
            " object (rows added by hand?)"
        )
    digest = str(ref.get("digest"))
    kept = _kept(objects_in(conn, tenant, [digest]).get(digest))
    for index, key in kept:
        if (
            conn.query_one(
                "SELECT 1 FROM ledger_lineage WHERE log = ? AND key = ? AND seq = ?",
                (tenant, bytes.fromhex(key), seq),
            )
            is None
        ):
            return (
                f"event seq {seq}: entry {index} of lineage object {digest} has no row in the"
                " lineage key index (deleted: `proctor lineage` no longer finds this read)"
            )
    return (
        f"event seq {seq}: the lineage key index holds rows for keys its lineage object"
        f" {digest} does not hold (added by hand: `proctor lineage` names a read that was not)"
    )
