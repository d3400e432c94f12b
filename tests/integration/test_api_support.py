"""Shared set-up for the API tests: a real home, two tenants with one principal per
role, and the real API under uvicorn on a loopback port. No tests here."""

from __future__ import annotations

import textwrap
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from proctor.api import ApiServer, Limits, OIDCIssuer, serve_api
from proctor.runtime import Runtime, init_home

ROLES = ("developer", "approver", "auditor", "admin")
TENANTS = ("acme", "globex")
# One principal per role, named for it; "bob" is a second approver (quorum, SoD).
PEOPLE = {"dev": "developer", "alice": "approver", "aud": "auditor", "root": "admin",
          "bob": "approver"}  # fmt: skip


@dataclass
class ApiEnv:
    home: Path
    rt: Runtime
    server: ApiServer
    tokens: dict[tuple[str, str], str] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return self.server.url

    def token(self, tenant: str, name: str) -> str:
        return self.tokens[(tenant, name)]

    def http(self, tenant: str = "acme", name: str = "root", **kw: object) -> httpx.Client:
        headers = {"Authorization": f"Bearer {self.token(tenant, name)}"}
        return httpx.Client(base_url=self.url, headers=headers, timeout=30, **kw)  # type: ignore[arg-type]

    def events(self, tenant: str) -> list[dict[str, object]]:
        import json

        return [json.loads(e) for e in self.rt.ledger.entries(tenant)]


def artifact_dir(parent: Path, name: str = "hello", body: str = "print('hello')\n") -> Path:
    d = parent / f"art-{name}"
    d.mkdir(parents=True)
    (d / "main.py").write_text(body)
    (d / "proctor.toml").write_text(
        textwrap.dedent(
            f"""\
            [artifact]
            name = "{name}"
            entrypoint = ["python3", "main.py"]
            purpose = "testing {name}"
            """
        )
    )
    for f in d.iterdir():
        f.chmod(0o644)
    return d


def build_env(
    tmp: Path,
    *,
    oidc: tuple[OIDCIssuer, ...] = (),
    limits: Limits | None = None,
    certfile: Path | None = None,
    keyfile: Path | None = None,
) -> ApiEnv:
    home = tmp / "home"
    init_home(home)
    rt = Runtime.open(home)
    tokens = {}
    for t in TENANTS:
        rt.tenants.create(t, rt.operator)
        for name, role in PEOPLE.items():
            _, tok = rt.principals.create(t, name, "user", [role], rt.operator)
            tokens[(t, name)] = tok
    server = serve_api(rt, "127.0.0.1", 0, oidc=oidc, limits=limits, certfile=certfile,
                       keyfile=keyfile)  # fmt: skip
    return ApiEnv(home, rt, server, tokens)


@pytest.fixture(scope="module")
def api_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ApiEnv]:
    env = build_env(tmp_path_factory.mktemp("api"))
    yield env
    env.server.stop()
    env.rt.close()


def self_signed(tmp: Path) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 (its own CA) and its key, as PEM files in ``tmp``."""
    import datetime as dt
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = dt.datetime.now(dt.UTC)
    cert = (
        x509.CertificateBuilder().subject_name(name).issuer_name(name)
        .public_key(key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=1))
        .not_valid_after(now + dt.timedelta(hours=1))
        .add_extension(x509.SubjectAlternativeName(
            [x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )  # fmt: skip
    certfile, keyfile = tmp / "cert.pem", tmp / "key.pem"
    certfile.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    keyfile.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                        serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))  # fmt: skip
    return certfile, keyfile
