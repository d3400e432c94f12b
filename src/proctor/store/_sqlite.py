from __future__ import annotations

import sqlite3
import threading
from collections.abc import Iterable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, suppress
from pathlib import Path
from typing import Any

from proctor.errors import NotInitialized, StoreError
from proctor.store._base import Capabilities, Conflict, Engine, Row, apply_migrations
from proctor.store._migrations import SQLITE_MIGRATIONS

# Wait this long for another process's write lock before giving up. Long enough to
# ride out a large batch commit, short enough that a wedged peer shows up as an error.
_BUSY_TIMEOUT_MS = 30_000

# Another writer's row, not a failing store: the extended result codes of a unique
# index or primary key refusing a second row.
_CONFLICT_CODES = frozenset({
    getattr(sqlite3, "SQLITE_CONSTRAINT_UNIQUE", 2067),
    getattr(sqlite3, "SQLITE_CONSTRAINT_PRIMARYKEY", 1555),
})  # fmt: skip
_CAPABILITIES = Capabilities(bulk_insert=False, secure_delete=True, advisory_lock=False)


def _conflict(exc: sqlite3.IntegrityError) -> None:
    """Raise a unique violation as :class:`Conflict`; any other refusal (NOT NULL,
    CHECK, a foreign key) stays the driver's, which the write turns into a
    StoreError."""
    if getattr(exc, "sqlite_errorcode", None) in _CONFLICT_CODES:
        raise Conflict(f"the store refused a conflicting write: {exc}") from exc


class _SQLiteConn:
    __slots__ = ("_db",)

    def __init__(self, db: sqlite3.Connection) -> None:
        self._db = db

    def execute(self, sql: str, params: Sequence[Any] = ()) -> int:
        try:
            return self._db.execute(sql, params).rowcount
        except sqlite3.IntegrityError as exc:
            _conflict(exc)
            raise

    def executemany(self, sql: str, rows: Iterable[Sequence[Any]]) -> None:
        try:
            self._db.executemany(sql, rows)
        except sqlite3.IntegrityError as exc:
            _conflict(exc)
            raise

    def query(self, sql: str, params: Sequence[Any] = ()) -> list[Row]:
        try:
            return self._db.execute(sql, params).fetchall()
        except sqlite3.IntegrityError as exc:
            _conflict(exc)
            raise

    def query_one(self, sql: str, params: Sequence[Any] = ()) -> Row | None:
        try:
            row: Row | None = self._db.execute(sql, params).fetchone()
        except sqlite3.IntegrityError as exc:
            _conflict(exc)
            raise
        return row

    def iterate(self, sql: str, params: Sequence[Any] = (), chunk: int = 4096) -> Iterator[Row]:
        cur = self._db.execute(sql, params)
        while rows := cur.fetchmany(chunk):
            yield from rows

    def secure_delete(self) -> None:
        # Freed and overwritten cells are zeroed, not left in free pages, until
        # SQLiteStore.scrub turns it off again for the writer.
        self._db.execute("PRAGMA secure_delete = ON")


class SQLiteStore:
    """The embedded engine: one file, WAL, ``synchronous=FULL``, one writer.

    Writers are serialised twice: a thread lock inside this process, and
    SQLite's own ``BEGIN IMMEDIATE`` file lock between processes (a CLI command
    and ``proctor serve`` may share a home). Readers get one connection per
    thread and never block the writer (WAL).
    """

    def __init__(self, path: Path, *, create: bool = False) -> None:
        self._path = path
        if not path.exists() and not create:
            raise NotInitialized(f"no Proctor store at {path}", hint="run `proctor init` first")
        self._local = threading.local()
        self._write_lock = threading.Lock()
        # Each connection with the thread it serves; the writer serves none and lives
        # until close().
        self._all: list[tuple[threading.Thread | None, sqlite3.Connection]] = []
        self._all_lock = threading.Lock()
        self._closed = False
        if not create:
            self._check_is_store()
        self._writer = self._connect(None)
        self._migrate()

    @property
    def engine(self) -> Engine:
        return Engine.SQLITE

    @property
    def capabilities(self) -> Capabilities:
        return _CAPABILITIES

    @property
    def url(self) -> str:
        return f"sqlite:///{self._path}"

    def unindexed(self, column: str) -> str:
        return f"+{column}"

    def try_lock(self, name: str) -> AbstractContextManager[None] | None:
        raise StoreError(
            f"the SQLite store {self._path} has no session locks ({name}):"
            " it belongs to one home, whose file lock is enough"
        )

    def scrub(self) -> None:
        self._check_open()
        with self._write_lock:
            db = self._writer
            with suppress(sqlite3.Error):
                db.execute("PRAGMA secure_delete = OFF")
            # The WAL may still hold page images from before a secure delete. A
            # reader's open snapshot can keep frames; a busy checkpoint is retried by
            # SQLite at the next one.
            with suppress(sqlite3.Error):
                db.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()

    def _connect(self, owner: threading.Thread | None) -> sqlite3.Connection:
        try:
            db = sqlite3.connect(
                self._path,
                isolation_level=None,
                check_same_thread=False,
                timeout=_BUSY_TIMEOUT_MS / 1000,
            )
            db.execute(f"PRAGMA busy_timeout={_BUSY_TIMEOUT_MS}")
            # Reading the schema forces SQLite to read the header: a file that
            # is not a database fails here, before anything is written.
            db.execute("PRAGMA schema_version").fetchone()
            mode = db.execute("PRAGMA journal_mode=WAL").fetchone()
            if mode is None or str(mode[0]).lower() != "wal":
                raise StoreError(f"cannot put {self._path} in WAL mode")
            # FULL: the WAL is fsync'd at every commit, so a returned commit
            # survives power loss, not only a process crash.
            db.execute("PRAGMA synchronous=FULL")
            db.execute("PRAGMA foreign_keys=ON")
        except sqlite3.DatabaseError as exc:
            raise self._cannot_open(exc) from exc
        with self._all_lock:
            # A reader of a thread that has ended is closed here: every run starts
            # threads of its own, and a long-lived server must not keep their
            # descriptors and page caches.
            alive: list[tuple[threading.Thread | None, sqlite3.Connection]] = []
            for thread, conn in self._all:
                if thread is None or thread.is_alive():
                    alive.append((thread, conn))
                else:
                    with suppress(sqlite3.Error):
                        conn.close()
            alive.append((owner, db))
            self._all = alive
        return db

    def _reader(self) -> sqlite3.Connection:
        db: sqlite3.Connection | None = getattr(self._local, "db", None)
        if db is None:
            db = self._connect(threading.current_thread())
            self._local.db = db
        return db

    def _check_open(self) -> None:
        if self._closed:
            raise StoreError("the store is closed")

    @contextmanager
    def read(self) -> Iterator[_SQLiteConn]:
        self._check_open()
        db = self._reader()
        try:
            db.execute("BEGIN")
            try:
                yield _SQLiteConn(db)
            finally:
                db.execute("COMMIT")
        except sqlite3.DatabaseError as exc:
            raise StoreError(f"cannot read the store {self._path}: {exc}") from exc

    @contextmanager
    def write(self, *locks: str) -> Iterator[_SQLiteConn]:
        # ``locks`` need nothing more here: the write lock below already makes
        # this the only writer of the whole database.
        del locks
        self._check_open()
        with self._write_lock:
            db = self._writer
            try:
                db.execute("BEGIN IMMEDIATE")
            except sqlite3.DatabaseError as exc:
                raise StoreError(f"cannot write the store {self._path}: {exc}") from exc
            try:
                yield _SQLiteConn(db)
            except BaseException as exc:
                with suppress(sqlite3.DatabaseError):
                    db.execute("ROLLBACK")
                if isinstance(exc, sqlite3.DatabaseError):
                    raise StoreError(f"cannot write the store {self._path}: {exc}") from exc
                raise
            try:
                db.execute("COMMIT")
            except sqlite3.DatabaseError as exc:
                # SQLite has rolled back already (the ROLLBACK is for the rare
                # error that leaves the transaction open).
                with suppress(sqlite3.DatabaseError):
                    db.execute("ROLLBACK")
                self._bury_failed_commit(db)
                raise StoreError(f"cannot write the store {self._path}: {exc}") from exc

    def _bury_failed_commit(self, db: sqlite3.Connection) -> None:
        """Make a failed commit's WAL frames unreachable, durably.

        A commit whose fsync of the WAL fails has already written every frame
        of the transaction, its commit frame included; SQLite reports the
        error and hides them from this process (the shared WAL index is not
        advanced), but the frames stay in the file with valid checksums. The
        next process to open the database rebuilds the index from the file
        and would bring the refused transaction back: events whose callers
        were told they were not recorded. The next commit is written over
        them and breaks their checksum chain, so one is made at once: a
        one-page write that changes nothing (``user_version`` set to itself),
        fsync'd. No setting does this: a checkpoint copies only committed
        frames and truncates the WAL only when no reader is left in it.
        If even this write fails the disk is failing; the next successful
        commit buries the frames the same way, and nothing is acknowledged
        before it. Only a crash before that commit can still let the refused
        transaction reappear (complete and signed, never half of it).
        """
        try:
            db.execute("BEGIN IMMEDIATE")
            row = db.execute("PRAGMA user_version").fetchone()
            db.execute(f"PRAGMA user_version = {int(row[0]) if row else 0}")
            db.execute("COMMIT")
        except sqlite3.DatabaseError:
            with suppress(sqlite3.DatabaseError):
                db.execute("ROLLBACK")

    def schema_version(self) -> int:
        with self.read() as conn:
            row = conn.query_one("SELECT MAX(version) FROM schema_migrations")
        return int(row[0]) if row and row[0] is not None else 0

    def _cannot_open(self, exc: sqlite3.Error) -> StoreError:
        corrupt = any(w in str(exc) for w in ("not a database", "malformed", "corrupt"))
        return StoreError(
            f"the store {self._path} cannot be opened: {exc}",
            hint="the file is not a Proctor database or it is corrupted"
            if corrupt
            else "check the disk (space, permissions) under the Proctor home",
        )

    def _check_is_store(self) -> None:
        """Refuse a file that holds no store (emptied, or another program's database)
        instead of making it a new, empty ledger. Read-only, before the connection
        that would switch the file to WAL (which writes its header); through SQLite,
        since a new store's pages may still be in the WAL only."""
        try:
            probe = sqlite3.connect(f"file:{self._path}?mode=ro", uri=True)
            try:
                found = probe.execute(
                    "SELECT 1 FROM sqlite_master WHERE type = 'table'"
                    " AND name = 'schema_migrations'"
                ).fetchone()
            finally:
                probe.close()
        except sqlite3.Error as exc:
            raise self._cannot_open(exc) from exc
        if found is None:
            raise NotInitialized(
                f"the file {self._path} holds no Proctor store (it is empty, or another"
                " program's database)",
                hint="restore the store from a backup, or run `proctor init` on a new home",
            )

    def _migrate(self) -> None:
        with self.write() as conn:
            conn.execute(
                "CREATE TABLE IF NOT EXISTS schema_migrations ("
                " version INTEGER PRIMARY KEY, applied_at TEXT NOT NULL)"
            )
            apply_migrations(
                conn, SQLITE_MIGRATIONS, str(self._path), "strftime('%Y-%m-%dT%H:%M:%fZ','now')"
            )

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with self._all_lock:
            for _, db in self._all:
                with suppress(sqlite3.Error):
                    db.close()
            self._all.clear()
