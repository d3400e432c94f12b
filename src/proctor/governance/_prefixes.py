"""Ids that people type: a run id, an approval id, a deployment's name (or an
artifact digest, which ``Artifacts.get`` resolves itself) may be given as any unique
prefix, within one tenant.

Tables print shortened ids; a person copies what they see. An exact id always
wins; otherwise the prefix must name exactly one row, and an ambiguous one is an
error that says how many it matched instead of picking one.
"""

from __future__ import annotations

from collections.abc import Callable

from proctor.errors import NotFound, UsageError
from proctor.store import Conn, Row

#: Fewer characters than this match too much to be what anyone meant: such a
#: prefix is never taken, even when one row matches; it is refused with the count.
MIN_PREFIX = 4
_SHOWN = 5
#: Counted up to this many matches (a bound on the scan), past it "more than".
_COUNTED = 1000


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
    _usable(conn, table, "id", tenant, given, noun, hint)
    # substr, not a range or LIKE: the same answer on SQLite and on PostgreSQL under
    # any collation, and nothing in the prefix is a pattern character.
    rows = conn.query(
        f"SELECT {columns} FROM {table} WHERE tenant = ? AND substr(id, 1, ?) = ?"  # noqa: S608
        f" ORDER BY id LIMIT {_SHOWN + 1}",
        (tenant, len(wanted), wanted),
    )
    _one(rows, tenant, given, noun, hint,
         count=lambda: _count(conn, table, "id", tenant, wanted))  # fmt: skip
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
    _usable(conn, table, column, tenant, given, noun, hint, what)
    rows = conn.query(
        f"SELECT DISTINCT {column} FROM {table} WHERE tenant = ?"  # noqa: S608
        f" AND substr({column}, 1, ?) = ? ORDER BY {column} LIMIT {_SHOWN + 1}",
        (tenant, len(wanted), wanted),
    )
    _one(rows, tenant, given, noun, hint, what,
         count=lambda: _count(conn, table, column, tenant, wanted))  # fmt: skip
    return str(rows[0][0])


def _count(conn: Conn, table: str, column: str, tenant: str, wanted: str) -> int:
    """How many distinct values of ``column`` start with ``wanted`` (up to _COUNTED + 1)."""
    row = conn.query_one(
        f"SELECT COUNT(*) FROM (SELECT DISTINCT {column} FROM {table} WHERE tenant = ?"  # noqa: S608
        f" AND substr({column}, 1, ?) = ? LIMIT {_COUNTED + 1}) AS matched",
        (tenant, len(wanted), wanted),
    )
    return 0 if row is None else int(row[0])


def _counted(n: int) -> str:
    return f"more than {_COUNTED}" if n > _COUNTED else str(n)


def _usable(
    conn: Conn, table: str, column: str, tenant: str, given: str, noun: str, hint: str,
    what: str = "id",
) -> None:  # fmt: skip
    """Nothing, if ``wanted`` is long enough to be looked up as a prefix. A short one
    that matches is refused with how many it matches (docs/cli.md: ambiguous, with
    the count), not answered "not found" as though there were none."""
    wanted = given.strip()
    if not wanted or not wanted.isprintable():
        raise NotFound(f"no {noun} {given!r} in tenant {tenant!r}", hint=hint)
    if len(wanted) >= MIN_PREFIX:
        return
    n = _count(conn, table, column, tenant, wanted)
    if n == 0:
        raise NotFound(f"no {noun} {given!r} in tenant {tenant!r}", hint=hint)
    more = f"give at least {MIN_PREFIX} characters of the {noun} {what}"
    if n == 1:
        raise UsageError(
            f"{given!r} is too short to name a {noun}: prefixes of fewer than {MIN_PREFIX}"
            f" characters are not looked up (1 {noun} {what} in tenant {tenant!r} starts with it)",
            hint=more,
        )
    raise UsageError(
        f"{given!r} is ambiguous: {_counted(n)} {noun} {what}s in tenant {tenant!r} start with it",
        hint=more,
    )


def _one(
    rows: list[Row], tenant: str, given: str, noun: str, hint: str, what: str = "id",
    count: Callable[[], int] | None = None,
) -> None:  # fmt: skip
    """Nothing, if ``rows`` (a prefix's matches, the first ``_SHOWN + 1``) is one row;
    ``count`` counts them all when more than ``_SHOWN`` matched."""
    if not rows:
        raise NotFound(f"no {noun} {given!r} in tenant {tenant!r}", hint=hint)
    if len(rows) > 1:
        shown = ", ".join(str(r[0]) for r in rows[:_SHOWN])
        count_text = str(len(rows))
        if len(rows) > _SHOWN:
            count_text = _counted(count()) if count is not None else f"more than {_SHOWN}"
        raise UsageError(
            f"{given!r} is ambiguous: {count_text} {noun} {what}s in tenant {tenant!r}"
            f" start with it"
            f" ({shown}{', …' if len(rows) > _SHOWN else ''})",
            hint=f"give more characters of the {noun} {what}",
        )
