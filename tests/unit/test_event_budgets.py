"""The fixed budgets that keep every event under MAX_EVENT_BYTES, and lineage objects
as pure values: their reference, their check, one key's proof."""

from __future__ import annotations

import pytest

from proctor.errors import UsageError
from proctor.governance import parse_manifest
from proctor.ledger import (
    CUT_MARKER,
    MAX_EVENT_BYTES,
    bound_details,
    canonical_json,
    check_lineage_object,
    clip,
    lineage_keys,
    lineage_leaf,
    lineage_object,
    lineage_proof,
    lineage_salt,
    verify_inclusion,
)


def test_clip_and_bound_details_cut_with_a_marker_and_count_what_was_cut() -> None:
    assert clip("short", 10) == "short"
    cut = clip("x" * 5000, 100)
    assert len(cut) == 100 and cut.endswith(CUT_MARKER)
    small = {"a": "b", "n": 1, "l": [1, 2], "o": {"k": None}}
    assert bound_details(small) == small
    # A value JSON cannot hold is passed on, for canonicalisation to refuse.
    assert bound_details({"b": b"x"}) == {"b": b"x"}
    hostile = {
        "error": "e" * 100_000,
        "resolved": [f"10.0.{i // 256}.{i % 256}" for i in range(5000)],
        "tables": [{"table": "t", "columns": ["c"] * 500, "columns_cut": 1000}],
        "nested": [["y" * 3000] * 100],
    }
    out = bound_details(hostile)
    assert len(canonical_json(out)) < MAX_EVENT_BYTES
    assert out["error"].endswith(CUT_MARKER)
    assert len(out["resolved"]) == 64 and out["resolved_cut"] == 5000 - 64
    # A list its maker already cut keeps counting from there.
    assert out["tables"][0]["columns_cut"] == 1000 + 500 - 64
    assert out["nested"][0][-1] == CUT_MARKER
    with pytest.raises(UsageError, match="nest deeper"):
        deep: dict[str, object] = {}
        for _ in range(20):
            deep = {"d": deep}
        bound_details(deep)


def test_a_lineage_object_names_its_keys_and_proves_one_without_the_others() -> None:
    keys = [f"{i:032x}" for i in range(1000)]
    obj, ref = lineage_object(reversed(keys + keys[:10]))  # any order, duplicates
    assert ref["count"] == 1000 and ref["digest"] == obj.digest
    assert lineage_keys(obj.data) == keys and len(obj.keys) == 1000
    assert check_lineage_object(ref, obj.data) is None
    index, path = lineage_proof(obj.data, keys[617])
    leaf = lineage_leaf(keys[617], lineage_salt(obj.data, keys[617]))
    verify_inclusion(index, 1000, leaf, path, bytes.fromhex(ref["root"]))
    other, other_ref = lineage_object(keys[1:])
    assert "does not hash" in str(check_lineage_object(ref, other.data))
    # A well-formed object whose digest the reference was rewritten to: count and root.
    assert "holds 999 keys" in str(
        check_lineage_object({**ref, "digest": other.digest}, other.data)
    )
    forged = {**other_ref, "count": 1000, "root": ref["root"]}
    assert "holds 999 keys" in str(check_lineage_object(forged, other.data))
    assert "Merkle root" in str(
        check_lineage_object({**other_ref, "root": ref["root"]}, other.data)
    )
    assert "missing" in str(check_lineage_object(ref, None))
    assert "no valid digest" in str(check_lineage_object({"digest": "../x"}, obj.data))
    empty, empty_ref = lineage_object([])
    assert empty_ref["count"] == 0 and check_lineage_object(empty_ref, empty.data) is None
    with pytest.raises(ValueError, match="not a lineage key"):
        lineage_object(["42"])  # a customer id, not its keyed hash


def test_a_manifest_too_large_to_record_is_refused_with_its_size() -> None:
    tables = "\n".join(
        f'[datasets.crm.tables.table_{i:04d}]\ncolumns = ["id", "name", "country"]\naccess = "read"'
        for i in range(200)
    )
    text = f'[artifact]\nname = "big"\nentrypoint = ["python3", "main.py"]\npurpose = "p"\n{tables}'
    with pytest.raises(UsageError, match="as the audit log records them; at most 10240"):
        parse_manifest(text)
    assert parse_manifest(text.split("[datasets", maxsplit=1)[0]).name == "big"
