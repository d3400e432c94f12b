"""C2SP signed notes and tlog-checkpoints, with Ed25519.

Formats, exactly as https://c2sp.org/signed-note and /tlog-checkpoint give them:

* key id: the first 4 bytes of SHA-256(name || 0x0A || 0x01 || public key);
* verifier key: ``<name>+<hex key id>+<base64(0x01 || public key)>``;
* signature line: ``— <name> <base64(key id || signature)>``;
* checkpoint body: ``<origin>\\n<size>\\n<base64 root>\\n``.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import os
import re
from dataclasses import dataclass
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import (
    Ed25519PrivateKey,
    Ed25519PublicKey,
)

from proctor.errors import UsageError, VerificationFailed

_ALG_ED25519 = b"\x01"
_EM_DASH = "\u2014"
# Key names are non-empty, without whitespace or '+' (signed-note).
_NAME_RE = re.compile(r"^[^\s+]+$")


def _key_id(name: str, public: bytes) -> bytes:
    return hashlib.sha256(name.encode() + b"\n" + _ALG_ED25519 + public).digest()[:4]


def _split_vkey(vkey: str, what: str) -> tuple[str, bytes, bytes]:
    """``name+hexid+base64`` as (name, key id, decoded key with its algorithm byte)."""
    # The base64 key may itself contain "+": only the first two separate fields.
    parts = vkey.strip().split("+", 2)
    if len(parts) != 3:
        raise UsageError(f"malformed {what} {vkey.strip()!r}")
    name, hex_id, b64 = parts
    try:
        return name, bytes.fromhex(hex_id), base64.b64decode(b64, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise UsageError(f"malformed {what} {vkey.strip()!r}: {exc}") from exc


def _check_name(name: str) -> None:
    if not _NAME_RE.match(name):
        raise UsageError(f"invalid key name {name!r}: no spaces or '+' allowed")


class Verifier:
    """Checks signatures of one named Ed25519 key."""

    def __init__(self, name: str, public: bytes) -> None:
        _check_name(name)
        if len(public) != 32:
            raise UsageError("an Ed25519 public key is 32 bytes")
        self.name = name
        self.public = public
        self.key_id = _key_id(name, public)
        self._key = Ed25519PublicKey.from_public_bytes(public)

    @classmethod
    def parse(cls, vkey: str) -> Verifier:
        """Parse a verifier key string ``name+hexid+base64key``."""
        name, key_id, raw = _split_vkey(vkey, "verifier key")
        if len(raw) != 33 or raw[:1] != _ALG_ED25519:
            raise UsageError("verifier key is not an Ed25519 key (algorithm byte 0x01)")
        verifier = cls(name, raw[1:])
        if verifier.key_id != key_id:
            raise UsageError("verifier key id does not match its name and key")
        return verifier

    def vkey(self) -> str:
        b64 = base64.b64encode(_ALG_ED25519 + self.public).decode()
        return f"{self.name}+{self.key_id.hex()}+{b64}"

    def verify(self, message: bytes, signature: bytes) -> bool:
        try:
            self._key.verify(signature, message)
        except InvalidSignature:
            return False
        return True


class Signer:
    """An Ed25519 note signer; the private key never leaves this object."""

    def __init__(self, name: str, key: Ed25519PrivateKey) -> None:
        public = key.public_key().public_bytes(
            serialization.Encoding.Raw, serialization.PublicFormat.Raw
        )
        self.verifier = Verifier(name, public)
        self._key = key

    @property
    def name(self) -> str:
        return self.verifier.name

    @classmethod
    def generate(cls, name: str) -> Signer:
        return cls(name, Ed25519PrivateKey.generate())

    @classmethod
    def load(cls, name: str, path: Path) -> Signer:
        try:
            data = path.read_bytes()
            key = serialization.load_pem_private_key(data, password=None)
        except (OSError, ValueError, TypeError) as exc:
            raise UsageError(f"cannot load the signing key {path}: {exc}") from exc
        if not isinstance(key, Ed25519PrivateKey):
            raise UsageError(f"the signing key {path} is not an Ed25519 key")
        return cls(name, key)

    def save(self, path: Path) -> None:
        """Write the private key, readable by its owner only, never overwriting."""
        pem = self._key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(pem)
            f.flush()
            os.fsync(f.fileno())

    def named(self, name: str) -> Signer:
        """The same key under another name (a key id of its own): one Ed25519 key
        signs each log's checkpoints under that log's origin."""
        return Signer(name, self._key)

    def signature_line(self, text: str, sig: bytes | None = None) -> str:
        if sig is None:
            sig = self._key.sign(text.encode())
        b64 = base64.b64encode(self.verifier.key_id + sig).decode()
        return f"{_EM_DASH} {self.name} {b64}\n"

    def sign_note(self, text: str, *also: Signer) -> str:
        """``text`` as a signed note, signed by this key then by each of ``also``."""
        if not text.endswith("\n") or "\n\n" in text:
            raise ValueError("note text must end in a newline and have no blank line")
        # Ed25519 is deterministic and a note's signature covers the text alone, so
        # a key under two names (``named``) makes the same signature: made once (a
        # checkpoint per batch is signed under its origin and the runtime's name).
        sig = self._key.sign(text.encode())
        lines = "".join(
            s.signature_line(text, sig if s._key is self._key else None) for s in (self, *also)
        )
        return f"{text}\n{lines}"


@dataclass(frozen=True)
class Checkpoint:
    origin: str
    size: int
    root: bytes

    def body(self) -> str:
        return f"{self.origin}\n{self.size}\n{base64.b64encode(self.root).decode()}\n"


def open_note(note: str, verifier: Verifier) -> str:
    """Return the text of a signed note after checking ``verifier``'s signature."""
    text, sep, sigs = note.rpartition("\n\n")
    if not sep or not sigs.endswith("\n"):
        raise VerificationFailed("malformed signed note: no signature block")
    text += "\n"
    for line in sigs[:-1].split("\n"):
        parts = line.split(" ")
        if len(parts) != 3 or parts[0] != _EM_DASH:
            raise VerificationFailed(f"malformed signature line {line!r}")
        _, name, b64 = parts
        if name != verifier.name:
            continue
        try:
            raw = base64.b64decode(b64, validate=True)
        except binascii.Error as exc:
            raise VerificationFailed(f"malformed signature line {line!r}") from exc
        if raw[:4] != verifier.key_id:
            continue
        if verifier.verify(text.encode(), raw[4:]):
            return text
        raise VerificationFailed(f"the signature of {name} on the note is not valid")
    raise VerificationFailed(f"the note carries no signature by {verifier.vkey()}")


def parse_checkpoint(text: str) -> Checkpoint:
    lines = text.split("\n")
    if len(lines) < 4 or lines[-1] != "":
        raise VerificationFailed("malformed checkpoint body")
    origin, size_s, root_b64 = lines[0], lines[1], lines[2]
    if not origin or not size_s.isdigit() or (size_s != "0" and size_s.startswith("0")):
        raise VerificationFailed("malformed checkpoint: bad origin or size line")
    try:
        root = base64.b64decode(root_b64, validate=True)
    except binascii.Error as exc:
        raise VerificationFailed("malformed checkpoint: bad root hash") from exc
    if len(root) != 32:
        raise VerificationFailed("malformed checkpoint: root hash is not 32 bytes")
    return Checkpoint(origin, int(size_s), root)


def open_checkpoint(note: str, verifier: Verifier, origin: str | None = None) -> Checkpoint:
    """Verify a signed checkpoint and return it; optionally require its origin.

    The runtime's one key signs a checkpoint twice, under the log's origin and
    under the trust domain's name (what older checkpoints carry): ``verifier`` may
    be either line. The other signature of the same key, when present, must be
    valid too, so an altered signature is caught whichever line the caller holds."""
    text = open_note(note, verifier)
    cp = parse_checkpoint(text)
    if origin is not None and cp.origin != origin:
        raise VerificationFailed(f"checkpoint is for log {cp.origin!r}, expected {origin!r}")
    for name in {cp.origin, cp.origin.split("/", 1)[0]} - {verifier.name}:
        if _NAME_RE.match(name):
            _check_signatures(note, text, Verifier(name, verifier.public))
    return cp


def _check_signatures(note: str, text: str, verifier: Verifier) -> None:
    """Every signature line of ``verifier`` (its name and key id) on ``note`` verifies."""
    for line in note[len(text) + 1 : -1].split("\n"):
        parts = line.split(" ")
        if len(parts) != 3 or parts[1] != verifier.name:
            continue
        try:
            raw = base64.b64decode(parts[2], validate=True)
        except binascii.Error as exc:
            raise VerificationFailed(f"malformed signature line {line!r}") from exc
        if raw[:4] == verifier.key_id and not verifier.verify(text.encode(), raw[4:]):
            raise VerificationFailed(f"the signature of {verifier.name} on the note is not valid")


# -- C2SP tlog-cosignature (https://c2sp.org/tlog-cosignature), Ed25519 ------------
#
# * key id: SHA-256(name || 0x0A || 0x04 || public key)[:4] (0x04, not the note's 0x01);
# * verifier key: ``<name>+<hex key id>+<base64(0x04 || public key)>``;
# * signed message: ``cosignature/v1\ntime <T>\n`` then the checkpoint body;
# * signature line: ``— <name> <base64(key id || big-endian u64 T || signature)>``.

_ALG_COSIGNATURE = b"\x04"
COSIGNATURE_HEADER = "cosignature/v1"


def _cosigner_key_id(name: str, public: bytes) -> bytes:
    return hashlib.sha256(name.encode() + b"\n" + _ALG_COSIGNATURE + public).digest()[:4]


def cosigned_message(body: str, timestamp: int) -> bytes:
    """The bytes an Ed25519 cosigner signs for ``body`` (a checkpoint note's text)."""
    return f"{COSIGNATURE_HEADER}\ntime {timestamp}\n{body}".encode()


class CosignatureVerifier:
    """Checks the timestamped cosignatures of one named Ed25519 cosigner (a witness)."""

    def __init__(self, name: str, public: bytes) -> None:
        _check_name(name)
        if len(public) != 32:
            raise UsageError("an Ed25519 public key is 32 bytes")
        self.name = name
        self.public = public
        self.key_id = _cosigner_key_id(name, public)
        self._key = Ed25519PublicKey.from_public_bytes(public)

    @classmethod
    def parse(cls, vkey: str) -> CosignatureVerifier:
        """Parse a cosigner's verifier key ``name+hexid+base64(0x04 || key)``."""
        name, key_id, raw = _split_vkey(vkey, "witness key")
        if len(raw) != 33 or raw[:1] != _ALG_COSIGNATURE:
            raise UsageError(
                "not a witness key: a cosignature/v1 key has the algorithm byte 0x04",
                hint="a witness prints its key at 'proctor witness init' and 'witness show'",
            )
        verifier = cls(name, raw[1:])
        if verifier.key_id != key_id:
            raise UsageError("witness key id does not match its name and key")
        return verifier

    def vkey(self) -> str:
        b64 = base64.b64encode(_ALG_COSIGNATURE + self.public).decode()
        return f"{self.name}+{self.key_id.hex()}+{b64}"

    def check_line(self, body: str, line: str) -> int | None:
        """The timestamp of ``line`` if it is this cosigner's valid cosignature of
        ``body``; None if the line is another key's. A line of this key (name and
        key id) whose signature fails raises: such a note is malformed."""
        parts = line.split(" ")
        if len(parts) != 3 or parts[0] != _EM_DASH or parts[1] != self.name:
            return None
        try:
            raw = base64.b64decode(parts[2], validate=True)
        except binascii.Error:
            return None
        if len(raw) != 4 + 8 + 64 or raw[:4] != self.key_id:
            return None
        timestamp = int.from_bytes(raw[4:12], "big")
        try:
            self._key.verify(raw[12:], cosigned_message(body, timestamp))
        except InvalidSignature:
            raise VerificationFailed(
                f"the cosignature of witness {self.name} on the checkpoint is not valid"
            ) from None
        return timestamp


class Cosigner:
    """A witness's Ed25519 cosigning key; the private key never leaves this object."""

    def __init__(self, name: str, key: Ed25519PrivateKey) -> None:
        public = key.public_key().public_bytes(
            serialization.Encoding.Raw, serialization.PublicFormat.Raw
        )
        self.verifier = CosignatureVerifier(name, public)
        self._key = key

    @property
    def name(self) -> str:
        return self.verifier.name

    @classmethod
    def generate(cls, name: str) -> Cosigner:
        return cls(name, Ed25519PrivateKey.generate())

    @classmethod
    def load(cls, name: str, path: Path) -> Cosigner:
        return cls(name, Signer.load(name, path)._key)

    def save(self, path: Path) -> None:
        Signer(self.name, self._key).save(path)

    def cosign(self, body: str, timestamp: int) -> str:
        """One signature line (with its newline) cosigning the checkpoint ``body``."""
        if not 0 < timestamp < 1 << 63:
            raise ValueError("a cosignature's timestamp is a positive POSIX time")
        sig = self._key.sign(cosigned_message(body, timestamp))
        raw = self.verifier.key_id + timestamp.to_bytes(8, "big") + sig
        return f"{_EM_DASH} {self.name} {base64.b64encode(raw).decode()}\n"


def split_note(note: str) -> tuple[str, list[str]]:
    """A signed note's text (with its final newline) and its signature lines."""
    text, sep, sigs = note.rpartition("\n\n")
    if not sep or not sigs.endswith("\n"):
        raise VerificationFailed("malformed signed note: no signature block")
    return text + "\n", sigs[:-1].split("\n")


def add_signatures(note: str, lines: list[str]) -> str:
    """``note`` with signature ``lines`` appended, each once (a cosigned checkpoint)."""
    text, have = split_note(note)
    for given in lines:
        line = given.rstrip("\n")
        if line and line not in have:
            have.append(line)
    return text + "\n" + "\n".join(have) + "\n"


def cosigned_by(note: str, witnesses: list[CosignatureVerifier]) -> dict[str, int]:
    """Each witness (by verifier key) with a valid cosignature on ``note``: its timestamp."""
    text, lines = split_note(note)
    found: dict[str, int] = {}
    for witness in witnesses:
        for line in lines:
            timestamp = witness.check_line(text, line)
            if timestamp is not None:
                found[witness.vkey()] = timestamp
                break
    return found


def require_cosignatures(note: str, witness_keys: list[str], quorum: int) -> dict[str, int]:
    """Refuse a checkpoint without ``quorum`` valid cosignatures from ``witness_keys``."""
    witnesses: dict[str, CosignatureVerifier] = {}
    for vkey in witness_keys:
        try:
            w = CosignatureVerifier.parse(vkey)
        except UsageError as exc:
            raise UsageError(f"--witness: {exc.message}", hint=exc.hint) from exc
        witnesses[w.vkey()] = w
    if not 1 <= quorum <= len(witnesses):
        raise UsageError(
            f"a witness quorum of {quorum} needs between 1 and {len(witnesses)} distinct witnesses",
            hint="give one --witness KEY per witness you trust, and a --witness-quorum K "
            "no larger than their number",
        )
    found = cosigned_by(note, list(witnesses.values()))
    if len(found) < quorum:
        cp = parse_checkpoint(split_note(note)[0])
        names = ", ".join(sorted(CosignatureVerifier.parse(k).name for k in found)) or "none"
        raise VerificationFailed(
            f"the checkpoint of size {cp.size} of {cp.origin} carries {len(found)} valid "
            f"cosignature(s) from the given witnesses ({names}); the policy needs {quorum}",
            hint="the witnesses refuse a checkpoint inconsistent with one they saw: a forked or "
            "rolled-back log gets no cosignature; an honest one may just not be submitted yet",
        )
    return found
