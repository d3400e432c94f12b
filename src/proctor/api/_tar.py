"""Unpack an uploaded artifact (a tar stream, optionally gzip) into a private directory.

Checked before anything is written: regular files, directories and symlinks only
(no hard links, devices or FIFOs), no absolute or ``..`` names, and at most
``max_files`` members and ``max_bytes`` of content. The uncompressed stream is
counted as it is read, so a small gzip that inflates to gigabytes stops at the
limit instead of filling the disk. Python's ``data`` extraction filter then
refuses any link that would point outside the directory.
"""

from __future__ import annotations

import gzip
import io
import tarfile
from pathlib import Path, PurePosixPath
from typing import BinaryIO

from proctor.api._errors import ApiError
from proctor.errors import UsageError

# Tar headers and padding on top of the content: 1 KiB per member is generous, and
# the archive's end is padded to a 10 KiB record.
_OVERHEAD_PER_MEMBER = 1024
_OVERHEAD = 20 * 1024


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
    head = upload.read(2)
    upload.seek(0)
    stream: BinaryIO = upload
    if head == b"\x1f\x8b":
        stream = gzip.GzipFile(fileobj=upload, mode="rb")  # type: ignore[assignment]
    counted = io.BufferedReader(
        _Counted(stream, max_bytes + _OVERHEAD_PER_MEMBER * max_files + _OVERHEAD)
    )
    count = 0
    total = 0
    try:
        with tarfile.open(fileobj=counted, mode="r|") as tar:
            for member in tar:
                count += 1
                if count > max_files:
                    raise ApiError(413, "too_large", f"the artifact has over {max_files} files")
                name = PurePosixPath(member.name)
                if name.is_absolute() or ".." in name.parts:
                    raise UsageError(f"the archive entry {member.name!r} leaves the artifact")
                if not (member.isfile() or member.isdir() or member.issym()):
                    raise UsageError(
                        f"the archive entry {member.name!r} is not a file, directory or symlink"
                    )
                total += member.size if member.isfile() else 0
                if total > max_bytes:
                    raise ApiError(413, "too_large", "the artifact is larger than the limit")
                tar.extract(member, dest, filter="data")
    except (tarfile.TarError, EOFError, gzip.BadGzipFile, OSError) as exc:
        if isinstance(exc, tarfile.FilterError):
            raise UsageError(f"the archive entry is refused: {exc}") from exc
        raise UsageError("the upload is not a readable tar archive") from exc
    if count == 0:
        raise UsageError("the upload is an empty archive")
