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

import json
import re
import secrets
import sqlite3
from contextlib import closing, suppress
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

from proctor.errors import NotFound, UsageError
from proctor.ledger import (
    Actor,
    EventDraft,
    Ledger,
    erase_from_object,
    erased_entries,
    is_erased_object,
    is_pruned_marker,
    keyed_hash,
    lineage_seqs,
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

    def as_json(self) -> dict[str, Any]:
        return {
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
    for digest, data in read_objects(store, tenant, set(refs.values())).items():
        new = erase_from_object(data, key_hmac, erasure)
        if new is not None:
            changed[digest] = new
    raw = bytes.fromhex(key_hmac)
    sqlite = store.engine == "sqlite"

    def write(conn: Conn) -> None:
        if sqlite:
            # Freed and overwritten cells are zeroed, not left in free pages.
            conn.execute("PRAGMA secure_delete = ON")
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
            "erasure.request",
            f"dataset/{dataset}",
            reason=f"erasure request {request_ref}: one record key erased from lineage",
            details={
                "erasure": erasure,
                "request_ref": request_ref,
                "dataset": dataset,
                "events": len(refs),
                "objects": len(changed),
            },
        ),
        hook=write,
    )
    if sqlite:
        _scrub_sqlite(store)
    return ErasureResult(erasure, tenant, dataset, request_ref, len(refs), len(changed),
                         appended.seq)  # fmt: skip


def _scrub_sqlite(store: Store) -> None:
    """Truncate the write-ahead log, which may still hold page images from before the
    erasure, and turn ``secure_delete`` off again for the writer."""
    with store.write() as conn:
        conn.execute("PRAGMA secure_delete = OFF")
    # A reader's open snapshot can keep frames; a busy checkpoint is retried by SQLite
    # at the next one, and the scrub can be run again (proctor erase is idempotent).
    path = store.url.removeprefix("sqlite:///")
    uri = f"file:{quote(path)}?mode=rw"  # never makes a file: the store's own, or nothing
    with suppress(sqlite3.Error), closing(sqlite3.connect(uri, uri=True, timeout=10)) as db:
        db.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()


def unbacked_erasures(store: Store, tenant: str) -> list[str]:
    """The erased lineage objects of ``tenant`` whose erasure no ``erasure.request``
    event of its log records: an object made unreadable by hand (to hide which rows a
    run read) rather than by an erasure. ``audit verify --tenant`` reports them."""
    with store.read() as conn:
        ids: set[str] = set()
        for (raw,) in conn.iterate(
            "SELECT data FROM ledger_entries WHERE log = ? ORDER BY seq", (tenant,)
        ):
            data = bytes(raw)
            if b'"erasure.request"' not in data:
                continue
            ev = json.loads(data)
            if ev.get("action") == "erasure.request" and ev.get("decision") == "allow":
                ids.add(str((ev.get("details") or {}).get("erasure")))
        problems: list[str] = []
        for digest, raw in conn.query(
            "SELECT digest, data FROM ledger_objects WHERE log = ? ORDER BY digest", (tenant,)
        ):
            data = bytes(raw)
            if not is_erased_object(data):
                continue
            try:
                _, names = erased_entries(data)
            except ValueError as exc:
                problems.append(f"lineage object {digest}: {exc}")
                continue
            unknown = [n for n in names if n not in ids]
            if unknown:
                problems.append(
                    f"lineage object {digest} says erasure {unknown[0]!r} made it; no"
                    " erasure.request event records one"
                )
    return problems
