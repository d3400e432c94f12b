"""One supervising ``proctor serve`` per home, and per store.

Two supervisors of one home would each keep every service up and fire every
schedule: twice the runs, each believing it is the only one. The first ``serve``
holds an exclusive ``flock`` on ``<home>/serve.lock`` for its whole life (the
kernel drops it when the process dies, SIGKILL included, so a dead server never
blocks its successor). Several homes may share one PostgreSQL store: each of
their ``serve`` processes is a node of it (lifecycle/_nodes.py), and what must
happen once across them (a service's next run, a schedule's tick) is claimed in
the store, not locked here.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path
from types import TracebackType

from proctor.errors import AlreadyExists
from proctor.store import Store

LOCK_FILE = "serve.lock"


class ServeLock:
    """Held while a ``serve`` supervises; :meth:`acquire` refuses a second one."""

    def __init__(self, home: Path, store: Store, owner: str) -> None:
        self.home = home
        self.store = store
        self.owner = owner
        self._fd: int | None = None

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
        return self

    def release(self) -> None:
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
