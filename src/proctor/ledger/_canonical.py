"""RFC 8785 (JCS) canonical JSON.

``rfc8785`` is the reference. For the shapes Proctor's events actually take
(strings, safe integers, booleans, null, lists, objects with keys in the Basic
Multilingual Plane) the standard library's encoder with sorted keys produces the
same bytes about five times faster, and ``orjson`` (when installed) with sorted
keys about five times faster again; property tests hold each equal to rfc8785
over that domain, and anything outside it (floats, large integers, astral-plane
keys) goes to ``rfc8785``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from json import encoder as _json_encoder
from typing import Any

import rfc8785

from proctor.errors import UsageError

_dumps: Callable[[Any], bytes] | None
_strict: Callable[[Any], bytes] | None
_loads: Callable[[bytes], Any] | None
try:
    import orjson
except ImportError:  # pragma: no cover - the stdlib's encoder is exact too, only slower
    _dumps = _loads = _strict = None
else:
    _SORTED = orjson.OPT_SORT_KEYS

    def _dumps(value: Any) -> bytes:
        return orjson.dumps(value, option=_SORTED)

    _loads = orjson.loads
    _STRICT = orjson.OPT_SORT_KEYS | orjson.OPT_STRICT_INTEGER

    def _strict(value: Any) -> bytes:
        return orjson.dumps(value, option=_STRICT)


def _no_floats(value: Any) -> bool:
    """Whether a value orjson read (exact dicts, lists and scalars) holds no float."""
    stack = [value]
    while stack:
        v = stack.pop()
        t = type(v)
        if t is dict:
            stack.extend(v.values())
        elif t is list:
            stack.extend(v)
        elif t is float:
            return False
    return True


_MAX_SAFE = 2**53 - 1
_encode = json.JSONEncoder(
    ensure_ascii=False, sort_keys=True, separators=(",", ":"), allow_nan=False
).encode


_SCALARS = frozenset({str, bool, type(None)})
_KNOWN = _SCALARS | {int, dict, list, tuple}


def _fast_ok(value: Any) -> bool:
    """Whether the fast encoder is exact for ``value``: only JSON's exact types (or
    subclasses encoded as them), integers within 2**53, keys in the BMP."""
    if type(value) is not dict:
        return _walk_ok(value)
    # An event's details, one level deep, inline: most of their values are strings,
    # small integers and lists of strings, checked here without the walk's stack.
    if not _keys_ok(value):
        return False
    for v in value.values():
        t = type(v)
        if t is str or t is bool or v is None:
            continue
        if t is int:
            if -_MAX_SAFE <= v <= _MAX_SAFE:
                continue
            return False
        if t is list:
            for x in v:
                if type(x) is not str and not _walk_ok(x):
                    return False
            continue
        if not _walk_ok(v):
            return False
    return True


def _walk_ok(value: Any) -> bool:
    stack = [value]
    while stack:
        v = stack.pop()
        t: type | None = type(v)
        # Exact types by identity: the common shapes cost a set lookup each.
        if t not in _KNOWN:
            t = _base(v)
            if t is None:
                return False
        if t in _SCALARS:
            continue
        if t is int:
            if -_MAX_SAFE <= v <= _MAX_SAFE:
                continue
            return False
        if t is dict:
            if not _keys_ok(v):
                return False
            stack.extend(v.values())
            continue
        stack.extend(v)  # a list or a tuple
    return True


def _base(v: Any) -> type | None:
    """The JSON type a subclass (a StrEnum, an OrderedDict) is encoded as."""
    for t in (bool, str, int, dict, list, tuple):  # bool before int, its base
        if isinstance(v, t):
            return t
    return None


def _keys_ok(d: dict[Any, Any]) -> bool:
    # JCS orders keys by UTF-16 code units, Python by code points: they differ
    # only once a key leaves the BMP. ``join`` refuses a key that is no string.
    try:
        keys = "".join(d)
    except TypeError:
        return False
    return keys.isascii() or max(keys, default="") <= "\uffff"


def canonical_event(event: dict[str, Any]) -> bytes:
    """``canonical_json`` for a ledger event, checking only its free-form ``details``.

    Every other field was type-checked when its ``EventDraft`` was made, so the
    walk that decides whether the fast encoder is exact covers only ``details``.
    """
    try:
        if _fast_ok(event["details"]):
            return _fast_encode(event)
    except (TypeError, ValueError, UnicodeError) as exc:
        raise UsageError(f"event cannot be encoded as canonical JSON: {exc}") from exc
    return canonical_json(event)


def _fast_encode(value: Any) -> bytes:
    """``value``, inside the fast domain, in its canonical bytes."""
    if _dumps is not None:
        try:
            return _dumps(value)
        except TypeError:
            pass  # a type orjson does not take (a str subclass as a key): the stdlib's
    return "".join(_text_encoder(value, 0)).encode("utf-8")


def canonical_json(value: Any) -> bytes:
    """The RFC 8785 encoding of ``value``; raises UsageError for what JSON cannot hold."""
    try:
        if _fast_ok(value):
            return _fast_encode(value)
        out: bytes = rfc8785.dumps(value)
        return out
    except (TypeError, ValueError, UnicodeError, rfc8785.CanonicalizationError) as exc:
        raise UsageError(f"value cannot be encoded as canonical JSON: {exc}") from exc


class _NotFast(Exception):
    pass


def _no_float(_: str) -> Any:
    raise _NotFast


def _safe_int(text: str) -> int:
    value = int(text)
    if -_MAX_SAFE <= value <= _MAX_SAFE:
        return value
    raise _NotFast


_fast_decoder = json.JSONDecoder(parse_float=_no_float, parse_int=_safe_int)
# Integers left to C: only one of 16 digits or more can be past the safe range,
# and a value holding such a run of digits (rare: a hex digest's) takes the
# decoder above, which checks each integer in Python.
_plain_decoder = json.JSONDecoder(parse_float=_no_float)
# A 4-byte UTF-8 sequence: a character outside the BMP, where key orders differ.
_ASTRAL = re.compile(rb"[\xf0-\xf4]")
# Every digit made "0", everything else " ": a run of 16 digits (perhaps an integer
# past 2**53) is then a plain substring search, several times faster than a regex.
_DIGITS = bytes(48 if 48 <= c <= 57 else 32 for c in range(256))
_LONG_RUN = b"0" * 16


def _make_text_encoder() -> Any:
    # The C encoder, made once: ``JSONEncoder.encode`` makes one per call, with a
    # cycle check that neither a decoded value nor one ``_fast_ok`` walked to its
    # end needs. Same arguments as ``_encode``'s.
    make = getattr(_json_encoder, "c_make_encoder", None)
    if make is None:  # pragma: no cover - CPython always has it
        return lambda value, _: [_encode(value)]
    basestring = _json_encoder.encode_basestring
    return make(None, None, basestring, None, ":", ",", True, False, False)


_text_encoder = _make_text_encoder()


def _plainly_canonical(data: bytes) -> tuple[Any] | None:
    """orjson's reading of ``data`` when orjson writes it back byte for byte and it
    is inside the fast domain; None for anything else (not JSON to orjson, a float,
    an integer past 2**53, an astral key, bytes that differ), which
    ``parse_canonical`` then judges exactly as without orjson, errors included."""
    if _loads is None or _dumps is None or _strict is None:
        return None
    try:
        value = _loads(data)
        # ASCII bytes hold no astral key, and ``_strict`` refuses an integer past
        # 2**53: only floats are left to look for.
        if data.isascii():
            if _no_floats(value) and _strict(value) == data:
                return (value,)
        elif _fast_ok(value) and _dumps(value) == data:
            return (value,)
    except (TypeError, ValueError):
        pass
    return None


def parse_canonical(data: bytes) -> tuple[Any, bool]:
    """Parse JSON bytes; also say whether they are exactly their RFC 8785 form.

    Decoding with number hooks tells, at C speed, whether the value is inside
    the fast encoder's exact domain, so verification need not walk every event.
    Raises ``ValueError`` (or ``UnicodeDecodeError``) for bytes that are not JSON.
    """
    accepted = _plainly_canonical(data)
    if accepted is not None:
        return accepted[0], True
    if data.isascii() or _ASTRAL.search(data) is None:
        decoder = _fast_decoder if _LONG_RUN in data.translate(_DIGITS) else _plain_decoder
        text = data.decode("utf-8")
        try:
            try:
                # No whitespace may come before or after canonical JSON; when some
                # does, ``decode`` reads it (or refuses what follows) as it always has.
                value, end = decoder.raw_decode(text)
            except ValueError:
                value, end = decoder.decode(text), -1
            if end != len(text):
                value, end = decoder.decode(text), -1
        except _NotFast:
            pass
        else:
            # Compared as text (``text`` is ``data`` strictly decoded: equal text is
            # equal bytes); only an output unequal is encoded, which raises for a
            # lone surrogate, as encoding every output did.
            out = "".join(_text_encoder(value, 0))
            if end >= 0 and out == text:
                return value, True
            out.encode("utf-8")
            return value, False
    value = json.loads(data)
    # JCS numbers are IEEE doubles: compare the float reading of every number.
    as_doubles = json.loads(data, parse_int=float)
    try:
        return value, canonical_json(as_doubles) == data
    except UsageError:
        return value, False
