"""Objects in a tenant's buckets, on disk: the one check of a key and the one
link-free way to walk, read, list and write them. The broker (a run's calls) and
``Resources`` (a person's) both use it, so a key a run may not name is a key no
person may name either.

Keys are segments of ``[A-Za-z0-9._-]`` that do not start with a dot (so no
``.``, ``..``, hidden or temporary names), no empty segment, no leading ``/``,
at most 1,024 characters. Paths are walked one directory at a time from an open
directory descriptor with ``O_NOFOLLOW``: a symbolic link anywhere under the
bucket (even one swapped in during the call) is refused rather than followed.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import re
import secrets
import stat
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

#: Largest object a run (or a person) may read or write, by default.
MAX_OBJECT_BYTES = 64 * 1024 * 1024
MAX_KEY_LENGTH = 1024
MAX_KEY_DEPTH = 32
_BUCKET_RE = re.compile(r"^[a-z][a-z0-9_]{0,62}$")  # as governance registers them
_SEGMENT_RE = re.compile(r"^[A-Za-z0-9_\-][A-Za-z0-9._\-]{0,254}$")
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
_CHUNK = 1024 * 1024


class ObjectUnsafe(Exception):
    """The path under the bucket is not plain directories and a regular file."""


class ObjectMissing(Exception):
    """No such object (or directory on the way to it)."""


class ObjectTooBig(Exception):
    """The object is over the size cap."""


def key_problem(key: object) -> str | None:
    """Why ``key`` is not an acceptable object key, or None if it is."""
    if not isinstance(key, str) or not key:
        return "the key must be a non-empty string"
    if len(key) > MAX_KEY_LENGTH:
        return f"the key is longer than {MAX_KEY_LENGTH} characters"
    parts = key.split("/")
    if len(parts) > MAX_KEY_DEPTH:
        return f"the key is deeper than {MAX_KEY_DEPTH} levels"
    for part in parts:
        if not _SEGMENT_RE.match(part):
            return (
                "each part of a key is letters, digits, '.', '_' or '-', "
                "does not start with '.', and parts are separated by single '/'"
            )
    return None


def bucket_problem(bucket: object) -> str | None:
    """Why ``bucket`` is not an acceptable bucket name, or None if it is."""
    if not isinstance(bucket, str) or not _BUCKET_RE.match(bucket):
        return "a bucket name is a lowercase letter, then letters, digits or _"
    return None


def open_bucket_dirs(root: Path, bucket: str, parents: list[str], *, create: bool) -> int:
    """A descriptor for the key's directory, walked from the bucket without
    following a symbolic link at any step."""
    fd = os.open(root, _DIR_FLAGS)
    try:
        for i, name in enumerate([bucket, *parents]):
            nxt = _open_dir_at(fd, name, create=create and i > 0)  # buckets are registered
            os.close(fd)
            fd = nxt
    except BaseException:
        os.close(fd)
        raise
    return fd


def _open_dir_at(fd: int, name: str, *, create: bool) -> int:
    try:
        try:
            return os.open(name, _DIR_FLAGS | os.O_NOFOLLOW, dir_fd=fd)
        except FileNotFoundError:
            if not create:
                raise ObjectMissing from None
            with contextlib.suppress(FileExistsError):  # another write made it meanwhile
                os.mkdir(name, 0o700, dir_fd=fd)
            return os.open(name, _DIR_FLAGS | os.O_NOFOLLOW, dir_fd=fd)
    except OSError as exc:
        # ELOOP: a symbolic link; ENOTDIR: a file where a directory should be.
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise ObjectUnsafe from None
        raise


def read_object_file(root: Path, bucket: str, key: str, max_bytes: int) -> bytes:
    """The bytes of ``key`` in ``bucket`` under ``root``, never through a link."""
    *parents, name = key.split("/")
    dir_fd = open_bucket_dirs(root, bucket, parents, create=False)
    try:
        try:
            # O_NONBLOCK: a FIFO planted in a bucket must not hang the reader.
            fd = os.open(
                name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=dir_fd
            )
        except FileNotFoundError:
            raise ObjectMissing from None
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.EISDIR, errno.ENXIO):
                raise ObjectUnsafe from None
            raise
    finally:
        os.close(dir_fd)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ObjectUnsafe
        if st.st_size > max_bytes:
            raise ObjectTooBig
        chunks, total = [], 0
        while chunk := os.read(fd, _CHUNK):
            total += len(chunk)
            if total > max_bytes:  # grew while we read
                raise ObjectTooBig
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


@dataclass(frozen=True)
class BucketObject:
    key: str
    size: int
    sha256: str
    modified: str  # ISO 8601, UTC


def list_object_files(root: Path, bucket: str) -> list[BucketObject]:
    """Every regular file under the bucket whose path is a valid key, sorted by key.
    Links, special files and dot names (a write's temporary file) are skipped,
    never followed."""
    out: list[BucketObject] = []
    top = open_bucket_dirs(root, bucket, [], create=False)

    def walk(dir_fd: int, prefix: str, depth: int) -> None:
        for name in sorted(os.listdir(dir_fd)):
            key = f"{prefix}{name}"
            if key_problem(key) is not None:
                continue
            try:
                st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
            except FileNotFoundError:  # removed meanwhile
                continue
            if stat.S_ISDIR(st.st_mode) and depth < MAX_KEY_DEPTH:
                try:
                    sub = os.open(name, _DIR_FLAGS | os.O_NOFOLLOW, dir_fd=dir_fd)
                except OSError:
                    continue
                try:
                    walk(sub, key + "/", depth + 1)
                finally:
                    os.close(sub)
            elif stat.S_ISREG(st.st_mode):
                entry = _describe(dir_fd, name, key)
                if entry is not None:
                    out.append(entry)

    try:
        walk(top, "", 1)
    finally:
        os.close(top)
    return sorted(out, key=lambda o: o.key)


def _describe(dir_fd: int, name: str, key: str) -> BucketObject | None:
    try:
        fd = os.open(
            name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=dir_fd
        )
    except OSError:  # swapped for a link or removed meanwhile
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return None
        h = hashlib.sha256()
        while chunk := os.read(fd, _CHUNK):
            h.update(chunk)
    finally:
        os.close(fd)
    modified = datetime.fromtimestamp(st.st_mtime, UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    return BucketObject(key, st.st_size, h.hexdigest(), modified)


@dataclass
class StagedObject:
    """A temporary file beside its target: written a piece at a time, fsync'd
    (:meth:`finish`), then renamed into place once its event is recorded."""

    dir_fd: int
    temp: str
    name: str
    fd: int | None = None

    def write(self, data: bytes) -> None:
        assert self.fd is not None
        view = memoryview(data)
        while view:
            view = view[os.write(self.fd, view) :]

    def finish(self) -> None:
        assert self.fd is not None
        fd, self.fd = self.fd, None
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def commit(self) -> None:
        try:
            os.replace(self.temp, self.name, src_dir_fd=self.dir_fd, dst_dir_fd=self.dir_fd)
            os.fsync(self.dir_fd)
        finally:
            os.close(self.dir_fd)

    def discard(self) -> None:
        try:
            if self.fd is not None:
                os.close(self.fd)
                self.fd = None
            os.unlink(self.temp, dir_fd=self.dir_fd)
        except FileNotFoundError:
            pass
        finally:
            os.close(self.dir_fd)


def stage_object(root: Path, bucket: str, key: str) -> StagedObject:
    """An open, empty temporary file beside the object ``key`` names."""
    *parents, name = key.split("/")
    dir_fd = open_bucket_dirs(root, bucket, parents, create=True)
    try:
        try:
            st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        except FileNotFoundError:
            pass
        else:
            if not stat.S_ISREG(st.st_mode):
                raise ObjectUnsafe
        # Keys never start with '.', so no key can name a temporary file.
        temp = f".tmp-{secrets.token_hex(8)}"
        fd = os.open(
            temp,
            os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
            0o600,
            dir_fd=dir_fd,
        )
    except BaseException:
        os.close(dir_fd)
        raise
    return StagedObject(dir_fd, temp, name, fd)
