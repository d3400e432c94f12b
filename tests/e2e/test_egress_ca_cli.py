"""Private upstreams (issue 17, item 4) through the real CLI, the API and the SDK:
``proctor egress ca add -t T HOST --ca-file F``, ``ca list``, ``ca remove``.

What is tried: bad input of every kind (a leaf certificate, a key in the file, an
expired CA, garbage, an address, a wildcard, a port, an unknown tenant) is one
clear line and changes neither the store nor the log; a developer is refused and
recorded; one tenant cannot touch another's; a registration altered in the store
(an attacker's CA put in place of the registered one) is refused, not trusted; the
runtime's broker lookup reads what was registered.
"""

from __future__ import annotations

import datetime
import json
import sqlite3
from collections.abc import Iterator
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from proctor.api import ApiServer, serve_api
from proctor.client import Client
from proctor.errors import ControlDenied, NotFound, UsageError
from proctor.governance import EgressCAError
from tests.conftest import run_cli
from tests.e2e.conftest_gov import Gov, build_gov


def make_cert(
    cn: str, *, ca: bool = True, days: int = 30, key: ec.EllipticCurvePrivateKey | None = None
) -> tuple[bytes, bytes]:
    """(certificate PEM, key PEM), self-signed; ``days`` < 0 for one already expired."""
    key = key or ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])
    now = datetime.datetime.now(datetime.UTC)
    start = now - datetime.timedelta(days=max(1, -days) + 1)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), False)
        .sign(key, hashes.SHA256())
    )
    key_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    return cert.public_bytes(serialization.Encoding.PEM), key_pem


def fingerprint(pem: bytes) -> str:
    return x509.load_pem_x509_certificate(pem).fingerprint(hashes.SHA256()).hex()


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Gov, ApiServer]]:
    gov = build_gov(tmp_path_factory.mktemp("egress-ca"))
    server = serve_api(gov.rt, "127.0.0.1", 0)
    yield gov, server
    server.stop()
    gov.rt.close()


def _state(gov: Gov) -> tuple[object, int]:
    """What a refused command must leave as it was: the row and the log's size."""
    with sqlite3.connect(gov.home / "proctor.db") as db:
        row = db.execute("SELECT value FROM meta WHERE key = 'egress_cas:acme'").fetchone()
    return row, len(list(gov.rt.ledger.entries("acme")))


def test_the_cli_adds_lists_and_removes(served: tuple[Gov, ApiServer], tmp_path: Path) -> None:
    gov, _ = served
    first, _ = make_cert("acme private CA 1")
    second, _ = make_cert("acme private CA 2")
    (tmp_path / "one.pem").write_bytes(first)
    (tmp_path / "two.pem").write_bytes(second)
    out = run_cli("egress", "ca", "add", "-t", "acme", "Private.CLI.Test.", "--ca-file",
                  str(tmp_path / "one.pem"), "--json", home=gov.home)  # fmt: skip
    doc = json.loads(out.out)
    assert doc["host"] == "private.cli.test"  # normalized as egress entries are
    assert [c["fingerprint"] for c in doc["cas"]] == [fingerprint(first)]
    assert doc["cas"][0]["subject"] == "CN=acme private CA 1"
    run_cli("egress", "ca", "add", "-t", "acme", "private.cli.test", "--ca-file",
            str(tmp_path / "two.pem"), home=gov.home)  # fmt: skip
    listed = json.loads(run_cli("egress", "ca", "list", "-t", "acme", "--json",
                                home=gov.home).out)  # fmt: skip
    mine = next(e for e in listed if e["host"] == "private.cli.test")
    assert [c["fingerprint"] for c in mine["cas"]] == [fingerprint(first), fingerprint(second)]
    # The broker's lookup (runtime.make_broker hands it to the proxy) reads them.
    pem = gov.rt.egress_cas.pem_for("acme", "private.cli.test")
    assert pem is not None and first in pem and second in pem
    assert gov.rt.egress_cas.pem_for("globex", "private.cli.test") is None
    # Each change is one event in the tenant's log, with the fingerprints, never a PEM.
    events = [json.loads(e) for e in gov.rt.ledger.entries("acme")]
    adds = [e for e in events if e["action"] == "egress.ca.add"
            and e["resource"] == "egress-ca/private.cli.test"]  # fmt: skip
    assert [e["details"]["fingerprints"] for e in adds] == [
        [fingerprint(first)],
        [fingerprint(first), fingerprint(second)],
    ]
    assert all(b"BEGIN CERTIFICATE" not in json.dumps(e).encode() for e in adds)
    text = run_cli("egress", "ca", "list", "-t", "acme", home=gov.home).out
    assert fingerprint(second) in text and "private.cli.test" in text
    # Rotation: the old one removed by fingerprint, then the host altogether.
    out = run_cli("egress", "ca", "remove", "-t", "acme", "private.cli.test", "--fingerprint",
                  fingerprint(first), "--json", home=gov.home)  # fmt: skip
    assert [c["fingerprint"] for c in json.loads(out.out)["cas"]] == [fingerprint(second)]
    assert gov.rt.egress_cas.pem_for("acme", "private.cli.test") == second
    run_cli("egress", "ca", "remove", "-t", "acme", "private.cli.test", home=gov.home)
    assert gov.rt.egress_cas.pem_for("acme", "private.cli.test") is None
    removes = [json.loads(e) for e in gov.rt.ledger.entries("acme")]
    removes = [e for e in removes if e["action"] == "egress.ca.remove"]
    assert [e["details"]["removed"] for e in removes] == [[fingerprint(first)],
                                                          [fingerprint(second)]]  # fmt: skip


def test_bad_input_is_one_line_and_changes_nothing(
    served: tuple[Gov, ApiServer], tmp_path: Path
) -> None:
    gov, _ = served
    good, _ = make_cert("acme good CA")
    leaf, leaf_key = make_cert("private.test", ca=False)
    expired, _ = make_cert("old CA", days=-2)
    files = {
        "leaf.pem": leaf,
        "with-key.pem": good + leaf_key,
        "expired.pem": expired,
        "garbage.pem": b"not a certificate at all\n",
        "broken.pem": b"-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n",
        "csr.pem": b"-----BEGIN CERTIFICATE REQUEST-----\nAAAA\n-----END CERTIFICATE REQUEST-----\n",
        "empty.pem": b"",
        "good.pem": good,
    }
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    cases = {
        "leaf.pem": ("private.test", "is not a CA certificate"),
        "with-key.pem": ("private.test", "holds a private key"),
        "expired.pem": ("private.test", "expired on"),
        "garbage.pem": ("private.test", "holds no PEM certificate"),
        "broken.pem": ("private.test", "cannot be read"),
        "csr.pem": ("private.test", "only CERTIFICATE blocks"),
        "empty.pem": ("private.test", "holds no PEM certificate"),
        "missing.pem": ("private.test", "cannot read"),
    }
    hosts = {
        "127.0.0.1": "is an address",
        "*.private.test": "is not a host name",
        "private.test:8443": "is not a host name",
        "https://private.test/": "is not a host name",
        "bad_name!.test": "is not a host name",
    }
    before = _state(gov)
    tried = [(f, h, why) for f, (h, why) in cases.items()]
    tried += [("good.pem", h, why) for h, why in hosts.items()]
    for file, host, why in tried:
        res = run_cli("egress", "ca", "add", "-t", "acme", host, "--ca-file",
                      str(tmp_path / file), home=gov.home, check=False)  # fmt: skip
        assert res.code != 0, (file, host)
        assert why in res.err, (file, host, res.err)
        assert "Traceback" not in res.err
        assert len(res.err.strip().splitlines()) <= 2, res.err  # the line, and a hint
        assert _state(gov) == before, (file, host)
    res = run_cli("egress", "ca", "add", "-t", "nobody", "private.test", "--ca-file",
                  str(tmp_path / "good.pem"), home=gov.home, check=False)  # fmt: skip
    assert res.code != 0 and "nobody" in res.err and _state(gov) == before
    res = run_cli("egress", "ca", "remove", "-t", "acme", "never.test", home=gov.home, check=False)
    assert res.code != 0 and "no CA certificate is registered for never.test" in res.err
    assert _state(gov) == before


def test_the_api_and_sdk_decide_and_record(served: tuple[Gov, ApiServer]) -> None:
    gov, server = served
    pem, _ = make_cert("acme api CA")
    with Client(server.url, gov.token("root")) as admin:
        doc = admin.add_egress_ca("acme", "private.api.test", pem)
        assert [c["fingerprint"] for c in doc["cas"]] == [fingerprint(pem)]
        listed = admin.egress_cas("acme")
        assert any(e["host"] == "private.api.test" for e in listed)
        with pytest.raises(UsageError, match="is not a CA certificate"):
            admin.add_egress_ca("acme", "private.api.test", make_cert("leaf", ca=False)[0])
        with pytest.raises(UsageError, match="is an address"):
            admin.add_egress_ca("acme", "10.0.0.1", pem)
    # A developer may not choose what a secret's host is verified against.
    before = _state(gov)
    with Client(server.url, gov.token("dev")) as dev, pytest.raises(ControlDenied):
        dev.add_egress_ca("acme", "private.api.test", make_cert("dev's CA")[0])
    with Client(server.url, gov.token("dev")) as dev, pytest.raises(ControlDenied):
        dev.remove_egress_ca("acme", "private.api.test")
    row, size = _state(gov)
    assert row == before[0] and size == before[1] + 2  # two api.request denials, nothing else
    denied = [json.loads(e) for e in gov.rt.ledger.entries("acme")][-2:]
    assert all(e["decision"] == "deny" and e["resource"] == "egress-ca/private.api.test"
               for e in denied)  # fmt: skip
    # Another tenant's admin cannot reach acme's registrations.
    with Client(server.url, gov.token("globex-root")) as other:
        with pytest.raises((ControlDenied, NotFound)):
            other.add_egress_ca("acme", "private.api.test", make_cert("globex CA")[0])
        with pytest.raises((ControlDenied, NotFound)):
            other.egress_cas("acme")
    # The CLI through the server is the same call.
    out = run_cli("--server", server.url, "egress", "ca", "list", "-t", "acme", "--json",
                  "--token", gov.token("root"))  # fmt: skip
    assert any(e["host"] == "private.api.test" for e in json.loads(out.out))
    with Client(server.url, gov.token("root")) as admin:
        left = admin.remove_egress_ca("acme", "private.api.test", fingerprint(pem))
        assert left == {"host": "private.api.test", "cas": []}
        with pytest.raises(NotFound):
            admin.remove_egress_ca("acme", "private.api.test")


def test_a_registration_altered_in_the_store_is_not_trusted(
    served: tuple[Gov, ApiServer], tmp_path: Path
) -> None:
    """Someone who can write the store but not the home's keys puts their own CA in
    place of the registered one: the row's MAC no longer matches, the broker's lookup
    fails (a 502 for every connection it verifies, tests/integration/
    test_private_upstreams.py) and the CLI says so in one line."""
    gov, _ = served
    pem, _ = make_cert("acme real CA")
    (tmp_path / "real.pem").write_bytes(pem)
    run_cli("egress", "ca", "add", "-t", "acme", "tampered.test", "--ca-file",
            str(tmp_path / "real.pem"), home=gov.home)  # fmt: skip
    attacker, _ = make_cert("attacker CA")
    with sqlite3.connect(gov.home / "proctor.db") as db:
        (value,) = db.execute("SELECT value FROM meta WHERE key = 'egress_cas:acme'").fetchone()
        doc = json.loads(value)
        entry = doc["hosts"]["tampered.test"][0]
        entry["pem"], entry["fingerprint"] = attacker.decode(), fingerprint(attacker)
        db.execute("UPDATE meta SET value = ? WHERE key = 'egress_cas:acme'", (json.dumps(doc),))
    try:
        with pytest.raises(EgressCAError, match="changed outside Proctor"):
            gov.rt.egress_cas.pem_for("acme", "tampered.test")
        res = run_cli("egress", "ca", "list", "-t", "acme", home=gov.home, check=False)
        assert res.code != 0 and "changed outside Proctor" in res.err
        assert "Traceback" not in res.err
    finally:
        with sqlite3.connect(gov.home / "proctor.db") as db:
            db.execute("UPDATE meta SET value = ? WHERE key = 'egress_cas:acme'", (value,))
    assert gov.rt.egress_cas.pem_for("acme", "tampered.test") == pem
