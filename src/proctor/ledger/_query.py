"""Filtered reads of one log: by run, action, actor, decision and time, newest or oldest
first.

One implementation for the CLI, the API and the SDK's server side. The log is read
in pages of sequence numbers, each page its own short read, so a filtered read
holds at most one page and the matches it keeps, never the whole log, and works
the same on SQLite and PostgreSQL. Event times never go backwards in a log (the
ledger stamps ``max(now, last time)``), so a time bound ends the walk early.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from proctor.errors import UsageError
from proctor.ledger._actions import Action
from proctor.ledger._ledger import Ledger

DECISIONS = ("allow", "deny")
_PAGE = 512
_MAX_TEXT = 200


def check_action(action: str | None) -> None:
    """Refuse an action no event can have: a typo is an error naming the near ones,
    not an empty answer that reads as "nothing happened" (the CLI's and the API's
    filters alike)."""
    if action is None or action in Action.__members__.values():
        return
    import difflib

    known = sorted(str(a) for a in Action)
    near = difflib.get_close_matches(action, known, n=4, cutoff=0.5)
    group = sorted({a for a in known if a.split(".")[0] == action.split(".")[0]})
    shown = near or group[:8]
    families = sorted({a.split(".")[0] + ".*" for a in known})
    raise UsageError(
        f"unknown action {action!r}",
        hint=f"did you mean {', '.join(shown)}?"
        if shown
        else f"actions are named <family>.<verb>; the families: {', '.join(families)}",
    )


@dataclass(frozen=True)
class EventFilter:
    """What a reader asks for; every given field must match (they combine with AND).

    ``since`` and ``until`` are the ledger's fixed-width UTC strings, [since, until).
    """

    run: str | None = None
    action: str | None = None
    decision: str | None = None
    since: str | None = None
    until: str | None = None
    #: The acting principal's or workload's id, exactly (``acme/alice``, a SPIFFE id).
    actor: str | None = None

    def __post_init__(self) -> None:
        if self.decision is not None and self.decision not in DECISIONS:
            raise UsageError(
                f"decision {self.decision!r} is neither 'allow' nor 'deny'",
                hint="give --decision allow or --decision deny",
            )
        for name in ("run", "action", "actor"):
            value = getattr(self, name)
            if value is not None and (not value or len(value) > _MAX_TEXT):
                raise UsageError(f"{name} must be 1 to {_MAX_TEXT} characters")
        check_action(self.action)
        if self.since is not None and self.until is not None and self.since >= self.until:
            raise UsageError(
                f"since ({self.since}) is not before until ({self.until}): nothing can match"
            )

    def matches(self, ev: dict[str, Any]) -> bool:
        return (
            (self.run is None or ev.get("run") == self.run)
            and (self.action is None or ev.get("action") == self.action)
            and (self.decision is None or ev.get("decision") == self.decision)
            and (self.actor is None or _actor_id(ev) == self.actor)
            and (self.since is None or str(ev.get("time", "")) >= self.since)
            and (self.until is None or str(ev.get("time", "")) < self.until)
        )


def _actor_id(ev: dict[str, Any]) -> str | None:
    actor = ev.get("actor")
    return str(actor.get("id")) if isinstance(actor, dict) else None


def query_events(
    ledger: Ledger,
    log: str,
    flt: EventFilter,
    *,
    limit: int | None = None,
    newest: bool = True,
    start: int = 0,
    end: int | None = None,
) -> list[bytes]:
    """The matching events' bytes (as hashed), in log order, of seq in [start, end).

    With ``limit`` and ``newest`` the last ``limit`` matches; with ``limit`` and not
    ``newest`` the first ``limit`` from ``start``; without ``limit``, all of them
    (then hold the reader to a bound yourself, or use :func:`iter_events`).
    """
    if limit is not None and limit < 1:
        raise UsageError("limit must be at least 1")
    if not newest or limit is None:
        out: list[bytes] = []
        for data in iter_events(ledger, log, flt, start=start, end=end):
            out.append(data)
            if limit is not None and len(out) >= limit:
                break
        return out
    hi = ledger.head(log).size if end is None else min(end, ledger.head(log).size)
    found: list[bytes] = []
    while hi > start and len(found) < limit:
        lo = max(start, hi - _PAGE)
        page: list[bytes] = []
        past = False
        for data in ledger.entries(log, lo, hi):
            ev = json.loads(data)
            if flt.matches(ev):
                page.append(data)
            elif flt.since is not None and str(ev.get("time", "")) < flt.since:
                past = True
        found = page[-(limit - len(found)) :] + found
        if past:
            break
        hi = lo
    return found


def iter_events(
    ledger: Ledger, log: str, flt: EventFilter, *, start: int = 0, end: int | None = None
) -> Iterator[bytes]:
    """The matching events' bytes from ``start`` on, oldest first, page by page."""
    lo = start
    if flt.since is not None:
        # Straight to the first event in the window, by the time index.
        lo = max(lo, _first_since(ledger, log, flt.since))
    while end is None or lo < end:
        hi = lo + _PAGE if end is None else min(lo + _PAGE, end)
        n = 0
        for data in list(ledger.entries(log, lo, hi)):
            n += 1
            ev = json.loads(data)
            if flt.until is not None and str(ev.get("time", "")) >= flt.until:
                return
            if flt.matches(ev):
                yield data
        if n < hi - lo:
            return
        lo = hi


def _first_since(ledger: Ledger, log: str, since: str) -> int:
    """The first seq whose time is at least ``since``: a binary search, one event read
    per step (times never go backwards in a log)."""
    lo, hi = 0, ledger.head(log).size
    while lo < hi:
        mid = (lo + hi) // 2
        data = next(iter(list(ledger.entries(log, mid, mid + 1))), None)
        if data is not None and str(json.loads(data).get("time", "")) < since:
            lo = mid + 1
        else:
            hi = mid
    return lo
