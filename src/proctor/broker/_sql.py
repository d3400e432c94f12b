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

Row values never reach the ledger: events hold names, counts and keyed hashes.
The statement itself is recorded only as a keyed hash (a literal in a WHERE
clause is a row value).
"""

from __future__ import annotations

import asyncio
import base64
import json
import re
import secrets
import sqlite3
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from proctor.broker._scope import BadCall, BrokerError, CallDenied, DatasetBinding, RunScope
from proctor.errors import PolicyError
from proctor.policy import (
    CedarValue,
    Decision,
    Entity,
    EntityRef,
    EntitySet,
    Request,
    decide,
)

#: Longest statement text accepted from a guest.
MAX_SQL_LENGTH = 100_000
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


class StatementTimeout(BrokerError):
    """The statement ran past the deployment's statement time limit and was stopped."""

    code = "statement_timeout"
    status = 408


@dataclass
class _Accesses:
    """What the engine reported while compiling one statement."""

    reads: dict[str, set[str]] = field(default_factory=dict)
    writes: dict[str, set[str]] = field(default_factory=dict)
    # INSERT and DELETE name no columns; they touch whole rows.
    whole_row_writes: set[str] = field(default_factory=set)
    functions: set[str] = field(default_factory=set)
    aliases: set[str] = field(default_factory=set)  # CTE names reported like tables
    selects: int = 0
    result_width: int | None = None  # columns of a result row, from the compiled program
    refusal: str | None = None
    # What the plan reads that the authorizer did not report (see _PlanRead).
    plan: list[_PlanRead] = field(default_factory=list)

    def plan_columns(self, table: str) -> set[str]:
        return {c for p in self.plan if p.table == table for c in p.columns}

    @property
    def is_write(self) -> bool:
        return bool(self.writes or self.whole_row_writes)

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


@dataclass(frozen=True)
class _Grant:
    """One Cedar question about one table, and its answer."""

    table: str
    action: str
    columns: tuple[str, ...]
    decision: Decision
    # Denied only because of columns the plan reads through (an index, a key).
    through_plan: bool = False

    def as_json(self) -> dict[str, Any]:
        return {
            "table": self.table,
            "action": self.action,
            "columns": list(self.columns),
            "decision": self.decision.decision,
            "policies": list(self.decision.policies),
        }


@dataclass
class _Outcome:
    """What one statement produced; rows go to the guest, never to the ledger."""

    columns: list[str] = field(default_factory=list)
    rows: list[list[Any]] = field(default_factory=list)
    truncated: bool = False
    rows_affected: int = 0
    keys: list[str] | None = None  # None: lineage is the whole table


class _Refused(Exception):
    """Refused before any policy question: the statement itself is unacceptable.

    ``reason`` goes to the ledger and the guest; ``detail`` (the engine's
    message, which may quote the guest's literals) to the guest only."""

    def __init__(
        self, reason: str, *, bad_call: bool = False, detail: str = "", write: bool = False
    ) -> None:
        super().__init__(reason)
        self.reason = reason
        self.bad_call = bad_call
        self.detail = detail
        self.write = write


class _TimedOut(Exception):
    pass


class _Misread(Exception):
    """The keyed variant's columns are not where they were put."""


def _connect(path: str, *, write: bool, busy_timeout: float) -> sqlite3.Connection:
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

    _KEEP = 4

    def __init__(self, location: str) -> None:
        self.location = location
        self._idle: list[sqlite3.Connection] = []
        self._lock = threading.Lock()
        # Row keys by table and b-trees by root page, valid for one schema
        # version (PRAGMA schema_version).
        self._keys: dict[str, list[str] | None] = {}
        self._trees: dict[int, _Tree | None] = {}
        self._keys_version = -1

    def take(self, busy_timeout: float) -> sqlite3.Connection:
        with self._lock:
            if self._idle:
                return self._idle.pop()
        return _connect(self.location, write=False, busy_timeout=busy_timeout)

    def give(self, conn: sqlite3.Connection) -> None:
        conn.set_authorizer(None)
        conn.set_progress_handler(None, 0)
        if conn.in_transaction:
            conn.close()  # a read-only statement left a transaction: do not reuse
            return
        with self._lock:
            if len(self._idle) < self._KEEP:
                self._idle.append(conn)
                return
        conn.close()

    def _check_version(self, conn: sqlite3.Connection) -> None:
        version = int(conn.execute("PRAGMA schema_version").fetchone()[0])
        with self._lock:
            if version != self._keys_version:
                self._keys, self._trees, self._keys_version = {}, {}, version

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
    rows = conn.execute(f"PRAGMA main.table_info({_quote(table)})").fetchall()
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
    rows = conn.execute(f"PRAGMA main.table_info({_quote(table)})").fetchall()
    pk = sorted((int(r[5]), str(r[1])) for r in rows if int(r[5]) > 0)
    if pk:
        return [name for _, name in pk]
    names = {str(r[1]).lower() for r in rows}
    # A real column may shadow one rowid spelling; SQLite has three.
    for alias in ("rowid", "_rowid_", "oid"):
        if alias not in names:
            return [alias]
    return None


def _quote(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


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
    info = conn.execute(f"PRAGMA main.index_xinfo({_quote(name)})").fetchall()
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
    orders it relies on, and every table it opens. Raises :class:`_Refused` for a
    b-tree outside the dataset (temp, another schema) or one the schema does not name.

    Only cursors opened to read (OpenRead, ReopenIdx) count: a write's own cursors
    (OpenWrite) only maintain the table and its indexes, and what a write reads to
    choose its rows is opened with OpenRead."""
    opened: dict[int, int] = {}
    for row in program:
        if row[1] in ("OpenRead", "ReopenIdx"):
            if int(row[4]) != 0:
                raise _Refused(f"{_OUTSIDE} (the statement opens the temp schema)")
            opened[int(row[2])] = int(row[3])
    trees = pool.trees(conn, set(opened.values()), check=check)
    if not opened:
        return [], set()
    reads: dict[tuple[str, str], set[str]] = {}
    tables: set[str] = set()
    for cursor, root in opened.items():
        tree = trees[root]
        if tree is None:
            raise _Refused(
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
        self.conn: sqlite3.Connection | None = None
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
            raise _Refused(
                _UNCHECKABLE_REASONS[word],
                write=bool(re.match(r"\s*(insert|update|delete|replace)\b", self.sql, re.I)),
            )
        self.conn = conn = self.pool.take(self._busy_timeout())
        conn.set_progress_handler(self._progress, _PROGRESS_STEPS)
        accesses = _Accesses()
        conn.set_authorizer(accesses.collect)
        try:
            # EXPLAIN compiles the statement (every authorizer report happens at
            # compile time) and lists its bytecode without running it.
            program = conn.execute("EXPLAIN " + self.sql, self.params).fetchall()
        except sqlite3.ProgrammingError as exc:
            # Python's own checks: several statements, wrong parameter count.
            raise _Refused(_programming_reason(exc), bad_call=True) from None
        except sqlite3.Error as exc:
            if accesses.refusal is not None:
                raise _Refused(accesses.refusal, write=accesses.is_write) from None
            if self.timed_out:
                raise _TimedOut from None
            raise _Refused(
                "the statement does not compile", bad_call=True, detail=str(exc)
            ) from None
        finally:
            conn.set_authorizer(None)
        if accesses.refusal is not None:
            raise _Refused(accesses.refusal, write=accesses.is_write)
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
            plan, opened = _plan_reads(program, self.pool, conn, check=True)
        except _Refused as exc:
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

    def run_read(self, accesses: _Accesses, row_limit: int) -> _Outcome:
        with self.lock:
            return self._run_read(accesses, row_limit)

    def _run_read(self, accesses: _Accesses, row_limit: int) -> _Outcome:
        conn = self.conn
        assert conn is not None
        sentinel = "9" + secrets.token_hex(12)
        variant, table, key = self._keyed_variant(conn, accesses, sentinel)
        if (
            variant is not None
            and table is not None
            and key is not None
            and self._plan_within(conn, variant, accesses)
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
            except _TimedOut:
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
        except (sqlite3.Error, _Refused):
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
    ) -> _Outcome:
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
                raise _TimedOut from None
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
        out = _Outcome(truncated=len(raw) > row_limit)
        raw = raw[:row_limit]
        out.columns = [str(d[0]) for d in description[:width]]
        out.rows = [[_json_value(v) for v in row[:width]] for row in raw]
        if key_width:
            key_at = width + (1 if expect is not None else 0)
            out.keys = [_key_text(row[key_at:]) for row in raw]
        return out

    def _keyed_variant(
        self, conn: sqlite3.Connection, accesses: _Accesses, sentinel: str
    ) -> tuple[str | None, str | None, list[str] | None]:
        if len(accesses.reads) != 1 or accesses.selects != 1:
            return None, None, None
        if accesses.functions & _AGGREGATE_FUNCTIONS:
            return None, None, None
        (table,) = accesses.reads
        # The schema version was checked by the analysis, on this connection.
        key = self.pool.row_key(conn, table, check=False)
        if key is None:
            return None, None, None
        variant = keyed_variant(self.sql, table, key, sentinel)
        return variant, table, key

    def run_write(self, accesses: _Accesses) -> _Outcome:
        """Run a permitted write inside a transaction left open for commit/rollback."""
        with self.lock:
            return self._run_write(accesses)

    def _run_write(self, accesses: _Accesses) -> _Outcome:
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
                raise _TimedOut from None
            raise
        finally:
            # Off before COMMIT/ROLLBACK: a handler past its deadline would
            # interrupt the rollback too.
            conn.set_authorizer(None)
            conn.set_progress_handler(None, 0)
            if conn.in_transaction and self.timed_out:
                conn.execute("ROLLBACK")
        return _Outcome(rows_affected=affected)

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


def _key_text(values: Sequence[Any]) -> str:
    """A row key as text: ``42`` for customer 42; a JSON array for composite keys."""

    def one(v: Any) -> Any:
        return v.hex() if isinstance(v, bytes) else v

    if len(values) == 1:
        v = one(values[0])
        return v if isinstance(v, str) else json.dumps(v)
    return json.dumps([one(v) for v in values], separators=(",", ":"))


# -- lineage: the keyed variant -------------------------------------------------
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
    cols = ", ".join(
        f"{_quote(qualifier)}.{k if k in ('rowid', '_rowid_', 'oid') else _quote(k)}" for k in key
    )
    if sentinel is not None:
        cols = f"'{sentinel}', {cols}"
    at = toks[from_at].start
    return f"{sql[:at]}, {cols} {sql[at:]}"


# -- the handler -----------------------------------------------------------------


def _parse_request(request: Mapping[str, Any]) -> tuple[str, str, Any]:
    dataset = request.get("dataset")
    sql = request.get("sql")
    params = request.get("params", [])
    if not isinstance(dataset, str) or not dataset:
        raise BadCall("sql: 'dataset' must be a non-empty string")
    if not isinstance(sql, str) or not sql.strip():
        raise BadCall("sql: 'sql' must be a non-empty string")
    if len(sql) > MAX_SQL_LENGTH:
        raise BadCall(f"sql: the statement is longer than {MAX_SQL_LENGTH} characters")
    if "\x00" in sql:
        raise BadCall("sql: the statement contains a NUL character")
    scalars = (str, int, float, type(None))
    if params is None:
        params = []
    if isinstance(params, list):
        if not all(isinstance(p, scalars) for p in params):
            raise BadCall("sql: parameters must be strings, numbers or null")
        return dataset, sql, tuple(params)
    if isinstance(params, dict):
        if not all(isinstance(k, str) and isinstance(v, scalars) for k, v in params.items()):
            raise BadCall("sql: named parameters must map names to strings, numbers or null")
        return dataset, sql, dict(params)
    raise BadCall("sql: 'params' must be a list or an object")


def _resource(dataset: str, tables: Sequence[str]) -> str:
    if len(tables) == 1:
        return f"dataset/{dataset}/table/{tables[0]}"
    return f"dataset/{dataset}"


def _combined(scope: RunScope, grants: Sequence[_Grant], allowed: bool) -> Decision:
    """One decision for the event: the permits that allowed every table, or the
    policies behind the denies (empty for the default deny)."""
    chosen = [g.decision for g in grants if g.decision.allowed == allowed]
    policies = sorted({p for d in chosen for p in d.policies})
    errors = tuple(e for d in chosen for e in d.errors)
    return Decision(allowed, tuple(policies), scope.policies.version, errors)


def _decide(
    scope: RunScope, dataset: str, binding: DatasetBinding, accesses: _Accesses
) -> list[_Grant]:
    grants: list[_Grant] = []
    questions = [("sql.select", t, c | accesses.plan_columns(t)) for t, c in accesses.reads.items()]
    questions += [("sql.write", t, c) for t, c in accesses.writes.items()]
    for action, table, cols in sorted(questions, key=lambda q: (q[1], q[0])):
        columns = tuple(sorted(c for c in cols if c))
        try:
            ref, entities = _table_entities(scope, dataset, binding, table)
        except PolicyError:
            # A table whose name cannot be a policy resource cannot be permitted.
            denied = Decision(False, (), scope.policies.version, ("unnameable table",))
            grants.append(_Grant(table, action, columns, denied))
            continue
        context: dict[str, CedarValue] = {
            "dataset": dataset,
            "columns": list(columns),
            "row_limit": scope.row_limit,
        }
        decision = decide(scope.policies, Request(scope.principal, action, ref, context), entities)
        through_plan = False
        if not decision.allowed and action == "sql.select" and accesses.plan_columns(table):
            # Would the columns the statement names alone be permitted? Then the
            # plan is why it is denied, and the refusal says how to avoid it.
            named = sorted(c for c in accesses.reads[table] if c)
            context = {**context, "columns": list(named)}
            alone = decide(scope.policies, Request(scope.principal, action, ref, context), entities)
            through_plan = alone.allowed
        grants.append(_Grant(table, action, columns, decision, through_plan))
    return grants


def _table_entities(
    scope: RunScope, dataset: str, binding: DatasetBinding, table: str
) -> tuple[EntityRef, EntitySet]:
    """The run's entities plus this Table, parsed once per run and table: adding
    an entity costs about what a decision does (docs/policy.md)."""
    cache: dict[tuple[str, str], tuple[EntityRef, EntitySet]]
    cache = scope.__dict__.setdefault("_sql_table_entities", {})
    hit = cache.get((dataset, table))
    if hit is None:
        entity = Entity.table(scope.tenant, dataset, table, synthetic=binding.synthetic)
        hit = (entity.uid, scope.entities().with_added([entity]))
        if len(cache) < 1024:  # a statement can name tables that do not exist
            cache[(dataset, table)] = hit
    return hit


def _deny_reason(denied: Sequence[_Grant], plan: Sequence[_PlanRead] = ()) -> str:
    parts = []
    for g in denied:
        what = f"{g.action} on {g.table} ({', '.join(g.columns) or 'no columns'})"
        if g.decision.errors:
            why = "policy evaluation failed"
        elif g.decision.policies:
            why = "forbidden by " + ", ".join(g.decision.policies)
        else:
            why = "no policy permits it"
        parts.append(f"{what}: {why}")
        if g.through_plan:
            parts += [p.hint() for p in plan if p.table == g.table]
    return "denied: " + "; ".join(parts)


def _sql_hmac(scope: RunScope, sql: str) -> str:
    return scope.key_hmacs([sql])[0]


async def handle_sql(scope: RunScope, request: Mapping[str, Any]) -> dict[str, Any]:
    """One guest SQL call: ``{"dataset", "sql", "params"}`` in; for a read
    ``{"columns", "rows", "row_count", "truncated"}`` out, for a write
    ``{"rows_affected"}``. Raises :class:`CallDenied` (policy or a refused
    construct), :class:`BadCall` (malformed), :class:`StatementTimeout`, or
    :class:`CallRefused` (the ledger could not record: nothing is answered,
    a write is rolled back). Every outcome is recorded."""
    untrusted: object = request  # decoded JSON from the guest: any shape
    if not isinstance(untrusted, Mapping):
        untrusted = {}
    request = untrusted
    raw_dataset = request.get("dataset")
    name = "?"
    if isinstance(raw_dataset, str) and 0 < len(raw_dataset) <= 128 and raw_dataset.isprintable():
        name = raw_dataset
    base: dict[str, Any] = {"dataset": name}
    raw_sql = request.get("sql")
    if isinstance(raw_sql, str):
        base["sql_hmac"] = _sql_hmac(scope, raw_sql)
    try:
        dataset, sql, params = _parse_request(request)
        binding = scope.datasets.get(dataset)
        if binding is None:
            raise CallDenied(f"sql: no dataset {dataset!r} is bound to this run")
        if binding.kind not in ("sqlite", "postgresql"):
            raise BadCall(f"sql: datasets of kind {binding.kind!r} are not supported yet")
    except BrokerError as exc:
        await _record_refusal(scope, "sql.select", f"dataset/{name}", exc.message, base)
        raise
    if binding.kind == "postgresql":
        # Each engine has its own connector; the request's checks above are shared.
        # Imported here: the PostgreSQL connector builds on this module.
        from proctor.broker._pg_sql import handle_pg_statement

        return await handle_pg_statement(scope, dataset, sql, params, binding, base)

    deadline = time.monotonic() + scope.statement_timeout
    stmt = _Statement(binding, _read_pool(scope, binding), sql, params, deadline)
    details = {**base, "synthetic": binding.synthetic}
    try:
        return await _handle(scope, stmt, dataset, binding, details)
    finally:
        # Returning a read connection to the pool is cheap: do it here unless a
        # worker still holds the statement (a cancelled call), then wait off-loop.
        if stmt.write_conn is None and stmt.lock.acquire(blocking=False):
            stmt.lock.release()
            stmt.close()
        else:
            await asyncio.to_thread(stmt.close)


async def _handle(
    scope: RunScope,
    stmt: _Statement,
    dataset: str,
    binding: DatasetBinding,
    details: dict[str, Any],
) -> dict[str, Any]:
    def compile_decide_read() -> tuple[_Accesses, list[_Grant], _Outcome | BaseException | None]:
        # One trip to a worker thread for the common case: a permitted read runs
        # at once; its event is recorded below, before anything is answered.
        accesses = stmt.analyse()
        grants = _decide(scope, dataset, binding, accesses)
        if accesses.is_write or not grants or not all(g.decision.allowed for g in grants):
            return accesses, grants, None
        try:
            return accesses, grants, stmt.run_read(accesses, scope.row_limit)
        except (_TimedOut, sqlite3.Error) as exc:
            return accesses, grants, exc

    try:
        accesses, grants, read = await asyncio.to_thread(compile_decide_read)
    except _Refused as exc:
        refused_action = "sql.write" if exc.write else "sql.select"
        await _record_refusal(scope, refused_action, f"dataset/{dataset}", exc.reason, details)
        if exc.bad_call:
            message = f"{exc.reason}: {exc.detail}" if exc.detail else exc.reason
            raise BadCall(f"sql: {message}") from None
        raise CallDenied(f"sql: refused: {exc.reason}") from None
    except _TimedOut:
        await _record_refusal(scope, "sql.select", f"dataset/{dataset}", "timeout", details)
        raise StatementTimeout("sql: the statement was stopped at the time limit") from None

    action = "sql.write" if accesses.is_write else "sql.select"
    tables = sorted({g.table for g in grants})
    resource = _resource(dataset, tables)
    details = {**details, "tables": [g.as_json() for g in grants]}
    if accesses.plan:
        details["plan"] = [p.as_json() for p in accesses.plan]
    denied = [g for g in grants if not g.decision.allowed]
    if not grants:
        # Deny by default holds here too: no policy names a statement on no table.
        reason = "the statement reads no table; no policy permits it"
        await _record_refusal(scope, action, resource, reason, details)
        raise CallDenied(f"sql: refused: {reason}")
    if denied:
        reason = _deny_reason(denied, accesses.plan)
        decision = _combined(scope, grants, allowed=False)
        await scope.record(action, resource, decision, reason=reason, details=details)
        raise CallDenied(f"sql: {reason}", policies=decision.policies)

    decision = _combined(scope, grants, allowed=True)
    reason = "permitted by " + ", ".join(decision.policies)
    try:
        if accesses.is_write:
            outcome = await asyncio.to_thread(stmt.run_write, accesses)
        elif isinstance(read, BaseException):
            raise read
        else:
            assert read is not None
            outcome = read
    except _TimedOut:
        details["outcome"] = "timeout"
        await scope.record(action, resource, decision, reason=reason, details=details)
        raise StatementTimeout(
            f"sql: the statement was stopped after {scope.statement_timeout:g} s"
        ) from None
    except sqlite3.Error as exc:
        # The class only: an engine message could quote a value.
        details["outcome"] = "error"
        details["error"] = type(exc).__name__
        await scope.record(action, resource, decision, reason=reason, details=details)
        raise BadCall(f"sql: the statement failed: {exc}") from None

    details["outcome"] = "ok"
    if accesses.is_write:
        details["rows_affected"] = outcome.rows_affected
        try:
            await scope.record(action, resource, decision, reason=reason, details=details)
        except BaseException:
            await asyncio.to_thread(stmt.rollback)
            raise
        await asyncio.to_thread(stmt.commit)
        return {"rows_affected": outcome.rows_affected}

    details["row_count"] = len(outcome.rows)
    details["truncated"] = outcome.truncated
    details["lineage"] = "rows" if outcome.keys is not None else "table"
    details["keys_hmac"] = scope.key_hmacs(outcome.keys) if outcome.keys is not None else []
    await scope.record(action, resource, decision, reason=reason, details=details)
    return {
        "columns": outcome.columns,
        "rows": outcome.rows,
        "row_count": len(outcome.rows),
        "truncated": outcome.truncated,
    }


async def _record_refusal(
    scope: RunScope, action: str, resource: str, reason: str, details: Mapping[str, Any]
) -> None:
    """A call refused before (or instead of) a policy question is still an event."""
    decision = Decision(False, (), scope.policies.version)
    await scope.record(
        action, resource, decision, reason=f"refused: {reason}", details=dict(details)
    )
