"""The API's JSON shapes (its OpenAPI schemas)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

_NAME = r"^[a-z][a-z0-9._-]{0,62}$"


class Strict(BaseModel):
    # Unknown fields are refused: a misspelt option must not silently do nothing.
    model_config = ConfigDict(extra="forbid")


class PrincipalOut(BaseModel):
    tenant: str
    name: str
    kind: str
    roles: list[str]
    disabled: bool
    responsible: str | None = None


class PrincipalCreate(Strict):
    name: str = Field(pattern=_NAME, max_length=63)
    kind: Literal["user", "service", "agent"] = "user"
    # An agent's role is its kind's: none need be given (approver or admin is refused).
    roles: list[Literal["developer", "approver", "auditor", "admin", "agent"]] = Field(
        default_factory=list, max_length=5
    )
    responsible: str | None = Field(
        default=None, max_length=128, description="An agent's: the person or team answerable"
    )


class PrincipalCreated(BaseModel):
    principal: PrincipalOut
    token: str = Field(description="Shown once; only its hash is kept")


class TokenOut(BaseModel):
    token: str


class TenantOut(BaseModel):
    name: str
    status: str
    created_at: str
    created_by: str
    origin: str
    log_size: int


class FreezeIn(Strict):
    reason: str = Field(default="", max_length=1000)


class ArtifactOut(BaseModel):
    tenant: str
    digest: str
    name: str
    manifest: dict[str, Any]
    capabilities_hash: str
    purpose: str
    author: str
    submitted_at: str
    size: int
    file_count: int


class FindingOut(BaseModel):
    """Something the manifest names that the tenant lacks, and the command that fixes it."""

    message: str
    fix: str


class SubmittedOut(ArtifactOut):
    """A submission, and what ``deploy`` would refuse today (the submission stands)."""

    warnings: list[FindingOut] = []


class ArtifactFileOut(BaseModel):
    model_config = ConfigDict(extra="allow")
    path: str


class ArtifactDetail(ArtifactOut):
    files: list[ArtifactFileOut]


class ApprovalIn(Strict):
    expires_seconds: int = Field(default=30 * 86400, ge=60, le=400 * 86400)
    comment: str = Field(default="", max_length=4000)


class RejectionIn(Strict):
    comment: str = Field(default="", max_length=4000)


class ApprovalOut(BaseModel):
    id: str
    tenant: str
    digest: str
    capabilities_hash: str
    purpose: str
    principal: str
    roles: list[str]
    decision: str
    comment: str
    created_at: str
    expires_at: str | None
    revoked_at: str | None
    revoked_by: str | None


class QuorumOut(BaseModel):
    required: int
    roles: list[str]


class QuorumIn(Strict):
    required: int = Field(ge=1, le=100)
    roles: list[Literal["developer", "approver", "auditor", "admin"]] = Field(
        default_factory=list, max_length=4
    )


class DeploymentIn(Strict):
    digest: str = Field(min_length=1, max_length=80)
    name: str = Field(pattern=r"^[a-z][a-z0-9-]{0,62}$")
    environment: Literal["sandbox", "production"] = "sandbox"
    # None: the manifest's lifecycle; anything else must equal it (it was approved).
    mode: Literal["job", "service", "schedule"] | None = None
    every_seconds: float | None = Field(default=None, ge=1, le=366 * 86400)
    instruction: str = Field(min_length=1, max_length=4000)
    reference: str = Field(default="", max_length=400)


class DeploymentOut(BaseModel):
    tenant: str
    name: str
    version: int
    digest: str
    environment: str
    mode: str
    every_seconds: float | None
    instruction: str
    reference: str
    approvals: list[str]
    created_by: str
    created_at: str
    status: str


class StopIn(Strict):
    reason: str = Field(default="stopped by request", max_length=1000)


class RunOut(BaseModel):
    id: str
    tenant: str
    deployment: str
    version: int
    digest: str
    environment: str
    workload: str
    approvals: list[str]
    backend: str
    platform: str | None
    status: str
    reason: str | None
    exit_code: int | None
    attempt: int
    limits: dict[str, Any]
    output_digest: str | None
    started_at: str
    ended_at: str | None


class PolicyOut(BaseModel):
    tenant: str
    version: str
    text: str
    set_at: str
    set_by: str
    seq: int


class PolicyIn(Strict):
    text: str = Field(max_length=512 * 1024)


class DecisionOut(BaseModel):
    decision: str
    allowed: bool
    policies: list[str]
    version: str
    errors: list[str]


class DatasetOut(BaseModel):
    name: str
    kind: str
    synthetic: bool
    twin_of: str | None


class SecretOut(BaseModel):
    name: str
    hosts: list[str]
    header: str
    twin_of: str | None = None  # a test secret: what sandbox runs get instead of twin_of


class SubprocessorOut(BaseModel):
    """A processor the tenant's data may go to (GDPR Art. 28): egress reaches only
    the hosts some subprocessor names."""

    tenant: str
    name: str
    purpose: str
    location: str
    hosts: list[str]
    created_at: str
    created_by: str


class SecretIn(Strict):
    value: str = Field(min_length=1, max_length=16384)
    hosts: list[str] = Field(min_length=1, max_length=64)
    header: str = Field(default="Authorization", max_length=200)
    template: str = Field(default="Bearer {secret}", max_length=1000)
    twin_of: str | None = Field(default=None, max_length=63)


class CheckpointOut(BaseModel):
    size: int
    time: str
    note: str


class InclusionOut(BaseModel):
    index: int
    size: int
    leaf_hash: str = Field(description="base64")
    hashes: list[str] = Field(description="base64, leaf to root (RFC 9162 §2.1.3)")


class ConsistencyOut(BaseModel):
    old: int
    new: int
    hashes: list[str] = Field(description="base64 (RFC 9162 §2.1.4)")


class VerifyOut(BaseModel):
    origin: str
    size: int
    root: str = Field(description="base64")
    checkpoints: int
    pruned: int = Field(0, description="entries pruned past retention (markers verified)")


class HealthOut(BaseModel):
    status: str
    version: str


class KeyOut(BaseModel):
    verifier_key: str = Field(description="C2SP signed-note verifier key")
    trust_domain: str
