"""An event's head (its canonical bytes up to ``seq``'s value, made in the
appending thread) and tail (what follows, made once per log and time in a batch)
put together are the bytes the general encoder gives, whatever the draft, seq,
tenant and time; a draft that cannot be encoded has no head and fails later as
before."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from proctor.errors import UsageError
from proctor.ledger import Actor, EventDraft
from proctor.ledger._canonical import canonical_event
from proctor.ledger._ledger import _TAIL_KEYS, _event_head, _event_tail

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
_text = st.text(max_size=6) | st.sampled_from(['"', "\\", '","seq":1,"tenant":"x', "\U0001f600"])
_maybe = st.none() | _text


@st.composite
def _drafts(draw: st.DrawFn) -> EventDraft:
    return EventDraft(
        Actor(draw(st.sampled_from(["operator", "workload"])), draw(_text.filter(bool))),
        draw(st.sampled_from(["sql.select", "test.event", "run.start"])),
        draw(_text),
        decision=draw(st.sampled_from(["allow", "deny"])),
        policies=tuple(draw(st.lists(_text, max_size=2))),
        reason=draw(_text),
        deployment=draw(_maybe),
        run=draw(_maybe),
        artifact=draw(_maybe),
        approvals=tuple(draw(st.lists(_text, max_size=2))),
        details=draw(_details),
    )


def test_the_keys_the_ledger_sets_sort_after_every_key_a_draft_gives() -> None:
    draft = EventDraft(Actor("operator", "o"), "test.event", "r")
    keys = sorted(draft.to_event(0, "", ""))
    assert tuple(keys[-len(_TAIL_KEYS) :]) == _TAIL_KEYS


# A seq holds JSON's exact integers (no log reaches 2**53 events).
@given(_drafts(), st.integers(min_value=0, max_value=2**53 - 1), _text, _text)
def test_head_seq_and_tail_are_the_general_encoders_bytes(
    draft: EventDraft, seq: int, tenant: str, time: str
) -> None:
    try:
        expected = canonical_event(draft.to_event(seq, time, tenant))
    except UsageError:
        assert _event_head(draft) is None
        return
    head = _event_head(draft)
    assert head is not None
    assert head + b"%d" % seq + _event_tail(tenant, time) == expected


def test_a_draft_that_cannot_be_encoded_has_no_head() -> None:
    draft = EventDraft(Actor("operator", "o"), "test.event", "r", details={"n": 2**64})
    assert _event_head(draft) is None
    with pytest.raises(UsageError):
        canonical_event(draft.to_event(1, "t", "acme"))
