"""Deny-by-default policy: Cedar, through cedarpy.

The public surface of the policy component. Everything else in this package
is private and may change without notice.

- :func:`compile_policies` parses, checks and validates a policy text once;
  the :class:`CompiledPolicies` it returns is reused for every decision.
- :func:`decide` answers a :class:`Request` with a :class:`Decision` (allow
  or deny, the deciding policies' ``@id`` values, the policy version, any
  evaluation errors, and its ``reason``: the words recorded beside it and
  given in a refusal). It never raises; every failure is a deny.
- :class:`EntityRef`, :class:`Entity`, :class:`EntitySet`, :class:`IpAddr`
  build requests and entities without hand-written Cedar JSON.
- :func:`capability_policies` turns an approved capability set into the
  permits of one deployment's workloads.
- :func:`evaluate_request` is what ``proctor policy test`` runs.
- :class:`EgressRule` and :func:`egress_rules`: the request rules an egress host
  may carry in approved capabilities (methods, paths, byte bounds, body digests).

Identifiers are namespaced: entity types ``Proctor::Table``, actions
``Proctor::Action::"sql.select"``. See docs/policy.md.
"""

from proctor.policy._capabilities import CAPABILITY_KEYS, capability_policies
from proctor.policy._egress_rules import (
    RULE_KEYS,
    RULE_PREFIX,
    EgressRule,
    check_pattern,
    egress_rules,
)
from proctor.policy._engine import (
    CompiledPolicies,
    Decision,
    compile_policies,
    decide,
    evaluate_request,
    normalize_text,
    policy_version,
)
from proctor.policy._hosts import DEFAULT_PORT, normalize_host, split_host_port
from proctor.policy._model import CedarValue, Entity, EntityRef, EntitySet, IpAddr, Request
from proctor.policy._schema import (
    ACTIONS,
    CONTROL_PLANE_ACTIONS,
    DATA_PLANE_ACTIONS,
    ENTITY_TYPES,
    NAMESPACE,
    schema_text,
)

__all__ = [
    "ACTIONS",
    "CAPABILITY_KEYS",
    "CONTROL_PLANE_ACTIONS",
    "DATA_PLANE_ACTIONS",
    "DEFAULT_PORT",
    "ENTITY_TYPES",
    "NAMESPACE",
    "RULE_KEYS",
    "RULE_PREFIX",
    "CedarValue",
    "CompiledPolicies",
    "Decision",
    "EgressRule",
    "Entity",
    "EntityRef",
    "EntitySet",
    "IpAddr",
    "Request",
    "capability_policies",
    "check_pattern",
    "compile_policies",
    "decide",
    "egress_rules",
    "evaluate_request",
    "normalize_host",
    "normalize_text",
    "policy_version",
    "schema_text",
    "split_host_port",
]
