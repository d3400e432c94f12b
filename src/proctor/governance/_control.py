"""Control-plane authorization: Cedar decides what each principal may do in its tenant.

The role policy is Proctor's own (below), instantiated per tenant and parsed once
per tenant. A principal acts only inside its own tenant: nothing permits a
resource of another tenant, so such a request is denied by default. The local
operator is the runtime's owner and is not decided here, but every one of its
actions is recorded like anyone else's.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from proctor.errors import ControlDenied, NotFound
from proctor.governance._policies import policy_object
from proctor.governance._principals import AGENT_ROLE, ROLES, Principal
from proctor.governance._runs import RunRecord
from proctor.ledger import Action, EventDraft, Ledger, LedgerObject
from proctor.policy import (
    CompiledPolicies,
    Decision,
    Entity,
    EntityRef,
    EntitySet,
    Request,
    compile_policies,
    decide,
)

if TYPE_CHECKING:
    # Deployments imports approvals, which import this module.
    from proctor.governance._deployments import Deployments

_ROLE_ACTIONS = {
    "developer": (
        Action.ARTIFACT_SUBMIT,
        Action.ARTIFACT_READ,
        Action.APPROVAL_REQUEST,
        Action.BUCKET_READ,
        Action.DATASET_DESCRIBE,
        Action.DEPLOYMENT_CREATE,
        Action.DEPLOYMENT_READ,
        Action.DEPLOYMENT_ROLLBACK,
        Action.RUN_START,
        Action.RUN_READ,
        Action.RUN_OUTPUT_READ,
        Action.RUN_STOP,
        Action.TENANT_READ,
    ),
    "approver": (
        Action.APPROVAL_GRANT,
        Action.APPROVAL_REJECT,
        Action.APPROVAL_REVOKE,
        Action.CALL_ANSWER,
        Action.ARTIFACT_READ,
        Action.DEPLOYMENT_READ,
        Action.RUN_READ,
        Action.RUN_OUTPUT_READ,
        Action.TENANT_READ,
    ),
    "auditor": (
        Action.AUDIT_READ,
        Action.RUN_EVENTS_READ,
        Action.EVIDENCE_EXPORT,
        Action.DATASET_DESCRIBE,
        Action.ARTIFACT_READ,
        Action.DEPLOYMENT_READ,
        Action.RUN_READ,
        Action.RUN_OUTPUT_READ,
        Action.POLICY_READ,
        Action.RETENTION_READ,
        Action.TENANT_READ,
    ),
    # An AI agent (issue 35): describes data (never rows), submits code, deploys to
    # the sandbox and runs there, reads runs, asks the approvers. Never a bucket's
    # objects (data), never the tenant's whole log; the forbids below hold the rest.
    AGENT_ROLE: (
        Action.ARTIFACT_SUBMIT,
        Action.ARTIFACT_READ,
        Action.APPROVAL_REQUEST,
        Action.DATASET_DESCRIBE,
        Action.DEPLOYMENT_CREATE,
        Action.DEPLOYMENT_READ,
        Action.RUN_START,
        Action.RUN_READ,
        Action.TENANT_READ,
    ),
}

#: What an agent may never do, whatever roles a row claims it holds, by the forbid
#: that says so and why (the refusal's explanation, recorded with it).
_AGENT_NEVER: dict[str, tuple[tuple[str, ...], str]] = {
    "control:agent-never-approves": (
        (Action.APPROVAL_GRANT, Action.APPROVAL_REJECT, Action.APPROVAL_REVOKE, Action.CALL_ANSWER),
        "an agent may not approve, reject, revoke or answer an asked call: a person"
        " approves (GDPR Art. 28(3)(a): the documented instructions come from a person)",
    ),
    "control:agent-never-administers": (
        (
            Action.PRINCIPAL_CREATE,
            Action.TOKEN_ISSUE,
            Action.TENANT_CREATE,
            Action.TENANT_FREEZE,
            Action.TENANT_UNFREEZE,
            Action.POLICY_SET,
            Action.QUORUM_SET,
            Action.RETENTION_MANAGE,
            Action.ERASURE_REQUEST,
            Action.SUBPROCESSOR_MANAGE,
            Action.DATASET_REGISTER,
            Action.SECRET_REGISTER,
            Action.BUCKET_WRITE,
        ),
        "an agent may not manage principals, tokens, the tenant, its policies or its"
        " resources: a person administers the tenant the agent works in",
    ),
    "control:agent-sandbox-only": (
        (Action.DEPLOYMENT_CREATE, Action.DEPLOYMENT_ROLLBACK),
        "an agent deploys to the sandbox only: a production deployment is a person's"
        " (GDPR Art. 28(3)(a): the documented instruction to process comes from a person)",
    ),
}


def explain(policies: tuple[str, ...]) -> str | None:
    """Why an agent was refused, in words, if one of ``policies`` is an agent forbid."""
    for pid in policies:
        found = _AGENT_NEVER.get(pid)
        if found is not None:
            return found[1]
    return None


def _agent_forbids() -> list[str]:
    from proctor.policy import CONTROL_PLANE_ACTIONS

    out = []
    for pid, (actions, _) in _AGENT_NEVER.items():
        # An action the schema does not have (yet) cannot be named; nothing permits it.
        acts = ", ".join(
            f'Proctor::Action::"{a}"' for a in actions if str(a) in CONTROL_PLANE_ACTIONS
        )
        condition = ""
        if pid == "control:agent-sandbox-only":
            # Without the environment in the context, an agent is refused (fails closed).
            condition = ' unless { context has environment && context.environment == "sandbox" }'
        out.append(
            f'@id("{pid}")\n'
            f"forbid(principal is Proctor::Agent, action in [{acts}], resource){condition};"
        )
    return out


def role_policy(tenant: str) -> str:
    """Proctor's built-in control-plane policy for ``tenant``."""
    parts = [
        f'@id("control:admin")\n'
        f'permit(principal in Proctor::Role::"{tenant}/admin",'
        f' action in Proctor::Action::"control-plane",'
        f' resource in Proctor::Tenant::"{tenant}");'
    ]
    for role, actions in _ROLE_ACTIONS.items():
        acts = ", ".join(f'Proctor::Action::"{a}"' for a in actions)
        parts.append(
            f'@id("control:{role}")\n'
            f'permit(principal in Proctor::Role::"{tenant}/{role}", action in [{acts}],'
            f' resource in Proctor::Tenant::"{tenant}");'
        )
    # A developer reads the events of the runs of deployments they created, and no
    # other part of the tenant's log (which holds other people's work).
    parts.append(
        f'@id("control:developer-own-run-events")\n'
        f'permit(principal in Proctor::Role::"{tenant}/developer",'
        f' action == Proctor::Action::"run.events.read",'
        f' resource in Proctor::Tenant::"{tenant}")'
        " when { context.principal_is_creator };"
    )
    # An agent reads the events and the output of the runs it started (of a
    # production deployment a person made, too) and of the sandbox deployments it
    # made; another run's output may hold data no approval let it see.
    parts.append(
        f'@id("control:agent-own-run-events")\n'
        f'permit(principal in Proctor::Role::"{tenant}/{AGENT_ROLE}",'
        ' action in [Proctor::Action::"run.events.read", Proctor::Action::"run.output.read"],'
        f' resource in Proctor::Tenant::"{tenant}")'
        " when { context.principal_is_creator ||"
        " (context has principal_started_run && context.principal_started_run) };"
    )
    parts.extend(_agent_forbids())
    parts.append(
        '@id("control:separation-of-duties")\n'
        'forbid(principal, action == Proctor::Action::"approval.grant", resource)'
        " when { context.principal_is_author };"
    )
    # The author of the code a run runs does not answer its asked calls either.
    parts.append(
        '@id("control:separation-of-duties-calls")\n'
        'forbid(principal, action == Proctor::Action::"call.answer", resource)'
        " when { context.principal_is_author };"
    )
    return "\n".join(parts) + "\n"


class ControlPlane:
    def __init__(self, ledger: Ledger) -> None:
        self._ledger = ledger
        self._compiled: dict[str, CompiledPolicies] = {}
        self._lock = threading.Lock()

    def _policies(self, tenant: str) -> CompiledPolicies:
        with self._lock:
            compiled = self._compiled.get(tenant)
            if compiled is None:
                compiled = compile_policies(role_policy(tenant))
                self._compiled[tenant] = compiled
            return compiled

    def role_policy_object(self, tenant: str) -> LedgerObject:
        """The role policy of ``tenant``'s principals as a ledger object named by the
        version its decisions cite, stored with an event that cites it."""
        return policy_object(self._policies(tenant))

    def decide(
        self,
        principal: Principal,
        action: str,
        resource: EntityRef,
        tenant: str,
        context: Mapping[str, Any] | None = None,
    ) -> Decision:
        """Decide for ``principal``; ``tenant`` is the tenant that owns ``resource``."""
        pref = EntityRef.user(principal.tenant, principal.name)
        if principal.kind == "service":
            pref = EntityRef.service_account(principal.tenant, principal.name)
        elif principal.kind == "agent":
            pref = EntityRef.agent(principal.tenant, principal.name)
        parents = tuple(EntityRef.role(principal.tenant, r) for r in principal.roles)
        entities = [
            Entity(pref, {}, (*parents, EntityRef.tenant(principal.tenant))),
            *(
                Entity(
                    EntityRef.role(principal.tenant, r), {}, (EntityRef.tenant(principal.tenant),)
                )
                for r in ROLES
            ),
            Entity(EntityRef.tenant(tenant), {}),
        ]
        if resource.type != "Tenant":
            entities.append(Entity(resource, {}, (EntityRef.tenant(tenant),)))
        return decide(
            self._policies(principal.tenant),
            Request(pref, action, resource, dict(context or {})),
            EntitySet(entities),
        )

    def authorize(
        self,
        principal: Principal,
        action: str,
        resource: EntityRef,
        tenant: str,
        *,
        event_resource: str,
        context: Mapping[str, Any] | None = None,
    ) -> Decision:
        """Decide; a refusal is recorded in the principal's tenant log and raised."""
        decision = self.decide(principal, action, resource, tenant, context)
        if not decision.allowed:
            why = (
                "forbidden by " + ", ".join(decision.policies)
                if decision.policies
                else f"no role of {principal.id} permits it"
            )
            because = explain(decision.policies)
            if because is not None:
                why = f"{why}: {because}"
            details: dict[str, Any] = {"policy_version": decision.version}
            if tenant != principal.tenant:
                details["target_tenant"] = tenant
            self._ledger.append(
                principal.tenant,
                EventDraft(
                    principal.actor,
                    action,
                    event_resource,
                    decision="deny",
                    policies=decision.policies,
                    reason=why,
                    details=details,
                    # The role policy that refused, named by the version the event cites,
                    # so an evidence pack carries its text (it changes with releases).
                    objects=(policy_object(self._policies(principal.tenant)),),
                ),
            )
            raise ControlDenied(
                f"{principal.id} may not {action} {event_resource}: {why}", decision.policies
            )
        return decision


def run_events_context(
    deployments: Deployments,
    principal: Principal | None,
    run: RunRecord,
    ledger: Ledger | None = None,
) -> dict[str, Any]:
    """The Cedar context of ``run.events.read`` on ``run``: whether ``principal``
    created the deployment version the run ran (the developer's permit needs it) and,
    for an agent, whether it started the run (read from ``ledger``'s run.start
    event: who started a run is in the signed record, not the row)."""
    if principal is None:
        return {"principal_is_creator": False}
    try:
        versions = deployments.versions(run.tenant, run.deployment)
    except NotFound:
        versions = []  # a throwaway run has no deployment: nobody created it
    creator = next((d.created_by for d in versions if d.version == run.version), None)
    context: dict[str, Any] = {"principal_is_creator": creator == principal.id}
    if principal.kind == "agent" and ledger is not None:
        context["principal_started_run"] = started_by(ledger, run) == principal.id
    return context


def started_by(ledger: Ledger, run: RunRecord) -> str | None:
    """Who the ledger says started ``run`` (its allowed run.start event's actor)."""
    from proctor.ledger import EventFilter, parse_canonical, query_events

    flt = EventFilter(run=run.id, action=Action.RUN_START, decision="allow", since=run.started_at)
    for data in query_events(ledger, run.tenant, flt, limit=1, newest=False):
        ev, _ = parse_canonical(data)
        return str(ev["actor"]["id"])
    return None
