"""An artifact's directory read: walked without following a link, each file copied
into a staging area of the blob store while it is hashed, each link held to the tree
read (``resolve_inside``); and the blob store itself, content-addressed and
checked again on every read.

What the walk refuses (each with a message naming the path): symlinks that leave
the directory, dangle, or are absolute; device files, FIFOs and sockets; more than
``max_files`` entries or ``max_bytes`` of content; names that are not UTF-8 or hold
control characters; directories nested deeper than ``MAX_DEPTH``.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import secrets
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from proctor.errors import UsageError, VerificationFailed
from proctor.governance._paths import LinkLoop, LinkOutside, PathKind, resolve_inside

SKIPPED_NAMES = frozenset({".git", ".hg", ".svn", ".bzr", "__pycache__"})
MAX_DEPTH = 64
MAX_PATH_BYTES = 1024
_CHUNK = 1 << 16


@dataclass(frozen=True)
class ArtifactFile:
    """One entry of an artifact: a regular file, or a symlink (``link`` set)."""

    path: str
    mode: int
    sha256: str
    size: int
    link: str | None = None

    def to_json(self) -> dict[str, Any]:
        """The entry as the digest covers it."""
        if self.link is not None:
            return {"path": self.path, "link": self.link}
        return {"path": self.path, "mode": self.mode, "sha256": self.sha256, "size": self.size}


# -- blobs -----------------------------------------------------------------


class Blobs:
    """Content-addressed files under one root, private to the runtime."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def path(self, sha256: str) -> Path:
        return self.root / "sha256" / sha256[:2] / sha256

    def staging(self) -> Path:
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        for sub in ("sha256", "tmp"):
            (self.root / sub).mkdir(mode=0o700, exist_ok=True)
        tmp = self.root / "tmp"
        stage = tmp / secrets.token_hex(8)
        stage.mkdir(mode=0o700)
        return stage

    def stage_from(self, fd: int, stage: Path, budget: int) -> tuple[str, int, Path]:
        """Copy an open file into ``stage`` while hashing it; refuse past ``budget`` bytes."""
        digest = hashlib.sha256()
        size = 0
        tmp = stage / secrets.token_hex(8)
        out = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            while chunk := os.read(fd, _CHUNK):
                size += len(chunk)
                if size > budget:
                    raise TooLarge
                digest.update(chunk)
                write_all(out, chunk)
            os.fsync(out)
        finally:
            os.close(out)
        return digest.hexdigest(), size, tmp

    def commit(self, tmp: Path, sha256: str) -> None:
        final = self.path(sha256)
        if final.exists():
            tmp.unlink()
            return
        final.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(tmp, 0o444)
        os.replace(tmp, final)
        _fsync_dir(final.parent)

    @contextlib.contextmanager
    def open(self, f: ArtifactFile) -> Iterator[VerifiedReader]:
        try:
            handle = self.path(f.sha256).open("rb")
        except OSError as exc:
            raise VerificationFailed(
                f"the stored content of {f.path} (sha256 {f.sha256}) is missing: {exc.strerror}"
            ) from exc
        with handle:
            yield VerifiedReader(handle, f)

    def read(self, f: ArtifactFile) -> bytes:
        with self.open(f) as reader:
            parts = list(reader.chunks())
        return b"".join(parts)


class VerifiedReader:
    """Chunks of a blob; raises once the whole has been read if it is not what was stored."""

    def __init__(self, handle: BinaryIO, f: ArtifactFile) -> None:
        self._handle = handle
        self._file = f

    def chunks(self) -> Iterator[bytes]:
        digest = hashlib.sha256()
        size = 0
        while chunk := self._handle.read(_CHUNK):
            size += len(chunk)
            digest.update(chunk)
            yield chunk
        if size != self._file.size or digest.hexdigest() != self._file.sha256:
            raise VerificationFailed(
                f"the stored content of {self._file.path} does not match its hash"
                f" (sha256 {self._file.sha256}): the blob store was tampered with or corrupted"
            )


class TooLarge(Exception):
    pass


def write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# -- walking a directory ---------------------------------------------------


@dataclass
class Walk:
    root: Path
    blobs: Blobs
    stage: Path
    max_bytes: int
    max_files: int
    total: int = 0

    def __post_init__(self) -> None:
        self.files: dict[str, tuple[ArtifactFile, Path]] = {}
        self.links: dict[str, str] = {}
        self.dirs: set[str] = {""}

    def run(self) -> None:
        try:
            fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY)
        except OSError as exc:
            raise UsageError(f"cannot open the directory {self.root}: {exc.strerror}") from exc
        try:
            self._dir(fd, "", 0)
        finally:
            os.close(fd)
        for path, target in self.links.items():
            self._check_link(path, target)

    def _dir(self, fd: int, prefix: str, depth: int) -> None:
        if depth > MAX_DEPTH:
            raise UsageError(f"{prefix}: directories nest deeper than {MAX_DEPTH} levels")
        for name in sorted(os.listdir(fd)):
            if name in SKIPPED_NAMES:
                continue
            rel = f"{prefix}{name}"
            _check_name(rel)
            try:
                self._entry(fd, name, rel, depth)
            except OSError as exc:
                # Unreadable, or removed while being read: the user's to fix, not a crash.
                raise UsageError(f"cannot read {rel}: {exc.strerror}") from exc

    def _entry(self, fd: int, name: str, rel: str, depth: int) -> None:
        st = os.stat(name, dir_fd=fd, follow_symlinks=False)
        if stat.S_ISDIR(st.st_mode):
            sub = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
            try:
                self.dirs.add(rel)
                self._dir(sub, rel + "/", depth + 1)
            finally:
                os.close(sub)
        elif stat.S_ISLNK(st.st_mode):
            self._count(rel)
            target = os.readlink(name, dir_fd=fd)
            if target.startswith("/"):
                raise UsageError(
                    f"{rel}: the symlink points to the absolute path {target!r}",
                    hint="only relative links to files inside the artifact are kept",
                )
            if not target or "\x00" in target:
                raise UsageError(f"{rel}: invalid symlink target {target!r}")
            self.links[rel] = target
        elif stat.S_ISREG(st.st_mode):
            self._count(rel)
            self._file(fd, name, rel, st)
        else:
            raise UsageError(
                f"{rel} is a {_kind(st.st_mode)}: only regular files, directories and"
                " symlinks inside the directory can be part of an artifact"
            )

    def _count(self, rel: str) -> None:
        if len(self.files) + len(self.links) >= self.max_files:
            raise UsageError(
                f"the artifact has more than {self.max_files} files (at {rel})",
                hint="leave data and dependencies out; they are not code to review",
            )

    def _file(self, dir_fd: int, name: str, rel: str, st: os.stat_result) -> None:
        # O_NOFOLLOW and O_NONBLOCK: if the entry was swapped for a link or a FIFO
        # since it was looked at, the open fails or returns at once, and the
        # fstat below refuses it, so what is hashed is what was checked.
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=dir_fd)
        try:
            now = os.fstat(fd)
            if not stat.S_ISREG(now.st_mode) or now.st_ino != st.st_ino:
                raise UsageError(f"{rel} changed while the artifact was being read")
            budget = self.max_bytes - self.total
            try:
                sha, size, tmp = self.blobs.stage_from(fd, self.stage, budget)
            except TooLarge:
                raise UsageError(
                    f"the artifact is larger than {_human(self.max_bytes)} (at {rel})",
                    hint="leave data and dependencies out; they are not code to review",
                ) from None
        finally:
            os.close(fd)
        self.total += size
        mode = 0o755 if now.st_mode & 0o111 else 0o644
        self.files[rel] = (ArtifactFile(rel, mode, sha, size), tmp)

    def _check_link(self, path: str, target: str) -> None:
        """Follow the link through the recorded tree: it must end at a file or directory
        of the artifact without ever leaving it."""
        try:
            end = resolve_inside(_parent_parts(path), target, self._kind_of, self._link_of)
        except LinkOutside:
            raise UsageError(
                f"{path}: the symlink points outside the artifact ({target!r})",
                hint="only relative links to files inside the artifact are kept",
            ) from None
        except LinkLoop:
            raise UsageError(f"{path}: too many levels of symlinks") from None
        if not end.complete:
            raise UsageError(
                f"{path}: the symlink's target {target!r} is not in the artifact",
                hint="dangling links, and links into skipped directories, are refused",
            )

    def _kind_of(self, parts: tuple[str, ...]) -> PathKind | None:
        rel = "/".join(parts)
        if rel in self.links:
            return "link"
        if rel in self.dirs:
            return "dir"
        if rel in self.files:
            return "file"
        return None

    def _link_of(self, parts: tuple[str, ...]) -> str:
        return self.links["/".join(parts)]

    def resolves_to_file(self, path: str) -> bool:
        if path in self.files:
            return True
        if path not in self.links:
            return False
        target = self.links[path]
        try:
            end = resolve_inside(_parent_parts(path), target, self._kind_of, self._link_of)
        except UsageError:
            return False
        return end.complete and end.kind == "file"


def _parent_parts(path: str) -> tuple[str, ...]:
    return tuple(p for p in path.split("/")[:-1] if p)


def _check_name(rel: str) -> None:
    try:
        encoded = rel.encode("utf-8")
    except UnicodeEncodeError:
        raise UsageError(
            f"{rel.encode('utf-8', 'surrogateescape')!r}: file names must be UTF-8"
        ) from None
    if len(encoded) > MAX_PATH_BYTES:
        raise UsageError(f"{rel[:80]}...: path longer than {MAX_PATH_BYTES} bytes")
    if any(not c.isprintable() for c in rel):
        raise UsageError(f"{rel!r}: file names must not contain control characters")


def _kind(mode: int) -> str:
    if stat.S_ISFIFO(mode):
        return "FIFO"
    if stat.S_ISSOCK(mode):
        return "socket"
    if stat.S_ISCHR(mode):
        return "character device"
    if stat.S_ISBLK(mode):
        return "block device"
    return "special file"


def _human(n: int) -> str:
    for unit, size in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= size and n % size == 0:
            return f"{n // size}{unit}"
    return f"{n} bytes"


class FileSet:
    """The paths an entrypoint may name: files, and links that resolve to one."""

    def __init__(self, walk: Walk) -> None:
        self._walk = walk

    def __contains__(self, item: object) -> bool:
        return isinstance(item, str) and self._walk.resolves_to_file(item)

    def __iter__(self) -> Iterator[str]:
        return iter(self._walk.files)

    def __len__(self) -> int:
        return len(self._walk.files)
