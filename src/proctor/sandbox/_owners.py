"""Who owns what a runtime leaves on the machine, so that a successor can clean up.

A process killed with SIGKILL runs no clean-up: its sandboxes, their registry
entries and its broker sockets stay behind. Everything of that kind is named
after its owner, a pid *and* that process's start time (field 22 of
``/proc/<pid>/stat``), so a later process removes exactly what belongs to the
dead: a pid the kernel has since given to an unrelated process is not mistaken
for the owner, and a live owner's things are never touched.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import stat
from pathlib import Path

from proctor.sandbox._errors import SandboxUnavailable

_OWNER_RE = re.compile(r"^(\d+)-(\d+)$")


def process_start_time(pid: int) -> str | None:
    """The start time of ``pid`` in clock ticks since boot, or None if it is gone.

    A zombie counts as gone: it has run its last instruction, and whatever it
    owned (a runsc it started, say) lives on without it.
    """
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # Fields 3 (state) and 22, counted after the parenthesised command name,
    # which may hold spaces.
    fields = raw.rpartition(")")[2].split()
    return None if fields[0] in ("Z", "X") else fields[19]


def owner_alive(pid: int, start: str | None) -> bool:
    return start is not None and process_start_time(pid) == start


def owner_name(pid: int | None = None) -> str:
    """``<pid>-<start time>`` of ``pid`` (this process by default)."""
    pid = os.getpid() if pid is None else pid
    start = process_start_time(pid)
    if start is None:
        raise SandboxUnavailable(f"/proc/{pid}/stat is unreadable: cannot name an owner")
    return f"{pid}-{start}"


def parse_owner(name: str) -> tuple[int, str] | None:
    m = _OWNER_RE.match(name)
    return (int(m.group(1)), m.group(2)) if m else None


def private_dir(path: Path) -> Path:
    """Create ``path`` (0700) if needed and check that it is ours: a real directory
    owned by this user that nobody else can write, not something planted there."""
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = os.lstat(path)
    except OSError as exc:
        raise SandboxUnavailable(f"cannot create {path}: {exc.strerror}") from exc
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o022:
        raise SandboxUnavailable(
            f"{path} is not a private directory of this user",
            hint="remove it, or point the runtime elsewhere",
        )
    return path


def owned_dir(root: Path) -> Path:
    """This process's directory under ``root``, created if needed (0700)."""
    private_dir(root)
    mine = root / owner_name()
    with contextlib.suppress(FileExistsError):
        mine.mkdir(mode=0o700)
    return mine


def release_owned_dir(root: Path) -> None:
    """Remove this process's directory under ``root`` if nothing is left in it."""
    with contextlib.suppress(OSError, SandboxUnavailable):
        (root / owner_name()).rmdir()


def reap_owned_dirs(root: Path) -> list[Path]:
    """Remove every owner directory under ``root`` whose owner is dead; returns them.

    Names that are not ``<pid>-<start>`` are left alone: not ours to judge.
    """
    reaped: list[Path] = []
    if not root.is_dir():
        return reaped
    for path in sorted(root.iterdir()):
        owner = parse_owner(path.name)
        if owner is None or owner_alive(*owner):
            continue
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
        reaped.append(path)
    return reaped
