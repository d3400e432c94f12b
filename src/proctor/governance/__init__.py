"""Tenants, their policies and resources (and, later, principals, artifacts,
approvals, deployments, runs)."""

from proctor.governance._keys import KeyRing
from proctor.governance._policies import Policies, PolicyVersion
from proctor.governance._resources import Dataset, Resources, Secret
from proctor.governance._tenants import Tenant, Tenants, validate_tenant_name

__all__ = [
    "Dataset",
    "KeyRing",
    "Policies",
    "PolicyVersion",
    "Resources",
    "Secret",
    "Tenant",
    "Tenants",
    "validate_tenant_name",
]
