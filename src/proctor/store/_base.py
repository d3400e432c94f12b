from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Protocol

from proctor.errors import StoreError

Row = tuple[Any, ...]


class Engine(StrEnum):
    """The database engines a store can be: the one place their names are spelled."""

    SQLITE = "sqlite"
    POSTGRESQL = "postgresql"

    @property
    def clock(self) -> str:
        """An SQL expression for the database server's clock, in seconds since the
        epoch: nodes judge one another's leases by one clock, never their own."""
        if self is Engine.POSTGRESQL:
            return "EXTRACT(EPOCH FROM clock_timestamp())::float8"
        return "((julianday('now') - 2440587.5) * 86400.0)"

    @property
    def lock_shared(self) -> str:
        """What ends a SELECT to hold its rows against a concurrent UPDATE until the
        transaction ends (SQLite's one writer holds everything already)."""
        return " FOR SHARE" if self is Engine.POSTGRESQL else ""

    @property
    def lock_skip(self) -> str:
        """What ends a SELECT to lock the rows it returns and pass over rows another
        transaction holds (a work queue's take; SQLite's one writer takes alone)."""
        return " FOR UPDATE SKIP LOCKED" if self is Engine.POSTGRESQL else ""


@dataclass(frozen=True, slots=True)
class Capabilities:
    """What an engine can do beyond portable SQL. Callers ask these instead of
    testing the engine, so a third engine states its abilities in one place."""

    #: Many rows inserted by one statement over array parameters
    #: (``INSERT ... SELECT ... FROM unnest(?::bytea[], ?::bigint[])``): the
    #: ledger's lineage index, 100,000 keys in one round trip.
    bulk_insert: bool
    #: Deleted and overwritten content can be zeroed in the engine's own files
    #: (:meth:`Conn.secure_delete`, then :meth:`Store.scrub`); without it a
    #: deletion leaves old page images to the engine's own cleanup.
    secure_delete: bool
    #: Session locks shared by every process and node that opens the store
    #: (:meth:`Store.try_lock`); without them a store belongs to one home, whose
    #: file lock is enough.
    advisory_lock: bool


class Conflict(StoreError):
    """A statement lost to another writer: a unique key or index taken, or a
    serialization failure. Raised by :class:`Conn` on either engine, in place of
    the driver's own exception, so a caller that expects a race can tell it from
    a failing store. Like every store error it ends the write transaction."""


class Conn(Protocol):
    """One transaction's view of the store."""

    def execute(self, sql: str, params: Sequence[Any] = ()) -> int:
        """Run one statement; return the number of rows it changed. A unique
        violation or a serialization failure raises :class:`Conflict`."""
        ...

    def executemany(self, sql: str, rows: Iterable[Sequence[Any]]) -> None: ...

    def query(self, sql: str, params: Sequence[Any] = ()) -> list[Row]: ...

    def query_one(self, sql: str, params: Sequence[Any] = ()) -> Row | None: ...

    def iterate(self, sql: str, params: Sequence[Any] = (), chunk: int = 4096) -> Iterator[Row]:
        """Stream a large result without holding it all in memory."""
        ...

    def secure_delete(self) -> None:
        """Zero what this write deletes or overwrites in the engine's files, where
        :attr:`Capabilities.secure_delete` says the engine can (elsewhere nothing);
        :meth:`Store.scrub` ends it."""
        ...


class Store(Protocol):
    """A database engine holding Proctor's state."""

    @property
    def engine(self) -> Engine: ...

    @property
    def capabilities(self) -> Capabilities: ...

    @property
    def url(self) -> str: ...

    def unindexed(self, column: str) -> str:
        """``column`` as an expression whose own indexes the planner leaves alone, for a
        query meant to use another index (``ledger_entries_ref``): SQLite would
        otherwise take the primary key for an ``ORDER BY`` it also serves
        (``+column``); PostgreSQL weighs both itself (the column)."""
        ...

    def read(self) -> AbstractContextManager[Conn]:
        """A consistent snapshot for reading."""
        ...

    def write(self, *locks: str) -> AbstractContextManager[Conn]:
        """A write transaction, committed durably when the block ends.

        ``locks`` name resources (such as tenants' logs) that only one writer
        across every process and node may hold at a time. The block's
        changes are durable (fsync'd) when it exits without an exception; an
        exception rolls everything back and propagates as a ``StoreError``.
        """
        ...

    def try_lock(self, name: str) -> AbstractContextManager[None] | None:
        """Take the session lock ``name`` for every process and node that opens this
        store, held until the returned context exits (or the process dies); None if
        another holds it. Only where :attr:`Capabilities.advisory_lock`; elsewhere a
        :class:`StoreError`."""
        ...

    def scrub(self) -> None:
        """After a :meth:`Conn.secure_delete` write: end secure deletion and drop
        what the engine's files still keep of the old pages (SQLite: the WAL,
        truncated; a reader's open snapshot may keep frames until the next
        checkpoint). Nothing where the engine cannot."""
        ...

    def schema_version(self) -> int: ...

    def close(self) -> None: ...


def apply_migrations(
    conn: Conn, migrations: Sequence[Sequence[str]], where: str, applied_at: str
) -> None:
    """Bring a store at its recorded schema version to the latest of ``migrations``,
    in the caller's write transaction (one engine's list: version N is item N-1).
    ``applied_at`` is the engine's SQL for the current UTC time as RFC 3339 text."""
    row = conn.query_one("SELECT MAX(version) FROM schema_migrations")
    current = int(row[0]) if row and row[0] is not None else 0
    latest = len(migrations)
    if current > latest:
        raise StoreError(
            f"the store {where} has schema version {current}, newer than this "
            f"Proctor understands ({latest})",
            hint="upgrade Proctor",
        )
    for version in range(current + 1, latest + 1):
        for statement in migrations[version - 1]:
            conn.execute(statement)
        conn.execute(
            "INSERT INTO schema_migrations (version, applied_at)"  # noqa: S608
            f" VALUES (?, {applied_at})",
            (version,),
        )
