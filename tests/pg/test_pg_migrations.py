"""The two engines' schemas are twins: same migrations, tables, columns, keys, indexes."""

from __future__ import annotations

from pathlib import Path

import pytest

from proctor.errors import StoreError
from proctor.store import open_store
from proctor.store._migrations import SQLITE_MIGRATIONS
from proctor.store._pg_migrations import POSTGRES_MIGRATIONS
from proctor.store._postgres import lock_key, redact, to_pg_sql

Schema = dict[str, list[tuple[str, bool, bool]]]  # table -> (column, not null, in pk)


def test_both_engines_have_the_same_number_of_migrations() -> None:
    assert len(POSTGRES_MIGRATIONS) == len(SQLITE_MIGRATIONS)
    for pg, lite in zip(POSTGRES_MIGRATIONS, SQLITE_MIGRATIONS, strict=True):
        assert len(pg) == len(lite), "each migration has the same statements on both"


def _sqlite_schema(path: Path) -> tuple[Schema, set[str]]:
    store = open_store(str(path), create=True)
    try:
        with store.read() as conn:
            tables = [
                str(r[0])
                for r in conn.query(
                    "SELECT name FROM sqlite_schema WHERE type = 'table' ORDER BY name"
                )
            ]
            schema: Schema = {}
            for t in tables:
                rows = conn.query(f'PRAGMA table_info("{t}")')
                schema[t] = [(str(r[1]), bool(r[3]) or int(r[5]) > 0, int(r[5]) > 0) for r in rows]
            indexes = {
                str(r[0])
                for r in conn.query(
                    "SELECT name FROM sqlite_schema WHERE type = 'index' AND sql IS NOT NULL"
                )
            }
    finally:
        store.close()
    return schema, indexes


def _pg_schema(dsn: str) -> tuple[Schema, set[str]]:
    store = open_store(dsn, create=True)
    try:
        with store.read() as conn:
            cols = conn.query(
                "SELECT c.table_name, c.column_name, c.is_nullable = 'NO',"
                " EXISTS (SELECT 1 FROM information_schema.key_column_usage k"
                "   JOIN information_schema.table_constraints tc"
                "     ON tc.constraint_name = k.constraint_name AND tc.table_name = k.table_name"
                "   WHERE tc.constraint_type = 'PRIMARY KEY' AND k.table_name = c.table_name"
                "     AND k.column_name = c.column_name)"
                " FROM information_schema.columns c WHERE c.table_schema = 'public'"
                " ORDER BY c.table_name, c.ordinal_position"
            )
            schema: Schema = {}
            for t, c, notnull, pk in cols:
                schema.setdefault(str(t), []).append((str(c), bool(notnull), bool(pk)))
            indexes = {
                str(r[0])
                for r in conn.query(
                    "SELECT indexname FROM pg_indexes WHERE schemaname = 'public'"
                    " AND indexname NOT LIKE '%pkey'"
                )
            }
    finally:
        store.close()
    return schema, indexes


@pytest.mark.postgres
def test_tables_columns_keys_and_indexes_match(pg_dsn: str, tmp_path: Path) -> None:
    lite, lite_idx = _sqlite_schema(tmp_path / "p.db")
    pg, pg_idx = _pg_schema(pg_dsn)
    assert sorted(pg) == sorted(lite)
    for table in lite:
        assert pg[table] == lite[table], table
    # SQLite names the unique index of a non-rowid PRIMARY KEY itself; PostgreSQL
    # calls it *_pkey. Named indexes must match exactly.
    assert pg_idx == lite_idx


def test_placeholders_are_translated_outside_literals_only() -> None:
    assert to_pg_sql("SELECT a FROM t WHERE b = ? AND c = ?") == (
        "SELECT a FROM t WHERE b = %s AND c = %s"
    )
    assert (
        to_pg_sql("SELECT '%' || ?, 'it''s' FROM \"t\"") == "SELECT '%%' || %s, 'it''s' FROM \"t\""
    )
    for bad in ("SELECT 'why?' FROM t", 'SELECT "a?" FROM t', "SELECT 1 -- what?", "SELECT $$x$$"):
        with pytest.raises(StoreError):
            to_pg_sql(bad)


def test_lock_keys_are_stable_signed_64_bit() -> None:
    k = lock_key("ledger:acme")
    assert k == lock_key("ledger:acme") != lock_key("ledger:acme2")
    assert -(2**63) <= k < 2**63
    # Fixed forever: nodes of different versions must take the same lock.
    assert lock_key("ledger:acme") == int.from_bytes(
        __import__("hashlib").sha256(b"ledger:acme").digest()[:8], "big", signed=True
    )


def test_the_password_never_shows_in_the_store_url() -> None:
    assert redact("postgresql://u:s3cret@db:5432/p") == "postgresql://u:***@db:5432/p"
    assert redact("postgresql://u@db/p") == "postgresql://u@db/p"
