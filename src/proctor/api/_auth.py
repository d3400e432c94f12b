"""Who is calling: a principal's bearer token (``pt_…``) or an OIDC JWT.

A JWT is accepted only from a configured issuer, for the configured audience,
signed by a key of that issuer's JWKS with one of the issuer's algorithms
(never ``none``, never an HMAC: a public key must not double as a shared
secret), and not expired. Its claims then name a principal of one tenant by
configuration: the name from ``principal_claim``, the roles from
``roles_claim`` through ``role_map`` or, failing that, from the stored
principal of that name.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jwt

from proctor.api._errors import unauthenticated
from proctor.errors import NotFound, UsageError
from proctor.governance import AGENT_ROLE, ROLES, AuthenticationFailed, Principal
from proctor.runtime import Runtime

_NAME_RE = re.compile(r"^[a-z][a-z0-9._-]{0,62}$")
# Asymmetric only: with an HMAC algorithm allowed, a published public key could
# be used as the shared secret to forge tokens.
_ALLOWED_ALGS = frozenset(
    {"RS256", "RS384", "RS512", "PS256", "PS384", "PS512", "ES256", "ES384", "ES512", "EdDSA"}
)
_JWKS_TTL = 300.0
_JWKS_MIN_REFRESH = 10.0


@dataclass(frozen=True)
class OIDCIssuer:
    """One trusted OIDC issuer and how its tokens' claims become a principal."""

    issuer: str
    audience: str
    tenant: str
    jwks_url: str | None = None
    jwks_file: Path | None = None
    principal_claim: str = "sub"
    roles_claim: str | None = None
    role_map: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    algorithms: tuple[str, ...] = ("RS256", "ES256", "EdDSA")
    leeway_seconds: int = 30
    #: Offer this issuer on the console's sign-in page; the console is then an OIDC
    #: client whose client id is ``audience`` (the ID token's audience).
    console: bool = False
    console_client_secret: str | None = field(default=None, repr=False)
    console_label: str = ""

    def __post_init__(self) -> None:
        if (self.jwks_url is None) == (self.jwks_file is None):
            raise UsageError(f"OIDC issuer {self.issuer}: give exactly one of jwks_url, jwks_file")
        bad = [a for a in self.algorithms if a not in _ALLOWED_ALGS]
        if bad or not self.algorithms:
            raise UsageError(
                f"OIDC issuer {self.issuer}: algorithms must be some of "
                f"{', '.join(sorted(_ALLOWED_ALGS))}; got {', '.join(bad) or 'none'}"
            )
        for claim_value, roles in self.role_map.items():
            unknown = [r for r in roles if r not in ROLES]
            if unknown:
                raise UsageError(
                    f"OIDC issuer {self.issuer}: role_map[{claim_value!r}] names unknown "
                    f"roles {', '.join(unknown)}"
                )


def load_oidc_config(path: Path) -> list[OIDCIssuer]:
    """Issuers from a JSON file: ``{"issuers": [{"issuer", "audience", "tenant", ...}]}``."""
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
        issuers = raw["issuers"]
        if not isinstance(issuers, list):
            raise TypeError("issuers must be a list")
        out = []
        for item in issuers:
            role_map = {str(k): tuple(v) for k, v in dict(item.get("role_map", {})).items()}
            jwks_file = item.get("jwks_file")
            if jwks_file is not None and not Path(jwks_file).is_absolute():
                jwks_file = path.parent / jwks_file
            out.append(
                OIDCIssuer(
                    issuer=str(item["issuer"]),
                    audience=str(item["audience"]),
                    tenant=str(item["tenant"]),
                    jwks_url=item.get("jwks_url"),
                    jwks_file=Path(jwks_file) if jwks_file is not None else None,
                    principal_claim=str(item.get("principal_claim", "sub")),
                    roles_claim=item.get("roles_claim"),
                    role_map=role_map,
                    algorithms=tuple(item.get("algorithms", ("RS256", "ES256", "EdDSA"))),
                    leeway_seconds=int(item.get("leeway_seconds", 30)),
                    console=bool(item.get("console", False)),
                    console_client_secret=_secret(item.get("console_client_secret_file"), path),
                    console_label=str(item.get("console_label", "")),
                )
            )
        return out
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise UsageError(f"the OIDC configuration {path} is unusable: {exc}") from exc


def _secret(name: Any, config: Path) -> str | None:
    """The console's OIDC client secret, read from its own file (never inline in
    the configuration, which may be shared or committed)."""
    if name is None:
        return None
    path = Path(str(name))
    path = path if path.is_absolute() else config.parent / path
    return path.read_text(encoding="utf-8").strip() or None


class _KeySet:
    """One issuer's JWKS: read from a file, or fetched from a URL and cached; an
    unknown key id triggers one refetch (key rotation), at most every few seconds."""

    def __init__(self, issuer: OIDCIssuer) -> None:
        self._issuer = issuer
        self._keys: dict[str | None, jwt.PyJWK] = {}
        self._fetched = 0.0
        self._lock = threading.Lock()

    def _load(self) -> None:
        if self._issuer.jwks_file is not None:
            text = self._issuer.jwks_file.read_text(encoding="utf-8")
        else:
            import httpx

            assert self._issuer.jwks_url is not None
            resp = httpx.get(self._issuer.jwks_url, timeout=5.0, follow_redirects=False)
            resp.raise_for_status()
            text = resp.text
        keys: dict[str | None, jwt.PyJWK] = {}
        for jwk in jwt.PyJWKSet.from_json(text).keys:
            keys[jwk.key_id] = jwk
        self._keys = keys
        self._fetched = time.monotonic()

    def key(self, kid: str | None) -> jwt.PyJWK:
        with self._lock:
            age = time.monotonic() - self._fetched
            stale = age > _JWKS_TTL or (kid not in self._keys and age > _JWKS_MIN_REFRESH)
            if not self._keys or stale:
                try:
                    self._load()
                except Exception as exc:
                    raise unauthenticated(
                        f"the signing keys of {self._issuer.issuer} cannot be read"
                    ) from exc
            if kid is None and len(self._keys) == 1:
                return next(iter(self._keys.values()))
            found = self._keys.get(kid)
        if found is None:
            raise unauthenticated("the token is signed with a key its issuer does not publish")
        return found


class Authenticator:
    def __init__(self, rt: Runtime, issuers: Sequence[OIDCIssuer] = ()) -> None:
        self._rt = rt
        self._issuers = {i.issuer: i for i in issuers}
        self._keys = {i.issuer: _KeySet(i) for i in issuers}

    def authenticate(self, authorization: str | None) -> Principal:
        if not authorization:
            raise unauthenticated("this needs a bearer token (Authorization: Bearer …)")
        scheme, _, token = authorization.partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            raise unauthenticated("the Authorization header must be 'Bearer <token>'")
        if token.startswith("pt_"):
            try:
                return self._rt.principals.authenticate(token)
            except AuthenticationFailed as exc:
                # Never echo the token; the principal's own message names no secret.
                raise unauthenticated(exc.message) from exc
        if token.count(".") == 2:
            return self._jwt(token)
        raise unauthenticated("the token is neither a Proctor token nor a JWT")

    def _jwt(self, token: str) -> Principal:
        try:
            header = jwt.get_unverified_header(token)
            unverified = jwt.decode(token, options={"verify_signature": False})
        except jwt.PyJWTError as exc:
            raise unauthenticated("the JWT is malformed") from exc
        alg = header.get("alg")
        iss = unverified.get("iss")
        issuer = self._issuers.get(iss) if isinstance(iss, str) else None
        if issuer is None:
            raise unauthenticated("the JWT's issuer is not trusted here")
        if not isinstance(alg, str) or alg not in issuer.algorithms:
            raise unauthenticated(f"the JWT's algorithm {alg!r} is not accepted from this issuer")
        kid = header.get("kid")
        key = self._keys[issuer.issuer].key(kid if isinstance(kid, str) else None)
        try:
            claims: dict[str, Any] = jwt.decode(
                token,
                key=key,
                algorithms=list(issuer.algorithms),
                audience=issuer.audience,
                issuer=issuer.issuer,
                leeway=issuer.leeway_seconds,
                options={"require": ["exp", "iss", "aud"]},
            )
        except jwt.ExpiredSignatureError as exc:
            raise unauthenticated("the JWT has expired") from exc
        except jwt.InvalidAudienceError as exc:
            raise unauthenticated("the JWT is not meant for this audience") from exc
        except jwt.InvalidIssuerError as exc:
            raise unauthenticated("the JWT's issuer is not trusted here") from exc
        except jwt.InvalidSignatureError as exc:
            raise unauthenticated("the JWT's signature does not verify") from exc
        except jwt.PyJWTError as exc:
            raise unauthenticated(f"the JWT is refused: {type(exc).__name__}") from exc
        return self._principal(issuer, claims)

    def _principal(self, issuer: OIDCIssuer, claims: Mapping[str, Any]) -> Principal:
        raw = claims.get(issuer.principal_claim)
        name = raw.lower() if isinstance(raw, str) else None
        if name is None or not _NAME_RE.match(name):
            raise unauthenticated(
                f"the JWT's {issuer.principal_claim!r} claim does not name a valid principal"
            )
        stored: Principal | None
        try:
            stored = self._rt.principals.get(issuer.tenant, name)
        except NotFound:
            stored = None
        if stored is not None and stored.disabled:
            raise unauthenticated(f"principal {stored.id} is disabled")
        roles: tuple[str, ...] = ()
        if issuer.roles_claim is not None:
            values = claims.get(issuer.roles_claim, [])
            if isinstance(values, str):
                values = [values]
            mapped: set[str] = set()
            for v in values if isinstance(values, list) else []:
                mapped.update(issuer.role_map.get(str(v), ()))
            roles = tuple(sorted(mapped))
        elif stored is not None:
            roles = stored.roles
        kind = stored.kind if stored is not None else "user"
        # An agent's rights are its kind's whatever a token's claims map to (an approver
        # role would not let it approve: Cedar forbids the Agent type; it is not given);
        # and nobody else holds the agent role.
        roles = (AGENT_ROLE,) if kind == "agent" else tuple(r for r in roles if r != AGENT_ROLE)
        if not roles:
            raise unauthenticated("the JWT's claims map to no role here")
        responsible = stored.responsible if stored is not None else None
        return Principal(issuer.tenant, name, kind, roles, responsible=responsible)
