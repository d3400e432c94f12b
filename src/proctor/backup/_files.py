"""The home's files a backup holds, copied and hashed in one read each.

A backup is as sensitive as the home (it holds its private keys): every directory
it makes is 0700, every file 0600. Links and special files are never followed nor
copied, only named.
"""

from __future__ import annotations

import hashlib
import os
import stat
from collections.abc import Iterator
from pathlib import Path

from proctor.backup._manifest import FileEntry
from proctor.errors import UsageError

_CHUNK = 1 << 20
#: The home's top-level entries a backup copies as files: the configuration, the
#: keys (checkpoint key, runtime key), the tenants' egress CA keys, the artifacts'
#: blobs, the buckets and the runs' outputs (stdout, stderr, receipts).
KEY_DIRS = ("keys", "ca")
DATA = ("config.json", "blobs", "buckets", "runs")
#: What is the home's but not worth a copy: the store (copied by its engine),
#: serve's lock, a run's CA bundle and code copy and an upload's staging (made
#: again, or gone, when the run or upload ends), and an earlier restore's record
#: (a restore of this backup writes its own).
_TRANSIENT = ("serve.lock", "ca-bundles", "blobs/tmp", "restored.json")
_STORE_FILES = ("proctor.db", "proctor.db-wal", "proctor.db-shm", "proctor.db-journal")


def make_dir(path: Path) -> None:
    """``path`` and every missing parent, each 0700 (``mkdir(parents=True)`` would
    give the parents the umask's mode)."""
    if path.is_dir():
        return
    make_dir(path.parent)
    try:
        path.mkdir(mode=0o700)
    except FileExistsError:
        if not path.is_dir():
            raise
    os.chmod(path, 0o700)


def copy_hashed(src: Path, dst: Path) -> FileEntry:
    """Copy the regular file ``src`` to the new file ``dst`` (0600, fsync'd) and
    return the digest of the bytes copied (not of ``src`` read again: a file
    written meanwhile is recorded as it was copied)."""
    fd = os.open(src, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise UsageError(f"{src} is not a regular file")
        make_dir(dst.parent)
        out = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        digest = hashlib.sha256()
        size = 0
        try:
            while chunk := os.read(fd, _CHUNK):
                digest.update(chunk)
                size += len(chunk)
                view = memoryview(chunk)
                while view:
                    view = view[os.write(out, view) :]
            os.fsync(out)
        finally:
            os.close(out)
    finally:
        os.close(fd)
    return FileEntry(digest.hexdigest(), size)


def hash_file(path: Path) -> FileEntry:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise UsageError(f"{path} is not a regular file")
        digest = hashlib.sha256()
        size = 0
        while chunk := os.read(fd, _CHUNK):
            digest.update(chunk)
            size += len(chunk)
    finally:
        os.close(fd)
    return FileEntry(digest.hexdigest(), size)


def home_files(home: Path, keys: bool) -> tuple[list[str], list[str]]:
    """The home's files a backup copies (paths relative to the home, sorted) and
    what it leaves out, named (a top-level entry, a link, a special file)."""
    wanted = (*DATA, *(KEY_DIRS if keys else ()))
    files: list[str] = []
    skipped: list[str] = []
    for entry in sorted(os.listdir(home)):
        if entry in _STORE_FILES or entry in _TRANSIENT:
            continue
        if entry not in wanted:
            if entry in KEY_DIRS:
                skipped.append(f"{entry}/ (private keys: --no-keys)")
            else:
                skipped.append(entry)
            continue
        for rel, kind in _walk(home, entry):
            if kind == "file":
                files.append(rel)
            elif kind != "transient":
                skipped.append(f"{rel} ({kind})")
    return sorted(files), skipped


def _walk(home: Path, rel: str) -> Iterator[tuple[str, str]]:
    st = os.lstat(home / rel)
    if rel.startswith("buckets/") and rel.rpartition("/")[2].startswith(".tmp-"):
        # An upload being staged (governance.stage_object): no key names it.
        yield rel, "transient"
        return
    if stat.S_ISREG(st.st_mode):
        yield rel, "file"
        return
    if stat.S_ISLNK(st.st_mode):
        yield rel, "a link, not followed"
        return
    if not stat.S_ISDIR(st.st_mode):
        yield rel, "not a regular file"
        return
    if rel in _TRANSIENT or _is_run_code(rel):
        yield rel, "transient"
        return
    for name in sorted(os.listdir(home / rel)):
        yield from _walk(home, f"{rel}/{name}")


def _is_run_code(rel: str) -> bool:
    # runs/<id>/code: a run's copy of its approved code, made from the blobs at start.
    parts = rel.split("/")
    return len(parts) == 3 and parts[0] == "runs" and parts[2] == "code"
