"""OIDC JWTs: accepted only when issued by a configured issuer, for our audience,
signed by one of its published keys with an accepted asymmetric algorithm, and not
expired. Each refusal is tested with keys made here."""

from __future__ import annotations

import base64
import http.server
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jwt
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from proctor.api import OIDCIssuer, load_oidc_config
from tests.integration.test_api_support import ApiEnv, build_env

ISSUER = "https://idp.example.test"
AUDIENCE = "proctor-api"


def _jwk(key: ec.EllipticCurvePrivateKey, kid: str) -> dict[str, Any]:
    doc: dict[str, Any] = jwt.algorithms.ECAlgorithm.to_jwk(key.public_key(), as_dict=True)
    return {**doc, "kid": kid, "alg": "ES256", "use": "sig"}


@pytest.fixture(scope="module")
def keys() -> dict[str, ec.EllipticCurvePrivateKey]:
    return {"good": ec.generate_private_key(ec.SECP256R1()),
            "rogue": ec.generate_private_key(ec.SECP256R1()),
            "url": ec.generate_private_key(ec.SECP256R1())}  # fmt: skip


class _JwksHandler(http.server.BaseHTTPRequestHandler):
    body = b""

    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *_: object) -> None:
        pass


@pytest.fixture(scope="module")
def oidc_env(
    tmp_path_factory: pytest.TempPathFactory, keys: dict[str, ec.EllipticCurvePrivateKey]
) -> Iterator[ApiEnv]:
    tmp = tmp_path_factory.mktemp("oidc")
    (tmp / "jwks.json").write_text(json.dumps({"keys": [_jwk(keys["good"], "k1")]}))
    _JwksHandler.body = json.dumps({"keys": [_jwk(keys["url"], "u1")]}).encode()
    jwks_server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _JwksHandler)
    threading.Thread(target=jwks_server.serve_forever, daemon=True).start()
    config = {
        "issuers": [
            {"issuer": ISSUER, "audience": AUDIENCE, "tenant": "acme", "jwks_file": "jwks.json",
             "principal_claim": "preferred_username", "roles_claim": "groups",
             "role_map": {"proctor-auditors": ["auditor"], "proctor-devs": ["developer"]},
             "algorithms": ["ES256"]},
            {"issuer": "https://ci.example.test", "audience": AUDIENCE, "tenant": "acme",
             "jwks_url": f"http://127.0.0.1:{jwks_server.server_port}/jwks",
             "algorithms": ["ES256"]},
        ]
    }  # fmt: skip
    (tmp / "oidc.json").write_text(json.dumps(config))
    env = build_env(tmp, oidc=tuple(load_oidc_config(tmp / "oidc.json")))
    yield env
    env.server.stop()
    env.rt.close()
    jwks_server.shutdown()


def _token(key: Any, *, alg: str = "ES256", kid: str = "k1", **claims: Any) -> str:
    now = int(time.time())
    body = {"iss": ISSUER, "aud": AUDIENCE, "iat": now, "exp": now + 300,
            "preferred_username": "carol", "groups": ["proctor-auditors"], **claims}  # fmt: skip
    body = {k: v for k, v in body.items() if v is not None}
    return jwt.encode(body, key, algorithm=alg, headers={"kid": kid})


def _call(env: ApiEnv, token: str, path: str = "/whoami") -> httpx.Response:
    return httpx.get(f"{env.url}{path}", headers={"Authorization": f"Bearer {token}"})


def _refused(resp: httpx.Response, words: str) -> None:
    assert resp.status_code == 401, resp.text
    err = resp.json()["error"]
    assert err["code"] == "unauthenticated"
    assert words in err["message"], err["message"]


def test_valid_jwt_maps_claims_to_a_principal(oidc_env: ApiEnv, keys: dict[str, Any]) -> None:
    r = _call(oidc_env, _token(keys["good"]))
    assert r.status_code == 200, r.text
    assert r.json() == {"tenant": "acme", "name": "carol", "kind": "user", "roles": ["auditor"],
                        "disabled": False, "responsible": None}  # fmt: skip
    assert _call(oidc_env, _token(keys["good"]), "/tenants/acme/events?limit=1").status_code == 200
    # The mapped role decides: an auditor may not submit or approve.
    assert _call(oidc_env, _token(keys["good"]), "/tenants/acme/quorum").status_code == 200
    deny = httpx.put(f"{oidc_env.url}/tenants/acme/quorum", json={"required": 1},
                     headers={"Authorization": f"Bearer {_token(keys['good'])}"})  # fmt: skip
    assert deny.status_code == 403
    # Another tenant is as invisible to a JWT principal as to any other.
    assert _call(oidc_env, _token(keys["good"]), "/tenants/globex").status_code == 404
    # Recorded under the mapped principal.
    assert any(e["actor"] == {"type": "user", "id": "acme/carol"} for e in oidc_env.events("acme"))


def test_jwks_from_url_and_stored_principal_roles(oidc_env: ApiEnv, keys: dict[str, Any]) -> None:
    # No roles_claim for this issuer: the stored principal "dev" gives its roles.
    tok = _token(keys["url"], kid="u1", iss="https://ci.example.test", sub="dev",
                 preferred_username=None, groups=None)  # fmt: skip
    r = _call(oidc_env, tok)
    assert r.status_code == 200 and r.json()["roles"] == ["developer"], r.text
    # An unknown subject there has no role: refused.
    tok = _token(keys["url"], kid="u1", iss="https://ci.example.test", sub="nobody")
    _refused(_call(oidc_env, tok), "no role")


def test_a_jwt_naming_an_agent_gives_it_the_agent_role_alone(
    oidc_env: ApiEnv, keys: dict[str, Any]
) -> None:
    """Claims cannot widen an agent: whatever its groups map to, a stored agent holds the
    agent role (and Cedar forbids its type approving whatever it holds); a person's
    groups never give the agent role."""
    rt = oidc_env.rt
    rt.principals.create("acme", "jwt-agent", "agent", [], rt.operator, responsible="acme/dev")
    tok = _token(keys["good"], preferred_username="jwt-agent", groups=["proctor-devs"])
    r = _call(oidc_env, tok)
    assert r.status_code == 200, r.text
    assert r.json()["kind"] == "agent" and r.json()["roles"] == ["agent"]
    assert r.json()["responsible"] == "acme/dev"
    deny = httpx.put(f"{oidc_env.url}/tenants/acme/quorum", json={"required": 1},
                     headers={"Authorization": f"Bearer {tok}"})  # fmt: skip
    assert deny.status_code == 403


def test_expired(oidc_env: ApiEnv, keys: dict[str, Any]) -> None:
    past = int(time.time()) - 3600
    _refused(_call(oidc_env, _token(keys["good"], exp=past, iat=past - 60)), "expired")


def test_missing_expiry(oidc_env: ApiEnv, keys: dict[str, Any]) -> None:
    r = _call(oidc_env, jwt.encode({"iss": ISSUER, "aud": AUDIENCE, "preferred_username": "carol",
              "groups": ["proctor-auditors"]}, keys["good"], algorithm="ES256",
              headers={"kid": "k1"}))  # fmt: skip
    _refused(r, "refused")


def test_wrong_audience(oidc_env: ApiEnv, keys: dict[str, Any]) -> None:
    _refused(_call(oidc_env, _token(keys["good"], aud="someone-else")), "audience")


def test_wrong_issuer(oidc_env: ApiEnv, keys: dict[str, Any]) -> None:
    _refused(_call(oidc_env, _token(keys["good"], iss="https://evil.example")), "issuer")


def test_alg_none(oidc_env: ApiEnv) -> None:
    def b64(doc: dict[str, Any]) -> str:
        return base64.urlsafe_b64encode(json.dumps(doc).encode()).decode().rstrip("=")

    now = int(time.time())
    claims = {"iss": ISSUER, "aud": AUDIENCE, "exp": now + 300,
              "preferred_username": "carol", "groups": ["proctor-admins", "proctor-auditors"]}  # fmt: skip
    for header in ({"alg": "none"}, {"alg": "None", "kid": "k1"}, {"alg": "none", "kid": "k1"}):
        for sig in ("", "AAAA"):
            _refused(_call(oidc_env, f"{b64(header)}.{b64(claims)}.{sig}"), "algorithm")


def test_wrongly_signed(oidc_env: ApiEnv, keys: dict[str, Any]) -> None:
    # Signed by a key the issuer does not publish, claiming the published key's id.
    _refused(_call(oidc_env, _token(keys["rogue"], kid="k1")), "signature")
    # A key id the issuer does not publish at all.
    _refused(_call(oidc_env, _token(keys["rogue"], kid="k9")), "does not publish")
    # A valid token with one claim changed after signing.
    head, body, sig = _token(keys["good"]).split(".")
    claims = json.loads(base64.urlsafe_b64decode(body + "=="))
    claims["groups"] = ["proctor-devs"]
    forged = base64.urlsafe_b64encode(json.dumps(claims).encode()).decode().rstrip("=")
    _refused(_call(oidc_env, f"{head}.{forged}.{sig}"), "signature")


def test_hmac_with_the_public_key_is_refused(oidc_env: ApiEnv, keys: dict[str, Any]) -> None:
    """Algorithm confusion: HS256 keyed with the issuer's public key must not pass."""
    pem = (
        keys["good"]
        .public_key()
        .public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    )
    import hashlib
    import hmac

    def b64(raw: bytes) -> str:
        return base64.urlsafe_b64encode(raw).decode().rstrip("=")

    now = int(time.time())
    header = b64(json.dumps({"alg": "HS256", "kid": "k1"}).encode())
    body = b64(json.dumps({"iss": ISSUER, "aud": AUDIENCE, "exp": now + 300,
                           "preferred_username": "carol", "groups": ["proctor-auditors"]}).encode())  # fmt: skip
    sig = b64(hmac.new(pem, f"{header}.{body}".encode(), hashlib.sha256).digest())
    _refused(_call(oidc_env, f"{header}.{body}.{sig}"), "algorithm")


def test_disabled_principal_and_bad_names(oidc_env: ApiEnv, keys: dict[str, Any]) -> None:
    oidc_env.rt.principals.create("acme", "mallory", "user", ["auditor"], oidc_env.rt.operator)
    oidc_env.rt.principals.set_disabled("acme", "mallory", True, oidc_env.rt.operator)
    _refused(_call(oidc_env, _token(keys["good"], preferred_username="mallory")), "disabled")
    _refused(_call(oidc_env, _token(keys["good"], preferred_username="../root")), "valid principal")
    _refused(_call(oidc_env, _token(keys["good"], groups=["unmapped"])), "no role")


def test_garbage_tokens(oidc_env: ApiEnv) -> None:
    for token in ("a.b.c", "not-a-token", "pt_", "x" * 5000):
        r = _call(oidc_env, token)
        assert r.status_code == 401 and token[:20] not in r.json()["error"]["message"]


def test_config_refuses_symmetric_algorithms(tmp_path: Path) -> None:
    from proctor.errors import UsageError

    with pytest.raises(UsageError, match="algorithms"):
        OIDCIssuer(ISSUER, AUDIENCE, "acme", jwks_file=tmp_path / "k.json", algorithms=("HS256",))
    with pytest.raises(UsageError, match="none"):
        OIDCIssuer(ISSUER, AUDIENCE, "acme", jwks_file=tmp_path / "k.json", algorithms=())
