"""The Cedar schema shipped with the package, parsed once on first use."""

from __future__ import annotations

import functools
import re
from importlib import resources

import cedarpy

from proctor.errors import PolicyError

#: The Cedar namespace of every Proctor entity type and action.
NAMESPACE = "Proctor"

ENTITY_TYPES: frozenset[str] = frozenset(
    {
        "Tenant",
        "Role",
        "User",
        "ServiceAccount",
        "Agent",
        "Artifact",
        "Deployment",
        "Workload",
        "Dataset",
        "Table",
        "Host",
        "Secret",
        "Bucket",
    }
)

DATA_PLANE_ACTIONS: frozenset[str] = frozenset(
    {"http.request", "sql.select", "sql.write", "secret.use", "file.read", "file.write"}
)

CONTROL_PLANE_ACTIONS: frozenset[str] = frozenset(
    {
        "tenant.create",
        "tenant.read",
        "tenant.freeze",
        "tenant.unfreeze",
        "principal.create",
        "token.issue",
        "artifact.submit",
        "artifact.read",
        "approval.grant",
        "approval.reject",
        "approval.revoke",
        "deployment.create",
        "deployment.read",
        "deployment.rollback",
        "run.start",
        "run.read",
        "run.stop",
        "run.events.read",
        "run.output.read",
        "policy.set",
        "policy.read",
        "audit.read",
        "evidence.export",
        "subprocessor.manage",
        "retention.read",
        "retention.manage",
        "erasure.request",
        "dataset.register",
        "dataset.describe",
        "approval.request",
        "secret.register",
        "bucket.read",
        "bucket.write",
        "call.answer",
    }
)

ACTIONS: frozenset[str] = DATA_PLANE_ACTIONS | CONTROL_PLANE_ACTIONS

_PREFIX = NAMESPACE + "::"


def schema_text() -> str:
    """The Cedar schema, in Cedar's human-readable schema syntax."""
    return (
        resources.files("proctor.policy").joinpath("schema.cedarschema").read_text(encoding="utf-8")
    )


@functools.cache
def schema_handle() -> cedarpy.Schema:
    # Parsed lazily rather than at import so that importing proctor.policy has
    # no side effects and a broken install fails at the first decision, loudly.
    try:
        return cedarpy.Schema.from_str(schema_text())
    except ValueError as exc:  # pragma: no cover - the shipped schema parses
        raise PolicyError(f"the packaged Cedar schema does not parse: {exc}") from exc


def qualify_type(type_name: str) -> str:
    """``Table`` or ``Proctor::Table`` -> ``Proctor::Table``; unknown types refused."""
    short = type_name.removeprefix(_PREFIX)
    if short not in ENTITY_TYPES:
        raise PolicyError(
            f"unknown entity type {type_name!r}",
            hint="one of: " + ", ".join(sorted(ENTITY_TYPES)),
        )
    return _PREFIX + short


def short_type(type_name: str) -> str:
    return qualify_type(type_name).removeprefix(_PREFIX)


_ACTION_UID = re.compile(r'Proctor::Action::"([^"\\]*)"')


def qualify_action(action: str) -> str:
    """``sql.select`` or ``Proctor::Action::"sql.select"`` -> ``sql.select``."""
    match = _ACTION_UID.fullmatch(action)
    short = match.group(1) if match else action
    if short not in ACTIONS:
        raise PolicyError(
            f"unknown action {action!r}",
            hint="one of: " + ", ".join(sorted(ACTIONS)),
        )
    return short


_ESCAPES = {"\\": "\\\\", '"': '\\"', "\n": "\\n", "\r": "\\r", "\t": "\\t", "\0": "\\0"}
_NEEDS_ESCAPE = re.compile(r'[\\"\x00-\x1f\x7f]')


def cedar_string(value: str) -> str:
    """A Cedar string literal for ``value``, escaped so no input can end it early."""

    def escape(match: re.Match[str]) -> str:
        ch = match.group(0)
        return _ESCAPES.get(ch, f"\\u{{{ord(ch):x}}}")

    return '"' + _NEEDS_ESCAPE.sub(escape, value) + '"'


def action_literal(action: str) -> str:
    return f"{_PREFIX}Action::{cedar_string(qualify_action(action))}"
