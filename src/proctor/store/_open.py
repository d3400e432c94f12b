from __future__ import annotations

from pathlib import Path

from proctor.errors import UsageError
from proctor.store._base import Store
from proctor.store._sqlite import SQLiteStore


def open_store(url: str, *, create: bool = False) -> Store:
    """Open the store at ``url``, migrating it: ``sqlite:///path`` or a bare path
    (SQLite), or ``postgresql://...`` / ``postgres://...`` (PostgreSQL).

    With ``create=False`` a missing database is an error rather than a new
    empty one, so a mistyped path never silently starts a fresh ledger. On
    PostgreSQL the database itself must exist; ``create`` decides whether an
    empty one receives Proctor's schema.
    """
    if url.startswith(("postgresql://", "postgres://")):
        try:
            from proctor.store._postgres import PostgresStore
        except ImportError as exc:  # psycopg is a dependency, but say so plainly
            raise UsageError(
                "the PostgreSQL engine needs psycopg 3, which is not installed",
                hint='pip install "psycopg[binary]"',
            ) from exc
        return PostgresStore(url, create=create)
    path = Path(url.removeprefix("sqlite:///") if url.startswith("sqlite:///") else url)
    return SQLiteStore(path, create=create)
