from __future__ import annotations

import base64
import hashlib
import json
import queue
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    # Only the broker awaits appends; a CLI process never loads asyncio (and ssl) for it.
    import asyncio

from proctor.errors import (
    AlreadyExists,
    LedgerError,
    NotFound,
    ProctorError,
    UsageError,
    VerificationFailed,
)
from proctor.ledger._actions import INDEXED_ACTIONS, event_ref
from proctor.ledger._canonical import canonical_event, canonical_json
from proctor.ledger._event import (
    EVENT_VERSION,
    EventDraft,
    bounded_event,
    utc_now,
    with_request_details,
)
from proctor.ledger._merkle import (
    EMPTY_ROOT,
    CompactRange,
    consistency_path,
    inclusion_path,
    leaf_hash,
    root_from,
)
from proctor.ledger._note import Checkpoint, Signer, Verifier, open_checkpoint
from proctor.ledger._objects import LedgerObject, store_objects
from proctor.ledger._tiles import TILE_WIDTH, FullTileCache, TileNodes, tile_path
from proctor.ledger._verify import VerifyReport, verify_log
from proctor.store import Conn, Engine, Row, Store
from proctor.telemetry import metrics, tenant

SYSTEM_LOG = "system"
_TILE_BYTES = TILE_WIDTH * 32
_UPSERT_TILE = (
    "INSERT INTO ledger_tiles (log, level, idx, hashes) VALUES (?, ?, ?, ?)"
    " ON CONFLICT (log, level, idx) DO UPDATE SET hashes = excluded.hashes"
)

TxHook = Callable[[Conn], None]
#: Checked inside every transaction the writer commits, just before its COMMIT:
#: a node that lost its lease raises there, and the batch rolls back whole.
Fence = Callable[[Conn], None]
#: An event in a second log that commits with the first, all or nothing; its
#: draft is made from the first event's leaf hash (a system-log entry that
#: names a tenant log's event 0, say).
Followup = tuple[str, Callable[[bytes], EventDraft]]
# An event ready to commit: log, seq, time, bytes, its row's ``ref``, and whether it
# is the item's own.
_Staged = tuple[str, int, str, bytes, str | None, bool]
_INSERT_ENTRY = "INSERT INTO ledger_entries (log, seq, time, data, ref) VALUES (?, ?, ?, ?, ?)"
# PostgreSQL: logs' heads, and, for a log whose size is not the one given (another
# node appended), the tile at the right edge of each level that holds any of it.
_EDGES = (
    "SELECT l.log, l.size, l.origin, l.last_time, t.level, t.idx, t.hashes"
    " FROM unnest(?::text[], ?::bigint[]) AS k(log, known) JOIN ledger_logs l ON l.log = k.log"
    " LEFT JOIN LATERAL (SELECT t.level, t.idx, t.hashes FROM generate_series(0, 7) AS g(lv)"
    " JOIN ledger_tiles t ON t.log = l.log AND t.level = g.lv"
    " AND t.idx = (l.size >> (8 * g.lv)) >> 8"
    " WHERE l.size <> k.known AND ((l.size >> (8 * g.lv)) & 255) <> 0) t ON true"
)
# PostgreSQL: a batch's events, tiles, heads and checkpoints, one statement over
# arrays (one round trip). Data-modifying CTEs all run, on distinct tables. The
# events' bytes go as one bytea cut by offsets: psycopg writes a list of bytes as
# a text array, escaping every byte (1.4 ms a batch of 62 events, against 0.02).
_WRITE_BATCH = (
    "WITH b AS (SELECT ?::bytea AS blob),"
    " e AS (INSERT INTO ledger_entries (log, seq, time, data, ref)"
    " SELECT u.log, u.seq, u.time, substring(b.blob FROM u.at FOR u.len), u.ref FROM b,"
    " unnest(?::text[], string_to_array(?, ',')::bigint[], ?::text[],"
    " string_to_array(?, ',')::int[], string_to_array(?, ',')::int[], ?::text[])"
    " AS u(log, seq, time, at, len, ref)),"
    " t AS (INSERT INTO ledger_tiles (log, level, idx, hashes)"
    " SELECT * FROM unnest(?::text[], ?::bigint[], ?::bigint[], ?::bytea[])"
    " ON CONFLICT (log, level, idx) DO UPDATE SET hashes = excluded.hashes),"
    " h AS (SELECT * FROM unnest(?::text[], ?::bigint[], ?::bytea[], ?::text[], ?::text[])"
    " AS h(log, size, root, last_time, note)),"
    " c AS (INSERT INTO ledger_checkpoints (log, size, time, note)"
    " SELECT log, size, last_time, note FROM h ON CONFLICT (log, size) DO NOTHING)"
    " UPDATE ledger_logs l SET size = h.size, root = h.root, last_time = h.last_time,"
    " checkpoint = h.note FROM h WHERE l.log = h.log"
)


def _columns(rows: Sequence[tuple[Any, ...]], width: int) -> list[tuple[Any, ...]]:
    """``rows`` as ``width`` columns (empty columns for no rows)."""
    return list(zip(*rows, strict=True)) if rows else [()] * width


_sha256 = hashlib.sha256
# Appended's own constructor is a Python function; the tuple's is not.
_new_tuple = tuple.__new__


class Appended(NamedTuple):
    """An event durably in the log: its place, its leaf hash, the checkpoint over it."""

    log: str
    seq: int
    leaf_hash: bytes
    size: int
    checkpoint: str
    event: bytes


@dataclass(frozen=True)
class InclusionProof:
    index: int
    size: int
    leaf_hash: bytes
    hashes: tuple[bytes, ...]

    def as_json(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "size": self.size,
            "leaf_hash": base64.b64encode(self.leaf_hash).decode(),
            "hashes": [base64.b64encode(h).decode() for h in self.hashes],
        }


@dataclass(frozen=True)
class ConsistencyProof:
    old: int
    new: int
    hashes: tuple[bytes, ...]

    def as_json(self) -> dict[str, Any]:
        return {
            "old": self.old,
            "new": self.new,
            "hashes": [base64.b64encode(h).decode() for h in self.hashes],
        }


@dataclass(frozen=True)
class LogHead:
    log: str
    origin: str
    size: int
    root: bytes
    checkpoint: str


class _Fenced(Exception):
    """The fence refused a batch: carries the fence's own error to every append."""

    def __init__(self, error: ProctorError) -> None:
        super().__init__(error.message)
        self.error = error


class _Done:
    """A one-shot completion flag: a held lock that the writer releases.

    Cheaper than ``threading.Event`` (no condition variable), which matters when
    tens of thousands of appends a second each wait for their batch.
    """

    __slots__ = ("_lock",)

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lock.acquire()

    def set(self) -> None:
        self._lock.release()

    def wait(self) -> None:
        self._lock.acquire()


class _Pending:
    __slots__ = (
        "create", "done", "draft", "error", "future", "head", "hook", "lazy", "log", "result",
        "then",
    )  # fmt: skip

    def __init__(
        self,
        log: str,
        draft: EventDraft,
        hook: TxHook | None,
        create: bool,
        future: asyncio.Future[Appended] | None = None,
        then: Followup | None = None,
        lazy: bool = False,
    ) -> None:
        self.log = log
        self.lazy = lazy
        # Here, in the caller's thread (and context): the request's details it carries.
        draft = with_request_details(draft)
        self.draft = draft
        self.hook = hook
        self.create = create
        self.then = then
        # Either a thread waits on ``done`` or a coroutine awaits ``future``.
        self.done = _Done() if future is None else None
        self.future = future
        self.result: Appended | None = None
        self.error: BaseException | None = None
        # A plain event's bytes up to its seq, made here in the caller's thread: the
        # writer adds only seq, tenant and time, under the log's lock.
        self.head = _event_head(draft) if hook is None and then is None and not create else None


#: The keys of an event that sort after every key its draft gives (RFC 8785 order):
#: what the writer adds to an event's head under the lock.
_TAIL_KEYS = ("seq", "tenant", "time", "v")


def _event_head(draft: EventDraft) -> bytes | None:
    """``canonical_event(draft.to_event(seq, time, tenant))`` up to the value of
    ``seq``: an object's canonical form is its members in key order, and the keys
    the ledger sets sort last (held by tests/unit/test_ledger_event_head.py). None if
    the draft cannot be encoded: the writer meets the same error and fails the
    append with it, as it did before heads were made ahead."""
    event = draft.to_event(0, "", "")
    for key in _TAIL_KEYS:
        del event[key]
    try:
        return canonical_event(event)[:-1] + b',"seq":'
    except ProctorError:
        return None


def _event_tail(tenant: str, time: str) -> bytes:
    """What follows ``seq``'s value in an event of ``tenant`` at ``time``."""
    return b"," + canonical_json({"tenant": tenant, "time": time, "v": EVENT_VERSION})[1:]


def _running_loop() -> asyncio.AbstractEventLoop:
    """The calling coroutine's event loop. Its caller imported asyncio; an import
    statement here would cost a look-up at every append."""
    loop: asyncio.AbstractEventLoop = sys.modules["asyncio"].get_running_loop()
    return loop


def _settle(items: list[_Pending]) -> None:
    """Runs in the event loop: resolve the futures of one batch at once."""
    for item in items:
        fut = item.future
        if fut is None or fut.done():
            continue
        error = item.error
        if error is not None:
            fut.set_exception(error)
        elif item.result is not None:
            fut.set_result(item.result)


def _wake(batch: list[_Pending]) -> None:
    loops: dict[asyncio.AbstractEventLoop, list[_Pending]] = {}
    for item in batch:
        done = item.done
        if done is not None:
            done.set()
            continue
        fut = item.future
        if fut is not None:
            loop = fut.get_loop()
            waiting = loops.get(loop)
            if waiting is None:
                loops[loop] = [item]
            else:
                waiting.append(item)
    # One wake-up per event loop per batch, not one per event.
    for loop, items in loops.items():
        with suppress(RuntimeError):  # a closed loop has nobody waiting any more
            loop.call_soon_threadsafe(_settle, items)


def _observe(rows: Sequence[tuple[str, int, str, bytes, str | None]], seconds: float) -> None:
    """A commit's metrics: its events per log, its size and how long it took (the
    writer's thread, once per batch: an event costs no metric of its own)."""
    if not rows:
        return
    m = metrics()
    m.ledger_batch.observe(len(rows))
    m.ledger_fsync_seconds.observe(seconds)
    first = rows[0][0]
    if all(row[0] == first for row in rows):
        m.ledger_appends.labels(tenant(first)).inc(len(rows))
        return
    per_log: dict[str, int] = {}
    for row in rows:
        per_log[row[0]] = per_log.get(row[0], 0) + 1
    for log, count in per_log.items():
        m.ledger_appends.labels(tenant(log)).inc(count)


def _event_bytes(item: _Pending, seq: int, time: str, tails: dict[tuple[str, str], bytes]) -> bytes:
    """The canonical bytes of a plain item's event at ``seq`` and ``time``."""
    head = item.head
    if head is None:
        return bounded_event(canonical_event(item.draft.to_event(seq, time, item.log)))
    key = (item.log, time)
    tail = tails.get(key)
    if tail is None:
        tail = tails[key] = _event_tail(item.log, time)
    return bounded_event(head + b"%d" % seq + tail)


class _LogState:
    """The writer's view of one log's right edge: peaks and the partial tiles."""

    def __init__(self, log: str, origin: str, last_time: str, tree: CompactRange) -> None:
        self.log = log
        self.origin = origin
        self.last_time = last_time
        self.tree = tree
        self.tiles: dict[int, tuple[int, bytearray]] = {}
        self.dirty: dict[tuple[int, int], bytearray] = {}

    @classmethod
    def load(cls, conn: Conn, log: str, cache: FullTileCache) -> _LogState | None:
        row = conn.query_one(
            "SELECT origin, size, last_time FROM ledger_logs WHERE log = ?", (log,)
        )
        if row is None:
            return None
        return cls.from_edge(TileNodes(conn, log, cache), str(row[0]), int(row[1]), str(row[2]))

    @classmethod
    def from_edge(cls, nodes: TileNodes, origin: str, size: int, last_time: str) -> _LogState:
        """The right edge at ``size``, from the tiles ``nodes`` holds or reads: the
        partial tile of each level (every peak lies in one of them)."""
        log = nodes.log
        state = cls(log, origin, last_time, CompactRange.from_tree(nodes, size))
        level = 0
        while size >> (8 * level):
            index, width = divmod(size >> (8 * level), TILE_WIDTH)
            buf = bytearray(nodes.tile(level, index)[: width * 32]) if width else bytearray()
            if len(buf) != width * 32:
                raise LedgerError(f"log {log}: tile level {level} is damaged in the store")
            state.tiles[level] = (index, buf)
            level += 1
        return state

    def _add(self, level: int, h: bytes) -> None:
        at = self.tiles.get(level)
        if at is None:
            at = self.tiles[level] = (0, bytearray())
        index, buf = at
        buf += h  # in place: the tile in ``tiles`` grows too
        self.dirty[(level, index)] = buf
        if len(buf) == _TILE_BYTES:
            self.tiles[level] = (index + 1, bytearray())

    def push(self, leaf: bytes) -> None:
        """CompactRange.push, inline (once per event on the writer's path), with
        each node at a tile level (every 8th height) added to its tile."""
        at = self.tiles.get(0)
        if at is None:
            self._add(0, leaf)
        else:
            index, buf = at
            buf += leaf  # in place: the tile in ``tiles`` grows too
            self.dirty[(0, index)] = buf
            if len(buf) == _TILE_BYTES:
                self.tiles[0] = (index + 1, bytearray())
        tree = self.tree
        peaks = tree.peaks
        height, h = 0, leaf
        while peaks and peaks[-1][0] == height:
            h = _sha256(b"\x01" + peaks.pop()[1] + h).digest()
            height += 1
            if not height & 7:
                self._add(height >> 3, h)
        peaks.append((height, h))
        tree.size += 1


class Ledger:
    """Append-only Merkle logs, one per tenant plus the runtime's ``system`` log.

    One writer thread takes appends from a queue and commits them in batches:
    one transaction, one fsync and one signed checkpoint per log per batch
    (group commit). :meth:`append` returns only once its event is durable; if
    it cannot be made durable, :meth:`append` raises :class:`LedgerError` and
    the caller must refuse whatever the event was recording.
    """

    def __init__(
        self,
        store: Store,
        signer: Signer,
        trust_domain: str,
        *,
        max_batch: int = 2048,
        clock: Callable[[], str] = utc_now,
        linger: float = 0.005,
    ) -> None:
        # ``clock`` gives each batch its time (RFC 3339 UTC); a test of retention
        # back-dates a year of events through it instead of writing rows by hand.
        self._clock = clock
        self._store = store
        self._signer = signer
        self._origin_signers: dict[str, Signer] = {}
        self._trust_domain = trust_domain
        self._max_batch = max_batch
        # How long a batch of events nobody waits on (append_later) may wait for
        # one somebody does, so that both share one commit and one fsync.
        self._linger = linger
        self._queue: queue.SimpleQueue[_Pending | _Done | None] = queue.SimpleQueue()
        self._states: dict[str, _LogState] = {}
        self._cache = FullTileCache()
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()
        self._closed = False
        # The last batch that could not be made durable (wall time, why), cleared by
        # the next that could: readiness reads it (lifecycle's ledger check).
        self._failure: tuple[float, str] | None = None
        self._fence: Fence | None = None
        # PostgreSQL: the right edge comes with the head, and a batch's rows go in
        # one statement (see _EDGES and _WRITE_BATCH); SQLite keeps the plain path.
        self._pg = store.engine is Engine.POSTGRESQL
        # PostgreSQL: BEGIN and the locks go with the batch's first statement, which
        # reads the heads of its logs (_edges): one round trip to lock and read.
        self._write = getattr(store, "write_lazy", store.write)
        self._edges: dict[str, list[Row]] = {}
        # An item the writer took from the queue after taking a batch's locks that
        # those locks do not cover: the next batch starts with it, keeping the order.
        self._carry: _Pending | None = None
        self._stopping = False

    # -- identity -----------------------------------------------------------

    def now(self) -> str:
        """The time the ledger gives the next batch (its clock's)."""
        return self._clock()

    @property
    def signer_name(self) -> str:
        return self._signer.name

    def _origin_signer(self, origin: str) -> Signer:
        signer = self._origin_signers.get(origin)
        if signer is None:
            signer = self._origin_signers[origin] = self._signer.named(origin)
        return signer

    def _sign(self, checkpoint: Checkpoint) -> str:
        # Signed under the log's origin (C2SP tlog-checkpoint: the key name SHOULD be
        # the origin), then under the runtime's own name, which every verifier key
        # given out before per-origin names (and every older checkpoint) carries.
        return self._origin_signer(checkpoint.origin).sign_note(checkpoint.body(), self._signer)

    def origin(self, log: str) -> str:
        if log == SYSTEM_LOG:
            return f"{self._trust_domain}/system"
        return f"{self._trust_domain}/tenant/{log}"

    def vkey(self, log: str | None = None) -> str:
        """The verifier key line: the runtime's (it verifies every checkpoint of every
        log), or, given ``log``, the one named for that log's origin (it verifies the
        log's checkpoints signed since per-origin names; what standard tools expect)."""
        if log is None:
            return self._signer.verifier.vkey()
        return self._origin_signer(self.origin(log)).verifier.vkey()

    # -- writing ------------------------------------------------------------

    def set_fence(self, fence: Fence | None) -> None:
        """Run ``fence(conn)`` inside every transaction the writer commits (every
        batch of appends, whatever the path), before its COMMIT (on PostgreSQL
        before the batch's one statement, which goes with the COMMIT; after the
        writes on SQLite); ``None`` removes it. If it raises a :class:`ProctorError`, the
        transaction rolls back and every append of that batch fails with that very
        error (another exception fails them as a store failure does)."""
        self._fence = fence

    def create_log(
        self,
        log: str,
        first: EventDraft,
        hook: TxHook | None = None,
        then: Followup | None = None,
    ) -> Appended:
        """Create ``log`` with ``first`` as its event 0, atomically with ``hook``'s
        writes and with the ``then`` event in another log."""
        return self._submit(_Pending(log, first, hook, create=True, then=then))

    def append(
        self,
        log: str,
        draft: EventDraft,
        hook: TxHook | None = None,
        then: Followup | None = None,
    ) -> Appended:
        """Append one event; returns once it is durable. ``hook``'s writes and the
        ``then`` event in another log commit with it, or nothing does."""
        return self._submit(_Pending(log, draft, hook, create=False, then=then))

    def append_many(self, log: str, drafts: Sequence[EventDraft]) -> list[Appended]:
        """Append several events, in order; returns once all are durable.

        They share batches with everything else in flight; if any fails, the
        first error is raised after all have settled.
        """
        items = [_Pending(log, d, None, create=False) for d in drafts]
        if self._closed:
            raise LedgerError("the ledger is closed; the events were not recorded")
        self._ensure_writer()
        for item in items:
            self._queue.put(item)
        for item in items:
            assert item.done is not None
            item.done.wait()
        for item in items:
            if item.error is not None:
                raise item.error
        return [item.result for item in items if item.result is not None]

    def append_async(
        self, log: str, draft: EventDraft, hook: TxHook | None = None
    ) -> asyncio.Future[Appended]:
        """:meth:`append` for asyncio code (the broker): ``await`` it for durability.

        Queued when called (not when first awaited), and a future rather than a
        coroutine: one frame less on the broker's path for every event."""
        return self._queued(_Pending(log, draft, hook, False, _running_loop().create_future()))

    def append_later(self, log: str, draft: EventDraft) -> asyncio.Future[Appended]:
        """Queue one event that nobody waits on now (what a call learned after its
        answer); it commits with the next batch that somebody waits on, or after
        ``linger`` seconds at the latest. Queued now, in order: an event appended
        after this one never commits without it. The future settles as
        :meth:`append_async`'s would, in the calling event loop."""
        future = _running_loop().create_future()
        return self._queued(_Pending(log, draft, None, False, future, lazy=True))

    def _queued(self, item: _Pending) -> asyncio.Future[Appended]:
        """Queue ``item`` (its future made in the caller's loop) and return that future."""
        if self._closed:
            raise LedgerError("the ledger is closed; the event was not recorded")
        if self._thread is None:
            self._ensure_writer()
        assert item.future is not None
        self._queue.put(item)
        return item.future

    def flush(self) -> None:
        """Return once everything queued before now is committed (or failed): the
        lazy events of :meth:`append_later` included."""
        if self._closed or self._thread is None:
            return
        barrier = _Done()
        self._queue.put(barrier)
        barrier.wait()

    def _submit(self, item: _Pending) -> Appended:
        if self._closed:
            raise LedgerError("the ledger is closed; the event was not recorded")
        self._ensure_writer()
        self._queue.put(item)
        assert item.done is not None
        item.done.wait()
        if item.error is not None:
            raise item.error
        assert item.result is not None
        return item.result

    def _ensure_writer(self) -> None:
        if self._thread is not None:
            return
        with self._start_lock:
            if self._thread is None:
                t = threading.Thread(target=self._run, name="proctor-ledger-writer", daemon=True)
                t.start()
                self._thread = t

    @property
    def closed(self) -> bool:
        """Closed: this ledger records nothing more."""
        return self._closed

    @property
    def last_failure(self) -> tuple[float, str] | None:
        """When (UTC seconds since the epoch) and why the last batch could not be made
        durable, if no batch has been since; None otherwise."""
        return self._failure

    def close(self) -> None:
        """Finish pending appends and stop the writer."""
        if self._closed:
            return
        self._closed = True
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
        # A flush that raced the close: nothing more will be committed.
        with suppress(queue.Empty):
            while True:
                left = self._queue.get_nowait()
                if isinstance(left, _Done):
                    left.set()

    def _run(self) -> None:
        stop = False
        while not stop:
            first: _Pending | _Done | None = self._carry
            if first is None:
                first = self._queue.get()
            else:
                self._carry = None
            if first is None:
                break
            batch, barriers, stop = self._gather(first)
            if batch:
                rows = None
                began = time.perf_counter()
                try:
                    rows = self._commit(batch, barriers)
                except BaseException as exc:
                    self._failure = (time.time(), _why(exc))
                    # Every waiter must be woken, whatever went wrong.
                    self._fail(batch, exc)
                took = time.perf_counter() - began
                _wake(batch)
                # Counted once the waiters are woken: no append waits on its metrics.
                if rows is None:
                    metrics().ledger_write_failures.inc()
                else:
                    self._failure = None
                    _observe(rows, took)
                stop = stop or self._stopping
            for barrier in barriers:
                barrier.set()

    def _drain(self, batch: list[_Pending], logs: set[str], barriers: list[_Done]) -> None:
        """Add to ``batch`` what was queued while its locks were awaited: on a log
        another node holds, the appends that came meanwhile join this batch instead
        of waiting for the next turn of the lock. Stops at the first item the held
        locks do not cover (carried to the next batch: appends keep their order)."""
        get_nowait, max_batch = self._queue.get_nowait, self._max_batch
        while len(batch) < max_batch:
            try:
                item = get_nowait()
            except queue.Empty:
                return
            if type(item) is _Pending:
                if item.log in logs and (item.then is None or item.then[0] in logs):
                    batch.append(item)
                else:
                    self._carry = item
                    return
            elif item is None:
                self._stopping = True
                return
            else:
                assert isinstance(item, _Done)
                barriers.append(item)

    def _gather(self, first: _Pending | _Done) -> tuple[list[_Pending], list[_Done], bool]:
        """``first`` and what else is queued: the batch, the flushes it ends, and
        whether to stop after it. A batch of lazy events only waits up to
        ``linger`` for something that is not."""
        batch: list[_Pending] = []
        barriers: list[_Done] = []
        lazy = True
        deadline = 0.0
        item: _Pending | _Done | None = first
        get_nowait, max_batch = self._queue.get_nowait, self._max_batch
        while True:
            if type(item) is _Pending:
                batch.append(item)
                if lazy and not item.lazy:
                    lazy = False
                if len(batch) >= max_batch:
                    break
            elif item is None:
                return batch, barriers, True
            else:
                assert isinstance(item, _Done)
                barriers.append(item)
                lazy = False
            try:
                item = get_nowait()
            except queue.Empty:
                if not lazy:
                    break
                now = time.monotonic()
                deadline = deadline or now + self._linger
                if now >= deadline:
                    break
                try:
                    item = self._queue.get(timeout=deadline - now)
                except queue.Empty:
                    break
        return batch, barriers, False

    def _fail(self, batch: list[_Pending], exc: BaseException) -> None:
        error: ProctorError
        if isinstance(exc, _Fenced):
            error = exc.error
        elif isinstance(exc, LedgerError):
            error = exc
        else:
            why = exc.message if isinstance(exc, ProctorError) else str(exc) or type(exc).__name__
            error = LedgerError(f"the ledger could not record the event durably: {why}")
        for item in batch:
            # The in-memory right edge may be ahead of what was committed.
            self._states.pop(item.log, None)
            if item.then is not None:
                self._states.pop(item.then[0], None)
            item.result = None
            if item.error is None:
                item.error = error

    def _commit(
        self, batch: list[_Pending], barriers: list[_Done]
    ) -> list[tuple[str, int, str, bytes, str | None]]:
        """Commit ``batch`` (one transaction, one fsync); the rows it made durable."""
        logs = sorted({item.log for item in batch} | {i.then[0] for i in batch if i.then})
        rows: list[tuple[str, int, str, bytes, str | None]] = []
        # The batch's own events, for their results: item, its log's state, seq, leaf, bytes.
        own: list[tuple[_Pending, _LogState, int, bytes, bytes]] = []
        objects: list[tuple[str, int, tuple[LedgerObject, ...]]] = []
        touched: dict[str, _LogState] = {}
        self._edges = {}
        # The bytes after seq's value, per log and time (a batch's are mostly one).
        tails: dict[tuple[str, str], bytes] = {}
        with self._write(*(f"ledger:{log}" for log in logs)) as conn:
            if self._pg:
                self._read_edges(conn, logs)
            self._drain(batch, set(logs), barriers)
            now = self._clock()
            for item in batch:
                draft = item.draft
                if item.create or item.hook is not None or item.then is not None:
                    self._take_atomic(conn, item, now, touched, rows, own, objects)
                    continue
                # The common case, one event and nothing else: no savepoint, and the
                # event is made here rather than through _stage.
                log = item.log
                found = touched.get(log)
                if found is None:
                    found = self._prepare(conn, item, touched)
                    if found is None:
                        continue  # its error is set
                state = found
                seq = state.tree.size
                time = now if now > state.last_time else state.last_time
                try:
                    data = _event_bytes(item, seq, time, tails)
                except ProctorError as exc:
                    if item.error is None:
                        item.error = exc
                    continue
                leaf = _sha256(b"\x00" + data).digest()
                state.push(leaf)
                state.last_time = time
                # event_ref, inline: the draft's action and resource are strings.
                ref = draft.resource if draft.action in INDEXED_ACTIONS else None
                rows.append((log, seq, time, data, ref))
                own.append((item, state, seq, leaf, data))
                if draft.objects:
                    objects.append((log, seq, draft.objects))
            # Objects go in with their events, all of the batch at once, like the entries.
            store_objects(conn, objects, self._store.capabilities.bulk_insert)
            if self._pg:
                notes = self._write_batch(conn, rows, touched)
            else:
                conn.executemany(_INSERT_ENTRY, rows)
                notes = {log: self._checkpoint(conn, log, state) for log, state in touched.items()}
                if self._fence is not None:
                    self._check_fence(conn)
        # Durable from here on: the transaction committed.
        self._states.update(touched)
        for item, state, seq, leaf, data in own:
            log = item.log
            item.result = _new_tuple(Appended, (log, seq, leaf, state.tree.size, notes[log], data))
        return rows

    def _check_fence(self, conn: Conn) -> None:
        fence = self._fence
        if fence is not None:
            try:
                fence(conn)
            except ProctorError as exc:
                raise _Fenced(exc) from exc

    def _take_atomic(
        self,
        conn: Conn,
        item: _Pending,
        now: str,
        touched: dict[str, _LogState],
        rows: list[tuple[str, int, str, bytes, str | None]],
        own: list[tuple[_Pending, _LogState, int, bytes, bytes]],
        objects: list[tuple[str, int, tuple[LedgerObject, ...]]],
    ) -> None:
        """Stage an item that writes more than its event (see :meth:`_stage_atomic`)
        and add its events to the batch's rows."""
        staged = self._stage_atomic(conn, item, now, touched)
        if staged is None:
            return
        # The in-memory right edges move only once nothing of the item can fail.
        for log, seq, at, data, ref, is_own in staged:
            leaf = _sha256(b"\x00" + data).digest()
            state = touched[log]
            state.push(leaf)
            state.last_time = at
            rows.append((log, seq, at, data, ref))
            if is_own:
                own.append((item, state, seq, leaf, data))
                if item.draft.objects:
                    objects.append((log, seq, item.draft.objects))

    def _write_batch(
        self,
        conn: Conn,
        rows: list[tuple[str, int, str, bytes, str | None]],
        touched: dict[str, _LogState],
    ) -> dict[str, str]:
        """PostgreSQL: the batch's events, changed tiles, heads and checkpoints in one
        statement, sent with the COMMIT (five round trips and the COMMIT's before);
        the fence, if any, runs first."""
        notes: dict[str, str] = {}
        tiles: list[tuple[str, int, int, bytes]] = []
        heads: list[tuple[str, int, bytes, str, str]] = []
        for log, state in touched.items():
            size = state.tree.size
            root = state.tree.root()
            note = notes[log] = self._sign(Checkpoint(state.origin, size, root))
            tiles.extend((log, lvl, idx, bytes(buf)) for (lvl, idx), buf in state.dirty.items())
            state.dirty.clear()
            heads.append((log, size, root, state.last_time, note))
        logs, seqs, times, datas, refs = _columns(rows, 5)
        at, starts = 1, []
        for data in datas:
            starts.append(at)
            at += len(data)
        if self._fence is not None:
            self._check_fence(conn)
        # Sent with the COMMIT where the store can: one round trip less under the lock.
        last = getattr(conn, "commit_with", conn.execute)
        last(
            _WRITE_BATCH,
            (
                b"".join(datas),
                list(logs),
                ",".join(map(str, seqs)),
                list(times),
                ",".join(map(str, starts)),
                ",".join(str(len(d)) for d in datas),
                list(refs),
                *(list(col) for col in _columns(tiles, 4)),
                *(list(col) for col in _columns(heads, 5)),
            ),
        )
        return notes

    def _checkpoint(self, conn: Conn, log: str, state: _LogState) -> str:
        """Write the log's changed tiles, its head and its signed checkpoint."""
        size = state.tree.size
        root = state.tree.root()
        note = self._sign(Checkpoint(state.origin, size, root))
        conn.executemany(
            _UPSERT_TILE, [(log, lvl, idx, bytes(buf)) for (lvl, idx), buf in state.dirty.items()]
        )
        state.dirty.clear()
        conn.execute(
            "UPDATE ledger_logs SET size = ?, root = ?, last_time = ?, checkpoint = ?"
            " WHERE log = ?",
            (size, root, state.last_time, note, log),
        )
        conn.execute(
            "INSERT INTO ledger_checkpoints (log, size, time, note) VALUES (?, ?, ?, ?)"
            " ON CONFLICT (log, size) DO NOTHING",
            (log, size, state.last_time, note),
        )
        return note

    def _stage_atomic(
        self, conn: Conn, item: _Pending, now: str, touched: dict[str, _LogState]
    ) -> list[_Staged] | None:
        """An item that writes more than its event (a new log, a hook's rows, a
        follow-up) does so inside a savepoint: all of it, or none (then its error is
        set and None returned)."""
        known = set(touched)
        conn.execute("SAVEPOINT item")
        try:
            own, follow = self._stage(conn, item, now, touched)
        except ProctorError as exc:
            conn.execute("ROLLBACK TO SAVEPOINT item")
            conn.execute("RELEASE SAVEPOINT item")
            for log in set(touched) - known:
                del touched[log]
            if item.error is None:
                item.error = exc
            return None
        conn.execute("RELEASE SAVEPOINT item")
        return [own] if follow is None else [own, follow]

    def _stage(
        self, conn: Conn, item: _Pending, now: str, touched: dict[str, _LogState]
    ) -> tuple[_Staged, _Staged | None]:
        """Write ``item``'s side effects and build its event (and its follow-up's)
        without moving any log's right edge; raises if any part cannot be done."""
        state = self._prepare(conn, item, touched)
        if state is None:
            assert item.error is not None
            raise item.error
        seq, time = state.tree.size, max(now, state.last_time)
        data = bounded_event(canonical_event(item.draft.to_event(seq, time, item.log)))
        if item.hook is not None:
            item.hook(conn)
        own = (item.log, seq, time, data, event_ref(item.draft.action, item.draft.resource), True)
        if item.then is None:
            return own, None
        other, make = item.then
        if other == item.log:
            raise UsageError("a follow-up event must go to another log")
        probe = _Pending(other, item.draft, None, create=False)
        ostate = self._prepare(conn, probe, touched)
        if ostate is None:
            assert probe.error is not None
            raise probe.error
        otime = max(now, ostate.last_time)
        odraft = make(leaf_hash(data))
        if odraft.objects:
            raise UsageError("a follow-up event carries no objects")
        odata = bounded_event(canonical_event(odraft.to_event(ostate.tree.size, otime, other)))
        oref = event_ref(odraft.action, odraft.resource)
        return own, (other, ostate.tree.size, otime, odata, oref, False)

    def _prepare(
        self, conn: Conn, item: _Pending, touched: dict[str, _LogState]
    ) -> _LogState | None:
        """The log's state inside this transaction, creating the log if asked."""
        state = touched.get(item.log)
        if item.create:
            if state is not None or conn.query_one(
                "SELECT 1 FROM ledger_logs WHERE log = ?", (item.log,)
            ):
                item.error = AlreadyExists(f"log {item.log!r} exists already")
                return None
            origin = self.origin(item.log)
            note = self._sign(Checkpoint(origin, 0, EMPTY_ROOT))
            conn.execute(
                "INSERT INTO ledger_logs (log, origin, size, root, last_time, checkpoint)"
                " VALUES (?, ?, 0, ?, '', ?)",
                (item.log, origin, EMPTY_ROOT, note),
            )
            state = _LogState(item.log, origin, "", CompactRange())
            touched[item.log] = state
            return state
        if state is not None:
            return state
        cached = self._states.get(item.log)
        read = self._edge if self._pg else self._reload
        state = read(conn, item.log, cached)
        if state is None:
            item.error = NotFound(f"no log {item.log!r}: unknown tenant")
            return None
        touched[item.log] = state
        return state

    def _reload(self, conn: Conn, log: str, cached: _LogState | None) -> _LogState | None:
        """``cached`` if the log's head is still at its size, else the log's right
        edge as stored (another process or node appended); None: no such log."""
        row = conn.query_one("SELECT size FROM ledger_logs WHERE log = ?", (log,))
        if row is None:
            return None
        if cached is not None and cached.tree.size == int(row[0]):
            return cached
        return _LogState.load(conn, log, self._cache)

    def _read_edges(self, conn: Conn, logs: Sequence[str]) -> None:
        """The heads of ``logs`` (and the right edges of those another node appended
        to) for :meth:`_edge`, in one query: the batch's first, sent with its BEGIN
        and locks, so it answers as soon as the locks are granted."""
        known = []
        for log in logs:
            cached = self._states.get(log)
            known.append(-1 if cached is None else cached.tree.size)
        edges: dict[str, list[Row]] = {log: [] for log in logs}
        for row in conn.query(_EDGES, (list(logs), known)):
            edges[str(row[0])].append(row)
        self._edges = edges

    def _edge(self, conn: Conn, log: str, cached: _LogState | None) -> _LogState | None:
        """:meth:`_reload` on PostgreSQL: the head, and the right edge's tiles only
        when another node appended, read with the batch's first statement."""
        edge = self._edges.pop(log, None)
        if edge is None:
            # Not read ahead (a test calls this alone).
            known = -1 if cached is None else cached.tree.size
            edge = conn.query(_EDGES, ([log], [known]))
        if not edge:
            return None
        size = int(edge[0][1])
        if cached is not None and cached.tree.size == size:
            return cached
        tiles = {(int(r[4]), int(r[5])): bytes(r[6]) for r in edge if r[4] is not None}
        nodes = TileNodes(conn, log, self._cache, tiles)
        return _LogState.from_edge(nodes, str(edge[0][2]), size, str(edge[0][3]))

    # -- reading ------------------------------------------------------------

    def logs(self) -> list[str]:
        with self._store.read() as conn:
            return [str(r[0]) for r in conn.query("SELECT log FROM ledger_logs ORDER BY log")]

    def head(self, log: str) -> LogHead:
        with self._store.read() as conn:
            return self._head(conn, log)

    def _head(self, conn: Conn, log: str) -> LogHead:
        row = conn.query_one(
            "SELECT origin, size, root, checkpoint FROM ledger_logs WHERE log = ?", (log,)
        )
        if row is None:
            raise NotFound(f"no log {log!r}: unknown tenant")
        return LogHead(log, str(row[0]), int(row[1]), bytes(row[2]), str(row[3]))

    def checkpoints(self, log: str) -> list[tuple[int, str, str]]:
        """Every stored checkpoint of ``log`` as (size, time, signed note), oldest first."""
        with self._store.read() as conn:
            self._head(conn, log)
            rows = conn.query(
                "SELECT size, time, note FROM ledger_checkpoints WHERE log = ? ORDER BY size",
                (log,),
            )
        return [(int(r[0]), str(r[1]), str(r[2])) for r in rows]

    def entries(self, log: str, start: int = 0, end: int | None = None) -> Iterator[bytes]:
        """The event bytes of ``log`` from ``start`` (inclusive) to ``end`` (exclusive)."""
        with self._store.read() as conn:
            self._head(conn, log)
            if end is None:
                rows = conn.iterate(
                    "SELECT data FROM ledger_entries WHERE log = ? AND seq >= ? ORDER BY seq",
                    (log, start),
                )
            else:
                rows = conn.iterate(
                    "SELECT data FROM ledger_entries WHERE log = ? AND seq >= ? AND seq < ?"
                    " ORDER BY seq",
                    (log, start, end),
                )
            for row in rows:
                yield bytes(row[0])

    def events_between(
        self, log: str, since: str | None = None, until: str | None = None
    ) -> Iterator[bytes]:
        """Event bytes whose ``time`` lies in [since, until), by the time index."""
        clauses, params = ["log = ?"], [log]
        if since is not None:
            clauses.append("time >= ?")
            params.append(since)
        if until is not None:
            clauses.append("time < ?")
            params.append(until)
        sql = f"SELECT data FROM ledger_entries WHERE {' AND '.join(clauses)} ORDER BY seq"  # noqa: S608 - fixed clauses
        with self._store.read() as conn:
            self._head(conn, log)
            for row in conn.iterate(sql, params):
                yield bytes(row[0])

    def _sizes(self, conn: Conn, log: str, size: int | None) -> tuple[LogHead, int]:
        head = self._head(conn, log)
        if size is None:
            size = head.size
        if not 0 < size <= head.size:
            raise UsageError(f"size {size} is out of range: log {log!r} has {head.size} events")
        return head, size

    def inclusion_proof(self, log: str, index: int, size: int | None = None) -> InclusionProof:
        with self._store.read() as conn:
            _, size = self._sizes(conn, log, size)
            if not 0 <= index < size:
                raise UsageError(
                    f"index {index} is out of range: the tree of log {log!r} at size "
                    f"{size} holds indexes 0 to {size - 1}"
                )
            nodes = TileNodes(conn, log, self._cache)
            path = inclusion_path(nodes, index, size)
            return InclusionProof(index, size, nodes(index, 0), tuple(path))

    def consistency_proof(self, log: str, old: int, new: int | None = None) -> ConsistencyProof:
        with self._store.read() as conn:
            _, new = self._sizes(conn, log, new)
            if not 0 < old <= new:
                raise UsageError(f"old size {old} must be between 1 and {new}")
            path = consistency_path(TileNodes(conn, log, self._cache), old, new)
            return ConsistencyProof(old, new, tuple(path))

    def root_at(self, log: str, size: int) -> bytes:
        with self._store.read() as conn:
            _, size = self._sizes(conn, log, size)
            return root_from(TileNodes(conn, log, self._cache), size)

    def tile(self, log: str, level: int, index: int) -> bytes:
        with self._store.read() as conn:
            self._head(conn, log)
            return TileNodes(conn, log, self._cache).tile(level, index)

    # -- verification and export -------------------------------------------

    def verify(self, log: str, trusted: Sequence[str] = ()) -> VerifyReport:
        """Recompute ``log`` from its stored events; see :func:`verify_log`.

        ``trusted`` are signed checkpoints held outside the store (an auditor's
        copy): the log must be consistent with them too.
        """
        with self._store.read() as conn:
            head = self._head(conn, log)
            notes = [
                str(r[0])
                for r in conn.query(
                    "SELECT note FROM ledger_checkpoints WHERE log = ? ORDER BY size", (log,)
                )
            ]
            notes.append(head.checkpoint)
            notes.extend(trusted)
            raw = TileNodes(conn, log, FullTileCache(capacity=16))
            # The rows' ref column where set: few rows (the governance events), read
            # through its partial index (the log unindexed, or SQLite walks the log).
            by_ref = (
                "SELECT seq, ref FROM ledger_entries"  # noqa: S608 - fixed text, no input
                f" WHERE ref IS NOT NULL AND {self._store.unindexed('log')} = ?"
            )
            refs = {int(r[0]): str(r[1]) for r in conn.query(by_ref, (log,))}
            entries = (
                bytes(r[0])
                for r in conn.iterate(
                    "SELECT data FROM ledger_entries WHERE log = ? ORDER BY seq", (log,)
                )
            )
            return verify_log(
                origin=head.origin,
                tenant=log,
                entries=entries,
                checkpoints=notes,
                verifier=self._signer.verifier,
                head=(head.size, head.root),
                tiles=raw.tile,
                refs=refs,
            )

    def export(self, log: str, out: Path) -> LogHead:
        """Write ``log`` so that :func:`verify_export` needs nothing else.

        Layout: ``events.jsonl`` (the hashed bytes, one per line),
        ``checkpoints.jsonl``, ``checkpoint`` (the latest signed note, as
        signed), ``verifier.key``, ``log.json``, and next to them a complete
        static C2SP tlog-tiles tree laid out as the API serves it, so that any
        static file server or object store serves it to standard tlog clients:
        ``checkpoint``, every full tile at every level and every full entry
        bundle (``tile/entries/...``), the partial tiles of every checkpoint size
        the log has signed (a client holding an older checkpoint proves against
        it), and the partial bundles of the checkpoint sizes in the last bundle
        (see :func:`partial_widths`). A bundle that would hold an event over 65,535 bytes
        (possible only in a log written before events were bounded) is left out
        and named in ``log.json`` (``unbundled``).
        """
        out.mkdir(parents=True, exist_ok=True)
        if any(out.iterdir()):
            raise UsageError(f"export directory {out} is not empty")
        with self._store.read() as conn:
            head = self._head(conn, log)
            sizes: list[int] = []
            with (out / "checkpoints.jsonl").open("wb") as f:
                for size, time, note in conn.query(
                    "SELECT size, time, note FROM ledger_checkpoints"
                    " WHERE log = ? AND size <= ? ORDER BY size",
                    (log, head.size),
                ):
                    sizes.append(int(size))
                    f.write(canonical_json({"size": size, "time": time, "note": note}) + b"\n")
            widths = partial_widths(head.size, sizes)
            bundles = _Bundles(head.size, widths, lambda rel, b: _write_file(out / rel, b))
            with (out / "events.jsonl").open("wb") as f:
                for row in conn.iterate(
                    "SELECT data FROM ledger_entries WHERE log = ? AND seq < ? ORDER BY seq",
                    (log, head.size),
                ):
                    data = bytes(row[0])
                    f.write(data + b"\n")
                    bundles.add(data)
            nodes = TileNodes(conn, log, self._cache)
            level = 0
            while head.size >> (8 * level):
                count = head.size >> (8 * level)
                for index in range((count + TILE_WIDTH - 1) // TILE_WIDTH):
                    tile = nodes.tile(level, index)
                    width = min(TILE_WIDTH, count - index * TILE_WIDTH)
                    for w in sorted({width} | widths.get((level, index), set())):
                        _write_file(out / tile_path(level, index, w), tile[: w * 32])
                level += 1
        (out / "checkpoint").write_text(head.checkpoint, encoding="utf-8")
        (out / "verifier.key").write_text(self.vkey() + "\n", encoding="utf-8")
        meta: dict[str, Any] = {
            "format": EXPORT_FORMAT,
            "log": log,
            "origin": head.origin,
            "size": head.size,
            "root": base64.b64encode(head.root).decode(),
            "tree": TREE_COMPLETE,
        }
        if bundles.skipped:
            meta["unbundled"] = bundles.skipped
        (out / "log.json").write_bytes(canonical_json(meta) + b"\n")
        return head


#: ``log.json``'s ``tree`` in an export that holds the complete static tlog-tiles
#: tree (entry bundles, and the partial tiles of every checkpoint size).
TREE_COMPLETE = "c2sp-tlog-tiles"
_BUNDLE = "entries"


def partial_widths(size: int, sizes: Sequence[int]) -> dict[tuple[int | str, int], set[int]]:
    """The partial tiles (level, or ``"entries"`` for bundles, and index) and their
    widths that the trees of ``sizes`` (checkpoint sizes up to ``size``) need: every
    partial hash tile (a proof against an older checkpoint needs them), and the
    partial bundles of the one bundle not yet full. An older size's entries are
    the prefix of a full bundle, which C2SP tlog-tiles lets a client fetch instead
    once it exists; writing each of them again for every checkpoint would cost up to
    128 times the events' bytes in a log checkpointed at every event."""
    out: dict[tuple[int | str, int], set[int]] = {}
    for s in sizes:
        if not 0 < s <= size:
            continue
        if s % TILE_WIDTH and s // TILE_WIDTH == size // TILE_WIDTH:
            out.setdefault((_BUNDLE, s // TILE_WIDTH), set()).add(s % TILE_WIDTH)
        level = 0
        while s >> (8 * level):
            count = s >> (8 * level)
            if count % TILE_WIDTH:
                out.setdefault((level, count // TILE_WIDTH), set()).add(count % TILE_WIDTH)
            level += 1
    return out


def _write_file(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


class _Bundles:
    """Entry bundles (C2SP tlog-tiles: big-endian uint16 length, then the entry),
    built from the events in order; each is handed to ``sink`` with its path when
    its 256 entries, or the last entry of the tree, are in."""

    def __init__(
        self,
        size: int,
        widths: dict[tuple[int | str, int], set[int]],
        sink: Callable[[str, bytes], None],
    ) -> None:
        self._size = size
        self._widths = widths
        self._sink = sink
        self._buf = bytearray()
        self._ends: list[int] = []
        self._seq = 0
        self._fits = True
        self.skipped: list[int] = []

    def add(self, data: bytes) -> None:
        if len(data) > 0xFFFF:
            self._fits = False
        elif self._fits:
            self._buf += len(data).to_bytes(2, "big") + data
        self._ends.append(len(self._buf))
        self._seq += 1
        if len(self._ends) == TILE_WIDTH or self._seq == self._size:
            index = (self._seq - 1) // TILE_WIDTH
            if self._fits:
                n = len(self._ends)
                for w in sorted({n} | self._widths.get((_BUNDLE, index), set())):
                    self._sink(tile_path(_BUNDLE, index, w), bytes(self._buf[: self._ends[w - 1]]))
            else:
                self.skipped.append(index)
            self._buf.clear()
            self._ends.clear()
            self._fits = True


EXPORT_FORMAT = "proctor-ledger-export/1"


def verify_export(
    directory: Path, verifier: Verifier | None = None, trusted: Sequence[str] = ()
) -> VerifyReport:
    """Verify an exported log offline. Without ``verifier`` the export's own key is used."""
    try:
        meta = json.loads((directory / "log.json").read_bytes())
        if not isinstance(meta, dict) or meta.get("format") != EXPORT_FORMAT:
            raise VerificationFailed(f"{directory} is not a Proctor ledger export")
        if verifier is None:
            verifier = Verifier.parse((directory / "verifier.key").read_text(encoding="utf-8"))
        latest = (directory / "checkpoint").read_text(encoding="utf-8")
        notes = [latest, *trusted]
        with (directory / "checkpoints.jsonl").open("rb") as f:
            for line in f:
                notes.append(str(json.loads(line)["note"]))
        origin, log = str(meta["origin"]), str(meta["log"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise VerificationFailed(f"cannot read the export {directory}: {exc}") from exc

    def tiles(level: int, index: int) -> bytes:
        full = directory / tile_path(level, index)
        if full.is_file():
            return full.read_bytes()
        partials = full.parent / f"{full.name}.p"
        widths = sorted(int(p.name) for p in partials.glob("*") if p.name.isdigit())
        return (partials / str(widths[-1])).read_bytes() if widths else b""

    complete = meta.get("tree") == TREE_COMPLETE
    expected: dict[tuple[int | str, int], set[int]] = {}
    if complete:
        sizes = [open_checkpoint(n, verifier, origin).size for n in notes]
        expected = partial_widths(int(meta["size"]), sizes)

    def check_bundle(rel: str, data: bytes) -> None:
        try:
            stored = (directory / rel).read_bytes()
        except OSError as exc:
            raise VerificationFailed(f"the export's tree lacks the entry bundle {rel}") from exc
        if stored != data:
            raise VerificationFailed(
                f"the export's entry bundle {rel} does not hold the exported events"
            )

    bundles = _Bundles(int(meta.get("size", 0)), expected, check_bundle)

    def entries() -> Iterator[bytes]:
        try:
            with (directory / "events.jsonl").open("rb") as f:
                for line in f:
                    data = line.rstrip(b"\n")
                    if complete:
                        bundles.add(data)
                    yield data
        except OSError as exc:
            raise VerificationFailed(f"cannot read the export's events: {exc}") from exc

    has_tiles = (directory / "tile").is_dir()
    report = verify_log(
        origin=origin,
        tenant=log,
        entries=entries(),
        checkpoints=notes,
        verifier=verifier,
        tiles=tiles if has_tiles else None,
    )
    if complete:
        if report.size != int(meta["size"]):
            raise VerificationFailed(
                f"the export's log.json says {meta['size']} events; it holds {report.size}"
            )
        # Every older tree's partial tiles are prefixes of the tiles just checked.
        for (level, index), ws in sorted(expected.items(), key=str):
            if level == _BUNDLE:
                continue
            assert isinstance(level, int)
            whole = tiles(level, index)
            for w in ws:
                rel = tile_path(level, index, w)
                if not (directory / rel).is_file():
                    raise VerificationFailed(f"the export's tree lacks the partial tile {rel}")
                if (directory / rel).read_bytes() != whole[: w * 32]:
                    raise VerificationFailed(
                        f"the export's partial tile {rel} does not match the tree"
                    )
    return report


def _why(exc: BaseException) -> str:
    """A failed batch's cause in one line, for the operator (no event data in it)."""
    if isinstance(exc, _Fenced):
        return exc.error.message
    if isinstance(exc, ProctorError):
        return exc.message
    return f"{type(exc).__name__}: {str(exc)[:200]}"
