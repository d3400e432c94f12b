from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol

from proctor.errors import StoreError

Row = tuple[Any, ...]


class Conn(Protocol):
    """One transaction's view of the store."""

    def execute(self, sql: str, params: Sequence[Any] = ()) -> int:
        """Run one statement; return the number of rows it changed."""
        ...

    def executemany(self, sql: str, rows: Iterable[Sequence[Any]]) -> None: ...

    def query(self, sql: str, params: Sequence[Any] = ()) -> list[Row]: ...

    def query_one(self, sql: str, params: Sequence[Any] = ()) -> Row | None: ...

    def iterate(self, sql: str, params: Sequence[Any] = (), chunk: int = 4096) -> Iterator[Row]:
        """Stream a large result without holding it all in memory."""
        ...


class Store(Protocol):
    """A database engine holding Proctor's state."""

    @property
    def engine(self) -> str: ...

    @property
    def url(self) -> str: ...

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
