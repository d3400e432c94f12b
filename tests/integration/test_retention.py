"""Retention, legal holds and pruning on a year of back-dated events (issue 20).

The events are written through the ledger's own code with a clock that walks a
year back, one batch (one signed checkpoint) a day. Pruning past the period must
leave every checkpoint, inclusion and consistency proof valid; ``verify`` counts
the pruned entries; an altered marker, a marker no prune made, and a marker whose
leaf hash was changed all fail; a held run's events and the governance events are
untouched. On SQLite and PostgreSQL (``ledger_env``).
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from proctor.errors import NotFound, UsageError, VerificationFailed
from proctor.governance import Retention
from proctor.ledger import (
    Actor,
    EventDraft,
    Ledger,
    leaf_hash,
    open_checkpoint,
    verify_consistency,
    verify_export,
    verify_inclusion,
)
from tests.conftest import LedgerEnv

T = "acme"
OP = Actor("operator", "root")
DAYS = 365
START = datetime(2025, 1, 1, tzinfo=UTC)


class Clock:
    def __init__(self) -> None:
        self.now = START

    def __call__(self) -> str:
        return self.now.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


@pytest.fixture
def year(ledger_env: LedgerEnv) -> Iterator[tuple[Ledger, Clock, LedgerEnv]]:
    clock = Clock()
    ledger = Ledger(ledger_env.store, ledger_env.signer, "test.local", clock=clock)
    with ledger_env.store.write() as conn:
        conn.execute(
            "INSERT INTO tenants (name, created_at, created_by, status)"
            " VALUES (?, ?, 'root', 'active')",
            (T, clock()),
        )
    ledger.create_log(T, EventDraft(OP, "tenant.create", f"tenant/{T}"))
    ledger.append(T, EventDraft(OP, "quorum.set", f"tenant/{T}", details={"quorum": 1}))
    for day in range(DAYS):
        clock.now = START + timedelta(days=day, hours=1)
        # One run a day, a held run every tenth day; its call and its end.
        run = f"run-{day:03d}" if day % 10 else "run-held"
        ledger.append_many(
            T,
            [
                EventDraft(
                    Actor("workload", run),
                    "sql.select",
                    "table/people",
                    run=run,
                    deployment="dep-b" if day % 7 == 0 else "dep-a",
                    details={"rows": day},
                ),
                EventDraft(OP, "run.end", f"run/{run}", run=run, deployment="dep-a"),
            ],
        )
    clock.now = START + timedelta(days=DAYS, hours=2)
    yield ledger, clock, ledger_env
    ledger.close()


def _entries(env: LedgerEnv) -> dict[int, bytes]:
    with env.store.read() as conn:
        rows = conn.query("SELECT seq, data FROM ledger_entries WHERE log = ? ORDER BY seq", (T,))
    return {int(s): bytes(d) for s, d in rows}


def _set(env: LedgerEnv, seq: int, data: bytes) -> None:
    with env.store.write() as conn:
        conn.execute("UPDATE ledger_entries SET data = ? WHERE log = ? AND seq = ?", (data, T, seq))


def test_a_year_pruned_keeps_every_proof_and_verify_tells_pruned_from_tampered(
    year: tuple[Ledger, Clock, LedgerEnv], tmp_path: Path
) -> None:
    ledger, clock, env = year
    ret = Retention(env.store, ledger)
    before = _entries(env)
    checkpoints = ledger.checkpoints(T)
    head_before = ledger.head(T)

    # Bad input is refused and changes nothing: under six months without a reason,
    # zero days, a hold without its target or its reason, an unknown tenant.
    with pytest.raises(UsageError, match="legal minimum"):
        ret.set(T, 90, OP)
    for bad in (lambda: ret.set(T, 0, OP), lambda: ret.add_hold(T, "run", None, "x", OP),
                lambda: ret.add_hold(T, "run", "r", "  ", OP),
                lambda: ret.add_hold(T, "planet", "r", "x", OP)):  # fmt: skip
        with pytest.raises(UsageError):
            bad()
    with pytest.raises(NotFound):
        ret.set("nobody", 200, OP)
    assert ret.rule(T) is None and ledger.head(T).size == head_before.size
    assert ret.prune(T, OP).why_none == "no retention rule: kept forever"

    rule = ret.set(T, 200, OP)
    assert rule.name == "retention/200d"
    hold = ret.add_hold(T, "run", "run-held", "litigation 2025-17", OP)
    dep_hold = ret.add_hold(T, "deployment", "dep-b", "incident 2025-3", OP)
    # A hold on the whole tenant suspends pruning entirely.
    whole = ret.add_hold(T, "tenant", None, "regulator inquiry", OP)
    assert ret.prune(T, OP).why_none == "the tenant is under legal hold"
    ret.remove_hold(T, whole.id, OP)
    with pytest.raises(UsageError, match="removed already"):
        ret.remove_hold(T, whole.id, OP)

    result = ret.prune(T, OP)
    cutoff = (clock.now - timedelta(days=200)).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    assert result.cutoff == cutoff
    old_days = [
        d
        for d in range(DAYS)
        if clock.now - timedelta(days=200) > START + timedelta(days=d, hours=1)
    ]
    run_held = [d for d in old_days if d % 10 == 0]
    dep_held = [d for d in old_days if d % 7 == 0 and d % 10]
    # A held run's two events; a held deployment's call (its run.end names dep-a).
    assert result.pruned == 2 * len(old_days) - 2 * len(run_held) - len(dep_held)
    assert result.held == 2 * len(run_held) + len(dep_held)
    assert result.events

    after = _entries(env)
    pruned = {s for s, d in after.items() if json.loads(d).get("action") == "ledger.pruned"}
    assert len(pruned) == result.pruned
    for seq, data in after.items():
        ev = json.loads(before.get(seq, data))
        if seq in pruned:
            marker = json.loads(data)
            assert marker["pruned"]["rule"] == "retention/200d"
            assert base64.b64decode(marker["pruned"]["leaf_hash"]) == leaf_hash(before[seq])
            assert marker["time"] == ev["time"] < cutoff
            assert "details" not in marker  # the payload is gone
        elif seq in before:
            assert data == before[seq], f"seq {seq} ({ev['action']}) changed"
    # The held run's events and the governance events are untouched.
    assert any(json.loads(before[s]).get("run") == "run-held" for s in range(2, 40))
    assert not any(json.loads(before[s]).get("run") == "run-held" for s in pruned)
    assert not any(json.loads(before[s]).get("deployment") == "dep-b" for s in pruned)
    assert 0 not in pruned and 1 not in pruned

    # Every checkpoint still verifies: its root is the tree's at its size; inclusion
    # proofs of pruned entries (by their kept leaf hash) and consistency proofs hold.
    vkey = env.signer.verifier
    head = ledger.head(T)
    final = open_checkpoint(head.checkpoint, vkey, head.origin)
    for size, _, note in checkpoints[:: max(1, len(checkpoints) // 25)] + checkpoints[-1:]:
        cp = open_checkpoint(note, vkey, head.origin)
        assert ledger.root_at(T, size) == cp.root
        if 0 < size < final.size:
            proof = ledger.consistency_proof(T, size, final.size)
            verify_consistency(size, final.size, cp.root, final.root, list(proof.hashes))
    for seq in sorted(pruned)[:: max(1, len(pruned) // 40)]:
        inc = ledger.inclusion_proof(T, seq)
        assert inc.leaf_hash == leaf_hash(before[seq])
        verify_inclusion(seq, final.size, inc.leaf_hash, list(inc.hashes), final.root)

    report = ledger.verify(T)
    assert report.pruned == result.pruned and report.size == head.size
    # Readers take markers as entries: a filtered read skips them, a table shows them.
    from proctor.cli._audit import _event_row, _events_table
    from proctor.ledger import EventFilter, query_events

    assert query_events(ledger, T, EventFilter(run="run-001"), limit=5, newest=False) == []
    table = _events_table()
    _event_row(table, json.loads(after[min(pruned)]))
    assert table.row_count == 1
    out = tmp_path / "export"
    ledger.export(T, out)
    assert verify_export(out).pruned == result.pruned

    # A second prune finds nothing new; the record says what happened.
    assert ret.prune(T, OP).pruned == 0
    kinds = [h["action"] for h in ret.history(T)]
    assert kinds == ["retention.set", "hold.add", "hold.add", "hold.add", "hold.remove",
                     "retention.prune"]  # fmt: skip
    assert {h.id for h in ret.holds(T)} == {hold.id, dep_hold.id}
    assert len(ret.holds(T, all_=True)) == 3

    # Tampering: each altered marker fails, with a message that says so.
    first = min(pruned)
    marker = json.loads(after[first])
    from proctor.ledger import canonical_json

    def forged(**changes: object) -> bytes:
        m = json.loads(after[first])
        m["pruned"] = {**m["pruned"], **changes}
        return canonical_json(m)

    for data, why in (
        (
            canonical_json({**marker, "time": "2025-01-01T00:00:00.000000Z"}),
            "tampered pruned marker",
        ),
        (forged(rule="retention/1d"), "tampered pruned marker"),
        (forged(by="0000000000000000"), "tampered pruned marker"),
        (
            forged(leaf_hash=base64.b64encode(b"\x01" * 32).decode()),
            "pruned marker whose leaf hash",
        ),
    ):
        _set(env, first, data)
        with pytest.raises(VerificationFailed, match=why):
            ledger.verify(T)
    _set(env, first, after[first])
    # An event deleted and dressed as pruned (its leaf hash read off the tile) is no
    # prune's: the markers of that prune no longer match its event, or no prune names it.
    held_seq = next(s for s in range(2, 40) if json.loads(before[s]).get("run") == "run-held")
    fake = json.loads(after[first])
    fake.update(seq=held_seq, time=json.loads(before[held_seq])["time"])
    fake["pruned"]["leaf_hash"] = base64.b64encode(leaf_hash(before[held_seq])).decode()
    _set(env, held_seq, canonical_json(fake))
    with pytest.raises(VerificationFailed, match="tampered pruned marker"):
        ledger.verify(T)
    _set(env, held_seq, before[held_seq])
    assert ledger.verify(T).pruned == result.pruned
