"""What the components above governance need of an opened Proctor home.

The runtime (``proctor.runtime.Runtime``) opens a home and wires it; the
lifecycle and the evidence sit below it in the order of components, so they
take this Protocol instead of importing the runtime. The runtime satisfies it
structurally (mypy checks that at every call site).
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from proctor.governance._approvals import Approvals
from proctor.governance._artifacts import Artifacts
from proctor.governance._asks import Asks
from proctor.governance._deployments import Deployments
from proctor.governance._egress import EgressRanges
from proctor.governance._keys import KeyRing
from proctor.governance._policies import Policies
from proctor.governance._resources import Resources
from proctor.governance._subprocessors import Subprocessors
from proctor.governance._tenants import Tenants
from proctor.ledger import Actor, Ledger
from proctor.store import Store


class HomeConfig(Protocol):
    @property
    def trust_domain(self) -> str: ...


class Home(Protocol):
    """An opened home: its directory, store, ledger, keys and governance services."""

    @property
    def home(self) -> Path: ...
    @property
    def config(self) -> HomeConfig: ...
    @property
    def store(self) -> Store: ...
    @property
    def ledger(self) -> Ledger: ...
    @property
    def keys(self) -> KeyRing: ...
    @property
    def tenants(self) -> Tenants: ...
    @property
    def policies(self) -> Policies: ...
    @property
    def resources(self) -> Resources: ...
    @property
    def subprocessors(self) -> Subprocessors: ...
    @property
    def artifacts(self) -> Artifacts: ...
    @property
    def approvals(self) -> Approvals: ...
    @property
    def asks(self) -> Asks: ...
    @property
    def deployments(self) -> Deployments: ...
    @property
    def egress(self) -> EgressRanges: ...
    @property
    def operator(self) -> Actor:
        """The local operator as this process runs (OS user and host)."""
        ...

    def log_name(self, tenant: str) -> str:
        """The log a tenant name addresses: ``system`` or an existing tenant."""
        ...

    def egress_ca_pem(self, tenant: str, hosts: list[str] | None = None) -> bytes:
        """The tenant CA's certificate; with ``hosts``, constrained to those names."""
        ...

    def close_orphaned_runs(
        self, actor: Actor | None = None, *, other_hosts: bool = False, skip: str | None = None,
        node: str | None = None,
    ) -> list[tuple[str, str]]:  # fmt: skip
        """Record as interrupted every run left 'running' by an owner that is gone
        (or, with ``node``, every run of that node, found dead by its lease)."""
        ...
