"""Retention, legal holds and pruning on a year of back-dated events (issue 20).

The events are written through the ledger's own code with a clock that walks a
year back, one batch (one signed checkpoint) a day. Pruning past the period must
leave every checkpoint, inclusion and consistency proof valid; ``verify`` counts
the pruned entries; an altered marker, a marker no prune made, and a marker whose
leaf hash was changed all fail; a held run's events and the governance events are
untouched. On SQLite and PostgreSQL (``ledger_env``).

Issue 31: a back-dated ``time`` column prunes nothing (the prune goes by each
event's signed time); a marker whose time is not its event's, or not before its
prune's cut-off, fails ``verify`` naming its seq; a hold given by a unique prefix
holds the run or deployment it names, an ambiguous or unknown one is refused, and a
prefix stored before holds were resolved still keeps what it starts.
"""

from __future__ import annotations

import base64
import hashlib
import json
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from proctor.errors import NotFound, UsageError, VerificationFailed
from proctor.governance import Retention, Runs
from proctor.ledger import (
    Actor,
    EventDraft,
    Ledger,
    canonical_json,
    leaf_hash,
    open_checkpoint,
    verify_consistency,
    verify_export,
    verify_inclusion,
)
from proctor.store import Store
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
    add_run(ledger_env.store, "run-held")
    for name in ("dep-a", "dep-b"):
        add_deployment(ledger_env.store, name)
    yield ledger, clock, ledger_env
    ledger.close()


def add_run(store: Store, run: str, deployment: str = "dep-a", tenant: str = T) -> None:
    """The run's row, as the supervisor writes it (holds resolve runs from the store)."""
    with store.write() as conn:
        Runs.insert(
            conn,
            (run, tenant, deployment, 1, "sha256:" + "0" * 64, "production", "wl", "[]",
             "bwrap", None, "succeeded", None, 0, 1, "{}", None, "2025-01-01T00:00:00.000000Z",
             None),
            "test",
        )  # fmt: skip


def add_deployment(store: Store, name: str, tenant: str = T) -> None:
    """A deployment's row (its backing event is not what these tests are about)."""
    with store.write() as conn:
        conn.execute(
            "INSERT INTO deployments (tenant, name, version, digest, environment, mode,"
            " every_seconds, instruction, reference, approvals, created_by, created_at,"
            " status, seq) VALUES (?, ?, 1, ?, 'production', 'job', NULL, 'x', '', '[]',"
            " 'root', '2025-01-01T00:00:00.000000Z', 'active', 0)",
            (tenant, name, "sha256:" + "0" * 64),
        )


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


# -- issue 31: the signed time decides, and holds resolve ------------------------

RECENT = "r-eecf0a1b2c3d"
#: Old runs (one a day from START) and their deployments; the holds below cover some.
OLD_RUNS = (
    ("r-aaaa00000001", "alpha"),  # held by its full id
    ("r-bbbb00000002", "alpha"),  # held by a unique prefix of its id
    ("r-cccc00000003", "batch-daily"),  # r-cccc is ambiguous; held by "batch-d"
    ("r-cccc00000004", "batch-daily"),
    ("r-dddd00000005", "gamma-sync"),  # its deployment held by its full name
    ("r-eeee00000006", "omega"),  # a prefix stored before holds were resolved
    ("r-ffff00000007", "legacy-dep"),  # a deployment prefix stored before
    ("r-0000aaaa0008", "omega"),  # no hold: pruned
    ("r-0000bbbb0009", "omega"),
)
DEPLOYMENTS = ("alpha", "batch-daily", "batch-weekly", "gamma-sync", "omega", "legacy-dep",
               "nightly-report")  # fmt: skip
RULE_DAYS = 200


@pytest.fixture
def small(ledger_env: LedgerEnv) -> Iterator[tuple[Ledger, Clock, LedgerEnv]]:
    """Nine runs a year old, then a run of 14 events minutes old; every run and
    deployment has its row, as the runtime writes them."""
    clock = Clock()
    ledger = Ledger(ledger_env.store, ledger_env.signer, "test.local", clock=clock)
    with ledger_env.store.write() as conn:
        conn.execute(
            "INSERT INTO tenants (name, created_at, created_by, status)"
            " VALUES (?, ?, 'root', 'active')",
            (T, clock()),
        )
    ledger.create_log(T, EventDraft(OP, "tenant.create", f"tenant/{T}"))
    for day, (run, dep) in enumerate(OLD_RUNS):
        clock.now = START + timedelta(days=day, hours=1)
        ledger.append_many(T, [
            EventDraft(Actor("workload", run), "sql.select", "table/people", run=run,
                       deployment=dep, details={"rows": day}),
            EventDraft(OP, "run.end", f"run/{run}", run=run, deployment=dep),
        ])  # fmt: skip
    clock.now = START + timedelta(days=400)
    ledger.append(T, EventDraft(OP, "run.start", f"run/{RECENT}", run=RECENT,
                                deployment="nightly-report"))  # fmt: skip
    for i in range(12):
        clock.now += timedelta(seconds=20)
        ledger.append(T, EventDraft(Actor("workload", RECENT), "sql.select", "table/people",
                                    run=RECENT, deployment="nightly-report",
                                    details={"rows": i}))  # fmt: skip
    ledger.append(T, EventDraft(OP, "run.end", f"run/{RECENT}", run=RECENT,
                                deployment="nightly-report"))  # fmt: skip
    clock.now += timedelta(minutes=10)
    for run, dep in (*OLD_RUNS, (RECENT, "nightly-report")):
        add_run(ledger_env.store, run, dep)
    for name in DEPLOYMENTS:
        add_deployment(ledger_env.store, name)
    yield ledger, clock, ledger_env
    ledger.close()


def _seqs_of(env: LedgerEnv, run: str) -> list[int]:
    return [s for s, d in _entries(env).items() if json.loads(d).get("run") == run]


def test_a_back_dated_time_column_prunes_nothing_recent(
    small: tuple[Ledger, Clock, LedgerEnv],
) -> None:
    ledger, _, env = small
    recent = _seqs_of(env, RECENT)
    assert len(recent) == 14
    # A store writer back-dates the time column of the recent run's entries: the copy
    # of the time that nobody signed.
    with env.store.write() as conn:
        conn.execute(
            "UPDATE ledger_entries SET time = ? WHERE log = ? AND seq >= ?",
            ("2025-01-02T00:00:00.000000Z", T, recent[0]),
        )
    before = _entries(env)
    ret = Retention(env.store, ledger)
    ret.set(T, RULE_DAYS, OP)
    result = ret.prune(T, OP)
    after = _entries(env)
    for seq in recent:
        assert after[seq] == before[seq], f"seq {seq} of a minutes-old run was pruned"
    # The old runs' events were pruned, each marker carrying its event's signed time.
    assert result.pruned == 2 * len(OLD_RUNS)
    assert list(result.misdated) == recent
    for seq, data in after.items():
        if json.loads(data).get("action") == "ledger.pruned":
            assert json.loads(data)["time"] == json.loads(before[seq])["time"]
    assert ledger.verify(T).pruned == result.pruned
    assert ret.prune(T, OP).pruned == 0


def prune_as_before(ledger: Ledger, store: Store, seqs: list[int], cutoff: str) -> None:
    """What the prune wrote before issue 31, had it chosen these entries: markers
    whose time is the time column's, committed to by a real signed prune event."""
    from proctor.ledger._prune import marker_bytes, ranges_of

    by, at = "00112233aabbccdd", ledger.now()
    digest = hashlib.sha256()
    rows = []
    with store.read() as conn:
        got = conn.query(
            "SELECT seq, time, data FROM ledger_entries WHERE log = ? ORDER BY seq", (T,)
        )
    for seq, time, data in got:
        if int(seq) in seqs:
            m = marker_bytes(int(seq), T, str(time), leaf_hash(bytes(data)), at=at, by=by,
                             rule=f"retention/{RULE_DAYS}d")  # fmt: skip
            digest.update(m + b"\n")
            rows.append((m, T, int(seq)))
    ranges = ranges_of(seqs)
    details = {"prune_id": by, "rule": f"retention/{RULE_DAYS}d", "at": at, "cutoff": cutoff,
               "count": len(rows), "first": seqs[0], "last": seqs[-1], "ranges": ranges,
               "markers": "sha256:" + digest.hexdigest()}  # fmt: skip
    ledger.append(
        T,
        EventDraft(OP, "retention.prune", f"tenant/{T}", details=details),
        hook=lambda conn: conn.executemany(
            "UPDATE ledger_entries SET data = ? WHERE log = ? AND seq = ?", rows
        ),
    )


def test_a_marker_whose_time_is_not_its_events_fails_verify_naming_the_seq(
    small: tuple[Ledger, Clock, LedgerEnv],
) -> None:
    ledger, clock, env = small
    recent = _seqs_of(env, RECENT)
    cutoff = (clock.now - timedelta(days=RULE_DAYS)).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    with env.store.write() as conn:
        conn.execute(
            "UPDATE ledger_entries SET time = ? WHERE log = ? AND seq >= ?",
            ("2025-01-02T00:00:00.000000Z", T, recent[0]),
        )
    # The runtime before issue 31 pruned them, signing markers with the column's time;
    # the events signed before them are later than that.
    prune_as_before(ledger, env.store, recent, cutoff)
    with pytest.raises(
        VerificationFailed,
        match=rf"event seq {recent[0]}: pruned marker's time 2025-01-02\S* is before the time"
        r" 2025-01-09\S* of event seq 1[78], signed before it",
    ):
        ledger.verify(T)


def test_a_marker_past_its_prunes_cutoff_fails_verify_naming_the_seq(
    small: tuple[Ledger, Clock, LedgerEnv],
) -> None:
    ledger, clock, env = small
    recent = _seqs_of(env, RECENT)
    # A prune (signed) whose markers carry the events' true times, which are after
    # its cut-off: those events were not past the period.
    cutoff = (clock.now - timedelta(days=RULE_DAYS)).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    prune_as_before(ledger, env.store, recent, cutoff)
    with pytest.raises(
        VerificationFailed,
        match=rf"event seq {recent[-1]}: pruned marker's time \S+ is not before the cut-off"
        rf" {cutoff}",
    ):
        ledger.verify(T)


def test_a_forged_marker_time_fails_verify_naming_the_seq(
    small: tuple[Ledger, Clock, LedgerEnv],
) -> None:
    ledger, _, env = small
    ret = Retention(env.store, ledger)
    ret.set(T, RULE_DAYS, OP)
    assert ret.prune(T, OP).pruned == 2 * len(OLD_RUNS)
    after = _entries(env)
    markers = sorted(s for s, d in after.items() if json.loads(d)["action"] == "ledger.pruned")
    seq = markers[3]  # not the prune's first: the seq named is the forged one's
    # Before the event signed ahead of it: the log's times say it is a forgery.
    for forged in ("2024-12-31T00:00:00.000000Z",):
        _set(env, seq, canonical_json({**json.loads(after[seq]), "time": forged}))
        with pytest.raises(VerificationFailed, match=rf"event seq {seq}: pruned marker's time"):
            ledger.verify(T)
    # A time between its neighbours': the prune event's digest of its markers catches it.
    m = json.loads(after[seq])
    _set(env, seq, canonical_json({**m, "time": m["time"][:-2] + "9Z"}))
    with pytest.raises(VerificationFailed, match="do not match their prune event"):
        ledger.verify(T)
    _set(env, seq, after[seq])
    assert ledger.verify(T).pruned == len(markers)


def test_holds_by_id_and_by_prefix_keep_what_they_name(
    small: tuple[Ledger, Clock, LedgerEnv],
) -> None:
    ledger, _, env = small
    ret = Retention(env.store, ledger)
    ret.set(T, RULE_DAYS, OP)
    size = ledger.head(T).size
    # Unknown, too short and ambiguous ids are refused, and nothing is stored.
    for scope, given, err, why in (
        ("run", "r-zzzz9999", NotFound, "no run 'r-zzzz9999'"),
        ("run", "r-", UsageError, r"'r-' is ambiguous: \d+ run ids"),
        ("run", "r-cccc", UsageError, r"ambiguous: 2 run ids .*r-cccc00000003"),
        ("deployment", "nope", NotFound, "no deployment 'nope'"),
        ("deployment", "batch", UsageError, r"ambiguous: 2 deployment names"),
        ("run", "run-held", NotFound, "no run 'run-held'"),
    ):
        with pytest.raises(err, match=why):
            ret.add_hold(T, scope, given, "case 31", OP)
    assert ret.holds(T, all_=True) == [] and ledger.head(T).size == size
    # Every way a person gives a run or a deployment: the full id, a unique prefix.
    by_id = ret.add_hold(T, "run", "r-aaaa00000001", "case 31", OP)
    by_prefix = ret.add_hold(T, "run", " r-bbbb ", "case 31", OP)
    dep_prefix = ret.add_hold(T, "deployment", "batch-d", "case 31", OP)
    dep_full = ret.add_hold(T, "deployment", "gamma-sync", "case 31", OP)
    assert [by_id.target, by_prefix.target, dep_prefix.target, dep_full.target] == [
        "r-aaaa00000001", "r-bbbb00000002", "batch-daily", "gamma-sync"]  # fmt: skip
    added = [e for e in ret.history(T) if e["action"] == "hold.add"]
    assert [e["details"]["target"] for e in added][1:3] == ["r-bbbb00000002", "batch-daily"]
    # Holds stored before ids were resolved: what a person typed, kept as typed.
    with env.store.write() as conn:
        for hid, scope, target in (("hold-old1", "run", "r-eeee"),
                                   ("hold-old2", "deployment", "legacy")):  # fmt: skip
            conn.execute(
                "INSERT INTO legal_holds (id, tenant, scope, target, reason, created_by,"
                " created_at) VALUES (?, ?, ?, ?, 'old', 'root', ?)",
                (hid, T, scope, target, "2025-06-01T00:00:00.000000Z"),
            )
    # A hold on the tenant, by its name, suspends everything.
    whole = ret.add_hold(T, "tenant", None, "case 31", OP)
    assert ret.prune(T, OP).why_none == "the tenant is under legal hold"
    ret.remove_hold(T, whole.id, OP)

    before = _entries(env)
    result = ret.prune(T, OP)
    after = _entries(env)
    pruned_runs = {json.loads(before[s]).get("run") for s in before if after[s] != before[s]}
    assert pruned_runs == {"r-0000aaaa0008", "r-0000bbbb0009"}
    assert result.pruned == 4 and result.held == 2 * (len(OLD_RUNS) - 2)
    assert ledger.verify(T).pruned == 4


def test_bytes_rewritten_with_another_time_are_neither_pruned_nor_believed(
    small: tuple[Ledger, Clock, LedgerEnv],
) -> None:
    ledger, _, env = small
    recent = _seqs_of(env, RECENT)
    first_old = _seqs_of(env, OLD_RUNS[0][0])[0]
    before = _entries(env)

    def retimed(seq: int, time: str) -> bytes:
        return canonical_json({**json.loads(before[seq]), "time": time})

    # A store writer rewrites the signed time itself: a recent event's to a year ago (to
    # have it pruned), an old event's to now (to end the prune's walk before the rest).
    _set(env, recent[0], retimed(recent[0], "2025-01-02T00:00:00.000000Z"))
    _set(env, first_old, retimed(first_old, "2026-12-01T00:00:00.000000Z"))
    forged = _entries(env)
    ret = Retention(env.store, ledger)
    ret.set(T, RULE_DAYS, OP)
    result = ret.prune(T, OP)
    after = _entries(env)
    assert list(result.unverified) == [first_old, recent[0]]
    assert after[recent[0]] == forged[recent[0]] and after[first_old] == forged[first_old]
    # Every other old event was pruned all the same; the recent run kept.
    assert result.pruned == 2 * len(OLD_RUNS) - 1
    assert all(after[s] == before[s] for s in recent if s != recent[0])
    # What verify says is the rewriting, at its seq, not a prune.
    with pytest.raises(VerificationFailed, match=rf"event seq {first_old}: "):
        ledger.verify(T)
