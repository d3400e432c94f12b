"""The dataset-connector seam: what every kind of SQL dataset shares.

A connector knows one engine (SQLite in ``_sql.py``, PostgreSQL in
``_pg_sql.py``): whether a location is its own and reachable, what to grant a
deployment outside Proctor at run start, how to compile a guest statement and
report what it reads, how to run it, what to release when the run ends and to
revoke at undeploy. The registry (``_connectors.py``) maps a dataset's kind to
its connector. What must not differ between engines is here, once: the
request's checks, the Cedar question per table, and the one decide -> record ->
answer path, so every outcome on every engine is recorded before it is answered.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, NamedTuple, Protocol, TypeVar

from proctor.broker._calls import Acted, Ruling
from proctor.broker._fair import LOOP, run_blocking
from proctor.broker._scope import BadCall, BrokerError, CallDenied, DatasetBinding, RunScope
from proctor.errors import PolicyError
from proctor.governance import DatasetKind
from proctor.ledger import Action, LedgerObject, clip, lineage_object
from proctor.policy import CedarValue, Decision, Entity, EntityRef, EntitySet, Request, decide

#: Longest statement text accepted from a guest.
MAX_SQL_LENGTH = 100_000


class StatementTimeout(BrokerError):
    """The statement ran past the deployment's statement time limit and was stopped."""

    code = "statement_timeout"
    status = 408


class AnswerTooLarge(BadCall):
    """A read's answer is larger than its budget (or the run's answers in flight
    would be): refused, recorded; the guest asks for fewer rows or columns."""

    code = "too_large"
    status = 413


#: Bytes one read's answer may make the broker hold (counted as PostgreSQL sends
#: the rows, and again as the broker holds them).
ANSWER_BYTES = 16 << 20
#: Bytes the answers of one run's calls in flight may hold together.
RUN_ANSWER_BYTES = 32 << 20


class AnswerBudget:
    """What one run's answers in flight hold, bounded. Thread-safe."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._held = 0
        self._lock = threading.Lock()

    def take(self, n: int) -> bool:
        """Hold ``n`` more bytes, if that stays within the limit."""
        with self._lock:
            if self._held + n > self.limit:
                return False
            self._held += n
            return True

    def give(self, n: int) -> None:
        with self._lock:
            self._held = max(0, self._held - n)


def run_answer_budget(scope: RunScope) -> AnswerBudget:
    budget: AnswerBudget = scope.__dict__.setdefault(
        "_sql_answer_budget", AnswerBudget(RUN_ANSWER_BYTES)
    )
    return budget


class PlanRead(Protocol):
    """Columns a statement's plan orders rows by that the engine did not report as
    read (an index it reads through): decided as reads, named in the refusal."""

    @property
    def table(self) -> str: ...

    @property
    def columns(self) -> frozenset[str]: ...

    def as_json(self) -> dict[str, Any]: ...

    def hint(self) -> str: ...


@dataclass
class Accesses:
    """What one statement reads and writes, as its engine reported it."""

    reads: dict[str, set[str]] = field(default_factory=dict)
    writes: dict[str, set[str]] = field(default_factory=dict)
    # INSERT and DELETE name no columns; they touch whole rows.
    whole_row_writes: set[str] = field(default_factory=set)
    plan: list[PlanRead] = field(default_factory=list)

    def plan_columns(self, table: str) -> set[str]:
        return {c for p in self.plan if p.table == table for c in p.columns}

    @property
    def is_write(self) -> bool:
        return bool(self.writes or self.whole_row_writes)


@dataclass(frozen=True)
class Grant:
    """One Cedar question about one table, and its answer."""

    table: str
    action: str
    columns: tuple[str, ...]
    decision: Decision
    # Denied only because of columns the plan reads through (an index, a key).
    through_plan: bool = False

    def as_json(self) -> dict[str, Any]:
        return {
            "table": self.table,
            "action": self.action,
            "columns": list(self.columns),
            "decision": self.decision.decision,
            "policies": list(self.decision.policies),
        }


@dataclass
class Outcome:
    """What one statement produced; rows go to the guest, never to the ledger."""

    columns: list[str] = field(default_factory=list)
    rows: list[list[Any]] = field(default_factory=list)
    truncated: bool = False
    rows_affected: int = 0
    keys: list[str] | None = None  # None: lineage is the whole table


# What a connector's statement raises; the shared path turns each into an event
# and a broker error. Private control flow: never leaves the broker.


class Refused(Exception):
    """Refused before any policy question: the statement itself is unacceptable.

    ``reason`` goes to the ledger and the guest; ``detail`` (the engine's
    message, which may quote the guest's literals) to the guest only."""

    def __init__(
        self, reason: str, *, bad_call: bool = False, detail: str = "", write: bool = False
    ) -> None:
        super().__init__(reason)
        self.reason = reason
        self.bad_call = bad_call
        self.detail = detail
        self.write = write


class TimedOut(Exception):
    """The statement passed the run's statement time limit and was stopped."""


class Failed(Exception):
    """The engine failed a permitted statement. ``error`` (its class name) goes to
    the ledger; ``message`` (which may quote a value) to the guest only."""

    def __init__(self, error: str, message: str) -> None:
        super().__init__(message)
        self.error, self.message = error, message


class DatabaseRefused(Exception):
    """The database's own grants refused a statement Cedar permitted."""


class TooLarge(Exception):
    """The answer passed its byte budget (``run``: the run's answers in flight did)."""

    def __init__(self, budget: int, *, run: bool = False) -> None:
        super().__init__(budget)
        self.budget, self.run = budget, run

    def sentence(self) -> str:
        if self.run:
            return (
                f"this run's answers in flight would hold more than its budget of"
                f" {self.budget} bytes: wait for one, or ask for fewer rows or columns"
            )
        return (
            f"the answer is larger than its budget of {self.budget} bytes: ask for fewer"
            " rows or columns (LIMIT, a narrower select list)"
        )


class Statement(Protocol):
    """One guest statement on one engine, driven by :func:`answer` from worker threads."""

    def analyse(self) -> Accesses:
        """Compile without running; what it reads and writes. Raises :class:`Refused`
        or :class:`TimedOut`."""
        ...

    def run_read(self, accesses: Accesses, row_limit: int) -> Outcome:
        """Run a permitted read, ``row_limit + 1`` rows fetched. Raises
        :class:`TimedOut`, :class:`Failed` or :class:`DatabaseRefused`."""
        ...

    def run_write(self, accesses: Accesses) -> Outcome:
        """Run a permitted write, left open for :meth:`commit` or :meth:`rollback`."""
        ...

    def commit(self) -> None: ...

    def rollback(self) -> None: ...


class SqlCall(NamedTuple):
    """A guest SQL call that passed the shared checks."""

    dataset: str
    sql: str
    params: tuple[Any, ...] | dict[str, Any]


#: At most this many tables, and columns per table, are described (the answer stays small).
DESCRIBED_TABLES = 500
DESCRIBED_COLUMNS = 500


@dataclass(frozen=True)
class ColumnShape:
    """A column as its dataset's catalog declares it: never a value of it."""

    name: str
    type: str
    nullable: bool
    primary_key: bool


@dataclass(frozen=True)
class TableShape:
    """A table or view of a dataset, named as a manifest names it."""

    name: str
    kind: str  # "table" | "view"
    columns: tuple[ColumnShape, ...]


class DatasetConnector(Protocol):
    """One kind of dataset. Implementations are registered in ``_connectors.py``."""

    @property
    def kind(self) -> DatasetKind: ...

    def recognises(self, where: str) -> bool:
        """Whether ``where`` (what an operator registers) names a dataset of this kind."""
        ...

    def locate(self, where: str) -> str:
        """The location to store for ``where``, checked to be reachable (raises
        :class:`~proctor.errors.UsageError`)."""
        ...

    def missing(self, location: str, tables: Mapping[str, Any]) -> list[str]:
        """What of ``tables`` (a manifest's ``datasets.<name>.tables``) the dataset
        does not have, as sentences ("no table 'x'", "no column 'y' in 'x'"); read
        with the runtime's own access, at deploy, never for a run."""
        ...

    def describe(self, location: str) -> list[TableShape]:
        """The dataset's tables and views with their columns and declared types, read
        from its own catalog with the runtime's own access; never a row."""
        ...

    def grant(
        self, binding: DatasetBinding, tenant: str, deployment: str, tables: Mapping[str, Any]
    ) -> None:
        """At run start: give the deployment what the engine enforces itself of the
        approved ``tables`` (the manifest's ``datasets.<name>.tables``)."""
        ...

    async def prepare(
        self, scope: RunScope, binding: DatasetBinding, call: SqlCall, base: dict[str, Any]
    ) -> tuple[Statement, dict[str, Any]]:
        """The call's statement, checked as far as the engine checks before it is
        analysed (a refusal raised as BadCall or CallDenied, recorded as the call's
        by the record stage), and the details its events carry (``base`` and the
        engine's own)."""
        ...

    async def close(self, scope: RunScope, stmt: Statement) -> None:
        """Give back what ``stmt`` holds (its connection), however the call ended."""
        ...

    def release(self, scope: RunScope, binding: DatasetBinding) -> None:
        """At run end: close what the run holds on the dataset."""
        ...

    def revoke(self, location: str, tenant: str, deployment: str, dataset: str) -> bool:
        """At undeploy: take back what :meth:`grant` gave; whether there was any."""
        ...

    def revoke_run(self, location: str, tenant: str, run_id: str, dataset: str) -> bool:
        """For a run whose owner is gone: take back what the run was granted outside
        Proctor (PostgreSQL: its login role); whether there was any."""
        ...


_Conn = TypeVar("_Conn")


class IdleConnections(Generic[_Conn]):
    """A run's idle connections to one dataset, reused across its calls: opening
    one and setting it up costs about as much as a small query. Thread-safe."""

    KEEP = 4

    def __init__(self) -> None:
        self._idle: list[_Conn] = []
        self._lock = threading.Lock()

    def pop(self) -> _Conn | None:
        with self._lock:
            return self._idle.pop() if self._idle else None

    def keep(self, conn: _Conn) -> bool:
        """Whether ``conn`` was kept; if not, the caller closes it."""
        with self._lock:
            if len(self._idle) < self.KEEP:
                self._idle.append(conn)
                return True
        return False

    def drain(self) -> list[_Conn]:
        with self._lock:
            idle, self._idle = self._idle, []
        return idle


# -- the request's checks ----------------------------------------------------------


def parse_request(request: Mapping[str, Any]) -> SqlCall:
    dataset = request.get("dataset")
    sql = request.get("sql")
    params = request.get("params", [])
    if not isinstance(dataset, str) or not dataset:
        raise BadCall("sql: 'dataset' must be a non-empty string")
    if not isinstance(sql, str) or not sql.strip():
        raise BadCall("sql: 'sql' must be a non-empty string")
    if len(sql) > MAX_SQL_LENGTH:
        raise BadCall(f"sql: the statement is longer than {MAX_SQL_LENGTH} characters")
    if "\x00" in sql:
        raise BadCall("sql: the statement contains a NUL character")
    scalars = (str, int, float, type(None))
    if params is None:
        params = []
    if isinstance(params, list):
        if not all(isinstance(p, scalars) for p in params):
            raise BadCall("sql: parameters must be strings, numbers or null")
        return SqlCall(dataset, sql, tuple(params))
    if isinstance(params, dict):
        if not all(isinstance(k, str) and isinstance(v, scalars) for k, v in params.items()):
            raise BadCall("sql: named parameters must map names to strings, numbers or null")
        return SqlCall(dataset, sql, dict(params))
    raise BadCall("sql: 'params' must be a list or an object")


def event_base(scope: RunScope, request: Mapping[str, Any]) -> dict[str, Any]:
    """The details every event of the call carries, taken from the raw request
    before it is checked (a refusal of a malformed call is recorded too)."""
    raw_dataset = request.get("dataset")
    name = "?"
    if isinstance(raw_dataset, str) and 0 < len(raw_dataset) <= 128 and raw_dataset.isprintable():
        name = raw_dataset
    base: dict[str, Any] = {"dataset": name}
    raw_sql = request.get("sql")
    if isinstance(raw_sql, str):
        # A literal in a WHERE clause is a row value: the text is kept only as a keyed hash.
        base["sql_hmac"] = _sql_hmac(scope, raw_sql)
    return base


#: Statement texts whose keyed hash one run keeps, and the longest kept.
_HMACS_KEPT = 256
_HMAC_SQL_LENGTH = 8192


def _sql_hmac(scope: RunScope, sql: str) -> str:
    """The statement's keyed hash, kept per run: a run sends the same text again and
    again, and the run's lineage key does not change."""
    kept: dict[str, str] = scope.__dict__.setdefault("_sql_hmacs", {})
    hit = kept.get(sql)
    if hit is None:
        hit = scope.key_hmacs([sql])[0]
        if len(sql) <= _HMAC_SQL_LENGTH:
            if len(kept) >= _HMACS_KEPT:
                kept.clear()
            kept[sql] = hit
    return hit


# -- the Cedar questions -----------------------------------------------------------


def _resource(dataset: str, tables: Sequence[str]) -> str:
    if len(tables) == 1:
        return f"dataset/{dataset}/table/{tables[0]}"
    return f"dataset/{dataset}"


def _combined(scope: RunScope, grants: Sequence[Grant], allowed: bool) -> Decision:
    """One decision for the event: the permits that allowed every table, or the
    policies behind the denies (empty for the default deny)."""
    chosen = [g.decision for g in grants if g.decision.allowed == allowed]
    policies = sorted({p for d in chosen for p in d.policies})
    errors = tuple(e for d in chosen for e in d.errors)
    return Decision(allowed, tuple(policies), scope.policies.version, errors)


#: Statement shapes whose answers one run keeps (see :func:`decide_tables`).
_DECISIONS_KEPT = 1024

_Questions = tuple[tuple[str, str, frozenset[str], frozenset[str]], ...]


class _Decisions:
    """One run's answers to the same Cedar questions, asked again and again (a run
    sends the same statement shape many times). Valid only for the policy set and
    entities they were decided under: :func:`decide_tables` drops them all the
    moment either is not the object it was (a changed set is a new object)."""

    def __init__(self, policies: object, entities: object) -> None:
        self.policies = policies
        self.entities = entities
        self.answers: dict[tuple[str, bool, int, _Questions], _Answers] = {}
        self.lock = threading.Lock()


class _Answers(NamedTuple):
    grants: tuple[Grant, ...]
    details: dict[str, Any]  # _grants_json(grants): never changed once made


def _decisions(scope: RunScope) -> _Decisions:
    policies, entities = scope.policies, scope.entities()
    kept: _Decisions | None = scope.__dict__.get("_sql_decisions")
    if kept is None or kept.policies is not policies or kept.entities is not entities:
        kept = scope.__dict__["_sql_decisions"] = _Decisions(policies, entities)
    return kept


def decide_tables(
    scope: RunScope, dataset: str, binding: DatasetBinding, accesses: Accesses
) -> list[Grant]:
    """One Cedar question per table the statement reads or writes, and its answer
    (see :func:`_decide_kept`)."""
    return list(_decide_kept(scope, dataset, binding, accesses).grants)


def _decide_kept(
    scope: RunScope, dataset: str, binding: DatasetBinding, accesses: Accesses
) -> _Answers:
    """One Cedar question per table the statement reads or writes, and its answer.

    Cedar's answer is a function of the policy set, the entities and the request
    alone (the context holds the dataset, the columns and the row limit, nothing
    that changes between calls), so a run asking about the same tables and columns
    again gets the answers it got, kept under the policy set and entities they were
    decided with and dropped with them (:func:`_decisions`)."""
    questions: _Questions = tuple(
        sorted(
            (t, "r", frozenset(c), frozenset(accesses.plan_columns(t)))
            for t, c in accesses.reads.items()
        )
        + sorted((t, "w", frozenset(c), frozenset()) for t, c in accesses.writes.items())
    )
    kept = _decisions(scope)
    key = (dataset, binding.synthetic, scope.row_limit, questions)
    with kept.lock:
        hit = kept.answers.get(key)
    if hit is not None:
        return hit
    grants = _decide_tables(scope, dataset, binding, accesses)
    answers = _Answers(tuple(grants), _grants_json(grants))
    with kept.lock:
        if len(kept.answers) >= _DECISIONS_KEPT:
            kept.answers.clear()  # a run cycling through shapes: start over
        kept.answers[key] = answers
    return answers


def _decide_tables(
    scope: RunScope, dataset: str, binding: DatasetBinding, accesses: Accesses
) -> list[Grant]:
    grants: list[Grant] = []
    questions = [
        (Action.SQL_SELECT, t, c | accesses.plan_columns(t)) for t, c in accesses.reads.items()
    ]
    questions += [(Action.SQL_WRITE, t, c) for t, c in accesses.writes.items()]
    for action, table, cols in sorted(questions, key=lambda q: (q[1], q[0])):
        columns = tuple(sorted(c for c in cols if c))
        try:
            ref, entities = _table_entities(scope, dataset, binding, table)
        except PolicyError:
            # A table whose name cannot be a policy resource cannot be permitted.
            denied = Decision(False, (), scope.policies.version, ("unnameable table",))
            grants.append(Grant(table, action, columns, denied))
            continue
        context: dict[str, CedarValue] = {
            "dataset": dataset,
            "columns": list(columns),
            "row_limit": scope.row_limit,
        }
        decision = decide(scope.policies, Request(scope.principal, action, ref, context), entities)
        through_plan = False
        if not decision.allowed and action == Action.SQL_SELECT and accesses.plan_columns(table):
            # Would the columns the statement names alone be permitted? Then the
            # plan is why it is denied, and the refusal says how to avoid it.
            named = sorted(c for c in accesses.reads[table] if c)
            context = {**context, "columns": list(named)}
            alone = decide(scope.policies, Request(scope.principal, action, ref, context), entities)
            through_plan = alone.allowed
        grants.append(Grant(table, action, columns, decision, through_plan))
    return grants


def column_permitted(
    scope: RunScope, dataset: str, binding: DatasetBinding, table: str, column: str
) -> bool:
    """Whether the run's Cedar set permits reading ``column`` of ``table`` on its own:
    the question a call naming only that column asks, in the run's context. What
    an engine grants the run itself (PostgreSQL: its login's column grants) is the
    approved columns this answers yes for; a call still asks for all it reads."""
    try:
        ref, entities = _table_entities(scope, dataset, binding, table)
    except PolicyError:
        return False
    context: dict[str, CedarValue] = {
        "dataset": dataset,
        "columns": [column],
        "row_limit": scope.row_limit,
    }
    request = Request(scope.principal, Action.SQL_SELECT, ref, context)
    return decide(scope.policies, request, entities).allowed


def _table_entities(
    scope: RunScope, dataset: str, binding: DatasetBinding, table: str
) -> tuple[EntityRef, EntitySet]:
    """The run's entities plus this Table, parsed once per run and table: adding
    an entity costs about what a decision does (docs/policy.md)."""
    cache: dict[tuple[str, str], tuple[EntityRef, EntitySet]]
    cache = scope.__dict__.setdefault("_sql_table_entities", {})
    hit = cache.get((dataset, table))
    if hit is None:
        entity = Entity.table(scope.tenant, dataset, table, synthetic=binding.synthetic)
        hit = (entity.uid, scope.entities().with_added([entity]))
        if len(cache) < 1024:  # a statement can name tables that do not exist
            cache[(dataset, table)] = hit
    return hit


def _deny_reason(denied: Sequence[Grant], plan: Sequence[PlanRead] = ()) -> str:
    parts = []
    for g in denied:
        what = f"{g.action} on {g.table} ({', '.join(g.columns) or 'no columns'})"
        parts.append(f"{what}: {g.decision.why}")
        if g.through_plan:
            parts += [p.hint() for p in plan if p.table == g.table]
    return "denied: " + "; ".join(parts)


# -- the SQL kind's decide and act stages ------------------------------------------


def _refused(
    scope: RunScope, action: str, resource: str, why: str, details: dict[str, Any],
    error: BrokerError,
) -> Ruling:  # fmt: skip
    """A statement refused before or instead of its tables' questions."""
    denied = Decision(False, (), scope.policies.version)
    return Ruling(action, resource, denied, f"refused: {why}", details, refusal=error)


async def rule(
    scope: RunScope, stmt: Statement, dataset: str, binding: DatasetBinding,
    details: dict[str, Any],
) -> Ruling:  # fmt: skip
    """The decide stage of a statement: analysed, one Cedar question per table it
    reads or writes, one decision. ``found``: (accesses, the read, its lineage).

    One trip to a worker thread for the common case: a permitted read is run in
    the same trip (held, not answered; the act stage takes it, and the record stage
    makes its event durable before anything is answered)."""

    def analyse_decide_read() -> tuple[Accesses, _Answers, Outcome | Exception | None, Lineage]:
        accesses = stmt.analyse()
        answers = _decide_kept(scope, dataset, binding, accesses)
        grants = answers.grants
        if accesses.is_write or not grants or not all(g.decision.allowed for g in grants):
            return accesses, answers, None, None
        try:
            outcome = stmt.run_read(accesses, scope.row_limit)
        except (TimedOut, Failed, DatabaseRefused, TooLarge) as exc:
            return accesses, answers, exc, None
        # Hashing one key per row is CPU work: here, not on the event loop.
        return accesses, answers, outcome, _lineage(scope, outcome)

    on = f"dataset/{dataset}"
    try:
        found = _quick(scope, stmt, dataset, binding)
        if found is None:
            found = await run_blocking(scope, analyse_decide_read)
        accesses, answers, read, lineage = found
    except Refused as exc:
        refused = Action.SQL_WRITE if exc.write else Action.SQL_SELECT
        error: BrokerError = CallDenied(f"sql: refused: {exc.reason}")
        if exc.bad_call:
            message = f"{exc.reason}: {exc.detail}" if exc.detail else exc.reason
            error = BadCall(f"sql: {message}")
        return _refused(scope, refused, on, exc.reason, details, error)
    except TimedOut:
        error = StatementTimeout("sql: the statement was stopped at the time limit")
        return _refused(scope, Action.SQL_SELECT, on, "timeout", details, error)

    grants = answers.grants
    action = Action.SQL_WRITE if accesses.is_write else Action.SQL_SELECT
    tables = sorted({g.table for g in grants})
    resource = _resource(dataset, tables)
    details = {**details, **answers.details}
    if accesses.plan:
        details.update(_plan_json(accesses.plan))
    denied = [g for g in grants if not g.decision.allowed]
    if not grants:
        # Deny by default holds here too: no policy names a statement on no table.
        reason = "the statement reads no table; no policy permits it"
        return _refused(scope, action, resource, reason, details,
                        CallDenied(f"sql: refused: {reason}"))  # fmt: skip
    if denied:
        reason = clip(_deny_reason(denied, accesses.plan), MAX_REASON)
        decision = _combined(scope, grants, allowed=False)
        error = CallDenied(f"sql: {reason}", policies=decision.policies)
        return Ruling(action, resource, decision, reason, details, refusal=error)
    decision = _combined(scope, grants, allowed=True)
    return Ruling(action, resource, decision, decision.reason, details,
                  found=(accesses, read, lineage))  # fmt: skip


def _quick(
    scope: RunScope, stmt: Statement, dataset: str, binding: DatasetBinding
) -> tuple[Accesses, _Answers, Outcome | Exception | None, Lineage] | None:
    """A permitted read its engine answers on the event loop, bounded (SQLite: a kept
    statement whose last run was quick, ``_sql.quick_read``); None: the worker path."""
    quick_read = getattr(stmt, "quick_read", None)
    if quick_read is None:
        return None

    def allowed(accesses: Accesses) -> bool:
        grants = _decide_kept(scope, dataset, binding, accesses).grants
        return bool(grants) and all(g.decision.allowed for g in grants)

    # Held to the run's share of the loop (and all runs' together): past it, the
    # read takes the worker path, fair-shared as any other.
    found = LOOP.run(scope, lambda: quick_read(allowed, scope.row_limit))
    if found is None:
        return None
    accesses, outcome = found
    answers = _decide_kept(scope, dataset, binding, accesses)
    return accesses, answers, outcome, _lineage(scope, outcome)


async def act(scope: RunScope, stmt: Statement, ruling: Ruling) -> Acted:
    """The act stage of a permitted statement: the read taken (run while deciding),
    or the write run in its transaction, committed once its event is durable and
    rolled back if it cannot be. An outcome that is not rows (a timeout, an answer
    over its budget, the database's own refusal, an error) is the event's too,
    and its answer an error."""
    accesses, read, lineage = ruling.found
    try:
        if accesses.is_write:
            outcome = await run_blocking(scope, stmt.run_write, accesses)
        elif isinstance(read, Exception):
            raise read
        else:
            assert read is not None
            outcome = read
    except TimedOut:
        return Acted(
            StatementTimeout(f"sql: the statement was stopped after {scope.statement_timeout:g} s"),
            {"outcome": "timeout"},
        )
    except TooLarge as exc:
        # Nothing is answered: the guest learns the budget and asks for less.
        return Acted(AnswerTooLarge(f"sql: refused: {exc.sentence()}"),
                     {"outcome": "too_large", "answer_budget": exc.budget})  # fmt: skip
    except DatabaseRefused as exc:
        # Cedar permitted more than the database grants: the database has the last word.
        return Acted(CallDenied(f"sql: the database refused it: {exc}"),
                     {"outcome": "refused_by_database"})  # fmt: skip
    except Failed as exc:
        # The class only: an engine message could quote a value.
        return Acted(BadCall(f"sql: the statement failed: {exc.message}"),
                     {"outcome": "error", "error": exc.error})  # fmt: skip
    if accesses.is_write:

        async def commit() -> None:
            await run_blocking(scope, stmt.commit)

        async def rollback() -> None:
            await run_blocking(scope, stmt.rollback)

        affected = {"rows_affected": outcome.rows_affected}
        return Acted(affected, {"outcome": "ok", **affected}, commit=commit, discard=rollback)
    details: dict[str, Any] = {
        "outcome": "ok",
        "row_count": len(outcome.rows),
        "truncated": outcome.truncated,
        "lineage": "rows" if lineage is not None else "table",
    }
    objects: tuple[LedgerObject, ...] = ()
    if lineage is not None:
        # The event names the rows by a reference of fixed size (ledger/_objects.py).
        objects = (lineage[0],)
        details["lineage_object"] = lineage[1]
    rows = {
        "columns": outcome.columns,
        "rows": outcome.rows,
        "row_count": len(outcome.rows),
        "truncated": outcome.truncated,
    }
    return Acted(rows, details, objects=objects)


# -- fixed budgets: an event's size must not follow its statement (docs/ledger.md) --

#: Lineage of one read: the object and the reference its event carries; None when
#: the statement's rows are not known one by one (``lineage: "table"``).
Lineage = tuple[LedgerObject, dict[str, Any]] | None
#: The longest refusal reason recorded (it names the denied tables and columns).
MAX_REASON = 2048
#: How many bytes of an event the per-table grants, and the plan's reads, may take.
_GRANTS_BUDGET = 8192
_PLAN_BUDGET = 2048
_COLUMNS_BUDGET = 2048


def _lineage(scope: RunScope, outcome: Outcome) -> Lineage:
    if outcome.keys is None:
        return None
    return lineage_object(scope.key_hmacs(outcome.keys))


def _json_len(value: Any) -> int:
    return len(json.dumps(value, ensure_ascii=False, separators=(",", ":"))) + 1


def _grants_json(grants: Sequence[Grant]) -> dict[str, Any]:
    """``{"tables": [...]}``, each grant's column list and the list itself cut to
    a fixed budget; what was cut is counted (``columns_cut``, ``tables_cut``)."""
    tables: list[dict[str, Any]] = []
    used = 0
    for i, g in enumerate(grants):
        item = g.as_json()
        cols: list[str] = item["columns"]
        if _json_len(cols) > _COLUMNS_BUDGET:
            kept: list[str] = []
            size = 2
            for c in cols:
                size += _json_len(c)
                if size > _COLUMNS_BUDGET:
                    break
                kept.append(c)
            item["columns"] = kept
            item["columns_cut"] = len(cols) - len(kept)
        item["table"] = clip(item["table"], 256)
        used += _json_len(item)
        if used > _GRANTS_BUDGET:
            return {"tables": tables, "tables_cut": len(grants) - i}
        tables.append(item)
    return {"tables": tables}


def _plan_json(plan: Sequence[PlanRead]) -> dict[str, Any]:
    items: list[dict[str, Any]] = []
    used = 0
    for i, p in enumerate(plan):
        item = p.as_json()
        used += _json_len(item)
        if used > _PLAN_BUDGET:
            return {"plan": items, "plan_cut": len(plan) - i}
        items.append(item)
    return {"plan": items}
