from __future__ import annotations

from pathlib import Path

from proctor.errors import UsageError
from proctor.store._base import Store
from proctor.store._sqlite import SQLiteStore


def open_store(url: str, *, create: bool = False) -> Store:
    """Open the store at ``url`` (``sqlite:///path`` or a bare path), migrating it.

    With ``create=False`` a missing database is an error rather than a new
    empty one, so a mistyped path never silently starts a fresh ledger.
    """
    if url.startswith(("postgresql://", "postgres://")):
        raise UsageError(
            "the PostgreSQL engine is not available in this version",
            hint="use a SQLite store (the default)",
        )
    path = Path(url.removeprefix("sqlite:///") if url.startswith("sqlite:///") else url)
    return SQLiteStore(path, create=create)
