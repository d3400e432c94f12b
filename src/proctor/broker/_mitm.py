"""Per-tenant CA and TLS termination, for injecting credentials the guest never sees.

For a host bound to a tenant secret, the proxy ends the guest's TLS with a
leaf certificate issued by the tenant's CA (which the sandbox trusts through
``SSL_CERT_FILE`` and ``REQUESTS_CA_BUNDLE``), opens its own verified TLS
connection to the real host, and adds the secret's header to each request.

The CA key stays in the runtime's directory (mode 0600) and never enters a
sandbox; only :meth:`TenantCA.ca_pem` (the certificate) does.

Given the hosts of a run's secrets, :meth:`TenantCA.ca_pem` returns the CA
certificate re-issued over the same key and name with X.509 name constraints
(RFC 5280 4.2.1.10) permitting only those hosts. OpenSSL enforces a trust
anchor's constraints, so a sandbox trusting that certificate accepts no leaf
of the tenant CA for any other name: not one minted by a broker bug, and not
one minted with a stolen CA key by whoever got a copy of the bundle trusted
somewhere else. The unconstrained certificate stays on the runtime's side.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import hashlib
import ipaddress
import os
import ssl
import tempfile
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from proctor.broker._egress import parse_host, split_authority
from proctor.broker._scope import BadCall
from proctor.errors import PolicyError, ProctorError
from proctor.policy import normalize_host

_CA_FILE = "tenant-ca.pem"
_CA_YEARS = 10
_LEAF_DAYS = 7
# Re-issue a cached leaf this long before it expires, so a long connection
# never starts with a certificate about to lapse.
_LEAF_MARGIN = datetime.timedelta(days=1)
_CLOCK_SKEW = datetime.timedelta(hours=1)
_MAX_LEAVES = 1024
_READ_CHUNK = 65536


class CAError(ProctorError):
    """The tenant CA cannot be created, read or used."""


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


class TenantCA:
    """One tenant's CA: created on first use in ``directory``, reused afterwards.

    ``directory`` belongs to the runtime (e.g. ``<home>/ca/<tenant>``); the
    file in it holds the CA key and must never be mounted into a sandbox.
    """

    def __init__(self, directory: Path, tenant: str) -> None:
        self.directory = directory
        self.tenant = tenant
        self._lock = threading.Lock()
        self._contexts: dict[str, tuple[datetime.datetime, ssl.SSLContext]] = {}
        self._key, self._cert = self._load_or_create()

    # -- the CA -----------------------------------------------------------

    def _load_or_create(self) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
        path = self.directory / _CA_FILE
        if not path.exists():
            self._create(path)
        try:
            data = path.read_bytes()
            cert = x509.load_pem_x509_certificate(data)
            key = serialization.load_pem_private_key(data, password=None)
        except (OSError, ValueError) as exc:
            raise CAError(f"cannot read the tenant CA in {path}: {exc}") from exc
        if not isinstance(key, ec.EllipticCurvePrivateKey):
            raise CAError(f"the tenant CA key in {path} is not an EC key")
        return key, cert

    def _create(self, path: Path) -> None:
        self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name(
            [
                x509.NameAttribute(NameOID.ORGANIZATION_NAME, "Proctor"),
                x509.NameAttribute(NameOID.COMMON_NAME, f"Proctor egress CA for {self.tenant}"),
            ]
        )
        now = _now()
        expires = now + datetime.timedelta(days=365 * _CA_YEARS)
        cert = _ca_builder(name, key, expires).sign(key, hashes.SHA256())
        data = cert.public_bytes(serialization.Encoding.PEM) + key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
        # Written whole to a private temporary file, then linked into place:
        # two runtimes creating the CA at once both end up using the winner's.
        fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=".ca-")
        try:
            os.fchmod(fd, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            with contextlib.suppress(FileExistsError):
                os.link(tmp, path)
        finally:
            os.unlink(tmp)

    def ca_pem(self, hosts: Iterable[str] | None = None) -> bytes:
        """The CA certificate, for the sandbox's trust bundle. Never the key.

        With ``hosts`` (secret host entries: ``host``, ``host:port``,
        ``*.domain``), the certificate is constrained to those names; with an
        empty list it vouches for no name at all.
        """
        if hosts is None:
            return self._cert.public_bytes(serialization.Encoding.PEM)
        # The same CA (subject, key, expiry) re-issued with the constraints added.
        cert = (
            _ca_builder(self._cert.subject, self._key, self._cert.not_valid_after_utc)
            .add_extension(name_constraints(hosts), critical=True)
            .sign(self._key, hashes.SHA256())
        )
        return cert.public_bytes(serialization.Encoding.PEM)

    # -- leaves -----------------------------------------------------------

    def leaf_for(self, host: str) -> tuple[bytes, bytes]:
        """A fresh leaf for ``host`` (DNS name or IP literal): (certificate PEM, key PEM)."""
        key = ec.generate_private_key(ec.SECP256R1())
        try:
            san: x509.GeneralName = x509.IPAddress(ipaddress.ip_address(host))
            # No common name for an address: OpenSSL checks a CN that looks like
            # a DNS name against the CA's DNS constraints, and "127.0.0.1" does.
            subject = x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "Proctor")])
        except ValueError:
            san = x509.DNSName(host)
            subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, host[:64])])
        now = _now()
        cert = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(self._cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - _CLOCK_SKEW)
            .not_valid_after(now + datetime.timedelta(days=_LEAF_DAYS))
            .add_extension(x509.SubjectAlternativeName([san]), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=False,
                    crl_sign=False,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), False)
            # Python 3.13 verifies with VERIFY_X509_STRICT, which wants AKI.
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(self._key.public_key()), False
            )
            .sign(self._key, hashes.SHA256())
        )
        key_pem = key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
        return cert.public_bytes(serialization.Encoding.PEM), key_pem

    def server_context(self, host: str) -> ssl.SSLContext:
        """A server-side TLS context presenting a leaf for ``host``; cached per host."""
        with self._lock:
            cached = self._contexts.get(host)
            if cached is not None and cached[0] - _LEAF_MARGIN > _now():
                return cached[1]
        cert_pem, key_pem = self.leaf_for(host)
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.set_alpn_protocols(["http/1.1"])
        # ssl loads chains only from files; the file lives for the load alone,
        # private to the runtime, in the CA's own directory.
        fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=".leaf-")
        try:
            os.fchmod(fd, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(cert_pem + key_pem)
            ctx.load_cert_chain(tmp)
        finally:
            os.unlink(tmp)
        expires = _now() + datetime.timedelta(days=_LEAF_DAYS)
        with self._lock:
            if len(self._contexts) >= _MAX_LEAVES:
                self._contexts.pop(next(iter(self._contexts)))
            self._contexts[host] = (expires, ctx)
        return ctx


def name_constraints(hosts: Iterable[str]) -> x509.NameConstraints:
    """Name constraints permitting exactly the names secret host entries cover.

    ``*.domain`` becomes ``.domain`` (names below it, as the entry means);
    ``host`` and ``host:port`` become the host itself (ports have no place in
    X.509); IP literals become a single-address range. Nothing at all is
    permitted for an empty list: every DNS name and every address excluded.
    """
    dns: set[str] = set()
    ips: set[ipaddress.IPv4Network | ipaddress.IPv6Network] = set()
    for entry in hosts:
        try:
            text, _port = split_authority(entry, 0)
            if text.startswith("*."):
                dns.add("." + normalize_host(text[2:]))
                continue
            host = parse_host(text)
        except (BadCall, PolicyError) as exc:
            raise CAError(f"cannot constrain the tenant CA to {entry!r}: {exc}") from exc
        if host.address is not None:
            ips.add(ipaddress.ip_network(host.address))
        else:
            dns.add(host.name)
    permitted: list[x509.GeneralName] = [x509.DNSName(d) for d in sorted(dns)]
    permitted += [x509.IPAddress(n) for n in sorted(ips, key=str)]
    if not permitted:
        # Excluding "" excludes every DNS name (RFC 5280: any name matches an empty
        # constraint); the two zero-length ranges cover every address.
        return x509.NameConstraints(
            permitted_subtrees=None,
            excluded_subtrees=[
                x509.DNSName(""),
                x509.IPAddress(ipaddress.ip_network("0.0.0.0/0")),
                x509.IPAddress(ipaddress.ip_network("::/0")),
            ],
        )
    # Permitting only DNS names says nothing about addresses, and the other way
    # round: the kind with no permitted subtree is excluded outright.
    excluded: list[x509.GeneralName] = []
    if not ips:
        excluded += [
            x509.IPAddress(ipaddress.ip_network("0.0.0.0/0")),
            x509.IPAddress(ipaddress.ip_network("::/0")),
        ]
    if not dns:
        excluded.append(x509.DNSName(""))
    return x509.NameConstraints(permitted_subtrees=permitted, excluded_subtrees=excluded or None)


def upstream_context(cafile: str | None, cadata: str | None = None) -> ssl.SSLContext:
    """Client-side TLS that verifies the real upstream (system bundle unless ``cafile``
    or ``cadata``: then those certificates alone)."""
    ctx = ssl.create_default_context(cafile=cafile, cadata=cadata)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.set_alpn_protocols(["http/1.1"])
    return ctx


#: ``(tenant, host)`` -> the PEM of the CA certificates the tenant registered for
#: ``host`` (``proctor egress ca add``), or None: the host keeps the default trust.
TrustLookup = Callable[[str, str], bytes | None]

#: The trust anchor named when the system's bundle verified an upstream.
SYSTEM_TRUST = "system"
#: ... and when the proxy's ``upstream_cafile`` did.
CAFILE_TRUST = "upstream-cafile"
_MAX_TRUST_CONTEXTS = 256


@dataclass(frozen=True)
class UpstreamTrust:
    """What an upstream's certificate is verified against: the TLS context, and the
    name of its trust anchor for the completion event. ``anchors`` (the CA
    certificates a tenant registered for the host, by SHA-256 fingerprint) is
    empty for the default trust, which ``label`` names."""

    context: ssl.SSLContext
    label: str
    anchors: tuple[tuple[str, x509.Certificate], ...] = ()

    def verified_by(self, peer_der: bytes | None) -> str:
        """The trust anchor that verified the upstream whose leaf is ``peer_der``:
        ``label`` for the default trust; for a host's registered CAs
        ``tenant-ca:<sha256>`` of the one that issued the leaf (Python 3.11 cannot
        give the verified chain, so the issuer is found by its signature), or of the
        only one registered; with several and a chain through an intermediate, all
        of them, joined by ``,``."""
        if not self.anchors:
            return self.label
        if peer_der is not None:
            with contextlib.suppress(ValueError):
                leaf = x509.load_der_x509_certificate(peer_der)
                for fingerprint, ca in self.anchors:
                    try:
                        leaf.verify_directly_issued_by(ca)
                    except (ValueError, TypeError, InvalidSignature):
                        continue
                    return f"tenant-ca:{fingerprint}"
        return ",".join(f"tenant-ca:{fingerprint}" for fingerprint, _ in self.anchors)


_trust_lock = threading.Lock()
_trust_cache: dict[bytes, UpstreamTrust] = {}


def registered_trust(pem: bytes) -> UpstreamTrust:
    """The trust of a host whose tenant registered ``pem`` (CA certificates): those
    certificates and nothing else, not the system's bundle. Cached by content."""
    key = hashlib.sha256(pem).digest()
    with _trust_lock:
        cached = _trust_cache.get(key)
    if cached is not None:
        return cached
    try:
        certs = x509.load_pem_x509_certificates(pem)
        ctx = upstream_context(None, cadata=pem.decode("ascii"))
    except (ValueError, ssl.SSLError) as exc:
        raise CAError(f"the CA certificates registered for the host cannot be used: {exc}") from exc
    anchors = tuple((cert.fingerprint(hashes.SHA256()).hex(), cert) for cert in certs)
    trust = UpstreamTrust(ctx, "tenant-ca", anchors)
    with _trust_lock:
        if len(_trust_cache) >= _MAX_TRUST_CONTEXTS:
            _trust_cache.pop(next(iter(_trust_cache)))
        _trust_cache[key] = trust
    return trust


class TlsStream:
    """TLS over an existing asyncio stream pair, through memory BIOs.

    Works on whatever streams the broker's server hands over (however they
    were made), and keeps any bytes the guest sent before the handshake began.
    Offers the small part of the StreamReader API the proxy needs.
    """

    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        ctx: ssl.SSLContext,
        *,
        server_side: bool,
    ) -> None:
        self._reader = reader
        self._writer = writer
        self._incoming = ssl.MemoryBIO()
        self._outgoing = ssl.MemoryBIO()
        self._obj = ctx.wrap_bio(self._incoming, self._outgoing, server_side=server_side)
        self._buf = bytearray()
        self._eof = False
        self.raw_in = 0
        self.raw_out = 0

    async def _flush(self) -> None:
        data = self._outgoing.read()
        if data:
            self.raw_out += len(data)
            self._writer.write(data)
            await self._writer.drain()

    async def _feed(self) -> None:
        data = await self._reader.read(_READ_CHUNK)
        if data:
            self.raw_in += len(data)
            self._incoming.write(data)
        else:
            self._incoming.write_eof()

    async def handshake(self) -> None:
        while True:
            try:
                self._obj.do_handshake()
                break
            except ssl.SSLWantReadError:
                await self._flush()
                await self._feed()
        await self._flush()

    async def _recv(self) -> bytes:
        while True:
            try:
                return self._obj.read(_READ_CHUNK)
            except ssl.SSLWantReadError:
                # TLS 1.3 post-handshake messages may need an answer first.
                await self._flush()
                await self._feed()
            except (ssl.SSLZeroReturnError, ssl.SSLEOFError):
                return b""

    async def _fill(self) -> bool:
        if self._eof:
            return False
        chunk = await self._recv()
        if not chunk:
            self._eof = True
            return False
        self._buf += chunk
        return True

    async def read(self, n: int = _READ_CHUNK) -> bytes:
        if not self._buf and not await self._fill():
            return b""
        out = bytes(self._buf[:n])
        del self._buf[:n]
        return out

    async def readuntil(self, separator: bytes, limit: int) -> bytes:
        start = 0
        while True:
            at = self._buf.find(separator, start)
            if at >= 0:
                end = at + len(separator)
                out = bytes(self._buf[:end])
                del self._buf[:end]
                return out
            if len(self._buf) > limit:
                raise asyncio.LimitOverrunError("separator not found within the limit", limit)
            start = max(0, len(self._buf) - len(separator) + 1)
            if not await self._fill():
                raise asyncio.IncompleteReadError(bytes(self._buf), None)

    async def readexactly(self, n: int) -> bytes:
        while len(self._buf) < n:
            if not await self._fill():
                raise asyncio.IncompleteReadError(bytes(self._buf), n)
        out = bytes(self._buf[:n])
        del self._buf[:n]
        return out

    async def write(self, data: bytes) -> None:
        self._obj.write(data)
        await self._flush()

    async def close(self) -> None:
        # close_notify, best effort: the peer may be gone already.
        with contextlib.suppress(ssl.SSLError, ValueError):
            self._obj.unwrap()
        with contextlib.suppress(ConnectionError, OSError):
            await self._flush()


def _ca_builder(
    name: x509.Name, key: ec.EllipticCurvePrivateKey, expires: datetime.datetime
) -> x509.CertificateBuilder:
    """A self-issued CA certificate for ``key``: may sign leaves, nothing below them."""
    return (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(_now() - _CLOCK_SKEW)
        .not_valid_after(expires)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=False,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), False)
    )
