"""``proctor backup verify DIR``: a backup checked offline, with no home.

In order, failing at the first problem with one sentence: the manifest's signature
(by the backup's key, and by the key the verifier trusts when given: a backup
tampered with and re-signed under a key of its own is caught only so); every
file's SHA-256 and size, and no file the manifest does not list; the checkpoint
key in the backup, if any, is the manifest's; each log's checkpoint is signed by
that key and names the size and root the manifest says; and the store copy's
ledger verifies (every leaf, root, tile and stored checkpoint recomputed, the
``ledger`` component's :func:`verify_log`) up to exactly that checkpoint.
"""

from __future__ import annotations

import os
import sqlite3
import stat
from dataclasses import dataclass
from pathlib import Path

from proctor.backup._files import hash_file
from proctor.backup._manifest import HOME, MANIFEST, SIGNATURE, Manifest, check_signature
from proctor.backup._take import sqlite_query
from proctor.errors import ProctorError, UsageError, VerificationFailed
from proctor.ledger import Signer, Verifier, VerifyReport, open_checkpoint, verify_log
from proctor.store import Engine, check_dump


@dataclass(frozen=True)
class BackupReport:
    directory: Path
    manifest: Manifest
    manifest_sha256: str
    files: int
    bytes: int
    #: Each log's verified size (its checkpoint's).
    logs: dict[str, int]
    #: True when the verifier gave the key it trusts (else the backup's own).
    key_given: bool

    def as_json(self) -> dict[str, object]:
        m = self.manifest
        return {
            "verified": True,
            "directory": str(self.directory),
            "created": m.created,
            "version": m.version,
            "engine": m.engine,
            "trust_domain": m.trust_domain,
            "verifier_key": m.verifier_key,
            "key_given": self.key_given,
            "keys": m.keys,
            "files": self.files,
            "bytes": self.bytes,
            "logs": {
                log: {"size": p.size, "root": p.as_json()["root"]}
                for log, p in sorted(m.logs.items())
            },
            "skipped": m.skipped,
            "manifest_sha256": self.manifest_sha256,
        }


def read_manifest(directory: Path) -> tuple[bytes, str]:
    if not directory.is_dir():
        raise UsageError(
            f"{directory} is not a directory", hint="give the directory `proctor backup -o` wrote"
        )
    try:
        data = (directory / MANIFEST).read_bytes()
    except FileNotFoundError:
        raise UsageError(
            f"{directory} is not a Proctor backup: it has no {MANIFEST}",
            hint="give the directory `proctor backup -o` wrote (one without a manifest "
            "was not finished)",
        ) from None
    try:
        note = (directory / SIGNATURE).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise VerificationFailed(
            f"the backup has no {SIGNATURE}: its manifest is unsigned"
        ) from None
    except UnicodeDecodeError as exc:
        raise VerificationFailed(f"the backup's {SIGNATURE} is not a signed note") from exc
    return data, note


def verify_backup(directory: Path, key: str | None = None) -> BackupReport:
    """Check the backup at ``directory``; ``key`` is the verifier key the caller
    trusts (``proctor key show``'s, kept apart from the backup)."""
    import hashlib

    data, note = read_manifest(directory)
    manifest = Manifest.decode(data)
    try:
        own = Verifier.parse(manifest.verifier_key)
    except UsageError as exc:
        raise VerificationFailed(f"the manifest's key is malformed: {exc.message}") from exc
    if key is not None:
        try:
            given = Verifier.parse(key.strip())
        except UsageError as exc:
            raise UsageError(f"--key: {exc.message}") from exc
        if given.vkey() != own.vkey():
            raise VerificationFailed(
                f"the backup is signed by {own.vkey()}, not by the key you trust "
                f"({given.vkey()}): it was made by another home, or altered and signed again"
            )
    if own.name != manifest.trust_domain:
        raise VerificationFailed(
            f"the manifest's key is named {own.name!r}, its trust domain {manifest.trust_domain!r}"
        )
    check_signature(data, note, own, manifest.trust_domain)
    total = _check_files(directory, manifest)
    if manifest.keys:
        _check_key(directory, manifest, own)
    _check_checkpoints(directory, manifest, own)
    sizes = _check_ledger(directory, manifest, own)
    if manifest.engine is Engine.POSTGRESQL:
        try:
            check_dump(directory / manifest.store)
        except ProctorError as exc:
            raise VerificationFailed(f"the store's dump is unreadable: {exc.message}") from exc
    return BackupReport(directory, manifest, hashlib.sha256(data).hexdigest(), len(manifest.files),
                        total, sizes, key is not None)  # fmt: skip


def _check_checkpoints(directory: Path, manifest: Manifest, own: Verifier) -> None:
    for log, point in sorted(manifest.logs.items()):
        try:
            text = (directory / point.checkpoint).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise VerificationFailed(f"cannot read the checkpoint of log {log!r}: {exc}") from exc
        try:
            cp = open_checkpoint(text, own, point.origin)
        except VerificationFailed as exc:
            raise VerificationFailed(
                f"the checkpoint of log {log!r} ({point.checkpoint}) is not signed by the "
                f"backup's key: {exc.message}"
            ) from exc
        if (cp.size, cp.root) != (point.size, point.root):
            raise VerificationFailed(
                f"the checkpoint of log {log!r} has size {cp.size}, the manifest says {point.size}"
            )


def _check_paths(manifest: Manifest) -> set[str]:
    """The manifest's files, each a path inside the backup; the store, ledger and
    checkpoints it names among them."""
    listed = set(manifest.files)
    for rel in listed:
        parts = rel.split("/")
        if rel.startswith("/") or any(p in ("", ".", "..") for p in parts):
            raise VerificationFailed(f"the manifest names a path outside the backup: {rel!r}")
    named = [manifest.store, manifest.ledger, *(p.checkpoint for p in manifest.logs.values())]
    for rel in named:
        if rel not in listed:
            raise VerificationFailed(f"the manifest names {rel!r} but does not list its digest")
    return listed


def _check_files(directory: Path, manifest: Manifest) -> int:
    listed = _check_paths(manifest)
    found: set[str] = set()
    for root, dirs, names in os.walk(directory):
        here = Path(root)
        for name in [*names, *dirs]:
            path = here / name
            rel = path.relative_to(directory).as_posix()
            st = os.lstat(path)
            if stat.S_ISDIR(st.st_mode):
                continue
            if rel in (MANIFEST, SIGNATURE):
                continue
            if not stat.S_ISREG(st.st_mode):
                raise VerificationFailed(f"the backup's {rel} is not a regular file (a link?)")
            found.add(rel)
    extra = sorted(found - listed)
    if extra:
        raise VerificationFailed(
            f"the backup holds {len(extra)} file(s) its manifest does not list: {extra[0]}"
        )
    missing = sorted(listed - found)
    if missing:
        raise VerificationFailed(
            f"the backup lacks {len(missing)} file(s) its manifest lists: {missing[0]}"
        )
    total = 0
    for rel, want in sorted(manifest.files.items()):
        got = hash_file(directory / rel)
        if got != want:
            raise VerificationFailed(
                f"{rel}: its SHA-256 is not the manifest's ({got.sha256[:16]}… for "
                f"{want.sha256[:16]}…): the file was changed after the backup was made"
            )
        total += got.size
    return total


def _check_key(directory: Path, manifest: Manifest, own: Verifier) -> None:
    path = directory / HOME / "keys" / "ledger.pem"
    try:
        signer = Signer.load(manifest.trust_domain, path)
    except UsageError as exc:
        raise VerificationFailed(f"the backup's checkpoint key: {exc.message}") from exc
    if signer.verifier.vkey() != own.vkey():
        raise VerificationFailed(
            "the backup's checkpoint key (home/keys/ledger.pem) is not the key that signed it"
        )


def _check_ledger(directory: Path, manifest: Manifest, verifier: Verifier) -> dict[str, int]:
    """Each log of the store copy verified up to the manifest's checkpoint, and no
    log the manifest does not name."""
    path = directory / manifest.ledger
    try:
        db, query = sqlite_query(path)
    except sqlite3.Error as exc:
        raise VerificationFailed(f"the store copy {path.name} does not open: {exc}") from exc
    sizes: dict[str, int] = {}
    try:
        logs = {str(r[0]) for r in query("SELECT log FROM ledger_logs", ())}
        if logs != set(manifest.logs):
            extra = sorted(logs ^ set(manifest.logs))
            raise VerificationFailed(
                f"the store copy's logs are not the manifest's (log {extra[0]!r})"
            )
        for log, point in sorted(manifest.logs.items()):
            note = (directory / point.checkpoint).read_text(encoding="utf-8")
            try:
                report = _verify_log(db, log, verifier, note)
            except VerificationFailed as exc:
                raise VerificationFailed(f"log {log!r} in the store copy: {exc.message}") from exc
            if (report.size, report.root) != (point.size, point.root):
                raise VerificationFailed(
                    f"log {log!r} in the store copy has size {report.size}, its checkpoint "
                    f"in the backup {point.size}"
                )
            sizes[log] = report.size
    except sqlite3.Error as exc:
        raise VerificationFailed(f"the store copy {path.name} cannot be read: {exc}") from exc
    finally:
        db.close()
    return sizes


def _verify_log(db: sqlite3.Connection, log: str, verifier: Verifier, trusted: str) -> VerifyReport:
    """``Ledger.verify`` of one log of a store copy, with nothing but the verifier key."""
    head = db.execute(
        "SELECT origin, size, root, checkpoint FROM ledger_logs WHERE log = ?", (log,)
    ).fetchone()
    notes = [str(r[0]) for r in db.execute(
        "SELECT note FROM ledger_checkpoints WHERE log = ? ORDER BY size", (log,))]  # fmt: skip
    notes += [str(head[3]), trusted]
    refs = {
        int(r[0]): str(r[1])
        for r in db.execute(
            "SELECT seq, ref FROM ledger_entries WHERE ref IS NOT NULL AND log = ?", (log,)
        )
    }

    def tiles(level: int, index: int) -> bytes:
        row = db.execute(
            "SELECT hashes FROM ledger_tiles WHERE log = ? AND level = ? AND idx = ?",
            (log, level, index),
        ).fetchone()
        return bytes(row[0]) if row else b""

    entries = (bytes(r[0]) for r in db.execute(
        "SELECT data FROM ledger_entries WHERE log = ? ORDER BY seq", (log,)))  # fmt: skip
    return verify_log(origin=str(head[0]), tenant=log, entries=entries, checkpoints=notes,
                      verifier=verifier, head=(int(head[1]), bytes(head[2])), tiles=tiles,
                      refs=refs)  # fmt: skip
