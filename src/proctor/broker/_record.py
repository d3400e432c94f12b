"""The record stage: a call's event made durable before anything is answered.

:func:`record` appends a call's one decision event (:class:`._calls.Ruling`,
with what its act found) through :meth:`RunScope.record`: Cedar's decision,
the run's standing re-read in the append's transaction, and
:class:`CallRefused` (503 ``not_recorded``) if the ledger cannot take it. A
ruling that refuses is raised once its event is durable.

Two more records belong to this stage: a refusal of a call before or instead
of its decision (:func:`refuse`: a malformed request, an object missing, a
broker rule; an act's refusal, an object missing, comes here through
:func:`record`; :func:`refuse_request`, the server's safety net for a refusal
nothing recorded yet), and the completion record of a call whose act outlives
its decision (:func:`complete`: an egress connection's bytes, duration, how
it ended, the trust anchor that verified the upstream where the broker ended
TLS, and the bodies' digests where a request rule asks for them), written before
any answer still owed.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from proctor.broker._admission import Admitted, Outcome
from proctor.broker._admit import SHOWN_METHOD, shown
from proctor.broker._calls import Acted, Call, Ruling
from proctor.broker._egress import UpstreamFailed
from proctor.broker._scope import REQUEST_EVENTS, BrokerError, CallRefused, RunScope
from proctor.ledger import Action

_SHOWN_REASON = 160


async def record(call: Call, ruling: Ruling, acted: Acted | None = None) -> None:
    """Append the call's decision event (with ``acted.details``); raise the ruling's
    refusal once it is durable, or the act's (``acted.refusal``: recorded as the
    call's refusal, with the ruling's details)."""
    if acted is not None and acted.refusal is not None:
        raise await refuse(call.scope, ruling.action, ruling.resource, acted.refusal,
                           ruling.details, why=acted.why)  # fmt: skip
    details = ruling.details if acted is None else {**ruling.details, **acted.details}
    appended = await call.scope.record(
        ruling.action, ruling.resource, ruling.decision, reason=ruling.reason, details=details,
        objects=acted.objects if acted is not None else (),
    )  # fmt: skip
    ruling.seq = appended.seq
    if ruling.refusal is not None:
        raise ruling.refusal


async def refuse(
    scope: RunScope,
    action: str,
    resource: str,
    exc: BrokerError,
    details: Mapping[str, Any],
    *,
    why: str | None = None,
    rule: str | None = None,
) -> BrokerError:
    """Record ``exc`` as the refusal of the call (``why`` its reason, ``rule`` the
    broker's rule named); the error to raise (``not_recorded`` if it could not be)."""
    policies = (rule,) if rule is not None else exc.policies
    try:
        await scope.record_refusal(
            action, resource, why or exc.message, policies=policies, details=dict(details)
        )
    except CallRefused as refused:
        return refused
    return exc


async def refuse_request(call: Call, exc: BrokerError, status: int | None) -> BrokerError:
    """The safety net: a refusal no stage recorded is recorded as ``broker.request``;
    the error to answer (``not_recorded`` if it cannot be)."""
    scope, head = call.scope, call.head
    code = status or exc.status
    details: dict[str, Any] = {"status": code, "error": exc.code}
    if head is not None:
        details["method"] = shown(head.method, SHOWN_METHOD)
        # The target is the guest's text (it could hold a value it read):
        # kept as a keyed hash, like a statement.
        details["target_hmac"] = scope.key_hmacs([head.target])[0]
    reason = exc.message
    if code == 404:
        reason = "no such broker endpoint"  # the path is in target_hmac
    try:
        await scope.record_refusal(
            Action.BROKER_REQUEST,
            f"run/{scope.run_id}",
            shown(reason, _SHOWN_REASON),
            policies=exc.policies,
            details=details,
        )
    except CallRefused as refused:
        return refused
    return exc


def recorded_any() -> bool:
    """Whether a stage recorded an event for the request being served."""
    counter = REQUEST_EVENTS.get()
    return counter is not None and counter.count > 0


async def complete(scope: RunScope, admitted: Admitted, outcome: Outcome) -> BrokerError | None:
    """Write the completion record, once; the answer still owed to the guest, if any
    (``not_recorded`` in its place if the record could not be written)."""
    if outcome.completed:
        return None
    outcome.completed = True
    answer, outcome.answer = outcome.answer, None
    if answer is not None:
        outcome.error = outcome.error or answer.message
        outcome.answered = answer.status
    recorded = await _completion(scope, admitted, outcome, owed=answer is not None)
    if answer is not None and recorded is None and not isinstance(answer, CallRefused):
        return CallRefused("the call was refused because the ledger cannot record it")
    if isinstance(answer, UpstreamFailed) and isinstance(recorded, int):
        answer.seq = recorded  # the guest's answer names the event that says why
    return answer


async def _completion(
    scope: RunScope, admitted: Admitted, outcome: Outcome, *, owed: bool = False
) -> int | bool | None:
    """The completion event. The call already happened, so a failure here is logged
    and the run's next call refused; the caller answers ``not_recorded`` instead of
    an error it still ``owed``. With nothing owed, nobody waits on the event: it is
    queued to commit with the next one anything waits on (one fsync a call).
    The event's seq where it was waited on, True where queued, None if lost."""
    details: dict[str, Any] = {
        "decision_seq": admitted.seq,
        "host": admitted.host.name,
        "port": admitted.port,
        "address": str(admitted.address),
        "bytes_up": outcome.bytes_up,
        "bytes_down": outcome.bytes_down,
        "duration_ms": round((time.monotonic() - admitted.started) * 1000, 3),
        "requests": outcome.requests,
    }
    if outcome.status is not None:
        details["status"] = outcome.status
    if outcome.injected:
        details["secrets"] = list(outcome.injected)
    if outcome.trust is not None:
        details["trust"] = outcome.trust
    if outcome.bodies is not None:
        outcome.bodies.finish(outcome.status)  # a plain-HTTP request's one exchange
        details.update(outcome.bodies.to_json())
    if outcome.error is not None:
        details["error"] = outcome.error
    if outcome.answered is not None:
        details["answered"] = outcome.answered
    reason = "closed" if outcome.error is None else "failed"
    lost = (
        f"the completion record of {admitted.resource} (event {admitted.seq}) could not be written"
    )
    if not owed:
        scope.record_later(Action.HTTP_REQUEST_END, admitted.resource, admitted.decision,
                           reason=reason, details=details, lost=lost)  # fmt: skip
        return True
    try:
        appended = await scope.record(
            Action.HTTP_REQUEST_END, admitted.resource, admitted.decision,
            reason=reason, details=details,
        )  # fmt: skip
    except CallRefused as exc:
        scope.lose_completion(lost, exc)
        return None
    return appended.seq
