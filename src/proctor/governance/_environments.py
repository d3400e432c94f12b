"""The two environments, defined and enforced in this one place.

``production`` is approved code on real data: the tenant's datasets, secrets and
buckets, and egress only to hosts a registered subprocessor covers.

``sandbox`` is the build loop, for code nobody approved, and it reaches only
stand-ins, whatever its manifest asks and whatever the tenant's policies permit:

- datasets: synthetic ones, or the synthetic twin of the real one the manifest
  names (a deployment whose datasets have neither is refused);
- buckets: the sandbox tree (``<buckets>/.sandbox/<tenant>``), empty until sandbox
  runs write to it; never the production objects;
- secrets: the test twin registered for the real secret (``secret set --twin-of``),
  or none at all: the real value is never bound;
- egress: only the hosts the tenant marked for sandbox use; a tenant-wide forbid,
  so no permit can widen it.

The supervisor takes every binding of a run from :func:`bindings`, in both
environments, so there is no second place where the rule could differ. The
environments' names are :class:`Environment`, spelled here only; every other
module asks the rules below (:func:`requires_quorum`, :func:`is_production`,
:func:`environment_forbid`, :func:`bound_datasets`, :func:`bucket_dir`) instead
of comparing names.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any, TypeVar

from proctor.errors import ProctorError, SyntheticOnly, UsageError
from proctor.governance._resources import Dataset, Resources, Secret
from proctor.governance._subprocessors import Subprocessors, egress_forbid, subprocessor_forbid

SANDBOX_EGRESS_FORBID_ID = "tenant:sandbox-egress"
_Twinned = TypeVar("_Twinned", Dataset, Secret)


class Environment(StrEnum):
    """Where a deployment runs: the one place the names are spelled."""

    PRODUCTION = "production"
    SANDBOX = "sandbox"


#: The environments' names, in the order the CLI offers them.
ENVIRONMENTS: tuple[str, ...] = (Environment.SANDBOX.value, Environment.PRODUCTION.value)


def environment_of(name: str) -> Environment:
    """The environment called ``name``; a name that is none is refused."""
    try:
        return Environment(name)
    except ValueError:
        raise UsageError(f"--env must be one of {', '.join(ENVIRONMENTS)}") from None


def is_production(environment: str) -> bool:
    """Approved code on real data: a run's signed receipt, the populations an auditor
    samples and the records of processing count these runs only."""
    return environment == Environment.PRODUCTION


def requires_quorum(environment: str) -> bool:
    """Whether a deployment in ``environment``, and every start and call of its runs,
    is held to a quorum of independent approvals. Production is; the sandbox runs
    code nobody approved and is held instead to stand-ins (:func:`check_synthetic`)."""
    return environment == Environment.PRODUCTION


def takes_production_names(environment: str) -> bool:
    """Whether a deployment in ``environment`` may have the name of a production one:
    only production (a sandbox deployment never takes or replaces one)."""
    return environment == Environment.PRODUCTION


def egress_to_subprocessors_only(environment: str) -> bool:
    """Whether ``environment``'s egress goes only to hosts a registered subprocessor
    covers (GDPR Art. 28(2)/(4)): production's; the sandbox has its own host list."""
    return environment == Environment.PRODUCTION


def bucket_dir(resources: Resources, tenant: str, environment: str) -> Path:
    """The tenant's bucket tree for ``environment``'s runs: sandbox runs get a tree of
    their own, so code nobody approved never reads or overwrites production objects."""
    if environment_of(environment) is Environment.SANDBOX:
        return resources.sandbox_bucket_dir(tenant)
    return resources.bucket_dir(tenant)


@dataclass(frozen=True)
class Bindings:
    """What one run of a deployment is given, by the names its manifest uses."""

    environment: Environment
    datasets: Mapping[str, Dataset]
    secrets: Mapping[str, Secret]
    buckets_dir: Path
    forbid: str  # Cedar text added to the run's policy set; forbid wins over permit


def check_synthetic(resources: Resources, tenant: str, capabilities: Mapping[str, Any]) -> None:
    """Refuse a sandbox deployment whose datasets would be real data."""
    wanted = sorted(capabilities.get("datasets", {}))
    bound = bound_datasets(resources, tenant, wanted, Environment.SANDBOX)
    real = [name for name in wanted if name not in bound]
    if real:
        raise SyntheticOnly(
            f"a sandbox deployment may only use synthetic data; {', '.join(real)} is "
            "neither marked synthetic nor has a synthetic twin",
            hint="register one with `proctor dataset add --synthetic --twin-of NAME`, "
            "or deploy to production (with approvals)",
        )


def bindings(
    resources: Resources,
    subprocessors: Subprocessors,
    tenant: str,
    environment: str,
    capabilities: Mapping[str, Any],
) -> Bindings:
    """Everything a run binds in ``environment``, for the capabilities it was given."""
    try:
        env = Environment(environment)
    except ValueError:
        raise ProctorError(f"unknown environment {environment!r}") from None
    datasets = bound_datasets(
        resources, tenant, sorted(capabilities.get("datasets", {})), environment
    )
    secrets = _secrets(resources, tenant, list(capabilities.get("secrets", [])), environment)
    buckets_dir = bucket_dir(resources, tenant, environment)
    if environment == Environment.SANDBOX:
        # The sandbox tree has a directory for every registered bucket (tenants made
        # before it existed get theirs here), so sandbox writes have somewhere to go.
        for name in resources.buckets(tenant):
            (buckets_dir / name).mkdir(mode=0o700, parents=True, exist_ok=True)
    forbid = environment_forbid(resources, subprocessors, tenant, environment)
    return Bindings(env, datasets, secrets, buckets_dir, forbid)


def environment_forbid(
    resources: Resources, subprocessors: Subprocessors, tenant: str, environment: str
) -> str:
    """The Cedar forbid every run in ``environment`` gets (read-only: ``policy show
    --effective`` shows exactly what a run is given)."""
    if environment == Environment.SANDBOX:
        return egress_forbid(SANDBOX_EGRESS_FORBID_ID, resources.sandbox_hosts(tenant))
    # No egress to a host no registered subprocessor covers (GDPR Art. 28(2)/(4)).
    return subprocessor_forbid(tenant, subprocessors.list(tenant))


def bound_datasets(
    resources: Resources, tenant: str, names: list[str], environment: str
) -> dict[str, Dataset]:
    """What each of ``names`` is bound to in ``environment``'s runs (absent: nothing)."""
    # A synthetic dataset is fit for both; a real one reaches the sandbox only
    # through its twin.
    return _bind(resources.datasets(tenant), names, environment,
                 sandbox_ok=lambda d: d.synthetic, production_ok=lambda d: True)  # fmt: skip


def _secrets(
    resources: Resources, tenant: str, names: list[str], environment: str
) -> dict[str, Secret]:
    # A test secret is fit for the sandbox only; a real one only for production.
    return _bind(resources.secrets(tenant), names, environment,
                 sandbox_ok=lambda s: s.twin_of is not None,
                 production_ok=lambda s: s.twin_of is None)  # fmt: skip


def _bind(
    items: list[_Twinned],
    names: list[str],
    environment: str,
    *,
    sandbox_ok: Callable[[_Twinned], bool],
    production_ok: Callable[[_Twinned], bool],
) -> dict[str, _Twinned]:
    """What each name a manifest uses is bound to in ``environment``: the item
    itself where it is fit for it, else (in the sandbox) its twin, else nothing."""
    by_name = {i.name: i for i in items}
    twins = {i.twin_of: i for i in items if i.twin_of}
    out: dict[str, _Twinned] = {}
    for name in names:
        item = by_name.get(name)
        if item is None:
            continue
        if environment == Environment.SANDBOX:
            bound = item if sandbox_ok(item) else twins.get(name)
        else:
            bound = item if production_ok(item) else None
        if bound is not None:
            out[name] = bound
    return out
