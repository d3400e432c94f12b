"""OpenID Connect sign-in for the console: the authorization code flow with PKCE
(RFC 7636, S256), a ``state`` bound to the browser that started it, and a
``nonce`` checked in the ID token. The ID token itself is then the session's
credential: the API verifies it exactly as it verifies any JWT (issuer, audience,
signature, expiry) and maps its claims to a principal, so the console holds no
second idea of who someone is."""

from __future__ import annotations

import base64
import hashlib
import secrets
import threading
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlencode

import httpx
import jwt

from proctor.errors import ProctorError, UsageError


@dataclass(frozen=True)
class SignInProvider:
    """An issuer people may sign in with. ``client_id`` is the audience the API
    accepts for that issuer's tokens."""

    issuer: str
    client_id: str
    client_secret: str | None = None
    label: str = ""
    scope: str = "openid profile email"

    @property
    def shown(self) -> str:
        return self.label or self.issuer


class SignInFailed(ProctorError):
    """An OIDC sign-in that cannot complete (said to the person, nothing leaks)."""


#: Discovery documents by issuer, with when they were fetched: a sign-in page is
#: open to anyone, and each start must not become a request to the provider.
_DISCOVERED: dict[str, tuple[float, dict[str, Any]]] = {}
_DISCOVERY_TTL = 300.0
_lock = threading.Lock()


def _discover(issuer: str) -> dict[str, Any]:
    with _lock:
        kept = _DISCOVERED.get(issuer)
    if kept is not None and time.monotonic() - kept[0] < _DISCOVERY_TTL:
        return kept[1]
    doc = _fetch_discovery(issuer)
    with _lock:
        _DISCOVERED[issuer] = (time.monotonic(), doc)
    return doc


def _fetch_discovery(issuer: str) -> dict[str, Any]:
    url = issuer.rstrip("/") + "/.well-known/openid-configuration"
    try:
        resp = httpx.get(url, timeout=5.0, follow_redirects=False)
        resp.raise_for_status()
        doc: dict[str, Any] = resp.json()
    except (httpx.HTTPError, ValueError) as exc:
        raise SignInFailed(f"the identity provider {issuer} cannot be reached") from exc
    if str(doc.get("issuer", "")).rstrip("/") != issuer.rstrip("/"):
        raise SignInFailed(f"the identity provider at {issuer} names another issuer")
    for key in ("authorization_endpoint", "token_endpoint"):
        if not isinstance(doc.get(key), str):
            raise SignInFailed(f"the identity provider {issuer} publishes no {key}")
    return doc


def pkce_pair() -> tuple[str, str]:
    verifier = secrets.token_urlsafe(48)
    digest = hashlib.sha256(verifier.encode("ascii")).digest()
    challenge = base64.urlsafe_b64encode(digest).rstrip(b"=").decode("ascii")
    return verifier, challenge


def authorization_url(
    provider: SignInProvider, redirect_uri: str, state: str, nonce: str, challenge: str
) -> str:
    doc = _discover(provider.issuer)
    query = urlencode({
        "response_type": "code", "client_id": provider.client_id,
        "redirect_uri": redirect_uri, "scope": provider.scope, "state": state,
        "nonce": nonce, "code_challenge": challenge, "code_challenge_method": "S256",
    })  # fmt: skip
    endpoint = str(doc["authorization_endpoint"])
    return endpoint + ("&" if "?" in endpoint else "?") + query


def exchange(
    provider: SignInProvider, code: str, redirect_uri: str, verifier: str, nonce: str
) -> tuple[str, float]:
    """The ID token for ``code`` and when it expires (epoch seconds). Its signature
    is checked by the API when the session first uses it; here only what binds it to
    this sign-in: the nonce, the audience, the issuer."""
    if not code or len(code) > 2048:
        raise UsageError("the identity provider's answer carries no usable code")
    doc = _discover(provider.issuer)
    form = {"grant_type": "authorization_code", "code": code, "redirect_uri": redirect_uri,
            "code_verifier": verifier, "client_id": provider.client_id}  # fmt: skip
    auth = (provider.client_id, provider.client_secret) if provider.client_secret else None
    try:
        resp = httpx.post(str(doc["token_endpoint"]), data=form, auth=auth, timeout=10.0,
                          follow_redirects=False)  # fmt: skip
        body = resp.json()
    except (httpx.HTTPError, ValueError) as exc:
        raise SignInFailed(f"the identity provider {provider.issuer} did not answer") from exc
    if resp.status_code != 200 or not isinstance(body, dict):
        why = body.get("error", resp.status_code) if isinstance(body, dict) else resp.status_code
        raise SignInFailed(f"the identity provider refused the sign-in ({why})")
    token = body.get("id_token")
    if not isinstance(token, str):
        raise SignInFailed("the identity provider returned no ID token")
    try:
        # Read, not trusted: the API verifies the signature before anything is shown.
        claims = jwt.decode(token, options={"verify_signature": False})
    except jwt.PyJWTError as exc:
        raise SignInFailed("the identity provider's ID token is malformed") from exc
    if not secrets.compare_digest(str(claims.get("nonce", "")), nonce):
        raise SignInFailed("the ID token does not belong to this sign-in (nonce)")
    aud = claims.get("aud")
    if provider.client_id not in (aud if isinstance(aud, list) else [aud]):
        raise SignInFailed("the ID token is meant for another client")
    if str(claims.get("iss", "")).rstrip("/") != provider.issuer.rstrip("/"):
        raise SignInFailed("the ID token names another issuer")
    exp = claims.get("exp")
    if not isinstance(exp, int | float) or exp <= time.time():
        raise SignInFailed("the ID token has expired")
    return token, float(exp)
