"""Per-run tokens: short-lived, bound to the run id and the artifact digest.

The socket is the run's capability; the token is checked on every request as
well, so a socket path that leaks (or a request replayed onto another run's
socket) is not enough. Format: ``pt1.<run>.<expiry>.<base64url HMAC-SHA256>``.

The MAC also covers an ``opening``: a random value the broker draws each time
it opens a run's socket and forgets when it closes it. A token therefore dies
with its socket, before its expiry, even if the same run id were opened again.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import re
import time

_RUN_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


class RunTokens:
    def __init__(self, key: bytes) -> None:
        if len(key) < 32:
            raise ValueError("the token key must be at least 32 bytes")
        self._key = key

    def _mac(self, run: str, artifact: str, expiry: int, opening: str) -> str:
        msg = f"{run}\n{artifact}\n{expiry}\n{opening}".encode()
        digest = hmac.new(self._key, msg, hashlib.sha256).digest()
        return base64.urlsafe_b64encode(digest).decode().rstrip("=")

    def issue(self, run: str, artifact: str, ttl: float, opening: str = "") -> str:
        if not _RUN_RE.match(run):
            raise ValueError(f"invalid run id {run!r}")
        expiry = int(time.time() + ttl)
        return f"pt1.{run}.{expiry}.{self._mac(run, artifact, expiry, opening)}"

    def check(self, token: str, run: str, artifact: str, opening: str = "") -> str | None:
        """None if ``token`` is valid for this run and artifact now, else why not."""
        parts = token.split(".")
        if len(parts) != 4 or parts[0] != "pt1":
            return "malformed token"
        _, tok_run, expiry_s, mac = parts
        if not expiry_s.isdigit():
            return "malformed token"
        expected = self._mac(tok_run, artifact, int(expiry_s), opening)
        if not hmac.compare_digest(mac.encode(), expected.encode()):
            return "token signature does not match this run and artifact"
        if tok_run != run:
            return "token belongs to another run"
        if int(expiry_s) < time.time():
            return "token expired"
        return None
