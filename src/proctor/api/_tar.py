"""Unpack an uploaded artifact (a tar stream, optionally gzip) into a private directory.

tarfile only reads the archive; this module writes every entry itself, relative to
directory descriptors opened with ``O_NOFOLLOW``, files created with ``O_EXCL``:
no path is ever resolved through a link, whatever the archive put there before.
(tarfile's own ``data`` filter is not enough: it judges links with
``os.path.realpath``, which stops resolving past ``PATH_MAX`` — CVE-2025-4517 — so
an archive of long names and links could write outside the directory.)

Refused, each with a message naming the entry: anything but regular files,
directories and symlinks (hard links, devices, FIFOs, sparse files); names that are
absolute, hold ``..``, a NUL or control character, are not UTF-8, nest deeper than
``MAX_DEPTH`` directories or are longer than ``MAX_PATH_BYTES``; two entries with
one name; a path through a symlink or a file; symlinks that are absolute or lead
outside the directory, followed through the links the archive holds as the kernel
would. Limits: ``max_files`` entries, ``max_bytes`` of file content, and the
uncompressed stream counted as it is read, so a small gzip that inflates to
gigabytes stops at the limit whatever its headers claim (an absolute cap, so no
compression ratio is needed). Files are 0644, or 0755 if executable: setuid,
setgid and sticky bits never reach the disk.
"""

from __future__ import annotations

import contextlib
import gzip
import io
import os
import tarfile
import zlib
from pathlib import Path
from typing import IO, BinaryIO

from proctor.api._errors import ApiError
from proctor.errors import UsageError
from proctor.governance import LinkLoop, LinkOutside, PathKind, resolve_inside

# The same bounds Artifacts.submit applies to a directory, checked here before
# anything is written.
MAX_DEPTH = 64
MAX_PATH_BYTES = 1024
# Tar headers and padding on top of the content: 1 KiB per member is generous, and
# the archive's end is padded to a 10 KiB record.
_OVERHEAD_PER_MEMBER = 1024
_OVERHEAD = 20 * 1024
_CHUNK = 1 << 16
_FILE_TYPES = (tarfile.REGTYPE, tarfile.AREGTYPE, tarfile.CONTTYPE)
_KINDS = {
    tarfile.LNKTYPE: "a hard link",
    tarfile.CHRTYPE: "a character device",
    tarfile.BLKTYPE: "a block device",
    tarfile.FIFOTYPE: "a FIFO",
    tarfile.GNUTYPE_SPARSE: "a sparse file",
}
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW


class _Counted(io.RawIOBase):
    def __init__(self, inner: BinaryIO, limit: int) -> None:
        self._inner = inner
        self._left = limit

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: memoryview) -> int:  # type: ignore[override]
        data = self._inner.read(min(len(buffer), self._left + 1))
        if len(data) > self._left:
            raise ApiError(413, "too_large", "the artifact is larger than the limit unpacked")
        self._left -= len(data)
        buffer[: len(data)] = data
        return len(data)


def extract_artifact(upload: BinaryIO, dest: Path, *, max_bytes: int, max_files: int) -> None:
    """Unpack the tar (or tar.gz) ``upload`` into the existing, empty directory ``dest``."""
    head = upload.read(2)
    upload.seek(0)
    stream: BinaryIO = upload
    if head == b"\x1f\x8b":
        stream = gzip.GzipFile(fileobj=upload, mode="rb")  # type: ignore[assignment]
    counted = io.BufferedReader(
        _Counted(stream, max_bytes + _OVERHEAD_PER_MEMBER * max_files + _OVERHEAD)
    )
    root = os.open(dest, _DIR_FLAGS)
    try:
        _Extraction(root, max_bytes, max_files).run(counted)
    finally:
        os.close(root)


class _Extraction:
    def __init__(self, root: int, max_bytes: int, max_files: int) -> None:
        self.root = root
        self.max_bytes = max_bytes
        self.max_files = max_files
        self.count = 0
        self.total = 0
        # What each path written so far is: "dir", "file" or "link"; () is dest.
        self.kinds: dict[tuple[str, ...], PathKind] = {(): "dir"}
        self.links: dict[tuple[str, ...], str] = {}

    def run(self, stream: BinaryIO) -> None:
        try:
            self._run(stream)
        except BaseException:
            # Refused: the links go, so that what is left in the directory (until the
            # caller removes it) cannot lead anywhere; files and directories are inert.
            self._remove_links()
            raise

    def _run(self, stream: BinaryIO) -> None:
        try:
            with tarfile.open(fileobj=stream, mode="r|") as tar:
                for member in tar:
                    self._member(tar, member)
        except (tarfile.TarError, EOFError, zlib.error, OSError, ValueError) as exc:
            # OSError here is the reading side (gzip's BadGzipFile among them): every
            # write below turns its own OSError into a UsageError naming the entry.
            raise UsageError("the upload is not a readable tar archive") from exc
        if self.count == 0:
            raise UsageError("the upload is an empty archive")
        # Checked once everything is written: a link can lead out only through
        # one that came later in the archive.
        for path, target in self.links.items():
            self._check_link(path, target)

    def _remove_links(self) -> None:
        for path in self.links:
            with contextlib.suppress(OSError, UsageError):
                parent = self._open_dir(path[:-1], "/".join(path))
                try:
                    os.unlink(path[-1], dir_fd=parent)
                finally:
                    _close(parent, self.root)

    def _member(self, tar: tarfile.TarFile, member: tarfile.TarInfo) -> None:
        self.count += 1
        if self.count > self.max_files:
            raise ApiError(413, "too_large", f"the artifact has over {self.max_files} files")
        name = member.name
        parts = _parts(name)
        if member.isdir():
            if parts:
                self._claim(parts, "dir", name)
                os.close(self._open_dir(parts, name))
            return
        if not parts:
            raise UsageError(f"the archive entry {name!r} is not a file name")
        if member.type in _FILE_TYPES:
            self.total += member.size
            if self.total > self.max_bytes:
                raise ApiError(413, "too_large", "the artifact is larger than the limit")
            self._claim(parts, "file", name)
            self._write_file(tar, member, parts)
        elif member.issym():
            target = member.linkname
            _check_target(name, target)
            self._claim(parts, "link", name)
            parent = self._open_dir(parts[:-1], name)
            try:
                os.symlink(target, parts[-1], dir_fd=parent)
            except OSError as exc:
                raise UsageError(f"the archive entry {name!r} cannot be written: {exc}") from exc
            finally:
                _close(parent, self.root)
            self.links[parts] = target
        else:
            kind = _KINDS.get(member.type, f"of tar type {member.type!r}")
            raise UsageError(
                f"the archive entry {name!r} is {kind}, not a file, directory or symlink"
            )

    def _claim(self, parts: tuple[str, ...], kind: PathKind, name: str) -> None:
        """Record ``parts`` as ``kind``, refusing a path through a link or a file, and
        a second entry with the same name (only a directory may be named twice)."""
        for i in range(1, len(parts)):
            above = self.kinds.get(parts[:i])
            if above not in (None, "dir"):
                raise UsageError(
                    f"the archive entry {name!r} goes through {'/'.join(parts[:i])!r}, "
                    f"which is a {'symlink' if above == 'link' else 'file'}"
                )
        existing = self.kinds.get(parts)
        if existing is not None and not (existing == kind == "dir"):
            raise UsageError(f"the archive has two entries named {'/'.join(parts)!r}")
        for i in range(1, len(parts)):
            self.kinds[parts[:i]] = "dir"
        self.kinds[parts] = kind

    def _open_dir(self, parts: tuple[str, ...], name: str) -> int:
        """A descriptor of the directory ``parts`` (made if missing), never via a link."""
        fd = self.root
        try:
            for part in parts:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(part, 0o755, dir_fd=fd)
                sub = os.open(part, _DIR_FLAGS, dir_fd=fd)
                _close(fd, self.root)
                fd = sub
        except OSError as exc:
            _close(fd, self.root)
            raise UsageError(f"the archive entry {name!r} cannot be written: {exc}") from exc
        return fd

    def _write_file(
        self, tar: tarfile.TarFile, member: tarfile.TarInfo, parts: tuple[str, ...]
    ) -> None:
        source = tar.extractfile(member)
        assert source is not None  # a regular file always has content
        mode = 0o755 if member.mode & 0o111 else 0o644
        parent = self._open_dir(parts[:-1], member.name)
        try:
            try:
                flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                fd = os.open(parts[-1], flags, 0o600, dir_fd=parent)
            except OSError as exc:
                raise UsageError(
                    f"the archive entry {member.name!r} cannot be written: {exc}"
                ) from exc
            try:
                os.fchmod(fd, mode)
                self._copy(source, fd, member)
            except BaseException:
                # Half a file is no file: the archive ended, or the disk did.
                with contextlib.suppress(OSError):
                    os.unlink(parts[-1], dir_fd=parent)
                raise
            finally:
                os.close(fd)
        finally:
            _close(parent, self.root)

    @staticmethod
    def _copy(source: IO[bytes], fd: int, member: tarfile.TarInfo) -> None:
        written = 0
        while chunk := source.read(_CHUNK):
            view = memoryview(chunk)
            try:
                while view:
                    view = view[os.write(fd, view) :]
            except OSError as exc:
                raise UsageError(
                    f"the archive entry {member.name!r} cannot be written: {exc.strerror}"
                ) from exc
            written += len(chunk)
        if written != member.size:
            raise UsageError(f"the archive entry {member.name!r} is truncated")

    def _check_link(self, path: tuple[str, ...], target: str) -> None:
        """Follow the link through what was written, as the kernel would: it must
        never climb above the directory (a dangling link is Artifacts.submit's to refuse)."""
        name = "/".join(path)
        try:
            resolve_inside(path[:-1], target, self._kind_of, self.links.__getitem__)
        except LinkOutside:
            raise UsageError(
                f"the archive entry {name!r} is a symlink leading outside the artifact ({target!r})"
            ) from None
        except LinkLoop:
            raise UsageError(f"the archive entry {name!r}: too many levels of symlinks") from None

    def _kind_of(self, parts: tuple[str, ...]) -> PathKind | None:
        return self.kinds.get(parts)


def _parts(name: str) -> tuple[str, ...]:
    try:
        encoded = name.encode("utf-8")
    except UnicodeEncodeError:
        raise UsageError(f"the archive entry {name!r} has a name that is not UTF-8") from None
    if len(encoded) > MAX_PATH_BYTES:
        raise UsageError(
            f"the archive entry {name[:80]!r}... is longer than {MAX_PATH_BYTES} bytes"
        )
    if not name.isprintable():
        raise UsageError(f"the archive entry {name!r} has a control character in its name")
    if name.startswith("/"):
        raise UsageError(f"the archive entry {name!r} leaves the artifact (an absolute path)")
    parts = tuple(p for p in name.split("/") if p not in ("", "."))
    if ".." in parts:
        raise UsageError(f"the archive entry {name!r} leaves the artifact ('..')")
    if len(parts) > MAX_DEPTH + 1:
        raise UsageError(f"the archive entry {name[:80]!r} nests deeper than {MAX_DEPTH} levels")
    return parts


def _check_target(name: str, target: str) -> None:
    if not target or not target.isprintable():
        raise UsageError(f"the archive entry {name!r} is a symlink with an invalid target")
    try:
        target.encode("utf-8")
    except UnicodeEncodeError:
        raise UsageError(
            f"the archive entry {name!r} is a symlink with an invalid target"
        ) from None
    if target.startswith("/"):
        raise UsageError(
            f"the archive entry {name!r} is a symlink to the absolute path {target!r}",
            hint="only relative links to files inside the artifact are kept",
        )
    if len(target.encode()) > MAX_PATH_BYTES:
        raise UsageError(f"the archive entry {name!r} is a symlink with too long a target")


def _close(fd: int, keep: int) -> None:
    if fd != keep:
        os.close(fd)
