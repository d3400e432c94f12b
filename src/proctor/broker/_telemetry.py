"""What a call tells the operator once it ends: its metrics and, where tracing is on,
its span.

One function, :func:`finished`, called wherever the pipeline ends a call (the run's
socket, the proxy's own entry points, transparent egress, a call the broker makes
itself). It reads what the call kept as it went (:class:`._calls.Call`: its stages
and when each began, its decision and its event's seq), so the stages themselves
carry no more than a clock read each.

- ``proctor_calls_total{kind, decision, tenant}``: ``kind`` the registered kind's
  name, ``unknown`` for a call refused before its kind was found (over the run's
  rate, bound or quota, a bad token, a malformed head, no such endpoint);
  ``decision`` the call's decision event's (``allow``/``deny``), ``deny`` for a call
  refused without one (over a limit, not recorded). A connection that asked
  nothing, or left before its call was decided, is no call.
- ``proctor_call_duration_seconds{kind}``: from the call's first byte to its end.
- ``proctor_decision_duration_seconds{kind}``: its decide stage.
- The span ``proctor.call {kind}`` (docs/operations.md), made after the fact with
  the recorded times, a child ``proctor.stage {stage}`` per stage, under the run's
  span where the run bound one (:func:`proctor.telemetry.bind_run`). Its
  attributes are the kind, the decision, the run, and the ledger log and seq of the
  call's decision event, so that a trace leads to its inclusion proof. Nothing of
  the guest's request (target, headers, body) is put in a label or an attribute.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from proctor import telemetry
from proctor.broker._calls import DECIDE, Call
from proctor.broker._scope import REQUEST_EVENTS

log = logging.getLogger("proctor.broker")

#: The kind of a call refused before its kind was found.
UNKNOWN = "unknown"

# The labelled children, per set of metrics (the no-op set, then the real one) and
# (kind, decision, tenant): ``labels()`` takes a lock and checks its values; a call's
# end should cost a dict lookup. The sets are kept, so their ids stay theirs.
_children: dict[int, dict[tuple[str, str, str], tuple[Any, Any, Any]]] = {}
_sets: list[telemetry.Metrics] = []


def _labelled(kind: str, decision: str, tenant: str) -> tuple[Any, Any, Any]:
    m = telemetry.metrics()
    of_set = _children.get(id(m))
    if of_set is None:
        _sets.append(m)
        of_set = _children[id(m)] = {}
    key = (kind, decision, tenant)
    found = of_set.get(key)
    if found is None:
        found = of_set[key] = (
            m.calls.labels(kind, decision, tenant),
            m.call_seconds.labels(kind),
            m.decision_seconds.labels(kind),
        )
    return found


def finished(call: Call, refused: bool = False) -> None:
    """Count ``call`` (``refused``: it was answered with an error, or closed unanswered)
    and make its span; a call that was never decided nor refused is not counted."""
    try:
        _finished(call, refused)
    except Exception:  # what the operator is told must never fail a call
        log.exception("broker: the metrics of a call of run %s failed", call.scope.run_id)


def _finished(call: Call, refused: bool) -> None:
    if call.handed_on:
        return
    end = time.perf_counter_ns()
    if call.decision is not None:
        decision = call.decision
    elif refused:
        decision = "deny"
    elif call.ruled is not None:
        decision = "allow" if call.ruled else "deny"
    else:
        return
    kind = call.kind.name if call.kind is not None else UNKNOWN
    calls, call_seconds, decision_seconds = _labelled(
        kind, decision, telemetry.tenant(call.scope.tenant)
    )
    calls.inc()
    call_seconds.observe((end - call.began) / 1e9)
    marks = call.marks
    if DECIDE in call.trace:
        i = call.trace.index(DECIDE)
        decide_end = marks[i + 1] if i + 1 < len(marks) else end
        decision_seconds.observe((decide_end - marks[i]) / 1e9)
    if telemetry.tracing_enabled():
        _span(call, kind, decision, end)


def _seq(call: Call) -> int | None:
    if call.seq is not None:
        return call.seq
    # A refusal recorded once for many calls (the run's bound, the tenant's quota),
    # in a context of its own: the answer named it.
    counter = REQUEST_EVENTS.get()
    if counter is not None and counter.refusal is not None:
        return counter.refusal[0]
    return None


def _span(call: Call, kind: str, decision: str, end: int) -> None:
    from opentelemetry import trace

    scope = call.scope
    offset = call.began_wall - call.began  # perf_counter_ns -> ns since the epoch
    attributes: dict[str, Any] = {
        "proctor.call.kind": kind,
        "proctor.decision": decision,
        "proctor.run": scope.run_id,
        "proctor.ledger.log": scope.tenant,
    }
    seq = _seq(call)
    if seq is not None:
        attributes["proctor.ledger.seq"] = seq
    tracer = telemetry.tracer()
    span = tracer.start_span(
        f"proctor.call {kind}",
        context=telemetry.run_context(scope.run_id),
        kind=trace.SpanKind.INTERNAL,
        attributes=attributes,
        start_time=call.began_wall,
    )
    inside = trace.set_span_in_context(span)
    marks = call.marks
    for i, stage in enumerate(call.trace):
        stop = marks[i + 1] if i + 1 < len(marks) else end
        child = tracer.start_span(
            f"proctor.stage {stage}", context=inside, start_time=marks[i] + offset
        )
        child.end(end_time=stop + offset)
    span.end(end_time=end + offset)
