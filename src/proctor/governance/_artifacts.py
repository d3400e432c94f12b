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

The walk of a directory and the blob store are ``_artifact_walk.py``; what changed
between two artifacts (files and manifest) is ``_artifact_diff.py``.
"""

from __future__ import annotations

import builtins
import hashlib
import json
import os
import posixpath
import secrets
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from proctor.errors import AlreadyExists, NotFound, UsageError, VerificationFailed
from proctor.governance._artifact_diff import (
    ArtifactDiff,
    CapabilityChange,
    FileChange,
    capability_words,
    file_changes,
    manifest_changes,
)
from proctor.governance._artifact_walk import (
    SKIPPED_NAMES,
    ArtifactFile,
    Blobs,
    FileSet,
    Walk,
    write_all,
)
from proctor.governance._environments import Environment
from proctor.governance._manifest import (
    MANIFEST_FILE,
    Manifest,
    check_entrypoint,
    parse_manifest,
)
from proctor.ledger import Action, Actor, EventDraft, Ledger, canonical_json, utc_now
from proctor.store import Conn, Store

# The walk (_artifact_walk.py) and the diff (_artifact_diff.py) have their own
# modules; what governance's __init__ and the tests import from here stays here.
__all__ = [
    "DEFAULT_MAX_BYTES",
    "DEFAULT_MAX_FILES",
    "FORMAT",
    "SKIPPED_NAMES",
    "Artifact",
    "ArtifactDiff",
    "ArtifactFile",
    "Artifacts",
    "CapabilityChange",
    "FileChange",
    "artifact_digest",
    "capability_words",
    "manifest_changes",
]

FORMAT = "proctor.artifact/1"
DEFAULT_MAX_BYTES = 64 * 1024 * 1024
DEFAULT_MAX_FILES = 10_000
_MIN_PREFIX = 4
_HEX = frozenset("0123456789abcdef")


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


def artifact_digest(files: list[ArtifactFile], manifest: Manifest) -> str:
    """The content address of ``files`` (any order) with ``manifest``."""
    body = {
        "format": FORMAT,
        "files": [f.to_json() for f in sorted(files, key=lambda f: f.path)],
        "manifest": manifest.to_json(),
    }
    return "sha256:" + hashlib.sha256(canonical_json(body)).hexdigest()


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
        self._blobs = Blobs(blob_root)

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
            walk = Walk(directory, self._blobs, stage, max_bytes, max_files)
            walk.run()
            manifest = self._manifest(walk)
            check_entrypoint(manifest, FileSet(walk))
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

    def _manifest(self, walk: Walk) -> Manifest:
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
            Action.ARTIFACT_SUBMIT,
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
                if r.environment == Environment.SANDBOX]  # fmt: skip
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
                            write_all(fd, chunk)
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
        files = file_changes(
            self.files(tenant, a.digest), self.files(tenant, b.digest), self._blobs.read
        )
        return ArtifactDiff(a, b, files, tuple(manifest_changes(a.manifest, b.manifest)))


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
