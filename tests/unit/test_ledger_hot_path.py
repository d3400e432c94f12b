"""The ledger writer's shortcuts give the same bytes as the general code they skip.

A checkpoint is signed once for both of its names (its origin's and the runtime's:
one Ed25519 key, deterministic signatures over the same text); the walk that decides
whether orjson is exact for an event's details checks their first level inline; the
writer's inline tree push fills the same tiles as ``CompactRange.push``.
"""

from __future__ import annotations

import base64

import pytest
import rfc8785
from hypothesis import given
from hypothesis import strategies as st

from proctor.errors import UsageError
from proctor.ledger import Checkpoint, Signer, canonical_json, open_checkpoint
from proctor.ledger._canonical import canonical_event
from proctor.ledger._ledger import _LogState
from proctor.ledger._merkle import CompactRange, leaf_hash
from proctor.ledger._note import _EM_DASH
from proctor.ledger._tiles import TILE_WIDTH


def test_a_note_signed_under_two_names_of_one_key_is_what_two_signings_give() -> None:
    runtime = Signer.generate("proctor.local")
    origin = runtime.named("proctor.local/tenant/acme")
    body = Checkpoint("proctor.local/tenant/acme", 7, b"\x01" * 32).body()
    note = origin.sign_note(body, runtime)
    # Each line as a separate signing makes it (what sign_note did before).
    expected = "".join(
        f"{_EM_DASH} {s.name} "
        + base64.b64encode(s.verifier.key_id + s._key.sign(body.encode())).decode()
        + "\n"
        for s in (origin, runtime)
    )
    assert note == f"{body}\n{expected}"
    for s in (origin, runtime):
        assert open_checkpoint(note, s.verifier, "proctor.local/tenant/acme").size == 7


def test_a_note_signed_by_another_key_too_carries_that_keys_own_signature() -> None:
    first, other = Signer.generate("a.local"), Signer.generate("b.local")
    body = Checkpoint("a.local/system", 1, b"\x02" * 32).body()
    note = first.sign_note(body, other)
    for s in (first, other):
        assert open_checkpoint(note, s.verifier, "a.local/system").size == 1


_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**60), max_value=2**60)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=4)
    | st.text(alphabet=st.characters(min_codepoint=0x10000), max_size=2)
)
_details = st.dictionaries(
    st.text(max_size=4) | st.text(alphabet=st.characters(min_codepoint=0x10000), max_size=2),
    st.recursive(
        _scalars,
        lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=3), c, max_size=3),
        max_leaves=6,
    ),
    max_size=5,
)


@given(_details)
def test_an_events_details_encode_as_rfc8785_whatever_their_first_level_holds(
    details: dict[str, object],
) -> None:
    event = {"action": "test.event", "details": details, "seq": 1}
    for ours, value in ((canonical_event, event), (canonical_json, details)):
        try:
            expected = rfc8785.dumps(value)
        except rfc8785.CanonicalizationError:
            # Past the integers JSON holds exactly: refused by both, one clear error.
            with pytest.raises(UsageError, match="cannot be encoded as canonical JSON"):
                ours(value)
        else:
            assert ours(value) == expected


def test_the_writers_push_fills_the_tiles_compact_range_fills() -> None:
    # Past one full level-1 tile (256 * 256 leaves): every tile level the writer fills.
    n = TILE_WIDTH * TILE_WIDTH + 300
    state = _LogState("acme", "o", "", CompactRange())
    expected: dict[tuple[int, int], bytearray] = {}
    ref = CompactRange()

    counts: dict[int, int] = {}

    def on_node(height: int, h: bytes) -> None:
        if height % 8 == 0:
            level = height // 8
            k = counts.get(level, 0)
            counts[level] = k + 1
            expected.setdefault((level, k // TILE_WIDTH), bytearray()).extend(h)

    for i in range(n):
        leaf = leaf_hash(i.to_bytes(4, "big"))
        state.push(leaf)
        ref.push(leaf, on_node)
        idx0 = i // TILE_WIDTH
        expected.setdefault((0, idx0), bytearray()).extend(leaf)
    assert state.tree.size == ref.size == n
    assert state.tree.root() == ref.root()
    assert {k: bytes(v) for k, v in state.dirty.items()} == {
        k: bytes(v) for k, v in expected.items()
    }
