"""A backup's manifest: what it holds, each file's digest, each log's checkpoint.

``manifest.json`` is canonical JSON; ``manifest.sig`` is a C2SP signed note whose
text names the manifest's SHA-256, signed by the home's checkpoint key under the
name ``<trust domain>/backup`` (one key, a name of its own per purpose, as the
ledger signs each log under its origin: a backup's signature is never a
checkpoint's, and its text does not parse as one). The checkpoints alone would
not do: they commit to the ledger, not to the blobs, buckets, run outputs,
configuration and keys beside it.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import re
from dataclasses import dataclass, field
from typing import Any

from proctor.errors import UsageError, VerificationFailed
from proctor.ledger import Signer, Verifier, canonical_json, split_note
from proctor.store import Engine

FORMAT = "proctor-backup/1"
MANIFEST = "manifest.json"
SIGNATURE = "manifest.sig"
#: Where the home's files go in a backup (config.json, keys/, blobs/, ...).
HOME = "home"
#: Each log's newest signed checkpoint as of the store copy: checkpoints/<log>.note.
CHECKPOINTS = "checkpoints"
STORE = "store"

_SAFE_LOG = re.compile(r"^[a-z0-9][a-z0-9._-]{0,127}$")


def checkpoint_file(log: str) -> str:
    """The backup's path of ``log``'s checkpoint note."""
    name = log if _SAFE_LOG.match(log) and ".." not in log else f"log-{log.encode().hex()}"
    return f"{CHECKPOINTS}/{name}.note"


def backup_name(trust_domain: str) -> str:
    """The key name a backup's manifest is signed under."""
    return f"{trust_domain}/backup"


@dataclass(frozen=True)
class LogPoint:
    """A log as the store copy holds it: its size and root at its newest checkpoint."""

    origin: str
    size: int
    root: bytes
    checkpoint: str  # the note's path in the backup

    def as_json(self) -> dict[str, Any]:
        return {
            "origin": self.origin,
            "size": self.size,
            "root": base64.b64encode(self.root).decode(),
            "checkpoint": self.checkpoint,
        }


@dataclass(frozen=True)
class FileEntry:
    sha256: str
    size: int


@dataclass(frozen=True)
class Manifest:
    created: str
    version: str
    trust_domain: str
    verifier_key: str
    engine: Engine
    schema_version: int
    #: True: the home's private keys are in the backup (a backup that restores).
    keys: bool
    #: The engine's copy of the store (a SQLite file, or pg_dump's archive).
    store: str
    #: A SQLite file holding the ledger's tables: the store itself on SQLite; on
    #: PostgreSQL a copy of the ledger's tables from the dump's snapshot, so that
    #: ``backup verify`` needs no server.
    ledger: str
    logs: dict[str, LogPoint]
    files: dict[str, FileEntry]
    #: What the home held that the backup leaves out (named, so nothing is lost unseen).
    skipped: list[str] = field(default_factory=list)

    def as_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "created": self.created,
            "version": self.version,
            "trust_domain": self.trust_domain,
            "verifier_key": self.verifier_key,
            "engine": self.engine.value,
            "schema_version": self.schema_version,
            "keys": self.keys,
            "store": self.store,
            "ledger": self.ledger,
            "logs": {k: v.as_json() for k, v in sorted(self.logs.items())},
            "files": {
                k: {"sha256": v.sha256, "size": v.size} for k, v in sorted(self.files.items())
            },
            "skipped": sorted(self.skipped),
        }

    def encode(self) -> bytes:
        return canonical_json(self.as_json()) + b"\n"

    @classmethod
    def decode(cls, data: bytes) -> Manifest:
        try:
            raw = json.loads(data)
            if not isinstance(raw, dict) or raw.get("format") != FORMAT:
                found = raw.get("format") if isinstance(raw, dict) else None
                raise VerificationFailed(
                    f"the manifest is not a Proctor backup's ({FORMAT}), it says {found!r}"
                )
            logs = {
                str(k): LogPoint(
                    str(v["origin"]),
                    int(v["size"]),
                    base64.b64decode(str(v["root"]), validate=True),
                    str(v["checkpoint"]),
                )
                for k, v in dict(raw["logs"]).items()
            }
            files = {
                str(k): FileEntry(str(v["sha256"]), int(v["size"]))
                for k, v in dict(raw["files"]).items()
            }
            return cls(
                created=str(raw["created"]),
                version=str(raw["version"]),
                trust_domain=str(raw["trust_domain"]),
                verifier_key=str(raw["verifier_key"]),
                engine=Engine(str(raw["engine"])),
                schema_version=int(raw["schema_version"]),
                keys=bool(raw["keys"]),
                store=str(raw["store"]),
                ledger=str(raw["ledger"]),
                logs=logs,
                files=files,
                skipped=[str(s) for s in raw.get("skipped", [])],
            )
        except (ValueError, KeyError, TypeError, binascii.Error) as exc:
            raise VerificationFailed(f"the manifest is malformed: {exc}") from exc


def _note_text(trust_domain: str, created: str, manifest: bytes) -> str:
    return f"{FORMAT}\n{trust_domain}\n{created}\nsha256:{hashlib.sha256(manifest).hexdigest()}\n"


def sign_manifest(signer: Signer, manifest: Manifest) -> tuple[bytes, str]:
    """The manifest's bytes and its signed note."""
    data = manifest.encode()
    named = signer.named(backup_name(manifest.trust_domain))
    return data, named.sign_note(_note_text(manifest.trust_domain, manifest.created, data))


def check_signature(data: bytes, note: str, verifier: Verifier, trust_domain: str) -> None:
    """Refuse unless ``note`` is a signature by ``verifier``'s key (under the backup's
    name) on exactly the manifest ``data``."""
    try:
        manifest = Manifest.decode(data)
    except VerificationFailed:
        raise
    if manifest.trust_domain != trust_domain:
        raise VerificationFailed(
            f"the manifest is of trust domain {manifest.trust_domain!r}, not {trust_domain!r}"
        )
    want = _note_text(trust_domain, manifest.created, data)
    text, lines = split_note(note)
    if text != want:
        raise VerificationFailed(
            "the manifest's signature is over another manifest (its digest differs): "
            "the manifest was changed after the backup was made"
        )
    try:
        named = Verifier(backup_name(trust_domain), verifier.public)
    except UsageError as exc:
        raise VerificationFailed(f"cannot check the manifest's signature: {exc.message}") from exc
    for line in lines:
        parts = line.split(" ")
        if len(parts) != 3 or parts[1] != named.name:
            continue
        try:
            raw = base64.b64decode(parts[2], validate=True)
        except binascii.Error:
            continue
        if raw[:4] == named.key_id and named.verify(text.encode(), raw[4:]):
            return
    raise VerificationFailed(
        f"the manifest is not signed by the key {verifier.vkey()}: it was changed, or "
        "made by another home"
    )
