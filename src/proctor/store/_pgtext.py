"""PostgreSQL text without a PostgreSQL driver: portable SQL as psycopg SQL, and a
DSN without its password. Apart from the engine so that callers outside the
store (the PostgreSQL dataset connector) use them without loading psycopg here.
"""

from __future__ import annotations

import functools
import re
from urllib.parse import unquote

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


_URI = re.compile(r"^(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)(?P<rest>.*)$", re.S)
# A keyword/value DSN (``host=h password='a b'``): any keyword ending in
# "password" (``sslpassword`` too), quoted (with backslash escapes) or not.
_KV_PASSWORD = re.compile(
    r"(?P<key>\b[A-Za-z_]*password\s*=\s*)(?P<value>'(?:[^'\\]|\\.)*'?|[^\s]*)",
    re.I | re.S,
)
_URI_PASSWORD = re.compile(r"(?P<key>password=)(?!\*\*\*(?:[&#\s]|$))[^&#\s]*", re.I)
_MASK = "***"


def _is_password_key(key: str) -> bool:
    return unquote(key).strip().lower().endswith("password")


def _redact_query(query: str) -> str:
    params = []
    for param in query.split("&"):
        key, eq, _value = param.partition("=")
        params.append(f"{key}={_MASK}" if eq and _is_password_key(key) else param)
    return "&".join(params)


def redact(dsn: str) -> str:
    """The DSN without its password, wherever a DSN can carry one, for messages
    and ``Store.url``: the URI's userinfo (``user:pw@``), its ``password=``
    query parameters (any case, percent-encoded keys, several of them), and a
    keyword/value DSN's ``password=`` (quoted or not). Conservative where libpq
    and a URL parser would read a malformed URI differently: more is masked."""
    m = _URI.match(dsn)
    if m is None:
        return _KV_PASSWORD.sub(lambda k: k.group("key") + _MASK, dsn)
    scheme, rest = m.group("scheme"), m.group("rest")
    # libpq ends the authority at the first "/"; userinfo runs to an "@" before it
    # (the last one: a password holding an unencoded "@" is masked whole).
    slash = rest.find("/")
    authority, tail = (rest, "") if slash < 0 else (rest[:slash], rest[slash:])
    if "?" in authority and "@" not in authority.rpartition("?")[2]:
        # No path: the query starts in what looked like the authority.
        authority, query_start = authority.split("?", 1)
        tail = "?" + query_start + tail
    user, at, host = authority.rpartition("@")
    if at:
        name, colon, _password = user.partition(":")
        authority = f"{name}:{_MASK}@{host}" if colon else f"{user}@{host}"
    path, q, query = tail.partition("?")
    if q:
        query, hash_, fragment = query.partition("#")
        tail = f"{path}?{_redact_query(query)}{hash_}{fragment}"
    # Whatever the split above made of a malformed URI, no "password=" survives.
    return _URI_PASSWORD.sub(lambda k: k.group("key") + _MASK, scheme + authority + tail)
