"""The answer stage: what the guest is sent, once what it answers is on record.

A call's answer (:func:`answer`: a JSON document, or an object's bytes) is
sent only after its event is durable; a kind whose act answers as it goes (a
tunnel, a relayed response) has sent it already, and one whose act ended the
guest's TLS (a secret injected) is answered inside it, after its completion
record, what is still owed (a refusal) and TLS's close. A refusal (:func:`refuse`)
is answered with its error, naming its event (``seq`` and ``reason``); one no
stage recorded is recorded first (``_record.refuse_request``), and if it
cannot be, the answer is 503 ``not_recorded`` whatever it would have been.
Past the run's bound or the tenant's quota the answer waits for that one
refusal's event; over the rate it is answered at once and only counted.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import time
from typing import TYPE_CHECKING

from proctor.broker._admit import Unauthenticated
from proctor.broker._calls import ANSWER, Acted, Call
from proctor.broker._http import error_bytes, respond, respond_json
from proctor.broker._record import recorded_any, refuse_request
from proctor.broker._scope import REQUEST_EVENTS, BrokerError, Exhausted, RateLimited

if TYPE_CHECKING:
    from proctor.broker._mitm import TlsStream


async def answer(call: Call, acted: Acted) -> None:
    """Send the call's answer (its event is durable)."""
    began = time.perf_counter_ns()
    if acted.inside is not None:
        await _answer_inside(call, acted.inside, acted.answer, began)
        return
    writer = call.writer
    assert writer is not None
    if isinstance(acted.answer, BrokerError):
        # Owed by an act that answered as it went (a 502 from dialing): its
        # completion record is durable.
        await send_error(call, acted.answer)
        return
    if isinstance(acted.answer, bytes):
        await respond(writer, 200, acted.answer, "application/octet-stream")
    elif acted.answer is not None:
        await respond_json(writer, 200, acted.answer)
    call.passed(ANSWER, began)


async def _answer_inside(call: Call, stream: TlsStream, owed: object, began: int) -> None:
    """The answer of a call its act moved inside TLS (a secret injected): an error
    still owed sent there, after the completion record; then TLS closed."""
    if isinstance(owed, BrokerError):
        with contextlib.suppress(ConnectionError, OSError, ssl.SSLError):
            await stream.write(error_bytes(owed))
    await stream.close()
    call.passed(ANSWER, began)


async def refuse(
    call: Call, exc: BrokerError, *, status: int | None = None, always: bool = False
) -> None:
    """Answer a refusal: recorded first unless a stage recorded it (``always``: record
    it in any case, a bug's 500)."""
    if isinstance(exc, Exhausted):
        await _exhausted(call, exc)
        return
    if isinstance(exc, RateLimited):
        await send_error(call, exc, extra=[("Retry-After", "1")])
        return
    if isinstance(exc, Unauthenticated):
        # Recorded by the admit stage; the 401 names no event (the token is the guest's).
        writer = call.writer
        assert writer is not None
        began = time.perf_counter_ns()
        await respond_json(writer, 401, {"error": exc.code, "message": exc.message,
                                         "policies": []})  # fmt: skip
        call.passed(ANSWER, began)
        return
    if always or not recorded_any():
        refused = await refuse_request(call, exc, status)
        if refused is not exc:
            exc, status = refused, None
    await send_error(call, exc, status=status)


async def _exhausted(call: Call, exc: Exhausted) -> None:
    """Past the run's bound or the tenant's quota: answered once its one event is
    durable, naming it; 503 ``not_recorded`` if it cannot be."""
    try:
        refusal = await asyncio.shield(exc.recorded)
    except BrokerError as refused:
        await send_error(call, refused)
        return
    counter = REQUEST_EVENTS.get()
    if counter is not None:
        counter.refusal = refusal
    await send_error(call, exc)


async def send_error(
    call: Call,
    exc: BrokerError,
    status: int | None = None,
    extra: list[tuple[str, str]] | None = None,
) -> None:
    writer = call.writer
    if writer is None or writer.is_closing() or not call.speaks_http:
        return
    began = time.perf_counter_ns()
    with contextlib.suppress(ConnectionError, OSError, RuntimeError):
        writer.write(error_bytes(exc, status, extra or ()))
        await writer.drain()
        call.passed(ANSWER, began)
