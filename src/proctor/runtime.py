"""The embedded runtime: a Proctor home, its store, signing key and ledger.

A home directory holds ``config.json`` (written last by ``init``: its presence
means the home is complete), ``proctor.db`` (the SQLite store) and
``keys/ledger.pem`` (the Ed25519 checkpoint key, mode 0600). Every path in
``config.json`` that lies inside the home is relative to it, so a copied home
opens its own store and a moved one keeps working (:func:`store_url`).

Opening a home also closes the record of runs whose owning process died on
this host (a ``proctor run`` killed with SIGKILL, a crashed server): they are
recorded as interrupted, after their sandboxes and broker sockets are removed,
by whichever process opens the home next.
"""

from __future__ import annotations

import json
import logging
import os
import pwd
import re
import shutil
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

from proctor.errors import AlreadyExists, NotFound, NotInitialized, ProctorError, UsageError
from proctor.governance import (
    Approvals,
    Artifacts,
    Asks,
    ControlPlane,
    DatasetKind,
    Deployments,
    EgressCAs,
    EgressRanges,
    HostCAs,
    KeyRing,
    Policies,
    Principals,
    Resources,
    Subprocessors,
    Tenants,
)
from proctor.ledger import SYSTEM_LOG, Action, Actor, EventDraft, Ledger, Signer, utc_now
from proctor.store import Conn, Store, open_store

if TYPE_CHECKING:
    from proctor.broker import Broker, RateLimit
    from proctor.lifecycle import Supervisor

log = logging.getLogger("proctor.runtime")

DEFAULT_TRUST_DOMAIN = "proctor.local"
_TRUST_DOMAIN_RE = re.compile(r"^[a-z0-9](?:[a-z0-9.-]{0,251}[a-z0-9])?$")
_CONFIG = "config.json"
_HOME_DB = "proctor.db"


def local_operator_id() -> str:
    """``local-operator:<user>@<host>``: the OS user this process runs as (its
    effective uid, not the environment's USER, which anyone can set) and the host."""
    uid = os.geteuid()
    try:
        user = pwd.getpwuid(uid).pw_name
    except KeyError:
        user = f"uid{uid}"
    return f"local-operator:{user}@{socket.gethostname()}"


def run_owner_alive(owner: str) -> bool:
    """Whether a run's owner ``host:pid[:start]`` is a live process of this host.

    Owners on another host count as dead here: see docs/sandbox.md on shared
    stores. Ids written before start times were kept (``host:pid``) are judged
    by the pid alone.
    """
    from proctor.sandbox import owner_alive, process_start_time

    host, _, rest = owner.partition(":")
    pid, _, start = rest.partition(":")
    if host != os.uname().nodename or not pid.isdigit():
        return False
    if start:
        return owner_alive(int(pid), start)
    return process_start_time(int(pid)) is not None


#: The reason a run whose owner died is closed with (``run.end`` says "interrupted: …").
OWNER_DIED = "supervisor died"
#: ... and a run of a node whose lease lapsed (lifecycle/_nodes.py).
NODE_LAPSED = "node lease lapsed"
#: Why a run a backup caught running is interrupted in the home restored from it.
RESTORED = "restored from a backup taken while it ran"


class _AlreadyClosed(ProctorError):
    """Another process closed the run first: nothing to record."""


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
    operator = local_operator_id()
    # Relative to the home (SQLAlchemy's spelling: three slashes, then a relative path).
    config = Config(trust_domain, store or f"sqlite:///{_HOME_DB}", "keys/ledger.pem", operator)
    opened = open_store(store_url(home, config), create=True)
    ledger = Ledger(opened, signer, trust_domain)
    try:
        ledger.create_log(
            SYSTEM_LOG,
            EventDraft(
                config.operator_actor,
                Action.RUNTIME_INIT,
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


def _sqlite_path(url: str) -> Path | None:
    if url.startswith(("postgresql://", "postgres://")):
        return None
    return Path(url.removeprefix("sqlite:///") if url.startswith("sqlite:///") else url)


def store_url(home: Path, config: Config) -> str:
    """What ``open_store`` opens for this home.

    A relative SQLite path is the home's own file. Homes made before paths were
    kept relative hold the absolute path of the home ``init`` made: when that is
    another directory's ``proctor.db`` and this home has its own, the home was
    copied or moved, and its own file is its store (``cp -a`` once made the copy
    append to the original's ledger). Anything else (PostgreSQL, a file placed
    elsewhere by hand) is opened as written, and :func:`store_outside` names it.
    """
    path = _sqlite_path(config.store)
    if path is None:
        return config.store
    if not path.is_absolute():
        return f"sqlite:///{home.absolute() / path}"
    own = home.absolute() / _HOME_DB
    if path.name == _HOME_DB and path.parent != own.parent and own.exists():
        return f"sqlite:///{own}"
    return f"sqlite:///{path}"


def store_outside(home: Path, url: str) -> str | None:
    """The store named for people (a DSN without its password) when it lies
    outside the home, else None."""
    path = _sqlite_path(url)
    if path is None:
        from proctor.store import redact

        return redact(url)
    try:
        path.resolve().relative_to(home.resolve())
    except ValueError:
        return str(path)
    return None


def _locate_dataset(where: Path | str) -> tuple[DatasetKind, str]:
    # The broker (and psycopg behind it) loads only when a dataset is registered.
    from proctor.broker import locate_dataset

    return locate_dataset(where)


def _exposed_in_dataset(kind: DatasetKind, location: str) -> list[str]:
    from proctor.broker import exposed_in_dataset  # loaded at registration, as above

    return exposed_in_dataset(kind, location)


def _missing_in_dataset(kind: DatasetKind, location: str, tables: Mapping[str, Any]) -> list[str]:
    from proctor.broker import missing_in_dataset  # loaded at deploy, as above

    return missing_in_dataset(kind, location, tables)


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
        self.resources = Resources(store, self.ledger, self.keys, home / "buckets",
                                   locate=_locate_dataset, missing=_missing_in_dataset,
                                   exposed=_exposed_in_dataset)  # fmt: skip
        self.principals = Principals(store, self.ledger)
        self.control = ControlPlane(self.ledger)
        self.artifacts = Artifacts(store, self.ledger, home / "blobs")
        self.approvals = Approvals(store, self.ledger, self.control, self.artifacts.get)
        self.asks = Asks(store, self.ledger, self.control)
        self.deployments = Deployments(store, self.ledger, self.approvals, self.resources)
        self.subprocessors = Subprocessors(store, self.ledger)
        self.egress = EgressRanges(store, self.ledger)
        self.egress_cas = EgressCAs(store, self.ledger, self.keys.derive("proctor/egress-cas/v1"))
        self._broker_root: Path | None = None
        #: The store, named for people, when it lies outside the home: every error a
        #: command meets through this runtime names it (``__exit__``).
        self.store_outside: str | None = None

    @classmethod
    def open(cls, home: Path | None = None) -> Runtime:
        home = home or default_home()
        config = load_config(home)
        signer = Signer.load(config.trust_domain, home / config.key)
        url = store_url(home, config)
        outside = store_outside(home, url)
        try:
            store = open_store(url)
        except ProctorError as exc:
            if outside is not None:
                _name_store(exc, outside)
            raise
        rt = cls(home, config, store, signer)
        rt.store_outside = outside
        try:
            rt.close_orphaned_runs()
            # The asked calls of the runs just closed (or closed by anyone since):
            # none is left waiting on a run that is over.
            rt.asks.abandon_orphans(rt.operator)
        except (ProctorError, OSError) as exc:
            # Opening must not fail for it: the next process to open the home tries again.
            why = exc.message if isinstance(exc, ProctorError) else str(exc)
            log.warning("proctor: runs of dead processes not closed yet: %s", why)
        except BaseException:
            rt.close()
            raise
        return rt

    @property
    def operator(self) -> Actor:
        """The local operator as this process runs: which OS user, on which host. Not
        the user who ran ``init``: the record names who acted, not who set up."""
        return Actor("operator", local_operator_id())

    # -- runs whose owner died -------------------------------------------------------

    def close_orphaned_runs(
        self, actor: Actor | None = None, *, other_hosts: bool = False, skip: str | None = None,
        node: str | None = None,
    ) -> list[tuple[str, str]]:  # fmt: skip
        """Record as interrupted every run left 'running' by an owner that is gone;
        returns their (tenant, run id).

        One query of the running runs, then a liveness check of each owner
        (host, pid and start time): cheap enough for every opening of the home.
        Only this host's runs unless ``other_hosts`` (``proctor serve`` at start,
        see docs/sandbox.md): another node's runs are not ours to judge every
        few seconds. ``skip`` is the caller's own owner id. The dead owner's
        sandboxes are killed first (they hold its broker sockets), then its
        sockets go, then each run is closed; a run another process closes
        meanwhile is recorded once, by whichever commits first.

        Runs of a node (a ``serve`` sharing the store, lifecycle/_nodes.py) on
        another host are judged by its lease, not here; ``node`` names one that was
        found dead, and closes its runs alone.
        """
        with self.store.read() as conn:
            rows = conn.query(
                "SELECT id, tenant, deployment, digest, supervisor, started_at FROM runs"
                " WHERE status = 'running'"
            )
            nodes = {str(r[0]) for r in conn.query("SELECT id FROM nodes WHERE state = 'live'")}
        host = os.uname().nodename
        dead = []
        started: dict[str, str] = {}
        reason = OWNER_DIED if node is None else NODE_LAPSED
        for run_id, tenant, name, digest, supervisor, started_at in rows:
            owner = "" if supervisor is None else str(supervisor)
            elsewhere = owner.partition(":")[0] != host
            if node is not None:
                if owner != node:
                    continue
            elif owner == skip or (elsewhere and (not other_hosts or owner in nodes)):
                continue
            if node is not None or not run_owner_alive(owner):
                dead.append((str(run_id), str(tenant), str(name), str(digest)))
                started[str(run_id)] = str(started_at) if started_at else ""
        if not dead:
            return []
        self._reap_dead_owners()
        if actor is None:
            from proctor.sandbox import process_start_time

            pid = os.getpid()
            actor = Actor("runtime", f"sweeper:{host}:{pid}:{process_start_time(pid)}")
        return self._close_runs(dead, started, reason, actor, revoke=True)

    def close_restored_runs(self, actor: Actor) -> list[tuple[str, str]]:
        """Record as interrupted every run a restored home's store holds as running:
        the backup was taken while they ran, and whatever runs them is the original
        home's, not this one's. Nothing of the owner is touched (its sandboxes, its
        sockets, the database grants its runs hold: the original may still be
        running them); returns their (tenant, run id)."""
        with self.store.read() as conn:
            rows = conn.query(
                "SELECT id, tenant, deployment, digest, started_at FROM runs"
                " WHERE status = 'running'"
            )
        dead = [(str(r[0]), str(r[1]), str(r[2]), str(r[3])) for r in rows]
        started = {str(r[0]): str(r[4]) if r[4] else "" for r in rows}
        return self._close_runs(dead, started, RESTORED, actor, revoke=False)

    def _close_runs(
        self, dead: list[tuple[str, str, str, str]], started: dict[str, str], reason: str,
        actor: Actor, *, revoke: bool,
    ) -> list[tuple[str, str]]:  # fmt: skip
        """Each run of ``dead`` (id, tenant, deployment, digest) recorded interrupted,
        its calls' missing completions first; ``revoke``: its database grants too."""
        closed = []
        for run_id, tenant, name, digest in dead:

            def update(conn: Conn, run_id: str = run_id) -> None:
                changed = conn.execute(
                    "UPDATE runs SET status = 'interrupted', reason = ?, ended_at = ?"
                    " WHERE id = ? AND status = 'running'",
                    (reason, utc_now(), run_id),
                )
                if changed != 1:
                    raise _AlreadyClosed(f"run {run_id} is closed already")

            self._complete_orphaned_calls(tenant, run_id, started[run_id], actor)
            try:
                self.ledger.append(
                    tenant,
                    EventDraft(actor, Action.RUN_END, f"run/{run_id}",
                               reason=f"interrupted: {reason}", deployment=name, run=run_id,
                               artifact=digest, details={"status": "interrupted"}),
                    hook=update,
                )  # fmt: skip
            except _AlreadyClosed:
                continue
            # What the dead owner made for the run: its copy of the approved code, its CA bundle.
            shutil.rmtree(self.home / "runs" / run_id / "code", ignore_errors=True)
            shutil.rmtree(self.home / "ca-bundles" / tenant / run_id, ignore_errors=True)
            if revoke:
                self._revoke_run_grants(tenant, run_id)
            closed.append((tenant, run_id))
        return closed

    def _complete_orphaned_calls(
        self, tenant: str, run_id: str, started_at: str, actor: Actor
    ) -> None:
        """An egress call whose completion record its dead owner never wrote (its
        answer went out first: docs/architecture.md, "One durable event on the
        hot path") gets one now, marked incomplete: the log says the call was let
        through and that what it moved is not known."""
        from proctor.ledger import EventFilter, iter_events

        decided: dict[int, dict[str, Any]] = {}
        ended: set[int] = set()
        flt = EventFilter(run=run_id, since=started_at or None)
        for data in iter_events(self.ledger, tenant, flt):
            ev = json.loads(data)
            if ev.get("action") == Action.HTTP_REQUEST and ev.get("decision") == "allow":
                decided[int(ev["seq"])] = ev
            elif ev.get("action") == Action.HTTP_REQUEST_END:
                ended.add(int(ev.get("details", {}).get("decision_seq", -1)))
        for seq, ev in sorted(decided.items()):
            if seq in ended:
                continue
            details = ev.get("details", {})
            self.ledger.append(
                tenant,
                EventDraft(actor, Action.HTTP_REQUEST_END, ev["resource"],
                           reason=f"incomplete: {OWNER_DIED} before its completion was recorded",
                           deployment=ev.get("deployment"), run=run_id,
                           artifact=ev.get("artifact"),
                           details={"decision_seq": seq, "host": details.get("host"),
                                    "port": details.get("port"), "incomplete": True,
                                    "error": f"incomplete: {OWNER_DIED}"}),
            )  # fmt: skip

    def _revoke_run_grants(self, tenant: str, run_id: str) -> None:
        # The dead owner's run logins on PostgreSQL datasets (see docs/postgres.md).
        from proctor.broker import revoke_run_grants

        datasets = [(d.kind, d.location, d.name) for d in self.resources.datasets(tenant)]
        try:
            revoke_run_grants(datasets, tenant, run_id)
        except ProctorError as exc:
            log.warning("proctor: run %s's dataset logins not dropped: %s", run_id, exc.message)

    def _reap_dead_owners(self) -> None:
        from proctor.sandbox import SandboxCleanupFailed, reap_orphans

        try:
            reap_orphans()
        except SandboxCleanupFailed as exc:
            # Left registered for the next attempt; the run is over either way.
            log.warning("proctor: %s", exc.message)
        from proctor.broker import reap_broker_sockets

        reap_broker_sockets()

    def log_name(self, tenant: str) -> str:
        """The log a tenant name addresses: ``system`` or an existing tenant."""
        if tenant != SYSTEM_LOG:
            self.tenants.get(tenant)
        return tenant

    def describe_dataset(
        self, tenant: str, name: str, actor: Actor, log: str, details: Mapping[str, Any]
    ) -> dict[str, Any]:
        """``tenant``'s dataset ``name`` described from its own catalog by its kind's
        connector (tables, columns, types; never a row, never its location), once the
        caller has decided the read; recorded as a ``dataset.describe`` event in
        ``log`` (the actor's tenant's) with ``details`` (request id, client): how many
        tables, never which."""
        from proctor.broker import describe_dataset

        found = next((d for d in self.resources.datasets(tenant) if d.name == name), None)
        if found is None:
            raise NotFound(f"no dataset {name!r} in tenant {tenant!r}",
                           hint=f"proctor dataset list -t {tenant}")  # fmt: skip
        tables = describe_dataset(found.kind, found.location)
        self.ledger.append(
            log,
            EventDraft(actor, Action.DATASET_DESCRIBE, f"dataset/{name}",
                       reason="described (tables, columns, types; no rows)",
                       details={**details, "tables": len(tables)}),
        )  # fmt: skip
        return {
            "name": found.name,
            "kind": str(found.kind),
            "synthetic": found.synthetic,
            "twin_of": found.twin_of,
            "tables": [
                {"name": t.name, "kind": t.kind,
                 "columns": [{"name": c.name, "type": c.type, "nullable": c.nullable,
                              "primary_key": c.primary_key} for c in t.columns]}
                for t in tables
            ],
        }  # fmt: skip

    def undeploy(self, tenant: str, name: str, actor: Actor, reason: str) -> None:
        """Stop a deployment and revoke what it was granted outside Proctor (the
        database roles of its PostgreSQL datasets): each dataset's connector knows."""
        self.deployments.set_status(tenant, name, "stopped", actor, reason)
        from proctor.broker import dataset_connector

        for ds in self.resources.datasets(tenant):
            dataset_connector(ds.kind).revoke(ds.location, tenant, name, ds.name)

    # -- egress -----------------------------------------------------------------

    def egress_ranges(self, tenant: str) -> tuple[str, ...]:
        """Special-purpose address ranges the tenant's runs may reach anyway (see
        ``proctor.governance.EgressRanges``)."""
        return self.egress.get(tenant)

    def allow_egress_range(self, tenant: str, cidr: str, actor: Actor) -> tuple[str, ...]:
        return self.egress.allow(tenant, cidr, actor)

    def host_cas(self, tenant: str) -> list[HostCAs]:
        """The CA certificates the tenant registered for named hosts (private upstreams,
        see ``proctor.governance.EgressCAs``)."""
        self.tenants.get(tenant)
        return self.egress_cas.list(tenant)

    def add_host_ca(self, tenant: str, host: str, pem: bytes, actor: Actor,
                    source: str = "the file") -> HostCAs:  # fmt: skip
        """Register CA certificates for ``host``: the broker verifies it against them alone."""
        self.tenants.get(tenant)
        return self.egress_cas.add(tenant, host, pem, actor, source)

    def remove_host_ca(self, tenant: str, host: str, actor: Actor,
                       fingerprint: str | None = None) -> HostCAs:  # fmt: skip
        self.tenants.get(tenant)
        return self.egress_cas.remove(tenant, host, actor, fingerprint)

    def egress_ca_pem(self, tenant: str, hosts: list[str] | None = None) -> bytes:
        """The tenant CA's certificate; with ``hosts``, constrained to those names."""
        from proctor.broker import TenantCA

        return TenantCA(self.home / "ca" / tenant, tenant).ca_pem(hosts)

    def make_broker(
        self, upstream_cafile: str | None = None, rate_limit: RateLimit | None = None
    ) -> Broker:
        """The broker for this runtime's runs, with every real handler; a host whose
        tenant registered CA certificates for it is verified against those alone."""
        from proctor.broker import broker_socket_root, make_broker

        # Released at close, when empty: what a SIGKILL leaves is reaped by owner.
        self._broker_root = broker_socket_root()
        return make_broker(self.home / "ca", self.keys.derive("proctor/broker-tokens/v1"),
                           upstream_cafile=upstream_cafile, rate_limit=rate_limit,
                           upstream_trust=self.egress_cas.pem_for)  # fmt: skip

    def supervisor(self, broker: Broker, backend: str | None = None) -> Supervisor:
        """The supervisor of this runtime's runs, over ``broker`` (from
        :meth:`make_broker`) and the sandbox ``backend`` (None: the best this host
        has). The one place a ``Supervisor`` is built: ``proctor run``, ``serve``,
        the API and the demo start runs alike (``tests/unit/test_layering.py``)."""
        # Lazily: commands that start no run do not load the lifecycle or the sandbox.
        from proctor.lifecycle import Supervisor

        return Supervisor(self, broker, backend)

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
        if isinstance(exc, ProctorError) and self.store_outside is not None:
            _name_store(exc, self.store_outside)
        self.close()


def _name_store(exc: ProctorError, store: str) -> None:
    # Which database a command read or wrote is not obvious when it is not the
    # home's own file; the person reading the error needs it.
    note = f"this home's store is {store}, outside the home"
    if exc.hint is None or note not in exc.hint:
        exc.hint = note if exc.hint is None else f"{exc.hint}; {note}"
