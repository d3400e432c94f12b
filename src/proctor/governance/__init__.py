"""Tenants and everything that governs what runs for them: principals and tokens,
control-plane authorization, policies, resources, artifacts, approvals, deployments."""

from proctor.errors import (
    ApprovalRequired,
    AuthenticationFailed,
    ControlDenied,
    NotApproved,
    ProductionName,
    SyntheticOnly,
)
from proctor.governance._approvals import (
    DEFAULT_EXPIRY,
    Approval,
    Approvals,
    ArtifactInfo,
    QuorumRule,
)
from proctor.governance._artifacts import (
    Artifact,
    ArtifactDiff,
    ArtifactFile,
    Artifacts,
    CapabilityChange,
    FileChange,
    artifact_digest,
)
from proctor.governance._backing import (
    RowProblem,
    Unbacked,
    decision_problems,
    require_backed,
    submission_problems,
    unbacked_rows,
)
from proctor.governance._control import ControlPlane, role_policy, run_events_context
from proctor.governance._deployments import (
    ENVIRONMENTS,
    MODES,
    Deployment,
    Deployments,
)
from proctor.governance._egress import EgressRanges
from proctor.governance._environments import Bindings, bindings
from proctor.governance._home import Home, HomeConfig
from proctor.governance._keys import KeyRing
from proctor.governance._manifest import (
    Lifecycle,
    Manifest,
    RunLimits,
    capabilities_hash,
    check_entrypoint,
    egress_entry,
    load_manifest,
    parse_manifest,
)
from proctor.governance._objects import (
    MAX_KEY_LENGTH,
    MAX_OBJECT_BYTES,
    BucketObject,
    ObjectMissing,
    ObjectTooBig,
    ObjectUnsafe,
    StagedObject,
    bucket_problem,
    key_problem,
    list_object_files,
    read_object_file,
    stage_object,
)
from proctor.governance._policies import EMPTY as EMPTY_POLICY
from proctor.governance._policies import Policies, PolicyVersion
from proctor.governance._principals import (
    KINDS,
    ROLES,
    Principal,
    Principals,
)
from proctor.governance._resources import Dataset, Resources, Secret
from proctor.governance._runs import RunRecord, Runs, RunStanding
from proctor.governance._subprocessors import (
    Subprocessor,
    Subprocessors,
    covers,
    split_entry,
    subprocessor_forbid,
)
from proctor.governance._tenants import Tenant, Tenants, validate_tenant_name

__all__ = [
    "DEFAULT_EXPIRY",
    "EMPTY_POLICY",
    "ENVIRONMENTS",
    "KINDS",
    "MAX_KEY_LENGTH",
    "MAX_OBJECT_BYTES",
    "MODES",
    "ROLES",
    "Approval",
    "ApprovalRequired",
    "Approvals",
    "Artifact",
    "ArtifactDiff",
    "ArtifactFile",
    "ArtifactInfo",
    "Artifacts",
    "AuthenticationFailed",
    "Bindings",
    "BucketObject",
    "CapabilityChange",
    "ControlDenied",
    "ControlPlane",
    "Dataset",
    "Deployment",
    "Deployments",
    "EgressRanges",
    "FileChange",
    "Home",
    "HomeConfig",
    "KeyRing",
    "Lifecycle",
    "Manifest",
    "NotApproved",
    "ObjectMissing",
    "ObjectTooBig",
    "ObjectUnsafe",
    "Policies",
    "PolicyVersion",
    "Principal",
    "Principals",
    "ProductionName",
    "QuorumRule",
    "Resources",
    "RowProblem",
    "RunLimits",
    "RunRecord",
    "RunStanding",
    "Runs",
    "Secret",
    "StagedObject",
    "Subprocessor",
    "Subprocessors",
    "SyntheticOnly",
    "Tenant",
    "Tenants",
    "Unbacked",
    "artifact_digest",
    "bindings",
    "bucket_problem",
    "capabilities_hash",
    "check_entrypoint",
    "covers",
    "decision_problems",
    "egress_entry",
    "key_problem",
    "list_object_files",
    "load_manifest",
    "parse_manifest",
    "read_object_file",
    "require_backed",
    "role_policy",
    "run_events_context",
    "split_entry",
    "stage_object",
    "submission_problems",
    "subprocessor_forbid",
    "unbacked_rows",
    "validate_tenant_name",
]
