"""Lineage objects are held to the signed events that reference them.

An evidence pack carries every lineage object its events name; `verify` checks each
against its event (digest, key count, Merkle root). An operator who alters an
object (to hide that a run read a record, or to frame one), swaps it for another
well-formed one, or drops it, is caught even with the unsigned manifest fixed; and
so is an object altered in the store before the pack was made.
"""

from __future__ import annotations

import json
import re
import sqlite3
import zipfile
from contextlib import closing
from pathlib import Path

import pytest

from proctor.evidence import export_pack, lineage, verify_pack
from proctor.ledger import lineage_keys, lineage_leaf, lineage_object
from proctor.runtime import Runtime
from tests.conftest import copy_home, run_cli
from tests.security.test_evidence_tamper import ALL, fails, rewrite


@pytest.fixture(scope="module")
def pack(demo_home: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, str]:
    base = tmp_path_factory.mktemp("lineage")
    home = copy_home(demo_home, base / "home")
    with Runtime.open(home) as rt:
        export_pack(rt, "acme", *ALL, base / "full.zip")
        vkey = rt.ledger.vkey()
    return home, base / "full.zip", vkey


def _an_object(files: dict[str, bytes]) -> tuple[str, list[str]]:
    """The name of the largest lineage object in the pack, and its keys."""
    name = max((n for n in files if n.startswith("lineage/")), key=lambda n: len(files[n]))
    return name, lineage_keys(files[name])


def test_a_pack_carries_and_verifies_every_referenced_lineage_object(
    pack: tuple[Path, Path, str], tmp_path: Path
) -> None:
    _, full, vkey = pack
    verify_pack(full, vkey)
    with zipfile.ZipFile(full) as zf:
        names = {n for n in zf.namelist() if n.startswith("lineage/")}
        refs = {
            json.loads(e)["details"]["lineage_object"]["digest"]
            for e in zf.read("events/events.jsonl").splitlines()
            if b'"lineage_object"' in e
        }
    assert refs and names == {"lineage/" + d.removeprefix("sha256:") for d in refs}

    # A key removed (hiding that a run read that record): the object no longer hashes
    # to the digest the signed event carries.
    def drop_key(files: dict[str, bytes]) -> None:
        name, keys = _an_object(files)
        files[name] = lineage_object(keys[1:])[0].data

    fails(rewrite(full, tmp_path / "a.zip", drop_key), vkey, "does not hash to its digest")

    # Dropped, manifest and all.
    def drop(files: dict[str, bytes]) -> None:
        del files[_an_object(files)[0]]

    fails(rewrite(full, tmp_path / "b.zip", drop), vkey, "is missing")

    # A byte changed inside, manifest fixed.
    def flip(files: dict[str, bytes]) -> None:
        name, _ = _an_object(files)
        data = bytearray(files[name])
        data[-10] = ord("0") if data[-10] != ord("0") else ord("1")
        files[name] = bytes(data)

    fails(rewrite(full, tmp_path / "c.zip", flip), vkey, "does not hash to its digest")


def test_an_object_altered_in_the_store_is_caught_in_the_pack(
    pack: tuple[Path, Path, str], tmp_path: Path
) -> None:
    home, _, vkey = pack
    altered = copy_home(home, tmp_path / "home")
    with Runtime.open(altered) as rt:
        digest, data = max(
            ((str(r[0]), bytes(r[1])) for r in _objects(rt)), key=lambda x: len(x[1])
        )
        keys = lineage_keys(data)
        # The operator keeps the digest (the event's reference) and drops one key.
        with rt.store.write() as conn:
            conn.execute(
                "UPDATE ledger_objects SET data = ? WHERE log = 'acme' AND digest = ?",
                (lineage_object(keys[1:])[0].data, digest),
            )
        export_pack(rt, "acme", *ALL, tmp_path / "p.zip")
        # Lineage answers from the key index are unaffected; the pack is refused.
        assert lineage(rt, "acme", "crm", "1")["tenant"] == "acme"
    fails(tmp_path / "p.zip", vkey, "does not hash to its digest")


def _objects(rt: Runtime) -> list[tuple[object, ...]]:
    with rt.store.read() as conn:
        return [tuple(r) for r in conn.query("SELECT digest, data FROM ledger_objects")]


# -- one real erasure cannot hide every read (issue 31, item 2) ----------------------
#
# A store writer without the signing key turns every other entry of every lineage
# object into its leaf (count and root still verify), names a real erasure in each,
# and deletes the key index: before erasures committed to their entries, lineage of
# every other key found nothing and `audit verify` and `evidence verify` passed.


def forge_erased(data: bytes, erasure: str) -> bytes | None:
    """A lineage object (plain or erased, format 2) with every entry turned into its
    leaf and ``erasure`` named, as a store writer forges it; None if not one."""
    try:
        doc = json.loads(data)
    except ValueError:
        return None  # a policy text
    if not isinstance(doc, dict) or doc.get("format") not in (
        "proctor-lineage/2", "proctor-lineage-erased/2"):  # fmt: skip
        return None
    keys = [lineage_leaf(e[0], e[1]).hex() if isinstance(e, list) else e for e in doc["keys"]]
    return json.dumps(
        {"erasures": doc.get("erasures", [erasure]), "format": "proctor-lineage-erased/2",
         "keys": keys}, sort_keys=True, separators=(",", ":"),
    ).encode()  # fmt: skip


def forge_store(db: Path, erasure: str) -> int:
    """What the writer does to the SQLite file; returns how many entries it hid."""
    hidden = 0
    with closing(sqlite3.connect(db)) as conn:
        for digest, data in conn.execute("SELECT digest, data FROM ledger_objects").fetchall():
            new = forge_erased(bytes(data), erasure)
            if new is None:
                continue
            hidden += sum(isinstance(e, list) for e in json.loads(data)["keys"])
            conn.execute("UPDATE ledger_objects SET data = ? WHERE digest = ?", (new, digest))
        conn.execute("DELETE FROM ledger_lineage")
        conn.commit()
    return hidden


def _reads(home: Path, key: str) -> list[object]:
    out = run_cli("lineage", "-t", "acme", "--dataset", "crm", "--key", key, "--json", home=home)
    return list(json.loads(out.out)["read"])


@pytest.fixture(scope="module")
def erased(demo_home: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str, str]:
    """A copy of the demo after one real erasure (key 1, read by two runs), by the
    CLI; its pack, and the erasure's id."""
    base = tmp_path_factory.mktemp("erased")
    home = copy_home(demo_home, base / "home")
    done = json.loads(run_cli("erase", "-t", "acme", "--dataset", "crm", "--key", "1",
                              "--request-ref", "DSR-31", "--json", home=home).out)  # fmt: skip
    assert (done["events"], done["objects"]) == (2, 2)
    run_cli("evidence", "export", "-t", "acme", "--from", ALL[0], "--to", ALL[1],
            "-o", str(base / "erased.zip"), home=home)  # fmt: skip
    return home, str(base / "erased.zip"), str(done["erasure"])


def test_one_real_erasure_cannot_hide_every_read(
    erased: tuple[Path, str, str], tmp_path: Path
) -> None:
    template, _, erasure = erased
    home = copy_home(template, tmp_path / "home")
    # The legitimate erasure verifies, and key 2's reads are found.
    run_cli("audit", "verify", "-t", "acme", home=home)
    assert len(_reads(home, "2")) == 2
    assert forge_store(home / "proctor.db", erasure) == 19_998
    # What the attack buys: no read of any key is found any more.
    assert _reads(home, "2") == [] and _reads(home, "777") == []
    res = run_cli("audit", "verify", "-t", "acme", home=home, check=False)
    assert res.code == 3, res.out + res.err
    assert re.search(r"entry \d+ of lineage object sha256:[0-9a-f]{64} is erased, but no erasure "
                     r"the object names lists it", res.err), res.err  # fmt: skip
    pack = tmp_path / "forged.zip"
    run_cli("evidence", "export", "-t", "acme", "--from", ALL[0], "--to", ALL[1],
            "-o", str(pack), home=home)  # fmt: skip
    res = run_cli("evidence", "verify", str(pack), home=home, check=False)
    assert res.code == 3, res.out + res.err
    assert re.search(r"lineage/[0-9a-f]{64}: entry \d+ of lineage object sha256:[0-9a-f]{64} is "
                     r"erased, but no erasure", res.err), res.err  # fmt: skip


def test_the_pack_itself_forged_the_same_way(erased: tuple[Path, str, str], tmp_path: Path) -> None:
    """The same forgery made in the pack (manifest fixed), and the erasure's proof or
    list altered or dropped: each is refused."""
    _, pack, erasure = erased
    good = Path(pack)
    verify_pack(good)

    def forge(files: dict[str, bytes]) -> None:
        for name in [n for n in files if n.startswith("lineage/")]:
            files[name] = forge_erased(files[name], erasure) or files[name]

    fails(rewrite(good, tmp_path / "a.zip", forge), _vkey(good), "no erasure the object names")

    def drop_lists(files: dict[str, bytes]) -> None:
        for name in [n for n in files if n.startswith("erasures/lists/")]:
            del files[name]

    fails(rewrite(good, tmp_path / "b.zip", drop_lists), _vkey(good), "entry list .* is missing")

    def widen_list(files: dict[str, bytes]) -> None:
        # The list made to name every entry of every object: it no longer hashes to
        # the digest the signed event carries.
        forge(files)
        (name,) = [n for n in files if n.startswith("erasures/lists/")]
        doc = json.loads(files[name])
        doc["entries"] = sorted(
            ["sha256:" + n.removeprefix("lineage/"), i]
            for n in files if n.startswith("lineage/")
            for i in range(len(json.loads(files[n])["keys"]))
        )  # fmt: skip
        files[name] = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()

    fails(rewrite(good, tmp_path / "c.zip", widen_list), _vkey(good), "does not hash to its digest")


def test_the_key_index_is_held_to_the_objects(
    erased: tuple[Path, str, str], tmp_path: Path
) -> None:
    """The index alone: a row deleted hides a read from `proctor lineage`, a row added
    frames one; `audit verify` names either (the pack holds no index)."""
    template, _, _ = erased
    home = copy_home(template, tmp_path / "home")
    db = home / "proctor.db"
    with closing(sqlite3.connect(db)) as conn:
        seq, key = conn.execute("SELECT seq, key FROM ledger_lineage ORDER BY seq, key"
                                " LIMIT 1 OFFSET 2500").fetchone()  # fmt: skip
        conn.execute("DELETE FROM ledger_lineage WHERE seq = ? AND key = ?", (seq, key))
        conn.commit()
    res = run_cli("audit", "verify", "-t", "acme", home=home, check=False)
    assert res.code == 3 and f"event seq {seq}: entry " in res.err, res.err
    assert "has no row in the lineage key index" in res.err
    with closing(sqlite3.connect(db)) as conn:
        conn.execute("INSERT INTO ledger_lineage (log, key, seq) VALUES ('acme', ?, ?)",
                     (key, seq))  # fmt: skip
        conn.execute("INSERT INTO ledger_lineage (log, key, seq) VALUES ('acme', ?, ?)",
                     (bytes(16), seq))  # fmt: skip
        conn.commit()
    res = run_cli("audit", "verify", "-t", "acme", home=home, check=False)
    assert res.code == 3 and "for keys its lineage object" in res.err, res.err


def _vkey(pack: Path) -> str:
    with zipfile.ZipFile(pack) as zf:
        return zf.read("verifier.key").decode().strip()


def test_an_erasure_after_the_period_is_proven_against_a_later_checkpoint(
    erased: tuple[Path, str, str], tmp_path: Path
) -> None:
    """A pack of a period before the erasure holds objects erased since: the erasure's
    event comes with its proof against the head checkpoint, consistent with the end
    one. Dropped, or the event altered, the erased objects are unexplained."""
    home = copy_home(erased[0], tmp_path / "home")
    # A second erasure (key 3), so the head is past the end checkpoint.
    run_cli("erase", "-t", "acme", "--dataset", "crm", "--key", "3", "--request-ref", "DSR-32",
            home=home)  # fmt: skip
    with Runtime.open(home) as rt:
        evs = [json.loads(e) for e in rt.ledger.entries("acme")]
        at = next(e for e in evs if e["action"] == "erasure.request")["time"]
        vkey = rt.ledger.vkey()
        export_pack(rt, "acme", ALL[0], at, tmp_path / "before.zip")
    good = tmp_path / "before.zip"
    report = verify_pack(good, vkey)
    assert (report.erasures, report.erasures_uncommitted) == (2, 0)
    with zipfile.ZipFile(good) as zf:
        names = set(zf.namelist())
        period = zf.read("events/events.jsonl")
    assert b'"erasure.request"' not in period
    assert {"erasures/checkpoint.note", "erasures/consistency.json"} <= names

    def drop(files: dict[str, bytes]) -> None:
        for name in [n for n in files if n.startswith("erasures/")]:
            del files[name]

    fails(
        rewrite(good, tmp_path / "a.zip", drop), vkey, "is erased, but no erasure the object names"
    )

    def alter(files: dict[str, bytes]) -> None:
        files["erasures/events.jsonl"] = files["erasures/events.jsonl"].replace(
            b'"DSR-31"', b'"DSR-99"'
        )

    fails(rewrite(good, tmp_path / "b.zip", alter), vkey, "the event or its proof was altered")

    def fork(files: dict[str, bytes]) -> None:
        # The later checkpoint swapped for the end one's sibling: no longer consistent.
        files["erasures/consistency.json"] = files["proofs/range.json"]

    fails(rewrite(good, tmp_path / "c.zip", fork), vkey, "erasures/consistency.json")
