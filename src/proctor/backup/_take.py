"""``proctor backup -o DIR``: a consistent copy of a home while it runs.

The store is copied first, by its engine (one snapshot: SQLite's backup API, or
pg_dump of a snapshot this process holds), and each log's head is read from that
very snapshot: the checkpoints a backup names are the newest the copy holds, so
the copy verifies up to them and no further. The files follow (blobs are
content-addressed and written before the rows that name them, so every blob the
copy names is there); a file written meanwhile is recorded as it was copied.
The manifest is written last: a directory without one is no backup.
"""

from __future__ import annotations

import os
import shutil
import sqlite3
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import proctor
from proctor.backup._files import copy_hashed, hash_file, home_files, make_dir
from proctor.backup._manifest import (
    HOME,
    MANIFEST,
    SIGNATURE,
    STORE,
    FileEntry,
    LogPoint,
    Manifest,
    checkpoint_file,
    sign_manifest,
)
from proctor.errors import ProctorError, UsageError, VerificationFailed
from proctor.ledger import Signer, open_checkpoint, utc_now
from proctor.runtime import load_config, store_url
from proctor.store import Conn, Engine, Row, copy_sqlite, dump_postgres, open_store

Query = Callable[[str, Sequence[Any]], list[Row]]

#: The ledger's tables a PostgreSQL backup copies into a SQLite file beside the dump
#: (what ``backup verify`` reads without a server), with their columns.
LEDGER_TABLES = {
    "ledger_logs": ("log", "origin", "size", "root", "last_time", "checkpoint"),
    "ledger_checkpoints": ("log", "size", "time", "note"),
    "ledger_tiles": ("log", "level", "idx", "hashes"),
    "ledger_entries": ("log", "seq", "time", "data", "ref"),
}


def read_heads(query: Query) -> tuple[dict[str, tuple[str, int, bytes, str]], int]:
    """Each log's (origin, size, root, checkpoint note), and the schema version."""
    heads = {
        str(r[0]): (str(r[1]), int(r[2]), bytes(r[3]), str(r[4]))
        for r in query("SELECT log, origin, size, root, checkpoint FROM ledger_logs", ())
    }
    row = query("SELECT MAX(version) FROM schema_migrations", ())
    return heads, int(row[0][0]) if row and row[0][0] is not None else 0


def sqlite_query(path: Path) -> tuple[sqlite3.Connection, Query]:
    """A read-only connection to a SQLite file nothing else writes (a copy)."""
    db = sqlite3.connect(f"{path.absolute().as_uri()}?mode=ro&immutable=1", uri=True)

    def query(sql: str, params: Sequence[Any]) -> list[Row]:
        return db.execute(sql, params).fetchall()

    return db, query


def take_backup(home: Path, out: Path, *, keys: bool = True) -> Manifest:
    """Back ``home`` up into the new directory ``out``; returns the manifest."""
    config = load_config(home)
    signer = Signer.load(config.trust_domain, home / config.key)
    _check_out(home, out)
    created = utc_now()
    make_dir(out)
    os.chmod(out, 0o700)  # an empty directory given may have been anyone's to read
    try:
        return _take(home, out, signer, config.trust_domain, store_url(home, config), created,
                     keys)  # fmt: skip
    except BaseException:
        # Nothing half-made is left to be taken for a backup (no manifest: none).
        shutil.rmtree(out, ignore_errors=True)
        raise


def _check_out(home: Path, out: Path) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UsageError(f"{out} exists and is not an empty directory",
                         hint="give a new directory to -o")  # fmt: skip
    try:
        out.absolute().resolve().relative_to(home.absolute().resolve())
    except ValueError:
        return
    raise UsageError(f"{out} lies inside the home it would back up",
                     hint="put the backup outside the home (and off its disk)")  # fmt: skip


def _take(
    home: Path, out: Path, signer: Signer, trust_domain: str, url: str, created: str, keys: bool
) -> Manifest:
    make_dir(out / STORE)
    files: dict[str, FileEntry] = {}
    if url.startswith(("postgresql://", "postgres://")):
        engine = Engine.POSTGRESQL
        store_rel, ledger_rel = f"{STORE}/proctor.pgdump", f"{STORE}/ledger.db"
        heads, schema = dump_postgres(
            url, out / store_rel, lambda conn: _copy_ledger(conn, out / ledger_rel)
        )
        files[ledger_rel] = hash_file(out / ledger_rel)
    else:
        engine = Engine.SQLITE
        store_rel = ledger_rel = f"{STORE}/proctor.db"
        copy_sqlite(Path(url.removeprefix("sqlite:///")), out / store_rel)
        db, query = sqlite_query(out / store_rel)
        try:
            heads, schema = read_heads(query)
        finally:
            db.close()
    files[store_rel] = hash_file(out / store_rel)
    logs: dict[str, LogPoint] = {}
    make_dir(out / "checkpoints")
    for log, (origin, size, root, note) in sorted(heads.items()):
        # The copy's own heads, signed by this home: a backup of a store that does not
        # verify at its head is refused here rather than found out at restore.
        cp = open_checkpoint(note, signer.verifier, origin)
        if (cp.size, cp.root) != (size, root):
            raise VerificationFailed(
                f"the store's head of log {log!r} (size {size}) is not its checkpoint "
                f"(size {cp.size}): the store is damaged; no backup made"
            )
        rel = checkpoint_file(log)
        _write_new(out / rel, note.encode())
        files[rel] = hash_file(out / rel)
        logs[log] = LogPoint(origin, size, root, rel)
    wanted, skipped = home_files(home, keys)
    for rel in wanted:
        try:
            files[f"{HOME}/{rel}"] = copy_hashed(home / rel, out / HOME / rel)
        except FileNotFoundError:
            continue  # removed while the backup ran (a run's output, a bucket object)
    if not (out / HOME / "config.json").is_file():
        raise UsageError(f"{home} has no config.json: not a Proctor home")
    manifest = Manifest(
        created=created, version=proctor.__version__, trust_domain=trust_domain,
        verifier_key=signer.verifier.vkey(), engine=engine, schema_version=schema, keys=keys,
        store=store_rel, ledger=ledger_rel, logs=logs, files=files, skipped=skipped,
    )  # fmt: skip
    data, note = sign_manifest(signer, manifest)
    _write_new(out / SIGNATURE, note.encode())
    # Last: its presence says the backup is whole.
    _write_new(out / MANIFEST, data)
    _fsync_dir(out)
    return manifest


def _copy_ledger(conn: Conn, dest: Path) -> tuple[dict[str, tuple[str, int, bytes, str]], int]:
    """In the dump's snapshot: the heads, and the ledger's tables copied into a new
    SQLite store at ``dest`` (for ``backup verify`` without a server)."""
    heads, schema = read_heads(conn.query)
    target = open_store(str(dest), create=True)
    try:
        for table, columns in LEDGER_TABLES.items():
            names = ", ".join(columns)
            marks = ", ".join("?" * len(columns))
            batch: list[Row] = []
            with target.write() as out:
                for row in conn.iterate(f"SELECT {names} FROM {table}"):  # noqa: S608 - fixed names
                    batch.append(tuple(bytes(v) if isinstance(v, memoryview) else v for v in row))
                    if len(batch) >= 1000:
                        out.executemany(f"INSERT INTO {table} ({names}) VALUES ({marks})", batch)  # noqa: S608
                        batch.clear()
                if batch:
                    out.executemany(f"INSERT INTO {table} ({names}) VALUES ({marks})", batch)  # noqa: S608
    finally:
        target.close()
    for leftover in ("-wal", "-shm"):
        Path(f"{dest}{leftover}").unlink(missing_ok=True)
    os.chmod(dest, 0o600)
    return heads, schema


def _write_new(path: Path, data: bytes) -> None:
    make_dir(path.parent)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError as exc:
        raise ProctorError(f"cannot make the backup {path} durable: {exc}") from exc
    finally:
        os.close(fd)
