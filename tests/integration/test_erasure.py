"""Erasure of one data subject's record key from the lineage record (issue 20).

After ``erase_key``, the key's index rows and its keyed hash are gone from the
store (the SQLite file and its write-ahead log are grepped for the hash, in hex and
raw), lineage for the key finds nothing, every changed object still verifies
against its signed event's count and Merkle root, the log still verifies, and every
other key's lineage (and the same key in another dataset) is unchanged. On SQLite
and PostgreSQL.

The attack: whoever holds the tenant's lineage key and a candidate record key
computes every value derivable from them (the keyed hash, its unsalted leaf, and its
leaf under every salt left in the store) and finds none of them anywhere, nor as an
entry of any object. A format-1 object (unsalted, written before salts) still
verifies, and its erasure works as before.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from pathlib import Path

import pytest

from proctor.errors import UsageError
from proctor.governance import erase_key, record_key_hmac, unbacked_erasures
from proctor.governance._erasure import check_lineage_record
from proctor.ledger import (
    Actor,
    EventDraft,
    check_erased_object,
    check_lineage_object,
    erase_from_object,
    erased_entries,
    is_erased_object,
    lineage_keys,
    lineage_leaf,
    lineage_object,
    lineage_seqs,
    read_objects,
)
from tests.conftest import LedgerEnv

T = "acme"
OP = Actor("operator", "root")
LKEY = b"\x07" * 32


def _h(key: str) -> str:
    return record_key_hmac(LKEY, key)


def _salts(objects: Iterable[bytes]) -> set[str]:
    """Every salt the objects still hold (kept [key, salt] pairs, plain or erased)."""
    salts: set[str] = set()
    for data in objects:
        doc = json.loads(data)
        for entry in doc.get("keys", []):
            if isinstance(entry, list):
                salts.add(entry[1])
    return salts


def derivable(key_hash: str, objects: Iterable[bytes]) -> list[bytes]:
    """What an attacker holding the lineage key computes from a candidate record key:
    its keyed hash, the hash's unsalted leaf, and its leaf under every salt left in
    ``objects``; each as hex and as raw bytes."""
    values = [bytes.fromhex(key_hash), lineage_leaf(key_hash)]
    values += [lineage_leaf(key_hash, salt) for salt in sorted(_salts(objects))]
    return [v for raw in values for v in (raw, raw.hex().encode())]


def _entries_of(data: bytes) -> set[str]:
    if b'"format":"proctor-erasure/' in data:
        return set()  # an erasure's list of the entries it erased: no key
    if is_erased_object(data):
        return {e if isinstance(e, str) else e[0] for e in erased_entries(data)[0]}
    return set(lineage_keys(data))


def _store_bytes(env: LedgerEnv) -> bytes:
    """The store's bytes where its engine zeroes what it deletes (its files, WAL
    included); elsewhere only the rows, which is all such an engine promises."""
    if not env.store.capabilities.secure_delete:
        with env.store.read() as conn:
            objs = b"".join(bytes(r[0]) for r in conn.query("SELECT data FROM ledger_objects"))
            keys = b"".join(bytes(r[0]) for r in conn.query("SELECT key FROM ledger_lineage"))
        return objs + keys
    path = Path(env.url)
    return b"".join(p.read_bytes() for p in path.parent.glob(path.name + "*"))


def test_an_erased_key_is_gone_and_everything_else_still_verifies(
    ledger_env: LedgerEnv, tmp_path: Path
) -> None:
    env, ledger = ledger_env, ledger_env.ledger
    with env.store.write() as conn:
        conn.execute("INSERT INTO tenants (name, created_at, created_by) VALUES (?, 'now', 'root')",
                     (T,))  # fmt: skip
    ledger.create_log(T, EventDraft(OP, "tenant.create", f"tenant/{T}"))
    reads = {"a": ("crm", range(1, 21)), "b": ("crm", range(10, 31)),
             "c": ("orders", range(12, 16)), "d": ("crm", range(40, 51)),
             "old": ("crm", range(60, 66))}  # fmt: skip
    seqs: dict[str, int] = {}
    for name, (dataset, keys) in reads.items():
        # "old" is a read logged before per-entry salts (format 1).
        obj, ref = lineage_object((_h(str(k)) for k in keys), salted=name != "old")
        draft = EventDraft(Actor("workload", f"run-{name}"), "sql.select", "table/t",
                           run=f"run-{name}", objects=(obj,),
                           details={"dataset": dataset, "lineage_object": ref})  # fmt: skip
        seqs[name] = ledger.append(T, draft).seq
    before = {k: lineage_seqs(env.store, T, _h(str(k))) for k in range(1, 66)}
    assert before[10] == {seqs["a"], seqs["b"]} and before[12] == {seqs["a"], seqs["b"], seqs["c"]}
    erased = _h("10")
    assert erased.encode() in _store_bytes(env) or not env.store.capabilities.secure_delete

    # Bad input changes nothing: a request reference that looks like a person.
    size = ledger.head(T).size
    with pytest.raises(UsageError, match="request reference"):
        erase_key(env.store, ledger, T, "crm", erased, "Jane Doe <jane@example.com>", OP)
    assert ledger.head(T).size == size and lineage_seqs(env.store, T, erased) == before[10]

    result = erase_key(env.store, ledger, T, "crm", erased, "DSR-2026-0042", OP)
    assert (result.events, result.objects) == (2, 2)
    erase_key(env.store, ledger, T, "crm", _h("12"), "DSR-2026-0043", OP)
    assert erase_key(env.store, ledger, T, "crm", _h("62"), "DSR-2026-0044", OP).objects == 1

    # Lineage for the erased key finds nothing; for 12 only the other dataset's read.
    assert lineage_seqs(env.store, T, erased) == set()
    assert lineage_seqs(env.store, T, _h("12")) == {seqs["c"]}
    assert lineage_seqs(env.store, T, _h("62")) == set()
    for k in range(1, 66):
        if k not in (10, 12, 62):
            assert lineage_seqs(env.store, T, _h(str(k))) == before[k], k
    # The hash is nowhere in the store, hex or raw (SQLite: the file and its WAL).
    blob = _store_bytes(env)
    assert erased.encode() not in blob and bytes.fromhex(erased) not in blob
    # Nor anything the holder of the lineage key computes from the erased key: its
    # unsalted leaf, or its leaf under any salt still stored (SQLite: file and WAL).
    with env.store.read() as conn:
        stored = [bytes(r[0]) for r in conn.query("SELECT data FROM ledger_objects")]
    assert len(_salts(stored)) > 50
    attack = derivable(erased, stored)
    for value in attack:
        assert value not in blob
    hexes = {v.decode() for v in attack[1::2]}  # (raw, hex) pairs
    for data in stored:
        assert not _entries_of(data) & hexes
    # Each object still verifies against its signed event; the erasure event names
    # the request, not the key or its hash.
    events = {json.loads(d)["seq"]: json.loads(d) for d in ledger.entries(T)}
    refs = {s: events[s]["details"]["lineage_object"] for s in seqs.values()}
    objects = read_objects(env.store, T, [r["digest"] for r in refs.values()])
    for name, s in seqs.items():
        data = objects[refs[s]["digest"]]
        assert check_lineage_object(refs[s], data) is None
        assert is_erased_object(data) == (name in ("a", "b", "old"))
    # The format-1 object erased as before: only as unlinkable as it ever was (its
    # unsalted leaf is still recomputable from the key by the lineage key's holder).
    old = objects[refs[seqs["old"]]["digest"]]
    assert b"proctor-lineage-erased/1" in old and lineage_leaf(_h("62")).hex().encode() in old
    assert _h("61") in _entries_of(old) and _h("62") not in _entries_of(old)
    erasure = [e for e in events.values() if e["action"] == "erasure.request"]
    assert [e["details"]["request_ref"] for e in erasure] == [
        "DSR-2026-0042", "DSR-2026-0043", "DSR-2026-0044"]  # fmt: skip
    assert erased not in json.dumps(erasure)
    assert ledger.verify(T).size == ledger.head(T).size
    out = tmp_path / "export"
    ledger.export(T, out)
    exported = b"".join(p.read_bytes() for p in out.rglob("*") if p.is_file())
    for value in attack:
        assert value not in exported

    # An erased object altered (a leaf hash changed, or an erasure no event records) fails.
    ref_a, data_a = refs[seqs["a"]], objects[refs[seqs["a"]]["digest"]]
    doc = json.loads(data_a)
    doc["keys"][0] = "0" * 64
    forged = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
    assert "Merkle root" in str(check_lineage_object(ref_a, forged))
    ids = [e["details"]["erasure"] for e in erasure]
    assert check_erased_object(ref_a, data_a, ids) is None
    assert "no erasure event" in str(check_erased_object(ref_a, data_a, ids[1:]))
    # Someone with the store but no erasure request hides key 45 of read d by hand:
    # the object still verifies against its event, but no erasure.request names it.
    assert unbacked_erasures(env.store, T) == []
    ref_d = refs[seqs["d"]]
    hidden = erase_from_object(objects[ref_d["digest"]], _h("45"), "erasure-forged")
    assert hidden is not None and check_lineage_object(ref_d, hidden) is None
    with env.store.write() as conn:
        conn.execute("UPDATE ledger_objects SET data = ? WHERE log = ? AND digest = ?",
                     (hidden, T, ref_d["digest"]))  # fmt: skip
    assert any("erasure-forged" in p for p in unbacked_erasures(env.store, T))


# -- an erasure commits to exactly the entries it erased (issue 31, item 2) ----------


def _tenant_with_reads(env: LedgerEnv, reads: dict[str, tuple[str, range]]) -> dict[str, int]:
    with env.store.write() as conn:
        conn.execute("INSERT INTO tenants (name, created_at, created_by) VALUES (?, 'now', 'root')",
                     (T,))  # fmt: skip
    env.ledger.create_log(T, EventDraft(OP, "tenant.create", f"tenant/{T}"))
    return {name: _read(env, name, dataset, keys) for name, (dataset, keys) in reads.items()}


def _read(env: LedgerEnv, name: str, dataset: str, keys: Iterable[int]) -> int:
    obj, ref = lineage_object(_h(str(k)) for k in keys)
    draft = EventDraft(Actor("workload", f"run-{name}"), "sql.select", "table/t",
                       run=f"run-{name}", objects=(obj,),
                       details={"dataset": dataset, "lineage_object": ref})  # fmt: skip
    return env.ledger.append(T, draft).seq


def _objects_by_seq(env: LedgerEnv) -> dict[int, tuple[str, bytes]]:
    events = [json.loads(d) for d in env.ledger.entries(T)]
    refs = {e["seq"]: e["details"]["lineage_object"]["digest"] for e in events
            if "lineage_object" in (e.get("details") or {})}  # fmt: skip
    stored = read_objects(env.store, T, refs.values())
    return {seq: (d, stored[d]) for seq, d in refs.items()}


def _put(env: LedgerEnv, digest: str, data: bytes) -> None:
    with env.store.write() as conn:
        conn.execute("UPDATE ledger_objects SET data = ? WHERE log = ? AND digest = ?",
                     (data, T, digest))  # fmt: skip


def test_one_real_erasure_cannot_hide_the_other_reads(ledger_env: LedgerEnv) -> None:
    """The attack of issue 31 against the library, on SQLite and PostgreSQL: every
    other entry turned into its leaf naming one real erasure, the index deleted."""
    from tests.security.test_lineage_tamper import forge_erased

    env = ledger_env
    reads = {f"r{i}": ("crm", range(i * 40, i * 40 + 60)) for i in range(10)}
    reads["o"] = ("orders", range(0, 30))
    _tenant_with_reads(env, reads)
    done = erase_key(env.store, env.ledger, T, "crm", _h("45"), "DSR-31", OP)
    assert done.objects == 2
    clean = check_lineage_record(env.store, T)
    assert clean.problems == [] and clean.erasures == 1 and clean.uncommitted == 0
    assert clean.objects == 11 and clean.index_rows == 10 * 60 + 30 - 2
    # The store writer, without the signing key.
    objects = _objects_by_seq(env)
    for digest, data in objects.values():
        forged = forge_erased(data, done.erasure)
        assert forged is not None
        _put(env, digest, forged)
    with env.store.write() as conn:
        conn.execute("DELETE FROM ledger_lineage WHERE log = ?", (T,))
    assert lineage_seqs(env.store, T, _h("100")) == set()  # what it hides
    problems = unbacked_erasures(env.store, T)
    # Every object is named, by an entry its erasure does not list.
    for digest, _ in objects.values():
        assert any(re.match(rf"entry \d+ of lineage object {digest} is erased, but no erasure", p)
                   for p in problems), digest  # fmt: skip
    assert any("erased dataset 'crm'" in p for p in problems)  # the orders read


def test_many_keys_erased_still_verify_and_a_restored_entry_is_named(
    ledger_env: LedgerEnv,
) -> None:
    env = ledger_env
    reads = {f"r{i}": ("crm", range(i * 10, i * 10 + 25)) for i in range(8)}
    reads["o"] = ("orders", range(0, 40))
    seqs = _tenant_with_reads(env, reads)
    before = _objects_by_seq(env)
    for k in range(5, 95, 4):
        erase_key(env.store, env.ledger, T, "crm", _h(str(k)), f"DSR-{k}", OP)
    erase_key(env.store, env.ledger, T, "orders", _h("7"), "DSR-o7", OP)
    check = check_lineage_record(env.store, T)
    assert check.problems == [] and (check.erasures, check.uncommitted) == (24, 0)
    assert env.ledger.verify(T).size == env.ledger.head(T).size
    # Each erasure event commits to its list: the count and digest of the pairs.
    events = [json.loads(d) for d in env.ledger.entries(T)]
    lists = [e["details"]["entries"] for e in events if e["action"] == "erasure.request"]
    assert sum(x["count"] for x in lists) == check_total_leaves(env)
    # A copy of an object from before its erasure put back: the erased key is in the
    # store again, and the erasure that listed it says so.
    digest, original = before[seqs["r1"]]
    _put(env, digest, original)
    problems = unbacked_erasures(env.store, T)
    assert any(f"of lineage object {digest}: erasure" in p and "holds its key again" in p
               for p in problems), problems  # fmt: skip


def check_total_leaves(env: LedgerEnv) -> int:
    total = 0
    for _, data in _objects_by_seq(env).values():
        if is_erased_object(data):
            total += sum(isinstance(e, str) and len(e) == 64 for e in erased_entries(data)[0])
    return total


def _old_erasure(env: LedgerEnv, dataset: str, key_hash: str, erasure: str) -> None:
    """An erasure as Proctor recorded it before erasures listed their entries: the
    objects rewritten, the index rows deleted, an event with counts only."""
    changed = 0
    datasets = {
        e["seq"]: e["details"].get("dataset") for e in map(json.loads, env.ledger.entries(T))
    }
    for seq, (digest, data) in _objects_by_seq(env).items():
        new = erase_from_object(data, key_hash, erasure) if datasets[seq] == dataset else None
        if new is None:
            continue
        changed += 1
        _put(env, digest, new)
        with env.store.write() as conn:
            conn.execute("DELETE FROM ledger_lineage WHERE log = ? AND key = ? AND seq = ?",
                         (T, bytes.fromhex(key_hash), seq))  # fmt: skip
    env.ledger.append(T, EventDraft(OP, "erasure.request", f"dataset/{dataset}", details={
        "erasure": erasure, "request_ref": "DSR-old", "dataset": dataset,
        "events": changed, "objects": changed}))  # fmt: skip


def test_an_erasure_recorded_before_the_lists_is_held_to_what_it_could_erase(
    ledger_env: LedgerEnv,
) -> None:
    env = ledger_env
    seqs = _tenant_with_reads(env, {"a": ("crm", range(1, 21)), "b": ("crm", range(10, 31)),
                                    "c": ("orders", range(10, 16))})  # fmt: skip
    _old_erasure(env, "crm", _h("10"), "erasure-old")
    check = check_lineage_record(env.store, T)
    assert check.problems == [] and (check.erasures, check.uncommitted) == (1, 1)
    objects = _objects_by_seq(env)

    def hide(seq: int, key: str) -> None:
        digest, data = _objects_by_seq(env)[seq]
        forged = erase_from_object(data, _h(key), "erasure-old")
        assert forged is not None
        # Name the old erasure once, as a forger would.
        doc = json.loads(forged)
        doc["erasures"] = ["erasure-old"]
        _put(env, digest, json.dumps(doc, sort_keys=True, separators=(",", ":")).encode())

    def restore() -> None:
        for digest, data in objects.values():
            _put(env, digest, data)

    # A second entry of an object it erased: it erased one key, so one entry.
    hide(seqs["a"], "11")
    assert any("is erased, but no erasure the object names lists it" in p
               for p in unbacked_erasures(env.store, T))  # fmt: skip
    restore()
    # An object of another dataset: its dataset, and one object more than it changed.
    hide(seqs["c"], "12")
    problems = unbacked_erasures(env.store, T)
    assert any("which erased dataset 'crm'" in p for p in problems), problems
    assert any("3 lineage objects name erasure 'erasure-old'" in p for p in problems), problems
    restore()
    # A read recorded after it.
    late = _read(env, "late", "crm", range(10, 14))
    hide(late, "12")
    assert any("recorded before it" in p for p in unbacked_erasures(env.store, T))
