"""Lineage objects are held to the signed events that reference them.

An evidence pack carries every lineage object its events name; `verify` checks each
against its event (digest, key count, Merkle root). An operator who alters an
object (to hide that a run read a record, or to frame one), swaps it for another
well-formed one, or drops it, is caught even with the unsigned manifest fixed; and
so is an object altered in the store before the pack was made.
"""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import pytest

from proctor.evidence import export_pack, lineage, verify_pack
from proctor.ledger import lineage_keys, lineage_object
from proctor.runtime import Runtime
from tests.conftest import copy_home
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
