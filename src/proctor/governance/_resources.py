"""What a tenant lets its runs reach through the broker: datasets, secrets, buckets.

Only the runtime holds a dataset's location and a secret's value. Registering
one is a control action recorded in the tenant's log (the value never is).
Each has a sandbox counterpart (a synthetic dataset twin, a test secret twin,
the sandbox bucket tree, the hosts marked for sandbox use); which one a run
gets is decided in one place, governance/_environments.py.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

from proctor.errors import AlreadyExists, NotFound, ProctorError, UsageError
from proctor.governance._keys import KeyRing
from proctor.governance._manifest import egress_entry
from proctor.governance._objects import (
    MAX_OBJECT_BYTES,
    BucketObject,
    ObjectMissing,
    ObjectTooBig,
    ObjectUnsafe,
    bucket_problem,
    key_problem,
    list_object_files,
    read_object_file,
    stage_object,
)
from proctor.ledger import Action, Actor, EventDraft, Ledger, TxHook, utc_now
from proctor.store import Conn, Store

_NAME_RE = re.compile(r"^[a-z][a-z0-9_]{0,62}$")


def _check_name(kind: str, name: str) -> None:
    if not _NAME_RE.match(name):
        raise UsageError(
            f"invalid {kind} name {name!r}",
            hint="use a lowercase letter, then up to 62 lowercase letters, digits or _",
        )


class DatasetKind(StrEnum):
    """The kinds of dataset a tenant registers: the one place their names are spelled.
    Each has its connector in the broker's registry (``broker._connectors``)."""

    SQLITE = "sqlite"
    POSTGRESQL = "postgresql"


def _dataset_kind(name: str, kind: str) -> DatasetKind:
    try:
        return DatasetKind(kind)
    except ValueError:
        raise ProctorError(
            f"dataset {name!r} is of an unknown kind {kind!r} in the store"
        ) from None


@dataclass(frozen=True)
class Dataset:
    tenant: str
    name: str
    kind: DatasetKind
    location: str
    synthetic: bool
    twin_of: str | None = None


@dataclass(frozen=True)
class Secret:
    tenant: str
    name: str
    hosts: tuple[str, ...]
    header: str
    template: str
    twin_of: str | None = None  # a test secret: sandbox runs get it instead of twin_of


#: Bucket trees of the sandbox environment live apart from production's, under a
#: name no tenant can take (tenant names start with a letter or digit).
SANDBOX_BUCKETS = ".sandbox"


#: (kind, location) of a dataset, checked to be reachable before it is registered.
#: Which kind a location is, and how to reach it, is each dataset connector's to
#: say; the broker sits above governance, so the runtime hands its registry in
#: (``proctor.broker.locate_dataset``).
LocateDataset = Callable[[Path | str], tuple[DatasetKind, str]]
#: What of a manifest's tables a dataset (kind, location) lacks, as sentences
#: (``proctor.broker.missing_in_dataset``); raises UsageError if it cannot be read.
MissingInDataset = Callable[[DatasetKind, str, Mapping[str, Any]], list[str]]
#: The objects of a dataset (kind, location) every role may read or run, as
#: sentences (``proctor.broker.exposed_in_dataset``).
ExposedInDataset = Callable[[DatasetKind, str], list[str]]


class Resources:
    def __init__(
        self, store: Store, ledger: Ledger, keys: KeyRing, buckets_root: Path,
        locate: LocateDataset, missing: MissingInDataset | None = None,
        exposed: ExposedInDataset | None = None,
    ) -> None:  # fmt: skip
        self._missing = missing
        self._exposed = exposed
        self._store = store
        self._ledger = ledger
        self._keys = keys
        self._buckets_root = buckets_root
        self._locate = locate

    def _record(
        self,
        tenant: str,
        actor: Actor,
        action: str,
        resource: str,
        details: dict[str, object],
        hook: TxHook,
    ) -> None:
        self._ledger.append(
            tenant,
            EventDraft(actor, action, resource, reason="registered", details=details),
            hook=hook,
        )

    # -- datasets -----------------------------------------------------------

    def add_dataset(
        self,
        tenant: str,
        name: str,
        path: Path | str,
        actor: Actor,
        *,
        synthetic: bool = False,
        twin_of: str | None = None,
        accept_public_grants: str | None = None,
    ) -> Dataset:
        """Register a dataset: a SQLite file, or a PostgreSQL DSN (``postgresql://…``)
        that only the runtime holds; ``twin_of`` makes it the synthetic stand-in of a
        real one. A database that grants objects to PUBLIC (every role, so every run's
        login) is refused unless ``accept_public_grants`` gives the reason it may."""
        _check_name("dataset", name)
        if twin_of is not None:
            if not synthetic:
                raise UsageError("only a synthetic dataset can be a twin (add --synthetic)")
            real = {d.name: d for d in self.datasets(tenant)}.get(twin_of)
            if real is None or real.synthetic:
                raise UsageError(f"--twin-of: {twin_of!r} is not a real dataset of {tenant!r}")
        if accept_public_grants is not None and not accept_public_grants.strip():
            raise UsageError("--accept-public-grants needs a reason")
        kind, location = self._locate(path)
        exposed = self._exposed(kind, location) if self._exposed is not None else []
        if exposed and accept_public_grants is None:
            shown = ", ".join(exposed[:20]) + (", ..." if len(exposed) > 20 else "")
            raise UsageError(
                f"the dataset's database grants to PUBLIC, so to every run's login whatever"
                f" Cedar forbids: {shown}",
                hint="REVOKE them from PUBLIC and grant them to the roles that need them"
                " (docs/postgres.md), or give --accept-public-grants REASON",
            )

        def insert(conn: Conn) -> None:
            if conn.query_one(
                "SELECT 1 FROM datasets WHERE tenant = ? AND name = ?", (tenant, name)
            ):
                raise AlreadyExists(f"dataset {name!r} exists already in tenant {tenant!r}")
            if twin_of is not None and conn.query_one(
                "SELECT 1 FROM datasets WHERE tenant = ? AND twin_of = ?", (tenant, twin_of)
            ):
                raise AlreadyExists(f"dataset {twin_of!r} has a synthetic twin already")
            conn.execute(
                "INSERT INTO datasets (tenant, name, kind, location, synthetic, created_at,"
                " twin_of) VALUES (?, ?, ?, ?, ?, ?, ?)",
                (tenant, name, kind, location, int(synthetic), utc_now(), twin_of),
            )

        # The location is the runtime's business; the event names the dataset only.
        self._record(
            tenant,
            actor,
            Action.DATASET_REGISTER,
            f"dataset/{name}",
            {"kind": kind, "synthetic": synthetic, "twin_of": twin_of}
            | (
                {"public_grants": exposed[:20], "public_grants_accepted": accept_public_grants}
                if exposed
                else {}
            ),
            insert,
        )
        return Dataset(tenant, name, kind, location, synthetic, twin_of)

    def missing(self, dataset: Dataset, tables: Mapping[str, Any]) -> list[str]:
        """What of ``tables`` (a manifest's) ``dataset`` does not have; nothing is
        checked when the runtime handed in no connector registry."""
        if self._missing is None:
            return []
        return self._missing(dataset.kind, dataset.location, tables)

    def datasets(self, tenant: str) -> list[Dataset]:
        with self._store.read() as conn:
            rows = conn.query(
                "SELECT name, kind, location, synthetic, twin_of FROM datasets WHERE tenant = ?"
                " ORDER BY name",
                (tenant,),
            )
        return [
            Dataset(tenant, str(r[0]), _dataset_kind(str(r[0]), str(r[1])), str(r[2]), bool(r[3]),
                    None if r[4] is None else str(r[4]))
            for r in rows
        ]  # fmt: skip

    # -- secrets ------------------------------------------------------------

    def set_secret(
        self,
        tenant: str,
        name: str,
        value: str,
        hosts: list[str],
        actor: Actor,
        *,
        header: str = "Authorization",
        template: str = "Bearer {secret}",
        twin_of: str | None = None,
    ) -> Secret:
        """Store a secret sealed; ``twin_of`` makes it the test stand-in of a real
        secret, the only one sandbox runs of code that names the real one get."""
        _check_name("secret", name)
        if not value:
            raise UsageError("a secret's value must not be empty")
        if "\n" in value or "\r" in value:
            raise UsageError("a secret's value must be one line (it goes into a header)")
        if "{secret}" not in template:
            raise UsageError("the header template must contain {secret}")
        if not re.match(r"^[A-Za-z0-9-]{1,64}$", header):
            raise UsageError(f"invalid header name {header!r}")
        if not hosts:
            raise UsageError("bind the secret to at least one host")
        norm = tuple(sorted({egress_entry(h, "--host") for h in hosts}))
        if twin_of is not None:
            if twin_of == name:
                raise UsageError("a secret cannot be its own twin")
            real = {s.name: s for s in self.secrets(tenant)}.get(twin_of)
            if real is None or real.twin_of is not None:
                raise UsageError(f"--twin-of: {twin_of!r} is not a real secret of {tenant!r}")
        sealed = self._keys.seal(value)

        def upsert(conn: Conn) -> None:
            row = conn.query_one(
                "SELECT twin_of FROM secrets WHERE tenant = ? AND name = ?", (tenant, name)
            )
            # A real secret never quietly becomes a test one, nor the reverse.
            if row is not None and row[0] != twin_of:
                was = f"the test twin of {row[0]!r}" if row[0] else "a real secret"
                raise UsageError(
                    f"secret {name!r} is {was}; it keeps that role when its value changes"
                )
            if twin_of is not None and conn.query_one(
                "SELECT 1 FROM secrets WHERE tenant = ? AND twin_of = ? AND name <> ?",
                (tenant, twin_of, name),
            ):
                raise AlreadyExists(f"secret {twin_of!r} has a test twin already")
            conn.execute(
                "INSERT INTO secrets (tenant, name, sealed, hosts, header, template, created_at,"
                " twin_of) VALUES (?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT (tenant, name) DO UPDATE"
                " SET sealed = excluded.sealed, hosts = excluded.hosts, header = excluded.header,"
                " template = excluded.template, created_at = excluded.created_at",
                (tenant, name, sealed, ",".join(norm), header, template, utc_now(), twin_of),
            )

        self._record(
            tenant,
            actor,
            Action.SECRET_REGISTER,
            f"secret/{name}",
            {"hosts": list(norm), "header": header, "twin_of": twin_of},
            upsert,
        )
        return Secret(tenant, name, norm, header, template, twin_of)

    def secrets(self, tenant: str) -> list[Secret]:
        with self._store.read() as conn:
            rows = conn.query(
                "SELECT name, hosts, header, template, twin_of FROM secrets WHERE tenant = ?"
                " ORDER BY name",
                (tenant,),
            )
        return [
            Secret(tenant, str(r[0]), tuple(str(r[1]).split(",")), str(r[2]), str(r[3]),
                   None if r[4] is None else str(r[4]))
            for r in rows
        ]  # fmt: skip

    def secret_value(self, tenant: str, name: str) -> str:
        with self._store.read() as conn:
            row = conn.query_one(
                "SELECT sealed FROM secrets WHERE tenant = ? AND name = ?", (tenant, name)
            )
        if row is None:
            raise NotFound(f"no secret {name!r} in tenant {tenant!r}")
        return self._keys.unseal(bytes(row[0]))

    # -- buckets ------------------------------------------------------------

    def bucket_dir(self, tenant: str) -> Path:
        """The tenant's bucket tree: its objects, which production runs bind."""
        return self._buckets_root / tenant

    def sandbox_bucket_dir(self, tenant: str) -> Path:
        """The tenant's sandbox bucket tree, apart from its objects (which tree a
        run binds is ``_environments.bucket_dir``'s rule)."""
        return self._buckets_root / SANDBOX_BUCKETS / tenant

    def add_bucket(self, tenant: str, name: str, actor: Actor) -> Path:
        _check_name("bucket", name)
        path = self.bucket_dir(tenant) / name

        def insert(conn: Conn) -> None:
            if conn.query_one(
                "SELECT 1 FROM buckets WHERE tenant = ? AND name = ?", (tenant, name)
            ):
                raise AlreadyExists(f"bucket {name!r} exists already in tenant {tenant!r}")
            conn.execute(
                "INSERT INTO buckets (tenant, name, created_at) VALUES (?, ?, ?)",
                (tenant, name, utc_now()),
            )
            path.mkdir(mode=0o700, parents=True, exist_ok=True)
            (self.sandbox_bucket_dir(tenant) / name).mkdir(mode=0o700, parents=True, exist_ok=True)

        self._record(tenant, actor, Action.BUCKET_CREATE, f"bucket/{name}", {}, insert)
        return path

    def buckets(self, tenant: str) -> list[str]:
        with self._store.read() as conn:
            rows = conn.query("SELECT name FROM buckets WHERE tenant = ? ORDER BY name", (tenant,))
        return [str(r[0]) for r in rows]

    # -- a person's reads and writes of bucket objects ------------------------------
    # The caller decides first (the CLI's authorize_read, the API's ctx.authorize);
    # these check the names exactly as the broker checks a run's, walk the bucket
    # without following a link, and record each call with the object's SHA-256 and
    # size, never its content.

    def _bucket_root(self, tenant: str, bucket: str) -> Path:
        problem = bucket_problem(bucket)
        if problem is not None:
            raise UsageError(f"bucket {bucket!r}: {problem}")
        with self._store.read() as conn:
            row = conn.query_one(
                "SELECT 1 FROM buckets WHERE tenant = ? AND name = ?", (tenant, bucket)
            )
        if row is None:
            raise NotFound(
                f"no bucket {bucket!r} in tenant {tenant!r}",
                hint=f"proctor bucket list -t {tenant} shows its buckets",
            )
        return self.bucket_dir(tenant)

    @staticmethod
    def _check_key(key: str) -> None:
        problem = key_problem(key)
        if problem is not None:
            shown = key if key.isprintable() and len(key) <= 200 else repr(key)[:200]
            raise UsageError(
                f"bad object key {shown!r}: {problem}",
                hint="a key is a relative path such as reports/2026/churn.csv",
            )

    def objects(self, tenant: str, bucket: str, actor: Actor) -> list[BucketObject]:
        """The bucket's objects (key, size, SHA-256, modified), sorted by key."""
        root = self._bucket_root(tenant, bucket)
        try:
            found = list_object_files(root, bucket)
        except ObjectMissing:
            found = []  # registered, nothing written yet
        except ObjectUnsafe:
            raise UsageError(f"bucket {bucket!r} is not a plain directory") from None
        self._ledger.append(
            tenant,
            EventDraft(
                actor, Action.BUCKET_LIST, f"bucket/{bucket}", reason="listed",
                details={"bucket": bucket, "objects": len(found)},
            ),
        )  # fmt: skip
        return found

    def get_object(
        self, tenant: str, bucket: str, key: str, actor: Actor, *,
        max_bytes: int = MAX_OBJECT_BYTES,
    ) -> bytes:  # fmt: skip
        """The object's exact bytes; the read is recorded before they are returned."""
        root = self._bucket_root(tenant, bucket)
        self._check_key(key)
        try:
            data = read_object_file(root, bucket, key, max_bytes)
        except ObjectMissing:
            raise NotFound(
                f"no object {key!r} in bucket {bucket!r}",
                hint=f"proctor bucket objects -t {tenant} {bucket} lists its keys",
            ) from None
        except ObjectUnsafe:
            raise UsageError(
                f"{key!r} in bucket {bucket!r} is a link, a directory or a special file; "
                "it is not followed"
            ) from None
        except ObjectTooBig:
            raise UsageError(f"the object is larger than {max_bytes} bytes") from None
        self._ledger.append(
            tenant,
            EventDraft(
                actor, Action.BUCKET_READ, f"bucket/{bucket}/{key}", reason="read",
                details={"bucket": bucket, "key": key, "bytes": len(data),
                         "sha256": hashlib.sha256(data).hexdigest()},
            ),
        )  # fmt: skip
        return data

    def put_object(
        self, tenant: str, bucket: str, key: str, data: bytes, actor: Actor, *,
        max_bytes: int = MAX_OBJECT_BYTES,
    ) -> BucketObject:  # fmt: skip
        """Write the object atomically: staged, fsync'd, recorded, then renamed into
        place, so no reader sees an object whose write is not in the ledger."""
        root = self._bucket_root(tenant, bucket)
        self._check_key(key)
        if len(data) > max_bytes:
            raise UsageError(f"the object is larger than {max_bytes} bytes")
        try:
            staged = stage_object(root, bucket, key)
        except ObjectMissing:
            raise NotFound(f"bucket {bucket!r} has no directory under the home") from None
        except ObjectUnsafe:
            raise UsageError(
                f"{key!r} in bucket {bucket!r} runs through or names a link or a non-file"
            ) from None
        digest = hashlib.sha256(data).hexdigest()
        try:
            staged.write(data)
            staged.finish()
            self._ledger.append(
                tenant,
                EventDraft(
                    actor, Action.BUCKET_WRITE, f"bucket/{bucket}/{key}", reason="written",
                    details={"bucket": bucket, "key": key, "bytes": len(data),
                             "sha256": digest},
                ),
            )  # fmt: skip
        except BaseException:
            staged.discard()
            raise
        staged.commit()
        return BucketObject(key, len(data), digest, utc_now())

    # -- the hosts sandbox runs may reach ----------------------------------------

    def allow_sandbox_host(self, tenant: str, host: str, actor: Actor) -> str:
        """Mark a host for sandbox use: sandbox runs reach no other (a mock API, a
        test instance), whatever their manifest or the tenant's policies permit."""
        entry = egress_entry(host, "host")

        def insert(conn: Conn) -> None:
            if conn.query_one(
                "SELECT 1 FROM sandbox_hosts WHERE tenant = ? AND host = ?", (tenant, entry)
            ):
                raise AlreadyExists(f"{entry} is marked for sandbox use already in {tenant!r}")
            conn.execute(
                "INSERT INTO sandbox_hosts (tenant, host, created_at, created_by)"
                " VALUES (?, ?, ?, ?)",
                (tenant, entry, utc_now(), actor.id),
            )

        self._ledger.append(
            tenant,
            EventDraft(actor, Action.EGRESS_SANDBOX_ALLOW, f"host/{entry}",
                       reason="marked for sandbox use", details={"host": entry}),
            hook=insert,
        )  # fmt: skip
        return entry

    def sandbox_hosts(self, tenant: str) -> list[str]:
        with self._store.read() as conn:
            rows = conn.query(
                "SELECT host FROM sandbox_hosts WHERE tenant = ? ORDER BY host", (tenant,)
            )
        return [str(r[0]) for r in rows]
