"""The actions an event records, spelled once.

Every event of a log names what was asked or done in its ``action``; the
verifier, evidence packs, OCSF export and people's reads all select events by
it, so a name spelled twice is a name that can drift. Components write and read
these members instead of strings. A member is a ``str``: the canonical bytes of
an event, the Cedar request and every comparison with a stored event's action
are the same as with the plain name.

The data plane's names are also the Cedar actions a call is decided under, and a
refused control-plane call is recorded under the Cedar action it asked for
(policy/_schema.py's schema spells them for Cedar; a test holds the two equal).
"""

from __future__ import annotations

from enum import StrEnum


class Action(StrEnum):
    """An event's ``action``."""

    # -- the data plane: a run's calls out of its sandbox (the broker) ----------
    SQL_SELECT = "sql.select"
    SQL_WRITE = "sql.write"
    FILE_READ = "file.read"
    FILE_WRITE = "file.write"
    HTTP_REQUEST = "http.request"
    HTTP_REQUEST_END = "http.request.end"
    SECRET_USE = "secret.use"  # noqa: S105 - an action, not a secret
    BROKER_AUTH = "broker.auth"
    BROKER_WHOAMI = "broker.whoami"
    BROKER_REQUEST = "broker.request"
    BROKER_RATE_LIMITED = "broker.rate_limited"
    BROKER_CALL_BOUND = "broker.call_bound"
    BROKER_LEDGER_QUOTA = "broker.ledger_quota"
    BROKER_CONNECTIONS_REFUSED = "broker.connections.refused"

    # -- runs ------------------------------------------------------------------
    RUN_START = "run.start"
    RUN_END = "run.end"
    RUN_STOP = "run.stop"
    RUN_READ = "run.read"
    RUN_EVENTS_READ = "run.events.read"
    #: A run's stdout and stderr (data the run wrote): an agent's own runs only.
    RUN_OUTPUT_READ = "run.output.read"
    SANDBOX_RUN = "sandbox.run"
    #: A call of a capability marked ``ask``, waiting for a person's answer (its
    #: exact arguments), and the answer (approved, denied, timed out, abandoned).
    CALL_ASK = "call.ask"
    CALL_ANSWER = "call.answer"

    # -- the control plane ---------------------------------------------------------
    RUNTIME_INIT = "runtime.init"
    TENANT_CREATE = "tenant.create"
    TENANT_READ = "tenant.read"
    TENANT_FREEZE = "tenant.freeze"
    TENANT_UNFREEZE = "tenant.unfreeze"
    TENANT_QUOTA = "tenant.quota"
    PRINCIPAL_CREATE = "principal.create"
    PRINCIPAL_DISABLE = "principal.disable"
    PRINCIPAL_ENABLE = "principal.enable"
    TOKEN_ISSUE = "token.issue"  # noqa: S105 - an action, not a secret
    ARTIFACT_SUBMIT = "artifact.submit"
    ARTIFACT_READ = "artifact.read"
    APPROVAL_GRANT = "approval.grant"
    APPROVAL_REJECT = "approval.reject"
    APPROVAL_REVOKE = "approval.revoke"
    APPROVAL_REQUEST = "approval.request"
    QUORUM_SET = "quorum.set"
    DEPLOYMENT_CREATE = "deployment.create"
    DEPLOYMENT_READ = "deployment.read"
    DEPLOYMENT_ROLLBACK = "deployment.rollback"
    DEPLOYMENT_STOPPED = "deployment.stopped"
    POLICY_SET = "policy.set"
    POLICY_READ = "policy.read"
    DATASET_REGISTER = "dataset.register"
    DATASET_DESCRIBE = "dataset.describe"
    SECRET_REGISTER = "secret.register"  # noqa: S105 - an action, not a secret
    BUCKET_CREATE = "bucket.create"
    BUCKET_LIST = "bucket.list"
    BUCKET_READ = "bucket.read"
    BUCKET_WRITE = "bucket.write"
    EGRESS_RANGE_ALLOW = "egress.range.allow"
    EGRESS_CA_ADD = "egress.ca.add"
    EGRESS_CA_REMOVE = "egress.ca.remove"
    EGRESS_SANDBOX_ALLOW = "egress.sandbox.allow"
    SUBPROCESSOR_ADD = "subprocessor.add"
    SUBPROCESSOR_REMOVE = "subprocessor.remove"
    SUBPROCESSOR_MANAGE = "subprocessor.manage"
    WITNESS_USE = "witness.use"
    WITNESS_REMOVE = "witness.remove"
    WITNESS_POLICY = "witness.policy"
    AUDIT_READ = "audit.read"
    AUDIT_EXPORT = "audit.export"
    EVIDENCE_EXPORT = "evidence.export"

    # -- retention -------------------------------------------------------------------
    RETENTION_READ = "retention.read"
    RETENTION_MANAGE = "retention.manage"
    RETENTION_SET = "retention.set"
    RETENTION_PRUNE = "retention.prune"
    HOLD_ADD = "hold.add"
    HOLD_REMOVE = "hold.remove"
    ERASURE_REQUEST = "erasure.request"
    #: A pruned entry's marker (never an appended event's action).
    LEDGER_PRUNED = "ledger.pruned"

    # -- the API -----------------------------------------------------------------------
    API_REQUEST = "api.request"
    API_RATE_LIMITED = "api.rate_limited"
    API_CONNECTIONS_REFUSED = "api.connections.refused"
    API_LOG_READS = "api.log_reads"


#: The governance actions whose events back the store's rows (governance/_backing.py
#: finds them by resource): the ledger writes each such event's resource into its
#: row's ``ref`` column, indexed (migration 13), and ``verify`` holds every row's
#: ``ref`` to its event, so a cleared or moved ``ref`` is found like altered bytes.
INDEXED_ACTIONS: frozenset[str] = frozenset(
    {
        Action.ARTIFACT_SUBMIT, Action.APPROVAL_GRANT, Action.APPROVAL_REJECT,
        Action.APPROVAL_REVOKE, Action.DEPLOYMENT_CREATE, Action.DEPLOYMENT_ROLLBACK,
        Action.DEPLOYMENT_STOPPED, Action.PRINCIPAL_CREATE, Action.PRINCIPAL_DISABLE,
        Action.PRINCIPAL_ENABLE, Action.TOKEN_ISSUE, Action.QUORUM_SET,
        Action.TENANT_FREEZE, Action.TENANT_UNFREEZE,
    }
)  # fmt: skip


def event_ref(action: object, resource: object) -> str | None:
    """What an event's row holds in ``ref``: its resource if its action is indexed
    (and the resource a string), else None."""
    if isinstance(action, str) and action in INDEXED_ACTIONS and isinstance(resource, str):
        return str(resource)
    return None
