"""The ledger's fast paths for canonical JSON give exactly what the reference does.

``parse_canonical`` leaves integers to C unless the bytes hold a run of 16 digits;
it must still call exactly the bytes canonical that rfc8785 would write, for every
number near the edge of the safe range and every string of digits.
"""

from __future__ import annotations

import json
from contextlib import suppress

import pytest
import rfc8785
from hypothesis import given, settings
from hypothesis import strategies as st

from proctor.errors import UsageError
from proctor.ledger._canonical import canonical_json, parse_canonical

_EDGE = 2**53
numbers = (
    st.integers(-(2**60), 2**60)
    | st.integers(_EDGE - 3, _EDGE + 3)
    | st.integers(-_EDGE - 3, -_EDGE + 3)
    | st.integers(10**15 - 3, 10**15 + 3)
    | st.floats(allow_nan=False, allow_infinity=False)
)
texts = st.text(max_size=8) | st.from_regex(r"\A[0-9a-f]{10,40}\Z")
values = st.recursive(
    st.none() | st.booleans() | numbers | texts,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(texts, children, max_size=4),
    max_leaves=16,
)


def _reference(data: bytes) -> bool:
    """The slow path alone: every number read as a double, written by rfc8785."""
    as_doubles = json.loads(data, parse_int=float)
    try:
        return canonical_json(as_doubles) == data
    except UsageError:
        return False


def _spellings(value: object) -> list[bytes]:
    out = [json.dumps(value, ensure_ascii=False).encode(), json.dumps(value).encode()]
    out.append(
        json.dumps(value, ensure_ascii=False, sort_keys=True, separators=(",", ":")).encode()
    )
    with suppress(rfc8785.CanonicalizationError, ValueError, TypeError, UnicodeError):
        out.append(rfc8785.dumps(value))
    return out


@settings(max_examples=400)
@given(values)
def test_parse_canonical_agrees_with_the_slow_path(value: object) -> None:
    for data in _spellings(value):
        parsed, ok = parse_canonical(data)
        assert ok is _reference(data), data
        assert parsed == json.loads(data)


def test_integers_past_the_safe_range_are_not_canonical() -> None:
    for n in (2**53 + 1, -(2**53) - 1, 10**17 + 1):
        data = b'{"a":' + str(n).encode() + b"}"
        assert parse_canonical(data)[1] is False
        assert _reference(data) is False
    # Inside the range, and a digest full of digits in a string, stay canonical.
    assert parse_canonical(b'{"a":9007199254740991}')[1] is True
    assert parse_canonical(b'{"a":"12345678901234567890"}')[1] is True


def test_subclasses_and_odd_keys_match_rfc8785() -> None:
    from collections import OrderedDict
    from enum import IntEnum, StrEnum

    class Colour(StrEnum):
        RED = "red"

    class Size(IntEnum):
        BIG = 7

    value = {
        "z": OrderedDict([("b", 1), ("a", [Colour.RED, Size.BIG, True, None])]),
        Colour.RED: ("t", 2**53 - 1),
        "\ufb01": 1,
        "é": {"\u00ff": "x"},
    }
    assert canonical_json(value) == rfc8785.dumps(value)
    for bad in ({1: "x"}, {"a": {None: 1}}, {"a": [{2.5: 1}]}):
        with pytest.raises(UsageError):
            canonical_json(bad)


# -- orjson, when installed: the same bytes as the stdlib's encoder and rfc8785 -----

_any_text = st.text(alphabet=st.characters(exclude_categories=("Cs",)), max_size=10)
fast_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**53) + 1, 2**53 - 1) | _any_text,
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(_any_text, children, max_size=4)
    ),
    max_leaves=16,
)


@settings(max_examples=500)
@given(fast_values)
def test_orjson_writes_what_the_stdlib_and_rfc8785_write(value: object) -> None:
    pytest.importorskip("orjson")
    from proctor.ledger import _canonical as c

    if not c._fast_ok(value):
        return  # an astral key: rfc8785 alone
    assert c._dumps is not None
    stdlib = "".join(c._text_encoder(value, 0)).encode("utf-8")
    assert c._dumps(value) == stdlib == rfc8785.dumps(value)


@settings(max_examples=400)
@given(values)
def test_orjson_reading_agrees_with_the_stdlib_reading(value: object) -> None:
    pytest.importorskip("orjson")
    from unittest import mock

    from proctor.ledger import _canonical as c

    for data in _spellings(value):
        with mock.patch.object(c, "_loads", None):
            expected = parse_canonical(data)
        assert parse_canonical(data) == expected


@pytest.mark.parametrize(
    "text",
    [
        b'{"a":1.0}',
        b'{"a":1e2}',
        b'{"a":9007199254740993}',
        b'{"b":1,"a":2}',
        b'{"a":1,"a":1}',
        b' {"a":1}',
        b'{"a":"\\u0041"}',
        b'{"a":"\\/"}',
        b'{"\xf0\x9f\x98\x80":1,"\xef\xac\x81":2}',
        b'{"a":-0}',
    ],
)
def test_orjson_accepts_no_spelling_the_stdlib_refuses(text: bytes) -> None:
    pytest.importorskip("orjson")
    from unittest import mock

    from proctor.ledger import _canonical as c

    with mock.patch.object(c, "_loads", None):
        expected = parse_canonical(text)
    assert parse_canonical(text) == expected
    assert expected[1] is False or text == b'{"\xf0\x9f\x98\x80":1,"\xef\xac\x81":2}'
