"""Private upstreams (issue 17, item 4): a host whose certificate comes from a private
CA, reached through the broker's TLS termination (a secret injected), is verified
against the CA certificates its tenant registered for it, and those alone.

Real HTTPS servers on 127.0.0.1 with certificates the tests issue from their own
CAs (``cryptography``), the real proxy on a real asyncio server, the real ledger.
The attacks tried: a host with a registration still trusted through the default
bundle; a registration for one host trusted for another; a lookup that fails
falling back to the default bundle; a registration removed but still honoured.
"""

from __future__ import annotations

import http.client
import json
import ssl
from collections.abc import Iterator
from pathlib import Path

import pytest

from proctor.broker import SecretBinding
from proctor.errors import ProctorError
from tests.conftest import LedgerEnv
from tests.integration.test_broker_proxy import (
    SECRET_VALUE,
    TENANT,
    Env,
    Upstream,
    UpstreamCA,
    proxy_env,
)

PLACEHOLDER = "proctor-secret:crm_token"


class Registry:
    """What the store answers for ``(tenant, host)`` (the runtime's
    ``EgressCAs.pem_for``); counts the lookups."""

    def __init__(self) -> None:
        self.pems: dict[tuple[str, str], bytes] = {}
        self.lookups = 0
        self.broken = False

    def __call__(self, tenant: str, host: str) -> bytes | None:
        self.lookups += 1
        if self.broken:
            raise ProctorError("the store is unavailable")
        return self.pems.get((tenant, host))


@pytest.fixture
def env(ledger_env: LedgerEnv, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Env]:
    gen = proxy_env(ledger_env, tmp_path, monkeypatch)
    env = next(gen)
    private = UpstreamCA.make()
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(private.issue(["private.test"], tmp_path / "private.pem"))
    upstream = Upstream(ctx)
    env.resolver.answers["private.test"] = [["127.0.0.1"]]
    registry = Registry()
    env.proxy.upstream_trust = registry
    env.extra.update(private=private, upstream=upstream, registry=registry)
    yield env
    upstream.shutdown()
    upstream.server_close()
    with pytest.raises(StopIteration):
        next(gen)


def _fingerprint(ca: UpstreamCA) -> str:
    from cryptography.hazmat.primitives import hashes

    return ca.cert.fingerprint(hashes.SHA256()).hex()


def _call(env: Env, host: str, port: int) -> tuple[int, bytes]:
    """One GET through an injected tunnel to ``host``: (status, body); a refused
    CONNECT is (status, its JSON body)."""
    env.scope([f"{host}:{port}"], secrets=["crm_token"],
              bindings=[SecretBinding(name="crm_token", value=SECRET_VALUE, hosts=(host,))])  # fmt: skip
    ctx = ssl.create_default_context(cadata=env.proxy.tenant_ca(TENANT).ca_pem().decode())
    conn = http.client.HTTPSConnection("127.0.0.1", env.harness.port, context=ctx, timeout=10)
    conn.set_tunnel(host, port)
    try:
        conn.request("GET", "/private", headers={"Authorization": f"Bearer {PLACEHOLDER}"})
        resp = conn.getresponse()
        return resp.status, resp.read()
    except OSError as exc:  # the tunnel refused: http.client keeps only the status line
        text = str(exc)
        return int(text.split("Tunnel connection failed: ")[1].split(" ", maxsplit=1)[0]), b""
    finally:
        conn.close()


def _end(env: Env) -> dict[str, object]:
    ends = [e for e in env.events() if e["action"] == "http.request.end"]
    assert len(ends) == 1
    details: dict[str, object] = ends[0]["details"]
    return details


def test_a_private_upstream_fails_without_a_registration(env: Env) -> None:
    """Today's behaviour, kept: neither the default bundle nor the proxy's
    ``upstream_cafile`` knows the private CA, so the broker answers 502 and records why."""
    up: Upstream = env.extra["upstream"]
    status, _ = _call(env, "private.test", up.port)
    assert status == 502
    assert up.seen == []
    end = _end(env)
    assert "did not verify" in str(end["error"]) and end["answered"] == 502
    assert "trust" not in end


def test_a_private_upstream_verifies_with_its_registered_ca(env: Env) -> None:
    up: Upstream = env.extra["upstream"]
    private: UpstreamCA = env.extra["private"]
    env.extra["registry"].pems[(TENANT, "private.test")] = private.pem()
    status, body = _call(env, "private.test", up.port)
    assert status == 200 and body == b"hello GET /private 0"
    assert [s["headers"]["Authorization"] for s in up.seen] == [f"Bearer {SECRET_VALUE}"]
    # The completion event names the anchor that verified the upstream.
    assert _end(env)["trust"] == f"tenant-ca:{_fingerprint(private)}"


def test_another_ca_registered_fails_and_is_recorded(env: Env) -> None:
    """The registered CA is the host's only anchor: a certificate from any other CA
    is refused, even one the default bundle (here ``upstream_cafile``) would accept.
    Before the fix the proxy verified every host against the default bundle."""
    other = UpstreamCA.make()
    registry = env.extra["registry"]
    registry.pems[(TENANT, "private.test")] = other.pem()
    # api.test's certificate is from the CA of the proxy's upstream_cafile.
    registry.pems[(TENANT, "api.test")] = other.pem()
    for host, up in (("private.test", env.extra["upstream"]), ("api.test", env.api)):
        status, _ = _call(env, host, up.port)
        assert status == 502, host
        assert up.seen == []  # the secret went nowhere
        events = env.events()
        end = [e for e in events if e["action"] == "http.request.end"][-1]["details"]
        assert end["answered"] == 502
        assert "did not verify" in end["error"]
        assert f"registered for {host} only: sha256:{_fingerprint(other)[:16]}" in end["error"]
        assert "trust" not in end
    raw = b"".join(env.raw_events())
    assert SECRET_VALUE.encode() not in raw


def test_a_host_without_a_registration_keeps_the_default_trust(env: Env) -> None:
    private: UpstreamCA = env.extra["private"]
    # Registered for private.test only: not for api.test, nor for a name below it.
    env.extra["registry"].pems[(TENANT, "private.test")] = private.pem()
    status, _ = _call(env, "api.test", env.api.port)
    assert status == 200
    assert _end(env)["trust"] == "upstream-cafile"


def test_a_registration_belongs_to_its_tenant(env: Env) -> None:
    """Another tenant's registration for the same name is not this tenant's anchor."""
    up: Upstream = env.extra["upstream"]
    env.extra["registry"].pems[("globex", "private.test")] = env.extra["private"].pem()
    status, _ = _call(env, "private.test", up.port)
    assert status == 502
    assert up.seen == []


def test_a_lookup_that_fails_fails_closed(env: Env) -> None:
    """A store that cannot be read is a 502, never the default bundle in its place."""
    registry = env.extra["registry"]
    registry.broken = True
    status, _ = _call(env, "api.test", env.api.port)  # the default bundle would verify it
    assert status == 502
    assert env.api.seen == []
    assert "cannot be read" in str(_end(env)["error"])


def test_a_removed_registration_is_not_honoured(env: Env) -> None:
    """The trust is read for each connection: a CA removed is not trusted on the next."""
    up: Upstream = env.extra["upstream"]
    registry = env.extra["registry"]
    registry.pems[(TENANT, "private.test")] = env.extra["private"].pem()
    assert _call(env, "private.test", up.port)[0] == 200
    del registry.pems[(TENANT, "private.test")]
    assert _call(env, "private.test", up.port)[0] == 502
    assert len(up.seen) == 1


def test_rotation_two_cas_registered_names_the_one_that_verified(env: Env) -> None:
    up: Upstream = env.extra["upstream"]
    private: UpstreamCA = env.extra["private"]
    newer = UpstreamCA.make()
    env.extra["registry"].pems[(TENANT, "private.test")] = newer.pem() + private.pem()
    status, _ = _call(env, "private.test", up.port)
    assert status == 200
    assert _end(env)["trust"] == f"tenant-ca:{_fingerprint(private)}"


def test_every_request_of_a_tunnel_is_verified_against_the_same_anchor(env: Env) -> None:
    """An injected tunnel opens one upstream connection per request: each is held to
    the registered CA (two requests, two verified connections, one trust read)."""
    up: Upstream = env.extra["upstream"]
    registry = env.extra["registry"]
    registry.pems[(TENANT, "private.test")] = env.extra["private"].pem()
    env.scope([f"private.test:{up.port}"], secrets=["crm_token"],
              bindings=[SecretBinding(name="crm_token", value=SECRET_VALUE,
                                      hosts=("private.test",))])  # fmt: skip
    ctx = ssl.create_default_context(cadata=env.proxy.tenant_ca(TENANT).ca_pem().decode())
    conn = http.client.HTTPSConnection("127.0.0.1", env.harness.port, context=ctx, timeout=10)
    conn.set_tunnel("private.test", up.port)
    for path in ("/one", "/two"):
        conn.request("GET", path)
        assert conn.getresponse().read() == f"hello GET {path} 0".encode()
    conn.close()
    assert up.connections == 2 and registry.lookups == 1
    end = _end(env)
    assert end["requests"] == 2 and str(end["trust"]).startswith("tenant-ca:")
    assert json.dumps(end).count("tenant-ca:") == 1
