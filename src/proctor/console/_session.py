"""Console sessions, held on the server.

The browser holds only a random session id in a cookie (``HttpOnly``,
``SameSite=Strict``, ``Secure`` under TLS); the credential the session acts with
(a principal's token or an OIDC ID token) never leaves this process. Only a hash
of the id is kept, so the table itself opens no session. A session ends at its
idle timeout, at its absolute lifetime, when its ID token expires, or at sign-out.

Where sessions are kept is a :class:`Shelf`: this process's memory by default
(a restart of ``serve`` ends every session), or the store every node of a
PostgreSQL home shares (``proctor.api`` gives one, sealed with the home's
runtime key), so that a person's next page may be answered by any node.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

COOKIE = "proctor_session"
#: The short-lived cookie that binds an OIDC sign-in's answer to the browser that
#: started it (a code delivered to another browser is refused).
LOGIN_COOKIE = "proctor_signin"


def _key(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


@dataclass
class Session:
    tenant: str
    principal: str
    roles: tuple[str, ...]
    credential: str
    via: str  # "token" or the OIDC issuer
    expires_at: float  # absolute: the lifetime, or the ID token's expiry
    csrf: str = field(default_factory=lambda: secrets.token_urlsafe(32))
    seen_at: float = field(default_factory=time.time)
    flash: list[tuple[str, str]] = field(default_factory=list)

    def csrf_ok(self, given: str | None) -> bool:
        return given is not None and hmac.compare_digest(given.encode(), self.csrf.encode())

    def has(self, *roles: str) -> bool:
        return bool(set(roles) & set(self.roles))

    def doc(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_doc(cls, doc: dict[str, Any]) -> Session:
        return cls(
            str(doc["tenant"]), str(doc["principal"]), tuple(doc["roles"]),
            str(doc["credential"]), str(doc["via"]), float(doc["expires_at"]),
            str(doc["csrf"]), float(doc["seen_at"]),
            [(str(k), str(m)) for k, m in doc.get("flash", [])],
        )  # fmt: skip


@dataclass
class PendingSignIn:
    issuer: str
    state: str
    nonce: str
    verifier: str
    browser: str  # hash of the LOGIN_COOKIE value
    created: float  # epoch seconds


class Shelf(Protocol):
    """Where sessions and sign-ins under way are kept, by hashed id and by state."""

    def load(self, key: str) -> dict[str, Any] | None: ...
    def save(self, key: str, doc: dict[str, Any]) -> None: ...
    def drop(self, key: str) -> None: ...
    def drop_expired(self, idle: float, now: float) -> None: ...
    def put_pending(self, state: str, doc: dict[str, Any]) -> None: ...
    def pop_pending(self, state: str) -> dict[str, Any] | None: ...
    def pending_count(self, since: float) -> int: ...


class MemoryShelf:
    """This process's memory: one node's sessions, gone with it."""

    def __init__(self) -> None:
        self._docs: dict[str, dict[str, Any]] = {}
        self._pending: dict[str, dict[str, Any]] = {}
        self._lock = threading.Lock()

    def load(self, key: str) -> dict[str, Any] | None:
        with self._lock:
            doc = self._docs.get(key)
            return None if doc is None else dict(doc)

    def save(self, key: str, doc: dict[str, Any]) -> None:
        with self._lock:
            self._docs[key] = dict(doc)

    def drop(self, key: str) -> None:
        with self._lock:
            self._docs.pop(key, None)

    def drop_expired(self, idle: float, now: float) -> None:
        with self._lock:
            for k in [k for k, d in self._docs.items()
                      if now - d["seen_at"] > idle or now >= d["expires_at"]]:  # fmt: skip
                del self._docs[k]
            for k in [k for k, p in self._pending.items() if now - p["created"] > PENDING_TTL]:
                del self._pending[k]

    def put_pending(self, state: str, doc: dict[str, Any]) -> None:
        with self._lock:
            self._pending[state] = dict(doc)

    def pop_pending(self, state: str) -> dict[str, Any] | None:
        with self._lock:
            return self._pending.pop(state, None)

    def pending_count(self, since: float) -> int:
        with self._lock:
            return sum(1 for p in self._pending.values() if p["created"] >= since)


#: How long an OIDC sign-in may take, from start to callback.
PENDING_TTL = 600.0
#: A session's last-seen time is written back at most this often (on a shared
#: shelf, a write per page would be a write per click).
_TOUCH = 15.0


class Sessions:
    """Sessions by hashed id; ``idle`` and ``lifetime`` in seconds."""

    #: OIDC sign-ins under way at once (each lasts at most ten minutes).
    PENDING_CAP = 10_000

    def __init__(
        self, idle: float = 900.0, lifetime: float = 8 * 3600.0, shelf: Shelf | None = None
    ) -> None:
        self.idle = idle
        self.lifetime = lifetime
        self.shelf: Shelf = shelf or MemoryShelf()
        self._swept = 0.0

    def open(self, session: Session) -> str:
        token = secrets.token_urlsafe(32)
        session.expires_at = min(session.expires_at, time.time() + self.lifetime)
        session.seen_at = time.time()
        self._sweep()
        self.shelf.save(_key(token), session.doc())
        return token

    def get(self, token: str | None) -> Session | None:
        if not token or len(token) > 128:
            return None
        doc = self.shelf.load(_key(token))
        if doc is None:
            return None
        session = Session.from_doc(doc)
        now = time.time()
        if now - session.seen_at > self.idle or now >= session.expires_at:
            self.shelf.drop(_key(token))
            return None
        if now - session.seen_at > min(_TOUCH, self.idle / 4):
            session.seen_at = now
            self.shelf.save(_key(token), session.doc())
        else:
            session.seen_at = now
        return session

    def save(self, token: str | None, session: Session) -> None:
        """Keep what a request changed of the session (its flash messages), unless
        the request ended it."""
        if token and self.shelf.load(_key(token)) is not None:
            self.shelf.save(_key(token), session.doc())

    def close(self, token: str | None) -> None:
        if token:
            self.shelf.drop(_key(token))

    def room(self) -> bool:
        self._sweep()
        return self.shelf.pending_count(time.time() - PENDING_TTL) < self.PENDING_CAP

    def begin(self, pending: PendingSignIn) -> None:
        self._sweep()
        self.shelf.put_pending(pending.state, asdict(pending))

    def finish(self, state: str, browser: str | None) -> PendingSignIn | None:
        """The sign-in ``state`` names, once, if this browser started it."""
        doc = self.shelf.pop_pending(state) if state else None
        if doc is None or browser is None:
            return None
        pending = PendingSignIn(**doc)
        if not hmac.compare_digest(pending.browser, _key(browser)):
            return None
        if time.time() - pending.created > PENDING_TTL:
            return None
        return pending

    def _sweep(self) -> None:
        now = time.time()
        if now - self._swept > 30.0:
            self._swept = now
            self.shelf.drop_expired(self.idle, now)


def browser_key(value: str) -> str:
    return _key(value)
