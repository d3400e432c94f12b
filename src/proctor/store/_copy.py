"""Engine-level copies of a store taken while it is written (``proctor backup``).

SQLite: the online backup API (``sqlite3.Connection.backup``) in one step, which
copies every page under one read transaction: a snapshot of the last commit,
taken without stopping the writer (WAL readers do not block it).

PostgreSQL: ``pg_dump`` of a snapshot this module exports from a transaction of
its own (``REPEATABLE READ``, ``pg_export_snapshot``), so that what the caller
reads in that transaction (the ledger's heads) and what the dump holds are the
same state of the database, whatever commits meanwhile. A dump restores only into
an empty database (``pg_restore``), never over a store that holds one.
"""

from __future__ import annotations

import glob
import os
import shutil
import sqlite3
import subprocess
from collections.abc import Callable
from contextlib import suppress
from pathlib import Path
from typing import TypeVar

from proctor.errors import StoreError, UsageError
from proctor.store._base import Conn
from proctor.store._pgtext import redact

T = TypeVar("T")

#: How long pg_dump and pg_restore may take (seconds) before the copy is refused.
PG_TOOL_TIMEOUT = 3600


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def copy_sqlite(src: Path, dest: Path) -> None:
    """A consistent copy of the SQLite store ``src`` at ``dest`` (a new file,
    mode 0600), taken while other connections write it."""
    if not src.is_file():
        raise StoreError(f"no SQLite store at {src}")
    fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.close(fd)
    try:
        # mode=rw: never create a database where the store should be.
        source = sqlite3.connect(f"{src.absolute().as_uri()}?mode=rw", uri=True, timeout=30)
        try:
            target = sqlite3.connect(dest)
            try:
                # pages=-1: one step, one read transaction, so the copy is one commit's
                # state; in steps, a write between them would restart the copy anyway.
                source.backup(target, pages=-1)
                # A file that stands alone: no WAL beside it to be lost.
                target.execute("PRAGMA journal_mode=DELETE").fetchone()
            finally:
                target.close()
        finally:
            source.close()
    except sqlite3.Error as exc:
        dest.unlink(missing_ok=True)
        raise StoreError(f"cannot copy the store {src}: {exc}") from exc
    _fsync(dest)


def pg_tool(name: str) -> str:
    """The path of PostgreSQL's ``name`` (pg_dump, pg_restore): on PATH, else the
    newest Debian install under /usr/lib/postgresql."""
    found = shutil.which(name)
    if found:
        return found
    versions = sorted(
        glob.glob(f"/usr/lib/postgresql/*/bin/{name}"),
        key=lambda p: int(p.split("/")[4]) if p.split("/")[4].isdigit() else 0,
    )
    if versions:
        return versions[-1]
    raise UsageError(
        f"{name} is not installed: a PostgreSQL store is copied with PostgreSQL's own tools",
        hint="install the PostgreSQL client (Debian: postgresql-client), as new as the server",
    )


def _without_password(dsn: str) -> tuple[str, dict[str, str]]:
    """``dsn`` without its password, and the environment that carries it instead: a
    tool's command line is readable by every user of the machine (``ps``)."""
    from psycopg.conninfo import conninfo_to_dict, make_conninfo

    try:
        params = conninfo_to_dict(dsn)
    except Exception as exc:  # psycopg's ProgrammingError: a malformed DSN
        raise UsageError(f"the store's URL {redact(dsn)} is malformed: {exc}") from exc
    password = params.pop("password", None)
    env = dict(os.environ)
    if password is not None:
        env["PGPASSWORD"] = str(password)
    return make_conninfo(**{k: str(v) for k, v in params.items() if v is not None}), env


def _run_tool(args: list[str], what: str, dsn: str, env: dict[str, str] | None = None) -> None:
    try:
        proc = subprocess.run(
            args, capture_output=True, timeout=PG_TOOL_TIMEOUT, check=False, env=env
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise StoreError(f"{what} {redact(dsn)} failed: {exc}") from exc
    if proc.returncode != 0:
        lines = proc.stderr.decode(errors="replace").strip().splitlines()
        why = lines[0] if lines else f"exit {proc.returncode}"
        raise StoreError(f"{what} {redact(dsn)} failed: {why}")


def dump_postgres(dsn: str, dest: Path, read: Callable[[Conn], T]) -> T:
    """Dump the PostgreSQL store at ``dsn`` to ``dest`` (pg_dump's custom format,
    mode 0600) and return ``read(conn)``, run in the very snapshot the dump holds."""
    import psycopg

    from proctor.store._postgres import _PGConn

    try:
        db = psycopg.connect(dsn, autocommit=True, application_name="proctor backup")
    except psycopg.Error as exc:
        raise StoreError(f"cannot connect to the store {redact(dsn)}: {exc}") from exc
    try:
        db.execute("BEGIN ISOLATION LEVEL REPEATABLE READ, READ ONLY")
        row = db.execute("SELECT pg_export_snapshot()").fetchone()
        snapshot = str(row[0]) if row else ""
        conn = _PGConn(db)
        try:
            got = read(conn)
        finally:
            conn.end()
        fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.close(fd)
        # pg_dump joins the exported snapshot while this transaction holds it open.
        bare, env = _without_password(dsn)
        _run_tool([pg_tool("pg_dump"), "--format=custom", "--no-owner", "--no-privileges",
                   f"--snapshot={snapshot}", f"--file={dest}", f"--dbname={bare}"],
                  "pg_dump of", dsn, env)  # fmt: skip
        db.execute("COMMIT")
    except psycopg.Error as exc:
        raise StoreError(f"cannot read the store {redact(dsn)}: {exc}") from exc
    finally:
        with suppress(psycopg.Error):
            db.close()
    _fsync(dest)
    return got


def check_dump(dump: Path) -> None:
    """Refuse a file pg_restore cannot read as an archive (read offline: no server)."""
    _run_tool([pg_tool("pg_restore"), "--list", str(dump)], "reading the dump", str(dump))


def restore_postgres(dump: Path, dsn: str) -> None:
    """Load ``dump`` into the database at ``dsn``, which must hold no Proctor store
    (a restore never writes over a store, the original's least of all)."""
    import psycopg

    try:
        with psycopg.connect(dsn, autocommit=True, application_name="proctor restore") as db:
            row = db.execute(
                "SELECT count(*) FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace"
                " WHERE n.nspname = current_schema() AND c.relkind IN ('r', 'p', 'v', 'S')"
            ).fetchone()
    except psycopg.Error as exc:
        raise StoreError(f"cannot connect to the store {redact(dsn)}: {exc}") from exc
    if row and int(row[0]):
        raise UsageError(
            f"the database {redact(dsn)} is not empty ({row[0]} tables): a restore goes "
            "into a new, empty database only",
            hint="create one (createdb) and give it with --store",
        )
    bare, env = _without_password(dsn)
    _run_tool([pg_tool("pg_restore"), "--no-owner", "--no-privileges", "--exit-on-error",
               "--single-transaction", f"--dbname={bare}", str(dump)],
              "pg_restore into", dsn, env)  # fmt: skip
