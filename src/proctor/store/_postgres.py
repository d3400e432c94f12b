"""The scale-out engine: PostgreSQL through psycopg 3.

Several runtime nodes (processes, machines) may open the same database. What
SQLite gets from its single writer, this engine gets from advisory locks:
``write(*locks)`` takes ``pg_advisory_xact_lock`` on each lock name's stable
64-bit hash, in sorted order (so two writers can never wait on each other in a
cycle), inside the transaction; the locks are released by its COMMIT or
ROLLBACK. A write that names no lock is a writer of the whole database, as on
SQLite: it takes one exclusive "database" lock that every named-lock writer
holds shared. Under the lock, READ COMMITTED sees every earlier writer's
commit, which is all the ledger needs (it re-reads its log's head after taking
the lock); SERIALIZABLE would only add retries.

Callers' portable SQL uses ``?`` placeholders; they become ``%s`` here, and a
literal ``%`` becomes ``%%``. Our SQL never puts ``?`` inside a string literal:
the translation refuses such a statement rather than guess.

Durability: ``synchronous_commit = on`` on every connection, so a returned
COMMIT is flushed to the server's WAL. Connections: one reader and one writer
per thread, opened on first use (the ledger's writer thread keeps its own).
"""

from __future__ import annotations

import hashlib
import itertools
import select
import threading
from collections.abc import Iterable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, suppress
from typing import Any

import psycopg
from psycopg import ServerCursor, errors

from proctor.errors import NotInitialized, StoreError
from proctor.store._base import Capabilities, Conflict, Engine, Row, apply_migrations
from proctor.store._pg_migrations import POSTGRES_MIGRATIONS
from proctor.store._pgtext import redact, to_pg_sql

# Wait this long for another node's lock before giving up: SQLite's busy timeout.
_LOCK_TIMEOUT = "30s"
_IDLE_IN_TX = "15s"
_TCP_USER_TIMEOUT_MS = 10_000
#: What libpq gives up after when the server stops answering (a cut network): a
#: connection or a read fails in about ten seconds instead of TCP's fifteen minutes.
_CUT_OFF: dict[str, Any] = {
    "connect_timeout": 10, "keepalives": 1, "keepalives_idle": 5, "keepalives_interval": 2,
    "keepalives_count": 3, "tcp_user_timeout": _TCP_USER_TIMEOUT_MS,
}  # fmt: skip
_DATABASE_LOCK = "proctor:database"
_MIGRATION_LOCK = "proctor:migrations"


_Statements = tuple[tuple[str, tuple[Any, ...]], ...]


def lock_key(name: str) -> int:
    """A lock name's stable signed 64-bit advisory lock key (the same on every node)."""
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "big", signed=True)


def _adapt(params: Sequence[Any]) -> tuple[Any, ...]:
    # SQLite stores a bool as 0/1 in an INTEGER column; PostgreSQL would refuse a
    # boolean there. memoryview (a SQLite blob spelling) becomes bytes.
    return tuple(
        int(p) if isinstance(p, bool) else bytes(p) if isinstance(p, memoryview) else p
        for p in params
    )


_cursor_names = itertools.count()

# Another writer won, the store is fine: a unique key or index taken (23505), or a
# transaction the server could not order after a concurrent one (40001, 40P01).
_CONFLICTS = (errors.UniqueViolation, errors.SerializationFailure, errors.DeadlockDetected)
_CAPABILITIES = Capabilities(bulk_insert=True, secure_delete=False, advisory_lock=True)


@contextmanager
def _conflicts() -> Iterator[None]:
    try:
        yield
    except _CONFLICTS as exc:
        raise Conflict(f"the store refused a conflicting write: {_first_line(exc)}") from exc


class _PGConn:
    __slots__ = ("_begin", "_cursors", "_db", "last")

    def __init__(self, db: psycopg.Connection[Any], begin: _Statements | None = None) -> None:
        self._db = db
        self._cursors: list[ServerCursor[Any]] = []
        # A read's BEGIN (a lazy write's BEGIN and locks) is sent in one round trip
        # with its first statement.
        self._begin = begin
        # A write's last statement, sent with its COMMIT (see commit_with).
        self.last: tuple[str, tuple[Any, ...]] | None = None

    @property
    def started(self) -> bool:
        return self._begin is None

    def _run(self, sql: str, params: Sequence[Any]) -> psycopg.Cursor[Any]:
        query, args = to_pg_sql(sql), _adapt(params)
        with _conflicts():
            if self._begin is None:
                return self._db.execute(query, args)
            begin, self._begin = self._begin, None
            with self._db.pipeline():
                for statement in begin:
                    self._db.execute(*statement)
                cur = self._db.execute(query, args)
        return cur

    def _start(self) -> None:
        if self._begin is not None:
            begin, self._begin = self._begin, None
            with self._db.pipeline():
                for statement in begin:
                    self._db.execute(*statement)

    def take_begin(self) -> _Statements:
        """What is still to be sent before this transaction's first statement."""
        begin, self._begin = self._begin or (), None
        return begin

    def execute(self, sql: str, params: Sequence[Any] = ()) -> int:
        return self._run(sql, params).rowcount

    def commit_with(self, sql: str, params: Sequence[Any] = ()) -> None:
        """Run ``sql`` as the write's last statement, sent in one round trip with
        its COMMIT (PostgreSQL only; a caller finds it with ``getattr``): under a
        lock another node waits for, one round trip less. Its result is not read;
        if it fails, the write fails as a failed COMMIT does, and nothing is
        committed. Nothing may run on this transaction after it."""
        if self.last is not None:
            raise StoreError("a write has one last statement")
        self.last = (to_pg_sql(sql), _adapt(params))

    def executemany(self, sql: str, rows: Iterable[Sequence[Any]]) -> None:
        batch = [_adapt(r) for r in rows]
        if batch:
            self._start()
            with self._db.cursor() as cur, _conflicts():
                cur.executemany(to_pg_sql(sql), batch)

    def query(self, sql: str, params: Sequence[Any] = ()) -> list[Row]:
        return self._run(sql, params).fetchall()

    def query_one(self, sql: str, params: Sequence[Any] = ()) -> Row | None:
        row: Row | None = self._run(sql, params).fetchone()
        return row

    def iterate(self, sql: str, params: Sequence[Any] = (), chunk: int = 4096) -> Iterator[Row]:
        # A server-side cursor: the result stays on the server, and other
        # statements may run on this transaction while it is being read.
        self._start()
        cur = self._db.cursor(name=f"proctor_iter_{next(_cursor_names)}")
        self._cursors.append(cur)
        cur.itersize = chunk
        cur.execute(to_pg_sql(sql), _adapt(params))
        while rows := cur.fetchmany(chunk):
            yield from rows
        cur.close()

    def secure_delete(self) -> None:
        """Nothing: PostgreSQL keeps a row's old versions until VACUUM, and its WAL
        until the server recycles it (``Capabilities.secure_delete`` is False)."""

    def end(self) -> None:
        """Close this transaction's cursors before it ends (an abandoned iterator
        must not try to close its cursor later, inside another transaction)."""
        for cur in self._cursors:
            with suppress(psycopg.Error):
                cur.close()
        self._cursors.clear()


class _Thread(threading.local):
    reader: psycopg.Connection[Any] | None = None
    writer: psycopg.Connection[Any] | None = None
    reading: _PGConn | None = None


class PostgresStore:
    """Proctor's state in one PostgreSQL database, shared by any number of nodes."""

    def __init__(self, dsn: str, *, create: bool = False) -> None:
        self._dsn = dsn
        self._local = _Thread()
        self._all: list[tuple[threading.Thread, psycopg.Connection[Any]]] = []
        self._all_lock = threading.Lock()
        self._closed = False
        try:
            self._migrate(create)
        except BaseException:
            self.close()
            raise

    @property
    def engine(self) -> Engine:
        return Engine.POSTGRESQL

    @property
    def capabilities(self) -> Capabilities:
        return _CAPABILITIES

    @property
    def url(self) -> str:
        return redact(self._dsn)

    def unindexed(self, column: str) -> str:
        return column

    def try_lock(self, name: str) -> AbstractContextManager[None] | None:
        """A session advisory lock on a connection of its own, so no transaction
        of this store ends it; closing that connection releases it."""
        self._check_open()
        try:
            db = psycopg.connect(self._dsn, autocommit=True, application_name="proctor lock")
        except psycopg.Error as exc:
            raise StoreError(
                f"cannot take the lock {name} on the store {self.url}: {_first_line(exc)}"
            ) from None
        try:
            row = db.execute("SELECT pg_try_advisory_lock(%s)", (lock_key(name),)).fetchone()
        except psycopg.Error as exc:
            with suppress(psycopg.Error):
                db.close()
            raise StoreError(
                f"cannot take the lock {name} on the store {self.url}: {_first_line(exc)}"
            ) from None
        if not (row and row[0]):
            with suppress(psycopg.Error):
                db.close()
            return None
        return _SessionLock(db, lock_key(name))

    def scrub(self) -> None:
        """Nothing to do: see ``_PGConn.secure_delete``."""

    @property
    def dsn(self) -> str:
        """The full DSN (with any password): only for the runtime's own connections."""
        return self._dsn

    # -- connections ----------------------------------------------------------

    def _connect(self) -> psycopg.Connection[Any]:
        try:
            db = psycopg.connect(self._dsn, autocommit=True, application_name="proctor",
                                 **_CUT_OFF)  # fmt: skip
            db.execute("SET synchronous_commit = on")
            db.execute(f"SET lock_timeout = '{_LOCK_TIMEOUT}'")
            # A node cut off in the middle of a transaction must not hold its locks
            # (a tenant log's, for every node) until TCP gives up, hours later.
            db.execute(f"SET idle_in_transaction_session_timeout = '{_IDLE_IN_TX}'")
            db.execute(f"SET tcp_user_timeout = {_TCP_USER_TIMEOUT_MS}")
            db.execute("SET TIME ZONE 'UTC'")
        except psycopg.Error as exc:
            raise StoreError(
                f"cannot connect to the store {self.url}: {_first_line(exc)}",
                hint="check that PostgreSQL is running and that the DSN, user and "
                "database are right",
            ) from exc
        me = threading.current_thread()
        with self._all_lock:
            # Connections of threads that have ended are closed here, not leaked.
            alive = []
            for thread, conn in self._all:
                if thread.is_alive():
                    alive.append((thread, conn))
                else:
                    with suppress(psycopg.Error):
                        conn.close()
            alive.append((me, db))
            self._all = alive
        return db

    def _usable(self, db: psycopg.Connection[Any] | None) -> psycopg.Connection[Any]:
        if db is None or db.closed or db.broken:
            return self._connect()
        if _hung_up(db):
            # The server ended this idle connection (a restart, a crash, an
            # administrator): psycopg only learns it at the next statement,
            # which would fail the caller's first call after the server is
            # back. A new connection now makes the recovery invisible.
            self._forget(db)
            return self._connect()
        return db

    def _forget(self, db: psycopg.Connection[Any]) -> None:
        """Drop a connection left in an unknown state (broken link, failed rollback)."""
        with suppress(psycopg.Error):
            db.close()
        if self._local.reader is db:
            self._local.reader = None
        if self._local.writer is db:
            self._local.writer = None

    def _check_open(self) -> None:
        if self._closed:
            raise StoreError("the store is closed")

    # -- transactions -----------------------------------------------------------

    @contextmanager
    def read(self) -> Iterator[_PGConn]:
        self._check_open()
        nested = self._local.reading
        if nested is not None:
            # A read inside a read on this thread shares its snapshot.
            yield nested
            return
        db = self._local.reader = self._usable(self._local.reader)
        conn = _PGConn(db, begin=(("BEGIN ISOLATION LEVEL REPEATABLE READ, READ ONLY", ()),))
        self._local.reading = conn
        ok = False
        try:
            yield conn
            ok = True
        except psycopg.Error as exc:
            raise StoreError(f"cannot read the store {self.url}: {_first_line(exc)}") from exc
        finally:
            self._local.reading = None
            self._finish(db, conn, commit=ok, what="read")

    def write(self, *locks: str) -> AbstractContextManager[_PGConn]:
        return self._write(locks, lazy=False)

    def write_lazy(self, *locks: str) -> AbstractContextManager[_PGConn]:
        """:meth:`write` whose BEGIN and locks go in one round trip with its first
        statement, whose answer therefore comes as soon as the locks are granted
        (the ledger's batch: its log's head). Nothing is locked before that
        statement, so only for a body that does nothing but statements; a caller
        finds it with ``getattr`` (PostgreSQL only)."""
        return self._write(locks, lazy=True)

    @contextmanager
    def _write(self, locks: tuple[str, ...], *, lazy: bool) -> Iterator[_PGConn]:
        self._check_open()
        db = self._local.writer = self._usable(self._local.writer)
        keys = sorted({lock_key(name) for name in locks})
        # BEGIN and every lock, in order, in one round trip.
        begin: _Statements = (
            ("BEGIN", ()),
            *(
                [("SELECT pg_advisory_xact_lock_shared(%s)", (lock_key(_DATABASE_LOCK),))]
                + [("SELECT pg_advisory_xact_lock(%s)", (key,)) for key in keys]
                if keys
                else [("SELECT pg_advisory_xact_lock(%s)", (lock_key(_DATABASE_LOCK),))]
            ),
        )
        conn = _PGConn(db, begin)
        if not lazy:
            try:
                conn.take_begin()
                with db.pipeline():
                    for statement in begin:
                        db.execute(*statement)
            except psycopg.Error as exc:
                self._finish(db, conn, commit=False, what="write")
                raise StoreError(f"cannot write the store {self.url}: {_first_line(exc)}") from exc
        ok = False
        try:
            yield conn
            ok = True
        except psycopg.Error as exc:
            self._finish(db, conn, commit=False, what="write")
            raise StoreError(f"cannot write the store {self.url}: {_first_line(exc)}") from exc
        except BaseException:
            self._finish(db, conn, commit=False, what="write")
            raise
        # The commit's failure is the write's failure: nothing was made durable.
        self._finish(db, conn, commit=ok, what="write")

    def _finish(
        self, db: psycopg.Connection[Any], conn: _PGConn, *, commit: bool, what: str
    ) -> None:
        conn.end()
        if db.closed or db.broken:
            self._forget(db)
            if commit:
                raise StoreError(f"cannot {what} the store {self.url}: the connection was lost")
            return
        if commit and conn.last is not None:
            self._commit_with(db, conn, conn.last, what)
            return
        if not conn.started:
            return  # a read (a lazy write) that ran no statement never began
        try:
            db.execute("COMMIT" if commit else "ROLLBACK")
        except psycopg.Error as exc:
            self._forget(db)
            if commit:
                raise StoreError(f"cannot {what} the store {self.url}: {_first_line(exc)}") from exc

    def _commit_with(
        self,
        db: psycopg.Connection[Any],
        conn: _PGConn,
        last: tuple[str, tuple[Any, ...]],
        what: str,
    ) -> None:
        """The last statement and COMMIT in one pipeline (after a lazy write's BEGIN
        and locks if it ran nothing else). If a statement fails, the server skips
        the rest (a pipeline stops at its first error) and the transaction is
        rolled back here."""
        try:
            with db.pipeline():
                for statement in conn.take_begin():
                    db.execute(*statement)
                db.execute(*last)
                db.execute("COMMIT")
        except psycopg.Error as exc:
            if db.closed or db.broken:
                self._forget(db)
            else:
                try:
                    db.execute("ROLLBACK")  # a warning only if the COMMIT had ended it
                except psycopg.Error:
                    self._forget(db)
            if isinstance(exc, _CONFLICTS):
                raise Conflict(
                    f"the store refused a conflicting write: {_first_line(exc)}"
                ) from exc
            raise StoreError(f"cannot {what} the store {self.url}: {_first_line(exc)}") from exc

    # -- schema -------------------------------------------------------------------

    def schema_version(self) -> int:
        with self.read() as conn:
            row = conn.query_one("SELECT MAX(version) FROM schema_migrations")
        return int(row[0]) if row and row[0] is not None else 0

    def _migrate(self, create: bool) -> None:
        with self.write() as conn:
            # Two nodes starting at once: the second waits, then finds nothing to do.
            conn.execute("SELECT pg_advisory_xact_lock(?)", (lock_key(_MIGRATION_LOCK),))
            exists = conn.query_one("SELECT to_regclass('schema_migrations') IS NOT NULL")
            if not (exists and exists[0]):
                if not create:
                    raise NotInitialized(
                        f"no Proctor store in {self.url}", hint="run `proctor init` first"
                    )
                conn.execute(
                    "CREATE TABLE schema_migrations ("
                    " version BIGINT PRIMARY KEY, applied_at TEXT NOT NULL)"
                )
            apply_migrations(
                conn,
                POSTGRES_MIGRATIONS,
                self.url,
                "to_char(now() AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.US\"Z\"')",
            )

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with self._all_lock:
            for _, db in self._all:
                with suppress(psycopg.Error):
                    db.close()
            self._all.clear()


class _SessionLock(AbstractContextManager[None]):
    """A held session lock: its connection, closed (and the lock with it) on exit."""

    def __init__(self, db: psycopg.Connection[Any], key: int) -> None:
        self._db = db
        self._key = key

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        # Unlocked before the close: a closed connection's server process lets go
        # of its locks only as it exits, a moment after, so a caller taking the
        # lock again at once would find it still held.
        with suppress(Exception):
            self._db.execute("SELECT pg_advisory_unlock(%s)", (self._key,))
        with suppress(Exception):
            self._db.close()


def _hung_up(db: psycopg.Connection[Any]) -> bool:
    """Whether the server spoke first on an idle connection: nothing is owed to
    it, so what waits is a closed socket or a farewell (FATAL) before one.
    A zero-timeout poll, no round trip."""
    try:
        fd = db.pgconn.socket
        readable, _, _ = select.select([fd], [], [], 0)
    except (psycopg.Error, OSError, ValueError):
        return True
    return bool(readable)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
