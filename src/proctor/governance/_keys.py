"""The runtime's symmetric secrets, all derived from one key file.

``keys/runtime.key`` (32 random bytes, mode 0600) is made once per home. From it,
HKDF derives a key per purpose: sealing tenant secrets at rest, each tenant's
lineage HMAC key, and the broker's run-token MAC key. One file to protect and
back up; no purpose can be turned into another's key.
"""

from __future__ import annotations

import base64
import os
from pathlib import Path

from cryptography.fernet import Fernet, InvalidToken
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from proctor.errors import ProctorError, UsageError


class KeyRing:
    def __init__(self, master: bytes) -> None:
        if len(master) != 32:
            raise UsageError("the runtime key must be 32 bytes")
        self._master = master

    @classmethod
    def load_or_create(cls, path: Path) -> KeyRing:
        if not path.exists():
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            except FileExistsError:
                pass  # made by another process a moment ago
            else:
                with os.fdopen(fd, "wb") as f:
                    f.write(os.urandom(32))
                    f.flush()
                    os.fsync(f.fileno())
        try:
            return cls(path.read_bytes())
        except OSError as exc:
            raise UsageError(f"cannot read the runtime key {path}: {exc}") from exc

    def derive(self, purpose: str) -> bytes:
        return HKDF(hashes.SHA256(), 32, salt=None, info=purpose.encode()).derive(self._master)

    def _fernet(self) -> Fernet:
        return Fernet(base64.urlsafe_b64encode(self.derive("proctor/secrets/v1")))

    def seal(self, value: str) -> bytes:
        return self._fernet().encrypt(value.encode())

    def unseal(self, sealed: bytes) -> str:
        try:
            return self._fernet().decrypt(sealed).decode()
        except InvalidToken as exc:
            raise ProctorError(
                "a stored secret cannot be decrypted with this home's runtime key"
            ) from exc

    def lineage_key(self, tenant: str) -> bytes:
        return self.derive(f"proctor/lineage/v1/{tenant}")
