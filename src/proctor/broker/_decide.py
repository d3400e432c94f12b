"""The decide stage: one decision for one call, however many Cedar questions it asks.

A call may ask Cedar more than one question: an HTTPS request to a host whose
secret the broker injects asks ``http.request`` on the host and ``secret.use``
on each secret it carries. They are one call, so they make one decision and one
event: allowed only if every question is, naming every permit that allowed it;
denied by the first question that was denied, naming the policies that denied
(:func:`combine`). The verifier re-decides such an event by the same rule
(``evidence._policies``), so the rule is written down in docs/egress.md and
must change there and in both places together.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from proctor.policy import Decision, Entity, EntityRef

if TYPE_CHECKING:
    from proctor.broker._scope import RunScope


@dataclass(frozen=True)
class Question:
    """One Cedar question of a call. ``label`` names it in a refusal's reason when
    it is not the call's first question (``secret.use of secret/gh``)."""

    action: str
    resource: EntityRef
    context: Mapping[str, Any]
    entities: tuple[Entity, ...] = ()
    label: str = ""


@dataclass(frozen=True)
class Verdict:
    """The call's one decision, and the reason its event and a refusal give."""

    decision: Decision
    reason: str
    #: The decision of each question, in order (for a caller that must say which).
    parts: tuple[Decision, ...] = field(default=(), repr=False)

    @property
    def allowed(self) -> bool:
        return self.decision.allowed


def combine(version: str, parts: Sequence[Decision]) -> Decision:
    """One decision from the decisions of one call's questions.

    Allowed when every part is, by every permit that allowed a part; otherwise
    denied by the policies (and errors) of the parts that were denied.
    """
    if len(parts) == 1:
        return parts[0]
    if all(p.allowed for p in parts):
        policies = tuple(dict.fromkeys(p for d in parts for p in d.policies))
        return Decision(True, policies, version)
    denied = [d for d in parts if not d.allowed]
    policies = tuple(dict.fromkeys(p for d in denied for p in d.policies))
    errors = tuple(e for d in denied for e in d.errors)
    return Decision(False, policies, version, errors)


def decide(scope: RunScope, questions: Sequence[Question]) -> Verdict:
    """Ask each of the call's questions with the run's workload as principal; never
    raises (an evaluation error denies)."""
    parts = tuple(scope.decide(q.action, q.resource, q.context, q.entities) for q in questions)
    decision = combine(scope.policies.version, parts)
    reason = decision.reason
    for question, part in zip(questions, parts, strict=True):
        if not part.allowed:
            reason = f"{question.label} {part.reason}" if question.label else part.reason
            break
    return Verdict(decision, reason, parts)
