"""The one exception root of Proctor, and the one table of its stable error codes.

Every error a user can see derives from :class:`ProctorError`. Its message is
written for people; the CLI prints it without a traceback and exits non-zero.
Errors from libraries underneath are translated at each component's boundary
(``raise LedgerError(...) from exc``).

Each class has a stable ``code`` and the HTTP ``status`` the API answers it
with; :func:`answer_of` (the API) and :func:`class_of` (the SDK) read the one
table below. The errors a client can be sent live here, not beside their
components, so that the SDK raises them without importing the server (Cedar,
the store, the sandbox drivers); the components re-export them.
"""

from __future__ import annotations


class ProctorError(Exception):
    """Root of every error Proctor raises on purpose."""

    #: Process exit code the CLI uses for this kind of error.
    exit_code: int = 1
    #: Stable machine-readable code: the API answers it, the SDK maps it back to the class.
    code: str = "internal"
    #: The HTTP status that answers it.
    status: int = 500
    #: Set by the SDK on an error it raised from a response: the server's request id.
    request_id: str | None = None

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def diagnostics(self) -> str:
        """Text for a person: what went wrong and, where known, what to do."""
        if self.hint:
            return f"{self.message}\nhint: {self.hint}"
        return self.message


class UsageError(ProctorError):
    """Bad input from the user: a malformed argument, an unknown name."""

    exit_code = 2
    code = "invalid_request"
    status = 400


class NotFound(UsageError):
    """A named thing (tenant, index, artifact) does not exist."""

    code = "not_found"
    status = 404


class AlreadyExists(UsageError):
    """A thing with this name exists already."""

    code = "already_exists"
    status = 409


class NotInitialized(ProctorError):
    """The Proctor home has not been initialised."""


class StoreError(ProctorError):
    """The store cannot be read or written (corrupt, locked, disk full)."""

    code = "store_unavailable"
    status = 503


class LedgerError(ProctorError):
    """The ledger cannot record or serve an event. Callers must refuse the call."""

    code = "ledger_unavailable"
    status = 503


class VerificationFailed(ProctorError):
    """A log, proof, checkpoint or signature does not verify."""

    exit_code = 3
    code = "verification_failed"
    status = 409


class SandboxError(ProctorError):
    """A sandbox could not be created, run or cleaned up."""

    code = "sandbox_error"


class PolicyError(ProctorError):
    """A policy is invalid or cannot be evaluated."""

    code = "invalid_policy"
    status = 400


# -- errors of governance and runs (re-exported by proctor.governance, proctor.lifecycle) --


class AuthenticationFailed(ProctorError):
    """The token names no principal, or a disabled one."""

    exit_code = 4
    code = "unauthenticated"
    status = 401


class ControlDenied(ProctorError):
    """The principal may not do this (or it is not theirs to see)."""

    exit_code = 5
    code = "forbidden"
    status = 403

    def __init__(
        self, message: str, policies: tuple[str, ...] = (), *, hint: str | None = None
    ) -> None:
        super().__init__(message, hint=hint)
        self.policies = policies


class ApprovalRequired(ProctorError):
    """The artifact lacks the quorum of valid approvals this needs."""

    exit_code = 5
    code = "approval_required"
    status = 409


class SyntheticOnly(ProctorError):
    """A sandbox deployment asked for a dataset that holds real data."""

    exit_code = 5
    code = "synthetic_only"
    status = 409


class NotApproved(ProctorError):
    """The deployment asks for something the approved manifest does not say."""

    exit_code = 5
    code = "not_approved"
    status = 409


class ProductionName(ProctorError):
    """A sandbox deployment tried to take a name production uses."""

    exit_code = 5
    code = "production_name"
    status = 409


class NotReady(ProctorError):
    """The tenant lacks what a manifest names: an unregistered dataset, or egress to a
    host no registered subprocessor covers. The hint is the command that fixes it."""

    exit_code = 5
    code = "not_ready"
    status = 409


class RunRefused(ProctorError):
    """The run may not start now: frozen tenant, inactive deployment, no quorum."""

    exit_code = 5
    code = "run_refused"
    status = 409


class AlreadyAnswered(ProctorError):
    """An asked call (a capability marked ``ask``) has its one answer already (or timed
    out, or its run ended): this answer does not count and is not recorded as one."""

    exit_code = 5
    code = "already_answered"
    status = 409


#: The table: the classes the API answers with their own code and status, most
#: specific first (the first one an error is an instance of answers for it).
ANSWERED: tuple[type[ProctorError], ...] = (
    AuthenticationFailed,
    ControlDenied,
    ApprovalRequired,
    SyntheticOnly,
    NotReady,
    NotApproved,
    ProductionName,
    RunRefused,
    AlreadyAnswered,
    NotFound,
    AlreadyExists,
    PolicyError,
    UsageError,
    LedgerError,
    StoreError,
    VerificationFailed,
    SandboxError,
)

#: Errors defined above this module that the API answers as one of the table's
#: classes, by their own ``code``: the broker's refusal to act unrecorded
#: (``CallRefused``) is the ledger's unavailability.
ANSWERED_AS: dict[str, type[ProctorError]] = {"not_recorded": LedgerError}

#: Codes the API layer answers by itself (request framing), and the class the SDK
#: raises for each.
FRAMING: dict[str, type[ProctorError]] = {
    "too_large": UsageError,
    "unsupported_media_type": UsageError,
    "method_not_allowed": UsageError,
    "rate_limited": UsageError,
}

#: Codes whose answer asks the client to retry (the Retry-After header).
RETRYABLE = frozenset({LedgerError.code, StoreError.code})

_BY_CODE: dict[str, type[ProctorError]] = {cls.code: cls for cls in ANSWERED} | FRAMING


def answer_of(exc: BaseException) -> tuple[int, str] | None:
    """The API's status and stable code for ``exc``; None for an error the table
    does not name (the API answers it as an internal error, without detail)."""
    for cls in ANSWERED:
        if isinstance(exc, cls):
            return cls.status, cls.code
    if isinstance(exc, ProctorError):
        for cls in type(exc).__mro__:
            alias = ANSWERED_AS.get(vars(cls).get("code", ""))
            if alias is not None:
                return alias.status, alias.code
    return None


def class_of(code: str) -> type[ProctorError] | None:
    """The class an API error code stands for (None: a code this version does not know)."""
    return _BY_CODE.get(code)
