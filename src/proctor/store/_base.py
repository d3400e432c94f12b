from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol

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
