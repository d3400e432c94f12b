"""Deployments: an approved digest bound to a tenant, an environment and a lifecycle.

A deployment is the documented instruction of GDPR Art. 28(3)(a): who instructed
what processing, for which purpose, approved by whom. Production needs a quorum
of valid approvals when deployed (and again at every run start); a sandbox
deployment needs none but may only touch datasets marked synthetic. Each change
is a new version, so ``rollback`` can go back to the previous one.

What runs is what was approved: the lifecycle (mode, schedule) is part of the
manifest and so of the digest, and a deployment that asks for another one is
refused. A sandbox deployment never takes or replaces a production deployment's
name, so a production name always runs approved code.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Protocol

from proctor.errors import NotApproved, NotFound, NotReady, ProductionName, UsageError
from proctor.governance._approvals import Approvals, ArtifactInfo
from proctor.governance._environments import (
    Environment,
    bound_datasets,
    check_synthetic,
    egress_to_subprocessors_only,
    environment_of,
    requires_quorum,
    takes_production_names,
)
from proctor.governance._manifest import Manifest
from proctor.governance._resources import Resources
from proctor.governance._subprocessors import Subprocessor, Subprocessors, covers, split_entry
from proctor.ledger import Action, Actor, EventDraft, Ledger, utc_now
from proctor.store import Conn, Store

MODES = ("job", "service", "schedule")
_NAME_RE = re.compile(r"^[a-z][a-z0-9-]{0,62}$")


class WithCapabilities(ArtifactInfo, Protocol):
    @property
    def capabilities(self) -> dict[str, Any]: ...
    @property
    def manifest(self) -> Manifest: ...


@dataclass(frozen=True)
class Deployment:
    tenant: str
    name: str
    version: int
    digest: str
    environment: str
    mode: str
    every_seconds: float | None
    instruction: str
    reference: str
    approvals: tuple[str, ...]
    created_by: str
    created_at: str
    status: str  # active | superseded | stopped

    def as_json(self) -> dict[str, Any]:
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in self.__dict__.items()}


_COLUMNS = (
    "tenant, name, version, digest, environment, mode, every_seconds, instruction, reference,"
    " approvals, created_by, created_at, status"
)


def _row(r: tuple[Any, ...]) -> Deployment:
    return Deployment(
        str(r[0]), str(r[1]), int(r[2]), str(r[3]), str(r[4]), str(r[5]),
        None if r[6] is None else float(r[6]), str(r[7]), str(r[8]),
        tuple(json.loads(r[9])), str(r[10]), str(r[11]), str(r[12]),
    )  # fmt: skip


@dataclass(frozen=True)
class Finding:
    """Something a manifest names that the tenant lacks, and the command that fixes it."""

    message: str
    fix: str


def _egress_covered(entry: str, register: list[Subprocessor]) -> bool:
    """Whether some subprocessor covers every host the manifest's entry may reach: a
    name, or for ``*.domain`` every name below it (the same wildcard or a wider one)."""
    name, port = split_entry(entry)
    for sp in register:
        for h in sp.hosts:
            if not name.startswith("*."):
                if covers(h, name, port):
                    return True
                continue
            sp_name, sp_port = split_entry(h)
            if (
                sp_port == port
                and sp_name.startswith("*.")
                and (name == sp_name or name.endswith(sp_name[1:]))
            ):
                return True
    return False


def readiness(
    resources: Resources,
    subprocessors: Subprocessors,
    tenant: str,
    capabilities: dict[str, Any],
    environment: str = Environment.PRODUCTION,
) -> list[Finding]:
    """What a run of these capabilities would be refused for because of the tenant's
    set-up rather than its code: datasets not registered, and (in production, where
    egress goes only to registered subprocessors) hosts no subprocessor covers. Found
    at deploy (refused) and at submit (warned), not at the first run."""
    found: list[Finding] = []
    wanted = capabilities.get("datasets", {})
    registered = {d.name for d in resources.datasets(tenant)}
    for name in sorted(wanted):
        if name not in registered:
            found.append(Finding(
                f"the manifest reads dataset {name!r}, which is not registered in {tenant}",
                f"proctor dataset add -t {tenant} {name} --sqlite PATH"
                " (or --postgres-env VAR)",
            ))  # fmt: skip
    # The tables and columns, in the dataset this environment's runs are bound to
    # (a real one's synthetic twin in the sandbox): a run would be refused on them.
    bound = bound_datasets(resources, tenant, sorted(wanted), environment)
    for name, dataset in sorted(bound.items()):
        which = name if dataset.name == name else f"{name} (its twin {dataset.name})"
        try:
            lacks = resources.missing(dataset, wanted[name].get("tables", {}))
        except UsageError as exc:
            lacks = [f"it cannot be read to check ({exc.message})"]
        if lacks:
            found.append(Finding(
                f"dataset {which} of {tenant}: {'; '.join(lacks)}",
                f"correct datasets.{name}.tables in proctor.toml and submit the new digest,"
                f" or register the dataset that has them (proctor dataset list -t {tenant})",
            ))  # fmt: skip
    if egress_to_subprocessors_only(environment):
        register = subprocessors.list(tenant)
        for entry in capabilities.get("egress", []):
            if not _egress_covered(entry, register):
                found.append(Finding(
                    f"egress to {entry} is not covered by any registered subprocessor of"
                    f" {tenant} (GDPR Art. 28(2)): every call there would be refused",
                    f"proctor subprocessor add -t {tenant} NAME --purpose '...'"
                    f" --location '...' --host {entry}",
                ))  # fmt: skip
    return found


def check_readiness(
    resources: Resources,
    subprocessors: Subprocessors,
    tenant: str,
    capabilities: dict[str, Any],
    environment: str,
) -> None:
    found = readiness(resources, subprocessors, tenant, capabilities, environment)
    if found:
        raise NotReady(
            "; ".join(f.message for f in found),
            hint="run: " + "; then: ".join(f.fix for f in found),
        )


class Deployments:
    def __init__(
        self, store: Store, ledger: Ledger, approvals: Approvals, resources: Resources
    ) -> None:
        self._store = store
        self._ledger = ledger
        self._approvals = approvals
        self._resources = resources

    def check_synthetic(self, tenant: str, artifact: WithCapabilities) -> None:
        check_synthetic(self._resources, tenant, artifact.capabilities)

    @staticmethod
    def lifecycle(
        artifact: WithCapabilities, mode: str | None, every_seconds: float | None
    ) -> tuple[str, float | None]:
        """The mode and interval a deployment runs with: the manifest's own. A flag
        that asks for another one is refused, since nobody approved it."""
        approved = artifact.manifest.lifecycle
        want_mode = approved.mode if mode is None else mode
        want_every = every_seconds
        if want_every is None and want_mode == approved.mode:
            want_every = approved.every_seconds
        if want_mode != approved.mode or want_every != approved.every_seconds:
            said = f'mode = "{approved.mode}"' + (
                f", every = {approved.every_seconds:g}s" if approved.every_seconds else ""
            )
            asked = f"{want_mode}" + (f" every {want_every:g}s" if want_every else "")
            raise NotApproved(
                f"the deployment asks for {asked}, but the artifact's approved manifest says"
                f" {said}; the lifecycle is part of what is approved",
                hint="deploy without --mode/--every to use the manifest's lifecycle, or change"
                " [lifecycle] in proctor.toml and submit the new digest for approval",
            )
        return want_mode, want_every

    def check_name(
        self, tenant: str, name: str, environment: str, conn: Conn | None = None
    ) -> None:
        if takes_production_names(environment):
            return
        query = "SELECT 1 FROM deployments WHERE tenant = ? AND name = ? AND environment = ?"
        params = (tenant, name, Environment.PRODUCTION.value)
        if conn is None:
            with self._store.read() as reader:
                taken = reader.query_one(query, params) is not None
        else:
            taken = conn.query_one(query, params) is not None
        if taken:
            raise ProductionName(
                f"{name!r} is a production deployment of {tenant!r}; a sandbox deployment"
                " never takes or replaces a production name",
                hint=f"deploy to the sandbox under another name, e.g. {name}-sandbox",
            )

    def deploy(
        self,
        tenant: str,
        artifact: WithCapabilities,
        name: str,
        *,
        environment: str,
        instruction: str,
        actor: Actor,
        mode: str | None = None,
        every_seconds: float | None = None,
        reference: str = "",
        rollback_of: int | None = None,
    ) -> Deployment:
        if not _NAME_RE.match(name):
            raise UsageError(f"invalid deployment name {name!r} (lowercase, digits, '-')")
        environment = environment_of(environment).value
        if mode is not None and mode not in MODES:
            raise UsageError(f"--mode must be one of {', '.join(MODES)}")
        if every_seconds is not None and every_seconds < 1:
            raise UsageError("--every must be at least one second")
        if every_seconds is not None:
            # The signed record holds str(every_seconds) and the row reads back a float:
            # an int 3600 would sign "3600" and every run would then fail its backing check.
            every_seconds = float(every_seconds)
        mode, every_seconds = self.lifecycle(artifact, mode, every_seconds)
        if not instruction.strip():
            raise UsageError(
                "a deployment needs an --instruction: the documented instruction for this "
                "processing (GDPR Art. 28(3)(a))"
            )
        # Recorded whole in the deployment's event, which has a fixed bound.
        for option, text, most in (
            ("--instruction", instruction, 2048),
            ("--reference", reference, 512),
        ):
            if len(json.dumps(text, ensure_ascii=False)) > most:
                raise UsageError(
                    f"{option} takes more than {most} bytes as the audit log records it",
                    hint="cite the document (--reference) instead of pasting it",
                )
        self.check_name(tenant, name, environment, None)
        approvals: list[str] = []
        if requires_quorum(environment):
            approvals = [a.id for a in self._approvals.require_quorum(tenant, artifact)]
        else:
            self.check_synthetic(tenant, artifact)
        # After the approval checks, whose refusals come first: a set-up the tenant
        # lacks is refused here, with the command that fixes it, not at the first run.
        check_readiness(self._resources, Subprocessors(self._store, self._ledger), tenant,
                        dict(artifact.capabilities), environment)  # fmt: skip
        created_at = utc_now()
        holder: list[Deployment] = []

        def insert(conn: Conn) -> None:
            row = conn.query_one(
                "SELECT MAX(version) FROM deployments WHERE tenant = ? AND name = ?",
                (tenant, name),
            )
            version = int(row[0]) + 1 if row and row[0] is not None else 1
            self.check_name(tenant, name, environment, conn)  # again, under the write lock
            conn.execute(
                "UPDATE deployments SET status = 'superseded' WHERE tenant = ? AND name = ?"
                " AND status = 'active'",
                (tenant, name),
            )
            dep = Deployment(
                tenant, name, version, artifact.digest, environment, mode, every_seconds,
                instruction, reference, tuple(approvals), actor.id, created_at, "active",
            )  # fmt: skip
            conn.execute(
                f"INSERT INTO deployments ({_COLUMNS}, seq) VALUES"  # noqa: S608
                " (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, 0)",
                (
                    tenant, name, version, dep.digest, environment, mode, every_seconds,
                    instruction, reference, json.dumps(approvals), actor.id, created_at,
                    "active",
                ),
            )  # fmt: skip
            holder.append(dep)

        self._ledger.append(
            tenant,
            EventDraft(
                actor,
                Action.DEPLOYMENT_ROLLBACK if rollback_of is not None else Action.DEPLOYMENT_CREATE,
                f"deployment/{name}",
                reason="deployed" if rollback_of is None else f"rolled back to {rollback_of}",
                deployment=name,
                artifact=artifact.digest,
                approvals=tuple(approvals),
                details={
                    "environment": environment,
                    "mode": mode,
                    "every_seconds": None if every_seconds is None else str(every_seconds),
                    "instruction": instruction,
                    "reference": reference,
                    "purpose": artifact.purpose,
                    "capabilities_hash": artifact.capabilities_hash,
                },
            ),
            hook=insert,
        )
        return holder[0]

    def versions(self, tenant: str, name: str) -> list[Deployment]:
        with self._store.read() as conn:
            rows = conn.query(
                f"SELECT {_COLUMNS} FROM deployments WHERE tenant = ? AND name = ?"  # noqa: S608
                " ORDER BY version",
                (tenant, name),
            )
        if not rows:
            raise NotFound(f"no deployment {name!r} in tenant {tenant!r}")
        return [_row(r) for r in rows]

    def get(self, tenant: str, name: str) -> Deployment:
        """The current version (active, or the last one if it was stopped)."""
        return self.versions(tenant, name)[-1]

    def current(self, tenant: str) -> list[Deployment]:
        with self._store.read() as conn:
            rows = conn.query(
                f"SELECT {_COLUMNS} FROM deployments d WHERE tenant = ? AND version ="  # noqa: S608
                " (SELECT MAX(version) FROM deployments e WHERE e.tenant = d.tenant"
                " AND e.name = d.name) ORDER BY name",
                (tenant,),
            )
        return [_row(r) for r in rows]

    def at(self, tenant: str, when: str) -> list[Deployment]:
        """The deployments in force at ``when``: for each name, the last version made by then."""
        with self._store.read() as conn:
            rows = conn.query(
                f"SELECT {_COLUMNS} FROM deployments d WHERE tenant = ? AND created_at <= ?"  # noqa: S608
                " AND version = (SELECT MAX(version) FROM deployments e WHERE"
                " e.tenant = d.tenant AND e.name = d.name AND e.created_at <= ?) ORDER BY name",
                (tenant, when, when),
            )
        return [_row(r) for r in rows]

    def set_status(self, tenant: str, name: str, status: str, actor: Actor, reason: str) -> None:
        current = self.get(tenant, name)

        def update(conn: Conn) -> None:
            conn.execute(
                "UPDATE deployments SET status = ? WHERE tenant = ? AND name = ? AND version = ?",
                (status, tenant, name, current.version),
            )

        self._ledger.append(
            tenant,
            EventDraft(actor, f"deployment.{status}", f"deployment/{name}", reason=reason,
                       deployment=name, artifact=current.digest),
            hook=update,
        )  # fmt: skip
