"""Times people type on the command line: an ISO 8601 date or time, or one relative
to now. Shared by every option that takes a moment (``runs list --since``, and any
``--since``/``--until`` that wants the relative forms).

The forms, all read as UTC:

============================  ==================================================
``now``                       this instant
``today``, ``yesterday``      midnight (00:00 UTC) at the start of that day
``90s``, ``30m``, ``1h``,     that long before now (s, m, h, d, w; a decimal
``2d``, ``1w``, ``1.5h``      count is allowed); ``2h ago`` reads the same
``2026-12-01``                midnight UTC at the start of that date
``2026-12-01T09:00:00Z``      that time; one without an offset is taken as UTC
============================  ==================================================

What comes back is the ledger's fixed-width UTC string
(``2026-12-01T09:00:00.000000Z``), which orders as text: it compares directly with
a run's ``started_at`` or an event's ``time``. Bad input is one
:class:`~proctor.errors.UsageError` naming the option and giving examples.

Usage::

    from proctor.cli._when import parse_when
    since = parse_when(text, "--since")          # or None when text is None
"""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta

from proctor.errors import UsageError

__all__ = ["EXAMPLES", "parse_when", "when_datetime"]

#: For help texts and errors.
EXAMPLES = "30m, 1h, 2d, 1w, yesterday, today, 2026-12-01, 2026-12-01T09:00:00Z"

_RELATIVE = re.compile(r"^(\d+(?:\.\d+)?)\s*(s|m|h|d|w)(?:\s+ago)?$")
_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
#: Past this a relative time means nothing anyone keeps (and datetime would overflow).
_MAX_SECONDS = 100 * 365 * 86400


def when_datetime(text: str, flag: str, *, now: datetime | None = None) -> datetime:
    """``text`` as an aware UTC datetime; ``now`` (aware) is for tests and for several
    options of one command that should share one "now"."""
    now = (now or datetime.now(UTC)).astimezone(UTC)
    value = text.strip().lower()
    if value == "now":
        return now
    midnight = now.replace(hour=0, minute=0, second=0, microsecond=0)
    if value == "today":
        return midnight
    if value == "yesterday":
        return midnight - timedelta(days=1)
    if m := _RELATIVE.match(value):
        seconds = float(m.group(1)) * _SECONDS[m.group(2)]
        if seconds > _MAX_SECONDS:
            raise UsageError(f"{flag}: {text!r} is too far back", hint=f"examples: {EXAMPLES}")
        return now - timedelta(seconds=seconds)
    try:
        dt = datetime.fromisoformat(text.strip().replace("Z", "+00:00").replace("z", "+00:00"))
        # An offset at either end of the calendar moves it past datetime's range.
        return (dt if dt.tzinfo is not None else dt.replace(tzinfo=UTC)).astimezone(UTC)
    except (ValueError, OverflowError):
        raise UsageError(f"{flag}: {text!r} is not a time", hint=f"examples: {EXAMPLES}") from None


def parse_when(text: str | None, flag: str, *, now: datetime | None = None) -> str | None:
    """``text`` as the ledger's fixed-width UTC string, or None when not given."""
    if text is None:
        return None
    return when_datetime(text, flag, now=now).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
