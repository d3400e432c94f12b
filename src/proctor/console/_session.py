"""Console sessions, held on the server.

The browser holds only a random session id in a cookie (``HttpOnly``,
``SameSite=Strict``, ``Secure`` under TLS); the credential the session acts with
(a principal's token or an OIDC ID token) never leaves this process. Only a hash
of the id is kept, so the table itself opens no session. A session ends at its
idle timeout, at its absolute lifetime, when its ID token expires, or at sign-out;
a restart of ``serve`` ends every session (nothing of them is written to disk).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import threading
import time
from dataclasses import dataclass, field

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
    seen_at: float = field(default_factory=time.monotonic)
    flash: list[tuple[str, str]] = field(default_factory=list)

    def csrf_ok(self, given: str | None) -> bool:
        return given is not None and hmac.compare_digest(given.encode(), self.csrf.encode())

    def has(self, *roles: str) -> bool:
        return bool(set(roles) & set(self.roles))


@dataclass
class PendingSignIn:
    issuer: str
    state: str
    nonce: str
    verifier: str
    browser: str  # hash of the LOGIN_COOKIE value
    created: float


class Sessions:
    """Sessions by hashed id; ``idle`` and ``lifetime`` in seconds."""

    def __init__(self, idle: float = 900.0, lifetime: float = 8 * 3600.0) -> None:
        self.idle = idle
        self.lifetime = lifetime
        self._by_key: dict[str, Session] = {}
        self._pending: dict[str, PendingSignIn] = {}
        self._lock = threading.Lock()

    def open(self, session: Session) -> str:
        token = secrets.token_urlsafe(32)
        session.expires_at = min(session.expires_at, time.time() + self.lifetime)
        with self._lock:
            self._sweep()
            self._by_key[_key(token)] = session
        return token

    def get(self, token: str | None) -> Session | None:
        if not token or len(token) > 128:
            return None
        with self._lock:
            session = self._by_key.get(_key(token))
            if session is None:
                return None
            now = time.monotonic()
            if now - session.seen_at > self.idle or time.time() >= session.expires_at:
                del self._by_key[_key(token)]
                return None
            session.seen_at = now
            return session

    def close(self, token: str | None) -> None:
        if token:
            with self._lock:
                self._by_key.pop(_key(token), None)

    def close_all(self, tenant: str, principal: str) -> int:
        """End every session of one principal (its token was rotated or disabled)."""
        with self._lock:
            gone = [k for k, s in self._by_key.items()
                    if s.tenant == tenant and s.principal == principal]  # fmt: skip
            for k in gone:
                del self._by_key[k]
        return len(gone)

    #: OIDC sign-ins under way at once (each lasts at most ten minutes).
    PENDING_CAP = 10_000

    def room(self) -> bool:
        with self._lock:
            self._sweep()
            return len(self._pending) < self.PENDING_CAP

    def begin(self, pending: PendingSignIn) -> None:
        with self._lock:
            self._sweep()
            self._pending[pending.state] = pending

    def finish(self, state: str, browser: str | None) -> PendingSignIn | None:
        """The sign-in ``state`` names, once, if this browser started it."""
        with self._lock:
            pending = self._pending.pop(state, None)
        if pending is None or browser is None:
            return None
        if not hmac.compare_digest(pending.browser, _key(browser)):
            return None
        if time.monotonic() - pending.created > 600:
            return None
        return pending

    def _sweep(self) -> None:
        now, wall = time.monotonic(), time.time()
        for k in [k for k, s in self._by_key.items()
                  if now - s.seen_at > self.idle or wall >= s.expires_at]:  # fmt: skip
            del self._by_key[k]
        for k in [k for k, p in self._pending.items() if now - p.created > 600]:
            del self._pending[k]


def browser_key(value: str) -> str:
    return _key(value)
