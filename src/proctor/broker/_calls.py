"""One call out of a sandbox, and the kinds of call: what the pipeline carries.

Every call goes through the same stages, one module each (:mod:`._pipeline`
reads them top to bottom): admit (:mod:`._admit`), parse (the kind),
decide (:mod:`._decide`), act (:mod:`._act`), record (:mod:`._record`),
answer (:mod:`._answer`). A kind of call supplies only what differs, through
:class:`CallKind`: how its request is parsed, which Cedar questions it asks,
how it acts, and whether its record must come before its act (an act that
cannot be held back, a connection dialed) or after it (an act whose result the
event carries, held until the event is durable: the bytes read, a staged write).

Kinds are registered once (:data:`KINDS`, in the order the socket matches
them); nothing else in the path tests a kind. Each :class:`Call` keeps the
stages it passed, in order (:attr:`Call.trace`): a tuple of names, cheap enough
to keep for every call; the broker keeps the last ones of each run. Beside it,
when each stage began (:attr:`Call.marks`, a clock read per stage), and the
call's decision and its event's seq, for the call's metrics and span
(:mod:`._telemetry`, once the call ends).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final, Protocol

if TYPE_CHECKING:
    from proctor.broker._http import RequestHead
    from proctor.broker._mitm import TlsStream
    from proctor.broker._proxy import EgressProxy
    from proctor.broker._scope import BrokerError, RunScope
    from proctor.broker._server import Handlers
    from proctor.ledger import LedgerObject
    from proctor.policy import Decision

#: The stages, by name, as a call's trace shows them.
ADMIT: Final = "admit"
PARSE: Final = "parse"
DECIDE: Final = "decide"
ASK: Final = "ask"
ACT: Final = "act"
RECORD: Final = "record"
COMPLETE: Final = "complete"
ANSWER: Final = "answer"


@dataclass(eq=False)
class Call:
    """One request on a run's socket, on its way through the stages."""

    scope: RunScope
    reader: asyncio.StreamReader | None = None
    writer: asyncio.StreamWriter | None = None
    head: RequestHead | None = None
    kind: CallKind | None = None
    handlers: Handlers | None = None
    #: The egress proxy, for a caller that hands a proxy call in directly.
    proxy: EgressProxy | None = None
    #: The stages passed, in order (a stage passed twice in a row shows once).
    trace: tuple[str, ...] = ()
    #: No byte came before the first-byte timeout: closed unread, for the server to count.
    idle: bool = False
    #: The guest spoke HTTP to the broker: a refusal is answered with an HTTP error.
    #: False for a redirected TLS or raw connection (transparent egress), which a
    #: refusal closes unanswered: HTTP written into a TLS stream helps no one.
    speaks_http: bool = True
    #: The connection may carry more than this call (the broker's socket reads the
    #: next request on it); False where the caller closes after one (the proxy's
    #: own entry points, transparent egress).
    persistent: bool = False
    #: Set by an act that left the connection fit for the next request (a plain-HTTP
    #: response relayed whole, framed by its length): the socket serves it next.
    keep_alive: bool = False
    #: Not the connection's first call: it was authenticated by the first one's token.
    follows: bool = False
    #: A redirected connection's original destination and first bytes
    #: (:class:`._transparent.Origin`); None on the socket and the proxy.
    origin: Any = None
    #: When each stage in :attr:`trace` began (``time.perf_counter_ns``), one each;
    #: a stage ends where the next begins, the last where the call ends.
    marks: list[int] = field(default_factory=list)
    #: When the call began: its first byte on the run's socket, else when it was made
    #: (``time.perf_counter_ns``, and the same instant as ``time.time_ns`` for spans).
    began: int = field(default_factory=time.perf_counter_ns)
    began_wall: int = field(default_factory=time.time_ns)
    #: The call's decision event, once recorded: "allow" or "deny", and its seq.
    decision: str | None = None
    seq: int | None = None
    #: What the decide stage ruled (allowed or not), where it ruled.
    ruled: bool | None = None
    #: Served by a call of its own (a handler that handed it to the proxy's entry
    #: point): that call is the one counted.
    handed_on: bool = False

    def passed(self, stage: str, at: int | None = None) -> None:
        """Note ``stage`` (begun ``at``, a ``perf_counter_ns`` reading; now if None)."""
        if not self.trace or self.trace[-1] != stage:
            self.trace = (*self.trace, stage)
            self.marks.append(at if at is not None else time.perf_counter_ns())

    def start(self) -> None:
        """The call begins now (its first byte came)."""
        self.began = time.perf_counter_ns()
        self.began_wall = time.time_ns()

    def recorded(self, decision: str, seq: int) -> None:
        """Its decision event is durable (the first a call records is its decision)."""
        if self.seq is None:
            self.decision, self.seq = decision, seq


#: The call being served by this task (set by the pipeline): stage functions that
#: are reached from a kind's own code (the record of a refusal, the completion
#: record) note themselves in its trace.
CURRENT: ContextVar[Call | None] = ContextVar("proctor_current_call", default=None)


def passed(stage: str) -> None:
    """Note ``stage`` in the trace of the call this task serves, if any."""
    call = CURRENT.get()
    if call is not None:
        call.passed(stage)


@dataclass
class Ruling:
    """What the decide stage found: the call's one decision and the event recording it.

    ``refusal`` set: the call stops once the event is durable, answered with it.
    ``found`` is what the kind learnt deciding and needs to act (an egress
    call's checked address); ``seq`` is the event's, once recorded.
    """

    action: str
    resource: str
    decision: Decision
    reason: str
    details: dict[str, Any]
    refusal: BrokerError | None = None
    found: Any = None
    seq: int | None = None


@dataclass
class Acted:
    """What the act stage did: ``details`` join the call's event; ``answer`` is what
    the guest is sent (a JSON document, bytes, or None when the act answered
    itself, a tunnel); ``commit`` runs once the event is durable, ``discard`` if
    it cannot be made so or the act was refused (a staged write made visible,
    or removed)."""

    answer: Any = None
    details: dict[str, Any] = field(default_factory=dict)
    commit: Callable[[], Any] | None = None
    discard: Callable[[], Any] | None = None
    #: Objects the event references (a read's lineage: its rows' keyed hashes).
    objects: tuple[LedgerObject, ...] = ()
    #: The act found the call cannot be carried out (an object missing, a link):
    #: the record stage records this refusal (``why`` its reason) as the call's
    #: event, and raises it; ``discard`` takes back what the act held.
    refusal: BrokerError | None = None
    why: str | None = None
    #: The guest's TLS, when the act ended it (a secret injected): the answer stage
    #: sends what is owed inside it, then closes it.
    inside: TlsStream | None = None


class CallKind(Protocol):
    """A kind of call: the parts of the pipeline that differ from one kind to another.

    ``method`` and ``path`` are the requests it answers: an exact path, a prefix
    ending in ``/``, ``authority`` (CONNECT's ``host:port``) or ``absolute-form``
    (an ``http://`` target, any method). ``records_first``: the event is
    recorded before the act (the act cannot be held back), else after it.
    """

    @property
    def name(self) -> str: ...
    @property
    def method(self) -> str: ...
    @property
    def path(self) -> str: ...
    @property
    def records_first(self) -> bool: ...

    async def parse(self, call: Call) -> Any:
        """The call's request, read from its head (and body); BadCall if malformed."""
        ...

    async def decide(self, call: Call, request: Any) -> Ruling | None:
        """The call's ruling (its Cedar questions asked through :mod:`._decide`);
        None for a kind whose act still decides and records itself."""
        ...

    async def act(self, call: Call, request: Any, ruling: Ruling | None) -> Acted:
        """Carry the call out."""
        ...

    async def done(self, call: Call, request: Any) -> None:
        """Give back what the parsed request holds (a database connection), however
        the call ended."""
        ...


#: Every kind of call, registered once, in the order the socket matches them.
KINDS: list[CallKind] = []


def register(kind: CallKind) -> CallKind:
    """Add ``kind`` to :data:`KINDS` (once, at import of the module defining it)."""
    if any(k.name == kind.name for k in KINDS):
        raise ValueError(f"call kind {kind.name!r} is registered twice")
    KINDS.append(kind)
    return kind
