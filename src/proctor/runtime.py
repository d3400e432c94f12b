"""The embedded runtime: a Proctor home, its store, signing key and ledger.

A home directory holds ``config.json`` (written last by ``init``: its presence
means the home is complete), ``proctor.db`` (the SQLite store) and
``keys/ledger.pem`` (the Ed25519 checkpoint key, mode 0600).
"""

from __future__ import annotations

import getpass
import json
import os
import re
import socket
import tempfile
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING

from proctor.errors import AlreadyExists, NotInitialized, UsageError
from proctor.governance import (
    Approvals,
    Artifacts,
    ControlPlane,
    Deployments,
    KeyRing,
    Policies,
    Principals,
    Resources,
    Subprocessors,
    Tenants,
)
from proctor.ledger import SYSTEM_LOG, Actor, EventDraft, Ledger, Signer
from proctor.store import Conn, Store, open_store

if TYPE_CHECKING:
    from proctor.broker import Broker, RateLimit

DEFAULT_TRUST_DOMAIN = "proctor.local"
_TRUST_DOMAIN_RE = re.compile(r"^[a-z0-9](?:[a-z0-9.-]{0,251}[a-z0-9])?$")
_CONFIG = "config.json"


def broker_socket_root() -> Path:
    """Where brokers put their runs' sockets: one directory per owning process,
    named ``<pid>-<start time>``, so that a server restarted after a SIGKILL
    removes what its dead predecessor left (see ``reap_broker_sockets``).
    ``PROCTOR_BROKER_SOCKETS`` overrides; on tmpfs by default, like the sockets'
    sandboxes' registry."""
    env = os.environ.get("PROCTOR_BROKER_SOCKETS")
    if env:
        return Path(env)
    if os.geteuid() == 0:
        return Path("/run/proctor-brokers")
    return Path(tempfile.gettempdir()) / f"proctor-brokers-{os.geteuid()}"


def reap_broker_sockets() -> list[Path]:
    """Remove the socket directories of every broker whose process is gone."""
    from proctor.sandbox import reap_owned_dirs

    return reap_owned_dirs(broker_socket_root())


def default_home() -> Path:
    env = os.environ.get("PROCTOR_HOME")
    if env:
        return Path(env)
    return Path.home() / ".proctor"


@dataclass(frozen=True)
class Config:
    trust_domain: str
    store: str
    key: str
    operator: str

    @property
    def operator_actor(self) -> Actor:
        return Actor("operator", self.operator)


def _write_private(path: Path, data: bytes) -> None:
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(path)


def init_home(
    home: Path, trust_domain: str = DEFAULT_TRUST_DOMAIN, store: str | None = None
) -> Config:
    """Create a Proctor home: store, signing key, and the system log's first event.

    ``store`` (or ``PROCTOR_STORE``) names a PostgreSQL database
    (``postgresql://…``, which must exist) that several runtime nodes can share;
    by default the store is a SQLite file in the home.
    """
    store = store or os.environ.get("PROCTOR_STORE") or None
    if store is not None and not store.startswith(("postgresql://", "postgres://")):
        raise UsageError(f"--store must be a postgresql:// URL, not {store!r}")
    if not _TRUST_DOMAIN_RE.match(trust_domain) or ".." in trust_domain:
        raise UsageError(
            f"invalid trust domain {trust_domain!r}", hint="use a DNS name such as proctor.local"
        )
    if (home / _CONFIG).exists():
        raise AlreadyExists(f"{home} is initialised already")
    leftover_db = store is None and (home / "proctor.db").exists()
    if leftover_db or (home / "keys" / "ledger.pem").exists():
        raise UsageError(
            f"{home} holds a store or key from an unfinished init",
            hint="remove the directory, or choose another --home",
        )
    home.mkdir(mode=0o700, parents=True, exist_ok=True)
    (home / "keys").mkdir(mode=0o700, exist_ok=True)
    key_path = home / "keys" / "ledger.pem"
    signer = Signer.generate(trust_domain)
    signer.save(key_path)
    KeyRing.load_or_create(home / "keys" / "runtime.key")
    operator = f"local-operator:{getpass.getuser()}@{socket.gethostname()}"
    config = Config(
        trust_domain, store or f"sqlite:///{home / 'proctor.db'}", "keys/ledger.pem", operator
    )
    opened = open_store(config.store, create=True)
    ledger = Ledger(opened, signer, trust_domain)
    try:
        ledger.create_log(
            SYSTEM_LOG,
            EventDraft(
                config.operator_actor,
                "runtime.init",
                f"runtime/{trust_domain}",
                reason="initialised",
                details={"verifier_key": signer.verifier.vkey(), "store": opened.engine},
            ),
        )
    finally:
        ledger.close()
        opened.close()
    _write_private(
        home / _CONFIG,
        json.dumps(config.__dict__, indent=2, sort_keys=True).encode() + b"\n",
    )
    return config


def load_config(home: Path) -> Config:
    path = home / _CONFIG
    if not path.exists():
        raise NotInitialized(f"{home} is not a Proctor home", hint="run `proctor init`")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
        return Config(
            trust_domain=str(raw["trust_domain"]),
            store=str(raw["store"]),
            key=str(raw["key"]),
            operator=str(raw["operator"]),
        )
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise NotInitialized(f"the configuration {path} is unreadable: {exc}") from exc


class Runtime:
    """Everything a command needs, opened from one home; close it when done."""

    def __init__(self, home: Path, config: Config, store: Store, signer: Signer) -> None:
        self.home = home
        self.config = config
        self.store = store
        self.signer = signer
        self.ledger = Ledger(store, signer, config.trust_domain)
        self.keys = KeyRing.load_or_create(home / "keys" / "runtime.key")
        self.tenants = Tenants(store, self.ledger)
        self.policies = Policies(store, self.ledger)
        self.resources = Resources(store, self.ledger, self.keys, home / "buckets")
        self.principals = Principals(store, self.ledger)
        self.control = ControlPlane(self.ledger)
        self.artifacts = Artifacts(store, self.ledger, home / "blobs")
        self.approvals = Approvals(store, self.ledger, self.control, self.artifacts.get)
        self.deployments = Deployments(store, self.ledger, self.approvals, self.resources)
        self.subprocessors = Subprocessors(store, self.ledger)
        self._broker_root: Path | None = None

    @classmethod
    def open(cls, home: Path | None = None) -> Runtime:
        home = home or default_home()
        config = load_config(home)
        signer = Signer.load(config.trust_domain, home / config.key)
        store = open_store(config.store)
        return cls(home, config, store, signer)

    @property
    def operator(self) -> Actor:
        return self.config.operator_actor

    def log_name(self, tenant: str) -> str:
        """The log a tenant name addresses: ``system`` or an existing tenant."""
        if tenant != SYSTEM_LOG:
            self.tenants.get(tenant)
        return tenant

    def undeploy(self, tenant: str, name: str, actor: Actor, reason: str) -> None:
        """Stop a deployment and revoke what it was granted outside Proctor: the
        database roles of its PostgreSQL datasets."""
        self.deployments.set_status(tenant, name, "stopped", actor, reason)
        from proctor.broker._pg_sql import revoke_deployment_role

        for ds in self.resources.datasets(tenant):
            if ds.kind == "postgresql":
                revoke_deployment_role(ds.location, tenant, name, ds.name)

    # -- egress -----------------------------------------------------------------

    def egress_ranges(self, tenant: str) -> tuple[str, ...]:
        """Special-purpose address ranges the tenant's runs may reach anyway (for
        services on the runtime's own loopback, such as the demo's stand-in API)."""
        with self.store.read() as conn:
            row = conn.query_one(
                "SELECT value FROM meta WHERE key = ?", (f"egress_ranges:{tenant}",)
            )
        return tuple(json.loads(row[0])) if row else ()

    def allow_egress_range(self, tenant: str, cidr: str, actor: Actor) -> tuple[str, ...]:
        import ipaddress

        try:
            network = str(ipaddress.ip_network(cidr, strict=True))
        except ValueError as exc:
            raise UsageError(f"{cidr!r} is not an address range: {exc}") from exc
        ranges = tuple(sorted({*self.egress_ranges(tenant), network}))

        def upsert(conn: Conn) -> None:
            conn.execute(
                "INSERT INTO meta (key, value) VALUES (?, ?) ON CONFLICT (key) DO UPDATE"
                " SET value = excluded.value",
                (f"egress_ranges:{tenant}", json.dumps(list(ranges))),
            )

        self.ledger.append(
            tenant,
            EventDraft(actor, "egress.range.allow", f"range/{network}", reason="allowed",
                       details={"ranges": list(ranges)}),
            hook=upsert,
        )  # fmt: skip
        return ranges

    def egress_ca_pem(self, tenant: str, hosts: list[str] | None = None) -> bytes:
        """The tenant CA's certificate; with ``hosts``, constrained to those names."""
        from proctor.broker import TenantCA

        return TenantCA(self.home / "ca" / tenant, tenant).ca_pem(hosts)

    def make_broker(
        self, upstream_cafile: str | None = None, rate_limit: RateLimit | None = None
    ) -> Broker:
        """The broker for this runtime's runs, with every real handler."""
        from proctor.broker import (
            Broker,
            BrokerError,
            EgressProxy,
            Handlers,
            handle_sql,
            read_object,
            write_object,
        )
        from proctor.sandbox import owned_dir

        proxy = EgressProxy(self.home / "ca", upstream_cafile=upstream_cafile)
        handlers = Handlers(
            sql=handle_sql,
            read_object=read_object,
            write_object=write_object,
            connect=proxy.handle_connect,
            forward=proxy.handle_forward,
        )
        root = broker_socket_root()
        for _ in range(3):
            # Sockets under this process's own directory: what a SIGKILL leaves
            # behind is found by owner and reaped by the next `proctor serve`.
            self._broker_root = root
            owned = owned_dir(root)
            try:
                return Broker(handlers, self.keys.derive("proctor/broker-tokens/v1"),
                              socket_root=owned, rate_limit=rate_limit)  # fmt: skip
            except FileNotFoundError:
                continue  # another runtime of this process removed it, empty, just now
        raise BrokerError(f"cannot make a broker socket directory under {root}")

    def close(self) -> None:
        self.ledger.close()
        self.store.close()
        if self._broker_root is not None:
            # Only when empty: a broker still running keeps its directory.
            from proctor.sandbox import release_owned_dir

            release_owned_dir(self._broker_root)

    def __enter__(self) -> Runtime:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
