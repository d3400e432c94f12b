"""The ask stage: a call the run's policy allows, of a capability marked ``ask``,
waits for a person's answer before it is carried out.

Between decide and act (a connection dialed, a statement run: nothing is done
before the answer), or, for a bucket write, between act and record: the object
is staged and held (not visible) so the ask names its SHA-256 and size, and it
is made visible only once approved and recorded, removed otherwise.

The wait holds no broker worker and no place in the fair pool: it is an asyncio
wait on the broker's loop, woken at once by an answer given in this process
(``governance._asks.on_answer``) and otherwise polling the store (the source of
truth: the answer may come from the CLI or another node's API) with backoff,
each poll one short trip to the fair pool. Past the ask's deadline the broker
itself closes it as timed out, by the same compare-and-swap as a person's
answer, so exactly one answer counts.

The chain in the run's log: ``call.ask`` (the exact arguments), ``call.answer``
(approved, denied, timed out, abandoned), then the call's own decision event,
whose details name both seqs (``details.ask``); a refused ask refuses the call
with that event, answered to the guest naming its seq like any refusal.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from proctor.broker._calls import Ruling
from proctor.broker._fair import run_blocking
from proctor.broker._scope import CallDenied, CallRefused, RunScope
from proctor.errors import LedgerError
from proctor.governance import (
    ASK_RULE,
    ASK_TIMEOUT_ACTOR,
    Ask,
    AskLost,
    answer_draft,
    closing_hook,
    insert_pending,
    note_seq,
    on_answer,
    read_ask,
)
from proctor.ledger import Action, canonical_json, clip
from proctor.policy import Decision
from proctor.store import Store

#: The first poll of the store after an ask, and the longest between two polls.
FIRST_POLL = 0.05
LONGEST_POLL = 1.0
#: How long a wait for the seq of an answer given elsewhere lasts at most (the seq is
#: written beside the row just after the answer's transaction).
_ANSWER_SEQ_GRACE = 2.0
#: The most of a SQL statement an ask's row keeps (its SHA-256 covers it whole).
MAX_STATEMENT = 8192
#: The most calls of one run that wait for an answer at once.
MAX_WAITING = 16
#: The most of a plain-HTTP request's target an ask names.
MAX_TARGET = 2048


@dataclass(frozen=True)
class AskRules:
    """A run's ``capabilities.ask``: which of its calls wait for a person."""

    egress: tuple[str, ...] = ()
    buckets: frozenset[str] = frozenset()
    tables: frozenset[str] = frozenset()
    timeout: float = 300.0

    @classmethod
    def of(cls, capabilities: Mapping[str, Any]) -> AskRules | None:
        ask = capabilities.get("ask")
        if not ask:
            return None
        return cls(
            tuple(ask.get("egress", ())), frozenset(ask.get("buckets", ())),
            frozenset(ask.get("tables", ())), float(ask.get("timeout_seconds", 300)),
        )  # fmt: skip

    def _host(self, host: str, port: int) -> bool:
        for entry in self.egress:
            name, _, entry_port = entry.rpartition(":")
            if str(port) != entry_port:
                continue
            name = name.strip("[]")
            if name.startswith("*."):
                if host.endswith(name[1:]):
                    return True
            elif host.strip("[]") == name:
                return True
        return False

    def covers(self, ruling: Ruling, request: Any) -> Asked | None:
        """The ask an allowed ``ruling`` needs (its exact arguments), or None."""
        if ruling.action == Action.HTTP_REQUEST:
            return self._egress(ruling.details, request)
        if ruling.action == Action.FILE_WRITE:
            bucket = ruling.details.get("bucket")
            if bucket not in self.buckets:
                return None
            return Asked({"bucket": bucket, "key": ruling.details.get("key")}, before=False)
        if ruling.action == Action.SQL_WRITE:
            return self._sql(ruling, request)
        return None

    def _egress(self, details: Mapping[str, Any], request: Any) -> Asked | None:
        host, port = str(details.get("host", "")), details.get("port")
        if not isinstance(port, int) or not self._host(host, port):
            return None
        keys = ("host", "port", "method", "scheme", "path", "address")
        args: dict[str, Any] = {k: details[k] for k in keys if k in details}
        # A plain-HTTP request's whole target (its query too) and its body's announced
        # size; a CONNECT's tunnel is opaque to the broker (host and port are all).
        target = getattr(request, "origin", None)
        if isinstance(target, str):
            args["target"] = target[:MAX_TARGET]
        framing = getattr(request, "framing", None)
        if framing is not None:
            args["body"] = {"framing": framing.kind, "bytes": framing.length}
        if "inject" in details:
            args["secrets"] = [i["secret"] for i in details["inject"]]  # names, never values
        return Asked(args, before=True)

    def _sql(self, ruling: Ruling, request: Any) -> Asked | None:
        dataset = getattr(request, "dataset", None)
        found = ruling.found[0] if isinstance(ruling.found, tuple) else None
        written = set(getattr(found, "writes", {}))
        written |= set(getattr(found, "whole_row_writes", ()))
        tables = sorted(t for t in written if f"{dataset}.{t}" in self.tables)
        if not tables:
            return None
        checked = getattr(request, "call", None)
        sql = str(getattr(checked, "sql", ""))
        params = getattr(checked, "params", ())
        args: dict[str, Any] = {
            "dataset": dataset,
            "tables": tables,
            "statement_sha256": hashlib.sha256(sql.encode()).hexdigest(),
            "params_sha256": hashlib.sha256(canonical_json(params)).hexdigest(),
        }
        # The text is for the approver (the row); the log keeps its digests only: a
        # literal in a statement is a row value, as in every SQL event.
        return Asked(
            args, before=True, private={"statement": sql[:MAX_STATEMENT], "params": params}
        )


@dataclass
class Asked:
    """One call's ask: its arguments (in the event and the row), what only the row
    keeps (``private``: a statement's text), and whether it is asked before acting."""

    arguments: dict[str, Any]
    before: bool
    private: dict[str, Any] = field(default_factory=dict)


@dataclass
class AskGate:
    """What the broker needs to ask (set on the run's scope by the supervisor), and how
    many of the run's calls wait now: at most ``max_waiting`` at once, so that a run
    cannot bury its approvers (nor the log) in asks; past it a call is refused at once."""

    rules: AskRules
    store: Store
    max_waiting: int = MAX_WAITING
    waiting: int = field(default=0, init=False)


def _iso(at: datetime) -> str:
    return at.strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"


async def wait_for_answer(scope: RunScope, gate: AskGate, ruling: Ruling, asked: Asked) -> None:
    """Record the ask, wait for its one answer; on approval ``ruling`` goes on naming
    the chain, otherwise it becomes the refusal its record stage records."""
    if gate.waiting >= gate.max_waiting:
        why = (f"{gate.waiting} calls of the run wait for an answer already"
               f" (at most {gate.max_waiting})")  # fmt: skip
        _refuse(scope, ruling, why)
        return
    gate.waiting += 1
    try:
        await _asked(scope, gate, ruling, asked)
    finally:
        gate.waiting -= 1


def _refuse(scope: RunScope, ruling: Ruling, why: str) -> None:
    ruling.decision = Decision(False, (ASK_RULE,), scope.policies.version)
    ruling.reason = clip(f"refused: {why}", 2048)
    ruling.refusal = CallDenied(f"{ruling.action} on {ruling.resource} refused: {why}",
                                policies=(ASK_RULE,))  # fmt: skip


async def _asked(scope: RunScope, gate: AskGate, ruling: Ruling, asked: Asked) -> None:
    now = datetime.now(UTC)
    ask = Ask(
        id="ask_" + os.urandom(8).hex(), tenant=scope.tenant, run=scope.run_id,
        deployment=scope.deployment, artifact=scope.artifact, action=ruling.action,
        resource=ruling.resource, arguments={**asked.arguments, **asked.private}, state="pending",
        created_at=_iso(now), deadline=_iso(now + timedelta(seconds=gate.rules.timeout)),
    )  # fmt: skip
    details = {"ask": ask.id, "call": ruling.action, "arguments": asked.arguments,
               "timeout_seconds": gate.rules.timeout, "deadline": ask.deadline}  # fmt: skip
    draft = scope._draft(Action.CALL_ASK, ruling.resource, ruling.decision,
                         "asked: waits for a person's answer", details)  # fmt: skip
    loop = asyncio.get_running_loop()
    woken = asyncio.Event()

    def wake_up() -> None:
        loop.call_soon_threadsafe(woken.set)

    on_answer(ask.id, wake_up)
    try:
        try:
            asked_at = await scope.ledger.append_async(
                scope.tenant, draft, lambda conn: insert_pending(conn, ask)
            )
        except LedgerError as exc:
            raise CallRefused(
                f"the call was refused because the ledger cannot record its ask: {exc.message}"
            ) from exc
        ask = _with(ask, ask_seq=asked_at.seq)
        await run_blocking(scope, note_seq, gate.store, ask.id, "ask_seq", asked_at.seq)
        answered = await _answered(scope, gate, ask, woken, time.monotonic() + gate.rules.timeout)
    finally:
        on_answer(ask.id, None)
    chain = {"id": ask.id, "seq": ask.ask_seq, "answer": answered.state,
             "answer_seq": answered.answer_seq, "answered_by": answered.answered_by}  # fmt: skip
    ruling.details = {**ruling.details, "ask": chain}
    if answered.state == "approved":
        return
    state = answered.state.replace("_", " ")
    by = f" by {answered.answered_by}" if answered.state == "denied" else ""
    why = (f"asked call {state}{by} (ask event {ask.ask_seq},"
           f" answer event {answered.answer_seq})")  # fmt: skip
    _refuse(scope, ruling, why)


def gone_while_waiting(
    scope: RunScope, ruling: Ruling, reader: asyncio.StreamReader | None
) -> None:
    """An approved call whose guest closed its connection while it waited is not made:
    nobody would receive its answer, and the approver approved a call someone waited on."""
    if ruling.refusal is not None or reader is None or not reader.at_eof():
        return
    _refuse(scope, ruling, "the guest closed its connection while the call waited for its answer")


def _with(ask: Ask, **changes: Any) -> Ask:
    return Ask(**{**ask.__dict__, **changes})


async def _answered(
    scope: RunScope, gate: AskGate, ask: Ask, woken: asyncio.Event, deadline: float
) -> Ask:
    """Poll (woken early by a same-process answer) until the ask's one answer; past
    ``deadline``, answer it timed out."""
    delay = FIRST_POLL
    seq_wait: float | None = None
    while True:
        row = await run_blocking(scope, read_ask, gate.store, scope.tenant, ask.id)
        if row is not None and row.state != "pending":
            if row.answer_seq is not None:
                return row
            # Answered elsewhere a moment ago: its seq is written just after.
            seq_wait = seq_wait or time.monotonic() + _ANSWER_SEQ_GRACE
            if time.monotonic() > seq_wait:
                return row
        elif (left := deadline - time.monotonic()) <= 0:
            timed_out = await _time_out(scope, gate, ask)
            if timed_out is not None:
                return timed_out
            continue  # an answer came first: read it
        else:
            delay = min(delay, left)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(woken.wait(), delay)
        woken.clear()
        delay = min(delay * 2, LONGEST_POLL)


async def _time_out(scope: RunScope, gate: AskGate, ask: Ask) -> Ask | None:
    """Close ``ask`` as timed out; None if an answer came first."""
    at = _iso(datetime.now(UTC))
    draft = answer_draft(ask, "timed_out", ASK_TIMEOUT_ACTOR, policies=(ASK_RULE,),
                         reason=f"timed out: not answered in {gate.rules.timeout:g} s")  # fmt: skip
    try:
        appended = await scope.ledger.append_async(
            scope.tenant, draft, closing_hook(ask, "timed_out", ASK_TIMEOUT_ACTOR.id, None, at)
        )
    except AskLost:
        return None
    except LedgerError as exc:
        raise CallRefused(
            f"the call was refused because the ledger cannot record its timeout: {exc.message}"
        ) from exc
    await run_blocking(scope, note_seq, gate.store, ask.id, "answer_seq", appended.seq)
    return _with(ask, state="timed_out", answered_by=ASK_TIMEOUT_ACTOR.id, answered_at=at,
                 answer_seq=appended.seq)  # fmt: skip
