"""Verify holds every node at a tile level to the stored tree as it recomputes it,
level 0 (each leaf) and above (a node of 256 leaves, of 65,536, ...): a stored hash
changed at any level is named, though every event and checkpoint is intact."""

from __future__ import annotations

import pytest

from proctor.errors import VerificationFailed
from tests.conftest import LedgerEnv, draft


@pytest.mark.parametrize("level", [0, 1])
def test_a_changed_hash_in_a_stored_tile_of_any_level_fails_verify(
    ledger_env: LedgerEnv, level: int
) -> None:
    ledger = ledger_env.ledger
    ledger.create_log("acme", draft(0))
    ledger.append_many("acme", [draft(i) for i in range(1, 2 * 256 + 10)])
    assert ledger.verify("acme").size == 2 * 256 + 10
    with ledger_env.store.read() as conn:
        row = conn.query_one(
            "SELECT hashes FROM ledger_tiles WHERE log = 'acme' AND level = ? AND idx = 0",
            (level,),
        )
    assert row is not None
    hashes = bytearray(row[0])
    hashes[32] ^= 1  # the second node of the tile: leaf 1, or the node of leaves 256-511
    with ledger_env.store.write() as conn:
        conn.execute(
            "UPDATE ledger_tiles SET hashes = ? WHERE log = 'acme' AND level = ? AND idx = 0",
            (bytes(hashes), level),
        )
    seq = 1 if level == 0 else 511
    with pytest.raises(
        VerificationFailed, match=rf"event seq {seq}: its hash does not match the stored tree"
    ):
        ledger.verify("acme")
