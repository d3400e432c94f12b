"""The console's sessions kept in the store, so that any node of a home answers a
person's next page (issue 19: no node affinity).

Each row is keyed by a hash (of the session id, of the sign-in's state) and
holds the session sealed with a key derived from the home's runtime key, which
every node of the home has: what a row carries (the principal's token or ID
token the session acts with) is nothing to whoever reads the store without
that key. Used on stores that several nodes share; one node keeps them in its
memory (``console.MemoryShelf``).
"""

from __future__ import annotations

import base64
import json
from typing import Any

from cryptography.fernet import Fernet, InvalidToken

from proctor.runtime import Runtime

_PURPOSE = "proctor/console-sessions/v1"
_LOCK = "console-sessions"


class StoreShelf:
    def __init__(self, rt: Runtime) -> None:
        self._store = rt.store
        self._fernet = Fernet(base64.urlsafe_b64encode(rt.keys.derive(_PURPOSE)))

    def _seal(self, doc: dict[str, Any]) -> bytes:
        return self._fernet.encrypt(json.dumps(doc).encode())

    def _open(self, sealed: Any) -> dict[str, Any] | None:
        try:
            doc: dict[str, Any] = json.loads(self._fernet.decrypt(bytes(sealed)))
        except (InvalidToken, ValueError, TypeError):
            return None  # sealed with another home's key, or damaged: no session
        return doc

    def load(self, key: str) -> dict[str, Any] | None:
        with self._store.read() as conn:
            row = conn.query_one("SELECT doc FROM console_sessions WHERE key = ?", (key,))
        return None if row is None else self._open(row[0])

    def save(self, key: str, doc: dict[str, Any]) -> None:
        with self._store.write(_LOCK) as conn:
            conn.execute(
                "INSERT INTO console_sessions (key, doc, seen_at, expires_at) VALUES (?, ?, ?, ?)"
                " ON CONFLICT (key) DO UPDATE SET doc = excluded.doc, seen_at = excluded.seen_at,"
                " expires_at = excluded.expires_at",
                (key, self._seal(doc), float(doc["seen_at"]), float(doc["expires_at"])),
            )

    def drop(self, key: str) -> None:
        with self._store.write(_LOCK) as conn:
            conn.execute("DELETE FROM console_sessions WHERE key = ?", (key,))

    def drop_expired(self, idle: float, now: float) -> None:
        from proctor.console import PENDING_TTL

        with self._store.write(_LOCK) as conn:
            conn.execute(
                "DELETE FROM console_sessions WHERE seen_at < ? OR expires_at <= ?",
                (now - idle, now),
            )
            conn.execute("DELETE FROM console_signins WHERE created < ?", (now - PENDING_TTL,))

    def put_pending(self, state: str, doc: dict[str, Any]) -> None:
        with self._store.write(_LOCK) as conn:
            conn.execute(
                "INSERT INTO console_signins (key, doc, created) VALUES (?, ?, ?)",
                (_hash(state), self._seal(doc), float(doc["created"])),
            )

    def pop_pending(self, state: str) -> dict[str, Any] | None:
        with self._store.write(_LOCK) as conn:
            row = conn.query_one("SELECT doc FROM console_signins WHERE key = ?", (_hash(state),))
            if row is None:
                return None
            conn.execute("DELETE FROM console_signins WHERE key = ?", (_hash(state),))
        return self._open(row[0])

    def pending_count(self, since: float) -> int:
        with self._store.read() as conn:
            row = conn.query_one("SELECT COUNT(*) FROM console_signins WHERE created >= ?",
                                 (since,))  # fmt: skip
        return 0 if row is None else int(row[0])


def _hash(state: str) -> str:
    import hashlib

    return hashlib.sha256(state.encode()).hexdigest()
