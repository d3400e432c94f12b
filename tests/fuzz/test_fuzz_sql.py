"""The SQL authorizer (``handle_sql``) against random schemas, policies and statements.

Each example builds a random schema (tables with awkward names, integer, text,
composite and no primary keys, WITHOUT ROWID tables, indexes (unique or not, on
permitted and denied columns), views) in two real SQLite files
that differ only in the cells of the columns the policy denies, and a Cedar policy
(from real capability permits) that allows a random subset of each table's columns.
Every text cell is a marker naming its table and column. Statements come from a
grammar: expressions, aliases, ``*``, joins (ON, USING, NATURAL), scalar and EXISTS
subqueries, CTEs (recursive too), compounds, views, derived tables, windows,
aggregates (group_concat, json_group_array, ...), printf/substr/hex/CASE, ORDER BY,
GROUP BY, HAVING, LIMIT/OFFSET, rowid spellings, and text built to make the lineage
rewrite misread the statement.

Properties, for every statement:

- no marker of a denied column in any answer or error message, nor any marker at all
  in the ledger;
- non-interference: whatever is answered on one file is answered, identically, on the
  other (so the answer depends on no denied cell: not through a WHERE, an ORDER BY, a
  join, a LIMIT, nor the lineage rewrite);
- a statement that names a denied column anywhere (select list, WHERE, ORDER BY,
  GROUP BY, HAVING, JOIN, subquery, LIMIT) is denied: reading a column to filter or
  sort on it is reading it;
- a statement that names only permitted columns, and that SQLite runs, is answered
  (so the test cannot pass by refusing everything), unless a table it reads is
  ordered by a denied column (an index on one, a WITHOUT ROWID or text key) and the
  refusal says the plan reads through it; and every permitted column read plainly
  returns exactly its cells (with NOT INDEXED where the plain read is refused so).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import sqlite3
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from proctor.broker import (
    BadCall,
    BrokerError,
    CallDenied,
    DatasetBinding,
    RunScope,
    StatementTimeout,
    handle_sql,
)
from proctor.ledger import Ledger
from proctor.policy import capability_policies, compile_policies
from tests.fuzz._support import TIMEOUT, fuzz_settings, one_in, sqlite_ledger

pytestmark = pytest.mark.timeout(TIMEOUT)

ROWS = 3
TABLE_NAMES = ["customers", "orders", "t", "Events", "a b", 'q"t', "é"]
COLUMN_NAMES = ["id", "name", "email", "Country", "c", "a b", 'x"y', "é", "select", "rowid"]
PK_KINDS = ["ipk", "text", "composite", "none", "without_rowid"]


def q(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


@dataclass
class Table:
    index: int
    name: str
    columns: list[str]
    pk: str
    permitted: set[str]
    ipk: str | None = None  # the INTEGER PRIMARY KEY column (the rowid alias)
    indexes: list[tuple[list[str], bool]] = field(default_factory=list)  # (columns, unique)

    def ordered_by_denied(self) -> bool:
        """Whether a b-tree of this table is sorted by a denied column: a plan may
        read through it, and the broker then refuses (docs/datasets.md)."""
        keyed = self.pk in ("text", "composite", "without_rowid")
        orders = [cols for cols, _ in self.indexes] + ([self.key_columns] if keyed else [])
        return any(set(cols) - self.permitted for cols in orders)

    @property
    def key_columns(self) -> list[str]:
        return {
            "ipk": [self.ipk or ""],
            "text": self.columns[:1],
            "composite": self.columns[:2],
            "without_rowid": self.columns[-1:],
        }.get(self.pk, [])

    def marker(self, column: str, row: int, variant: str) -> Any:
        """The cell of ``column`` in ``row`` on file ``variant`` ("a" or "b").

        Permitted cells are the same on both files and name their table and column.
        Denied cells start ``MKd`` and name their column: a key's differ between the
        files but keep their order (a scan in key order is the same scan on both);
        any other's come from a small domain shared by same-named columns of every
        table (so joins on them match some rows), permuted per table on file b (so
        a join or filter on them gives other rows there)."""
        if column == self.ipk:
            base = 900_000_000 + self.index * 10_000 + row * 10
            return base + (5 if variant == "b" and column not in self.permitted else 0)
        if column in self.permitted:
            return f"MK{self.index}x{self.columns.index(column)}x{row}p:{self.name}.{column}"
        if column in self.key_columns:
            return f"MKd{row}{variant}:{column}"
        k = row if variant == "a" else (row + self.index + 1) % (ROWS + 1)
        return f"MKd{k}:{column}"

    def rowid_column(self) -> str | None:
        """What the authorizer names when ``rowid`` is read, or None if it cannot be."""
        if self.pk == "without_rowid":
            return None
        if any(c.lower() in ("rowid", "_rowid_", "oid") for c in self.columns):
            return None  # a real column shadows at least one spelling: left out
        return self.ipk or "ROWID"


@dataclass
class View:
    name: str
    table: Table
    columns: list[str]
    permitted: set[str]  # a view is a Table resource of its own (docs/datasets.md)


@dataclass
class Schema:
    tables: list[Table]
    views: list[View]

    def denied_tokens(self) -> tuple[set[str], set[int]]:
        """What a denied cell shows (``MKd``, also hex-encoded), and denied integers."""
        texts = {"MKd", b"MKd".hex(), b"MKd".hex().upper()}
        ints: set[int] = set()
        for t in self.tables:
            if t.ipk is not None and t.ipk not in t.permitted:
                ints |= {t.marker(t.ipk, r, v) for r in range(ROWS) for v in "ab"}
        return texts, ints


@st.composite
def schemas(draw: st.DrawFn) -> Schema:
    names = draw(st.lists(st.sampled_from(TABLE_NAMES), min_size=1, max_size=3, unique=True))
    tables = []
    for i, name in enumerate(names):
        cols = draw(
            st.lists(st.sampled_from(COLUMN_NAMES), min_size=2, max_size=4, unique_by=str.lower)
        )
        pk = draw(st.sampled_from(PK_KINDS))
        permitted = set(draw(st.lists(st.sampled_from(cols), unique=True)))
        table = Table(i, name, cols, pk, permitted)
        if pk == "ipk" and cols[0].lower() not in ("rowid",):
            table.ipk = cols[0]
        elif pk == "ipk":
            table.pk = "none"
        for _ in range(draw(st.integers(0, 2))):
            on = draw(st.lists(st.sampled_from(cols), min_size=1, max_size=2, unique=True))
            table.indexes.append((on, draw(one_in(3))))
        tables.append(table)
    views = []
    for t in tables:
        if draw(one_in(2)):
            cols = draw(st.lists(st.sampled_from(t.columns), min_size=1, unique=True))
            permitted = set(draw(st.lists(st.sampled_from(cols), unique=True)))
            views.append(View(f"v{t.index}", t, cols, permitted))
    return Schema(tables, views)


def build(schema: Schema, path: Path, variant: str) -> None:
    """The schema in a SQLite file; the denied columns' cells differ by ``variant``."""
    conn = sqlite3.connect(path)
    for t in schema.tables:
        defs = []
        for c in t.columns:
            defs.append(f"{q(c)} INTEGER PRIMARY KEY" if c == t.ipk else f"{q(c)} TEXT")
        if t.pk == "text":
            defs[0] = f"{q(t.columns[0])} TEXT PRIMARY KEY"
        elif t.pk == "composite":
            defs.append(f"PRIMARY KEY ({q(t.columns[0])}, {q(t.columns[1])})")
        elif t.pk == "without_rowid":
            defs.append(f"PRIMARY KEY ({q(t.columns[-1])})")
        tail = " WITHOUT ROWID" if t.pk == "without_rowid" else ""
        conn.execute(f"CREATE TABLE {q(t.name)} ({', '.join(defs)}){tail}")
        for r in range(ROWS):
            values = [t.marker(c, r, variant) for c in t.columns]
            marks = ", ".join("?" for _ in values)
            conn.execute(f"INSERT INTO {q(t.name)} VALUES ({marks})", values)
        # Every column's cells are distinct within a table: a unique index always fits.
        for n, (on, unique) in enumerate(t.indexes):
            conn.execute(
                f"CREATE {'UNIQUE ' if unique else ''}INDEX {q(f'i{t.index}_{n}')}"
                f" ON {q(t.name)} ({', '.join(q(c) for c in on)})"
            )
    for v in schema.views:
        conn.execute(
            f"CREATE VIEW {q(v.name)} AS SELECT {', '.join(q(c) for c in v.columns)}"
            f" FROM {q(v.table.name)}"
        )
    conn.commit()
    conn.close()


def caps_for(schema: Schema) -> dict[str, Any]:
    tables = {
        t.name: {"columns": sorted(t.permitted), "access": "read"}
        for t in [*schema.tables, *schema.views]
        if t.permitted
    }
    return {"datasets": {"crm": {"tables": tables}}} if tables else {}


# -- statements --------------------------------------------------------------------------


@dataclass
class Stmt:
    sql: str
    params: list[Any] = field(default_factory=list)
    columns: set[tuple[str, str]] = field(default_factory=set)  # (table, column) named
    tables: set[str] = field(default_factory=set)  # tables read, with or without columns
    exact: bool = True  # False: the model of what is named may be incomplete
    refused: bool = False  # a construct the broker refuses whatever it names


SCALAR_FUNCS = [
    "{}",
    "upper({})",
    "lower({})",
    "length({})",
    "hex({})",
    "quote({})",
    "substr({}, 2, 3)",
    "printf('%s!', {})",
    "json_object('k', {})",
    "json_array({})",
    "coalesce({}, 'n')",
    "iif({} > 'M', 1, 0)",
    "CASE WHEN {} LIKE 'MK%' THEN 1 ELSE 0 END",
    "replace({}, 'MK', 'ZZ')",
    "instr({}, 'x')",
    "typeof({})",
    "unicode({})",
    "CAST({} AS BLOB)",
    "{} COLLATE NOCASE",
    "trim({})",
    "({} || '~')",
]
AGGREGATES = [
    "count({})",
    "max({})",
    "min({})",
    "group_concat({}, ',')",
    "json_group_array({})",
    "count(DISTINCT {})",
    "sum(length({}))",
    "total(length({}))",
]
CASES = st.sampled_from(["keep", "keep", "upper", "lower"])


class Gen:
    """Draws one statement at a time against ``schema``."""

    def __init__(self, draw: st.DrawFn, schema: Schema) -> None:
        self.draw = draw
        self.schema = schema

    def pick(self, options: list[Any]) -> Any:
        # An index, not sampled_from(options): a new strategy per draw is slow.
        return options[self.draw(st.integers(0, len(options) - 1))]

    def ident(self, name: str) -> str:
        """``name`` as SQL spells it: quoted, or bare (any case) when it may be."""
        plain = name.isascii() and name.isidentifier() and name.lower() not in ("select",)
        if not plain or self.draw(one_in(2)):
            return q(name)
        case = self.draw(CASES)
        return name.upper() if case == "upper" else name.lower() if case == "lower" else name

    def col(self, s: Stmt, t: Table, qualifier: str | None = None) -> str:
        # Mostly permitted ones, so that statements get past the decision and run.
        permitted = sorted(t.permitted)
        c = self.pick(permitted if permitted and not self.draw(one_in(3)) else t.columns)
        s.columns.add((t.name, c))
        s.tables.add(t.name)
        ref = self.ident(c)
        return f"{qualifier}.{ref}" if qualifier else ref

    def expr(self, s: Stmt, t: Table, qualifier: str | None = None) -> str:
        return self.pick(SCALAR_FUNCS).format(self.col(s, t, qualifier))

    def cond(self, s: Stmt, t: Table, qualifier: str | None = None) -> str:
        c = self.col(s, t, qualifier)
        return self.pick(
            [
                f"{c} = 'x'",
                f"{c} > 'MK'",
                f"{c} LIKE 'MK%'",
                f"{c} IS NOT NULL",
                f"length({c}) > 3",
                f"{c} IN ('a', 'b')",
                f"substr({c}, 1, 2) = 'MK'",
            ]
        )

    def table(self, s: Stmt) -> Table:
        t: Table = self.pick(self.schema.tables)
        s.tables.add(t.name)
        return t

    # -- shapes ----------------------------------------------------------------------

    def statement(self) -> Stmt:
        shape = self.pick(
            [
                self.plain,
                self.plain,
                self.plain,
                self.aggregate,
                self.star,
                self.join,
                self.scalar_subquery,
                self.exists,
                self.cte,
                self.recursive,
                self.compound,
                self.view,
                self.derived,
                self.window,
                self.lineage_trick,
                self.lineage_trick,
                self.lineage_trick,
                self.literal_join,
                self.literal_join,
                self.rowid,
                self.limit_subquery,
            ]
        )
        s: Stmt = shape()
        return s

    def plain(self) -> Stmt:
        s = Stmt("")
        t = self.table(s)
        alias = self.pick([None, "a", "t0"])
        qual = alias if alias and self.draw(one_in(2)) else None
        items = [self.expr(s, t, qual) for _ in range(self.draw(st.integers(1, 3)))]
        if self.draw(one_in(3)):
            items[0] += f" AS {self.pick(['v', 'name', 'FROM_', q('x y')])}"
        sql = f"SELECT {'DISTINCT ' if self.draw(one_in(6)) else ''}{', '.join(items)}"
        sql += f" FROM {self.ident(t.name)}" + (f" AS {alias}" if alias else "")
        if self.draw(one_in(4)):
            sql += " NOT INDEXED"
        if self.draw(one_in(2)):
            sql += f" WHERE {self.cond(s, t, qual)}"
        if self.draw(one_in(2)):
            sql += f" ORDER BY {self.expr(s, t, qual)}{self.pick(['', ' DESC'])}"
        if self.draw(one_in(3)):
            sql += f" LIMIT {self.pick([1, 2, -1])} OFFSET {self.pick([0, 1])}"
        s.sql = sql
        return s

    def aggregate(self) -> Stmt:
        s = Stmt("")
        t = self.table(s)
        agg = "count(*)" if self.draw(one_in(4)) else self.pick(AGGREGATES).format(self.col(s, t))
        sql = f"SELECT {agg} FROM {self.ident(t.name)}"
        if self.draw(one_in(2)):
            sql += f" WHERE {self.cond(s, t)}"
        if self.draw(one_in(2)):
            sql += f" GROUP BY {self.col(s, t)}"
            if self.draw(one_in(2)):
                sql += f" HAVING {self.pick(AGGREGATES).format(self.col(s, t))} > 0"
        s.sql = sql
        return s

    def star(self) -> Stmt:
        s = Stmt("")
        t = self.table(s)
        s.columns |= {(t.name, c) for c in t.columns}
        name = self.ident(t.name)
        s.sql = self.pick(
            [f"SELECT * FROM {name}", f"SELECT {name}.* FROM {name}", f"SELECT *, 1 FROM {name}"]
        )
        return s

    def join(self) -> Stmt:
        s = Stmt("")
        a, b = self.table(s), self.table(s)
        left, right = self.ident(a.name), self.ident(b.name)
        kind = self.pick(["on", "on", "using", "natural", "cross"])
        common = [c for c in a.columns if c.lower() in {d.lower() for d in b.columns}]
        if kind in ("using", "natural") and not common:
            kind = "on"
        items = f"{self.expr(s, a, 'x')}, {self.expr(s, b, 'y')}"
        if kind == "on":
            on = f"{self.col(s, a, 'x')} = {self.col(s, b, 'y')}"
            sql = f"SELECT {items} FROM {left} AS x JOIN {right} AS y ON {on}"
        elif kind == "using":
            c = self.pick(common)
            for t in (a, b):
                s.columns |= {(t.name, d) for d in t.columns if d.lower() == c.lower()}
            sql = f"SELECT {items} FROM {left} AS x JOIN {right} AS y USING ({self.ident(c)})"
            s.refused = True  # the columns compared are never reported: refused outright
        elif kind == "natural":
            for t in (a, b):
                s.columns |= {(t.name, d) for d in t.columns if d.lower() in map(str.lower, common)}
            sql = f"SELECT {items} FROM {left} AS x NATURAL JOIN {right} AS y"
            s.refused = True
        else:
            sql = f"SELECT {items} FROM {left} AS x CROSS JOIN {right} AS y"
        if self.draw(one_in(2)):
            sql += f" WHERE {self.cond(s, b, 'y')}"
        s.sql = sql
        return s

    def scalar_subquery(self) -> Stmt:
        s = Stmt("")
        a, b = self.table(s), self.table(s)
        inner = f"SELECT {self.expr(s, b)} FROM {self.ident(b.name)}"
        if self.draw(one_in(2)):
            inner += f" WHERE {self.cond(s, b)}"
        s.sql = f"SELECT ({inner} LIMIT 1), {self.expr(s, a)} FROM {self.ident(a.name)}"
        return s

    def exists(self) -> Stmt:
        s = Stmt("")
        a, b = self.table(s), self.table(s)
        if self.draw(one_in(2)):
            where = f"EXISTS (SELECT 1 FROM {self.ident(b.name)} WHERE {self.cond(s, b)})"
        else:
            where = f"{self.col(s, a)} IN (SELECT {self.col(s, b)} FROM {self.ident(b.name)})"
        s.sql = f"SELECT {self.expr(s, a)} FROM {self.ident(a.name)} WHERE {where}"
        return s

    def cte(self) -> Stmt:
        s = Stmt("")
        t = self.table(s)
        inner = f"SELECT {self.expr(s, t)} AS v, {self.col(s, t)} AS w FROM {self.ident(t.name)}"
        outer = self.pick(
            [
                "SELECT v FROM x",
                "SELECT v FROM x WHERE w > 'MK'",
                "SELECT count(*) FROM x",
                "SELECT v FROM x ORDER BY w",
                "SELECT group_concat(v) FROM x",
            ]
        )
        s.sql = f"WITH x AS ({inner}) {outer}"
        return s

    def recursive(self) -> Stmt:
        s = Stmt("")
        t = self.table(s)
        c = self.col(s, t)
        s.sql = (
            f"WITH RECURSIVE r(n, v) AS (SELECT 1, {c} FROM {self.ident(t.name)} "
            f"UNION ALL SELECT n + 1, v FROM r WHERE n < 3) SELECT v, n FROM r"
        )
        return s

    def compound(self) -> Stmt:
        s = Stmt("")
        a, b = self.table(s), self.table(s)
        op = self.pick(["UNION", "UNION ALL", "INTERSECT", "EXCEPT"])
        s.sql = (
            f"SELECT {self.expr(s, a)} FROM {self.ident(a.name)} {op} "
            f"SELECT {self.expr(s, b)} FROM {self.ident(b.name)}"
        ) + self.pick(["", " ORDER BY 1"])
        return s

    def view(self) -> Stmt:
        if not self.schema.views:
            return self.plain()
        v: View = self.pick(self.schema.views)
        s = Stmt("")
        s.tables |= {v.table.name, v.name}
        # The view's definition is compiled whole: every column it selects is read,
        # whichever of them the statement then uses; and the view's own columns.
        s.columns |= {(v.table.name, c) for c in v.columns}
        if self.draw(one_in(3)):
            s.columns |= {(v.name, c) for c in v.columns}
            s.sql = f"SELECT * FROM {q(v.name)}"
        else:
            c = self.pick(v.columns)
            s.columns.add((v.name, c))
            s.sql = f"SELECT {self.pick(SCALAR_FUNCS).format(self.ident(c))} FROM {q(v.name)}"
        return s

    def derived(self) -> Stmt:
        s = Stmt("")
        t = self.table(s)
        inner = f"SELECT {self.col(s, t)} AS v, {self.col(s, t)} AS w FROM {self.ident(t.name)}"
        outer = self.pick(["SELECT v FROM ({})", "SELECT v FROM ({}) WHERE w = 'x'"])
        s.sql = outer.format(inner)
        return s

    def window(self) -> Stmt:
        s = Stmt("")
        t = self.table(s)
        # Chosen first, then drawn: a column is named only if the text uses it.
        fn = self.pick(["row_number()", "rank()", "lag", "count(*)"])
        if fn == "lag":
            fn = f"lag({self.col(s, t)})"
        over = self.pick(["PARTITION BY", "ORDER BY", ""])
        if over:
            over += f" {self.col(s, t)}"
        s.sql = f"SELECT {self.col(s, t)}, {fn} OVER ({over}) FROM {self.ident(t.name)}"
        return s

    def literal_join(self) -> Stmt:
        """A join on a column against a guessed value: an equality oracle, unless the
        column compared is decided like any other read."""
        s = Stmt("")
        t = self.table(s)
        c = self.pick(t.columns)
        guess = self.pick([f"MKd{k}:{c}" for k in range(ROWS + 1)]).replace("'", "''")
        item = self.expr(s, t, "x")
        name = self.ident(t.name)
        kind = self.pick(["on", "using", "natural"])
        if kind == "on":
            s.columns.add((t.name, c))
            s.sql = (
                f"SELECT {item} FROM {name} AS x JOIN (SELECT '{guess}' AS g) AS y"
                f" ON x.{self.ident(c)} = y.g"
            )
        else:
            s.refused = True
            join = "JOIN" if kind == "using" else "NATURAL JOIN"
            tail = f" USING ({q(c)})" if kind == "using" else ""
            s.sql = f"SELECT {item} FROM {name} AS x {join} (SELECT '{guess}' AS {q(c)}) AS y{tail}"
        return s

    def lineage_trick(self) -> Stmt:
        """Text the lineage rewrite's tokenizer may read otherwise than SQLite does."""
        s = Stmt("")
        t = self.table(s)
        c, d = self.col(s, t), self.col(s, t)
        name = self.ident(t.name)
        nbsp = "\u00a0"
        s.sql, s.params = self.pick(
            [
                (f"SELECT {c} AS n{nbsp}FROM{nbsp}{t.name}{nbsp}WHERE, {d} FROM {name}", []),
                (f"SELECT {c} AS n{nbsp}FROM{nbsp}{t.name}{nbsp}WHERE, {d} FROM {name}", []),
                (f"SELECT {c}, $a::FROM {name} FROM {name}", [1]),
                (f"SELECT {c} AS n\u2028FROM {name}", []),
                (f"SELECT {c}, $a::FROM {name} FROM {name}", [1]),
                (f"SELECT {c}, :a::FROM {name} FROM {name}", [1]),
                (f"SELECT {c}, $a(')') AS z, {d} FROM {name}", [1]),
                (f"SELECT {c}, $a(x) FROM {name}", [1]),
                (f"SELECT {c} /* FROM x */ FROM {name}", []),
                (f"SELECT {c} -- FROM x\nFROM {name}", []),
                (f"SELECT 'FROM x', {c} FROM {name}", []),
                (f'SELECT {c} AS "FROM", {d} FROM {name}', []),
                (f"SELECT {c} AS [FROM], {d} FROM {name}", []),
                (f"SELECT {c} AS `FROM`, {d} FROM {name}", []),
                (f"SELECT {c}, ? FROM {name}", ["FROM"]),
                (f"SELECT {c}€FROM {name}", []),
                (f"SELECT {c} FROM main.{name}", []),
                (f"SELECT {c} FROM {name} AS {name}", []),
                (f"SELECT {c}\tFROM\n{name}\fWHERE {d} > ''", []),
            ]
        )
        s.exact = False  # weird text: SQLite may read other names than the model's
        return s

    def rowid(self) -> Stmt:
        s = Stmt("")
        t = self.table(s)
        spelling = self.pick(["rowid", "_rowid_", "oid", "ROWID"])
        target = t.rowid_column()
        if target is None:
            s.exact = False
        else:
            s.columns.add((t.name, target))
        s.sql = f"SELECT {spelling}, {self.col(s, t)} FROM {self.ident(t.name)}"
        return s

    def limit_subquery(self) -> Stmt:
        s = Stmt("")
        t = self.table(s)
        c, d = self.col(s, t), self.col(s, t)
        name = self.ident(t.name)
        s.sql = self.pick(
            [
                f"SELECT {c} FROM {name} LIMIT (SELECT length({d}) FROM {name} LIMIT 1)",
                f"SELECT {c} FROM {name} LIMIT 1 OFFSET (SELECT count(*) FROM {name} WHERE {d} > 'MK')",
                f"SELECT {c} FROM {name} ORDER BY (SELECT {d} FROM {name} LIMIT 1)",
            ]
        )
        return s


@st.composite
def cases(draw: st.DrawFn) -> tuple[Schema, list[Stmt]]:
    schema = draw(schemas())
    gen = Gen(draw, schema)
    return schema, [gen.statement() for _ in range(draw(st.integers(4, 10)))]


# -- running them -------------------------------------------------------------------------


@dataclass
class Env:
    tmp: Path
    ledger: Ledger
    loop: asyncio.AbstractEventLoop
    n: int = 0


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    tmp = tmp_path_factory.mktemp("sql")
    loop = asyncio.new_event_loop()
    with sqlite_ledger(tmp) as ledger:
        yield Env(tmp, ledger, loop)
    loop.close()


def scope_for(env: Env, schema: Schema, path: Path) -> RunScope:
    return RunScope(
        tenant="acme",
        run_id=f"r{env.n}",
        workload=f"spiffe://test.local/tenant/acme/deployment/churn/run/r{env.n}",
        deployment="churn",
        artifact="sha256:" + "ab" * 32,
        approvals=("approval-1",),
        environment="production",
        policies=compile_policies(capability_policies("acme", "churn", caps_for(schema))),
        ledger=env.ledger,
        datasets={"crm": DatasetBinding("crm", "sqlite", str(path))},
        lineage_key=b"k" * 32,
        statement_timeout=2.0,
    )


def ask(env: Env, scope: RunScope, sql: str, params: list[Any]) -> dict[str, Any] | BrokerError:
    request = {"dataset": "crm", "sql": sql, "params": params}
    try:
        return env.loop.run_until_complete(handle_sql(scope, request))
    except BrokerError as exc:
        return exc


def plain_run(path: Path, sql: str, params: list[Any]) -> bool:
    """Whether SQLite itself (no authorizer) runs the statement."""
    conn = sqlite3.connect(f"{path.as_uri()}?mode=ro", uri=True)
    try:
        conn.execute(sql, params).fetchall()
        return True
    except (sqlite3.Error, ValueError, OverflowError):
        return False
    finally:
        conn.close()


def strings_in(value: Any) -> Iterator[str]:
    if isinstance(value, str):
        yield value
        if value and len(value) % 4 == 0:
            with contextlib.suppress(ValueError):  # a blob comes back as base64
                yield base64.b64decode(value, validate=True).decode("utf-8", "replace")
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from strings_in(k)
            yield from strings_in(v)
    elif isinstance(value, list):
        for v in value:
            yield from strings_in(v)
    elif isinstance(value, int | float):
        yield str(value)


def plan_refusal(answer: dict[str, Any] | BrokerError) -> bool:
    """A refusal because the plan reads through a b-tree ordered by a denied column."""
    return isinstance(answer, CallDenied) and (
        "write NOT INDEXED" in answer.message or "WITHOUT ROWID table" in answer.message
    )


def assert_no_leak(schema: Schema, answer: dict[str, Any] | BrokerError, sql: str) -> None:
    texts, ints = schema.denied_tokens()
    shown = answer.as_json() if isinstance(answer, BrokerError) else answer
    for text in strings_in(shown):
        for token in texts:
            assert token not in text, f"denied cell {token!r} leaked by {sql!r}: {text[:200]!r}"
        for number in ints:
            assert str(number) not in text, f"denied integer leaked by {sql!r}: {text[:200]!r}"


@fuzz_settings(150)
@given(case=cases())
def test_no_statement_reads_a_denied_cell(env: Env, case: tuple[Schema, list[Stmt]]) -> None:
    schema, statements = case
    env.n += 1
    a_path, b_path = env.tmp / f"s{env.n}a.db", env.tmp / f"s{env.n}b.db"
    build(schema, a_path, "a")
    build(schema, b_path, "b")
    a_scope, b_scope = scope_for(env, schema, a_path), scope_for(env, schema, b_path)
    entries_before = sum(1 for _ in env.ledger.entries("acme"))
    permitted = {(t.name, c) for t in [*schema.tables, *schema.views] for c in t.permitted}
    with_permit = {t.name for t in [*schema.tables, *schema.views] if t.permitted}
    ordered = {t.name for t in schema.tables if t.ordered_by_denied()}

    # Every permitted column, read plainly, answers exactly its cells; where the
    # plan would read through an index on a denied column, NOT INDEXED does.
    for t in schema.tables:
        for c in sorted(t.permitted):
            out = ask(env, a_scope, f"SELECT {q(c)} FROM {q(t.name)}", [])
            if plan_refusal(out) and t.ordered_by_denied():
                if t.pk == "without_rowid":
                    # Stored in its key's order, and NOT INDEXED does not keep SQLite
                    # off its indexes: ORDER BY a permitted key (the planner may still
                    # pick an index that starts with it and holds a denied column),
                    # or nothing reads it.
                    if not set(t.key_columns) <= t.permitted:
                        continue
                    order = ", ".join(q(k) for k in t.key_columns)
                    out = ask(env, a_scope, f"SELECT {q(c)} FROM {q(t.name)} ORDER BY {order}", [])
                    if plan_refusal(out):
                        continue
                else:
                    out = ask(env, a_scope, f"SELECT {q(c)} FROM {q(t.name)} NOT INDEXED", [])
            assert not isinstance(out, BrokerError), f"{t.name}.{c} is permitted: {out}"
            assert sorted(map(str, (r[0] for r in out["rows"]))) == sorted(
                str(t.marker(c, r, "a")) for r in range(ROWS)
            )
        count = ask(env, a_scope, f"SELECT count(*) FROM {q(t.name)}", [])
        if t.permitted:
            assert not isinstance(count, BrokerError) and count["rows"] == [[ROWS]], count
        else:
            assert isinstance(count, CallDenied), count

    # The lineage rewrite's known traps, on every table the policy lets one read.
    nbsp = "\u00a0"
    for t in schema.tables:
        for c in sorted(t.permitted)[:1]:
            statements.append(
                Stmt(
                    f"SELECT {q(c)} AS n{nbsp}FROM{nbsp}{t.name}{nbsp}WHERE, {q(c)} FROM {q(t.name)}"
                )
            )
            statements.append(Stmt(f"SELECT {q(c)}, $a::FROM {q(t.name)} FROM {q(t.name)}", [1]))
            for stmt in statements[-2:]:
                stmt.exact = False
                stmt.tables.add(t.name)

    for s in statements:
        a = ask(env, a_scope, s.sql, s.params)
        b = ask(env, b_scope, s.sql, s.params)
        assert_no_leak(schema, a, s.sql)
        assert_no_leak(schema, b, s.sql)
        assert not isinstance(a, StatementTimeout), s.sql
        # Non-interference: the denied cells differ between the files; the answers may not.
        if isinstance(a, BrokerError) or isinstance(b, BrokerError):
            assert type(a) is type(b), f"{s.sql!r}: {a!r} on one file, {b!r} on the other"
        else:
            assert a == b, f"{s.sql!r} answers differently when only denied cells differ"
        runs = plain_run(a_path, s.sql, s.params)
        named_denied = not (s.columns <= permitted and s.tables <= with_permit)
        if s.refused:
            assert isinstance(a, CallDenied) and "not allowed" in a.message, (s.sql, a)
        elif s.exact and runs and named_denied:
            assert isinstance(a, CallDenied), f"{s.sql!r} names a denied column: {a!r}"
        elif s.exact and runs and not named_denied and not (plan_refusal(a) and s.tables & ordered):
            assert not isinstance(a, BrokerError), f"{s.sql!r} names only permitted: {a!r}"
        if plan_refusal(a) and s.exact:
            assert s.tables & ordered, f"{s.sql!r}: refused for an order no index has: {a!r}"
        if isinstance(a, BrokerError):
            assert isinstance(a, CallDenied | BadCall), repr(a)

    # Row values never reach the ledger: not one marker, permitted or not.
    new = b"".join(list(env.ledger.entries("acme"))[entries_before:])
    for t in schema.tables:
        for c in t.columns:
            if c != t.ipk:
                assert f"MK{t.index}x{t.columns.index(c)}x".encode() not in new
