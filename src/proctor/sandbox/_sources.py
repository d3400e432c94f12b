"""Host directories a guest reads (its code, the guest library), readable on both backends.

The guest is an unprivileged user on every backend: 65534 inside gVisor's
sentry, the dedicated ``proctor-guest`` user under bubblewrap. A code directory
of mode 0700 or a file of mode 0600 would be unreadable to it, and under
bubblewrap even a private directory above it (a user's 0700 home) stops bwrap's
set-up, which runs as root without the right to override another user's
permissions. Neither backend may differ from the other, and the host's files
are never chmod-ed to make them readable.

So a directory is bound in place when the guest can read all of it there, and
otherwise a private copy is bound: regular files (0644, or 0755 when any
execute bit is set), directories (0755) and symbolic links as links (they
resolve inside the guest, never on the host); FIFOs, sockets and devices are
left out. The copy is made with directory file descriptors and ``O_NOFOLLOW``,
so a link swapped in while copying is copied as a link, never followed. It is
a snapshot taken when the run starts, and it lives in the run's work
directory, removed with it.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable
from pathlib import Path

from proctor.sandbox._errors import SandboxSpecInvalid

_CHUNK = 1 << 20
_OTHER_RX = stat.S_IROTH | stat.S_IXOTH


def _ancestors_searchable(path: Path) -> bool:
    # bwrap's set-up is root in a namespace where only root's and the guest
    # user's ids exist: it passes root's own directories, and others' only
    # where everyone may.
    for parent in path.parents:
        st = os.stat(parent)
        if st.st_mode & stat.S_IXOTH:
            continue
        if st.st_uid == 0 and st.st_mode & stat.S_IXUSR:
            continue
        return False
    return True


def readable_in_place(path: Path) -> bool:
    """Whether a guest of any backend can reach and read all of ``path`` where it is."""
    try:
        return _ancestors_searchable(path) and _tree_readable(path)
    except OSError:
        return False  # root cannot list it either; the copy will say why


def _tree_readable(path: Path) -> bool:
    stack = [path]
    while stack:
        directory = stack.pop()
        st = os.lstat(directory)
        if st.st_mode & _OTHER_RX != _OTHER_RX:
            return False
        with os.scandir(directory) as entries:
            for entry in entries:
                est = entry.stat(follow_symlinks=False)
                if stat.S_ISDIR(est.st_mode):
                    stack.append(Path(entry.path))
                elif stat.S_ISREG(est.st_mode) and not est.st_mode & stat.S_IROTH:
                    return False
    return True


def _copy_file(src_dir: int, name: str, dest: Path, mode: int) -> None:
    src = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=src_dir)
    try:
        if not stat.S_ISREG(os.fstat(src).st_mode):
            return  # replaced by something else while copying: not code
        out = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
        try:
            os.fchmod(out, mode)
            while chunk := os.read(src, _CHUNK):
                view = memoryview(chunk)
                while view:
                    view = view[os.write(out, view) :]
        finally:
            os.close(out)
    finally:
        os.close(src)


def copy_readable(src: Path, dest: Path) -> None:
    """Copy the tree at ``src`` to ``dest`` (new), every part readable by anyone."""
    root = os.open(src, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    pending: list[tuple[int, Path]] = [(root, dest)]
    try:
        dest.mkdir(mode=0o755)
        dest.chmod(0o755)  # the umask must not take from the guest what it reads
        while pending:
            dir_fd, target = pending.pop()
            try:
                with os.scandir(dir_fd) as entries:
                    listing = list(entries)
                for entry in listing:
                    st = entry.stat(follow_symlinks=False)
                    out = target / entry.name
                    if stat.S_ISLNK(st.st_mode):
                        os.symlink(os.readlink(entry.name, dir_fd=dir_fd), out)
                    elif stat.S_ISDIR(st.st_mode):
                        child = os.open(
                            entry.name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=dir_fd
                        )
                        out.mkdir(mode=0o755)
                        out.chmod(0o755)
                        pending.append((child, out))
                    elif stat.S_ISREG(st.st_mode):
                        mode = 0o755 if st.st_mode & 0o111 else 0o644
                        _copy_file(dir_fd, entry.name, out, mode)
            finally:
                os.close(dir_fd)
    except OSError as exc:
        raise SandboxSpecInvalid(
            f"cannot copy {src} for the guest to read: {exc.strerror} ({exc.filename or src})"
        ) from exc
    finally:
        for dir_fd, _ in pending:
            os.close(dir_fd)


def needing_copies(paths: Iterable[Path]) -> list[Path]:
    """The directories among ``paths`` that a guest could not read in place."""
    return [p for p in paths if not readable_in_place(p)]


def guest_sources(paths: Iterable[Path], copies: Iterable[Path], workdir: Path) -> dict[Path, Path]:
    """For each host directory the guest reads, the directory to bind: itself, or for
    those in ``copies`` a private copy made in ``workdir`` (the run's own)."""
    sources = {p: p for p in paths}
    for index, path in enumerate(copies):
        sources[path] = workdir / f"source-{index}"
        copy_readable(path, sources[path])
    return sources
