"""Artifact uploads are unpacked only when every entry is safe and within limits."""

from __future__ import annotations

import gzip
import io
import tarfile
from pathlib import Path

import pytest

from proctor.api._errors import ApiError
from proctor.api._tar import extract_artifact
from proctor.errors import UsageError


def _tar(*entries: tuple[tarfile.TarInfo, bytes], gz: bool = False) -> io.BytesIO:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz" if gz else "w") as tar:
        for info, data in entries:
            info.size = len(data) if info.isfile() else 0
            tar.addfile(info, io.BytesIO(data) if info.isfile() else None)
    buf.seek(0)
    return buf


def _file(name: str, data: bytes = b"x") -> tuple[tarfile.TarInfo, bytes]:
    return tarfile.TarInfo(name), data


def _kind(name: str, kind: bytes, link: str = "") -> tuple[tarfile.TarInfo, bytes]:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.linkname = link
    return info, b""


def test_plain_and_gzip(tmp_path: Path) -> None:
    for gz in (False, True):
        dest = tmp_path / str(gz)
        dest.mkdir()
        extract_artifact(_tar(_file("a/b.py", b"print(1)"), gz=gz), dest, max_bytes=100,
                         max_files=10)  # fmt: skip
        assert (dest / "a" / "b.py").read_bytes() == b"print(1)"


@pytest.mark.parametrize(
    "entry",
    [
        _file("/etc/cron.d/x"),
        _file("../x"),
        _file("a/../../x"),
        _kind("dev", tarfile.CHRTYPE),
        _kind("fifo", tarfile.FIFOTYPE),
        _kind("hard", tarfile.LNKTYPE, "/etc/passwd"),
        _kind("up", tarfile.SYMTYPE, "../../etc/passwd"),
        _kind("abs", tarfile.SYMTYPE, "/etc/passwd"),
    ],
)
def test_unsafe_entries_refused(tmp_path: Path, entry: tuple[tarfile.TarInfo, bytes]) -> None:
    with pytest.raises(UsageError):
        extract_artifact(_tar(entry), tmp_path, max_bytes=100, max_files=10)
    assert not (tmp_path.parent / "x").exists()


def test_limits(tmp_path: Path) -> None:
    with pytest.raises(ApiError, match="files"):
        extract_artifact(_tar(*(_file(f"f{i}") for i in range(5))), tmp_path, max_bytes=100,
                         max_files=3)  # fmt: skip
    with pytest.raises(ApiError, match="larger"):
        extract_artifact(_tar(_file("big", b"x" * 200)), tmp_path, max_bytes=100, max_files=3)
    # A gzip bomb: the inflated stream is counted, whatever the headers claim.
    bomb = io.BytesIO(gzip.compress(b"\0" * (4 << 20)))
    with pytest.raises((ApiError, UsageError)):
        extract_artifact(bomb, tmp_path, max_bytes=1000, max_files=3)


def test_not_a_tar(tmp_path: Path) -> None:
    for data in (b"", b"hello", b"\x1f\x8bnot gzip"):
        with pytest.raises(UsageError):
            extract_artifact(io.BytesIO(data), tmp_path, max_bytes=100, max_files=3)
