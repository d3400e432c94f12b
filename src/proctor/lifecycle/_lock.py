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
import os
from contextlib import AbstractContextManager
from pathlib import Path
from types import TracebackType

from proctor.errors import AlreadyExists
from proctor.store import Store

LOCK_FILE = "serve.lock"
_STORE_LOCK = "proctor:serve:supervisor"


class ServeLock:
    """Held while a ``serve`` supervises; :meth:`acquire` refuses a second one."""

    def __init__(self, home: Path, store: Store, owner: str) -> None:
        self.home = home
        self.store = store
        self.owner = owner
        self._fd: int | None = None
        self._held: AbstractContextManager[None] | None = None

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
        if not self.store.capabilities.advisory_lock:
            return  # a store without session locks belongs to one home: the file lock is enough
        held = self.store.try_lock(_STORE_LOCK)
        if held is None:
            raise AlreadyExists(
                f"a proctor serve supervises the store of {self.home} already "
                "(a PostgreSQL store shared by another home)",
                hint="one serve per store until node membership exists: stop the other one",
            )
        held.__enter__()
        self._held = held

    def release(self) -> None:
        if self._held is not None:
            with contextlib.suppress(Exception):
                self._held.__exit__(None, None, None)
            self._held = None
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
