"""Tenants and everything that governs what runs for them: principals and tokens,
control-plane authorization, policies, resources, artifacts, approvals, deployments."""

from proctor.governance._approvals import (
    DEFAULT_EXPIRY,
    Approval,
    ApprovalRequired,
    Approvals,
    ArtifactInfo,
    QuorumRule,
)
from proctor.governance._control import ControlDenied, ControlPlane, role_policy
from proctor.governance._deployments import (
    ENVIRONMENTS,
    MODES,
    Deployment,
    Deployments,
    SyntheticOnly,
)
from proctor.governance._keys import KeyRing
from proctor.governance._policies import Policies, PolicyVersion
from proctor.governance._principals import (
    KINDS,
    ROLES,
    AuthenticationFailed,
    Principal,
    Principals,
)
from proctor.governance._resources import Dataset, Resources, Secret
from proctor.governance._tenants import Tenant, Tenants, validate_tenant_name

__all__ = [
    "DEFAULT_EXPIRY",
    "ENVIRONMENTS",
    "KINDS",
    "MODES",
    "ROLES",
    "Approval",
    "ApprovalRequired",
    "Approvals",
    "ArtifactInfo",
    "AuthenticationFailed",
    "ControlDenied",
    "ControlPlane",
    "Dataset",
    "Deployment",
    "Deployments",
    "KeyRing",
    "Policies",
    "PolicyVersion",
    "Principal",
    "Principals",
    "QuorumRule",
    "Resources",
    "Secret",
    "SyntheticOnly",
    "Tenant",
    "Tenants",
    "role_policy",
    "validate_tenant_name",
]
