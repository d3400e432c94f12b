"""A dataset's tables, columns and types, read from its own catalog; never a row.

What an agent (or a developer) writes a manifest from: the names the manifest's
``[datasets.*.tables]`` take, checked at deploy by readiness against the same catalog.
SQLite: the registered file opened read-only (``mode=ro``), ``sqlite_schema`` and
``pragma_table_info``. PostgreSQL: the system catalog through the runtime's own
connection (the registered DSN), in a read-only transaction; the catalog rather than
information_schema, which shows only what the DSN's role may use. Nothing here reads
a table's contents.
"""

from __future__ import annotations

import sqlite3
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

from proctor.errors import NotFound, UsageError
from proctor.governance import Dataset, DatasetKind
from proctor.ledger import Action, Actor, EventDraft
from proctor.runtime import Runtime

#: At most this many tables and columns per table are described (the answer stays small).
MAX_TABLES = 500
MAX_COLUMNS = 500


@dataclass(frozen=True)
class Column:
    name: str
    type: str
    nullable: bool
    primary_key: bool


@dataclass(frozen=True)
class Table:
    name: str
    kind: str  # "table" | "view"
    columns: tuple[Column, ...]


def describe_recorded(
    rt: Runtime, tenant: str, name: str, actor: Actor, log: str, details: dict[str, Any]
) -> dict[str, Any]:
    """``tenant``'s dataset ``name`` described (after the caller decided the read), and
    the description recorded as a ``dataset.describe`` event in ``log`` (the actor's
    tenant's) with ``details`` (request id, client): how many tables, never what."""
    found = next((d for d in rt.resources.datasets(tenant) if d.name == name), None)
    if found is None:
        raise NotFound(f"no dataset {name!r} in tenant {tenant!r}",
                       hint=f"proctor dataset list -t {tenant}")  # fmt: skip
    tables = describe(found)
    rt.ledger.append(
        log,
        EventDraft(actor, Action.DATASET_DESCRIBE, f"dataset/{name}",
                   reason="described (tables, columns, types; no rows)",
                   details={**details, "tables": len(tables)}),
    )  # fmt: skip
    return as_json(found, tables)


def describe(dataset: Dataset) -> list[Table]:
    """The tables (and views) of ``dataset`` with their columns and declared types."""
    if dataset.kind == DatasetKind.SQLITE:
        return _sqlite(dataset.location)
    if dataset.kind == DatasetKind.POSTGRESQL:
        return _postgresql(dataset.location)
    raise UsageError(f"datasets of kind {dataset.kind!r} cannot be described")


def as_json(dataset: Dataset, tables: list[Table]) -> dict[str, Any]:
    return {
        "name": dataset.name,
        "kind": str(dataset.kind),
        "synthetic": dataset.synthetic,
        "twin_of": dataset.twin_of,
        "tables": [
            {
                "name": t.name,
                "kind": t.kind,
                "columns": [
                    {
                        "name": c.name,
                        "type": c.type,
                        "nullable": c.nullable,
                        "primary_key": c.primary_key,
                    }
                    for c in t.columns
                ],
            }
            for t in tables
        ],
    }


def _sqlite(location: str) -> list[Table]:
    try:
        # Read-only and no URI parameters from the path itself (quoted).
        db = sqlite3.connect(f"file:{quote(location)}?mode=ro", uri=True)
    except sqlite3.Error as exc:
        raise UsageError(f"the SQLite dataset cannot be read: {exc}") from exc
    try:
        db.execute("PRAGMA query_only = ON")
        names = db.execute(
            "SELECT name, type FROM sqlite_schema WHERE type IN ('table', 'view')"
            " AND name NOT LIKE 'sqlite\\_%' ESCAPE '\\' ORDER BY name LIMIT ?",
            (MAX_TABLES,),
        ).fetchall()
        out = []
        for name, kind in names:
            rows = db.execute(
                'SELECT name, type, "notnull", pk FROM pragma_table_info(?) ORDER BY cid LIMIT ?',
                (name, MAX_COLUMNS),
            ).fetchall()
            cols = tuple(
                Column(str(r[0]), str(r[1] or ""), not bool(r[2]), bool(r[3])) for r in rows
            )
            out.append(Table(str(name), str(kind), cols))
        return out
    except sqlite3.Error as exc:
        raise UsageError(f"the SQLite dataset cannot be read: {exc}") from exc
    finally:
        db.close()


_PG_COLUMNS = """
SELECT n.nspname, c.relname, c.relkind, a.attname,
       format_type(a.atttypid, a.atttypmod), a.attnotnull,
       EXISTS (SELECT 1 FROM pg_index i WHERE i.indrelid = c.oid AND i.indisprimary
               AND a.attnum = ANY (i.indkey))
FROM pg_class c
JOIN pg_namespace n ON n.oid = c.relnamespace
JOIN pg_attribute a ON a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped
WHERE c.relkind IN ('r', 'v', 'm', 'p', 'f')
  AND n.nspname NOT IN ('pg_catalog', 'information_schema')
  AND n.nspname NOT LIKE 'pg\\_toast%%' AND n.nspname NOT LIKE 'pg\\_temp%%'
ORDER BY n.nspname, c.relname, a.attnum
"""


def _postgresql(location: str) -> list[Table]:
    import psycopg

    try:
        with psycopg.connect(location, connect_timeout=10) as conn:
            conn.read_only = True
            rows = conn.execute(_PG_COLUMNS).fetchall()
    except psycopg.Error as exc:
        # The DSN may hold a password: never echo it.
        raise UsageError(f"the PostgreSQL dataset cannot be reached: {type(exc).__name__}") from exc
    tables: dict[str, tuple[str, list[Column]]] = {}
    for schema, rel, relkind, col, typ, notnull, pk in rows:
        # A table of the public schema is named as a manifest names it (no schema).
        name = str(rel) if schema == "public" else f"{schema}.{rel}"
        if name not in tables:
            if len(tables) >= MAX_TABLES:
                continue
            tables[name] = ("view" if relkind in ("v", "m") else "table", [])
        cols = tables[name][1]
        if len(cols) < MAX_COLUMNS:
            cols.append(Column(str(col), str(typ), not bool(notnull), bool(pk)))
    return [Table(n, k, tuple(c)) for n, (k, c) in tables.items()]
