"""A C2SP tlog-witness (https://c2sp.org/tlog-witness): its key, its state, and
the ``add-checkpoint`` decision.

State lives in ``<state>/witness.db`` (SQLite, ``synchronous=FULL``): per log
origin, the verifier keys it trusts and the last checkpoint it cosigned. The key
is ``<state>/witness.pem`` (mode 0600). A checkpoint is cosigned only if it is
signed by a trusted key of its origin and consistent with the last one cosigned;
the update is a compare-and-swap on (size, root), so of two requests from the
same old size only one can advance the witness, and the record is durable before
the cosignature is returned.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import sqlite3
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, closing, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from proctor.errors import AlreadyExists, NotFound, ProctorError, UsageError
from proctor.ledger import (
    Cosigner,
    Verifier,
    add_signatures,
    parse_checkpoint,
    split_note,
    verify_consistency,
)

KEY_FILE = "witness.pem"
DB_FILE = "witness.db"
#: The spec lets a client send at most 63 proof lines.
MAX_PROOF = 63
#: A request body larger than this is refused unread (a checkpoint is a few lines).
MAX_BODY = 64 * 1024
EMPTY_ROOT = hashlib.sha256(b"").digest()
SIZE_TYPE = "text/x.tlog.size"

_SCHEMA = [
    "CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)",
    # The last checkpoint cosigned per origin; a new log starts at size 0, the empty root.
    """CREATE TABLE IF NOT EXISTS logs (
        origin TEXT PRIMARY KEY,
        size INTEGER NOT NULL,
        root BLOB NOT NULL,
        note TEXT,
        updated TEXT
    )""",
    """CREATE TABLE IF NOT EXISTS log_keys (
        origin TEXT NOT NULL REFERENCES logs (origin),
        vkey TEXT NOT NULL,
        PRIMARY KEY (origin, vkey)
    )""",
]


@dataclass(frozen=True)
class Answer:
    """An HTTP answer of the witness: status, content type, body."""

    status: int
    body: bytes = b""
    content_type: str = "text/plain; charset=utf-8"


def _text(status: int, message: str) -> Answer:
    return Answer(status, (message + "\n").encode())


@dataclass(frozen=True)
class LogState:
    origin: str
    keys: tuple[str, ...]
    size: int
    root: bytes
    updated: str | None

    def as_json(self) -> dict[str, Any]:
        return {
            "origin": self.origin,
            "keys": list(self.keys),
            "size": self.size,
            "root": base64.b64encode(self.root).decode(),
            "updated": self.updated,
        }


@contextmanager
def _open_db(state: Path) -> Iterator[sqlite3.Connection]:
    """A connection of its own per use, in one immediate transaction: the
    compare-and-swap is then real between threads (and processes) sharing the state."""
    try:
        conn = sqlite3.connect(state / DB_FILE, timeout=30, isolation_level=None)
    except sqlite3.Error as exc:
        raise UsageError(f"cannot open the witness state in {state}: {exc}") from exc
    with closing(conn):
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=FULL")
        conn.execute("BEGIN IMMEDIATE")
        try:
            for stmt in _SCHEMA:
                conn.execute(stmt)
            yield conn
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        conn.execute("COMMIT")


class Witness:
    """One witness, opened from its state directory."""

    def __init__(self, state: Path, cosigner: Cosigner, clock: Any = time.time) -> None:
        self.state = state
        self.cosigner = cosigner
        self._clock = clock

    # -- making and opening ---------------------------------------------------

    @classmethod
    def init(cls, state: Path, name: str) -> Witness:
        """Make a new witness in ``state``: its key and an empty state database."""
        cosigner = Cosigner.generate(name)
        state.mkdir(parents=True, exist_ok=True)
        if (state / KEY_FILE).exists() or (state / DB_FILE).exists():
            raise AlreadyExists(
                f"{state} holds a witness already",
                hint="'proctor witness show --state DIR' prints its key",
            )
        cosigner.save(state / KEY_FILE)
        witness = cls(state, cosigner)
        with witness._db() as db:
            db.execute("INSERT INTO meta (key, value) VALUES ('name', ?)", (name,))
        return witness

    @classmethod
    def open(cls, state: Path) -> Witness:
        if not (state / DB_FILE).is_file() or not (state / KEY_FILE).is_file():
            raise NotFound(
                f"no witness in {state}",
                hint="make one with 'proctor witness init --state DIR --name NAME'",
            )
        with _open_db(state) as db:
            row = db.execute("SELECT value FROM meta WHERE key = 'name'").fetchone()
        if row is None:
            raise UsageError(f"the witness state in {state} has no name: it is damaged")
        return cls(state, Cosigner.load(str(row[0]), state / KEY_FILE))

    def _db(self) -> AbstractContextManager[sqlite3.Connection]:
        return _open_db(self.state)

    # -- configuration --------------------------------------------------------

    @property
    def vkey(self) -> str:
        return self.cosigner.verifier.vkey()

    def add_log(self, origin: str, vkey: str) -> LogState:
        """Trust ``vkey`` to sign checkpoints of ``origin`` (a new origin starts at size 0)."""
        if not origin or any(c.isspace() for c in origin):
            raise UsageError(f"invalid log origin {origin!r}: one line without spaces")
        verifier = Verifier.parse(vkey)
        with self._db() as db:
            db.execute(
                "INSERT OR IGNORE INTO logs (origin, size, root) VALUES (?, 0, ?)",
                (origin, EMPTY_ROOT),
            )
            db.execute(
                "INSERT OR IGNORE INTO log_keys (origin, vkey) VALUES (?, ?)",
                (origin, verifier.vkey()),
            )
        return self.log(origin)

    def logs(self) -> list[LogState]:
        with self._db() as db:
            origins = [str(r[0]) for r in db.execute("SELECT origin FROM logs ORDER BY origin")]
        return [self.log(o) for o in origins]

    def log(self, origin: str) -> LogState:
        with self._db() as db:
            row = db.execute(
                "SELECT size, root, updated FROM logs WHERE origin = ?", (origin,)
            ).fetchone()
            keys = [
                str(r[0])
                for r in db.execute(
                    "SELECT vkey FROM log_keys WHERE origin = ? ORDER BY vkey", (origin,)
                )
            ]
        if row is None:
            raise NotFound(f"the witness knows no log {origin!r}")
        return LogState(origin, tuple(keys), int(row[0]), bytes(row[1]), row[2])

    def checkpoint(self, origin_hash: str) -> str | None:
        """The last checkpoint cosigned of the log whose origin hashes to
        ``origin_hash``, with the log's signatures and a cosignature made now.

        Cosigning it again is what a witness may always do for the newest checkpoint
        it holds (the cosignature's time says: as of then, this was consistent with
        everything cosigned before); a fresh time lets a verifier refuse an old
        answer replayed by whoever controls the path to the witness."""
        with self._db() as db:
            for origin, note in db.execute("SELECT origin, note FROM logs WHERE note IS NOT NULL"):
                if hashlib.sha256(str(origin).encode()).hexdigest() == origin_hash:
                    text, lines = split_note(str(note))
                    kept = [ln for ln in lines if not self._own_line(ln)]
                    fresh = self.cosigner.cosign(text, max(1, int(self._clock())))
                    return text + "\n" + "\n".join([*kept, fresh.rstrip("\n")]) + "\n"
        return None

    def _own_line(self, line: str) -> bool:
        """Whether a signature line is this witness's (its name and key id)."""
        parts = line.split(" ")
        if len(parts) != 3 or parts[1] != self.cosigner.name:
            return False
        try:
            raw = base64.b64decode(parts[2], validate=True)
        except binascii.Error:
            return False
        return raw[:4] == self.cosigner.verifier.key_id

    # -- add-checkpoint --------------------------------------------------------

    def add_checkpoint(self, body: bytes) -> Answer:
        """Decide one ``add-checkpoint`` request, as the spec orders the checks."""
        try:
            text = body.decode("utf-8")
        except UnicodeDecodeError:
            return _text(400, "the request is not UTF-8")
        head, sep, note = text.partition("\n\n")
        if not sep:
            return _text(400, "no empty line between the old size and the checkpoint")
        lines = head.split("\n")
        old_text = lines[0][4:] if lines[0].startswith("old ") else ""
        if not old_text.isdigit() or (old_text != "0" and old_text.startswith("0")):
            return _text(400, "the first line must be 'old <size>' without leading zeroes")
        old = int(old_text)
        if len(lines) - 1 > MAX_PROOF:
            return _text(400, f"more than {MAX_PROOF} consistency proof lines")
        try:
            proof = [base64.b64decode(h, validate=True) for h in lines[1:]]
        except binascii.Error:
            return _text(400, "a consistency proof line is not base64")
        if any(len(h) != 32 for h in proof):
            return _text(400, "a consistency proof line is not a 32-byte hash")
        try:
            note_text, sig_lines = split_note(note)
            checkpoint = parse_checkpoint(note_text)
        except ProctorError as exc:
            return _text(400, exc.message)
        with self._db() as db:
            row = db.execute(
                "SELECT size, root FROM logs WHERE origin = ?", (checkpoint.origin,)
            ).fetchone()
            keys = [
                Verifier.parse(str(r[0]))
                for r in db.execute(
                    "SELECT vkey FROM log_keys WHERE origin = ?", (checkpoint.origin,)
                )
            ]
        if row is None:
            return _text(404, f"unknown log origin {checkpoint.origin!r}")
        signed = self._log_signed(note_text, sig_lines, keys)
        if signed is not None:
            return signed
        if old > checkpoint.size:
            return _text(400, f"old size {old} is larger than the checkpoint's {checkpoint.size}")
        size, root = int(row[0]), bytes(row[1])
        if old != size:
            return Answer(409, f"{size}\n".encode(), SIZE_TYPE)
        if checkpoint.size == 0 and checkpoint.root != EMPTY_ROOT:
            return _text(422, "a checkpoint of size 0 must have the empty tree's root")
        if old == 0 and proof:
            return _text(422, "a consistency proof from size 0 must be empty")
        if old == checkpoint.size and checkpoint.root != root:
            return _text(422, f"another root for size {old}, which the witness cosigned: a fork")
        if 0 < old < checkpoint.size:
            try:
                verify_consistency(old, checkpoint.size, root, checkpoint.root, proof)
            except ProctorError as exc:
                return _text(422, f"the consistency proof does not verify: {exc.message}")
        cosignature = self.cosigner.cosign(note_text, max(1, int(self._clock())))
        stored = add_signatures(note, [cosignature])
        with self._db() as db:
            # Compare-and-swap: only the request that still sees the (size, root) it
            # checked against advances the witness; the others get 409 and the new size.
            cur = db.execute(
                "UPDATE logs SET size = ?, root = ?, note = ?, updated = ?"
                " WHERE origin = ? AND size = ? AND root = ?",
                (
                    checkpoint.size,
                    checkpoint.root,
                    stored,
                    time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                    checkpoint.origin,
                    size,
                    root,
                ),
            )
            if cur.rowcount != 1:
                now = db.execute(
                    "SELECT size FROM logs WHERE origin = ?", (checkpoint.origin,)
                ).fetchone()
                return Answer(409, f"{int(now[0])}\n".encode(), SIZE_TYPE)
        return Answer(200, cosignature.encode())

    @staticmethod
    def _log_signed(text: str, lines: list[str], keys: list[Verifier]) -> Answer | None:
        """403 unless a trusted key of the origin signed; signatures of unknown keys
        are ignored, a failing one of a trusted key refuses the note."""
        valid = False
        for line in lines:
            parts = line.split(" ")
            if len(parts) != 3 or parts[0] != "\u2014":
                return _text(400, "malformed signature line")
            for key in keys:
                if parts[1] != key.name:
                    continue
                try:
                    raw = base64.b64decode(parts[2], validate=True)
                except binascii.Error:
                    return _text(400, "malformed signature line")
                if raw[:4] != key.key_id:
                    continue
                if not key.verify(text.encode(), raw[4:]):
                    return _text(403, f"the signature of {key.name} does not verify")
                valid = True
        if not valid:
            return _text(403, "no signature from a key the witness trusts for this log")
        return None
