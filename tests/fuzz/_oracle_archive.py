"""Oracles for artifact archives and directories, shared by the hypothesis tests and the
atheris harness.

An upload is unpacked into ``<base>/p1/p2/dest`` beside files that must not change
(``<base>/outside.txt``, ``<base>/victim/secret``, ``<base>/p1/keep``). Property:
refused with a ProctorError naming the problem, or accepted; either way nothing around
``dest`` changed, and inside it there is nothing but directories, files of mode 0644
or 0755 with one link each, and symlinks that stay inside. An accepted archive is
unpacked faithfully: every file has the content the archive gave it.
"""

from __future__ import annotations

import hashlib
import io
import os
import stat
import tarfile
from pathlib import Path

from proctor.api._tar import extract_artifact
from proctor.errors import ProctorError


def prepare(base: Path) -> Path:
    """The tree around the destination; returns the (empty) destination."""
    (base / "victim").mkdir(parents=True)
    (base / "victim" / "secret").write_text("do not touch\n")
    (base / "outside.txt").write_text("outside\n")
    dest = base / "p1" / "p2" / "dest"
    dest.mkdir(parents=True)
    (base / "p1" / "keep").write_text("keep\n")
    return dest


def snapshot(root: Path, skip: Path) -> dict[str, tuple[object, ...]]:
    """Every entry under ``root`` but ``skip``'s subtree: type, mode, size, content, target."""
    out: dict[str, tuple[object, ...]] = {}
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        here = Path(dirpath)
        dirnames[:] = [d for d in dirnames if here / d != skip]
        for name in dirnames + filenames:
            path = here / name
            st = os.lstat(path)
            digest = link = None
            if stat.S_ISREG(st.st_mode):
                digest = hashlib.sha256(path.read_bytes()).hexdigest()
            elif stat.S_ISLNK(st.st_mode):
                link = os.readlink(path)
            out[str(path.relative_to(root))] = (st.st_mode, st.st_size, digest, link)
    return out


def check_inside(dest: Path) -> None:
    """Nothing in ``dest`` a sandboxed reader of it could use to reach anything else."""
    real_dest = os.path.realpath(dest)
    for dirpath, dirnames, filenames in os.walk(dest, followlinks=False):
        for name in dirnames + filenames:
            path = Path(dirpath) / name
            st = os.lstat(path)
            mode = stat.S_IMODE(st.st_mode)
            if stat.S_ISREG(st.st_mode):
                assert mode in (0o644, 0o755), f"{path}: mode {oct(mode)}"
                assert st.st_nlink == 1, f"{path} is a hard link"
            elif stat.S_ISDIR(st.st_mode):
                assert not mode & (stat.S_ISUID | stat.S_ISGID), f"{path}: mode {oct(mode)}"
            elif stat.S_ISLNK(st.st_mode):
                target = os.readlink(path)
                assert not target.startswith("/"), f"{path} -> {target}"
                resolved = os.path.realpath(path)
                assert resolved == real_dest or resolved.startswith(real_dest + "/"), (
                    f"{path} -> {target} resolves to {resolved}, outside"
                )
            else:
                raise AssertionError(f"{path} is a special file ({oct(st.st_mode)})")


def check_extract(data: bytes, base: Path, *, max_bytes: int, max_files: int) -> Path | None:
    """Unpack ``data`` beside the fixed tree in ``base``; the destination if accepted."""
    dest = prepare(base)
    before = snapshot(base, dest)
    try:
        extract_artifact(io.BytesIO(data), dest, max_bytes=max_bytes, max_files=max_files)
        accepted = True
    except ProctorError as exc:
        assert isinstance(exc.message, str) and exc.message.strip(), repr(exc)
        accepted = False
    assert snapshot(base, dest) == before, "something outside the destination changed"
    check_inside(dest)
    if accepted:
        _check_faithful(data, dest, max_bytes=max_bytes, max_files=max_files)
    return dest if accepted else None


def _check_faithful(data: bytes, dest: Path, *, max_bytes: int, max_files: int) -> None:
    """What was accepted is what the archive holds (as tarfile itself reads it)."""
    count = total = 0
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:*") as tar:
        for member in tar:
            count += 1
            path = dest.joinpath(*(p for p in member.name.split("/") if p not in ("", ".")))
            if member.isfile():
                total += member.size
                source = tar.extractfile(member)
                assert source is not None
                assert path.read_bytes() == source.read(), f"{member.name} differs"
                assert stat.S_IMODE(path.stat().st_mode) == (
                    0o755 if member.mode & 0o111 else 0o644
                )
            elif member.issym():
                assert os.readlink(path) == member.linkname
            elif member.isdir():
                assert path.is_dir() and not path.is_symlink()
    assert 0 < count <= max_files
    assert total <= max_bytes
