"""The run's CA bundle as each runtime reads it: the PEM variables (Node's too) and
a Java truststore made from the same bundle when the host has a JRE."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes

from proctor.broker import RunChannel, TenantCA
from proctor.lifecycle import brokered_spec
from proctor.lifecycle._truststore import PASSWORD, java_truststore

SYSTEM = Path("/etc/ssl/certs/ca-certificates.crt")


def _ca_dir(tmp_path: Path) -> tuple[Path, bytes]:
    ca = TenantCA(tmp_path / "ca", "acme").ca_pem(["api.test"])
    d = tmp_path / "bundle"
    d.mkdir()
    system = SYSTEM.read_bytes() if SYSTEM.exists() else b""
    (d / "bundle.pem").write_bytes(system + b"\n" + ca)
    return d, ca


def _channel(tmp_path: Path) -> RunChannel:
    return RunChannel("r1", tmp_path / "b.sock", "tok")


@pytest.mark.skipif(shutil.which("keytool") is None, reason="no JRE on this host")
def test_the_java_truststore_holds_the_tenant_ca_as_a_trusted_entry_and_is_made_once(
    tmp_path: Path,
) -> None:
    d, ca = _ca_dir(tmp_path)
    spec = brokered_spec(
        _channel(tmp_path), ("true",), ca_dir=d, env={"JAVA_TOOL_OPTIONS": "-Xmx64m"}
    )
    stores = list(d.glob("truststore-*.p12"))
    assert len(stores) == 1
    opts = spec.env["JAVA_TOOL_OPTIONS"]
    assert opts.startswith("-Xmx64m "), "the caller's own options are kept"
    assert f"-Djavax.net.ssl.trustStore=/opt/proctor-ca/{stores[0].name}" in opts
    assert "-Djavax.net.ssl.trustStoreType=PKCS12" in opts
    # keytool (Java's own reader) sees the tenant CA as a trusted certificate entry.
    fingerprint = x509.load_pem_x509_certificate(ca).fingerprint(hashes.SHA256())
    listing = subprocess.run(
        ["keytool", "-list", "-keystore", str(stores[0]), "-storetype", "PKCS12",
         "-storepass", PASSWORD],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    wanted = ":".join(f"{b:02X}" for b in fingerprint)
    entries = [line for line in listing.splitlines() if "trustedCertEntry" in line]
    assert wanted in listing and len(entries) >= 1
    assert listing.count("trustedCertEntry") == listing.count("Certificate fingerprint")
    # Made once: a second spec over the same bundle reuses the file as it is.
    before = stores[0].stat().st_mtime_ns
    again = brokered_spec(_channel(tmp_path), ("true",), ca_dir=d)
    assert java_truststore(d) == stores[0]
    assert stores[0].stat().st_mtime_ns == before
    assert again.env["JAVA_TOOL_OPTIONS"].startswith("-Djavax.net.ssl.trustStore=")


def test_every_pem_variable_names_the_bundle_node_included(tmp_path: Path) -> None:
    d, _ = _ca_dir(tmp_path)
    env = brokered_spec(_channel(tmp_path), ("true",), ca_dir=d).env
    for name in ("SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE", "NODE_EXTRA_CA_CERTS"):
        assert env[name] == "/opt/proctor-ca/bundle.pem"


def test_without_a_jre_no_truststore_is_made_and_java_is_not_told_of_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    d, _ = _ca_dir(tmp_path)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    env = brokered_spec(_channel(tmp_path), ("true",), ca_dir=d).env
    assert "JAVA_TOOL_OPTIONS" not in env
    assert not list(d.glob("truststore-*"))


def test_without_a_bundle_dir_nothing_of_trust_is_set(tmp_path: Path) -> None:
    env = brokered_spec(_channel(tmp_path), ("true",)).env
    assert not {"SSL_CERT_FILE", "NODE_EXTRA_CA_CERTS", "JAVA_TOOL_OPTIONS"} & set(env)


@pytest.mark.skipif(shutil.which("java") is None, reason="no JRE on this host")
def test_the_jre_home_is_named_and_its_configuration_outside_usr_is_bound(tmp_path: Path) -> None:
    """Debian's JRE keeps java.security in /etc/java-NN-openjdk: without it bound, a
    JVM in the sandbox cannot start its security providers (no TLS at all)."""
    spec = brokered_spec(_channel(tmp_path), ("true",))
    home = Path(spec.env["JAVA_HOME"])
    assert (home / "bin" / "java").is_file()
    real = (home / "conf" / "security" / "java.security").resolve()
    if real.is_relative_to("/usr"):
        assert set(spec.ro_dirs.values()) == {"/opt/proctor/proctor_guest"}
    else:
        conf = real.parent.parent
        assert spec.ro_dirs[conf] == str(conf)
        assert conf != Path("/etc") and conf.name.startswith("java")
