"""SQL on a tenant's PostgreSQL datasets, with column control done by the database.

The runtime holds the dataset's DSN (an account allowed to create roles and
grant on the dataset's tables). For each deployment and dataset,
:func:`grant_deployment_role` creates a role whose privileges are exactly the
approved capabilities: ``USAGE`` on the tables' schemas and column-level
``SELECT (c1, c2, ...)`` on each approved table, nothing else (a role starts
with only what ``PUBLIC`` has). :func:`revoke_deployment_role` drops it on
undeploy. A guest statement then goes:

1. onto a connection that logs in *as the deployment role*, in a
   ``READ ONLY`` transaction with ``SET LOCAL statement_timeout`` and
   ``SET LOCAL ROLE``. Logging in as the role (not only ``SET ROLE`` from the
   runtime's account) matters: PostgreSQL checks ``SET ROLE`` and
   ``set_config('role', ...)`` against the *session* user, so a guest's
   ``SELECT set_config('role', 'postgres', true)`` would otherwise take back
   the runtime account's rights. The role's password is derived from the
   runtime's DSN (HMAC-SHA256), so only the runtime can log in as it;
2. ``EXPLAIN (VERBOSE, FORMAT JSON)`` of the statement, as the role: the plan
   names every base table and the columns each scan outputs or filters on.
   The database refuses here already if the statement touches a column
   outside the grant (that refusal is recorded too);
3. Cedar decides per table (``sql.select``, the set of columns), exactly as
   for SQLite datasets; one deny denies the statement, recorded first;
4. the statement runs (``row_limit + 1`` fetched) and the transaction is
   rolled back (nothing to keep: it was read-only);
5. the result event (tables, columns, row count, keyed hashes of the returned
   rows' primary keys: the same ``keys_hmac`` lineage as SQLite) is recorded
   before anything is answered.

Only reads are supported on PostgreSQL datasets: a write is refused.

Steps 3 and 5 are the path every dataset kind shares (``_datasets.py``); the
connector (:class:`PostgresConnector`) grants at run start, releases the run's
connections at run end and revokes at undeploy.
"""

from __future__ import annotations

import asyncio
import base64
import datetime as dt
import decimal
import hashlib
import hmac
import json
import re
import uuid
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import psycopg
from psycopg import sql as pgsql

from proctor.broker._datasets import (
    Accesses,
    DatabaseRefused,
    Failed,
    IdleConnections,
    Outcome,
    Refused,
    SqlCall,
    Statement,
    TimedOut,
    answer,
)
from proctor.broker._lineage import key_text, keyed_variant
from proctor.broker._scope import BadCall, CallDenied, DatasetBinding, RunScope
from proctor.errors import ProctorError, StoreError, UsageError
from proctor.store import redact, to_pg_sql

#: Connections a deployment role may hold at once.
ROLE_CONNECTION_LIMIT = 16
_ROLE_PREFIX = "proctor_dep_"
_READ_WORDS = frozenset({"SELECT", "WITH", "TABLE", "VALUES"})
# Plan nodes after which a result row no longer stands for one table row.
_COARSE_NODES = frozenset(
    {"Aggregate", "WindowAgg", "Unique", "SetOp", "Append", "Group", "Recursive Union"}
)
_QUAL_NAME = re.compile(
    r'("(?:[^"]|"")+"|[A-Za-z_][A-Za-z0-9_$]*)\.("(?:[^"]|"")+"|[A-Za-z_][A-Za-z0-9_$]*)'
)


class DatasetRoleError(ProctorError):
    """A deployment role could not be created or dropped on a PostgreSQL dataset."""


def deployment_role(tenant: str, deployment: str, dataset: str) -> str:
    """The role name for one deployment's access to one dataset (stable, <= 63 bytes)."""
    digest = hashlib.sha256(f"{tenant}\x00{deployment}\x00{dataset}".encode()).hexdigest()
    return _ROLE_PREFIX + digest[:32]


def _role_password(dsn: str, role: str) -> str:
    # Only the holder of the runtime's DSN (with its password) can derive it.
    return hmac.new(dsn.encode(), f"proctor-pg-role/v1/{role}".encode(), hashlib.sha256).hexdigest()


def _split_table(table: str) -> tuple[str, str]:
    schema, _, name = table.rpartition(".")
    return (schema or "public"), name


def grant_deployment_role(
    dsn: str, tenant: str, deployment: str, dataset: str, tables: Mapping[str, Any]
) -> str:
    """Create (or reset) the deployment's role on the dataset; return its name.

    ``tables`` is the approved manifest's ``datasets.<dataset>.tables``:
    ``{table: {"columns": [...], ...}}`` (a table may be ``schema.table``).
    Afterwards the role holds exactly ``SELECT`` on those columns: grants from
    an earlier version of the deployment are revoked first.
    """
    role = deployment_role(tenant, deployment, dataset)
    try:
        with psycopg.connect(dsn, autocommit=True) as conn, conn.transaction():
            exists = conn.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", (role,)).fetchone()
            ident = pgsql.Identifier(role)
            password = pgsql.Literal(_role_password(dsn, role))
            if exists is None:
                conn.execute(
                    pgsql.SQL(
                        "CREATE ROLE {} LOGIN NOINHERIT NOSUPERUSER NOCREATEDB NOCREATEROLE"
                        " NOREPLICATION CONNECTION LIMIT {} PASSWORD {}"
                    ).format(ident, pgsql.Literal(ROLE_CONNECTION_LIMIT), password)
                )
            else:
                conn.execute(pgsql.SQL("ALTER ROLE {} PASSWORD {}").format(ident, password))
                _revoke_all(conn, role)
            schemas = sorted({_split_table(t)[0] for t in tables})
            for schema in schemas:
                conn.execute(
                    pgsql.SQL("GRANT USAGE ON SCHEMA {} TO {}").format(
                        pgsql.Identifier(schema), ident
                    )
                )
            for table, grant in sorted(tables.items()):
                columns = sorted({str(c) for c in grant.get("columns", ())})
                if not columns:
                    continue
                schema, name = _split_table(table)
                conn.execute(
                    pgsql.SQL("GRANT SELECT ({}) ON TABLE {} TO {}").format(
                        pgsql.SQL(", ").join(pgsql.Identifier(c) for c in columns),
                        pgsql.Identifier(schema, name),
                        ident,
                    )
                )
    except psycopg.Error as exc:
        raise DatasetRoleError(
            f"cannot grant deployment {deployment!r} its columns on dataset {dataset!r} "
            f"({redact(dsn)}): {_first_line(exc)}",
            hint="the dataset's DSN must be allowed to create roles and grant on its tables",
        ) from exc
    return role


def _revoke_all(conn: psycopg.Connection[Any], role: str) -> None:
    # DROP OWNED removes every privilege granted to the role in this database
    # (table, column, schema) and anything it owns (it owns nothing).
    conn.execute(pgsql.SQL("DROP OWNED BY {}").format(pgsql.Identifier(role)))


def revoke_deployment_role(dsn: str, tenant: str, deployment: str, dataset: str) -> bool:
    """Drop the deployment's role on the dataset, ending its sessions. Returns
    whether there was one. Roles are cluster-wide: a cluster holding several
    datasets needs this once per dataset (each has its own role)."""
    role = deployment_role(tenant, deployment, dataset)
    try:
        with psycopg.connect(dsn, autocommit=True) as conn:
            with conn.transaction():
                exists = conn.execute(
                    "SELECT 1 FROM pg_roles WHERE rolname = %s", (role,)
                ).fetchone()
                if exists is None:
                    return False
                conn.execute(pgsql.SQL("ALTER ROLE {} NOLOGIN").format(pgsql.Identifier(role)))
            conn.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = %s",
                (role,),
            )
            with conn.transaction():
                _revoke_all(conn, role)
                conn.execute(pgsql.SQL("DROP ROLE {}").format(pgsql.Identifier(role)))
    except psycopg.Error as exc:
        raise DatasetRoleError(
            f"cannot drop deployment {deployment!r}'s role on dataset {dataset!r} "
            f"({redact(dsn)}): {_first_line(exc)}"
        ) from exc
    return True


def connect_as_role(dsn: str, role: str) -> psycopg.Connection[Any]:
    """A connection logged in as a deployment role (what every guest query uses)."""
    return psycopg.connect(
        dsn, user=role, password=_role_password(dsn, role), autocommit=True,
        application_name="proctor-broker",
    )  # fmt: skip


# -- connections ----------------------------------------------------------------


class _RolePool:
    """Connections as one deployment role, for one run; reused across its calls."""

    def __init__(self, dsn: str, role: str) -> None:
        self.dsn, self.role = dsn, role
        self._idle = IdleConnections[psycopg.Connection[Any]]()
        self._keys: dict[str, list[str] | None] = {}
        self._columns: dict[str, set[str]] = {}

    def take(self) -> psycopg.Connection[Any]:
        while (conn := self._idle.pop()) is not None:
            if not conn.closed and not conn.broken:
                return conn
        return connect_as_role(self.dsn, self.role)

    def give(self, conn: psycopg.Connection[Any]) -> None:
        reusable = not (conn.closed or conn.broken) and conn.info.transaction_status == 0  # IDLE
        if not (reusable and self._idle.keep(conn)):
            conn.close()

    def close(self) -> None:
        for conn in self._idle.drain():
            conn.close()

    def columns(self, conn: psycopg.Connection[Any], table: str) -> set[str]:
        if table not in self._columns:
            rows = conn.execute(
                "SELECT attname FROM pg_attribute WHERE attrelid = to_regclass(%s)"
                " AND attnum > 0 AND NOT attisdropped",
                (table,),
            ).fetchall()
            self._columns[table] = {str(r[0]) for r in rows}
        return self._columns[table]

    def row_key(self, conn: psycopg.Connection[Any], table: str) -> list[str] | None:
        if table not in self._keys:
            rows = conn.execute(
                "SELECT a.attname FROM pg_index i JOIN pg_attribute a"
                " ON a.attrelid = i.indrelid AND a.attnum = ANY (i.indkey)"
                " WHERE i.indrelid = to_regclass(%s) AND i.indisprimary ORDER BY a.attnum",
                (table,),
            ).fetchall()
            self._keys[table] = [str(r[0]) for r in rows] or None
        return self._keys[table]


def _pool(scope: RunScope, binding: DatasetBinding) -> _RolePool:
    pools: dict[str, _RolePool] = scope.__dict__.setdefault("_pg_role_pools", {})
    pool = pools.get(binding.name)
    if pool is None:
        role = deployment_role(scope.tenant, scope.deployment, binding.name)
        pool = pools.setdefault(binding.name, _RolePool(binding.location, role))
    return pool


def close_pg_pools(scope: RunScope) -> None:
    """Close a run's dataset connections (the supervisor calls it when the run ends)."""
    pools: dict[str, _RolePool] = scope.__dict__.pop("_pg_role_pools", {})
    for pool in pools.values():
        pool.close()


# -- one statement ----------------------------------------------------------------


def _unquote(name: str) -> str:
    return name[1:-1].replace('""', '"') if name.startswith('"') else name.lower()


def _plan_nodes(plan: Mapping[str, Any]) -> Iterator[Mapping[str, Any]]:
    yield plan
    for child in plan.get("Plans", ()):
        yield from _plan_nodes(child)


def _strings(value: Any) -> Iterator[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, list):
        for v in value:
            yield from _strings(v)


_LITERAL = re.compile(r"'(?:[^']|'')*'")
_WORD = re.compile(r'"(?:[^"]|"")+"|[A-Za-z_][A-Za-z0-9_$]*')


def accesses_from_plan(
    plan: Mapping[str, Any], columns_of: Callable[[str], set[str]]
) -> tuple[Accesses, bool]:
    """Tables and columns a plan reads (from EXPLAIN VERBOSE), and whether a result
    row may stand for several table rows (aggregates, set operations, joins).

    This is what Cedar is asked about and what the event records; the database's
    column grants are what enforces, so an over-approximation here only denies.

    PostgreSQL qualifies a column (``alias.column``) wherever the plan has more
    than one relation; with one relation it may not, and a bare name is then a
    column of that relation if the relation has a column by that name."""
    nodes = list(_plan_nodes(plan))
    aliases: dict[str, str] = {}
    for node in nodes:
        rel = node.get("Relation Name")
        if rel is not None:
            schema = node.get("Schema", "public")
            table = rel if schema == "public" else f"{schema}.{rel}"
            aliases[str(node.get("Alias", rel))] = table
    accesses = Accesses()
    for table in aliases.values():
        accesses.reads.setdefault(table, set()).add("")
    only = next(iter(aliases.values())) if len(set(aliases.values())) == 1 else None
    only_columns = columns_of(only) if only is not None else set()
    for node in nodes:
        own = aliases.get(str(node.get("Alias", ""))) if node.get("Relation Name") else None
        own_columns = columns_of(own) if own is not None else set()
        for key, value in node.items():
            if key in ("Plans", "Relation Name", "Schema", "Alias", "Node Type"):
                continue
            if key == "Output" and own is not None and node is not plan:
                # A scan under another node may output its whole row (a "physical
                # target list"); what is used of it is named by the nodes above.
                continue
            for raw in _strings(value):
                text = _LITERAL.sub("''", raw)
                for m in _QUAL_NAME.finditer(text):
                    table = aliases.get(_unquote(m.group(1))) or aliases.get(m.group(1))
                    if table is not None:
                        accesses.reads[table].add(_unquote(m.group(2)))
                for m in _WORD.finditer(_QUAL_NAME.sub(" ", text)):
                    word = _unquote(m.group())
                    if own is not None and word in own_columns:
                        accesses.reads[own].add(word)
                    elif only is not None and word in only_columns:
                        accesses.reads[only].add(word)
    coarse = any(n.get("Node Type") in _COARSE_NODES for n in nodes) or len(aliases) != 1
    return accesses, coarse


#: Plan nodes that return rows in an index's order (a bitmap scan does not).
_ORDERED_INDEX_SCANS = frozenset({"Index Scan", "Index Only Scan"})


class _Statement(Statement):
    """One guest statement, in one read-only transaction as the deployment role
    (declared a Statement: the write steps exist only to fill the protocol)."""

    def __init__(self, pool: _RolePool, sql: str, params: tuple[Any, ...], timeout: float) -> None:
        self.pool, self.sql, self.params, self.timeout = pool, sql, params, timeout
        self.conn: psycopg.Connection[Any] | None = None
        self.plan: Mapping[str, Any] = {}
        # Whether a result row may stand for several table rows (from the plan).
        self.coarse = True

    def analyse(self) -> Accesses:
        self.conn = conn = self.pool.take()
        ms = max(1, int(self.timeout * 1000))
        try:
            conn.execute("BEGIN READ ONLY")
            conn.execute(pgsql.SQL("SET LOCAL statement_timeout = {}").format(pgsql.Literal(ms)))
            # Column grants cover the columns a statement names, not an index the planner
            # reads through: an index scan of (plan, email) returns ids in email order.
            # With index scans off, indexes are still used, as bitmaps, whose rows come
            # in the table's physical order; the plan is checked below all the same.
            conn.execute("SET LOCAL enable_indexscan = off")
            conn.execute("SET LOCAL enable_indexonlyscan = off")
            conn.execute(pgsql.SQL("SET LOCAL ROLE {}").format(pgsql.Identifier(self.pool.role)))
            row = conn.execute("EXPLAIN (VERBOSE, FORMAT JSON) " + self.sql, self.params).fetchone()
        except psycopg.errors.QueryCanceled:
            raise TimedOut from None
        except psycopg.errors.InsufficientPrivilege as exc:
            raise Refused(f"the database refused it: {_first_line(exc)}") from None
        except psycopg.errors.ReadOnlySqlTransaction:
            raise Refused("writes are not allowed on PostgreSQL datasets") from None
        except psycopg.Error as exc:
            raise Refused(
                "the statement does not compile", bad_call=True, detail=_first_line(exc)
            ) from None
        assert row is not None
        doc = row[0] if not isinstance(row[0], str) else json.loads(row[0])
        self.plan = doc[0]["Plan"]
        if any(n.get("Node Type") in _ORDERED_INDEX_SCANS for n in _plan_nodes(self.plan)):
            raise Refused(
                "the plan reads through an index, whose order could reveal a column this run"
                " may not read"
            )
        accesses, self.coarse = accesses_from_plan(self.plan, lambda t: self.pool.columns(conn, t))
        return accesses

    def run_read(self, accesses: Accesses, row_limit: int) -> Outcome:
        try:
            return self._run_read(accesses, row_limit)
        except psycopg.errors.InsufficientPrivilege as exc:
            # Cedar permitted more than the role holds.
            raise DatabaseRefused(_first_line(exc)) from None
        except psycopg.Error as exc:
            raise Failed(type(exc).__name__, _first_line(exc)) from None

    def run_write(self, accesses: Accesses) -> Outcome:
        # Never reached: the plan of a read-only transaction reports no write.
        raise Refused("writes are not allowed on PostgreSQL datasets")

    def commit(self) -> None:
        return None  # reads only: the transaction is rolled back at close

    def rollback(self) -> None:
        return None

    def _run_read(self, accesses: Accesses, row_limit: int) -> Outcome:
        conn = self.conn
        assert conn is not None
        if not self.coarse:
            (table,) = accesses.reads
            key = self.pool.row_key(conn, table)
            variant = keyed_variant(self.sql, table.rpartition(".")[2], key) if key else None
            if variant is not None and key is not None:
                try:
                    with conn.transaction():  # a savepoint: a failed variant leaves no trace
                        return self._fetch(conn, variant, row_limit, len(key))
                except psycopg.errors.QueryCanceled:
                    raise TimedOut from None
                except psycopg.Error:
                    pass  # the key is not granted, or the rewrite did not fit: run as written
        try:
            return self._fetch(conn, self.sql, row_limit, 0)
        except psycopg.errors.QueryCanceled:
            raise TimedOut from None

    def _fetch(
        self, conn: psycopg.Connection[Any], sql: str, row_limit: int, key_width: int
    ) -> Outcome:
        cur = conn.execute(sql, self.params)
        raw = cur.fetchmany(row_limit + 1)
        description = cur.description or []
        out = Outcome(truncated=len(raw) > row_limit)
        raw = raw[:row_limit]
        width = len(description) - key_width
        out.columns = [d.name for d in description[:width]]
        out.rows = [[_json_value(v) for v in row[:width]] for row in raw]
        if key_width:
            out.keys = [key_text([_json_value(v) for v in row[width:]]) for row in raw]
        return out

    def close(self) -> None:
        conn, self.conn = self.conn, None
        if conn is None:
            return
        try:
            if not conn.closed and not conn.broken:
                conn.execute("ROLLBACK")
        except psycopg.Error:
            conn.close()
        self.pool.give(conn)


def _json_value(value: Any) -> Any:
    if isinstance(value, bytes | bytearray | memoryview):
        return {"base64": base64.b64encode(bytes(value)).decode()}
    if isinstance(value, decimal.Decimal):
        return int(value) if value == value.to_integral_value() else float(value)
    if isinstance(value, dt.datetime | dt.date | dt.time):
        return value.isoformat()
    if isinstance(value, dt.timedelta):
        return value.total_seconds()
    if isinstance(value, uuid.UUID):
        return str(value)
    if value is None or isinstance(value, str | int | float | bool | list | dict):
        return value
    return str(value)


def _first_word(sql: str) -> str:
    text = sql
    while True:
        text = text.lstrip().lstrip("(").lstrip()
        if text.startswith("--"):
            text = text.partition("\n")[2]
        elif text.startswith("/*"):
            text = text.partition("*/")[2]
        else:
            break
    m = re.match(r"[A-Za-z]+", text)
    return m.group().upper() if m else ""


# -- the connector ---------------------------------------------------------------


class PostgresConnector:
    """PostgreSQL datasets: the database enforces the approved columns too, through
    a role per deployment and dataset that every guest statement runs as."""

    kind = "postgresql"

    def recognises(self, where: str) -> bool:
        return where.startswith(("postgresql://", "postgres://"))

    def locate(self, where: str) -> str:
        try:
            with psycopg.connect(where, connect_timeout=10) as conn:
                conn.execute("SELECT 1")
        except psycopg.Error as exc:
            # The DSN may hold a password: never echo it.
            raise UsageError(
                f"the PostgreSQL dataset cannot be reached: {type(exc).__name__}"
            ) from exc
        return where

    def grant(
        self, binding: DatasetBinding, tenant: str, deployment: str, tables: Mapping[str, Any]
    ) -> None:
        # Reset to match the approved manifest at every start.
        grant_deployment_role(binding.location, tenant, deployment, binding.name, tables)

    async def handle(
        self, scope: RunScope, binding: DatasetBinding, call: SqlCall, base: dict[str, Any]
    ) -> dict[str, Any]:
        try:
            if not isinstance(call.params, tuple):
                raise BadCall("sql: PostgreSQL datasets take positional parameters (?) only")
            try:
                pg_sql = to_pg_sql(call.sql)
            except StoreError as exc:
                raise BadCall(f"sql: {exc.message}") from None
            if _first_word(call.sql) not in _READ_WORDS:
                raise CallDenied(
                    "sql: refused: only reads (SELECT) are allowed on PostgreSQL datasets"
                )
        except (BadCall, CallDenied) as exc:
            resource = f"dataset/{call.dataset}"
            await scope.record_refusal("sql.select", resource, exc.message, details=base)
            raise
        details: dict[str, Any] = {**base, "synthetic": binding.synthetic, "engine": "postgresql"}
        stmt = _Statement(_pool(scope, binding), pg_sql, call.params, scope.statement_timeout)
        try:
            return await answer(scope, stmt, call.dataset, binding, details)
        finally:
            await asyncio.to_thread(stmt.close)

    def release(self, scope: RunScope, binding: DatasetBinding) -> None:
        pools: dict[str, _RolePool] = scope.__dict__.get("_pg_role_pools", {})
        pool = pools.pop(binding.name, None)
        if pool is not None:
            pool.close()

    def revoke(self, location: str, tenant: str, deployment: str, dataset: str) -> bool:
        return revoke_deployment_role(location, tenant, deployment, dataset)


POSTGRESQL = PostgresConnector()


def _first_line(exc: BaseException | None) -> str:
    text = str(exc or "").strip()
    return text.splitlines()[0] if text else type(exc).__name__
