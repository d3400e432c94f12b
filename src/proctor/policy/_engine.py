"""Compiled policy sets and decisions."""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import cedarpy

from proctor.errors import PolicyError
from proctor.policy._model import Entity, EntityRef, EntitySet, Request
from proctor.policy._schema import schema_handle

_CEDAR_ID = re.compile(r"`(policy\d+)`")


@dataclass(frozen=True, slots=True)
class Decision:
    """The answer to one :class:`Request`, with what decided it.

    ``policies`` are the ``@id`` values of the deciding policies: the permits
    that allowed, the forbids that denied, or the policies whose evaluation
    failed (and so denied); empty for the default deny.
    """

    allowed: bool
    policies: tuple[str, ...]
    version: str
    errors: tuple[str, ...] = ()

    @property
    def decision(self) -> Literal["allow", "deny"]:
        return "allow" if self.allowed else "deny"

    @property
    def why(self) -> str:
        """What decided, in words that fit after a colon inside a longer reason.

        ``permitted by a, b``, ``forbidden by a, b``, ``policy evaluation
        failed`` or ``no policy permits it`` (the default deny).
        """
        if self.allowed:
            return "permitted by " + ", ".join(self.policies)
        if self.errors:
            # Checked before the policies: a failing policy is named in
            # ``policies`` too, and did not forbid anything.
            return "policy evaluation failed"
        if self.policies:
            return "forbidden by " + ", ".join(self.policies)
        return "no policy permits it"

    @property
    def reason(self) -> str:
        """The reason recorded beside the decision and given in a refusal.

        It follows the call it explains (``sql.select on t forbidden by p``),
        so a deny that no policy forbade says it was denied.
        """
        if self.allowed or (self.policies and not self.errors):
            return self.why
        return "denied: " + self.why

    def to_json(self) -> dict[str, Any]:
        return {
            "decision": self.decision,
            "allowed": self.allowed,
            "policies": list(self.policies),
            "version": self.version,
            "errors": list(self.errors),
        }


class CompiledPolicies:
    """A policy set parsed and validated once, reused for every decision.

    ``text`` is the normalized policy text and ``version`` its SHA-256
    (``sha256:<hex>``), so anyone holding the text can recompute the version
    recorded beside a decision.
    """

    __slots__ = ("_ids", "_policy_set", "policy_ids", "text", "version")

    def __init__(self, text: str, policy_set: cedarpy.PolicySet, ids: Mapping[str, str]) -> None:
        self.text = text
        self.version = policy_version(text)
        self._policy_set = policy_set
        # Cedar names policies by position (policy0, policy1, ...), which
        # shifts whenever a policy is added above; decisions report the @id.
        self._ids = dict(ids)
        self.policy_ids: tuple[str, ...] = tuple(ids.values())

    def __len__(self) -> int:
        return len(self.policy_ids)

    def __repr__(self) -> str:
        return f"CompiledPolicies(version={self.version!r}, policies={len(self)})"

    def _translate(self, message: str) -> str:
        return _rename(message, self._ids)


def normalize_text(text: str) -> str:
    """The form policy text is stored and hashed in.

    Only line endings, trailing blanks and surrounding blank lines are
    normalized, on purpose not Cedar's formatter: a version written to the
    ledger today must be recomputable from the stored text with nothing but
    SHA-256, whatever cedarpy release reformats policies differently later.
    """
    lines = text.replace("\r\n", "\n").replace("\r", "\n").split("\n")
    body = "\n".join(line.rstrip() for line in lines).strip("\n")
    return body + "\n" if body else ""


def policy_version(text: str) -> str:
    """``sha256:<hex>`` of the normalized text."""
    return "sha256:" + hashlib.sha256(normalize_text(text).encode("utf-8")).hexdigest()


def compile_policies(text: str) -> CompiledPolicies:
    """Parse, check and validate ``text`` once; :class:`PolicyError` if it is not fit.

    Refused: Cedar syntax errors, templates, a policy without an ``@id``, two
    policies with one ``@id``, and anything Cedar's validator rejects against
    the Proctor schema. Messages are Cedar's own, with policies named by ``@id``.
    """
    normalized = normalize_text(text)
    try:
        policy_set = cedarpy.PolicySet.from_str(normalized)
        est = json.loads(cedarpy.policies_to_json_str(normalized))
    except ValueError as exc:
        raise PolicyError(f"policy text does not parse: {exc}") from exc
    if est.get("templates"):
        raise PolicyError(
            "policy templates (?principal, ?resource) are not supported",
            hint="write the principal and resource out in each policy",
        )
    ids = _policy_ids(est.get("staticPolicies", {}))
    result = cedarpy.validate_policies(normalized, schema_handle())
    if not result.validation_passed:
        messages = [_rename(str(e.error), ids) for e in result.errors]
        raise PolicyError(
            "policy does not validate against the Proctor schema: " + "; ".join(messages),
            hint="see the schema in proctor/policy/schema.cedarschema",
        )
    return CompiledPolicies(normalized, policy_set, ids)


def _policy_ids(static: Mapping[str, Any]) -> dict[str, str]:
    ids: dict[str, str] = {}
    seen: dict[str, str] = {}

    # Cedar's positional ids sort as text policy0, policy1, policy10, policy2:
    # order by number, so "policy #N" in messages is the N-th in the text.
    def position(cedar_id: str) -> tuple[int, str]:
        number = cedar_id.removeprefix("policy")
        return (int(number) if number.isdigit() else -1, cedar_id)

    for cedar_id in sorted(static, key=position):
        body = static[cedar_id]
        annotation = body.get("annotations", {}).get("id")
        if not annotation:
            raise PolicyError(
                f"policy #{len(ids) + 1} has no @id annotation: {_excerpt(cedar_id, body)}",
                hint='start every policy with @id("a-stable-name")',
            )
        if annotation in seen:
            raise PolicyError(
                f"two policies share @id({json.dumps(annotation)})",
                hint="each @id names one policy, so that decisions name it unambiguously",
            )
        seen[annotation] = cedar_id
        ids[cedar_id] = annotation
    return ids


def _excerpt(cedar_id: str, body: Mapping[str, Any]) -> str:
    try:
        rendered = cedarpy.policies_from_json_str(
            json.dumps({"staticPolicies": {cedar_id: body}, "templates": {}, "templateLinks": []})
        )
    except ValueError:  # pragma: no cover - Cedar rendering its own output
        return cedar_id
    flat = " ".join(rendered.split())
    return flat if len(flat) <= 120 else flat[:117] + "..."


def _rename(message: str, ids: Mapping[str, str]) -> str:
    return _CEDAR_ID.sub(lambda m: f"`{ids.get(m.group(1), m.group(1))}`", message)


def decide(
    compiled: CompiledPolicies,
    request: Request,
    entities: EntitySet | Iterable[Entity] = (),
) -> Decision:
    """Decide ``request`` under ``compiled``. Never raises: every failure is a deny.

    Nothing is allowed unless a permit matches; a matching forbid wins; an
    evaluation error in any policy denies, even when a permit matched,
    because a policy that could not be evaluated might have been a forbid.
    """
    try:
        entity_set = entities if isinstance(entities, EntitySet) else EntitySet(entities)
        result = cedarpy.is_authorized(
            request.to_cedar(), compiled._policy_set, entity_set._handle, schema_handle()
        )
        allowed = result.decision is cedarpy.Decision.Allow
        raw_errors = [str(e) for e in result.diagnostics.errors]
        reasons = tuple(compiled._ids.get(r, r) for r in result.diagnostics.reasons)
        errors = tuple(compiled._translate(e) for e in raw_errors)
    except Exception as exc:  # fail closed on anything, including our own bugs
        return Decision(False, (), compiled.version, (f"{type(exc).__name__}: {exc}",))
    if errors:
        failing = tuple(
            dict.fromkeys(
                compiled._ids.get(m.group(1), m.group(1))
                for e in raw_errors
                for m in [_CEDAR_ID.search(e)]
                if m
            )
        )
        return Decision(False, failing, compiled.version, errors)
    if allowed:
        return Decision(True, reasons, compiled.version)
    # "Deny" (forbid or no permit) and "NoDecision" (request did not build) alike.
    return Decision(False, reasons, compiled.version)


def _request_from_json(payload: Mapping[str, Any]) -> tuple[Request, list[Entity]]:
    known = {"principal", "action", "resource", "context", "entities"}
    unknown = set(payload) - known
    if unknown:
        raise PolicyError(f"unknown fields in request: {', '.join(sorted(unknown))}")
    for name in ("principal", "action", "resource"):
        if name not in payload:
            raise PolicyError(f"request has no {name!r}")
    action = payload["action"]
    if isinstance(action, Mapping):
        action = action.get("id")
    if not isinstance(action, str):
        raise PolicyError("action must be a string such as 'sql.select'")
    context = payload.get("context", {})
    if not isinstance(context, Mapping):
        raise PolicyError("context must be an object")
    raw_entities = payload.get("entities", [])
    if not isinstance(raw_entities, list):
        raise PolicyError("entities must be a list")
    entities = [_entity_from_json(i, item) for i, item in enumerate(raw_entities)]
    request = Request(
        _ref_from_json(payload["principal"], "principal"),
        action,
        _ref_from_json(payload["resource"], "resource"),
        dict(context),
    )
    return request, entities


def _ref_from_json(value: Any, what: str) -> EntityRef:
    if not isinstance(value, Mapping) or set(value) != {"type", "id"}:
        raise PolicyError(f"{what} must be an object {{'type': ..., 'id': ...}}")
    return EntityRef(str(value["type"]), value["id"])


def _entity_from_json(i: int, item: Any) -> Entity:
    if not isinstance(item, Mapping) or "uid" not in item:
        raise PolicyError(f"entities[{i}] must be an object with a 'uid'")
    attrs = item.get("attrs", {})
    parents = item.get("parents", [])
    if not isinstance(attrs, Mapping) or not isinstance(parents, list):
        raise PolicyError(f"entities[{i}]: 'attrs' must be an object, 'parents' a list")
    return Entity(
        _ref_from_json(item["uid"], f"entities[{i}].uid"),
        dict(attrs),
        tuple(_ref_from_json(p, f"entities[{i}].parents") for p in parents),
    )


def evaluate_request(compiled: CompiledPolicies, payload: str | Mapping[str, Any]) -> Decision:
    """What ``proctor policy test`` runs: a JSON request in, the decision out.

    ``payload`` (a JSON text or the parsed object) has ``principal``,
    ``resource`` (``{"type": "Table", "id": "acme/crm/customers"}``; types
    short or ``Proctor::``-qualified), ``action`` (``"sql.select"``),
    optional ``context`` (Cedar JSON, checked against the schema) and
    optional ``entities`` (``[{"uid": ..., "attrs": {...}, "parents": [...]}]``).
    A malformed payload raises :class:`PolicyError`; a well-formed one is
    decided exactly as the broker would decide it.
    """
    if isinstance(payload, str):
        try:
            payload = json.loads(payload)
        except json.JSONDecodeError as exc:
            raise PolicyError(f"request is not valid JSON: {exc}") from exc
    if not isinstance(payload, Mapping):
        raise PolicyError("request must be a JSON object")
    request, entities = _request_from_json(payload)
    # Built here rather than inside decide() so that entities that do not fit
    # the schema are reported to the person testing, not just denied.
    return decide(compiled, request, EntitySet(entities))
