"""PostgreSQL text without a PostgreSQL driver: portable SQL as psycopg SQL, and a
DSN without its password. Apart from the engine so that callers outside the
store (the PostgreSQL dataset connector) use them without loading psycopg here.
"""

from __future__ import annotations

import functools
import re
from urllib.parse import urlsplit, urlunsplit

from proctor.errors import StoreError

_SQL_TOKEN = re.compile(
    r"""
    (?P<string>[eE]?'(?:[^']|'')*')
    |(?P<ident>"(?:[^"]|"")*")
    |(?P<comment>--[^\n]*|/\*.*?\*/)
    |(?P<dollar>\$[A-Za-z_]*\$)
    |(?P<mark>\?)
    |(?P<percent>%)
    |(?P<other>[^'"\-/?%$]+|.)
    """,
    re.S | re.X,
)


@functools.lru_cache(maxsize=1024)
def to_pg_sql(sql: str) -> str:
    """Portable SQL (``?`` placeholders) as psycopg SQL (``%s``, ``%%``).

    Raises :class:`StoreError` if a ``?`` sits inside a string literal,
    quoted identifier or comment, or if the statement uses dollar quoting:
    both would make the translation ambiguous, and our own SQL has neither.
    """
    out: list[str] = []
    for m in _SQL_TOKEN.finditer(sql):
        kind, text = m.lastgroup, m.group()
        if kind == "mark":
            out.append("%s")
        elif kind == "percent":
            out.append("%%")
        elif kind == "dollar":
            raise StoreError(f"dollar-quoted SQL is not supported by the store: {sql[:80]!r}")
        elif kind in ("string", "ident", "comment"):
            if "?" in text:
                raise StoreError(
                    f"a '?' inside a literal, identifier or comment is ambiguous: {sql[:80]!r}"
                )
            out.append(text.replace("%", "%%"))
        else:
            out.append(text)
    return "".join(out)


def redact(dsn: str) -> str:
    """The DSN without its password, for messages and ``Store.url``."""
    parts = urlsplit(dsn)
    if parts.password is None:
        return dsn
    host = parts.hostname or ""
    if parts.port is not None:
        host = f"{host}:{parts.port}"
    netloc = f"{parts.username}:***@{host}" if parts.username else f"***@{host}"
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))
