"""Tenants (and, later, principals, artifacts, approvals, deployments, runs)."""

from proctor.governance._tenants import Tenant, Tenants, validate_tenant_name

__all__ = ["Tenant", "Tenants", "validate_tenant_name"]
