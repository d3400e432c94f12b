"""Both engines' migrations go through one loop (store/_base.apply_migrations): a
new store gets every version once, a reopened one nothing, and a store written by
a newer Proctor is refused and left as it was."""

from __future__ import annotations

import pytest

from proctor.errors import StoreError
from proctor.store import open_store


def _raw_versions(url: str) -> list[int]:
    """The versions as the database holds them, read without Proctor's store."""
    if url.startswith("postgresql://"):
        import psycopg

        with psycopg.connect(url) as conn:
            rows = conn.execute("SELECT version FROM schema_migrations ORDER BY 1").fetchall()
    else:
        import sqlite3

        db = sqlite3.connect(url)
        rows = db.execute("SELECT version FROM schema_migrations ORDER BY 1").fetchall()
        db.close()
    return [int(r[0]) for r in rows]


def _versions(url: str) -> list[int]:
    store = open_store(url)
    try:
        with store.read() as conn:
            return [int(r[0]) for r in conn.query("SELECT version FROM schema_migrations")]
    finally:
        store.close()


def test_every_version_once_then_nothing(store_url: str) -> None:
    open_store(store_url, create=True).close()
    first = _versions(store_url)
    assert first == list(range(1, len(first) + 1)) and len(first) >= 8
    assert _versions(store_url) == first  # reopening applies nothing


def test_a_store_from_a_newer_proctor_is_refused_and_unchanged(store_url: str) -> None:
    store = open_store(store_url, create=True)
    with store.write() as conn:
        conn.execute(
            "INSERT INTO schema_migrations (version, applied_at) VALUES (?, ?)",
            (999, "2030-01-01T00:00:00Z"),
        )
    store.close()
    before = _raw_versions(store_url)
    with pytest.raises(StoreError, match="schema version 999, newer than this") as refused:
        open_store(store_url)
    assert refused.value.hint == "upgrade Proctor"
    assert _raw_versions(store_url) == before
