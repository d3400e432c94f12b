"""Artifacts: directories of code with a manifest, stored content-addressed.

An artifact's id is its digest: ``sha256:`` + SHA-256 of the RFC 8785 form of

    {"format": "proctor.artifact/1",
     "files": [{"path", "mode", "sha256", "size"} | {"path", "link"}, ...],
     "manifest": Manifest.to_json()}

with files sorted by path. Modes are normalized to 0644 or 0755 (only the
executable bit is code; the rest is the submitter's umask), so the same code
has the same digest on every machine, and one changed byte, executable bit,
link target or manifest entry gives a new digest, which needs new approvals.

File contents live in a blob directory, one read-only file per SHA-256
(``<root>/sha256/ab/ab12...``), written atomically and fsync'd before the
store row that names them commits. Blobs are verified again every time they
are read, so a blob changed on disk is an error, never code that runs.

What a submission refuses (each with a message naming the path): symlinks
that leave the directory, dangle, or are absolute; device files, FIFOs and
sockets; more than ``max_files`` entries or ``max_bytes`` of content; names
that are not UTF-8 or hold control characters. Version-control metadata
(``.git``, ``.hg``, ``.svn``, ``.bzr``) and ``__pycache__`` are skipped:
they are not code the approver reviews, and bytecode caches differ between
two checkouts of the same source. Empty directories are not kept.
"""

from __future__ import annotations

import builtins
import contextlib
import difflib
import hashlib
import json
import os
import posixpath
import secrets
import shutil
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from proctor.errors import AlreadyExists, NotFound, UsageError, VerificationFailed
from proctor.governance._manifest import (
    MANIFEST_FILE,
    Manifest,
    check_entrypoint,
    parse_manifest,
)
from proctor.governance._paths import LinkLoop, LinkOutside, PathKind, resolve_inside
from proctor.ledger import Actor, EventDraft, Ledger, canonical_json, utc_now
from proctor.store import Conn, Store

FORMAT = "proctor.artifact/1"
DEFAULT_MAX_BYTES = 64 * 1024 * 1024
DEFAULT_MAX_FILES = 10_000
SKIPPED_NAMES = frozenset({".git", ".hg", ".svn", ".bzr", "__pycache__"})
MAX_DEPTH = 64
MAX_PATH_BYTES = 1024
# Past this size a unified diff is more noise than review.
MAX_TEXT_DIFF_BYTES = 512 * 1024
_CHUNK = 1 << 16
_MIN_PREFIX = 4
_HEX = frozenset("0123456789abcdef")


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


@dataclass(frozen=True)
class Artifact:
    tenant: str
    digest: str
    name: str
    manifest: Manifest
    capabilities: dict[str, Any]
    capabilities_hash: str
    purpose: str
    author: str
    submitted_at: str
    size: int
    file_count: int

    def to_json(self) -> dict[str, Any]:
        return {
            "tenant": self.tenant,
            "digest": self.digest,
            "name": self.name,
            "manifest": self.manifest.to_json(),
            "capabilities_hash": self.capabilities_hash,
            "purpose": self.purpose,
            "author": self.author,
            "submitted_at": self.submitted_at,
            "size": self.size,
            "file_count": self.file_count,
        }


@dataclass(frozen=True)
class FileChange:
    """A file added, removed or changed between two artifacts.

    ``change`` is ``added``, ``removed`` or ``modified`` (content, mode or
    link target). ``diff`` is a unified diff for text files; ``binary``
    says the content is not text, so only sizes and hashes are shown.
    """

    path: str
    change: str
    old: ArtifactFile | None
    new: ArtifactFile | None
    binary: bool = False
    diff: str | None = None

    @property
    def summary(self) -> str:
        """One line for people: sizes and hashes where the content is not shown as text."""
        old, new = self.old, self.new
        if (old is not None and old.link is not None) or (new is not None and new.link is not None):
            return f"link {_entry(old)} -> {_entry(new)}"
        if old is not None and new is not None and old.sha256 == new.sha256:
            return f"mode {old.mode:04o} -> {new.mode:04o}"
        sizes = " -> ".join(f"{f.size} bytes" for f in (old, new) if f is not None)
        hashes = " -> ".join(f.sha256[:16] + "…" for f in (old, new) if f is not None)
        mode = ""
        if old is not None and new is not None and old.mode != new.mode:
            mode = f", mode {old.mode:04o} -> {new.mode:04o}"
        if self.binary:
            return f"binary, {sizes}, sha256 {hashes}{mode}"
        if self.diff is None:
            return f"too large to show as text, {sizes}, sha256 {hashes}{mode}"
        return f"text, {sizes}{mode}"

    def to_json(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "change": self.change,
            "old": self.old.to_json() if self.old else None,
            "new": self.new.to_json() if self.new else None,
            "binary": self.binary,
            "diff": self.diff,
            "summary": self.summary,
        }


def _entry(f: ArtifactFile | None) -> str:
    if f is None:
        return "(none)"
    return f"to {f.link}" if f.link is not None else f"(file, {f.size} bytes)"


@dataclass(frozen=True)
class CapabilityChange:
    """One line of the manifest's review.

    ``area``: name, purpose, entrypoint, dataset, table, column, access,
    egress, secret, bucket, limit or lifecycle. ``widens`` marks a change
    that lets the code do more than before (a new column, host, secret,
    write access, a larger limit, a new purpose): what an approver must not
    miss.
    """

    area: str
    subject: str
    change: str
    old: str | None
    new: str | None
    widens: bool
    #: The change in words, e.g. "adds egress to api.example.com:443".
    text: str = ""

    def to_json(self) -> dict[str, Any]:
        return {
            "area": self.area,
            "subject": self.subject,
            "change": self.change,
            "old": self.old,
            "new": self.new,
            "widens": self.widens,
            "text": self.text,
        }


@dataclass(frozen=True)
class ArtifactDiff:
    old: Artifact
    new: Artifact
    files: tuple[FileChange, ...]
    capabilities: tuple[CapabilityChange, ...]

    @property
    def widens(self) -> bool:
        return any(c.widens for c in self.capabilities)

    @property
    def same_capabilities(self) -> bool:
        return self.old.capabilities_hash == self.new.capabilities_hash

    def to_json(self) -> dict[str, Any]:
        return {
            "old": self.old.digest,
            "new": self.new.digest,
            "same_capabilities": self.same_capabilities,
            "widens": self.widens,
            "capabilities": [c.to_json() for c in self.capabilities],
            "files": [f.to_json() for f in self.files],
        }


def artifact_digest(files: list[ArtifactFile], manifest: Manifest) -> str:
    """The content address of ``files`` (any order) with ``manifest``."""
    body = {
        "format": FORMAT,
        "files": [f.to_json() for f in sorted(files, key=lambda f: f.path)],
        "manifest": manifest.to_json(),
    }
    return "sha256:" + hashlib.sha256(canonical_json(body)).hexdigest()


# -- blobs -----------------------------------------------------------------


class _Blobs:
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
                    raise _TooLarge
                digest.update(chunk)
                _write_all(out, chunk)
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
    def open(self, f: ArtifactFile) -> Iterator[_VerifiedReader]:
        try:
            handle = self.path(f.sha256).open("rb")
        except OSError as exc:
            raise VerificationFailed(
                f"the stored content of {f.path} (sha256 {f.sha256}) is missing: {exc.strerror}"
            ) from exc
        with handle:
            yield _VerifiedReader(handle, f)

    def read(self, f: ArtifactFile) -> bytes:
        with self.open(f) as reader:
            parts = list(reader.chunks())
        return b"".join(parts)


class _VerifiedReader:
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


class _TooLarge(Exception):
    pass


def _write_all(fd: int, data: bytes) -> None:
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
class _Walk:
    root: Path
    blobs: _Blobs
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
            except _TooLarge:
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


# -- the component -----------------------------------------------------------


class Artifacts:
    """Submitted artifacts per tenant, their files, and the review view between two.

    ``submit`` records ``artifact.submit`` in the tenant's log in the same
    transaction as the row, so an artifact exists only if its submission is
    in the ledger. Submitting identical content again is the same artifact:
    it returns the existing one and records nothing (its author stays the
    first submitter).
    """

    def __init__(self, store: Store, ledger: Ledger, blob_root: Path) -> None:
        self._store = store
        self._ledger = ledger
        self._blobs = _Blobs(blob_root)

    # -- submit --------------------------------------------------------------

    def submit(
        self,
        tenant: str,
        directory: Path,
        author: Actor,
        *,
        max_bytes: int = DEFAULT_MAX_BYTES,
        max_files: int = DEFAULT_MAX_FILES,
    ) -> Artifact:
        self._require_tenant(tenant)
        if not directory.is_dir():
            raise UsageError(f"{directory} is not a directory")
        stage = self._blobs.staging()
        try:
            walk = _Walk(directory, self._blobs, stage, max_bytes, max_files)
            walk.run()
            manifest = self._manifest(walk)
            check_entrypoint(manifest, _FileSet(walk))
            files = [f for f, _ in walk.files.values()]
            files += [
                ArtifactFile(p, 0o777, hashlib.sha256(t.encode()).hexdigest(), len(t.encode()), t)
                for p, t in walk.links.items()
            ]
            files.sort(key=lambda f: f.path)
            digest = artifact_digest(files, manifest)
            existing = self.find(tenant, digest)
            if existing is not None:
                return existing
            for f, tmp in walk.files.values():
                self._blobs.commit(tmp, f.sha256)
        finally:
            shutil.rmtree(stage, ignore_errors=True)
        return self._record(tenant, digest, manifest, files, walk.total, author)

    def _manifest(self, walk: _Walk) -> Manifest:
        if MANIFEST_FILE in walk.links:
            raise UsageError(f"{MANIFEST_FILE} must be a regular file, not a symlink")
        if MANIFEST_FILE not in walk.files:
            raise UsageError(
                f"{walk.root} has no {MANIFEST_FILE}",
                hint="an artifact is a directory with a proctor.toml; see docs/artifacts.md",
            )
        # Parsed from the staged copy: the bytes the digest covers, not a re-read.
        _, tmp = walk.files[MANIFEST_FILE]
        return parse_manifest(tmp.read_bytes())

    def _record(
        self,
        tenant: str,
        digest: str,
        manifest: Manifest,
        files: list[ArtifactFile],
        size: int,
        author: Actor,
    ) -> Artifact:
        submitted_at = utc_now()
        caps_hash = manifest.capabilities_hash
        manifest_text = canonical_json(manifest.to_json()).decode("utf-8")

        def insert(conn: Conn) -> None:
            if conn.query_one(
                "SELECT 1 FROM artifacts WHERE tenant = ? AND digest = ?", (tenant, digest)
            ):
                raise AlreadyExists(f"artifact {digest} exists already in tenant {tenant!r}")
            conn.execute(
                "INSERT INTO artifacts (tenant, digest, name, manifest, capabilities_hash,"
                " purpose, author, submitted_at, size) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    tenant,
                    digest,
                    manifest.name,
                    manifest_text,
                    caps_hash,
                    manifest.purpose,
                    author.id,
                    submitted_at,
                    size,
                ),
            )
            # Files are keyed by digest alone: the same digest is the same files,
            # whichever tenant submitted it first.
            conn.executemany(
                "INSERT INTO artifact_files (digest, path, mode, sha256, size, link)"
                " VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT (digest, path) DO NOTHING",
                [(digest, f.path, f.mode, f.sha256, f.size, f.link) for f in files],
            )

        draft = EventDraft(
            author,
            "artifact.submit",
            f"artifact/{digest}",
            reason="submitted",
            artifact=digest,
            details={
                "digest": digest,
                "name": manifest.name,
                "purpose": manifest.purpose,
                "capabilities_hash": caps_hash,
                "capabilities": manifest.capabilities,
                "entrypoint": list(manifest.entrypoint),
                "files": len(files),
                "bytes": size,
            },
        )
        try:
            self._ledger.append(tenant, draft, hook=insert)
        except AlreadyExists:
            # Submitted concurrently by someone else: the same content, the same artifact.
            return self.get(tenant, digest)
        return Artifact(
            tenant,
            digest,
            manifest.name,
            manifest,
            manifest.capabilities,
            caps_hash,
            manifest.purpose,
            author.id,
            submitted_at,
            size,
            len(files),
        )

    def _require_tenant(self, tenant: str) -> None:
        with self._store.read() as conn:
            if conn.query_one("SELECT 1 FROM tenants WHERE name = ?", (tenant,)) is None:
                raise NotFound(
                    f"unknown tenant {tenant!r}", hint="`proctor tenant list` shows them"
                )

    # -- reading -------------------------------------------------------------

    _COLUMNS = (
        "a.tenant, a.digest, a.name, a.manifest, a.capabilities_hash, a.purpose, a.author,"
        " a.submitted_at, a.size,"
        " (SELECT count(*) FROM artifact_files f WHERE f.digest = a.digest)"
    )

    @staticmethod
    def _from_row(row: tuple[Any, ...]) -> Artifact:
        manifest = Manifest.from_json(json.loads(str(row[3])))
        return Artifact(
            tenant=str(row[0]),
            digest=str(row[1]),
            name=str(row[2]),
            manifest=manifest,
            capabilities=manifest.capabilities,
            capabilities_hash=str(row[4]),
            purpose=str(row[5]),
            author=str(row[6]),
            submitted_at=str(row[7]),
            size=int(row[8]),
            file_count=int(row[9]),
        )

    def find(self, tenant: str, digest: str) -> Artifact | None:
        """The artifact with exactly this digest in ``tenant``, or None."""
        with self._store.read() as conn:
            row = conn.query_one(
                f"SELECT {self._COLUMNS} FROM artifacts a WHERE a.tenant = ? AND a.digest = ?",  # noqa: S608
                (tenant, digest),
            )
        return self._from_row(row) if row else None

    def get(self, tenant: str, digest: str) -> Artifact:
        """The artifact named by its digest or a unique prefix of it (at least 4 hex digits)."""
        hexpart = digest.strip().lower().removeprefix("sha256:")
        if len(hexpart) < _MIN_PREFIX or not set(hexpart) <= _HEX or len(hexpart) > 64:
            raise UsageError(
                f"{digest!r} is not an artifact digest",
                hint=f"write sha256:<hex>, or at least {_MIN_PREFIX} hex digits of it",
            )
        with self._store.read() as conn:
            rows = conn.query(
                f"SELECT {self._COLUMNS} FROM artifacts a"  # noqa: S608
                " WHERE a.tenant = ? AND a.digest >= ? AND a.digest < ?"
                " ORDER BY a.digest LIMIT 6",
                (tenant, "sha256:" + hexpart, "sha256:" + hexpart + "g"),
            )
        if not rows:
            raise NotFound(
                f"no artifact {digest} in tenant {tenant!r}",
                hint="`proctor artifact list` shows them",
            )
        if len(rows) > 1:
            shown = ", ".join(str(r[1]) for r in rows[:5])
            count = "more than 5" if len(rows) > 5 else str(len(rows))
            raise UsageError(
                f"{digest!r} is ambiguous: {count} artifacts in tenant {tenant!r} start with it"
                f" ({shown}{', …' if len(rows) > 5 else ''})",
                hint="give more digits of the digest",
            )
        return self._from_row(rows[0])

    def list(self, tenant: str) -> list[Artifact]:
        with self._store.read() as conn:
            rows = conn.query(
                f"SELECT {self._COLUMNS} FROM artifacts a WHERE a.tenant = ?"  # noqa: S608
                " ORDER BY a.submitted_at, a.digest",
                (tenant,),
            )
        return [self._from_row(r) for r in rows]

    def files(self, tenant: str, digest: str) -> builtins.list[ArtifactFile]:
        """The artifact's entries, sorted by path (only if ``tenant`` has it)."""
        return self.stored_files(self.get(tenant, digest).digest)

    def stored_files(self, digest: str) -> builtins.list[ArtifactFile]:
        """The ``artifact_files`` rows of exactly ``digest``, as stored (unchecked)."""
        with self._store.read() as conn:
            rows = conn.query(
                "SELECT path, mode, sha256, size, link FROM artifact_files WHERE digest = ?"
                " ORDER BY path",
                (digest,),
            )
        return [
            ArtifactFile(
                str(r[0]), int(r[1]), str(r[2]), int(r[3]), None if r[4] is None else str(r[4])
            )
            for r in rows
        ]

    def read_file(self, tenant: str, digest: str, path: str) -> bytes:
        """One file's exact bytes, verified against its hash. ``path`` is the path as
        the artifact lists it; nothing is resolved against a filesystem."""
        if (
            not path
            or path.startswith("/")
            or any(part in ("", ".", "..") for part in path.split("/"))
            or not path.isprintable()
        ):
            raise UsageError(
                f"{path!r} is not a path inside the artifact",
                hint="give a path as `proctor artifact show --files` lists it, e.g. main.py",
            )
        artifact = self.get(tenant, digest)
        for f in self.stored_files(artifact.digest):
            if f.path == path:
                if f.link is not None:
                    raise UsageError(
                        f"{path} is a symlink to {f.link}", hint="read the file it points to"
                    )
                return self._blobs.read(f)
        raise NotFound(
            f"no file {path!r} in artifact {artifact.digest}",
            hint=f"proctor artifact show -t {tenant} {artifact.digest} --files",
        )

    def write_tar(self, tenant: str, digest: str, out: BinaryIO) -> Artifact:
        """The artifact's exact tree as a tar on ``out``: submitting what it extracts to
        gives the same digest. Checked as ``materialize`` checks (the digest recomputed
        from the stored rows, every blob against its hash) before a byte is written;
        owners, times and names of users are fixed, so the same digest gives the same tar."""
        artifact = self.get(tenant, digest)
        files = self.stored_files(artifact.digest)
        _check_tree(files)
        if artifact_digest(files, artifact.manifest) != artifact.digest:
            raise VerificationFailed(
                f"artifact {artifact.digest}: its stored files and manifest no longer hash"
                " to its digest; the store was changed",
                hint=f"proctor audit verify --tenant {tenant}",
            )
        import tarfile

        dirs = sorted({"/".join(f.path.split("/")[:i])
                       for f in files for i in range(1, f.path.count("/") + 1)})  # fmt: skip
        with tarfile.open(fileobj=out, mode="w|", format=tarfile.PAX_FORMAT) as tar:
            for d in dirs:
                tar.addfile(_tar_info(d, tarfile.DIRTYPE, 0o755))
            for f in files:
                if f.link is not None:
                    info = _tar_info(f.path, tarfile.SYMTYPE, 0o777)
                    info.linkname = f.link
                    tar.addfile(info)
                    continue
                data = self._blobs.read(f)
                info = _tar_info(f.path, tarfile.REGTYPE, f.mode)
                info.size = len(data)
                tar.addfile(info, _BytesReader(data))
        return artifact

    def review(self, tenant: str, digest: str, *, calls_per_run: int = 50) -> dict[str, Any]:
        """What an approver sees before approving: the manifest in words, the files, and
        what each sandbox run of this very digest did (its calls from the ledger,
        refusals first)."""
        from proctor.governance._runs import Runs

        artifact = self.get(tenant, digest)
        files = self.stored_files(artifact.digest)
        runs = [r for r in Runs(self._store).of_artifact(tenant, artifact.digest)
                if r.environment == "sandbox"]  # fmt: skip
        calls = self._run_calls(tenant, [r.id for r in runs], runs[0].started_at if runs else "")
        shown = []
        for r in runs:
            mine = sorted(calls.get(r.id, []), key=lambda e: (e["decision"] != "deny", e["seq"]))
            shown.append({
                "id": r.id, "deployment": r.deployment, "status": r.status,
                "exit_code": r.exit_code, "started_at": r.started_at, "ended_at": r.ended_at,
                "calls": len(mine), "refused": sum(e["decision"] == "deny" for e in mine),
                "events": mine[:calls_per_run],
            })  # fmt: skip
        return {
            **artifact.to_json(),
            "capabilities": artifact.capabilities,
            "capabilities_words": capability_words(artifact.capabilities),
            "files": [f.to_json() for f in files],
            "sandbox_runs": shown,
        }

    def _run_calls(
        self, tenant: str, run_ids: builtins.list[str], since: str
    ) -> dict[str, builtins.list[dict[str, Any]]]:
        """The calls out of each run (not its own start and end), read once from the log."""
        out: dict[str, builtins.list[dict[str, Any]]] = {}
        if not run_ids:
            return out
        wanted = set(run_ids)
        for raw in self._ledger.events_between(tenant, since=since):
            ev = json.loads(raw)
            run = ev.get("run")
            if run not in wanted or str(ev.get("action", "")).startswith("run."):
                continue
            out.setdefault(run, []).append({
                "seq": ev["seq"], "time": ev["time"], "action": ev["action"],
                "resource": ev["resource"], "decision": ev["decision"], "reason": ev["reason"],
            })  # fmt: skip
        return out

    # -- materialize ---------------------------------------------------------

    def materialize(self, tenant: str, digest: str, dest: Path) -> Path:
        """Write the artifact's files to ``dest`` (which must not exist), verifying each.

        Directories are 0755 and files 0644 or 0755 whatever the umask: the
        sandbox's guest runs as another user (65534) and must read them. The
        tree is built beside ``dest`` and renamed into place, so ``dest``
        exists only complete and verified.

        The digest is recomputed from the entries and manifest written here,
        and each blob is checked against its entry as it is copied: what lands
        in ``dest`` is the content the digest names, whatever rows and blobs
        someone changed in the store.
        """
        artifact = self.get(tenant, digest)
        files = self.stored_files(artifact.digest)
        _check_tree(files)
        recomputed = artifact_digest(files, artifact.manifest)
        if recomputed != artifact.digest:
            raise VerificationFailed(
                f"artifact {artifact.digest}: its stored files and manifest hash to"
                f" {recomputed[:19]}…, not to its digest; the store was changed",
                hint=f"proctor audit verify --tenant {tenant}",
            )
        if dest.exists() or dest.is_symlink():
            raise UsageError(f"{dest} exists already; materialize into a new directory")
        tmp = dest.parent / f".{dest.name}.{secrets.token_hex(6)}.tmp"
        tmp.mkdir(mode=0o755)
        try:
            os.chmod(tmp, 0o755)  # noqa: S103 - the guest (uid 65534) must read the code
            for f in files:
                target = tmp / f.path
                self._mkdirs(tmp, target.parent)
                if f.link is not None:
                    os.symlink(f.link, target)
                    continue
                fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, f.mode)
                try:
                    os.fchmod(fd, f.mode)
                    with self._blobs.open(f) as reader:
                        for chunk in reader.chunks():
                            _write_all(fd, chunk)
                finally:
                    os.close(fd)
            os.rename(tmp, dest)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return dest

    @staticmethod
    def _mkdirs(root: Path, directory: Path) -> None:
        missing = []
        while directory != root and not directory.exists():
            missing.append(directory)
            directory = directory.parent
        for d in reversed(missing):
            d.mkdir(mode=0o755)
            os.chmod(d, 0o755)  # noqa: S103 - the guest (uid 65534) must read the code

    # -- diff ----------------------------------------------------------------

    def diff(self, tenant: str, old: str, new: str) -> ArtifactDiff:
        """What changed from ``old`` to ``new``: the view an approver reviews."""
        a = self.get(tenant, old)
        b = self.get(tenant, new)
        a_files = {f.path: f for f in self.files(tenant, a.digest)}
        b_files = {f.path: f for f in self.files(tenant, b.digest)}
        changes: list[FileChange] = []
        for path in sorted(a_files.keys() | b_files.keys()):
            fa, fb = a_files.get(path), b_files.get(path)
            if fa == fb:
                continue
            change = "added" if fa is None else "removed" if fb is None else "modified"
            changes.append(self._file_change(path, change, fa, fb))
        return ArtifactDiff(a, b, tuple(changes), tuple(manifest_changes(a.manifest, b.manifest)))

    def _file_change(
        self, path: str, change: str, fa: ArtifactFile | None, fb: ArtifactFile | None
    ) -> FileChange:
        if (fa is not None and fa.link is not None) or (fb is not None and fb.link is not None):
            return FileChange(path, change, fa, fb)
        if fa is not None and fb is not None and fa.sha256 == fb.sha256:
            return FileChange(path, change, fa, fb)  # mode only
        if any(f is not None and f.size > MAX_TEXT_DIFF_BYTES for f in (fa, fb)):
            return FileChange(path, change, fa, fb)
        old = self._blobs.read(fa) if fa is not None else b""
        new = self._blobs.read(fb) if fb is not None else b""
        old_text, new_text = _text(old), _text(new)
        if old_text is None or new_text is None:
            return FileChange(path, change, fa, fb, binary=True)
        lines = difflib.unified_diff(
            old_text.splitlines(keepends=True),
            new_text.splitlines(keepends=True),
            fromfile="/dev/null" if fa is None else f"a/{path}",
            tofile="/dev/null" if fb is None else f"b/{path}",
        )
        return FileChange(path, change, fa, fb, diff="".join(_terminated(lines)))


def _check_tree(files: builtins.list[ArtifactFile]) -> None:
    """Refuse stored paths that would write outside ``dest`` or through a link.

    The walk never records such paths; this guards against rows changed in
    the store, so that materializing can never write where it should not.
    """
    links = {f.path for f in files if f.link is not None}
    for f in files:
        parts = f.path.split("/")
        if (
            f.path.startswith("/")
            or posixpath.normpath(f.path) != f.path
            or any(p in ("", ".", "..") for p in parts)
        ):
            raise VerificationFailed(f"stored artifact path {f.path!r} is not a safe relative path")
        for i in range(1, len(parts)):
            if "/".join(parts[:i]) in links:
                raise VerificationFailed(f"stored artifact path {f.path!r} goes through a link")


def _tar_info(name: str, kind: bytes, mode: int) -> Any:
    import tarfile

    info = tarfile.TarInfo(name)
    info.type = kind
    info.mode = mode
    info.mtime = 0
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    return info


class _BytesReader:
    """A read-only file over bytes, for ``tarfile.addfile``."""

    def __init__(self, data: bytes) -> None:
        self._view = memoryview(data)
        self._pos = 0

    def read(self, n: int = -1) -> bytes:
        end = len(self._view) if n < 0 else min(len(self._view), self._pos + n)
        chunk = bytes(self._view[self._pos : end])
        self._pos = end
        return chunk


class _FileSet:
    """The paths an entrypoint may name: files, and links that resolve to one."""

    def __init__(self, walk: _Walk) -> None:
        self._walk = walk

    def __contains__(self, item: object) -> bool:
        return isinstance(item, str) and self._walk.resolves_to_file(item)

    def __iter__(self) -> Iterator[str]:
        return iter(self._walk.files)

    def __len__(self) -> int:
        return len(self._walk.files)


def _text(data: bytes) -> str | None:
    if b"\x00" in data[:8192]:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def _terminated(lines: Iterator[str]) -> Iterator[str]:
    for line in lines:
        if line.endswith("\n"):
            yield line
        else:
            yield line + "\n\\ No newline at end of file\n"


# -- capability review -------------------------------------------------------

_GRANTS = {"read": {"read"}, "write": {"write"}, "read-write": {"read", "write"}}


def manifest_changes(a: Manifest, b: Manifest) -> list[CapabilityChange]:
    """The manifest lines that differ, each marked whether it lets the code do more,
    and said in words ("adds egress to api.example.com:443")."""
    out: list[CapabilityChange] = []

    def add(area: str, subject: str, old: Any, new: Any, widens: bool, text: str) -> None:
        change = "added" if old is None else "removed" if new is None else "changed"
        out.append(CapabilityChange(area, subject, change, _show(old), _show(new), widens, text))

    if a.name != b.name:
        add("name", "name", a.name, b.name, False, f"renames the job from {a.name} to {b.name}")
    if a.purpose != b.purpose:
        # A new purpose is new processing, whatever the code: review it as such.
        add(
            "purpose",
            "purpose",
            a.purpose,
            b.purpose,
            True,
            f"changes the purpose from {a.purpose!r} to {b.purpose!r}",
        )
    if a.entrypoint != b.entrypoint:
        add(
            "entrypoint",
            "entrypoint",
            list(a.entrypoint),
            list(b.entrypoint),
            False,
            f"changes the entrypoint from {' '.join(a.entrypoint)} to {' '.join(b.entrypoint)}",
        )

    da, db = a.capabilities["datasets"], b.capabilities["datasets"]
    for ds in sorted(da.keys() | db.keys()):
        ta = da.get(ds, {}).get("tables", {})
        tb = db.get(ds, {}).get("tables", {})
        if ds not in da:
            add("dataset", ds, None, ds, True, f"adds dataset {ds}")
        elif ds not in db:
            add("dataset", ds, ds, None, False, f"drops dataset {ds}")
        for table in sorted(ta.keys() | tb.keys()):
            subject = f"{ds}.{table}"
            ga, gb = ta.get(table), tb.get(table)
            if ga is None:
                add(
                    "table",
                    subject,
                    None,
                    _grant(gb),
                    True,
                    f"adds {_ACCESS[gb['access']]} of {subject} ({', '.join(gb['columns'])})",
                )
                continue
            if gb is None:
                add(
                    "table",
                    subject,
                    _grant(ga),
                    None,
                    False,
                    f"drops {_ACCESS[ga['access']]} of {subject} ({', '.join(ga['columns'])})",
                )
                continue
            if ga["access"] != gb["access"]:
                widens = not _GRANTS[gb["access"]] <= _GRANTS[ga["access"]]
                add(
                    "access",
                    subject,
                    ga["access"],
                    gb["access"],
                    widens,
                    f"changes access to {subject} from {_ACCESS[ga['access']]}"
                    f" to {_ACCESS[gb['access']]}",
                )
            ca, cb = set(ga["columns"]), set(gb["columns"])
            for column in sorted(cb - ca):
                add(
                    "column",
                    f"{subject}.{column}",
                    None,
                    column,
                    True,
                    f"adds {_ACCESS[gb['access']]} of {subject}.{column}",
                )
            for column in sorted(ca - cb):
                add(
                    "column",
                    f"{subject}.{column}",
                    column,
                    None,
                    False,
                    f"drops {_ACCESS[ga['access']]} of {subject}.{column}",
                )

    for area, key, noun in (("egress", "egress", "egress to"), ("secret", "secrets", "secret")):
        sa, sb = set(a.capabilities[key]), set(b.capabilities[key])
        for item in sorted(sb - sa):
            add(area, item, None, item, True, f"adds {noun} {item}")
        for item in sorted(sa - sb):
            add(area, item, item, None, False, f"drops {noun} {item}")

    ba, bb = a.capabilities["buckets"], b.capabilities["buckets"]
    for name in sorted(ba.keys() | bb.keys()):
        old, new = ba.get(name), bb.get(name)
        if old == new:
            continue
        widens = new is not None and (old is None or not _GRANTS[new] <= _GRANTS[old])
        if old is None:
            text = f"adds {_ACCESS[new]} of bucket {name}"
        elif new is None:
            text = f"drops {_ACCESS[old]} of bucket {name}"
        else:
            text = f"changes access to bucket {name} from {_ACCESS[old]} to {_ACCESS[new]}"
        add("bucket", name, old, new, widens, text)

    la, lb = a.limits.to_json(), b.limits.to_json()
    for key in sorted(la.keys() | lb.keys()):
        old_l, new_l = la.get(key), lb.get(key)
        if old_l != new_l:
            # An unset limit is the runtime's default, which the manifest cannot compare.
            widens = old_l is not None and new_l is not None and new_l > old_l
            if old_l is None:
                text = f"sets the {key} limit to {new_l} (was the runtime's default)"
            elif new_l is None:
                text = f"drops the {key} limit of {old_l} (the runtime's default applies)"
            else:
                verb = "raises" if new_l > old_l else "lowers"
                text = f"{verb} the {key} limit from {old_l} to {new_l}"
            add("limit", key, old_l, new_l, widens, text)

    ya, yb = a.lifecycle.to_json(), b.lifecycle.to_json()
    for key in sorted(ya.keys() | yb.keys()):
        if ya.get(key) != yb.get(key):
            widens = key == "mode" and ya.get(key) == "job"
            if ya.get(key) is None:
                text = f"sets the lifecycle {key} to {yb.get(key)}"
            elif yb.get(key) is None:
                text = f"drops the lifecycle {key} {ya.get(key)}"
            else:
                text = f"changes the lifecycle {key} from {ya.get(key)} to {yb.get(key)}"
            add("lifecycle", key, ya.get(key), yb.get(key), widens, text)
    return out


#: What an access grants, in words.
_ACCESS = {"read": "read", "write": "write", "read-write": "read and write"}


def capability_words(capabilities: dict[str, Any]) -> list[str]:
    """What the code may do outside its sandbox, one sentence each, for an approver."""
    lines: list[str] = []
    for ds, spec in sorted(capabilities["datasets"].items()):
        for table, grant in sorted(spec["tables"].items()):
            lines.append(
                f"{_ACCESS[grant['access']]} of {ds}.{table}"
                f" (columns {', '.join(grant['columns'])})"
            )
    lines += [f"egress to {host}" for host in capabilities["egress"]]
    lines += [f"the secret {name} injected into its calls" for name in capabilities["secrets"]]
    lines += [f"{_ACCESS[access]} of bucket {name}"
              for name, access in sorted(capabilities["buckets"].items())]  # fmt: skip
    return lines or ["nothing: the code can reach nothing outside its sandbox"]


def _grant(grant: dict[str, Any]) -> str:
    return f"{grant['access']}: {', '.join(grant['columns'])}"


def _show(value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, str):
        return value
    return json.dumps(value)
