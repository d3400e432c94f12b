"""One call, one path: every call out of a sandbox, top to bottom.

::

    admit   (_admit.py)   budget charged, token checked, the kind found
    parse   (the kind)    its request read from the head (and body)
    decide  (the kind, through _decide.py)  its Cedar questions: one decision, one ruling
    ask     (_ask.py)     a call of a capability marked ask waits for a person's answer
    act     (_act.py)     carried out: held until recorded, or after it
    record  (_record.py)  the one decision event, durable before any answer
    answer  (_answer.py)  the result sent; a refusal answered naming its event

A kind whose act cannot be held back (``records_first``: a connection dialed)
is recorded before it acts, and what it learns acting is a completion record
(``_record.complete``) written before any answer it still owes. Each call's
stages are kept, in order, in :attr:`Call.trace`, and when each began; once a
call ends, :func:`._telemetry.finished` counts it and makes its span.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
import time
from typing import Any

from proctor.broker import _connectors, _files, _proxy, _transparent, _whoami  # noqa: F401 - registers the kinds
from proctor.broker._act import act, settle
from proctor.broker._admit import Gate, admit
from proctor.broker._answer import answer, refuse, send_error
from proctor.broker._ask import gone_while_waiting, wait_for_answer
from proctor.broker._calls import ASK, CURRENT, DECIDE, PARSE, Acted, Call, CallKind
from proctor.broker._record import record
from proctor.broker._scope import REQUEST_EVENTS, BrokerError, RequestEvents, RunScope
from proctor.broker._telemetry import finished

log = logging.getLogger("proctor.broker")


async def serve(call: Call, gate: Gate, first_byte: float) -> None:
    """Serve one call on its connection; every answer has its event first."""
    # Counts what the stages record for this request (this task's context only).
    REQUEST_EVENTS.set(RequestEvents())
    CURRENT.set(call)
    refused = False
    try:
        await _stages(call, gate, first_byte)
    except BrokerError as exc:
        refused = True
        await refuse(call, exc)
    except (ConnectionError, asyncio.IncompleteReadError):
        return
    except asyncio.CancelledError:
        raise
    except Exception:  # a bug must not kill the broker, nor reach the guest
        refused = True
        log.exception("broker: unexpected failure in run %s", call.scope.run_id)
        await refuse(call, BrokerError("internal broker error"), status=500, always=True)
    finally:
        finished(call, refused)


async def _stages(call: Call, gate: Gate, first_byte: float) -> None:
    kind = await admit(call, gate, first_byte)
    if kind is None:
        return
    await _parsed_and_served(call, kind)


async def _parsed_and_served(call: Call, kind: CallKind) -> None:
    """From parse to answer, whoever admitted the call."""
    began = time.perf_counter_ns()
    request = await kind.parse(call)
    call.passed(PARSE, began)
    try:
        await answer(call, await _decided(call, kind, request))
    finally:
        await kind.done(call, request)


async def _decided(call: Call, kind: CallKind, request: Any) -> Acted:
    """Decide, act and record, in the kind's order; what is to be answered."""
    # The kind's questions, asked through _decide: one ruling for the call.
    began = time.perf_counter_ns()
    ruling = await kind.decide(call, request)
    if ruling is not None:
        call.passed(DECIDE, began)
        call.ruled = ruling.refusal is None and ruling.decision.allowed
    gate = call.scope.asks
    asked = None
    if gate is not None and ruling is not None and ruling.refusal is None and call.ruled:
        asked = gate.rules.covers(ruling, request)
        if asked is not None and asked.before:
            began = time.perf_counter_ns()
            await wait_for_answer(call.scope, gate, ruling, asked)  # nothing done yet
            gone_while_waiting(call.scope, ruling, call.reader)
            call.passed(ASK, began)
    if ruling is not None and (kind.records_first or ruling.refusal is not None):
        await record(call, ruling)  # a refusal is raised here, once on record
    acted = await act(call, kind, request, ruling)
    if gate is not None and asked is not None and not asked.before and acted.refusal is None:
        assert ruling is not None
        # Asked once staged and held (a bucket write): the ask names what it would write.
        asked.arguments.update({k: acted.details[k] for k in ("sha256", "bytes")
                                if k in acted.details})  # fmt: skip
        began = time.perf_counter_ns()
        try:
            await wait_for_answer(call.scope, gate, ruling, asked)
            gone_while_waiting(call.scope, ruling, call.reader)
            call.passed(ASK, began)
            if ruling.refusal is not None:
                await record(call, ruling)  # raises the refusal once on record
        except BaseException:
            await settle(acted, recorded=False)
            raise
    if ruling is not None and ruling.seq is None:
        try:
            await record(call, ruling, acted)
        except BaseException:
            await settle(acted, recorded=False)
            raise
        await settle(acted, recorded=True)
    return acted


async def perform(scope: RunScope, kind: CallKind, request: Any) -> Any:
    """The call ``request`` of ``kind`` made for ``scope``'s run from the broker's own
    code (not read from a socket): decided, acted and recorded as a guest's; its answer."""
    call = Call(scope, kind=kind)
    token = CURRENT.set(call)
    refused = True
    try:
        acted = await _decided(call, kind, request)
        refused = isinstance(acted.answer, BrokerError)
    finally:
        CURRENT.reset(token)
        await kind.done(call, request)
        finished(call, refused)
    if isinstance(acted.answer, BrokerError):
        raise acted.answer  # recorded with the call's event
    return acted.answer


async def serve_kind(call: Call, kind: CallKind) -> None:
    """Serve a call whose head was read, admitted and matched elsewhere (the egress
    proxy's own entry points): parse, decide, act, record, answer."""
    outer = CURRENT.get()
    if outer is not None and outer is not call:
        outer.handed_on = True  # this call is the one counted
    token = CURRENT.set(call)
    call.kind = kind
    refused = False
    try:
        await _parsed_and_served(call, kind)
    except BrokerError as exc:
        refused = True
        # Every refusal of an egress kind is recorded where it is found (or is
        # not_recorded): answered as it is, by whoever's server this is.
        await send_error(call, exc)
    finally:
        CURRENT.reset(token)
        finished(call, refused)
        # A kept-alive connection carries the next request: its owner closes it.
        if call.writer is not None and not call.writer.is_closing() and not call.keep_alive:
            call.writer.close()
            with contextlib.suppress(ConnectionError, OSError, ssl.SSLError):
                await call.writer.wait_closed()
