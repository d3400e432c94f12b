"""Uploaded artifact archives: refused, or unpacked with nothing written outside."""

from __future__ import annotations

import io
import shutil
import tarfile
import tempfile
from pathlib import Path

import _harness

_harness.instrumented("proctor.api._tar")

from tests.fuzz._oracle_archive import check_extract  # noqa: E402

SCRATCH = Path(tempfile.mkdtemp(prefix="proctor-fuzz-tar-"))


def _tar(*entries: tuple[str, bytes, bytes, str]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, kind, data, link in entries:
            info = tarfile.TarInfo(name)
            info.type = kind
            info.linkname = link
            info.size = len(data) if kind == tarfile.REGTYPE else 0
            tar.addfile(info, io.BytesIO(data) if kind == tarfile.REGTYPE else None)
    return buf.getvalue()


SEEDS = [
    _tar(
        ("proctor.toml", tarfile.REGTYPE, b"[artifact]\n", ""),
        ("a/b.py", tarfile.REGTYPE, b"1", ""),
    ),
    _tar(
        ("sub", tarfile.DIRTYPE, b"", ""),
        ("sub/up", tarfile.SYMTYPE, b"", ".."),
        ("m", tarfile.SYMTYPE, b"", "sub/up/.."),
    ),
    _tar(("l", tarfile.SYMTYPE, b"", "x"), ("l/f", tarfile.REGTYPE, b"x", "")),
]


def test_one_input(data: bytes) -> None:
    base = Path(tempfile.mkdtemp(dir=SCRATCH))
    try:
        check_extract(data, base, max_bytes=64 * 1024, max_files=64)
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    try:
        _harness.run(test_one_input, SEEDS)
    finally:
        shutil.rmtree(SCRATCH, ignore_errors=True)
