"""The fast canonical encoder must give exactly rfc8785's bytes, or defer to it."""

from __future__ import annotations

import math

import pytest
import rfc8785
from hypothesis import given
from hypothesis import strategies as st

from proctor.errors import UsageError
from proctor.ledger import canonical_json

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**60), 2**60)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=6), children, max_size=4)
    ),
    max_leaves=20,
)


@given(json_values)
def test_same_bytes_as_rfc8785(value: object) -> None:
    try:
        expected = rfc8785.dumps(value)
    except (rfc8785.CanonicalizationError, ValueError, TypeError, UnicodeError):
        with pytest.raises(UsageError):
            canonical_json(value)
        return
    assert canonical_json(value) == expected


def test_key_order_is_utf16_not_code_points() -> None:
    value = {"\U0001f600": 1, "\ufb01": 2}
    assert canonical_json(value) == rfc8785.dumps(value)


@pytest.mark.parametrize("bad", [math.nan, {"a": math.inf}, {1: "x"}, object()])
def test_unencodable_values_are_refused(bad: object) -> None:
    with pytest.raises(UsageError):
        canonical_json(bad)


@given(json_values)
def test_parse_canonical_agrees_with_rfc8785(value: object) -> None:
    import json

    from proctor.ledger._canonical import parse_canonical

    try:
        canonical = rfc8785.dumps(value)
    except (rfc8785.CanonicalizationError, ValueError, TypeError, UnicodeError):
        return
    parsed, ok = parse_canonical(canonical)
    assert ok
    assert parsed == json.loads(canonical)
    loose = json.dumps(value, indent=1).encode()
    if loose != canonical:
        assert parse_canonical(loose)[1] is False


@pytest.mark.parametrize("text", [b'{"a":1.0}', b'{"b":1,"a":2}', b'{"a":1,"a":1}', b'{"a": 1}'])
def test_non_canonical_spellings_are_noticed(text: bytes) -> None:
    from proctor.ledger._canonical import parse_canonical

    assert parse_canonical(text)[1] is False
