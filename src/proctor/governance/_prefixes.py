"""Ids that people type: a run id, an approval id, a deployment's name (or an
artifact digest, which ``Artifacts.get`` resolves itself) may be given as any unique
prefix, within one tenant.

Tables print shortened ids; a person copies what they see. An exact id always
wins; otherwise the prefix must name exactly one row, and an ambiguous one is an
error that says how many it matched instead of picking one.
"""

from __future__ import annotations

from proctor.errors import NotFound, UsageError
from proctor.store import Conn, Row

#: Fewer characters than this match too much to be what anyone meant.
MIN_PREFIX = 4
_SHOWN = 5


def find_by_prefix(
    conn: Conn, table: str, columns: str, tenant: str, given: str, *, noun: str, hint: str
) -> Row:
    """The row of ``table`` in ``tenant`` whose ``id`` is ``given`` or starts with it.

    ``table`` and ``columns`` are the caller's constants, never user input."""
    wanted = given.strip()
    row = conn.query_one(
        f"SELECT {columns} FROM {table} WHERE id = ? AND tenant = ?",  # noqa: S608
        (wanted, tenant),
    )
    if row is not None:
        return row
    if len(wanted) < MIN_PREFIX or not wanted.isprintable():
        raise NotFound(f"no {noun} {given!r} in tenant {tenant!r}", hint=hint)
    # substr, not a range or LIKE: the same answer on SQLite and on PostgreSQL under
    # any collation, and nothing in the prefix is a pattern character.
    rows = conn.query(
        f"SELECT {columns} FROM {table} WHERE tenant = ? AND substr(id, 1, ?) = ?"  # noqa: S608
        f" ORDER BY id LIMIT {_SHOWN + 1}",
        (tenant, len(wanted), wanted),
    )
    _one(rows, tenant, given, noun, hint)
    return rows[0]


def resolve_prefix(
    conn: Conn,
    table: str,
    column: str,
    tenant: str,
    given: str,
    *,
    noun: str,
    hint: str,
    what: str = "id",
) -> str:
    """The full value of ``column`` in ``table`` (in ``tenant``) that is ``given`` or the
    one value starting with it; for names several rows share (a deployment's versions).

    ``table`` and ``column`` are the caller's constants, never user input."""
    wanted = given.strip()
    row = conn.query_one(
        f"SELECT {column} FROM {table} WHERE {column} = ? AND tenant = ? LIMIT 1",  # noqa: S608
        (wanted, tenant),
    )
    if row is not None:
        return str(row[0])
    if len(wanted) < MIN_PREFIX or not wanted.isprintable():
        raise NotFound(f"no {noun} {given!r} in tenant {tenant!r}", hint=hint)
    rows = conn.query(
        f"SELECT DISTINCT {column} FROM {table} WHERE tenant = ?"  # noqa: S608
        f" AND substr({column}, 1, ?) = ? ORDER BY {column} LIMIT {_SHOWN + 1}",
        (tenant, len(wanted), wanted),
    )
    _one(rows, tenant, given, noun, hint, what)
    return str(rows[0][0])


def _one(rows: list[Row], tenant: str, given: str, noun: str, hint: str, what: str = "id") -> None:
    """Nothing, if ``rows`` (a prefix's matches, the first ``_SHOWN + 1``) is one row."""
    if not rows:
        raise NotFound(f"no {noun} {given!r} in tenant {tenant!r}", hint=hint)
    if len(rows) > 1:
        shown = ", ".join(str(r[0]) for r in rows[:_SHOWN])
        count = f"more than {_SHOWN}" if len(rows) > _SHOWN else str(len(rows))
        raise UsageError(
            f"{given!r} is ambiguous: {count} {noun} {what}s in tenant {tenant!r} start with it"
            f" ({shown}{', …' if len(rows) > _SHOWN else ''})",
            hint=f"give more characters of the {noun} {what}",
        )
