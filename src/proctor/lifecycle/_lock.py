"""One supervising ``proctor serve`` per home, and per store.

Two supervisors of one home would each keep every service up and fire every
schedule: twice the runs, each believing it is the only one. The first ``serve``
holds an exclusive ``flock`` on ``<home>/serve.lock`` for its whole life (the
kernel drops it when the process dies, SIGKILL included, so a dead server never
blocks its successor). A PostgreSQL store can be shared by several homes, so
there the lock is a session advisory lock on the store as well, held on a
connection of its own; until node membership exists, one ``serve`` per store.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
from pathlib import Path
from types import TracebackType
from typing import Any

from proctor.errors import AlreadyExists, StoreError
from proctor.store import Store

LOCK_FILE = "serve.lock"
_PG_LOCK = "proctor:serve:supervisor"


def _pg_key(name: str) -> int:
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "big", signed=True)


class ServeLock:
    """Held while a ``serve`` supervises; :meth:`acquire` refuses a second one."""

    def __init__(self, home: Path, store: Store, owner: str) -> None:
        self.home = home
        self.store = store
        self.owner = owner
        self._fd: int | None = None
        self._pg: Any = None

    def acquire(self) -> ServeLock:
        path = self.home / LOCK_FILE
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 256, 0).decode(errors="replace").strip() or "another process"
            os.close(fd)
            raise AlreadyExists(
                f"a proctor serve supervises {self.home} already ({holder})",
                hint="one serve per home: stop that one first (SIGTERM), or use it",
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{self.owner}\n".encode(), 0)
        self._fd = fd
        try:
            self._lock_store()
        except BaseException:
            self.release()
            raise
        return self

    def _lock_store(self) -> None:
        dsn = getattr(self.store, "dsn", None)
        if self.store.engine != "postgresql" or not isinstance(dsn, str):
            return  # a SQLite store belongs to one home: the file lock is enough
        import psycopg

        try:
            conn = psycopg.connect(dsn, autocommit=True, application_name="proctor serve lock")
            row = conn.execute("SELECT pg_try_advisory_lock(%s)", (_pg_key(_PG_LOCK),)).fetchone()
        except psycopg.Error as exc:
            raise StoreError(
                f"cannot take the store's supervisor lock: {type(exc).__name__}"
            ) from None
        if not (row and row[0]):
            conn.close()
            raise AlreadyExists(
                f"a proctor serve supervises the store of {self.home} already "
                "(a PostgreSQL store shared by another home)",
                hint="one serve per store until node membership exists: stop the other one",
            )
        self._pg = conn

    def release(self) -> None:
        if self._pg is not None:
            with contextlib.suppress(Exception):
                self._pg.close()  # the session's advisory lock goes with it
            self._pg = None
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, 0)
            os.close(self._fd)  # the flock goes with the last descriptor
            self._fd = None

    def __enter__(self) -> ServeLock:
        return self.acquire()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()
