"""A Java truststore beside a run's CA bundle, for JVMs in the sandbox.

Java reads none of the PEM variables (``SSL_CERT_FILE`` and the like); it trusts
what ``javax.net.ssl.trustStore`` names. A JVM in the sandbox gets, through
``JAVA_TOOL_OPTIONS``, a PKCS12 truststore holding the same certificates as the
run's bundle (the system's roots and the run's tenant CA), each entry marked as a
trusted certificate the way keytool marks it (the ``cryptography`` package writes
Oracle's trusted-key-usage attribute), so no JVM is started to make it.

It is made only when the host has a JRE (``java`` or ``keytool`` on ``PATH``, the
same ``/usr`` the sandbox sees): without one no program in the sandbox could read
it. Its name carries the bundle's digest, so a bundle is converted once and a
later run with the same bundle reuses the file.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import tempfile
import warnings
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives.serialization import BestAvailableEncryption, pkcs12

from proctor.errors import ProctorError

BUNDLE = "bundle.pem"
_PEM = re.compile(rb"-----BEGIN CERTIFICATE-----.+?-----END CERTIFICATE-----", re.DOTALL)
#: Not a secret: the store holds only public certificates, and Java needs some
#: password to check the file's integrity MAC.
PASSWORD = "proctor-trust"  # noqa: S105


def jre_present() -> bool:
    return shutil.which("java") is not None or shutil.which("keytool") is not None


def java_home() -> Path | None:
    """The host JRE's home (``/usr/lib/jvm/...``), found through ``java`` on PATH."""
    java = shutil.which("java")
    if java is None:
        return None
    home = Path(java).resolve().parent.parent
    return home if (home / "lib").is_dir() else None


def java_conf_dir(home: Path) -> Path | None:
    """Where the JRE's configuration really lives, when that is outside ``/usr``.

    Debian's JREs link ``conf/security/java.security`` (and ``jvm.cfg``, the
    policy files) into ``/etc/java-NN-openjdk``, which the sandbox does not see:
    without it a JVM cannot load its security providers, so no TLS, no digest,
    no SecureRandom. Only that one directory of configuration is named, never
    ``/etc`` itself."""
    master = home / "conf" / "security" / "java.security"
    try:
        real = master.resolve(strict=True)
    except OSError:
        return None
    if real.is_relative_to(home) or real.is_relative_to("/usr"):
        return None  # inside the JRE's home: the sandbox already sees it
    root = real.parent.parent
    if not root.name.startswith("java") or root.parent in (root, Path("/")):
        return None
    return root


def java_truststore(ca_dir: Path) -> Path | None:
    """The PKCS12 truststore for the bundle in ``ca_dir``, made if missing; None
    when the host has no JRE or ``ca_dir`` holds no bundle."""
    bundle = ca_dir / BUNDLE
    if not jre_present() or not bundle.is_file():
        return None
    data = bundle.read_bytes()
    path = ca_dir / f"truststore-{hashlib.sha256(data).hexdigest()[:16]}.p12"
    if path.is_file():
        return path
    certs = _certificates(data)
    if not certs:
        raise ProctorError(f"the run's CA bundle {bundle} holds no certificate")
    entries = [
        pkcs12.PKCS12Certificate(cert, f"proctor-{i}".encode()) for i, cert in enumerate(certs)
    ]
    store = pkcs12.serialize_java_truststore(entries, BestAvailableEncryption(PASSWORD.encode()))
    # Written whole, then renamed: two runs making it at once both see a whole file.
    fd, tmp = tempfile.mkstemp(dir=ca_dir, prefix=".truststore-")
    try:
        os.fchmod(fd, 0o644)
        with os.fdopen(fd, "wb") as f:
            f.write(store)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def _certificates(data: bytes) -> list[x509.Certificate]:
    # One block at a time: a system root this library will not parse (some carry
    # a negative serial number) is left out of Java's store, not the whole store.
    certs = []
    for block in _PEM.findall(data):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                certs.append(x509.load_pem_x509_certificate(block))
            except ValueError:
                continue
    return certs


def java_options(truststore: Path, guest_dir: str) -> str:
    """The ``JAVA_TOOL_OPTIONS`` that make a JVM trust ``truststore``, seen at ``guest_dir``."""
    return (
        f"-Djavax.net.ssl.trustStore={guest_dir}/{truststore.name} "
        f"-Djavax.net.ssl.trustStorePassword={PASSWORD} "
        "-Djavax.net.ssl.trustStoreType=PKCS12"
    )
