"""Calls that wait for a person: the asks of capabilities marked ``ask`` (issue 35).

A run's call that its policy allows and that falls under an ``ask`` capability
(``capabilities.ask``: egress hosts, bucket writes, table writes) is not carried
out at once: the broker records a ``call.ask`` event naming the call's exact
arguments and stores a pending row (``asks``, migration 18) in that event's
transaction, then waits for the row to move. Exactly one answer moves it: an
approver's approval or denial (``call.answer``, decided by Cedar: the approver
role, never the artifact's author, never an agent), the broker's timeout, or
the run's end (abandoned). Each is a compare-and-swap (``UPDATE ... WHERE state =
'pending'``) inside the transaction of its own ``call.answer`` event, so a second
answer changes nothing and records nothing (:class:`AlreadyAnswered`).

The store is the source of truth: the answer may come from another process (the
CLI, serve's API), so the broker polls the row; an answer given in the same
process wakes the broker's wait at once (:func:`on_answer`).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from proctor.errors import AlreadyAnswered, ControlDenied, NotFound, ProctorError, UsageError
from proctor.governance._backing import Record
from proctor.governance._control import ControlPlane
from proctor.governance._principals import Principal
from proctor.ledger import (
    Action,
    Actor,
    Appended,
    EventDraft,
    Ledger,
    LedgerObject,
    canonical_json,
    utc_now,
)
from proctor.policy import EntityRef
from proctor.store import Conn, Store

#: An ask's states: pending until its one answer.
STATES = ("pending", "approved", "denied", "timed_out", "abandoned")
ANSWERED = STATES[1:]
#: The rule an asked call's refusal names (denied, timed out, abandoned).
ASK_RULE = "proctor:ask"
#: The rule that refuses an agent's answer (people answer asked calls).
PEOPLE_ANSWER_RULE = "proctor:ask:people-answer"
#: The rule that refuses an answer by the author of the code the run runs (the local
#: operator is not decided by Cedar, so this holds it to the same separation).
AUTHOR_RULE = "proctor:ask:not-the-author"
MAX_COMMENT_BYTES = 2048
#: The runtime's actor for an ask that timed out (the broker decided it).
TIMEOUT_ACTOR = Actor("runtime", "broker")
#: The runtime's actor for an ask closed because its run had ended, found on an answer.
SWEEP_ACTOR = Actor("runtime", "asks")

_COLUMNS = (
    "id, tenant, run_id, deployment, artifact, action, resource, arguments, state,"
    " created_at, deadline, ask_seq, answered_by, answered_at, answer_seq, comment"
)


@dataclass(frozen=True)
class Ask:
    """One asked call: what it would do (``arguments``, exactly), and its answer."""

    id: str
    tenant: str
    run: str
    deployment: str
    artifact: str | None
    action: str  # the call's Cedar action: http.request, file.write, sql.write
    resource: str
    arguments: dict[str, Any]
    state: str
    created_at: str
    deadline: str
    ask_seq: int | None = None
    answered_by: str | None = None
    answered_at: str | None = None
    answer_seq: int | None = None
    comment: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id, "tenant": self.tenant, "run": self.run,
            "deployment": self.deployment, "artifact": self.artifact, "action": self.action,
            "resource": self.resource, "arguments": self.arguments, "state": self.state,
            "created_at": self.created_at, "deadline": self.deadline, "ask_seq": self.ask_seq,
            "answered_by": self.answered_by, "answered_at": self.answered_at,
            "answer_seq": self.answer_seq, "comment": self.comment,
        }  # fmt: skip


def _ask(row: tuple[Any, ...]) -> Ask:
    (id_, tenant, run, deployment, artifact, action, resource, arguments, state, created,
     deadline, ask_seq, by, at, answer_seq, comment) = row  # fmt: skip
    return Ask(
        str(id_), str(tenant), str(run), str(deployment), _text(artifact), str(action),
        str(resource), json.loads(str(arguments)), str(state), str(created), str(deadline),
        _int(ask_seq), _text(by), _text(at), _int(answer_seq), _text(comment),
    )  # fmt: skip


def _text(value: Any) -> str | None:
    return None if value is None else str(value)


def _int(value: Any) -> int | None:
    return None if value is None else int(value)


# -- the broker's side: the pending row, its state, its closing ----------------------


def insert_pending(conn: Conn, ask: Ask) -> None:
    """The pending row, written in the ``call.ask`` event's transaction."""
    conn.execute(
        f"INSERT INTO asks ({_COLUMNS}) VALUES"  # noqa: S608 - fixed columns
        " (?, ?, ?, ?, ?, ?, ?, ?, 'pending', ?, ?, NULL, NULL, NULL, NULL, NULL)",
        (ask.id, ask.tenant, ask.run, ask.deployment, ask.artifact, ask.action, ask.resource,
         canonical_json(ask.arguments).decode(), ask.created_at, ask.deadline),
    )  # fmt: skip


def read_ask(store: Store, tenant: str, ask_id: str) -> Ask | None:
    with store.read() as conn:
        row = conn.query_one(
            f"SELECT {_COLUMNS} FROM asks WHERE tenant = ? AND id = ?",  # noqa: S608
            (tenant, ask_id),
        )
    return None if row is None else _ask(tuple(row))


def note_seq(store: Store, ask_id: str, column: str, seq: int) -> None:
    """Keep the seq of the ask's event (``ask_seq``) or of its answer's (``answer_seq``)
    beside its row, for reads; the events are the record."""
    if column not in ("ask_seq", "answer_seq"):
        raise UsageError(f"no such column {column!r}")
    with store.write() as conn:
        conn.execute(f"UPDATE asks SET {column} = ? WHERE id = ?", (seq, ask_id))  # noqa: S608


class AskLost(ProctorError):
    """Raised inside the answer's transaction: the ask was answered first."""


def closing_hook(
    ask: Ask, state: str, by: str, comment: str | None, at: str
) -> Callable[[Conn], None]:
    """The compare-and-swap of an answer, run in its ``call.answer`` event's
    transaction: the event is written only if this answer is the one that counts."""
    if state not in ANSWERED:
        raise UsageError(f"no such answer {state!r}")

    def hook(conn: Conn) -> None:
        changed = conn.execute(
            "UPDATE asks SET state = ?, answered_by = ?, answered_at = ?, comment = ?"
            " WHERE id = ? AND tenant = ? AND state = 'pending'",
            (state, by, at, comment, ask.id, ask.tenant),
        )
        if changed != 1:
            raise AskLost(f"ask {ask.id} is answered already")

    return hook


def answer_draft(
    ask: Ask, state: str, actor: Actor, *, reason: str, comment: str | None = None,
    policies: tuple[str, ...] = (), details: Mapping[str, Any] | None = None,
    objects: tuple[LedgerObject, ...] = (),
) -> EventDraft:  # fmt: skip
    """The ``call.answer`` event of ``ask`` answered ``state`` by ``actor`` (``objects``:
    the role policy whose version a person's answer cites, for evidence packs)."""
    doc: dict[str, Any] = {"ask": ask.id, "ask_seq": ask.ask_seq, "answer": state,
                           "call": ask.action, "call_resource": ask.resource}  # fmt: skip
    if comment:
        doc["comment"] = comment
    doc.update(details or {})
    return EventDraft(
        actor, Action.CALL_ANSWER, f"ask/{ask.id}", reason=reason, policies=policies,
        deployment=ask.deployment, run=ask.run, artifact=ask.artifact, details=doc,
        objects=objects,
    )  # fmt: skip


def already(ask: Ask, current: Ask | None) -> AlreadyAnswered:
    state = current.state if current is not None else "answered"
    person = current is not None and current.state in ("approved", "denied")
    who = f" by {current.answered_by}" if person and current and current.answered_by else ""
    seq = (
        f" (event {current.answer_seq})"
        if current is not None and current.answer_seq is not None
        else ""
    )
    return AlreadyAnswered(
        f"ask {ask.id} is already answered: {state.replace('_', ' ')}{who}{seq}",
        hint="an asked call has exactly one answer; this one did not count",
    )


def close_ask(  # noqa: PLR0913 - the answer's event and its row, spelled out
    store: Store, ledger: Ledger, ask: Ask, state: str, actor: Actor, *, reason: str,
    comment: str | None = None, policies: tuple[str, ...] = (),
    details: Mapping[str, Any] | None = None, objects: tuple[LedgerObject, ...] = (),
) -> Appended:  # fmt: skip
    """Move ``ask`` from pending to ``state`` with its ``call.answer`` event, or raise
    :class:`AlreadyAnswered` (nothing recorded) if another answer came first."""
    at = utc_now()
    draft = answer_draft(ask, state, actor, reason=reason, comment=comment,
                         policies=policies, details=details, objects=objects)  # fmt: skip
    try:
        appended = ledger.append(ask.tenant, draft, hook=closing_hook(ask, state, actor.id,
                                                                      comment, at))  # fmt: skip
    except AskLost:
        raise already(ask, read_ask(store, ask.tenant, ask.id)) from None
    note_seq(store, ask.id, "answer_seq", appended.seq)
    wake(ask.id)
    return appended


# -- waking a wait in the same process -------------------------------------------------

_WAITERS: dict[str, Callable[[], None]] = {}
_WAITERS_LOCK = threading.Lock()


def on_answer(ask_id: str, wake_up: Callable[[], None] | None) -> None:
    """Call ``wake_up`` (from any thread) when ``ask_id`` is answered in this process;
    None: forget it. A shortcut only: the waiting side polls the store all the same."""
    with _WAITERS_LOCK:
        if wake_up is None:
            _WAITERS.pop(ask_id, None)
        else:
            _WAITERS[ask_id] = wake_up


def wake(ask_id: str) -> None:
    with _WAITERS_LOCK:
        wake_up = _WAITERS.get(ask_id)
    if wake_up is not None:
        wake_up()


# -- people's side: read, answer; the runtime's: close what no one waits on ---------------


class Asks:
    """The asked calls of a home's tenants."""

    def __init__(self, store: Store, ledger: Ledger, control: ControlPlane) -> None:
        self._store = store
        self._ledger = ledger
        self._control = control

    def find(
        self, tenant: str, *, run: str | None = None, state: str | None = None, limit: int = 500
    ) -> list[Ask]:
        """``tenant``'s asks, newest first (pending ones first when ``state`` is None)."""
        if state is not None and state not in STATES:
            raise UsageError(f"unknown ask state {state!r}", hint="one of " + ", ".join(STATES))
        where, params = ["tenant = ?"], [tenant]
        if run is not None:
            where.append("run_id = ?")
            params.append(run)
        if state is not None:
            where.append("state = ?")
            params.append(state)
        with self._store.read() as conn:
            rows = conn.query(
                f"SELECT {_COLUMNS} FROM asks WHERE {' AND '.join(where)}"  # noqa: S608
                f" ORDER BY created_at DESC, id LIMIT {int(limit)}",
                params,
            )
        asks = [_ask(tuple(r)) for r in rows]
        return sorted(asks, key=lambda a: a.state != "pending")  # stable: newest first

    def get(self, tenant: str, ask_id: str) -> Ask:
        ask = read_ask(self._store, tenant, ask_id)
        if ask is None:
            raise NotFound(f"no ask {ask_id!r} in tenant {tenant!r}")
        return ask

    def _run_status(self, ask: Ask) -> str | None:
        with self._store.read() as conn:
            row = conn.query_one("SELECT status FROM runs WHERE id = ?", (ask.run,))
        return None if row is None else str(row[0])

    def _author(self, ask: Ask) -> str | None:
        if ask.artifact is None:
            return None
        submitted = Record(self._store, self._ledger).submission(ask.tenant, ask.artifact)
        if submitted is not None:
            return str(submitted["actor"]["id"])
        with self._store.read() as conn:
            row = conn.query_one(
                "SELECT author FROM artifacts WHERE tenant = ? AND digest = ?",
                (ask.tenant, ask.artifact),
            )
        return None if row is None else str(row[0])

    def _refuse(self, ask: Ask, actor: Actor, rule: str, why: str) -> ControlDenied:
        self._ledger.append(
            ask.tenant,
            EventDraft(actor, Action.CALL_ANSWER, f"ask/{ask.id}", decision="deny",
                       policies=(rule,), reason=why, deployment=ask.deployment, run=ask.run,
                       artifact=ask.artifact, details={"ask": ask.id, "ask_seq": ask.ask_seq}),
        )  # fmt: skip
        return ControlDenied(f"{actor.id} may not answer ask {ask.id}: {why}", (rule,))

    def answer(
        self, tenant: str, ask_id: str, approve: bool, *, actor: Actor,
        principal: Principal | None = None, comment: str = "", trust_domain: str = "",
    ) -> Ask:  # fmt: skip
        """Approve or deny ``ask_id`` as ``principal`` (None: the local operator,
        ``actor``). Refused and recorded: an agent, the artifact's author, a principal
        Cedar does not permit ``call.answer``. :class:`AlreadyAnswered` (not recorded
        as an answer) if it has its answer already."""
        if len(canonical_json(comment)) > MAX_COMMENT_BYTES:
            raise UsageError(
                f"the comment takes more than {MAX_COMMENT_BYTES} bytes as the log records it"
            )
        ask = self.get(tenant, ask_id)
        if ask.state != "pending":
            raise already(ask, ask)
        status = self._run_status(ask)
        if status is not None and status != "running":
            # Its run ended and no sweep closed the ask yet (a killed owner, found by a
            # process that is not serve): close it now; no answer counts for a call
            # nobody waits on.
            self.abandon_run(tenant, ask.run, SWEEP_ACTOR, f"its run is {status}")
            raise already(ask, self.get(tenant, ask_id))
        if principal is not None and principal.kind == "agent":
            # The instruction to act on personal data comes from a person (Art. 28(3)(a)).
            raise self._refuse(ask, actor, PEOPLE_ANSWER_RULE, "an agent never answers asked calls")
        author = self._author(ask)
        is_author = author is not None and actor.id == author
        policies: tuple[str, ...] = ()
        version = None
        objects: tuple[LedgerObject, ...] = ()
        if principal is not None:
            workload = (
                f"spiffe://{trust_domain}/tenant/{tenant}/deployment/{ask.deployment}/run/{ask.run}"
            )
            allowed = self._control.authorize(
                principal, Action.CALL_ANSWER, EntityRef.workload(workload), tenant,
                event_resource=f"ask/{ask.id}", context={"principal_is_author": is_author},
            )  # fmt: skip
            policies, version = allowed.policies, allowed.version
            objects = (self._control.role_policy_object(principal.tenant),)
        elif is_author:
            raise self._refuse(
                ask, actor, AUTHOR_RULE, "the author of the code does not answer its calls"
            )
        state = "approved" if approve else "denied"
        details = {"policy_version": version} if version is not None else {}
        close_ask(self._store, self._ledger, ask, state, actor, reason=state,
                  comment=comment or None, policies=policies, details=details,
                  objects=objects)  # fmt: skip
        return self.get(tenant, ask_id)

    def abandon_run(self, tenant: str, run: str, actor: Actor, why: str) -> list[Ask]:
        """Close the pending asks of ``run``, which ended (or whose owner is gone): each
        ``abandoned`` with its event. Returns those this call closed."""
        closed = []
        for ask in self.find(tenant, run=run, state="pending"):
            try:
                close_ask(self._store, self._ledger, ask, "abandoned", actor,
                          reason=f"abandoned: {why}", policies=(ASK_RULE,))  # fmt: skip
            except AlreadyAnswered:
                continue
            closed.append(self.get(tenant, ask.id))
        return closed

    def abandon_orphans(self, actor: Actor) -> list[Ask]:
        """Close every pending ask whose run is no longer running (its serve was killed,
        its run recorded interrupted since): none is left waiting on nobody."""
        with self._store.read() as conn:
            rows = conn.query(
                "SELECT a.tenant, a.run_id, r.status FROM asks a LEFT JOIN runs r"
                " ON r.id = a.run_id WHERE a.state = 'pending'"
            )
        closed: list[Ask] = []
        for tenant, run, status in {(str(t), str(r), s) for t, r, s in rows}:
            if status == "running":
                continue
            why = f"its run is {status}" if status is not None else "its run is not recorded"
            closed += self.abandon_run(tenant, run, actor, why)
        return closed
