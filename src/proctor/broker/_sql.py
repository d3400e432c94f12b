"""SQL on a tenant's SQLite datasets, with column control done by the engine.

The broker never parses SQL to decide what a statement touches. SQLite's
authorizer callback reports every table and column the statement reads or
writes, as the engine compiles it: through views (the underlying tables are
reported with the view as source), subqueries, CTEs and triggers. The handler:

1. opens the dataset read-only (``mode=ro`` URI, ``PRAGMA query_only``);
2. compiles the guest's statement as ``EXPLAIN <statement>`` (prepared, never
   run) under a collecting authorizer, which refuses outright what no policy
   may allow (ATTACH, PRAGMA, DDL, transaction control, functions outside an
   allow-list, writes to SQLite's own tables, other schemas), and what it would
   not see: NATURAL JOIN and JOIN ... USING compare columns the authorizer is
   never told about, and INDEXED BY orders rows by an index's columns; then
   reads the compiled program for what the plan reads through (the columns of
   an index it scans or searches, the key of a WITHOUT ROWID table: the rows
   come back in their order) and for tables the authorizer did not name
   (``sqlite_master`` when only counted);
3. asks Cedar about every table touched: ``sql.select`` with the set of
   columns read, ``sql.write`` with the columns written. One deny denies the
   whole statement, recorded as one event naming tables, columns, policies;
4. runs it under an enforcing authorizer that allows exactly the accesses
   Cedar permitted (so a schema change between steps 2 and 4 cannot widen
   them), a progress handler for the time limit, ``row_limit + 1`` fetched;
   a write runs on a separate read-write connection inside one transaction;
5. records the result event (tables, columns, row count, keyed hashes of the
   returned rows' primary keys) before answering. If the ledger cannot record
   it, the answer is dropped and a write is rolled back.

Steps 3 and 5 (and the request's checks) are the path every dataset kind
shares, in ``_datasets.py``; this module is the SQLite connector behind it.

Row values never reach the ledger: events hold names, counts and keyed hashes.
The statement itself is recorded only as a keyed hash (a literal in a WHERE
clause is a row value).
"""

from __future__ import annotations

import base64
import re
import secrets
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote

from proctor.broker._datasets import (
    DESCRIBED_COLUMNS,
    DESCRIBED_TABLES,
    MAX_SQL_LENGTH,
    Accesses,
    ColumnShape,
    Failed,
    IdleConnections,
    Outcome,
    Refused,
    SqlCall,
    Statement,
    TableShape,
    TimedOut,
)
from proctor.broker._fair import run_blocking
from proctor.broker._lineage import KeyedSplit, key_text, keyed_split, quote_name
from proctor.broker._scope import DatasetBinding, RunScope
from proctor.errors import UsageError
from proctor.governance import DatasetKind

#: Largest string or blob a statement may build (SQLITE_LIMIT_LENGTH).
MAX_VALUE_LENGTH = 16 * 1024 * 1024
#: VM instructions between two checks of the statement deadline.
_PROGRESS_STEPS = 1000

# Authorizer action codes (sqlite3.h). Python 3.11's module also exports error
# codes under colliding names (24 is both SQLITE_ATTACH and SQLITE_FORMAT), so
# the numbers are spelled out here.
_DELETE = 9
_INSERT = 18
_PRAGMA = 19
_READ = 20
_SELECT = 21
_TRANSACTION = 22
_UPDATE = 23
_ATTACH = 24
_DETACH = 25
_FUNCTION = 31
_SAVEPOINT = 32
_RECURSIVE = 33
_OK = 0
_DENY = 1

# What SQLite compares or orders by without ever reporting the column to the
# authorizer: the columns of NATURAL JOIN and JOIN ... USING (the join condition
# is made after names are resolved), and the index INDEXED BY picks (the rows
# come back in its order). A word search over the whole text, strings and
# comments included, finds every keyword SQLite could read, whatever a tokenizer
# makes of the rest; a string holding the word goes in a parameter instead.
# NOT INDEXED (only whitespace between the words) is let through: it only keeps
# the planner off indexes, which is what the plan check below asks for.
_UNCHECKABLE = re.compile(r"\b(natural|using|indexed)\b", re.IGNORECASE)
_NOT_BEFORE = re.compile(r"\bnot\s+\Z", re.IGNORECASE)
_UNCHECKABLE_REASONS = {
    "natural": "NATURAL JOIN is not allowed: SQLite does not report the columns it "
    "compares, so they cannot be checked (write the join with ON)",
    "using": "JOIN ... USING is not allowed: SQLite does not report the columns it "
    "compares, so they cannot be checked (write the join with ON)",
    "indexed": "INDEXED BY is not allowed: it orders the rows by an index's columns, "
    "which SQLite does not report",
}

_REFUSED_ACTIONS = {
    _PRAGMA: "PRAGMA is not allowed",
    _TRANSACTION: "transaction control is not allowed (each statement is its own transaction)",
    _SAVEPOINT: "transaction control is not allowed (each statement is its own transaction)",
    _ATTACH: "ATTACH is not allowed",
    _DETACH: "DETACH is not allowed",
}


# SQLite's schema table answers to two names in main and two in temp; the
# authorizer reports a column read as sqlite_master and a "table, no column"
# read as spelled. Decided as one table, ``sqlite_master``.
SCHEMA_TABLE = "sqlite_master"
_SCHEMA_NAMES = frozenset({"sqlite_master", "sqlite_schema"})
_TEMP_SCHEMA_NAMES = frozenset({"sqlite_temp_master", "sqlite_temp_schema"})
_OUTSIDE = "only the dataset's own tables may be read"


def _words(text: str) -> frozenset[str]:
    return frozenset(text.split())


# Opcodes whose P1 is never a cursor (a register, an address, a database): a
# cursor whose number shows up as P1 only in these, and in OpenRead, Count and
# Close, was opened to be counted, never positioned, so its order is not used.
_COUNT_ONLY = _words(
    """
    OpenRead ReopenIdx Count Close ColumnsUsed Init Goto Halt Transaction Copy SCopy
    Integer Int64 Real String8 Null Variable Move ResultRow AggFinal Once Gosub Return
    BeginSubrtn InitCoroutine Yield EndCoroutine
    """
)


# Pure functions of their arguments. Everything else is refused: load_extension,
# readfile/writefile/edit (CLI extensions), fts3_tokenizer (pointer games),
# sqlite_offset (file layout), and any function a future SQLite adds until it
# is looked at. A function sees only values of columns the authorizer has
# already reported, so json_extract(email, ...) still needs email permitted.
_SCALAR_FUNCTIONS = _words(
    """
    abs char coalesce concat concat_ws format glob hex ifnull iif instr length like
    likelihood likely lower ltrim max min nullif octet_length printf quote random
    randomblob replace round rtrim sign soundex substr substring trim typeof unhex
    unicode unlikely upper zeroblob
    date time datetime julianday unixepoch strftime timediff
    acos acosh asin asinh atan atan2 atanh ceil ceiling cos cosh degrees exp floor ln
    log log10 log2 mod pi pow power radians sin sinh sqrt tan tanh trunc
    json jsonb json_array jsonb_array json_array_length json_error_position
    json_extract jsonb_extract json_insert jsonb_insert json_object jsonb_object
    json_patch jsonb_patch json_pretty json_remove jsonb_remove json_replace
    jsonb_replace json_set jsonb_set json_type json_valid json_quote
    changes total_changes last_insert_rowid
    """
)
# Aggregates and window functions: allowed, but a result row then no longer
# stands for one table row, so lineage falls back to the table (see below).
_AGGREGATE_FUNCTIONS = _words(
    """
    avg count group_concat string_agg sum total max min
    json_group_array jsonb_group_array json_group_object jsonb_group_object
    row_number rank dense_rank percent_rank cume_dist ntile lag lead
    first_value last_value nth_value
    """
)
ALLOWED_FUNCTIONS = _SCALAR_FUNCTIONS | _AGGREGATE_FUNCTIONS


@dataclass
class _Accesses(Accesses):
    """What the authorizer reported while SQLite compiled one statement."""

    functions: set[str] = field(default_factory=set)
    aliases: set[str] = field(default_factory=set)  # CTE names reported like tables
    selects: int = 0
    result_width: int | None = None  # columns of a result row, from the compiled program
    refusal: str | None = None

    def refuse(self, reason: str) -> int:
        if self.refusal is None:
            self.refusal = reason
        return _DENY

    def collect(
        self, action: int, arg1: str | None, arg2: str | None, db: str | None, _src: str | None
    ) -> int:
        if action in (_SELECT, _RECURSIVE):
            self.selects += action == _SELECT
            return _OK
        if action == _READ:
            table = arg1 or ""
            # db is None only for the "table read, no column" report (count(*)).
            if db not in ("main", None) or _fold(table) in _TEMP_SCHEMA_NAMES:
                return self.refuse(f"{_OUTSIDE}, not {db or 'temp'}.{table}")
            if _fold(table) in _SCHEMA_NAMES:
                table = SCHEMA_TABLE  # never a CTE's name: decided like any table
            self.reads.setdefault(table, set()).add(arg2 or "")
            return _OK
        if action in (_INSERT, _UPDATE, _DELETE):
            table = arg1 or ""
            if table.lower().startswith("sqlite_"):
                # DDL writes the schema table first; so does the set-up of a
                # table-valued function, which is why json_each() lands here.
                return self.refuse(
                    "the schema cannot be changed (CREATE, DROP, ALTER); table-valued "
                    "functions (json_each, pragma_table_info, ...) are not supported"
                )
            if db != "main":
                return self.refuse(f"writing {db}.{table} is not allowed")
            if action == _UPDATE:
                self.writes.setdefault(table, set()).add(arg2 or "")
            else:
                self.whole_row_writes.add(table)
            return _OK
        if action == _FUNCTION:
            name = (arg2 or "").lower()
            if name not in ALLOWED_FUNCTIONS:
                return self.refuse(f"function {name}() is not allowed")
            self.functions.add(name)
            return _OK
        if action in _REFUSED_ACTIONS:
            return self.refuse(_REFUSED_ACTIONS[action])
        return self.refuse("schema changes (CREATE, DROP, ALTER, ...) are not allowed")


@dataclass(frozen=True)
class _PlanRead:
    """Columns the compiled plan orders rows by, which the authorizer never reports.

    An index's entries are sorted by its columns; reading through it (a covering
    scan, a search, ORDER BY or MIN/MAX satisfied by it) returns rows in that
    order, so the guest learns how the rows rank by a column it may not read.
    A WITHOUT ROWID table is itself stored in its primary key's order. Decided
    as reads of those columns (Cedar sees them in ``columns``)."""

    table: str
    via: str  # "index <name>" or "WITHOUT ROWID table <name>"
    columns: frozenset[str]

    def as_json(self) -> dict[str, Any]:
        return {"table": self.table, "via": self.via, "columns": sorted(self.columns)}

    def hint(self) -> str:
        cols = ", ".join(sorted(self.columns))
        if self.via.startswith("index "):
            return (
                f"the plan reads {self.table} through {self.via} on ({cols}), so the rows "
                f"would come back ranked by it: write NOT INDEXED after {self.table} "
                "(for a WITHOUT ROWID table, ORDER BY its key)"
            )
        return (
            f"{self.table} is a WITHOUT ROWID table stored in the order of its key ({cols}): "
            "it cannot be read without that key"
        )


@dataclass(frozen=True)
class _Tree:
    """What one b-tree of the dataset is, and the columns that order its entries."""

    table: str
    via: str | None  # None: a rowid table (its order is the rowid's, not a column's)
    columns: frozenset[str]


class _Misread(Exception):
    """The keyed variant's columns are not where they were put."""


# -- statement shapes ------------------------------------------------------------
#
# A run sends the same statement again and again with other parameters. What
# step 2 learns of it (the accesses the authorizer reports, the b-trees its plan
# reads through) and where its keyed variant puts the key are functions of the
# text, the parameters' names or count, and the schema the connection compiled
# it against (its tables and indexes, and the statistics it loaded with them):
# not of the parameters' values, except where SQLite plans with them. It does
# for a LIKE or GLOB whose pattern is a parameter (the pattern's prefix may pick
# an index), and, where SQLite is built with STAT4 and the dataset holds
# sqlite_stat4, for any parameter compared with an indexed column. Those
# statements are analysed on every call, as all are on a cache miss.
#
# Kept per connection (each has its own schema and statistics loaded), for one
# schema version (``PRAGMA schema_version``, read on every call before the cache
# is consulted): a schema change drops them. What is enforced is unchanged: the
# statement still runs under the enforcing authorizer built from the decision,
# and Cedar is still asked (``decide_tables`` keeps its own answers per policy set).

#: A statement that depends on the schema: running it reloads a stale one.
_RELOAD = "SELECT 1 FROM main.sqlite_schema LIMIT 1"
#: Statements whose plan may follow a parameter's value (see above): never kept.
_VALUE_PLANNED = re.compile(r"like|glob", re.IGNORECASE)
#: Statement shapes one connection keeps, and the longest statement kept.
_SHAPES_KEPT = 128
_SHAPE_SQL_LENGTH = 8192


def _has_stat4() -> bool:
    db = sqlite3.connect(":memory:")
    try:
        return any("ENABLE_STAT4" in str(r[0]) for r in db.execute("PRAGMA compile_options"))
    finally:
        db.close()


#: Whether this SQLite plans with parameter values from sqlite_stat4.
_STAT4 = _has_stat4()


# -- reads answered on the event loop ---------------------------------------------
#
# A trip to a worker thread and back costs more than a kept point read itself (two
# wake-ups, and the GIL handed between three threads). A kept read whose last run
# took under _QUICK_LAST is run on the event loop instead, on an idle connection
# of the run's, with the busy timeout at zero (a locked dataset is not waited for)
# and a progress handler that stops it at _QUICK_BUDGET: stopped, busy, or failing
# in any way, nothing of it is used and the call takes the worker path as if it had
# not been tried (its shape is then marked slow until a worker run is quick again).
# What is decided, enforced and recorded is the same on both paths.

#: A kept read whose last run took less than this is tried on the event loop.
_QUICK_LAST = 0.0005
#: The most one such read may hold the event loop before it is stopped.
_QUICK_BUDGET = 0.002
#: VM instructions between two checks of that bound.
_QUICK_STEPS = 100


@dataclass
class _Shape:
    """What one statement shape compiled to on one connection (see above)."""

    accesses: _Accesses
    # Whether its last read was quick enough to be tried on the event loop.
    quick: bool = False
    # Where the keyed variant puts the key, and whether the variant's plan reads
    # through nothing undecided; None: not worked out yet (a write, or no read yet).
    keyed: tuple[KeyedSplit | None, str | None, list[str] | None] | None = None
    within: bool | None = None


class _Conn(sqlite3.Connection):
    """A read connection and the statement shapes it compiled (see above)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.shapes: dict[tuple[str, object], _Shape] = {}
        self.shapes_version = -1
        # Its busy timeout as opened (ms), and as it is now (quick reads set zero).
        self.busy_default = self.busy_now = max(1, int(float(kwargs.get("timeout", 5.0)) * 1000))

    def busy(self, ms: int) -> None:
        """Set the busy timeout to ``ms`` (a statement only if it changes)."""
        if self.busy_now != ms:
            self.execute(f"PRAGMA busy_timeout = {int(ms)}")
            self.busy_now = ms


def _shape_key(sql: str, params: Any) -> tuple[str, object] | None:
    """The cache key of a statement and its parameters' names or count; None: not kept."""
    if len(sql) > _SHAPE_SQL_LENGTH or _VALUE_PLANNED.search(sql):
        return None
    if isinstance(params, dict):
        return sql, tuple(sorted(params))
    return sql, len(params)


def _connect(
    path: str, *, write: bool, busy_timeout: float, factory: type[sqlite3.Connection] = _Conn
) -> sqlite3.Connection:
    mode = "rw" if write else "ro"
    uri = f"{Path(path).resolve().as_uri()}?mode={mode}"
    conn = sqlite3.connect(
        uri,
        uri=True,
        isolation_level=None,
        check_same_thread=False,
        timeout=busy_timeout,
        # Every statement is compiled afresh under the authorizer (SQLite also
        # expires prepared statements when the authorizer changes); a cache
        # would only hide that.
        cached_statements=0,
        factory=factory,
    )
    conn.setlimit(sqlite3.SQLITE_LIMIT_ATTACHED, 0)
    conn.setlimit(sqlite3.SQLITE_LIMIT_LENGTH, MAX_VALUE_LENGTH)
    conn.setlimit(sqlite3.SQLITE_LIMIT_SQL_LENGTH, MAX_SQL_LENGTH + 64)
    # A dataset file is the tenant's, not ours: its views and triggers should
    # not reach functions with side effects even if one were allowed someday.
    conn.execute("PRAGMA trusted_schema = OFF")
    if not write:
        conn.execute("PRAGMA query_only = ON")
    return conn


class _ReadPool:
    """Read-only connections to one dataset for one run, reused across its calls:
    opening one and setting it up costs about as much as a small query."""

    def __init__(self, location: str) -> None:
        self.location = location
        self._idle = IdleConnections[_Conn]()
        self._lock = threading.Lock()
        # Row keys by table and b-trees by root page, valid for one schema
        # version (PRAGMA schema_version).
        self._keys: dict[str, list[str] | None] = {}
        self._trees: dict[int, _Tree | None] = {}
        self._keys_version = -1
        # Whether the dataset holds sqlite_stat4 (and this SQLite plans with it).
        self._stat4 = False

    def take_idle(self) -> _Conn | None:
        """An idle connection, if one is: never opens one (see quick_read)."""
        return self._idle.pop()

    def take(self, busy_timeout: float) -> _Conn:
        conn = self._idle.pop()
        if conn is not None:
            conn.busy(conn.busy_default)  # as it was opened, if a quick read changed it
            return conn
        made = _connect(self.location, write=False, busy_timeout=busy_timeout)
        assert isinstance(made, _Conn)
        return made

    def give(self, conn: _Conn) -> None:
        conn.set_authorizer(None)
        conn.set_progress_handler(None, 0)
        # A read-only statement that left a transaction open is not reused.
        if conn.in_transaction or not self._idle.keep(conn):
            conn.close()

    def _check_version(self, conn: sqlite3.Connection) -> None:
        version = int(conn.execute("PRAGMA schema_version").fetchone()[0])
        if isinstance(conn, _Conn) and conn.shapes_version != version:
            # The pragma reads the file; the connection's own copy of the schema is
            # reloaded only when a statement that depends on it runs, and EXPLAIN
            # lists a program without running it. Without this, a statement
            # compiled after another connection changed the schema (an index
            # added) would be analysed against the old schema and run against the
            # new one, through an index nobody decided.
            conn.execute(_RELOAD).fetchall()
            conn.shapes.clear()
            conn.shapes_version = version
        with self._lock:
            if version == self._keys_version:
                return
        stat4 = _STAT4 and _declared(conn, "sqlite_stat4") is not None
        with self._lock:
            if version != self._keys_version:
                self._keys, self._trees, self._keys_version = {}, {}, version
                self._stat4 = stat4

    def shapes(self, conn: _Conn) -> dict[tuple[str, object], _Shape] | None:
        """``conn``'s statement shapes, for the schema version it sees now (checked
        here); None if the dataset's plans may follow parameter values."""
        self._check_version(conn)
        with self._lock:
            if self._stat4:
                return None
        return conn.shapes

    def row_key(
        self, conn: sqlite3.Connection, table: str, *, check: bool = True
    ) -> list[str] | None:
        if check:
            self._check_version(conn)
        with self._lock:
            if table in self._keys:
                return self._keys[table]
        key = _row_key(conn, table)
        with self._lock:
            self._keys[table] = key
        return key

    def trees(
        self, conn: sqlite3.Connection, roots: set[int], *, check: bool = True
    ) -> dict[int, _Tree | None]:
        """What each root page of main is (None: no table or index the schema names).
        ``check=False``: the schema version was checked moments ago in this statement."""
        if check:
            self._check_version(conn)
        with self._lock:
            out = {r: self._trees[r] for r in roots if r in self._trees}
        for root in roots - out.keys():
            out[root] = tree = _tree(conn, root)
            with self._lock:
                self._trees[root] = tree
        return out


def _read_pool(scope: RunScope, binding: DatasetBinding) -> _ReadPool:
    # Kept on the scope so the connections live and die with the run.
    pools: dict[str, _ReadPool] = scope.__dict__.setdefault("_sql_read_pools", {})
    pool = pools.get(binding.location)
    if pool is None:
        pool = pools.setdefault(binding.location, _ReadPool(binding.location))
    return pool


def _columns_of(conn: sqlite3.Connection, table: str) -> list[str]:
    rows = conn.execute(f"PRAGMA main.table_info({quote_name(table)})").fetchall()
    return [str(r[1]) for r in rows]


def _declared(conn: sqlite3.Connection, table: str) -> str | None:
    """The name ``table`` was declared with (SQLite matches names ignoring ASCII
    case), or None if the dataset has no such table or view."""
    row = conn.execute(
        "SELECT name FROM main.sqlite_schema WHERE type IN ('table', 'view') AND name = ?"
        " COLLATE NOCASE",
        (table,),
    ).fetchone()
    return None if row is None else str(row[0])


_ASCII_LOWER = str.maketrans("ABCDEFGHIJKLMNOPQRSTUVWXYZ", "abcdefghijklmnopqrstuvwxyz")


def _fold(name: str) -> str:
    """A table name as SQLite compares them: ASCII letters without case."""
    return name.translate(_ASCII_LOWER)


def _row_key(conn: sqlite3.Connection, table: str) -> list[str] | None:
    """The columns that identify a row of ``table``: its primary key, else a rowid alias."""
    rows = conn.execute(f"PRAGMA main.table_info({quote_name(table)})").fetchall()
    pk = sorted((int(r[5]), str(r[1])) for r in rows if int(r[5]) > 0)
    if pk:
        return [name for _, name in pk]
    names = {str(r[1]).lower() for r in rows}
    # A real column may shadow one rowid spelling; SQLite has three.
    for alias in ("rowid", "_rowid_", "oid"):
        if alias not in names:
            return [alias]
    return None


def _tree(conn: sqlite3.Connection, root: int) -> _Tree | None:
    """The table or index whose b-tree starts at ``root`` in main, and what orders it.

    Run without an authorizer, on the broker's behalf. An index is ordered by all
    its columns, the ones SQLite appends (a WITHOUT ROWID table's key) included;
    a column that is an expression could be of any column, so it stands for all
    of them. A WITHOUT ROWID table is ordered by its key columns."""
    if root == 1:
        return _Tree(SCHEMA_TABLE, None, frozenset())
    row = conn.execute(
        "SELECT type, name, tbl_name FROM main.sqlite_schema WHERE rootpage = ?"
        " AND type IN ('table', 'index')",
        (root,),
    ).fetchone()
    if row is None:
        return None
    kind, name, table = str(row[0]), str(row[1]), str(row[2])
    # (seqno, cid, name, desc, coll, key); a rowid table's own name gives no rows.
    info = conn.execute(f"PRAGMA main.index_xinfo({quote_name(name)})").fetchall()
    if kind == "table":
        key = frozenset(str(r[2]) for r in info if int(r[5]) and r[2] is not None)
        return _Tree(table, f"WITHOUT ROWID table {name}", key) if key else _Tree(table, None, key)
    if any(int(r[1]) == -2 for r in info):
        return _Tree(table, f"index {name}", frozenset(_columns_of(conn, table)))
    cols = frozenset(str(r[2]) for r in info if int(r[1]) >= 0 and r[2] is not None)
    return _Tree(table, f"index {name}", cols)


def _plan_reads(
    program: Sequence[Sequence[Any]], pool: _ReadPool, conn: sqlite3.Connection, check: bool
) -> tuple[list[_PlanRead], set[str]]:
    """What the compiled ``program`` (EXPLAIN's rows) reads through b-trees: the
    orders it relies on, and every table it opens. Raises :class:`Refused` for a
    b-tree outside the dataset (temp, another schema) or one the schema does not name.

    Only cursors opened to read (OpenRead, ReopenIdx) count: a write's own cursors
    (OpenWrite) only maintain the table and its indexes, and what a write reads to
    choose its rows is opened with OpenRead."""
    opened: dict[int, int] = {}
    for row in program:
        if row[1] in ("OpenRead", "ReopenIdx"):
            if int(row[4]) != 0:
                raise Refused(f"{_OUTSIDE} (the statement opens the temp schema)")
            opened[int(row[2])] = int(row[3])
    trees = pool.trees(conn, set(opened.values()), check=check)
    if not opened:
        return [], set()
    reads: dict[tuple[str, str], set[str]] = {}
    tables: set[str] = set()
    for cursor, root in opened.items():
        tree = trees[root]
        if tree is None:
            raise Refused(
                f"the plan reads a b-tree (page {root}) the dataset's schema does not name"
            )
        tables.add(tree.table)
        if tree.via is None or not tree.columns or _counted_only(program, cursor):
            continue
        reads.setdefault((tree.table, tree.via), set()).update(tree.columns)
    plan = [_PlanRead(t, via, frozenset(c)) for (t, via), c in sorted(reads.items())]
    return plan, tables


def _counted_only(program: Sequence[Sequence[Any]], cursor: int) -> bool:
    """Whether ``cursor`` is only counted (count(*) reads the smallest b-tree)."""
    uses = {str(row[1]) for row in program if int(row[2]) == cursor}
    return "Count" in uses and uses <= _COUNT_ONLY


class _Statement:
    """One guest statement on one dataset, from compile to commit. Not thread-safe;
    used by one worker thread at a time."""

    def __init__(
        self, binding: DatasetBinding, pool: _ReadPool, sql: str, params: Any, deadline: float
    ) -> None:
        self.binding = binding
        self.pool = pool
        self.sql = sql
        self.params = params
        self.deadline = deadline
        self.conn: _Conn | None = None
        self.shape: _Shape | None = None  # what this statement compiled to, if kept
        self.write_conn: sqlite3.Connection | None = None
        self.timed_out = False
        # The event loop may close the statement while a worker still runs it
        # (a cancelled call): closing waits for the worker, which the deadline bounds.
        self.lock = threading.Lock()

    # -- limits ---------------------------------------------------------------

    def _progress(self) -> int:
        if time.monotonic() > self.deadline:
            self.timed_out = True
            return 1
        return 0

    def _busy_timeout(self) -> float:
        return max(0.05, self.deadline - time.monotonic())

    # -- step 2: what does it touch? ------------------------------------------

    def analyse(self) -> _Accesses:
        with self.lock:
            return self._analyse()

    def _analyse(self) -> _Accesses:
        for unseen in _UNCHECKABLE.finditer(self.sql):
            word = unseen.group(1).lower()
            if word == "indexed" and _NOT_BEFORE.search(self.sql, 0, unseen.start()):
                continue
            raise Refused(
                _UNCHECKABLE_REASONS[word],
                write=bool(re.match(r"\s*(insert|update|delete|replace)\b", self.sql, re.I)),
            )
        self.conn = conn = self.pool.take(self._busy_timeout())
        conn.set_progress_handler(self._progress, _PROGRESS_STEPS)
        # The schema version is read (and the connection's schema made current)
        # before anything is compiled or taken from what was kept.
        try:
            shapes = self.pool.shapes(conn)
        except sqlite3.Error:
            checked = False  # the compile below meets it and says why
            shapes = None
        else:
            checked = True
        key = _shape_key(self.sql, self.params) if shapes is not None else None
        if shapes is not None and key is not None:
            self.shape = shapes.get(key)
            if self.shape is not None:
                return self.shape.accesses
        accesses = self._compile(conn, checked=checked)
        if shapes is not None and key is not None:
            if len(shapes) >= _SHAPES_KEPT:
                shapes.clear()  # a run cycling through statements: start over
            self.shape = shapes[key] = _Shape(accesses)
        return accesses

    def _compile(self, conn: _Conn, *, checked: bool) -> _Accesses:
        accesses = _Accesses()
        conn.set_authorizer(accesses.collect)
        try:
            # EXPLAIN compiles the statement (every authorizer report happens at
            # compile time) and lists its bytecode without running it.
            program = conn.execute("EXPLAIN " + self.sql, self.params).fetchall()
        except sqlite3.ProgrammingError as exc:
            # Python's own checks: several statements, wrong parameter count.
            raise Refused(_programming_reason(exc), bad_call=True) from None
        except sqlite3.Error as exc:
            if accesses.refusal is not None:
                raise Refused(accesses.refusal, write=accesses.is_write) from None
            if self.timed_out:
                raise TimedOut from None
            raise Refused(
                "the statement does not compile", bad_call=True, detail=str(exc)
            ) from None
        finally:
            conn.set_authorizer(None)
        if accesses.refusal is not None:
            raise Refused(accesses.refusal, write=accesses.is_write)
        widths = {int(row[3]) for row in program if row[1] == "ResultRow"}
        accesses.result_width = widths.pop() if len(widths) == 1 else None
        for table, cols in list(accesses.reads.items()):
            if cols != {""} or table == SCHEMA_TABLE:
                continue
            # "Referenced, no column read" is also reported for a CTE or a
            # subquery's alias; only the dataset's own tables and views count.
            # (A CTE named like a real table is decided as that table: stricter.)
            # It names the table as the statement spelled it (ORDERS for orders),
            # where a column read names it as declared: decided as declared.
            declared = _declared(conn, table)
            if declared != table:
                del accesses.reads[table]
                if declared is None:
                    accesses.aliases.add(table)
                else:
                    accesses.reads.setdefault(declared, set()).add("")
        for table in accesses.whole_row_writes:
            accesses.writes.setdefault(table, set()).update(_columns_of(conn, table))
        # What the plan reads that the authorizer did not say: every table it opens
        # is decided (it always is, this is a backstop), and the columns of the
        # indexes and WITHOUT ROWID keys whose order it uses.
        try:
            plan, opened = _plan_reads(program, self.pool, conn, check=not checked)
        except Refused as exc:
            exc.write = accesses.is_write
            raise
        for table in opened:
            if table not in accesses.reads and table not in accesses.writes:
                accesses.reads[table] = {""}
        for read in plan:
            extra = read.columns - accesses.reads.get(read.table, set())
            if extra:
                accesses.reads.setdefault(read.table, set())
                accesses.plan.append(_PlanRead(read.table, read.via, frozenset(extra)))
        return accesses

    # -- step 4: run it --------------------------------------------------------

    def _enforcing(
        self,
        reads: Mapping[str, set[str]],
        writes: Mapping[str, set[str]],
        aliases: set[str],
    ) -> Callable[[int, str | None, str | None, str | None, str | None], int]:
        # The engine reports a table as the statement spelled it where no column
        # is read (see _analyse): matched here the way SQLite matches names.
        folded = {_fold(t): cols for t, cols in reads.items()}

        def authorize(
            action: int, arg1: str | None, arg2: str | None, db: str | None, _src: str | None
        ) -> int:
            if action in (_SELECT, _RECURSIVE):
                return _OK
            if action == _READ:
                table, column = arg1 or "", arg2 or ""
                if db is None and not column and table in aliases:
                    return _OK
                if db is None and not column:
                    name = _fold(table)
                    name = SCHEMA_TABLE if name in _SCHEMA_NAMES else name
                    return _OK if "" in folded.get(name, ()) else _DENY
                ok = db in ("main", None) and column in reads.get(table, ())
                return _OK if ok else _DENY
            if action == _UPDATE:
                return _OK if db == "main" and (arg2 or "") in writes.get(arg1 or "", ()) else _DENY
            if action in (_INSERT, _DELETE):
                return _OK if db == "main" and (arg1 or "") in writes else _DENY
            if action == _FUNCTION:
                return _OK if (arg2 or "").lower() in ALLOWED_FUNCTIONS else _DENY
            return _DENY

        return authorize

    def run_read(self, accesses: Accesses, row_limit: int) -> Outcome:
        assert isinstance(accesses, _Accesses)
        with self.lock, _failing():
            started = time.monotonic()
            try:
                out = self._run_read(accesses, row_limit)
                if self.shape is not None:
                    self.shape.quick = time.monotonic() - started < _QUICK_LAST
                return out
            finally:
                # The rows are held: the connection goes back to the pool now, not
                # after the event is durable, so the run's next calls find it (and
                # the statement shapes it compiled) instead of opening another.
                if self.conn is not None:
                    conn, self.conn = self.conn, None
                    self.pool.give(conn)

    def quick_read(
        self, allowed: Callable[[Accesses], bool], row_limit: int
    ) -> tuple[_Accesses, Outcome] | None:
        """On the event loop: the read, if it is kept, quick, ``allowed`` (the
        caller's Cedar answers) and done within the bound (see above); None: take
        the worker path."""
        key = _shape_key(self.sql, self.params)
        conn = self.pool.take_idle() if key is not None else None
        if conn is None or key is None:
            return None
        shape: _Shape | None = None
        stop = time.monotonic() + _QUICK_BUDGET

        def bounded() -> int:
            if time.monotonic() > stop:
                self.timed_out = True  # read by _fetch: stopped, not failed
                return 1
            return 0

        try:
            conn.busy(0)  # left so for the next quick read; a worker's take sets it back
            conn.set_progress_handler(bounded, _QUICK_STEPS)
            shapes = self.pool.shapes(conn)
            shape = shapes.get(key) if shapes is not None else None
            if shape is None or not shape.quick:
                return None
            accesses = shape.accesses
            if accesses.is_write or not allowed(accesses):
                return None  # decided again, and recorded, on the regular path
            self.conn, self.shape = conn, shape
            return accesses, self._run_read(accesses, row_limit)
        except (sqlite3.Error, TimedOut, _Misread):
            if shape is not None:
                shape.quick = False
            return None
        finally:
            self.conn = None
            self.shape = None
            self.timed_out = False
            conn.set_progress_handler(None, 0)
            self.pool.give(conn)

    def _run_read(self, accesses: _Accesses, row_limit: int) -> Outcome:
        conn = self.conn
        assert conn is not None
        sentinel = "9" + secrets.token_hex(12)
        split, table, key = self._keyed(conn, accesses)
        variant = None if split is None else split.join(sentinel)
        if (
            variant is not None
            and table is not None
            and key is not None
            and self._within(conn, variant, accesses)
        ):
            reads = {t: set(c) for t, c in accesses.reads.items()}
            # The broker's own read of the key (the engine names a rowid read
            # after its INTEGER PRIMARY KEY alias, or ROWID); never returned.
            reads[table] |= {*key, "ROWID"}
            try:
                return self._fetch(
                    conn, variant, reads, accesses.aliases, row_limit, len(key) + 1,
                    expect=(accesses.result_width, sentinel),
                )  # fmt: skip
            except TimedOut:
                raise
            except (sqlite3.Error, _Misread):
                pass  # the rewrite did not fit this statement; run it as written
        return self._fetch(conn, self.sql, accesses.reads, accesses.aliases, row_limit, 0)

    def _plan_within(self, conn: sqlite3.Connection, sql: str, accesses: _Accesses) -> bool:
        """Whether ``sql`` (the keyed variant) reads through nothing that was not
        decided for the statement: its plan may pick another index."""
        try:
            program = conn.execute("EXPLAIN " + sql, self.params).fetchall()
            plan, opened = _plan_reads(program, self.pool, conn, check=False)
        except (sqlite3.Error, Refused):
            return False
        decided = {t: c | accesses.plan_columns(t) for t, c in accesses.reads.items()}
        if not opened <= decided.keys():
            return False
        return all(p.columns <= decided[p.table] for p in plan)

    def _fetch(
        self,
        conn: sqlite3.Connection,
        sql: str,
        reads: Mapping[str, set[str]],
        aliases: set[str],
        row_limit: int,
        key_width: int,
        expect: tuple[int | None, str] | None = None,
    ) -> Outcome:
        """Run ``sql``; its last ``key_width`` columns are the broker's, never returned.
        For the keyed variant, ``expect`` is (the statement's own width, the sentinel
        that must open the broker's columns in every row): the key's values are
        stripped only if they are exactly where they were put."""
        conn.set_authorizer(self._enforcing(reads, {}, aliases))
        try:
            cur = conn.execute(sql, self.params)
            raw = cur.fetchmany(row_limit + 1)
            description = cur.description or ()
            cur.close()
        except sqlite3.Error:
            if self.timed_out:
                raise TimedOut from None
            raise
        finally:
            conn.set_authorizer(None)
        width = len(description) - key_width
        if expect is not None:
            own, sentinel = expect
            # A statement the rewrite misread (its FROM was not where the scan
            # said) has the key somewhere else: then only the original runs.
            if own is None or width != own or any(row[width] != sentinel for row in raw):
                raise _Misread
        out = Outcome(truncated=len(raw) > row_limit)
        raw = raw[:row_limit]
        out.columns = [str(d[0]) for d in description[:width]]
        out.rows = [[_json_value(v) for v in row[:width]] for row in raw]
        if key_width:
            key_at = width + (1 if expect is not None else 0)
            out.keys = [key_text(row[key_at:]) for row in raw]
        return out

    def _within(self, conn: sqlite3.Connection, variant: str, accesses: _Accesses) -> bool:
        """:meth:`_plan_within`, kept with the statement's shape."""
        if self.shape is not None and self.shape.within is not None:
            return self.shape.within
        within = self._plan_within(conn, variant, accesses)
        if self.shape is not None:
            self.shape.within = within
        return within

    def _keyed(
        self, conn: sqlite3.Connection, accesses: _Accesses
    ) -> tuple[KeyedSplit | None, str | None, list[str] | None]:
        """Where the keyed variant puts the key, kept with the statement's shape."""
        if self.shape is not None and self.shape.keyed is not None:
            return self.shape.keyed
        keyed = self._keyed_split(conn, accesses)
        if self.shape is not None:
            self.shape.keyed = keyed
        return keyed

    def _keyed_split(
        self, conn: sqlite3.Connection, accesses: _Accesses
    ) -> tuple[KeyedSplit | None, str | None, list[str] | None]:
        if len(accesses.reads) != 1 or accesses.selects != 1:
            return None, None, None
        if accesses.functions & _AGGREGATE_FUNCTIONS:
            return None, None, None
        (table,) = accesses.reads
        # The schema version was checked by the analysis, on this connection.
        key = self.pool.row_key(conn, table, check=False)
        if key is None:
            return None, None, None
        return keyed_split(self.sql, table, key), table, key

    def run_write(self, accesses: Accesses) -> Outcome:
        """Run a permitted write inside a transaction left open for commit/rollback."""
        assert isinstance(accesses, _Accesses)
        with self.lock, _failing():
            return self._run_write(accesses)

    def _run_write(self, accesses: _Accesses) -> Outcome:
        self.write_conn = conn = _connect(
            self.binding.location, write=True, busy_timeout=self._busy_timeout()
        )
        conn.execute("BEGIN IMMEDIATE")
        conn.set_progress_handler(self._progress, _PROGRESS_STEPS)
        conn.set_authorizer(self._enforcing(accesses.reads, accesses.writes, accesses.aliases))
        try:
            cur = conn.execute(self.sql, self.params)
            cur.fetchall()  # RETURNING rows: consumed, not returned (reads were decided)
            affected = max(cur.rowcount, 0)
            cur.close()
        except sqlite3.Error:
            if self.timed_out:
                raise TimedOut from None
            raise
        finally:
            # Off before COMMIT/ROLLBACK: a handler past its deadline would
            # interrupt the rollback too.
            conn.set_authorizer(None)
            conn.set_progress_handler(None, 0)
            if conn.in_transaction and self.timed_out:
                conn.execute("ROLLBACK")
        return Outcome(rows_affected=affected)

    def commit(self) -> None:
        with self.lock:
            assert self.write_conn is not None
            self.write_conn.execute("COMMIT")

    def rollback(self) -> None:
        with self.lock:
            if self.write_conn is not None and self.write_conn.in_transaction:
                self.write_conn.execute("ROLLBACK")

    def close(self) -> None:
        with self.lock:
            if self.conn is not None:
                self.pool.give(self.conn)
            if self.write_conn is not None:
                try:
                    self.write_conn.set_progress_handler(None, 0)
                    if self.write_conn.in_transaction:
                        self.write_conn.execute("ROLLBACK")
                finally:
                    self.write_conn.close()
            self.conn = self.write_conn = None


def _programming_reason(exc: sqlite3.ProgrammingError) -> str:
    text = str(exc)
    if "one statement at a time" in text:
        return "one statement per call: multiple statements are not allowed"
    if "binding" in text.lower():
        return f"parameters do not match the statement: {text}"
    return "the statement cannot be run"


def _json_value(value: Any) -> Any:
    if isinstance(value, bytes):
        return {"base64": base64.b64encode(value).decode()}
    return value


@contextmanager
def _failing() -> Iterator[None]:
    # The shared path records only the class of an engine error: its message
    # could quote a value, and goes to the guest alone.
    try:
        yield
    except sqlite3.Error as exc:
        raise Failed(type(exc).__name__, str(exc)) from None


# -- the connector -----------------------------------------------------------------


class SQLiteConnector:
    """SQLite datasets: a file only the runtime opens; the engine's authorizer is
    both what reports a statement's accesses and what enforces the decision, so
    nothing is granted or revoked outside Proctor."""

    kind = DatasetKind.SQLITE

    def recognises(self, where: str) -> bool:
        # A path: whatever a connector with a URL scheme did not claim (tried last).
        return True

    def locate(self, where: str) -> str:
        path = Path(where).resolve()
        try:
            db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
            try:
                db.execute("SELECT count(*) FROM sqlite_schema").fetchone()
            finally:
                db.close()
        except sqlite3.Error as exc:
            raise UsageError(f"{path} is not a readable SQLite database: {exc}") from exc
        return str(path)

    def missing(self, location: str, tables: Mapping[str, Any]) -> list[str]:
        # SQLite's names are case-insensitive (ASCII), as its authorizer compares them.
        try:
            db = sqlite3.connect(f"file:{location}?mode=ro", uri=True)
        except sqlite3.Error as exc:
            raise UsageError(f"the SQLite dataset cannot be read: {exc}") from exc
        try:
            found: list[str] = []
            for table, grant in sorted(tables.items()):
                info = db.execute("SELECT name FROM pragma_table_info(?)", (table,)).fetchall()
                if not info:
                    found.append(f"no table {table!r}")
                    continue
                have = {str(r[0]).lower() for r in info}
                columns = [str(c) for c in grant.get("columns", ())]
                found += [f"no column {c!r} in {table!r}" for c in columns if c.lower() not in have]
            return found
        except sqlite3.Error as exc:
            raise UsageError(f"the SQLite dataset cannot be read: {exc}") from exc
        finally:
            db.close()

    def describe(self, location: str) -> list[TableShape]:
        try:
            # Read-only, and the path quoted: no URI parameter comes from the path.
            db = sqlite3.connect(f"file:{quote(location)}?mode=ro", uri=True)
        except sqlite3.Error as exc:
            raise UsageError(f"the SQLite dataset cannot be read: {exc}") from exc
        try:
            db.execute("PRAGMA query_only = ON")
            names = db.execute(
                "SELECT name, type FROM sqlite_schema WHERE type IN ('table', 'view')"
                " AND name NOT LIKE 'sqlite\\_%' ESCAPE '\\' ORDER BY name LIMIT ?",
                (DESCRIBED_TABLES,),
            ).fetchall()
            out = []
            for name, kind in names:
                rows = db.execute(
                    'SELECT name, type, "notnull", pk FROM pragma_table_info(?)'
                    " ORDER BY cid LIMIT ?",
                    (name, DESCRIBED_COLUMNS),
                ).fetchall()
                cols = tuple(ColumnShape(str(r[0]), str(r[1] or ""), not bool(r[2]), bool(r[3]))
                             for r in rows)  # fmt: skip
                out.append(TableShape(str(name), str(kind), cols))
            return out
        except sqlite3.Error as exc:
            raise UsageError(f"the SQLite dataset cannot be read: {exc}") from exc
        finally:
            db.close()

    def grant(
        self, binding: DatasetBinding, tenant: str, deployment: str, tables: Mapping[str, Any]
    ) -> None:
        return None

    async def prepare(
        self, scope: RunScope, binding: DatasetBinding, call: SqlCall, base: dict[str, Any]
    ) -> tuple[Statement, dict[str, Any]]:
        deadline = time.monotonic() + scope.statement_timeout
        stmt = _Statement(binding, _read_pool(scope, binding), call.sql, call.params, deadline)
        return stmt, {**base, "synthetic": binding.synthetic}

    async def close(self, scope: RunScope, stmt: Statement) -> None:
        assert isinstance(stmt, _Statement)
        # Returning a read connection to the pool is cheap: do it here unless a
        # worker still holds the statement (a cancelled call), then wait off-loop.
        if stmt.write_conn is None and stmt.lock.acquire(blocking=False):
            stmt.lock.release()
            stmt.close()
        else:
            await run_blocking(scope, stmt.close)

    def release(self, scope: RunScope, binding: DatasetBinding) -> None:
        # The read pools are the scope's and go with it; no connection outlives a
        # statement in a transaction.
        return None

    def revoke(self, location: str, tenant: str, deployment: str, dataset: str) -> bool:
        return False

    def revoke_run(self, location: str, tenant: str, run_id: str, dataset: str) -> bool:
        return False  # a SQLite dataset grants nothing per run


SQLITE = SQLiteConnector()
