"""Filtered reads of a log (proctor.ledger.query_events / iter_events), on SQLite and
PostgreSQL: the same answers as a plain filter over every event, read a page at a
time, and bad input refused before anything is read."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from proctor.errors import UsageError
from proctor.ledger import EventDraft, EventFilter, Ledger, iter_events, query_events
from tests.conftest import OPERATOR, LedgerEnv

N = 1200  # more than two pages of 512


def _draft(i: int) -> EventDraft:
    return EventDraft(
        OPERATOR,
        ("http.request", "sql.select", "run.start")[i % 3],
        f"thing/{i}",
        decision="deny" if i % 5 == 0 else "allow",
        run=f"r-{i % 4}",
    )


def test_filters_newest_and_first_n_match_a_plain_filter(ledger_env: LedgerEnv) -> None:
    ledger = ledger_env.ledger
    ledger.create_log("acme", _draft(0))
    ledger.append_many("acme", [_draft(i) for i in range(1, N)])
    every = [json.loads(d) for d in ledger.entries("acme")]
    cut = every[700]["time"]
    pages: list[int] = []
    original = Ledger.entries

    def counted(self: Ledger, log: str, start: int = 0, end: int | None = None) -> Iterator[bytes]:
        pages.append((end if end is not None else N) - start)
        return original(self, log, start, end)

    def seqs(found: Any) -> list[int]:
        return [json.loads(d)["seq"] for d in found]

    def want(**kw: Any) -> list[int]:
        flt = EventFilter(**kw)
        return [e["seq"] for e in every if flt.matches(e)]

    cases: list[dict[str, Any]] = [
        {"run": "r-1"},
        {"run": "r-1", "decision": "deny"},
        {"action": "sql.select", "decision": "allow", "run": "r-2"},
        {"since": cut},
        {"until": cut, "decision": "deny"},
        {"run": "r-nobody"},
    ]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Ledger, "entries", counted)
        for kw in cases:
            flt = EventFilter(**kw)
            assert seqs(iter_events(ledger, "acme", flt)) == want(**kw), kw
            assert seqs(query_events(ledger, "acme", flt, limit=7)) == want(**kw)[-7:], kw
            first = query_events(ledger, "acme", flt, limit=7, newest=False)
            assert seqs(first) == want(**kw)[:7], kw
            assert seqs(iter_events(ledger, "acme", flt, start=600, end=900)) == [
                s for s in want(**kw) if 600 <= s < 900
            ], kw
    # Read a page at a time, never the whole log at once.
    assert pages and max(pages) <= 512
    for bad in ({"decision": "maybe"}, {"since": cut, "until": cut}, {"run": ""}):
        with pytest.raises(UsageError):
            EventFilter(**bad)
    with pytest.raises(UsageError):
        query_events(ledger, "acme", EventFilter(), limit=0)


def test_the_actor_filter_matches_the_actors_id_exactly(ledger_env: LedgerEnv) -> None:
    from proctor.ledger import Actor

    ledger = ledger_env.ledger
    ledger.create_log("acme", _draft(0))
    people = [Actor("user", "acme/alice"), Actor("user", "acme/alice2"), Actor("user", "acme/bob")]
    ledger.append_many("acme", [EventDraft(people[i % 3], "test.event", f"t/{i}")
                                for i in range(30)])  # fmt: skip

    def ids(found: Any) -> list[str]:
        return [json.loads(d)["actor"]["id"] for d in found]

    got = query_events(ledger, "acme", EventFilter(actor="acme/alice"), limit=100)
    # Exactly that id: not acme/alice2, whose id merely begins with it.
    assert ids(got) == ["acme/alice"] * 10
    assert ids(iter_events(ledger, "acme", EventFilter(actor="acme/bob"))) == ["acme/bob"] * 10
    assert query_events(ledger, "acme", EventFilter(actor="acme/nobody"), limit=5) == []
    for bad in ("", "x" * 201):
        with pytest.raises(UsageError):
            EventFilter(actor=bad)
