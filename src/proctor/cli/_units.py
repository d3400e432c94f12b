"""Human units on the command line: sizes (256M) and durations (30s, 30d)."""

from __future__ import annotations

import re

from proctor.errors import UsageError

_SIZE_RE = re.compile(r"^(\d+(?:\.\d+)?)\s*([KMGT]?)(i?B)?$", re.IGNORECASE)
_DURATION_RE = re.compile(r"^(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)?$")
_SIZE_UNITS = {"": 1, "K": 1024, "M": 1024**2, "G": 1024**3, "T": 1024**4}
_TIME_UNITS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, None: 1}


def parse_size(text: str, flag: str) -> int:
    m = _SIZE_RE.match(text.strip())
    if not m:
        raise UsageError(f"{flag}: {text!r} is not a size (examples: 256M, 1G, 65536)")
    return int(float(m.group(1)) * _SIZE_UNITS[m.group(2).upper()])


def parse_duration(text: str, flag: str) -> float:
    m = _DURATION_RE.match(text.strip())
    if not m:
        raise UsageError(f"{flag}: {text!r} is not a duration (examples: 30s, 5m, 1h, 30d, 500ms)")
    return float(m.group(1)) * _TIME_UNITS[m.group(2)]
