"""An event's OCSF line keeps its bytes.

A pack's verifier regenerates every OCSF line from the signed event and compares
bytes (``evidence/_verify.py``), so a pack exported by an earlier Proctor fails to
verify if the mapping's output moves by one byte. ``tests/data/ocsf_golden.jsonl``
holds events and the lines the mapping wrote for them before ``ocsf_line`` was
split into per-action mappers (issue 32): the demo's events, and generated ones
that reach every branch (each class, refusals and default denies, failed
outcomes, IP and name endpoints, pruned markers, odd detail types).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from proctor.evidence._ocsf import ocsf_line

GOLDEN = Path(__file__).parent.parent / "data" / "ocsf_golden.jsonl"
ROWS: list[dict[str, Any]] = [json.loads(line) for line in GOLDEN.read_text().splitlines()]


def test_the_golden_lines_cover_every_class_and_both_decisions() -> None:
    lines = [json.loads(row["line"]) for row in ROWS]
    assert {o["class_uid"] for o in lines} == {4001, 4002, 6003, 6005}
    assert {o["action"] for o in lines} == {"Allowed", "Denied"}
    assert any("src_endpoint" not in o for o in lines)
    assert any(o.get("unmapped", {}).get("pruned") for o in lines)


@pytest.mark.parametrize(
    "row", ROWS, ids=[f"{r['event']['seq']}-{r['event']['action']}" for r in ROWS]
)
def test_an_events_line_is_byte_for_byte_what_it_was(row: dict[str, Any]) -> None:
    assert ocsf_line(row["event"], "proctor.test/tenant/acme").decode() == row["line"]
