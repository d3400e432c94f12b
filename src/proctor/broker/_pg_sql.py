"""SQL on a tenant's PostgreSQL datasets, with column control done by the database.

The runtime holds the dataset's DSN (an account allowed to create roles and
grant on the dataset's tables). Two kinds of role, both created here:

* per deployment and dataset, a *group* role (``proctor_dep_...``, ``NOLOGIN``)
  whose privileges are exactly the approved capabilities: ``USAGE`` on the
  tables' schemas and column-level ``SELECT (c1, c2, ...)`` on each approved
  table, nothing else. :func:`grant_deployment_role` resets it to the approved
  manifest at every run start (and takes from live runs' logins what it no
  longer holds); :func:`revoke_deployment_role` drops it (and the logins of its
  live runs) on undeploy. Nothing logs in as it or is a member of it: it is the
  approved manifest, written where the database keeps grants;
* per run and dataset, a *login* role (``proctor_run_...``), created at the
  run's first statement and granted directly the group's columns that the
  run's own Cedar set permits, asked per table and column in the run's context
  (:func:`create_run_login`): a column or table Cedar forbids is one PostgreSQL
  itself refuses, whatever the statement's shape (a subquery, a CTE, a set
  operation, a whole-row value). Its random password only this process's
  memory holds (sent to the server as a SCRAM verifier, so
  not even the server's statement log has it); it is dropped when the run ends,
  whichever way it ends (:meth:`PostgresConnector.release`; the runtime's sweep
  of dead owners' runs calls :func:`drop_run_login` too). A role per run, not
  per deployment: two runs of one deployment overlap, and a login shared by
  them could not be taken back when the first one ends. A password the guest
  set on its own role (PostgreSQL lets any role do that) dies with the role.

A guest statement then goes:

0. parsed with PostgreSQL's own parser (``pglast``): exactly one statement, a
   ``SELECT``, that calls only functions of an allowlist (ones that compute on
   their arguments: no SQL run by a function, no cluster state, no catalog
   lookup by a ``reg*`` cast) and names no catalog. Refusals are recorded;
1. onto a connection that logs in *as the run's login role*, in a
   ``READ ONLY`` transaction with ``SET LOCAL statement_timeout``. Logging in
   as the role (not only ``SET ROLE`` from the runtime's account) matters:
   PostgreSQL checks ``SET ROLE`` and ``set_config('role', ...)`` against the
   *session* user, and the login is a member of no role;
2. ``EXPLAIN (VERBOSE, FORMAT JSON)`` of the statement, as the role: the plan
   names every base table and the columns each scan outputs or filters on;
   the parse tree's every reference (``_pg_reads.py``) is the floor added to it
   (a statement it cannot account for is refused).
   The database refuses here already if the statement touches a column
   outside the grant (that refusal is recorded too). A plan that scans a
   catalog or a function outside the allowlist is refused;
3. Cedar decides per table (``sql.select``, the set of columns), exactly as
   for SQLite datasets (for what only a call has: the set of columns together,
   and the record); one deny denies the statement, recorded first;
4. the statement runs through a cursor, a batch at a time, wrapped so that
   the server stops before sending the row that passes the answer's byte
   budget (:func:`bounded_statement`; ``row_limit + 1`` rows at most, the
   broker's rows held to the budget and the run's answers in flight to
   another), and the transaction is rolled back (nothing to keep: it was
   read-only);
5. the result event (tables, columns, row count, keyed hashes of the returned
   rows' primary keys: the same lineage object as SQLite) is recorded
   before anything is answered.

Every guest text (the EXPLAIN, the keyed variant, the fetch) goes over the
extended query protocol (a prepared statement), where the *server* refuses
more than one statement ("cannot insert multiple commands into a prepared
statement"): a ``; COMMIT; ...`` never leaves the read-only transaction,
whatever step 0 made of the text.

Only reads are supported on PostgreSQL datasets: a write is refused.

Steps 3 and 5 are the path every dataset kind shares (``_datasets.py``); the
connector (:class:`PostgresConnector`) grants at run start, drops the run's
login at run end and revokes at undeploy.
"""

from __future__ import annotations

import base64
import datetime as dt
import decimal
import functools
import hashlib
import json
import logging
import re
import secrets
import sys
import threading
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import pglast
import psycopg
from pglast import ast as pgast
from pglast import enums as pgenums
from pglast import visitors as pgvisitors
from pglast.stream import RawStream
from psycopg import sql as pgsql

from proctor.broker import _datasets as budgets
from proctor.broker._datasets import (
    DESCRIBED_COLUMNS,
    DESCRIBED_TABLES,
    Accesses,
    AnswerBudget,
    ColumnShape,
    DatabaseRefused,
    Failed,
    IdleConnections,
    Outcome,
    Refused,
    SqlCall,
    Statement,
    TableShape,
    TimedOut,
    TooLarge,
    column_permitted,
    run_answer_budget,
)
from proctor.broker._fair import run_blocking
from proctor.broker._lineage import key_text
from proctor.broker._pg_reads import Unaccounted, statement_reads, table_name
from proctor.broker._scope import BadCall, CallDenied, DatasetBinding, RunScope
from proctor.errors import ProctorError, StoreError, UsageError
from proctor.governance import DatasetKind
from proctor.store import redact, to_pg_sql

log = logging.getLogger("proctor")

#: Connections a run's login role may hold at once.
ROLE_CONNECTION_LIMIT = 16
_ROLE_PREFIX = "proctor_dep_"
_LOGIN_PREFIX = "proctor_run_"
_READ_WORDS = frozenset({"SELECT", "WITH", "TABLE", "VALUES"})
# Plan nodes after which a result row no longer stands for one table row.
_COARSE_NODES = frozenset(
    {"Aggregate", "WindowAgg", "Unique", "SetOp", "Append", "Group", "Recursive Union"}
)
# Quoted names and literals as "unrolled loops" ([^"]* then ("" [^"]*)*): an
# alternation per character costs Python's matcher memory per character, and a
# plan can hold a constant of many megabytes (a folded repeat('x', n)). A name
# starts only where no name goes on: tried from inside a long word, the pattern
# would cost time in the square of its length.
_QUAL_NAME = re.compile(
    r'(?<![A-Za-z0-9_$"])'
    r'("[^"]*(?:""[^"]*)*"|[A-Za-z_][A-Za-z0-9_$]*)\.("[^"]*(?:""[^"]*)*"|[A-Za-z_][A-Za-z0-9_$]*)'
)


class DatasetRoleError(ProctorError):
    """A deployment role could not be created or dropped on a PostgreSQL dataset."""


def deployment_role(tenant: str, deployment: str, dataset: str) -> str:
    """The role name for one deployment's access to one dataset (stable, <= 63 bytes)."""
    digest = hashlib.sha256(f"{tenant}\x00{deployment}\x00{dataset}".encode()).hexdigest()
    return _ROLE_PREFIX + digest[:32]


def run_login_role(tenant: str, run_id: str, dataset: str) -> str:
    """The login role of one run on one dataset (stable, <= 63 bytes): the sweep of
    a dead owner's runs finds it again from the run's id alone."""
    digest = hashlib.sha256(f"{tenant}\x00{run_id}\x00{dataset}".encode()).hexdigest()
    return _LOGIN_PREFIX + digest[:32]


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
    an earlier version of the deployment are revoked first. The role never logs
    in: each run logs in as a role of its own, a member of this one.
    """
    role = deployment_role(tenant, deployment, dataset)
    try:
        with psycopg.connect(dsn, autocommit=True) as conn, conn.transaction():
            exists = conn.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", (role,)).fetchone()
            ident = pgsql.Identifier(role)
            if exists is None:
                conn.execute(
                    pgsql.SQL(
                        "CREATE ROLE {} NOLOGIN NOINHERIT NOSUPERUSER NOCREATEDB NOCREATEROLE"
                        " NOREPLICATION"
                    ).format(ident)
                )
            else:
                # A role of an earlier version logged in with a password derived from
                # the DSN: it logs in no more.
                conn.execute(pgsql.SQL("ALTER ROLE {} NOLOGIN PASSWORD NULL").format(ident))
                _revoke_all(conn, role)
            schemas = sorted({_split_table(t)[0] for t in tables})
            for schema in schemas:
                conn.execute(
                    pgsql.SQL("GRANT USAGE ON SCHEMA {} TO {}").format(
                        pgsql.Identifier(schema), ident
                    )
                )
            _grant_columns(
                conn,
                role,
                {
                    _split_table(t): sorted({str(c) for c in g.get("columns", ())})
                    for t, g in tables.items()
                },
            )
            _narrow_logins(conn, role)
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


def _drop_logins(conn: psycopg.Connection[Any], roles: list[str]) -> None:
    # NOLOGIN first (no new session), then end the sessions, then drop.
    for role in roles:
        conn.execute(pgsql.SQL("ALTER ROLE {} NOLOGIN").format(pgsql.Identifier(role)))
    conn.execute(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = ANY(%s)",
        (roles,),
    )
    for role in roles:
        with conn.transaction():
            _revoke_all(conn, role)
            conn.execute(pgsql.SQL("DROP ROLE {}").format(pgsql.Identifier(role)))


def revoke_deployment_role(dsn: str, tenant: str, deployment: str, dataset: str) -> bool:
    """Drop the deployment's role on the dataset, and the login roles of its runs,
    ending their sessions. Returns whether there was one. Roles are
    cluster-wide: a cluster holding several datasets needs this once per
    dataset (each has its own role)."""
    role = deployment_role(tenant, deployment, dataset)
    try:
        with psycopg.connect(dsn, autocommit=True) as conn:
            logins = _run_logins(conn, role)
            exists = conn.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", (role,)).fetchone()
            if exists is None:
                return False
            _drop_logins(conn, logins)
            with conn.transaction():
                _revoke_all(conn, role)
                conn.execute(pgsql.SQL("DROP ROLE {}").format(pgsql.Identifier(role)))
    except psycopg.Error as exc:
        raise DatasetRoleError(
            f"cannot drop deployment {deployment!r}'s role on dataset {dataset!r} "
            f"({redact(dsn)}): {_first_line(exc)}"
        ) from exc
    return True


#: What a run's login carries so that undeploy finds it: it is no member of its
#: deployment's role (a member could ``SET ROLE`` to it and read every approved
#: column, whatever Cedar says), so the link is this comment.
_LOGIN_MARK = "proctor run login of "

#: Every column-level SELECT held by one role in the current database.
_COLUMN_GRANTS = (
    "SELECT n.nspname, c.relname, a.attname FROM pg_class c"
    " JOIN pg_namespace n ON n.oid = c.relnamespace"
    " JOIN pg_attribute a ON a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped"
    " CROSS JOIN LATERAL aclexplode(a.attacl) x"
    " WHERE x.grantee = (SELECT oid FROM pg_roles WHERE rolname = %s)"
    " AND x.privilege_type = 'SELECT' ORDER BY 1, 2, a.attnum"
)


def column_grants(conn: psycopg.Connection[Any], role: str) -> dict[tuple[str, str], list[str]]:
    """The column-level ``SELECT`` grants ``role`` holds here: {(schema, table): columns}."""
    out: dict[tuple[str, str], list[str]] = {}
    for schema, name, column in conn.execute(_COLUMN_GRANTS, (role,)).fetchall():
        out.setdefault((str(schema), str(name)), []).append(str(column))
    return out


def _grant_columns(
    conn: psycopg.Connection[Any], role: str, grants: Mapping[tuple[str, str], list[str]]
) -> None:
    ident = pgsql.Identifier(role)
    for schema in sorted({s for (s, _), cols in grants.items() if cols}):
        conn.execute(
            pgsql.SQL("GRANT USAGE ON SCHEMA {} TO {}").format(pgsql.Identifier(schema), ident)
        )
    for (schema, name), columns in sorted(grants.items()):
        if columns:
            conn.execute(
                pgsql.SQL("GRANT SELECT ({}) ON TABLE {} TO {}").format(
                    pgsql.SQL(", ").join(pgsql.Identifier(c) for c in columns),
                    pgsql.Identifier(schema, name),
                    ident,
                )
            )


def create_run_login(dsn: str, group: str, role: str, *, allow: Callable[[str, str], bool]) -> str:
    """Create the login role ``role`` of a run of ``group``'s deployment, with a
    fresh random password; return the password (the caller's memory is the only
    place it is kept). The server receives a SCRAM verifier, never the password.

    The login holds exactly the column grants of ``group`` (the approved
    manifest) for which ``allow(table, column)`` (the run's Cedar set, asked
    per table and column) says yes, granted to it directly: it is no member of
    ``group``, so a column Cedar forbids is one PostgreSQL itself refuses, in
    whatever shape a statement reads it."""
    password = secrets.token_urlsafe(32)
    try:
        with psycopg.connect(dsn, autocommit=True) as conn, conn.transaction():
            verifier = conn.pgconn.encrypt_password(
                password.encode(), role.encode(), b"scram-sha-256"
            ).decode()
            ident = pgsql.Identifier(role)
            approved = column_grants(conn, group)
            exists = conn.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", (role,)).fetchone()
            if exists is None:
                conn.execute(
                    pgsql.SQL(
                        "CREATE ROLE {} LOGIN NOINHERIT NOSUPERUSER NOCREATEDB NOCREATEROLE"
                        " NOREPLICATION CONNECTION LIMIT {} PASSWORD {}"
                    ).format(ident, pgsql.Literal(ROLE_CONNECTION_LIMIT), pgsql.Literal(verifier))
                )
            else:
                conn.execute(
                    pgsql.SQL("ALTER ROLE {} LOGIN NOINHERIT PASSWORD {}").format(
                        ident, pgsql.Literal(verifier)
                    )
                )
                _revoke_all(conn, role)
                _leave_groups(conn, role)
            conn.execute(
                pgsql.SQL("COMMENT ON ROLE {} IS {}").format(
                    ident, pgsql.Literal(_LOGIN_MARK + group)
                )
            )
            allowed = {
                key: [c for c in columns if allow(table_name(*key), c)]
                for key, columns in approved.items()
            }
            _grant_columns(conn, role, allowed)
    except psycopg.Error as exc:
        raise DatasetRoleError(
            f"cannot open a login for the run on the dataset ({redact(dsn)}): {_first_line(exc)}",
            hint="the deployment's role is gone if it was undeployed",
        ) from exc
    return password


def _leave_groups(conn: psycopg.Connection[Any], role: str) -> None:
    # A login of an earlier version was a member of its deployment's role.
    groups = conn.execute(
        "SELECT g.rolname FROM pg_auth_members m JOIN pg_roles g ON g.oid = m.roleid"
        " JOIN pg_roles r ON r.oid = m.member WHERE r.rolname = %s",
        (role,),
    ).fetchall()
    for (group,) in groups:
        conn.execute(
            pgsql.SQL("REVOKE {} FROM {}").format(
                pgsql.Identifier(str(group)), pgsql.Identifier(role)
            )
        )


def _run_logins(conn: psycopg.Connection[Any], group: str) -> list[str]:
    """The live logins of runs of ``group``'s deployment (and members, as logins of
    an earlier version were)."""
    rows = conn.execute(
        "SELECT r.rolname FROM pg_roles r WHERE r.rolname LIKE 'proctor\\_run\\_%%' AND ("
        " shobj_description(r.oid, 'pg_authid') = %s OR EXISTS (SELECT 1 FROM pg_auth_members m"
        " JOIN pg_roles g ON g.oid = m.roleid WHERE m.member = r.oid AND g.rolname = %s))"
        " ORDER BY 1",
        (_LOGIN_MARK + group, group),
    ).fetchall()
    return [str(r[0]) for r in rows]


def _narrow_logins(conn: psycopg.Connection[Any], group: str) -> None:
    """Take from live runs' logins every column the group no longer holds: a
    re-grant to a narrower approval narrows the runs already going on."""
    kept = column_grants(conn, group)
    for login in _run_logins(conn, group):
        for (schema, name), columns in column_grants(conn, login).items():
            gone = [c for c in columns if c not in kept.get((schema, name), ())]
            if gone:
                conn.execute(
                    pgsql.SQL("REVOKE SELECT ({}) ON TABLE {} FROM {}").format(
                        pgsql.SQL(", ").join(pgsql.Identifier(c) for c in gone),
                        pgsql.Identifier(schema, name),
                        pgsql.Identifier(login),
                    )
                )


def drop_run_login(dsn: str, role: str) -> bool:
    """Drop a run's login role, ending its sessions; whether there was one."""
    try:
        with psycopg.connect(dsn, autocommit=True, connect_timeout=10) as conn:
            exists = conn.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", (role,)).fetchone()
            if exists is None:
                return False
            _drop_logins(conn, [role])
    except psycopg.Error as exc:
        raise DatasetRoleError(
            f"cannot drop a run's login role on the dataset ({redact(dsn)}): {_first_line(exc)}"
        ) from exc
    return True


def drop_run_logins(dsn: str, tenant: str, run_id: str, dataset: str) -> bool:
    """:func:`drop_run_login` for a run known by its id (a dead owner's run)."""
    return drop_run_login(dsn, run_login_role(tenant, run_id, dataset))


def connect_as_role(dsn: str, role: str, password: str) -> psycopg.Connection[Any]:
    """A connection logged in as a run's login role (what every guest query uses)."""
    return psycopg.connect(
        dsn, user=role, password=password, autocommit=True, application_name="proctor-broker"
    )


# -- connections ----------------------------------------------------------------


class _RolePool:
    """Connections of one run as its login role; reused across its calls. The
    login is created at the first statement and dropped by :meth:`close`."""

    def __init__(
        self,
        dsn: str,
        role: str,
        login: str,
        allow: Callable[[str, str], bool],
        budget: AnswerBudget | None = None,
    ) -> None:
        self.dsn, self.role, self.login, self.allow = dsn, role, login, allow
        self.budget = budget if budget is not None else AnswerBudget(budgets.RUN_ANSWER_BYTES)
        self._idle = IdleConnections[psycopg.Connection[Any]]()
        self._keys: dict[str, list[str] | None] = {}
        self._columns: dict[str, set[str]] = {}
        self._relations: dict[tuple[str, str], list[str] | None] = {}
        self._lock = threading.Lock()
        self._password: str | None = None
        self._closed = False

    def take(self) -> psycopg.Connection[Any]:
        while (conn := self._idle.pop()) is not None:
            if not conn.closed and not conn.broken:
                return conn
        with self._lock:
            if self._closed:
                raise DatasetRoleError("the run has ended: its login on the dataset is dropped")
            if self._password is None:
                self._password = create_run_login(self.dsn, self.role, self.login, allow=self.allow)
            password = self._password
        return connect_as_role(self.dsn, self.login, password)

    def give(self, conn: psycopg.Connection[Any]) -> None:
        reusable = not (conn.closed or conn.broken) and conn.info.transaction_status == 0  # IDLE
        if not (reusable and self._idle.keep(conn)):
            conn.close()

    def close(self) -> None:
        """End the run on the dataset: its connections closed, its login dropped."""
        with self._lock:
            self._closed = True
            created, self._password = self._password is not None, None
        for conn in self._idle.drain():
            conn.close()
        if created:
            drop_run_login(self.dsn, self.login)

    def columns(self, conn: psycopg.Connection[Any], table: str) -> set[str]:
        if table not in self._columns:
            rows = conn.execute(
                "SELECT attname FROM pg_attribute WHERE attrelid = to_regclass(%s)"
                " AND attnum > 0 AND NOT attisdropped",
                (table,),
            ).fetchall()
            self._columns[table] = {str(r[0]) for r in rows}
        return self._columns[table]

    def relation_columns(
        self, conn: psycopg.Connection[Any], schema: str, name: str
    ) -> list[str] | None:
        """A relation's columns in order (None: there is none by that name)."""
        key = (schema, name)
        if key not in self._relations:
            rows = conn.execute(
                "SELECT a.attname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace"
                " JOIN pg_attribute a ON a.attrelid = c.oid AND a.attnum > 0"
                " AND NOT a.attisdropped WHERE n.nspname = %s AND c.relname = %s"
                " ORDER BY a.attnum",
                key,
            ).fetchall()
            found = conn.execute(
                "SELECT 1 FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace"
                " WHERE n.nspname = %s AND c.relname = %s",
                key,
            ).fetchone()
            if len(self._relations) < 1024:
                self._relations[key] = [str(r[0]) for r in rows] if found else None
            else:
                return [str(r[0]) for r in rows] if found else None
        return self._relations[key]

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
        login = run_login_role(scope.tenant, scope.run_id, binding.name)

        def allow(table: str, column: str) -> bool:
            return column_permitted(scope, binding.name, binding, table, column)

        pool = pools.setdefault(
            binding.name,
            _RolePool(binding.location, role, login, allow, run_answer_budget(scope)),
        )
    return pool


def close_pg_pools(scope: RunScope) -> None:
    """End a run on its PostgreSQL datasets: connections closed, logins dropped.
    The closed pools stay with the scope: a call still on its way finds its
    run ended instead of opening a login again."""
    pools: dict[str, _RolePool] = scope.__dict__.get("_pg_role_pools", {})
    for pool in list(pools.values()):
        _close_logged(pool)


def _close_logged(pool: _RolePool) -> None:
    # At run end: the run is over whatever happens here; a login left behind is
    # swept with the run's id at the next opening of the home.
    try:
        pool.close()
    except DatasetRoleError as exc:
        log.warning("proctor: %s", exc.message)


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


_LITERAL = re.compile(r"'[^']*(?:''[^']*)*'")
_WORD = re.compile(r'"[^"]*(?:""[^"]*)*"|[A-Za-z_][A-Za-z0-9_$]*')


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


# -- what a statement may call ---------------------------------------------------

#: Functions a guest statement may call: builtins of pg_catalog that compute only
#: on their arguments (strings, numbers, dates, JSON, arrays, aggregates, window
#: functions). Anything else is refused: a function may run SQL of its own
#: (query_to_xml, dblink), read or change the cluster's state (pg_stat_*,
#: pg_lock_status, advisory locks, set_config, current_setting, large objects,
#: files) or look a catalog up (to_regclass, has_*_privilege), and none of that
#: shows in a plan node Cedar is asked about.
ALLOWED_FUNCTIONS = frozenset(
    {
        # aggregates
        "count", "sum", "avg", "min", "max", "string_agg", "array_agg", "bool_and",
        "bool_or", "every", "bit_and", "bit_or", "stddev", "stddev_pop", "stddev_samp",
        "variance", "var_pop", "var_samp", "corr", "covar_pop", "covar_samp",
        "regr_slope", "regr_intercept", "regr_r2", "regr_count", "regr_avgx", "regr_avgy",
        "percentile_cont", "percentile_disc", "mode", "json_agg", "jsonb_agg",
        "json_object_agg", "jsonb_object_agg",
        # window functions
        "row_number", "rank", "dense_rank", "percent_rank", "cume_dist", "ntile", "lag",
        "lead", "first_value", "last_value", "nth_value",
        # strings
        "lower", "upper", "initcap", "length", "char_length", "character_length",
        "octet_length", "bit_length", "substr", "substring", "left", "right", "trim",
        "btrim", "ltrim", "rtrim", "lpad", "rpad", "replace", "translate", "concat",
        "concat_ws", "position", "strpos", "split_part", "reverse", "repeat", "format",
        "starts_with", "ascii", "chr", "overlay", "md5", "sha224", "sha256", "sha384",
        "sha512", "encode", "decode", "regexp_replace", "regexp_match", "regexp_matches",
        "regexp_like", "regexp_count", "regexp_instr", "regexp_substr",
        "regexp_split_to_array", "regexp_split_to_table", "quote_literal", "quote_ident",
        "quote_nullable", "to_hex", "normalize", "unistr", "string_to_array",
        "string_to_table", "array_to_string", "convert_from", "convert_to", "to_ascii",
        "soundex", "like_escape", "textcat", "similar_to_escape", "similar_escape",
        "is_normalized",
        # numbers
        "abs", "round", "ceil", "ceiling", "floor", "trunc", "sqrt", "cbrt", "power", "pow",
        "exp", "ln", "log", "log10", "mod", "sign", "div", "gcd", "lcm", "factorial",
        "degrees", "radians", "pi", "sin", "cos", "tan", "asin", "acos", "atan", "atan2",
        "width_bucket", "scale", "min_scale", "trim_scale", "numeric", "int4", "int8",
        "float8", "text", "random", "to_char", "to_number",
        # dates and times
        "now", "clock_timestamp", "statement_timestamp", "transaction_timestamp",
        "date_trunc", "date_part", "extract", "date_bin", "age", "make_date", "make_time",
        "make_timestamp", "make_timestamptz", "make_interval", "to_date", "to_timestamp",
        "justify_days", "justify_hours", "justify_interval", "isfinite", "timezone",
        "date_add", "date_subtract", "overlaps",
        # JSON
        "to_json", "to_jsonb", "row_to_json", "array_to_json", "json_build_object",
        "jsonb_build_object", "json_build_array", "jsonb_build_array", "json_object",
        "jsonb_object", "json_array_length", "jsonb_array_length", "json_extract_path",
        "jsonb_extract_path", "json_extract_path_text", "jsonb_extract_path_text",
        "json_array_elements", "jsonb_array_elements", "json_array_elements_text",
        "jsonb_array_elements_text", "json_each", "jsonb_each", "json_each_text",
        "jsonb_each_text", "json_object_keys", "jsonb_object_keys", "json_typeof",
        "jsonb_typeof", "jsonb_set", "jsonb_insert", "jsonb_strip_nulls",
        "json_strip_nulls", "jsonb_pretty", "jsonb_path_query", "jsonb_path_query_array",
        "jsonb_path_query_first", "jsonb_path_exists", "jsonb_path_match",
        # arrays and sets
        "array_length", "array_lower", "array_upper", "array_ndims", "array_dims",
        "cardinality", "unnest", "array_position", "array_positions", "array_append",
        "array_prepend", "array_cat", "array_remove", "array_replace", "array_fill",
        "generate_series", "generate_subscripts", "trim_array",
        # other pure functions
        "gen_random_uuid", "num_nulls", "num_nonnulls",
    }
)  # fmt: skip
#: Schemas whose relations carry the cluster's state, other sessions' data or the
#: catalog (roles, databases, settings, locks, statistics).
CATALOG_SCHEMAS = frozenset({"pg_catalog", "information_schema", "pg_toast"})
_WRITE_NODES = (pgast.InsertStmt, pgast.UpdateStmt, pgast.DeleteStmt, pgast.MergeStmt)


def _qualified(names: Any) -> tuple[str, str]:
    parts = [str(n.sval) for n in names or () if isinstance(n, pgast.String)]
    return (parts[-2] if len(parts) > 1 else ""), (parts[-1] if parts else "")


class _Checker(pgvisitors.Visitor):
    """Every node of the parsed statement that could read what no plan shows."""

    def __init__(self) -> None:
        super().__init__()
        self.refusal: str | None = None

    def _refuse(self, why: str) -> None:
        if self.refusal is None:
            self.refusal = why

    def visit(self, ancestors: Any, node: Any) -> None:
        if isinstance(node, _WRITE_NODES):
            self._refuse("only reads (SELECT) are allowed on PostgreSQL datasets")
        elif isinstance(node, pgast.SelectStmt):
            if node.intoClause is not None or node.lockingClause:
                self._refuse("only reads (SELECT) are allowed on PostgreSQL datasets")
        elif isinstance(node, pgast.FuncCall):
            schema, name = _qualified(node.funcname)
            if schema not in ("", "pg_catalog") or name not in ALLOWED_FUNCTIONS:
                shown = f"{schema}.{name}" if schema else name
                self._refuse(
                    f"the function {shown}() is not allowed on PostgreSQL datasets: only"
                    " functions that compute on their arguments are (none that runs SQL,"
                    " reads the cluster's state or looks a catalog up)"
                )
        elif isinstance(node, pgast.TypeName):
            _, name = _qualified(node.names)
            if name.startswith("reg"):
                self._refuse(f"a cast to {name} is a catalog lookup, not allowed on datasets")
        elif isinstance(node, pgast.RangeVar):
            schema = str(node.schemaname or "")
            if schema in CATALOG_SCHEMAS or (not schema and str(node.relname).startswith("pg_")):
                self._refuse(
                    f"{node.relname} is a catalog or cluster view: not readable through a dataset"
                )


class _Folds(Exception):
    """A constant expression PostgreSQL would fold, while planning, into a value
    large enough to matter (``EXPLAIN`` prints it, the broker reads it whole)."""


#: Functions whose result can be far larger than their arguments.
_EXPANDING = frozenset(
    {"repeat", "lpad", "rpad", "format", "replace", "regexp_replace", "overlay", "array_fill"}
)
#: Aggregates and window functions: computed when the statement runs, never folded.
_NOT_FOLDED = frozenset(
    {
        "count", "sum", "avg", "min", "max", "string_agg", "array_agg", "bool_and",
        "bool_or", "every", "bit_and", "bit_or", "stddev", "stddev_pop", "stddev_samp",
        "variance", "var_pop", "var_samp", "corr", "covar_pop", "covar_samp",
        "regr_slope", "regr_intercept", "regr_r2", "regr_count", "regr_avgx", "regr_avgy",
        "percentile_cont", "percentile_disc", "mode", "json_agg", "jsonb_agg",
        "json_object_agg", "jsonb_object_agg", "row_number", "rank", "dense_rank",
        "percent_rank", "cume_dist", "ntile", "lag", "lead", "first_value", "last_value",
        "nth_value",
    }
)  # fmt: skip
#: How deep constant calls may nest (each can double its argument: encode(..., 'hex')).
_MAX_FOLD_DEPTH = 4
#: The largest literal count, width or length an expanding call on constants may take.
_MAX_FOLD_LITERAL = 1000
_NOT_CONSTANT = (pgast.ColumnRef, pgast.SubLink, pgast.SelectStmt, pgast.RangeVar)


def _folded(node: Any) -> tuple[bool, int]:
    """(whether ``node`` is constant, its depth of calls); raises :class:`_Folds`
    for a constant expression that could fold into a large value. Parameters are
    constants here: the server folds a prepared statement's bound values too."""
    if node is None or isinstance(node, str | int | float | bool):
        return True, 0
    if isinstance(node, list | tuple):
        constant, depth = True, 0
        for child in node:
            c, d = _folded(child)
            constant, depth = constant and c, max(depth, d)
        return constant, depth
    if not isinstance(node, pgast.Node):
        return True, 0
    constant, depth = True, 0
    for slot in getattr(type(node), "__slots__", ()):
        if slot != "location":
            c, d = _folded(getattr(node, slot, None))
            constant, depth = constant and c, max(depth, d)
    if isinstance(node, _NOT_CONSTANT):
        return False, 0
    if isinstance(node, pgast.FuncCall):
        name = _qualified(node.funcname)[1]
        if name in _NOT_FOLDED or node.over is not None or node.agg_star:
            return False, 0
        if constant:
            depth += 1
            if name in _EXPANDING and not _small_literals(node.args):
                raise _Folds(
                    f"{name}() of constants over {_MAX_FOLD_LITERAL} (a count, a width or"
                    " a string) or of other calls: PostgreSQL computes it while planning,"
                    " whole. Pass the value as a column or use a smaller one"
                )
    elif (
        isinstance(node, pgast.TypeCast)
        and node.typeName is not None
        and constant
        and node.typeName.typmods
    ):
        depth += 1
        name = _qualified(node.typeName.names)[1]
        if name in ("bpchar", "char", "character") and not _small_literals(node.typeName.typmods):
            raise _Folds(f"a cast of a constant to {name}(n) over {_MAX_FOLD_LITERAL}")
    if constant and depth > _MAX_FOLD_DEPTH:
        raise _Folds(
            f"calls on constants nested more than {_MAX_FOLD_DEPTH} deep: PostgreSQL"
            " computes them while planning, whole"
        )
    return constant, depth


def _small_literals(args: Any) -> bool:
    """Whether every argument is a literal (or a literal cast) and small."""
    for arg in args or ():
        value = arg.arg if isinstance(arg, pgast.TypeCast) else arg
        if not isinstance(value, pgast.A_Const):
            return False
        literal = value.val
        if isinstance(literal, pgast.Integer) and abs(int(literal.ival or 0)) > _MAX_FOLD_LITERAL:
            return False
        if isinstance(literal, pgast.Float | pgast.String):
            text = str(getattr(literal, "fval", None) or getattr(literal, "sval", ""))
            if len(text) > 100 or re.search(r"\d{4,}", text):
                return False
    return True


def _parser_text(pg_sql: str) -> str:
    """psycopg text (``%s`` marks, ``%%``) as PostgreSQL's parser reads it."""
    marks = iter(range(1, 1 << 16))
    return re.sub(r"%[s%]", lambda m: "%" if m.group() == "%%" else f"${next(marks)}", pg_sql)


#: Statement texts whose parse-tree answers (check, keyed variant) are kept, and
#: the longest kept: both are functions of the text alone, and a run sends the
#: same text again and again (a parse and a deparse cost about a millisecond).
_TEXTS_KEPT = 256
_KEPT_LENGTH = 8192


def check_statement(pg_sql: str) -> None:
    """Refuse, before anything reaches the database, what is not one plain read
    calling only allowed functions (``pg_sql``: psycopg text, ``%s`` marks).
    Raises :class:`CallDenied` (refused) or :class:`BadCall` (does not parse)."""
    found = _checked(pg_sql) if len(pg_sql) <= _KEPT_LENGTH else _check(pg_sql)
    if found is not None:
        kind, message = found
        raise kind(message)


@functools.lru_cache(maxsize=_TEXTS_KEPT)
def _checked(pg_sql: str) -> tuple[type[BadCall] | type[CallDenied], str] | None:
    return _check(pg_sql)


def _check(pg_sql: str) -> tuple[type[BadCall] | type[CallDenied], str] | None:
    """:func:`check_statement`'s refusal (its class and message), or None."""
    try:
        _check_statement(pg_sql)
    except (BadCall, CallDenied) as exc:
        return type(exc), exc.message
    return None


def _check_statement(pg_sql: str) -> None:
    text = _parser_text(pg_sql)
    try:
        statements = pglast.parse_sql(text)
    except pglast.parser.ParseError as exc:
        raise BadCall(f"sql: the statement does not parse: {exc}") from None
    if len(statements) != 1:
        raise CallDenied("sql: refused: one statement per call on PostgreSQL datasets")
    if not isinstance(statements[0].stmt, pgast.SelectStmt):
        raise CallDenied("sql: refused: only reads (SELECT) are allowed on PostgreSQL datasets")
    checker = _Checker()
    checker(statements[0])
    if checker.refusal is not None:
        raise CallDenied(f"sql: refused: {checker.refusal}")
    try:
        _folded(statements[0].stmt)
    except _Folds as exc:
        raise CallDenied(f"sql: refused: {exc}") from None
    except RecursionError:
        raise CallDenied("sql: refused: the statement nests too deeply") from None


def _plan_refusal(plan: Mapping[str, Any]) -> str | None:
    """What the plan reads that is not a dataset's table, if anything: a catalog or
    cluster view (a view's plan names the relations and functions under it), a
    function outside the allowlist as a row source."""
    for node in _plan_nodes(plan):
        schema = str(node.get("Schema", ""))
        if node.get("Relation Name") is not None and schema in CATALOG_SCHEMAS:
            return (
                f"the statement reads {schema}.{node['Relation Name']}, a catalog or cluster"
                " view: not readable through a dataset"
            )
        function = node.get("Function Name")
        if function is not None and (
            schema not in ("", "pg_catalog") or str(function) not in ALLOWED_FUNCTIONS
        ):
            return f"the statement calls the function {function}(), not allowed on datasets"
    return None


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
        # Bytes this statement's answer holds of the run's budget (given back at close).
        self.held = 0
        # The event loop may close the statement while a worker still runs it (a
        # cancelled call): whoever comes second finds the connection given back.
        self.lock = threading.Lock()
        self.closed = False

    def analyse(self) -> Accesses:
        with self.lock:
            if self.closed:
                raise Refused("the call has ended")
            return self._analyse()

    def _analyse(self) -> Accesses:
        try:
            self.conn = conn = self.pool.take()
        except (psycopg.Error, DatasetRoleError):
            raise Refused("the dataset cannot be reached as this run's role") from None
        ms = max(1, int(self.timeout * 1000))
        try:
            # One round trip (the simple protocol runs them in order, and stops at the
            # first that fails). Column grants cover the columns a statement names,
            # not an index the planner reads through: an index scan of (plan, email)
            # returns ids in email order. With index scans off, indexes are still
            # used, as bitmaps, whose rows come in the table's physical order; the
            # plan is checked below all the same. The search path is fixed, whatever
            # the role or database says: builtins first, then the dataset's tables;
            # no "$user" schema a role could own.
            conn.execute(
                pgsql.SQL(
                    "BEGIN READ ONLY; SET LOCAL statement_timeout = {};"
                    " SET LOCAL enable_indexscan = off; SET LOCAL enable_indexonlyscan = off;"
                    " SET LOCAL search_path = pg_catalog, public"
                ).format(pgsql.Literal(ms))
            )
            # prepare=True: the extended query protocol, one statement or none.
            row = conn.execute(
                "EXPLAIN (VERBOSE, FORMAT JSON) " + self.sql, self.params, prepare=True
            ).fetchone()
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
        refusal = _plan_refusal(self.plan)
        if refusal is not None:
            raise Refused(refusal)
        if any(n.get("Node Type") in _ORDERED_INDEX_SCANS for n in _plan_nodes(self.plan)):
            raise Refused(
                "the plan reads through an index, whose order could reveal a column this run"
                " may not read"
            )
        accesses, self.coarse = accesses_from_plan(self.plan, lambda t: self.pool.columns(conn, t))
        # The floor: every reference the statement makes, which the plan may not
        # show (under a Subquery Scan, a CTE Scan, an Append; in a recursive CTE).
        try:
            (raw,) = pglast.parse_sql(_parser_text(self.sql))
            if not isinstance(raw.stmt, pgast.SelectStmt):
                raise Unaccounted("not a SELECT")
            foreign = _not_builtin(conn, raw.stmt)
            if foreign is not None:
                raise Refused(foreign)
            floor = statement_reads(
                raw.stmt, lambda schema, name: self.pool.relation_columns(conn, schema, name)
            )
        except (Unaccounted, ValueError, pglast.parser.ParseError) as exc:
            raise Refused(
                f"the statement cannot be accounted for ({exc}): it is refused rather than"
                " recorded with fewer columns than it reads"
            ) from None
        for table, columns in floor.items():
            accesses.reads.setdefault(table, set()).update(columns)
        # Lineage by row needs one table, as the record names it.
        self.coarse = self.coarse or len(accesses.reads) != 1
        return accesses

    def run_read(self, accesses: Accesses, row_limit: int) -> Outcome:
        with self.lock:
            try:
                return self._run_read(accesses, row_limit)
            except psycopg.errors.InsufficientPrivilege as exc:
                # Cedar permitted more than the role holds.
                raise DatabaseRefused(_first_line(exc)) from None
            except psycopg.Error as exc:
                raise Failed(type(exc).__name__, _first_line(exc)) from None
            finally:
                # The rows are held (and counted in the run's budget until close):
                # the transaction ends and the connection goes back to the pool now,
                # in this worker, not after the event is durable, so the run's next
                # calls find it instead of opening more logins than the role may.
                self._end()

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
            variant = keyed_statement(self.sql, table, key) if key else None
            if variant is not None and key is not None:
                try:
                    with conn.transaction():  # a savepoint: a failed variant leaves no trace
                        return self._fetch(conn, variant, row_limit, len(key), key)
                except psycopg.errors.QueryCanceled:
                    raise TimedOut from None
                except (psycopg.Error, _KeyMisplaced):
                    pass  # the key is not granted, or the rewrite did not fit: run as written
        try:
            return self._fetch(conn, self.sql, row_limit, 0)
        except psycopg.errors.QueryCanceled:
            raise TimedOut from None

    def _fetch(
        self,
        conn: psycopg.Connection[Any],
        sql: str,
        row_limit: int,
        key_width: int,
        key: Sequence[str] = (),
    ) -> Outcome:
        """The answer, read through a cursor a batch at a time: never more than the
        answer's budget held, on the wire (the server stops the statement first,
        :func:`bounded_statement`) or in the broker's rows."""
        limit = budgets.ANSWER_BYTES
        bounded = bounded_statement(sql, limit)
        if bounded is None:
            raise Failed("SyntaxError", "the statement cannot be read to its end")
        # The guest's text, as a prepared statement: the server runs one statement.
        conn.execute(f"DECLARE {_CURSOR} NO SCROLL CURSOR FOR {bounded}", self.params, prepare=True)
        out = Outcome()
        keys: list[str] = []
        try:
            self._read_rows(conn, out, keys, row_limit, key_width, key)
        except BaseException:
            # A keyed variant that failed is run again as written: what it held is
            # given back first (and the rows let go now, not when the exception is).
            out.rows.clear()
            keys.clear()
            self.pool.budget.give(self.held)
            self.held = 0
            raise
        finally:
            if conn.info.transaction_status == psycopg.pq.TransactionStatus.INTRANS:
                conn.execute(f"CLOSE {_CURSOR}")
        out.truncated = len(out.rows) > row_limit
        del out.rows[row_limit:]
        if key_width:
            out.keys = keys[:row_limit]
        return out

    def _read_rows(
        self,
        conn: psycopg.Connection[Any],
        out: Outcome,
        keys: list[str],
        row_limit: int,
        key_width: int,
        key: Sequence[str],
    ) -> None:
        # The rows held stay under 7/8 of the budget: the rest is for the batch being
        # read and the call's event.
        limit = budgets.ANSWER_BYTES
        rows_limit = limit - limit // 8
        width = -1
        held = 0  # what this answer holds in the broker (estimated from its objects)
        batch = 32
        while len(out.rows) <= row_limit:
            want = min(batch, row_limit + 1 - len(out.rows))
            try:
                cur = conn.execute(f"FETCH FORWARD {want} FROM {_CURSOR}")
                raw = cur.fetchall()
            except psycopg.errors.InvalidTextRepresentation as exc:
                if _BUDGET_MARK in str(exc):
                    raise TooLarge(limit) from None
                raise
            if width < 0:
                # The last column is the running byte count the server keeps.
                names = [d.name for d in cur.description or ()]
                width = len(names) - 1 - key_width
                if key_width and names[width : width + key_width] != list(key):
                    raise _KeyMisplaced  # where the key should be, something else came back
                out.columns = names[:width]
            for row in raw:
                values = [_json_value(v) for v in row[:width]]
                size = _held_size(values)
                if key_width:
                    key = key_text([_json_value(v) for v in row[width : width + key_width]])
                    keys.append(key)
                    size += sys.getsizeof(key)
                held += size
                if held > rows_limit:
                    raise TooLarge(limit)
                if not self.pool.budget.take(size):
                    raise TooLarge(self.pool.budget.limit, run=True)
                self.held += size
                out.rows.append(values)
            if len(raw) < want:
                break
            # Batches of about a sixteenth of the budget, at the rows' size so far.
            per_row = max(1, held // max(1, len(out.rows)))
            batch = max(16, min(1000, (limit // 16) // per_row))

    def close(self) -> None:
        with self.lock:
            self._close()

    def close_idle(self) -> bool:
        """Close at once if that needs no round trip (no connection held, no worker
        running the statement); whether it did."""
        if not self.lock.acquire(blocking=False):
            return False
        try:
            if self.conn is not None:
                return False
            self._close()
            return True
        finally:
            self.lock.release()

    def _close(self) -> None:
        self.closed = True
        held, self.held = self.held, 0
        self.pool.budget.give(held)
        self._end()

    def _end(self) -> None:
        conn, self.conn = self.conn, None
        if conn is None:
            return
        try:
            if not conn.closed and not conn.broken:
                conn.execute("ROLLBACK")
        except psycopg.Error:
            conn.close()
        self.pool.give(conn)


class _Callables(pgvisitors.Visitor):
    """The functions, operators and types a statement names (what PostgreSQL
    resolves by name on the search path)."""

    def __init__(self) -> None:
        super().__init__()
        # Comparisons are looked up by name where the text names none (IN, USING).
        self.functions: set[str] = set()
        self.operators: set[str] = {"=", "<>", "<", ">", "<=", ">="}
        self.types: set[str] = set()
        self.foreign: str | None = None

    def visit(self, ancestors: Any, node: Any) -> None:
        if isinstance(node, pgast.FuncCall):
            self.functions.add(_qualified(node.funcname)[1])
        elif isinstance(node, pgast.A_Expr):
            schema, name = _qualified(node.name)
            if schema not in ("", "pg_catalog") and self.foreign is None:
                self.foreign = f"the operator {schema}.{name}"
            if name.isupper():  # BETWEEN and its kind: comparisons, added above
                return
            self.operators.add(name)
        elif isinstance(node, pgast.TypeName):
            schema, name = _qualified(node.names)
            if schema not in ("", "pg_catalog") and self.foreign is None:
                self.foreign = f"the type {schema}.{name}"
            self.types.add(name)


#: Which of the named functions, operators on builtin types, and types resolve
#: (or may, by overloading) to something outside pg_catalog on the fixed path.
_SHADOWS = """
SELECT 'the function ' || p.proname || '()' FROM pg_proc p
  JOIN pg_namespace n ON n.oid = p.pronamespace
  WHERE n.nspname <> 'pg_catalog' AND n.nspname = ANY (current_schemas(false))
  AND p.proname = ANY (%(functions)s)
UNION ALL
SELECT 'the operator ' || o.oprname FROM pg_operator o
  JOIN pg_namespace n ON n.oid = o.oprnamespace
  WHERE n.nspname <> 'pg_catalog' AND n.nspname = ANY (current_schemas(false))
  AND o.oprname = ANY (%(operators)s)
  AND (o.oprleft = 0 OR o.oprleft IN (SELECT oid FROM pg_type
       WHERE typnamespace = 'pg_catalog'::regnamespace))
  AND o.oprright IN (SELECT oid FROM pg_type WHERE typnamespace = 'pg_catalog'::regnamespace)
UNION ALL
SELECT 'the type ' || t.typname FROM pg_type t
  JOIN pg_namespace n ON n.oid = t.typnamespace
  WHERE n.nspname <> 'pg_catalog' AND n.nspname = ANY (current_schemas(false))
  AND t.typname = ANY (%(types)s)
  AND NOT EXISTS (SELECT 1 FROM pg_type b WHERE b.typname = t.typname
                  AND b.typnamespace = 'pg_catalog'::regnamespace)
LIMIT 1
"""


def _not_builtin(conn: psycopg.Connection[Any], stmt: pgast.SelectStmt) -> str | None:
    """Why ``stmt`` may call something that is not PostgreSQL's own, if it may.

    The allowlist is of names; PostgreSQL resolves a call by name and argument
    types over the search path, so a ``reverse(bigint)`` of the dataset's schema
    (SECURITY DEFINER, reading anything its owner may) wins over the builtin
    ``reverse(text)`` for a bigint argument, whatever the path's order. A name
    the dataset's schemas define too is refused."""
    names = _Callables()
    names(stmt)
    if names.foreign is not None:
        return f"{names.foreign} is not PostgreSQL's own: not allowed on datasets"
    row = conn.execute(
        _SHADOWS,
        {
            "functions": sorted(names.functions),
            "operators": sorted(names.operators),
            "types": sorted(names.types),
        },
    ).fetchone()
    if row is None:
        return None
    return (
        f"{row[0]} is defined in the dataset's own schema as well as by PostgreSQL, so"
        " a call may resolve to it: not allowed on datasets (a function is checked by"
        " what it resolves to)"
    )


class _KeyMisplaced(Exception):
    """The keyed variant's last columns are not the key it appended."""


def keyed_statement(pg_sql: str, table: str, key: Sequence[str]) -> str | None:
    """:func:`_keyed_statement`, kept per text, table and key."""
    if len(pg_sql) > _KEPT_LENGTH:
        return _keyed_statement(pg_sql, table, key)
    return _keyed_kept(pg_sql, table, tuple(key))


@functools.lru_cache(maxsize=_TEXTS_KEPT)
def _keyed_kept(pg_sql: str, table: str, key: tuple[str, ...]) -> str | None:
    return _keyed_statement(pg_sql, table, key)


def _keyed_statement(pg_sql: str, table: str, key: Sequence[str]) -> str | None:
    """``pg_sql`` (psycopg text) with ``table``'s key columns appended to its select
    list, rewritten on PostgreSQL's own parse tree and printed by its deparser; or
    None unless each result row is one row of ``table`` (one plain relation in
    ``FROM``, no set operation, CTE, DISTINCT, GROUP BY, HAVING, window or
    sub-select). A tokenizer of ours once read ``/* /* */ ... */`` (PostgreSQL
    nests comments) and ``E'\\''`` otherwise than the server, and took the
    guest's own last column for the key."""
    try:
        (raw,) = pglast.parse_sql(_parser_text(pg_sql))
    except (ValueError, pglast.parser.ParseError):
        return None
    stmt = raw.stmt
    items = tuple(getattr(stmt, "fromClause", None) or ())
    if (
        not isinstance(stmt, pgast.SelectStmt)
        or stmt.op != pgenums.SetOperation.SETOP_NONE
        or stmt.withClause
        or stmt.distinctClause
        or stmt.groupClause
        or stmt.havingClause
        or stmt.windowClause
        or stmt.valuesLists
        or stmt.intoClause
        or stmt.lockingClause
        or len(items) != 1
        or not isinstance(items[0], pgast.RangeVar)
    ):
        return None
    relation = items[0]
    alias = relation.alias
    if alias is not None and alias.colnames:
        return None  # renamed columns: the key's name may be another column's
    if table_name(str(relation.schemaname or "public"), str(relation.relname)) != table:
        return None
    finder = _SubLinks()
    finder(stmt)
    if finder.found:
        return None  # a sub-select may return other rows' values
    qualifier = str(alias.aliasname) if alias is not None else str(relation.relname)
    stmt.targetList = (
        *(stmt.targetList or ()),
        *(
            pgast.ResTarget(
                val=pgast.ColumnRef(fields=(pgast.String(sval=qualifier), pgast.String(sval=k)))
            )
            for k in key
        ),
    )
    return _psycopg_text(RawStream()(stmt))


class _SubLinks(pgvisitors.Visitor):
    def __init__(self) -> None:
        super().__init__()
        self.found = False

    def visit(self, ancestors: Any, node: Any) -> None:
        if isinstance(node, pgast.SubLink | pgast.RangeSubselect):
            self.found = True


def _psycopg_text(text: str) -> str | None:
    """Deparsed text (``$n`` parameters) as psycopg text (``%s``, ``%%``); None if
    its parameters are not ``$1..$n`` in order (psycopg's are by position)."""
    parts: list[str] = []
    at = 0
    n = 0
    for tok in pglast.parser.scan(text):
        if tok.name == "PARAM":
            n += 1
            if text[tok.start : tok.end + 1] != f"${n}":
                return None
            parts += [text[at : tok.start].replace("%", "%%"), "%s"]
            at = tok.end + 1
    parts.append(text[at:].replace("%", "%%"))
    return "".join(parts)


_CURSOR = "proctor_answer"
#: What the server's refusal of an answer over its budget says (a cast that fails).
_BUDGET_MARK = "proctor answer budget"
_TRAILING = frozenset({"ASCII_59", "SQL_COMMENT", "C_COMMENT"})


def bounded_statement(sql: str, limit: int) -> str | None:
    """``sql`` (one SELECT, psycopg text) wrapped so that the server stops it,
    before sending the row, once its rows' text passes ``limit`` bytes: the broker
    never receives more than the budget, whatever one row holds. The rows and
    their order are the statement's; one column is added last, the running total.
    None if the statement's end cannot be found (what follows it: ``;``, comments,
    is left out so that it can stand in parentheses)."""
    try:
        tokens = pglast.parser.scan(sql)
    except pglast.parser.ParseError:
        return None
    body = [t for t in tokens if t.name not in _TRAILING]
    if not body:
        return None
    text = sql[: body[-1].end + 1]
    # ROW(q.*), not q: a column the statement names q would stand for the row. The
    # guest's text is the statement by design (the run's login enforces what it reads).
    head = (
        "SELECT w.* FROM (SELECT q.*, sum(octet_length(ROW(q.*)::text))"
        " OVER (ROWS UNBOUNDED PRECEDING) AS proctor_answer_bytes FROM (\n"
    )
    tail = (
        f"\n) q) w WHERE CASE WHEN w.proctor_answer_bytes > {int(limit)}"
        f" THEN ('{_BUDGET_MARK}: ' || w.proctor_answer_bytes)::int > 0 ELSE true END"
    )
    return head + text + tail


def _held_size(value: Any) -> int:
    """About what ``value`` holds in this process (its objects, nested)."""
    if isinstance(value, list):
        return sys.getsizeof(value) + sum(_held_size(v) for v in value)
    if isinstance(value, dict):
        return sys.getsizeof(value) + sum(_held_size(k) + _held_size(v) for k, v in value.items())
    return sys.getsizeof(value)


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

#: Databases of the cluster, other than the dataset's, that any role may connect to.
_OPEN_DATABASES = (
    "SELECT datname FROM pg_database WHERE datallowconn AND datname <> current_database()"
    " AND has_database_privilege('public', oid, 'CONNECT') ORDER BY datname"
)


#: What the dataset's database gives every role, a run's login included, whatever
#: its grants say: relations (or columns) granted to PUBLIC, and SECURITY DEFINER
#: functions PUBLIC may execute (they read with their owner's rights).
_PUBLIC_OBJECTS = (
    "SELECT 'relation ' || quote_ident(n.nspname) || '.' || quote_ident(c.relname)"
    " FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace"
    " WHERE n.nspname NOT IN ('pg_catalog', 'information_schema')"
    " AND n.nspname NOT LIKE 'pg\\_%' AND c.relkind IN ('r', 'v', 'm', 'p', 'f')"
    " AND (EXISTS (SELECT 1 FROM aclexplode(c.relacl) a WHERE a.grantee = 0)"
    " OR EXISTS (SELECT 1 FROM pg_attribute t CROSS JOIN LATERAL aclexplode(t.attacl) a"
    " WHERE t.attrelid = c.oid AND a.grantee = 0))"
    " UNION ALL"
    " SELECT 'SECURITY DEFINER function ' || quote_ident(n.nspname) || '.'"
    " || quote_ident(p.proname) || '()'"
    " FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace"
    " WHERE n.nspname NOT IN ('pg_catalog', 'information_schema')"
    " AND n.nspname NOT LIKE 'pg\\_%' AND p.prosecdef"
    " AND (p.proacl IS NULL OR EXISTS (SELECT 1 FROM aclexplode(p.proacl) a"
    " WHERE a.grantee = 0))"
    " ORDER BY 1 LIMIT 21"
)


def public_objects(conn: psycopg.Connection[Any]) -> list[str]:
    """The dataset database's objects any role may read or run (at most 21)."""
    return [str(r[0]) for r in conn.execute(_PUBLIC_OBJECTS).fetchall()]


#: Every column of every table and view outside the system schemas, with its declared
#: type, nullability and whether the primary key holds it.
_DESCRIBE = """
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


class PostgresConnector:
    """PostgreSQL datasets: the database enforces the approved columns too, through
    a role per deployment and dataset that every guest statement runs as."""

    kind = DatasetKind.POSTGRESQL

    def recognises(self, where: str) -> bool:
        return where.startswith(("postgresql://", "postgres://"))

    def locate(self, where: str) -> str:
        try:
            with psycopg.connect(where, connect_timeout=10) as conn:
                open_to_all = [str(r[0]) for r in conn.execute(_OPEN_DATABASES).fetchall()]
                to_public = public_objects(conn)
        except psycopg.Error as exc:
            # The DSN may hold a password: never echo it.
            raise UsageError(
                f"the PostgreSQL dataset cannot be reached: {type(exc).__name__}"
            ) from exc
        if open_to_all:
            # The operator's set-up (docs/postgres.md): a run's login could connect there.
            log.warning(
                "proctor: on the PostgreSQL dataset's cluster every role may connect to"
                " the databases %s; a run's login role could too. Run `REVOKE CONNECT ON"
                " DATABASE <name> FROM PUBLIC` for each (docs/postgres.md)",
                ", ".join(open_to_all),
            )
        if to_public:
            # A grant to PUBLIC is a grant to every run's login: the database would
            # not refuse what Cedar forbids there (docs/postgres.md).
            shown = ", ".join(to_public[:20]) + (", ..." if len(to_public) > 20 else "")
            log.warning(
                "proctor: the PostgreSQL dataset's database grants to PUBLIC (every role,"
                " a run's login too): %s. A run's statements are still decided by Cedar,"
                " but the database itself would not refuse these: REVOKE them from"
                " PUBLIC and grant them to the roles that need them (docs/postgres.md)",
                shown,
            )
        return where

    def missing(self, location: str, tables: Mapping[str, Any]) -> list[str]:
        # The catalog, not information_schema: that shows only what the DSN's role
        # may use, and a column the runtime cannot see is one the grant cannot give.
        wanted = {t: _split_table(t) for t in tables}
        try:
            with psycopg.connect(location, connect_timeout=10) as conn:
                rows = conn.execute(
                    "SELECT n.nspname, c.relname, a.attname FROM pg_attribute a"
                    " JOIN pg_class c ON c.oid = a.attrelid"
                    " JOIN pg_namespace n ON n.oid = c.relnamespace"
                    " WHERE a.attnum > 0 AND NOT a.attisdropped"
                    " AND c.relkind IN ('r', 'v', 'm', 'p', 'f')"
                    " AND (n.nspname, c.relname) IN (SELECT * FROM unnest(%s::text[], %s::text[]))",
                    ([s for s, _ in wanted.values()], [n for _, n in wanted.values()]),
                ).fetchall()
        except psycopg.Error as exc:
            raise UsageError(
                f"the PostgreSQL dataset cannot be reached: {type(exc).__name__}"
            ) from exc
        columns: dict[tuple[str, str], set[str]] = {}
        for schema, name, column in rows:
            columns.setdefault((str(schema), str(name)), set()).add(str(column))
        found: list[str] = []
        for table, key in sorted(wanted.items()):
            have = columns.get(key)
            if have is None:
                found.append(f"no table {table!r}")
                continue
            found += [f"no column {c!r} in {table!r}"
                      for c in tables[table].get("columns", ()) if str(c) not in have]  # fmt: skip
        return found

    def describe(self, location: str) -> list[TableShape]:
        # The catalog, as missing() reads it: information_schema shows only what the
        # DSN's role may use. A read-only transaction; no table's contents.
        try:
            with psycopg.connect(location, connect_timeout=10) as conn:
                conn.read_only = True
                rows = conn.execute(_DESCRIBE).fetchall()
        except psycopg.Error as exc:
            # The DSN may hold a password: never echo it.
            raise UsageError(
                f"the PostgreSQL dataset cannot be reached: {type(exc).__name__}"
            ) from exc
        tables: dict[str, tuple[str, list[ColumnShape]]] = {}
        for schema, rel, relkind, col, typ, notnull, pk in rows:
            # A table of the public schema is named as a manifest names it (no schema).
            name = str(rel) if schema == "public" else f"{schema}.{rel}"
            if name not in tables:
                if len(tables) >= DESCRIBED_TABLES:
                    continue
                tables[name] = ("view" if relkind in ("v", "m") else "table", [])
            cols = tables[name][1]
            if len(cols) < DESCRIBED_COLUMNS:
                cols.append(ColumnShape(str(col), str(typ), not bool(notnull), bool(pk)))
        return [TableShape(n, k, tuple(c)) for n, (k, c) in tables.items()]

    def grant(
        self, binding: DatasetBinding, tenant: str, deployment: str, tables: Mapping[str, Any]
    ) -> None:
        # Reset to match the approved manifest at every start.
        grant_deployment_role(binding.location, tenant, deployment, binding.name, tables)

    async def prepare(
        self, scope: RunScope, binding: DatasetBinding, call: SqlCall, base: dict[str, Any]
    ) -> tuple[Statement, dict[str, Any]]:
        # A refusal here is recorded as the call's by the record stage (_connectors.prepare).
        if not isinstance(call.params, tuple):
            raise BadCall("sql: PostgreSQL datasets take positional parameters (?) only")
        try:
            pg_sql = to_pg_sql(call.sql)
        except StoreError as exc:
            raise BadCall(f"sql: {exc.message}") from None
        if _first_word(call.sql) not in _READ_WORDS:
            raise CallDenied("sql: refused: only reads (SELECT) are allowed on PostgreSQL datasets")
        check_statement(pg_sql)
        details: dict[str, Any] = {
            **base,
            "synthetic": binding.synthetic,
            "engine": DatasetKind.POSTGRESQL.value,
        }
        stmt = _Statement(_pool(scope, binding), pg_sql, call.params, scope.statement_timeout)
        return stmt, details

    async def close(self, scope: RunScope, stmt: Statement) -> None:
        assert isinstance(stmt, _Statement)
        # A read ended its transaction in its worker: only the budget is left to
        # give back, here, without a trip to a worker of its own.
        if not stmt.close_idle():
            await run_blocking(scope, stmt.close)

    def release(self, scope: RunScope, binding: DatasetBinding) -> None:
        # The closed pool stays with the scope (see close_pg_pools); one is made
        # closed if no call came, so that a late call opens no login either.
        _close_logged(_pool(scope, binding))

    def revoke(self, location: str, tenant: str, deployment: str, dataset: str) -> bool:
        return revoke_deployment_role(location, tenant, deployment, dataset)

    def revoke_run(self, location: str, tenant: str, run_id: str, dataset: str) -> bool:
        return drop_run_logins(location, tenant, run_id, dataset)


POSTGRESQL = PostgresConnector()


def _first_line(exc: BaseException | None) -> str:
    text = str(exc or "").strip()
    return text.splitlines()[0] if text else type(exc).__name__
