"""The admit stage: is this a call the run may make at all, and of which kind?

In order: the head is read (a connection silent for the first-byte timeout is
closed and counted, never answered); the call is charged to the run's budget
(rate, bound of calls, the tenant's ledger quota: :meth:`RunScope.admit_call`),
before anything that costs a ledger write, the refusal of a bad token included;
the token is checked (bound to the run, its artifact and the socket's opening);
the kind is found in the one registry (:data:`._calls.KINDS`), or the request
is refused 404 (no such endpoint) or 405 (a known path, the wrong method).
"""

from __future__ import annotations

from proctor.broker._calls import ADMIT, KINDS, Call, CallKind
from proctor.broker._http import IdleConnection, RequestHead, read_head
from proctor.broker._scope import BadCall, BrokerError
from proctor.broker._tokens import RunTokens
from proctor.guest.protocol import TOKEN_HEADER
from proctor.ledger import Action
from proctor.policy import Decision

SHOWN_METHOD = 16


class Unauthenticated(BrokerError):
    """The call's token is missing, forged, expired, or another run's (recorded)."""

    code = "unauthenticated"
    status = 401


class Gate:
    """What a call's token is checked against: the broker's token key, and each open
    run's artifact and *opening* (drawn when its socket opens, forgotten when it
    closes: a token dies with its socket). Used on the broker's event loop."""

    def __init__(self, tokens: RunTokens) -> None:
        self.tokens = tokens
        self._open: dict[str, tuple[str, str]] = {}  # run -> (artifact, opening)

    def opened(self, run_id: str, artifact: str, opening: str) -> None:
        self._open[run_id] = (artifact, opening)

    def closed(self, run_id: str) -> None:
        self._open.pop(run_id, None)

    def problem(self, run_id: str, token: str) -> str | None:
        """Why ``token`` does not admit a call of ``run_id``, or None."""
        artifact, opening = self._open.get(run_id, ("", ""))
        problem = self.tokens.check(token, run_id, artifact, opening)
        if problem is None or token.count(".") != 3:
            return problem
        # Say so when it is the token of another open run (replayed here), which
        # only that run's opening can show; an ended run's token reads as forged.
        other = token.split(".")[1]
        replayed = other != run_id and other in self._open
        if replayed and self.tokens.check(token, other, *self._open[other]) is None:
            return "token belongs to another run"
        return problem


def shown(text: str, limit: int) -> str:
    """Guest text made safe for an event: printable ASCII, cut at ``limit``."""
    out = text.encode("ascii", "backslashreplace").decode()
    out = "".join(c if c.isprintable() else "?" for c in out)
    return out if len(out) <= limit else out[: limit - 3] + "..."


async def admit(call: Call, gate: Gate, first_byte: float) -> CallKind | None:
    """The call's kind, once the call is charged and its token checked; None when
    nothing was asked (a clean end; or no byte within ``first_byte`` seconds,
    ``call.idle``, for the server to count)."""
    scope = call.scope
    assert call.reader is not None
    try:
        head = await read_head(call.reader, first_byte=first_byte, arrived=call.start)
    except IdleConnection:
        call.idle = True
        return None
    except BadCall:
        # A malformed request is a call: charged before its refusal is recorded.
        scope.admit_call()
        raise
    if head is None:
        return None  # nothing asked, nothing answered
    call.head = head
    scope.admit_call()
    call.passed(ADMIT, call.began)
    token = head.header(TOKEN_HEADER)
    if token:
        problem = gate.problem(scope.run_id, token)
    elif call.follows:
        # A kept-alive connection's later request: the connection's first request
        # was authenticated, and nothing but that guest holds the connection.
        problem = None
    else:
        problem = f"missing {TOKEN_HEADER} header"
    if problem is not None:
        await scope.record(
            Action.BROKER_AUTH,
            f"run/{scope.run_id}",
            Decision(False, (), scope.policies.version),
            reason=problem,
            details={"method": shown(head.method, SHOWN_METHOD)},
        )
        raise Unauthenticated(problem)
    call.kind = kind_for(head)
    return call.kind


def kind_for(head: RequestHead) -> CallKind:
    """The registered kind answering ``head``; :class:`BadCall` 404 or 405 if none."""
    method, target = head.method, head.target
    if method == "CONNECT":
        return _by_path("authority")
    if target.startswith(("http://", "https://")):
        return _by_path("absolute-form")
    path = target.split("?", 1)[0]
    known = [
        k
        for k in KINDS
        if k.path.startswith("/")
        and (path == k.path or (k.path.endswith("/") and path.startswith(k.path)))
    ]
    for kind in known:
        if kind.method == method:
            return kind
    if known:
        methods = " or ".join(sorted({k.method for k in known}))
        err = BadCall(f"use {methods} for {known[0].path}")
        err.status = 405
        raise err
    err = BadCall(f"no such broker endpoint: {method} {path}")
    err.status = 404
    raise err


def _by_path(path: str) -> CallKind:
    return next(k for k in KINDS if k.path == path)
