"""Row lineage: which table rows a guest's read returned, for every engine.

The result event names the returned rows by keyed hashes of their primary keys.
How the keys are obtained is shared by the SQLite and PostgreSQL connectors: the
statement runs once, as a variant with the key appended (below), so the result
and its lineage come from the same execution.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


def quote_name(name: str) -> str:
    """An identifier quoted for SQL (the same rule in SQLite and PostgreSQL)."""
    return '"' + name.replace('"', '""') + '"'


def key_text(values: Sequence[Any]) -> str:
    """A row key as text: ``42`` for customer 42; a JSON array for composite keys."""

    def one(v: Any) -> Any:
        return v.hex() if isinstance(v, bytes) else v

    if len(values) == 1:
        v = one(values[0])
        return v if isinstance(v, str) else json.dumps(v)
    return json.dumps([one(v) for v in values], separators=(",", ":"))


# -- the keyed variant --------------------------------------------------------
#
# Which table rows did the guest get back? For the common shape (one table, no
# join, no aggregate, no DISTINCT/GROUP BY/compound/window, no subquery or view)
# every result row is one table row, so the broker runs the statement with the
# key appended to the select list (``SELECT <list>, "t"."id" FROM t ...``) and
# strips it before answering: result and lineage come from the same execution.
# Appending at the end keeps ``ORDER BY 2`` meaning the same. The token scan
# below only finds the top-level FROM; what the statement reads is still known
# from the authorizer, and the variant runs under the same enforcing authorizer
# (plus the key column). Any other shape is recorded with ``lineage: "table"``:
# the tables and columns are known, the rows are not.

_TOKEN_RE = re.compile(
    r"""
    (?P<space>\s+)
    |(?P<comment>--[^\n]*|/\*.*?(?:\*/|\Z))
    |(?P<string>'(?:[^']|'')*')
    |(?P<quoted>"(?:[^"]|"")*"|`(?:[^`]|``)*`|\[[^\]]*\])
    |(?P<variable>\?[0-9]*|[$@:\#](?:::|[A-Za-z0-9_$])*\(?)
    |(?P<word>[^\W\d][\w$]*)
    |(?P<other>.)
    """,
    re.S | re.X,
)
_COARSE_WORDS = frozenset(
    {"DISTINCT", "GROUP", "HAVING", "WINDOW", "OVER", "UNION", "INTERSECT", "EXCEPT"}
    | {"VALUES", "JOIN", "NATURAL", "WITH"}
)
_AFTER_FROM = frozenset({"WHERE", "ORDER", "LIMIT"})


@dataclass(frozen=True)
class _Token:
    kind: str
    text: str
    start: int

    @property
    def upper(self) -> str:
        return self.text.upper() if self.kind == "word" else ""

    @property
    def name(self) -> str | None:
        """The identifier this token spells, unquoted; None if it is not one."""
        if self.kind == "word":
            return self.text
        if self.kind == "quoted":
            inner = self.text[1:-1]
            return inner if self.text[0] == "[" else inner.replace(self.text[0] * 2, self.text[0])
        return None


def _tokens(sql: str) -> list[_Token]:
    return [
        _Token(m.lastgroup or "", m.group(), m.start())
        for m in _TOKEN_RE.finditer(sql)
        if m.lastgroup not in ("space", "comment")
    ]


def _reads_like_sqlite(sql: str) -> bool:
    """Whether the scan below splits ``sql`` where SQLite's tokenizer does.

    It does for ASCII text: strings, quoted names and comments end at the same
    characters. Outside them, non-ASCII text is where the two part ways (Python's
    ``\\s`` takes U+00A0 as a space, SQLite any byte over 0x7F as part of a name),
    and so are Tcl-style parameters (``$a::b``, ``$a(x)``), which SQLite reads as
    one token; for those the statement keeps table-level lineage."""
    for m in _TOKEN_RE.finditer(sql):
        kind, text = m.lastgroup, m.group()
        if kind in ("string", "quoted", "comment"):
            continue
        if not text.isascii() or (kind == "space" and not set(text) <= set(" \t\n\f\r")):
            return False
        if kind == "variable" and ("::" in text or text.endswith("(")):
            return False
    return True


def _not_indexed(rest: list[_Token]) -> list[_Token]:
    """``rest`` past a leading ``NOT INDEXED`` (it belongs to the table before it)."""
    if len(rest) >= 2 and rest[0].upper == "NOT" and rest[1].upper == "INDEXED":
        return rest[2:]
    return rest


def keyed_variant(
    sql: str, table: str, key: Sequence[str], sentinel: str | None = None
) -> str | None:
    """``sql`` with ``table``'s key columns appended to its select list, or None
    when the statement is not the one-row-per-table-row shape described above.
    With ``sentinel``, the string literal ``'<sentinel>'`` goes first (the caller
    checks it comes back right after the statement's own columns)."""
    split = keyed_split(sql, table, key)
    if split is None:
        return None
    return split.join(sentinel)


@dataclass(frozen=True)
class KeyedSplit:
    """Where the key columns go in one statement: the scan is a function of the
    text, the table and its key alone, so a caller running the same statement
    again keeps this and adds only its fresh sentinel."""

    head: str  # the statement up to its top-level FROM, then ", "
    tail: str  # the key columns, then the statement from FROM on

    def join(self, sentinel: str | None = None) -> str:
        if sentinel is None:
            return self.head + self.tail
        return f"{self.head}'{sentinel}', {self.tail}"


def keyed_split(sql: str, table: str, key: Sequence[str]) -> KeyedSplit | None:
    """:func:`keyed_variant` cut where its sentinel goes (None: not the shape)."""
    if not _reads_like_sqlite(sql):
        return None
    toks = _tokens(sql)
    while toks and toks[-1].text == ";":
        toks.pop()
    if len(toks) < 4 or toks[0].upper != "SELECT":
        return None
    depth = 0
    from_at: int | None = None
    for i, tok in enumerate(toks):
        if tok.text == "(":
            depth += 1
        elif tok.text == ")":
            depth -= 1
        elif tok.upper == "SELECT" and i > 0:
            return None  # a subquery may return other rows' values
        elif depth == 0 and tok.upper in _COARSE_WORDS:
            return None
        elif depth == 0 and tok.upper == "FROM" and from_at is None:
            from_at = i
    if from_at is None:
        return None
    rest = toks[from_at + 1 :]
    if len(rest) >= 3 and (rest[0].name or "").lower() == "main" and rest[1].text == ".":
        rest = rest[2:]
    if not rest or (rest[0].name or "").casefold() != table.casefold():
        return None
    qualifier = table
    rest = _not_indexed(rest[1:])
    if rest and rest[0].upper == "AS":
        rest = rest[1:]
        if not rest or rest[0].name is None:
            return None
    if rest and rest[0].name is not None and rest[0].upper not in _AFTER_FROM:
        qualifier = rest[0].name or table
        rest = _not_indexed(rest[1:])
    if rest and rest[0].upper not in _AFTER_FROM:
        return None
    rowid = ("rowid", "_rowid_", "oid")
    cols = ", ".join(f"{quote_name(qualifier)}.{k if k in rowid else quote_name(k)}" for k in key)
    at = toks[from_at].start
    return KeyedSplit(f"{sql[:at]}, ", f"{cols} {sql[at:]}")
