from __future__ import annotations

import json
import logging
import re
from collections.abc import Mapping, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any, Literal

from proctor.errors import LedgerError, UsageError
from proctor.ledger._objects import LedgerObject

EVENT_VERSION = 1
#: The largest event the ledger appends, in canonical bytes. A C2SP tlog-tiles
#: entry bundle prefixes each entry with a uint16 length (at most 65,535 bytes);
#: this leaves room to spare, so every entry of every log is servable. Per-row
#: data goes to lineage objects, free text is cut (``clip``): an event over the
#: bound is a bug, and the ledger refuses it (docs/ledger.md).
MAX_EVENT_BYTES = 16 * 1024
#: The marker a cut text ends with.
CUT_MARKER = "…[cut]"
Decision = Literal["allow", "deny"]

_ACTOR_TYPES = frozenset({"operator", "user", "service", "agent", "workload", "runtime"})
_ACTION_RE = re.compile(r"^[a-z][a-z0-9_]*(\.[a-z][a-z0-9_]*)+$")


def utc_now() -> str:
    """RFC 3339 UTC with microseconds; fixed width, so strings sort by time."""
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


@dataclass(frozen=True)
class Actor:
    """Who acted: a person, a service account, an AI agent, a run's workload, or the runtime."""

    type: str
    id: str

    def __post_init__(self) -> None:
        if self.type not in _ACTOR_TYPES:
            raise UsageError(f"unknown actor type {self.type!r}")
        if not self.id:
            raise UsageError("an actor needs an id")

    def as_json(self) -> dict[str, str]:
        return {"type": self.type, "id": self.id}


#: Details every event a principal (a person, a service, an agent) records in this
#: context carries beside its own: the API sets what the request says of itself that
#: the record should keep (the MCP client an agent works through, X-Proctor-Client),
#: and each event its handler records, in its thread or a run's it starts, has it.
#: An event's own details win.
REQUEST_DETAILS: ContextVar[Mapping[str, Any] | None] = ContextVar(
    "proctor_request_details", default=None
)
_PRINCIPAL_ACTORS = frozenset({"user", "service", "agent"})


def with_request_details(draft: EventDraft) -> EventDraft:
    """``draft`` with this context's :data:`REQUEST_DETAILS` (a principal's only)."""
    extra = REQUEST_DETAILS.get()
    if not extra or draft.actor.type not in _PRINCIPAL_ACTORS:
        return draft
    missing = {k: v for k, v in extra.items() if k not in draft.details}
    return replace(draft, details={**draft.details, **missing}) if missing else draft


@dataclass(frozen=True)
class EventDraft:
    """An event before the ledger gives it its place (``seq``) and ``time``."""

    actor: Actor
    action: str
    resource: str
    decision: Decision = "allow"
    policies: tuple[str, ...] = ()
    reason: str = ""
    deployment: str | None = None
    run: str | None = None
    artifact: str | None = None
    approvals: tuple[str, ...] = ()
    details: dict[str, Any] = field(default_factory=dict)
    # Stored with the event, in its transaction; ``details`` carries their references.
    objects: tuple[LedgerObject, ...] = ()

    def __post_init__(self) -> None:
        # Checked here, in the caller's thread, so that the ledger's writer can
        # trust every field but ``details`` when it canonicalises the event.
        for name in ("action", "resource", "reason"):
            if not isinstance(getattr(self, name), str):
                raise UsageError(f"event field {name!r} must be a string")
        for name in ("deployment", "run", "artifact"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise UsageError(f"event field {name!r} must be a string or None")
        for name in ("policies", "approvals"):
            value = getattr(self, name)
            if not isinstance(value, tuple) or not all(isinstance(v, str) for v in value):
                raise UsageError(f"event field {name!r} must be a tuple of strings")
        if not isinstance(self.details, dict):
            raise UsageError("event details must be a JSON object")
        if not isinstance(self.objects, tuple) or not all(
            isinstance(o, LedgerObject) for o in self.objects
        ):
            raise UsageError("event objects must be a tuple of LedgerObject")
        if not isinstance(self.actor, Actor):
            raise UsageError("an event needs an Actor")
        if not _ACTION_RE.match(self.action):
            raise UsageError(f"invalid action name {self.action!r} (expected e.g. 'sql.select')")
        if self.decision not in ("allow", "deny"):
            raise UsageError(f"decision must be 'allow' or 'deny', not {self.decision!r}")

    def to_event(self, seq: int, time: str, tenant: str) -> dict[str, Any]:
        return {
            "v": EVENT_VERSION,
            "seq": seq,
            "time": time,
            "tenant": tenant,
            "actor": self.actor.as_json(),
            "action": self.action,
            "resource": self.resource,
            "decision": self.decision,
            "policies": list(self.policies),
            "reason": self.reason,
            "deployment": self.deployment,
            "run": self.run,
            "artifact": self.artifact,
            "approvals": list(self.approvals),
            "details": self.details,
        }


def clip(text: str, limit: int) -> str:
    """``text`` cut to at most ``limit`` characters, ending with ``CUT_MARKER`` when
    it was cut: free text in an event (a message, a path) has a fixed budget."""
    if len(text) <= limit:
        return text
    return text[: max(0, limit - len(CUT_MARKER))] + CUT_MARKER


_log = logging.getLogger("proctor.ledger")


def bounded_event(data: bytes) -> bytes:
    """``data`` if it is within ``MAX_EVENT_BYTES``; otherwise the append fails.

    Every event the code makes is built to fit (per-row data in objects, free text
    clipped), so one that does not is a bug: it is logged as an error and the call
    it records is refused, as any call that cannot be recorded."""
    if len(data) <= MAX_EVENT_BYTES:
        return data
    head = data[:200].decode("utf-8", "replace")
    _log.error("event of %d bytes over the %d-byte bound: %s...", len(data), MAX_EVENT_BYTES, head)
    raise LedgerError(
        f"an event of {len(data)} bytes is over the ledger's bound of {MAX_EVENT_BYTES}"
        " bytes (a bug in whatever built it); it was not recorded"
    )


#: Fixed budgets of ``bound_details``: the longest string, the longest list, and
#: all the details together (in canonical bytes, leaving the rest of the event's
#: bound to its fixed fields, a clipped reason and resource).
MAX_DETAIL_TEXT = 1024
MAX_DETAIL_ITEMS = 64
MAX_DETAILS_BYTES = 12 * 1024


def bound_details(details: Mapping[str, Any]) -> dict[str, Any]:
    """``details`` with every string cut to ``MAX_DETAIL_TEXT`` characters (``clip``),
    every list to ``MAX_DETAIL_ITEMS`` items, and the whole to about
    ``MAX_DETAILS_BYTES``: what comes after the budget is spent is cut. A list cut
    in an object gets a sibling ``<key>_cut`` counting what was left out, one in a
    list ends with ``CUT_MARKER``. For details built from what a guest or an
    upstream sends (a path, an error message, the addresses a name resolves to):
    their size then no longer follows the input. Details within the budgets are
    returned unchanged."""
    if _within(details, 0) and _json_bytes(details) <= MAX_DETAILS_BYTES:
        return dict(details)  # the common case, at the cost of one encoding
    return _Budget(MAX_DETAILS_BYTES).object(details, 0)


def _within(value: Any, depth: int) -> bool:
    """Whether no string, list or nesting in ``value`` is past its budget."""
    if isinstance(value, str):
        return len(value) <= MAX_DETAIL_TEXT
    if isinstance(value, Mapping):
        return depth <= 8 and all(
            len(str(k)) <= 128 and _within(v, depth + 1) for k, v in value.items()
        )
    if isinstance(value, list | tuple):
        return len(value) <= MAX_DETAIL_ITEMS and all(_within(v, depth + 1) for v in value)
    return True


def _json_bytes(value: Any) -> int:
    # An estimate only: a value JSON cannot hold is left for canonicalisation to refuse.
    return len(json.dumps(value, ensure_ascii=False, default=repr).encode())


class _Budget:
    def __init__(self, left: int) -> None:
        self.left = left

    def text(self, value: str) -> str:
        value = clip(value, MAX_DETAIL_TEXT)
        cost = _json_bytes(value) + 1
        while cost > self.left and len(value) > len(CUT_MARKER):
            value = clip(value, max(len(CUT_MARKER), len(value) // 2))
            cost = _json_bytes(value) + 1
        self.left -= cost
        return value

    def value(self, value: Any, depth: int) -> Any:
        if isinstance(value, str):
            return self.text(value)
        if isinstance(value, Mapping):
            return self.object(value, depth + 1)
        if isinstance(value, list | tuple):
            items, cut = self.items(value, depth)
            return [*items, CUT_MARKER] if cut else items
        self.left -= _json_bytes(value) + 1
        return value

    def items(self, values: Sequence[Any], depth: int) -> tuple[list[Any], int]:
        out: list[Any] = []
        for v in values[:MAX_DETAIL_ITEMS]:
            if self.left <= 0:
                break
            out.append(self.value(v, depth + 1))
        return out, len(values) - len(out)

    def object(self, obj: Mapping[str, Any], depth: int) -> dict[str, Any]:
        if depth > 8:
            raise UsageError("event details nest deeper than 8 levels")
        out: dict[str, Any] = {}
        for key, value in obj.items():
            name = clip(str(key), 128)
            if name in out:
                continue  # a count set with its list, below
            self.left -= len(name) + 4
            if isinstance(value, list | tuple):
                items, cut = self.items(value, depth)
                out[name] = items
                if cut:
                    # A list its maker already cut keeps counting from there.
                    prior = obj.get(f"{name}_cut")
                    more = prior if isinstance(prior, int) and not isinstance(prior, bool) else 0
                    out[f"{name}_cut"] = cut + more
            else:
                out[name] = self.value(value, depth)
        return out
