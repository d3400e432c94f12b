"""CA certificates a tenant registers for named hosts: private upstreams.

Where the broker ends TLS to an upstream (a secret injected), it verifies the
upstream's certificate for the host name. A host whose certificate comes from a
private CA (an internal API, a vendor's on-premises appliance) cannot be verified
against the system's bundle; its tenant registers that CA for the host
(``proctor egress ca add``), and the broker then verifies the host against those
certificates *only*, never the system's bundle: a registration narrows trust for
its host, it never widens it for another.

Kept in the store (the ``meta`` row ``egress_cas:<tenant>``: host -> its
certificates), each change recorded in the tenant's log with its row (one
transaction: ``egress.ca.add``, ``egress.ca.remove``, with the fingerprints). The
broker reads the row for each connection it verifies, so a removal holds from the
next connection on. A row carries a MAC under a key of the runtime's key ring
(not in the store): someone who can write the store but not the home cannot put
their own CA in place of a registered one; a row whose MAC does not match is
refused, and so is every connection to its host.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import ipaddress
import json
import re
import ssl
from dataclasses import dataclass
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization

from proctor.errors import NotFound, PolicyError, ProctorError, UsageError
from proctor.ledger import Action, Actor, EventDraft, Ledger, utc_now
from proctor.policy import normalize_host
from proctor.store import Conn, Store

#: The most bytes a file of CA certificates may take, and certificates one host may have.
MAX_PEM_BYTES = 64 * 1024
MAX_HOST_CAS = 8

_PEM_BLOCK = re.compile(rb"-----BEGIN ([A-Z0-9 ]+)-----\r?\n(.*?)-----END \1-----", re.DOTALL)


class EgressCAError(ProctorError):
    """The CA certificates registered for a host cannot be used."""


@dataclass(frozen=True)
class RegisteredCA:
    """One CA certificate registered for a host."""

    fingerprint: str  # SHA-256 of the DER, hex
    subject: str
    not_after: str
    pem: str
    added_at: str
    added_by: str

    def to_json(self) -> dict[str, Any]:
        return {"fingerprint": self.fingerprint, "subject": self.subject,
                "not_after": self.not_after, "added_at": self.added_at,
                "added_by": self.added_by}  # fmt: skip


@dataclass(frozen=True)
class HostCAs:
    """The CA certificates a tenant registered for one host."""

    host: str
    cas: tuple[RegisteredCA, ...]

    @property
    def fingerprints(self) -> list[str]:
        return [c.fingerprint for c in self.cas]

    def to_json(self) -> dict[str, Any]:
        return {"host": self.host, "cas": [c.to_json() for c in self.cas]}


def ca_host(host: str) -> str:
    """A host CA certificates may be registered for: a DNS name, normalized as
    egress entries are (``proctor.policy.normalize_host``); not an address, a port
    or a wildcard, or :class:`UsageError`."""
    text = host.strip()
    if not text or len(text) > 253 or any(c in text for c in "*:/[]@ "):
        raise UsageError(
            f"{host[:80]!r} is not a host name",
            hint="give the DNS name the upstream's certificate is for, e.g. api.internal.example",
        )
    try:
        name = normalize_host(text)
    except PolicyError as exc:
        raise UsageError(f"{host!r} is not a host name: {exc.message}") from exc
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return name
    raise UsageError(
        f"{host!r} is an address; CA certificates are registered for DNS names",
        hint="give the name the upstream's certificate is issued for",
    )


def read_ca_pem(data: bytes, source: str = "the file") -> list[x509.Certificate]:
    """The CA certificates of a PEM file, or :class:`UsageError` naming what is wrong:
    every PEM block a certificate, each a CA (basicConstraints CA:TRUE), none expired."""
    if len(data) > MAX_PEM_BYTES:
        raise UsageError(f"{source} is {len(data)} bytes; at most {MAX_PEM_BYTES} are accepted")
    blocks = _PEM_BLOCK.findall(data)
    if not blocks:
        raise UsageError(
            f"{source} holds no PEM certificate",
            hint="give the CA certificate in PEM form (-----BEGIN CERTIFICATE-----)",
        )
    labels = {label.decode() for label, _ in blocks}
    if any("PRIVATE KEY" in label for label in labels):
        raise UsageError(
            f"{source} holds a private key; give the CA certificate alone",
            hint="a key never belongs in Proctor's store: keep it where the CA is run",
        )
    if labels != {"CERTIFICATE"}:
        other = sorted(labels - {"CERTIFICATE"})[0]
        raise UsageError(f"{source} holds a {other} block; only CERTIFICATE blocks are accepted")
    if len(blocks) > MAX_HOST_CAS:
        raise UsageError(f"{source} holds {len(blocks)} certificates; at most {MAX_HOST_CAS}")
    certs = []
    now = datetime.datetime.now(datetime.UTC)
    for label, body in blocks:
        pem = b"-----BEGIN " + label + b"-----\n" + body + b"-----END " + label + b"-----\n"
        try:
            cert = x509.load_pem_x509_certificate(pem)
            constraints = cert.extensions.get_extension_for_class(x509.BasicConstraints).value
        except x509.ExtensionNotFound:
            constraints = None
        except ValueError as exc:
            raise UsageError(f"{source} holds a certificate that cannot be read: {exc}") from exc
        shown = f"{_subject(cert)} (sha256 {_fingerprint(cert)[:16]}...)"
        if constraints is None or not constraints.ca:
            raise UsageError(
                f"{source}: {shown} is not a CA certificate (no basicConstraints CA:TRUE)",
                hint="register the CA that issued the upstream's certificate, not the "
                "certificate itself",
            )
        if cert.not_valid_after_utc <= now:
            raise UsageError(f"{source}: {shown} expired on {cert.not_valid_after_utc:%Y-%m-%d}")
        certs.append(cert)
    try:
        # The broker loads them the same way; what it could not load is refused here.
        ssl.create_default_context(cadata=_pem_of(certs).decode("ascii"))
    except ssl.SSLError as exc:
        raise UsageError(f"{source}: TLS cannot use these certificates: {exc}") from exc
    return certs


class EgressCAs:
    """The CA certificates each tenant registered for named hosts."""

    def __init__(self, store: Store, ledger: Ledger, mac_key: bytes) -> None:
        self._store = store
        self._ledger = ledger
        self._mac_key = mac_key

    # -- reading ------------------------------------------------------------------

    def _read(self, conn: Conn, tenant: str) -> tuple[str | None, dict[str, Any]]:
        row = conn.query_one("SELECT value FROM meta WHERE key = ?", (_key(tenant),))
        if row is None:
            return None, {}
        text = str(row[0])
        try:
            doc = json.loads(text)
            hosts = doc["hosts"]
            mac = str(doc["mac"])
        except (ValueError, KeyError, TypeError) as exc:
            raise EgressCAError(
                f"the CA certificates registered for {tenant}'s hosts cannot be read"
            ) from exc
        if not isinstance(hosts, dict) or not hmac.compare_digest(mac, self._mac(tenant, hosts)):
            raise EgressCAError(
                f"the CA certificates registered for {tenant}'s hosts were changed outside "
                "Proctor (their MAC does not match): no host of theirs is trusted",
                hint=f"proctor audit events -t {tenant} --action egress.ca.add shows what was "
                "registered",
            )
        return text, hosts

    def _mac(self, tenant: str, hosts: dict[str, Any]) -> str:
        body = json.dumps({"tenant": tenant, "hosts": hosts}, sort_keys=True).encode()
        return hmac.new(self._mac_key, body, hashlib.sha256).hexdigest()

    def list(self, tenant: str) -> list[HostCAs]:
        with self._store.read() as conn:
            _, hosts = self._read(conn, tenant)
        return [_host_cas(host, hosts[host]) for host in sorted(hosts)]

    def get(self, tenant: str, host: str) -> HostCAs | None:
        name = ca_host(host)
        with self._store.read() as conn:
            _, hosts = self._read(conn, tenant)
        return _host_cas(name, hosts[name]) if name in hosts else None

    def pem_for(self, tenant: str, host: str) -> bytes | None:
        """The broker's lookup: the PEM of the CA certificates ``tenant`` registered
        for ``host`` (a name as the broker normalized it), or None."""
        with self._store.read() as conn:
            _, hosts = self._read(conn, tenant)
        entries = hosts.get(host)
        if not entries:
            return None
        return "".join(str(e["pem"]) for e in entries).encode("ascii")

    # -- changing -----------------------------------------------------------------

    def add(self, tenant: str, host: str, pem: bytes, actor: Actor,
            source: str = "the file") -> HostCAs:  # fmt: skip
        """Register the CA certificates in ``pem`` for ``host`` (beside any registered
        already: a rotation adds the new CA, then removes the old one)."""
        name = ca_host(host)
        certs = read_ca_pem(pem, source)
        with self._store.read() as conn:
            before, hosts = self._read(conn, tenant)
        entries = list(hosts.get(name, []))
        known = {e["fingerprint"] for e in entries}
        now, added = utc_now(), []
        for cert in certs:
            fp = _fingerprint(cert)
            if fp in known:
                continue
            known.add(fp)
            entry = RegisteredCA(fp, _subject(cert), cert.not_valid_after_utc.isoformat(),
                                 _pem_of([cert]).decode("ascii"), now, actor.id)  # fmt: skip
            entries.append({**entry.to_json(), "pem": entry.pem})
            added.append(entry)
        if not added:
            raise UsageError(f"every certificate in {source} is registered for {name} already")
        if len(entries) > MAX_HOST_CAS:
            raise UsageError(
                f"{name} would have {len(entries)} CA certificates; at most {MAX_HOST_CAS}",
                hint=f"remove one first: proctor egress ca remove -t {tenant} {name} "
                "--fingerprint SHA256",
            )
        after = {**hosts, name: entries}
        details = {"host": name, "added": [_shown(c) for c in added],
                   "fingerprints": [e["fingerprint"] for e in entries]}  # fmt: skip
        self._write(tenant, before, after, EventDraft(
            actor, Action.EGRESS_CA_ADD, f"egress-ca/{name}",
            reason=f"{len(added)} CA certificate(s) registered for {name}", details=details,
        ))  # fmt: skip
        return _host_cas(name, entries)

    def remove(self, tenant: str, host: str, actor: Actor,
               fingerprint: str | None = None) -> HostCAs:  # fmt: skip
        """Remove ``host``'s CA certificates (only the one of ``fingerprint``, if given);
        what is left (no certificate: the host is verified as any other again)."""
        name = ca_host(host)
        with self._store.read() as conn:
            before, hosts = self._read(conn, tenant)
        entries = list(hosts.get(name, []))
        if not entries:
            raise NotFound(f"no CA certificate is registered for {name} in tenant {tenant}")
        if fingerprint is None:
            removed, kept = entries, []
        else:
            fp = fingerprint.strip().lower().replace(":", "").removeprefix("sha256")
            removed = [e for e in entries if e["fingerprint"] == fp]
            kept = [e for e in entries if e["fingerprint"] != fp]
            if not removed:
                raise NotFound(
                    f"no CA certificate of fingerprint {fingerprint[:80]!r} is registered "
                    f"for {name}",
                    hint=f"proctor egress ca list -t {tenant} shows the fingerprints",
                )
        after = {h: e for h, e in hosts.items() if h != name}
        if kept:
            after[name] = kept
        details = {"host": name, "removed": [e["fingerprint"] for e in removed],
                   "fingerprints": [e["fingerprint"] for e in kept]}  # fmt: skip
        self._write(tenant, before, after, EventDraft(
            actor, Action.EGRESS_CA_REMOVE, f"egress-ca/{name}",
            reason=f"{len(removed)} CA certificate(s) removed for {name}", details=details,
        ))  # fmt: skip
        return _host_cas(name, kept)

    def _write(self, tenant: str, before: str | None, after: dict[str, Any],
               draft: EventDraft) -> None:  # fmt: skip
        value = json.dumps({"hosts": after, "mac": self._mac(tenant, after)}, sort_keys=True)

        def upsert(conn: Conn) -> None:
            # Read again in the event's transaction: two changes at once must not
            # both write what each read before the other.
            row = conn.query_one("SELECT value FROM meta WHERE key = ?", (_key(tenant),))
            if (None if row is None else str(row[0])) != before:
                raise UsageError(
                    f"the CA certificates of {tenant}'s hosts changed meanwhile; nothing was "
                    "changed",
                    hint="run the command again",
                )
            conn.execute(
                "INSERT INTO meta (key, value) VALUES (?, ?) ON CONFLICT (key) DO UPDATE"
                " SET value = excluded.value",
                (_key(tenant), value),
            )

        self._ledger.append(tenant, draft, hook=upsert)


def _key(tenant: str) -> str:
    return f"egress_cas:{tenant}"


def _host_cas(host: str, entries: list[dict[str, Any]]) -> HostCAs:
    return HostCAs(host, tuple(
        RegisteredCA(str(e["fingerprint"]), str(e["subject"]), str(e["not_after"]),
                     str(e["pem"]), str(e["added_at"]), str(e["added_by"]))
        for e in entries
    ))  # fmt: skip


def _shown(ca: RegisteredCA) -> dict[str, str]:
    return {"fingerprint": ca.fingerprint, "subject": ca.subject[:200], "not_after": ca.not_after}


def _fingerprint(cert: x509.Certificate) -> str:
    return cert.fingerprint(hashes.SHA256()).hex()


def _subject(cert: x509.Certificate) -> str:
    return cert.subject.rfc4514_string()


def _pem_of(certs: list[x509.Certificate]) -> bytes:
    return b"".join(c.public_bytes(serialization.Encoding.PEM) for c in certs)
