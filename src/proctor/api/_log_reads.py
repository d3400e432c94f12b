"""Reads of a tenant's log through the C2SP tlog-tiles paths, counted instead of
appended one by one.

Recording each read in the log being read would grow that log with every fetch:
a checkpoint would be stale the moment a client had it, and reading would be
writing. So an allowed read of ``log/checkpoint``, ``log/tile/...`` or
``log/tile/entries/...`` is decided by Cedar like any request, then counted; one
``api.log_reads`` event per reader, tenant and minute goes into the ``system``
log with the count and the kinds of path read. The event of a minute is written
once the minute is over (at the next read of any log through these paths, or
when the API stops). A refused read is recorded at once, in the system log,
before it is answered.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime

from proctor.errors import LedgerError
from proctor.ledger import SYSTEM_LOG, Action, Actor, EventDraft, Ledger

log = logging.getLogger("proctor.api")

#: The period one event covers, in seconds.
PERIOD = 60
#: The kinds of path counted.
KINDS = ("checkpoint", "tile", "partial_tile", "entries", "partial_entries")


@dataclass
class _Count:
    reads: int = 0
    kinds: dict[str, int] = field(default_factory=dict)


# reader actor, the reader's tenant ("" for an anonymous mirror read), the log, period
_Key = tuple[Actor, str, str, int]


class LogReads:
    """Thread-safe counts of tlog-tiles reads, one event per key and period."""

    def __init__(
        self, ledger: Callable[[], Ledger], clock: Callable[[], float] = time.time
    ) -> None:
        self._ledger = ledger
        self._clock = clock
        self._lock = threading.Lock()
        self._counts: dict[_Key, _Count] = {}

    def count(self, actor: Actor, reader_tenant: str, tenant: str, kind: str) -> None:
        """Count one allowed read; records the periods that are over."""
        period = int(self._clock() // PERIOD)
        with self._lock:
            c = self._counts.setdefault((actor, reader_tenant, tenant, period), _Count())
            c.reads += 1
            c.kinds[kind] = c.kinds.get(kind, 0) + 1
            due = any(k[3] < period for k in self._counts)
        if due:
            self._record(lambda k: k[3] < period)

    def flush(self) -> None:
        """Record every count still pending (when the API stops)."""
        self._record(lambda _k: True)

    def _record(self, which: Callable[[_Key], bool]) -> None:
        with self._lock:
            taken = {k: c for k, c in self._counts.items() if which(k)}
            for k in taken:
                del self._counts[k]
        drafts = [self._draft(k, c) for k, c in sorted(taken.items(), key=lambda kc: kc[0][3])]
        if not drafts:
            return
        try:
            self._ledger().append_many(SYSTEM_LOG, drafts)
        except LedgerError as exc:
            # Kept for the next attempt: a count is never dropped while the API runs.
            with self._lock:
                for k, c in taken.items():
                    mine = self._counts.setdefault(k, _Count())
                    mine.reads += c.reads
                    for kind, n in c.kinds.items():
                        mine.kinds[kind] = mine.kinds.get(kind, 0) + n
            log.error("api.log_reads not recorded: %s", exc.message)

    @staticmethod
    def _draft(key: _Key, c: _Count) -> EventDraft:
        actor, reader_tenant, tenant, period = key
        start = datetime.fromtimestamp(period * PERIOD, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        return EventDraft(
            actor,
            Action.API_LOG_READS,
            f"log/{tenant}",
            reason=f"{c.reads} reads of log {tenant} through the tlog-tiles paths",
            details={
                "tenant": tenant,
                "reader_tenant": reader_tenant or None,
                "period_start": start,
                "period_seconds": PERIOD,
                "reads": c.reads,
                "kinds": dict(sorted(c.kinds.items())),
            },
        )
