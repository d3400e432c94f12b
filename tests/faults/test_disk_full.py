"""The disk under a whole runtime fills up mid-workload, then frees up again.

A Proctor home (``init_home``: SQLite store, keys, blobs) lives on a small
tmpfs this test mounts itself. Threads make calls the way the runtime does:
plain ledger appends, SQL through the broker (``handle_sql`` on a RunScope,
so a call is answered only once its event is durable) and a control-plane
change whose own row commits with its event (``allow_egress_range``). A
filler file then takes every free byte. What must hold:

- while the disk is full calls are refused (LedgerError / CallRefused), and
  nothing else goes wrong: no other exception, no answer without an event;
- no acknowledged event is lost, in this Ledger and in a new process reading
  the home from disk; nothing refused is in the log (nor its control row);
- once the filler is deleted the same runtime object takes calls again, by
  itself, with no restart; ``verify`` passes for every log.

Also the home for the workload that test_store_outage.py runs on PostgreSQL.
"""

from __future__ import annotations

import asyncio
import errno
import json
import os
import subprocess
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from proctor.broker import CallDenied, CallRefused, DatasetBinding, RunScope, handle_sql
from proctor.errors import LedgerError
from proctor.ledger import Actor, Appended, EventDraft, leaf_hash
from proctor.policy import capability_policies, compile_policies
from proctor.runtime import Runtime, init_home
from tests.conftest import run_cli
from tests.integration.test_broker_sql import DEPLOYMENT, default_caps, make_dataset

SOAK = os.environ.get("PROCTOR_SOAK") == "1"
TENANT = "acme"
WORKER = Actor("operator", "fault-workload")
REFUSALS = (LedgerError, CallRefused)
CYCLES = 3 if SOAK else 1


@dataclass
class Call:
    kind: str  # "append", "sql" or "control"
    key: str  # what identifies the call's event: k, run/i, or the range
    start: float
    end: float
    ok: bool  # answered (an event was recorded and returned)
    appended: list[Appended] = field(default_factory=list)
    error: str = ""  # the exception's class name when not ok

    @property
    def took(self) -> float:
        return self.end - self.start


@dataclass
class ObservedScope(RunScope):
    """A real RunScope that keeps what its ``record`` returned: each event's
    place in the log, so the test can find exactly the events of each call."""

    recorded: list[Appended] = field(default_factory=list)

    async def record(self, *args: Any, **kwargs: Any) -> Appended:
        appended = await super().record(*args, **kwargs)
        self.recorded.append(appended)
        return appended


class Workload:
    """Threads calling into one runtime until stopped; every call is kept.

    A call that raises anything but a refusal (or, for SQL, a policy deny,
    which is an answer with its event) is kept with that error, and the test
    fails on it: an unexpected exception is exactly what a fault must not cause.
    """

    def __init__(
        self,
        rt: Runtime,
        dataset: Path,
        *,
        appenders: int = 3,
        sql: int = 2,
        pace: float = 0.0,
    ) -> None:
        self.rt = rt
        self.dataset = dataset
        self.pace = pace
        self.calls: list[Call] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._policies = compile_policies(capability_policies(TENANT, DEPLOYMENT, default_caps()))
        self.scopes: list[ObservedScope] = []
        self._threads = [
            *(threading.Thread(target=self._appender, args=(w,)) for w in range(appenders)),
            *(threading.Thread(target=self._sql, args=(w,)) for w in range(sql)),
            threading.Thread(target=self._control),
        ]

    def __enter__(self) -> Workload:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(60)
            assert not t.is_alive(), "a workload thread hangs"

    def _keep(self, call: Call) -> None:
        with self._lock:
            self.calls.append(call)
        if self.pace:
            time.sleep(self.pace)

    def snapshot(self) -> list[Call]:
        with self._lock:
            return list(self.calls)

    def wait_for(self, what: str, pred: Callable[[list[Call]], bool], timeout: float) -> list[Call]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            calls = self.snapshot()
            if pred(calls):
                return calls
            time.sleep(0.01)
        counts: dict[tuple[str, bool, str], int] = {}
        for c in self.snapshot():
            counts[(c.kind, c.ok, c.error)] = counts.get((c.kind, c.ok, c.error), 0) + 1
        raise AssertionError(f"timed out after {timeout} s waiting for {what}: {counts}")

    def _appender(self, w: int) -> None:
        i = 0
        while not self._stop.is_set():
            k = f"a{w}-{i}"
            i += 1
            draft = EventDraft(WORKER, "test.event", f"thing/{k}", details={"k": k})
            start = time.monotonic()
            try:
                a = self.rt.ledger.append(TENANT, draft)
            except Exception as exc:  # kept and judged by the test
                self._keep(Call("append", k, start, time.monotonic(), False, [], _name(exc)))
            else:
                self._keep(Call("append", k, start, time.monotonic(), True, [a]))

    def _sql(self, w: int) -> None:
        run = f"run-{w}"
        scope = ObservedScope(
            tenant=TENANT,
            run_id=run,
            workload=f"spiffe://proctor.local/tenant/{TENANT}/deployment/{DEPLOYMENT}/run/{run}",
            deployment=DEPLOYMENT,
            artifact="sha256:" + "ab" * 32,
            approvals=("approval-1",),
            environment="production",
            policies=self._policies,
            ledger=self.rt.ledger,
            datasets={"crm": DatasetBinding("crm", "sqlite", str(self.dataset))},
            lineage_key=b"k" * 32,
        )
        with self._lock:
            self.scopes.append(scope)
        loop = asyncio.new_event_loop()
        i = 0
        try:
            while not self._stop.is_set():
                # Every third call asks for the email column: a deny, which is
                # answered (CallDenied) only once the deny is recorded too.
                column = "email" if i % 3 == 2 else "name"
                request = {"dataset": "crm", "sql": f"SELECT id, {column} FROM customers"}
                before = len(scope.recorded)
                start = time.monotonic()
                try:
                    loop.run_until_complete(handle_sql(scope, request))
                except CallDenied:
                    ok, error = True, ""
                except Exception as exc:  # kept and judged by the test
                    ok, error = False, _name(exc)
                else:
                    ok, error = True, ""
                new = scope.recorded[before:]
                self._keep(Call("sql", f"{run}/{i}", start, time.monotonic(), ok, new, error))
                i += 1
        finally:
            loop.close()

    def _control(self) -> None:
        i = 0
        while not self._stop.is_set():
            cidr = f"198.18.{i // 256}.{i % 256}/32"
            i += 1
            start = time.monotonic()
            try:
                self.rt.allow_egress_range(TENANT, cidr, WORKER)
            except Exception as exc:  # kept and judged by the test
                self._keep(Call("control", cidr, start, time.monotonic(), False, [], _name(exc)))
            else:
                self._keep(Call("control", cidr, start, time.monotonic(), True))
            time.sleep(0.005)  # a control change is rare next to calls


def _name(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def unexpected(calls: list[Call]) -> list[Call]:
    """Calls that failed with anything but a refusal."""
    names = tuple(t.__name__ + ":" for t in REFUSALS)
    return [c for c in calls if not c.ok and not c.error.startswith(names)]


def check_log_matches(rt: Runtime, calls: list[Call], in_doubt: Sequence[Call] = ()) -> list[bytes]:
    """The tenant's log holds every answered call's event and no refused one's.

    ``in_doubt`` are refused calls whose commit may have happened all the same
    (PostgreSQL killed between its commit and its reply: the client cannot
    know); their events may be present, no others. Returns the log's events
    (bytes), for comparison with another reader.
    """
    rows = list(rt.ledger.entries(TENANT))
    leaves = [leaf_hash(r) for r in rows]
    events = [json.loads(r) for r in rows]
    ours: set[int] = set()
    for c in calls:
        if c.kind == "control":
            continue
        if c.ok:
            assert len(c.appended) == 1, f"{c.kind} {c.key} answered with {len(c.appended)} events"
        else:
            assert not c.appended, f"{c.kind} {c.key} was refused after recording an event"
        for a in c.appended:
            assert a.log == TENANT
            assert a.seq < len(rows), f"acknowledged seq {a.seq} is not in the log"
            assert leaves[a.seq] == a.leaf_hash, f"acknowledged seq {a.seq} changed"
            ours.add(a.seq)
    doubt_keys = {c.key for c in in_doubt if c.kind != "sql"}
    doubt_runs = [c.key.split("/")[0] for c in in_doubt if c.kind == "sql"]
    ranges = {c.key: c.ok for c in calls if c.kind == "control"}
    for seq, ev in enumerate(events):
        if seq in ours:
            continue
        if ev["action"] == "egress.range.allow":
            cidr = ev["resource"].removeprefix("range/")
            if ranges.get(cidr) is not True:
                assert cidr in doubt_keys, f"event {seq} records a refused change {cidr}"
                ranges[cidr] = True  # it did commit: its row must be there too
        elif ev["run"]:
            assert ev["run"] in doubt_runs, f"event {seq} ({ev['action']}) has no answered call"
            doubt_runs.remove(ev["run"])
        elif ev["actor"]["id"] == WORKER.id:
            assert ev["details"]["k"] in doubt_keys, f"event {seq} has no answered call"
    # The control rows committed with their events, and only those.
    assert set(rt.egress_ranges(TENANT)) == {k for k, ok in ranges.items() if ok}
    assert sum(ranges.values()) == sum(1 for e in events if e["action"] == "egress.range.allow")
    return rows


def check_from_disk(home: Path, rows: list[bytes]) -> None:
    """A new process reads the same events from the home and verifies every log."""
    for log in ("system", TENANT):
        run_cli("audit", "verify", "-t", log, home=home)  # exits non-zero if it fails
    listed = run_cli("audit", "events", "-t", TENANT, "--jsonl", home=home).raw.splitlines()
    assert listed[: len(rows)] == rows


@contextmanager
def small_tmpfs(where: Path, size: str) -> Iterator[Path]:
    where.mkdir()
    proc = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(where)],
        capture_output=True, timeout=30, check=False,
    )  # fmt: skip
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {proc.stderr.decode().strip()}")
    try:
        yield where
    finally:
        done = subprocess.run(["umount", str(where)], capture_output=True, timeout=30, check=False)
        if done.returncode != 0:  # something still holds a file: detach it anyway
            subprocess.run(["umount", "-l", str(where)], capture_output=True, timeout=30)


def fill(path: Path) -> int:
    """Write ``path`` until the filesystem has no byte left; returns its size."""
    written = 0
    with path.open("wb", buffering=0) as f:
        for chunk in (1 << 20, 1 << 12, 1):
            block = b"\0" * chunk
            while True:
                try:
                    n = f.write(block)
                except OSError as exc:
                    if exc.errno != errno.ENOSPC:
                        raise
                    break
                written += n or 0
    return written


@pytest.mark.host
def test_disk_full_refuses_then_recovers_by_itself(tmp_path: Path) -> None:
    dataset = make_dataset(tmp_path / "crm.db")  # the data read is not on the full disk
    with small_tmpfs(tmp_path / "mnt", "24m") as mnt:
        home = mnt / "home"
        init_home(home)
        rt = Runtime.open(home)
        filler = mnt / "filler"
        try:
            rt.tenants.create(TENANT, rt.operator)
            run_disk_full(rt, home, dataset, filler)
        finally:
            rt.close()
            filler.unlink(missing_ok=True)


def run_disk_full(rt: Runtime, home: Path, dataset: Path, filler: Path) -> None:
    wal = home / "proctor.db-wal"
    kinds = ("append", "sql", "control")
    windows: list[tuple[float, float, float]] = []  # full at, freed at, answering again at
    wal_full = filled = 0
    with Workload(rt, dataset) as load:
        load.wait_for("calls before the fault", lambda cs: len(cs) >= 200, 30)
        for _cycle in range(CYCLES):
            full_at = time.monotonic()
            filled = fill(filler)

            def refused_each(cs: list[Call], since: float = full_at) -> bool:
                late = [c for c in cs if c.start > since and not c.ok]
                return all(sum(c.kind == k for c in late) >= 3 for k in kinds)

            load.wait_for("refusals of every kind while the disk is full", refused_each, 30)
            # Keep it full a while: every call in here is judged below.
            time.sleep(1.0 if SOAK else 0.3)
            wal_full = max(wal_full, wal.stat().st_size)

            freed_at = time.monotonic()
            filler.unlink()

            def answered_each(cs: list[Call], since: float = freed_at) -> bool:
                late = [c for c in cs if c.start > since and c.ok]
                return all(sum(c.kind == k for c in late) >= 3 for k in kinds)

            calls = load.wait_for("the same runtime to answer again", answered_each, 30)
            back = min(c.end for c in calls if c.start > freed_at and c.ok)
            windows.append((full_at, freed_at, back))
            time.sleep(1.0 if SOAK else 0.3)
    calls = load.calls

    assert not unexpected(calls), unexpected(calls)[:5]
    during = [c for w in windows for c in calls if w[0] < c.start and c.end < w[1]]
    refused = [c for c in during if not c.ok]
    assert refused, "nothing was refused while the disk was full"
    # Once the runtime answered again it kept answering: nothing was left wedged.
    for _, freed_at, back in windows:
        nxt = min([w[0] for w in windows if w[0] > freed_at], default=float("inf"))
        after = [c for c in calls if back < c.start and c.end < nxt]
        assert after and all(c.ok for c in after), [c for c in after if not c.ok][:5]
    rows = check_log_matches(rt, calls)
    for log in ("system", TENANT):
        assert rt.ledger.verify(log).size == rt.ledger.head(log).size
    check_from_disk(home, rows)
    wal_end = wal.stat().st_size
    recovered = max(back - freed_at for _, freed_at, back in windows)
    print(
        f"\ndisk full x{CYCLES}: {len(calls)} calls, {sum(c.ok for c in calls)} answered, "
        f"{sum(not c.ok for c in calls)} refused ({len(refused)} of {len(during)} while full); "
        f"filler {filled >> 10} KiB; WAL {wal_full >> 10} KiB full, {wal_end >> 10} KiB at end; "
        f"first answer at most {recovered * 1000:.0f} ms after the filler went; "
        f"log {len(rows)} events"
    )
    # The WAL is bounded by SQLite's checkpoint (1000 pages) plus a batch, not
    # by how long or how often the disk was full.
    assert wal_end < 8 << 20
