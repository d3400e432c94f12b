"""One error shape for every response that is not a success.

``{"error": {"code", "message", "hint", "request_id"}}``: ``code`` is stable (the
SDK maps it back to an exception class), ``message`` is written for people.
Nothing else leaves the server: no traceback, no exception type, no token.
"""

from __future__ import annotations

import logging
from typing import Any

from pydantic import BaseModel

from proctor.errors import (
    AlreadyExists,
    LedgerError,
    NotFound,
    PolicyError,
    ProctorError,
    SandboxError,
    StoreError,
    UsageError,
    VerificationFailed,
)

log = logging.getLogger("proctor.api")

#: Seconds a client should wait before retrying when the ledger or store cannot write.
RETRY_AFTER = 2


class ErrorBody(BaseModel):
    code: str
    message: str
    hint: str | None = None
    request_id: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorBody


class ApiError(ProctorError):
    """An error raised by the API layer itself, with its status and code."""

    def __init__(
        self, status: int, code: str, message: str, *, hint: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:  # fmt: skip
        super().__init__(message, hint=hint)
        self.status = status
        self.code = code
        self.headers = headers or {}


def unauthenticated(message: str) -> ApiError:
    return ApiError(401, "unauthenticated", message, headers={"WWW-Authenticate": "Bearer"})


def not_found(message: str) -> ApiError:
    return ApiError(404, "not_found", message)


def classify(exc: BaseException) -> tuple[int, str, dict[str, str]]:
    """Status, stable code and extra headers for an exception raised by a handler."""
    # Imported here: the governance and lifecycle errors live beside their modules,
    # and proctor.errors (the root) must not import them.
    from proctor.broker import CallRefused
    from proctor.governance import (
        ApprovalRequired,
        AuthenticationFailed,
        ControlDenied,
        NotApproved,
        ProductionName,
        SyntheticOnly,
    )
    from proctor.lifecycle import RunRefused

    retry = {"Retry-After": str(RETRY_AFTER)}
    if isinstance(exc, ApiError):
        return exc.status, exc.code, exc.headers
    table: list[tuple[type[BaseException], int, str, dict[str, str]]] = [
        (AuthenticationFailed, 401, "unauthenticated", {"WWW-Authenticate": "Bearer"}),
        (ControlDenied, 403, "forbidden", {}),
        (ApprovalRequired, 409, "approval_required", {}),
        (SyntheticOnly, 409, "synthetic_only", {}),
        (NotApproved, 409, "not_approved", {}),
        (ProductionName, 409, "production_name", {}),
        (RunRefused, 409, "run_refused", {}),
        (NotFound, 404, "not_found", {}),
        (AlreadyExists, 409, "already_exists", {}),
        (PolicyError, 400, "invalid_policy", {}),
        (UsageError, 400, "invalid_request", {}),
        (LedgerError, 503, "ledger_unavailable", retry),
        (CallRefused, 503, "ledger_unavailable", retry),
        (StoreError, 503, "store_unavailable", retry),
        (VerificationFailed, 409, "verification_failed", {}),
        (SandboxError, 500, "sandbox_error", {}),
    ]
    for kind, status, code, headers in table:
        if isinstance(exc, kind):
            return status, code, headers
    return 500, "internal", {}


def body(code: str, message: str, hint: str | None, request_id: str | None) -> dict[str, Any]:
    return {"error": {"code": code, "message": message, "hint": hint, "request_id": request_id}}


def describe(
    exc: BaseException, request_id: str | None
) -> tuple[int, dict[str, Any], dict[str, str]]:
    """The response for ``exc``: a Proctor error's own message, or a generic one."""
    status, code, headers = classify(exc)
    if code == "ledger_unavailable":
        # The underlying text may name store paths or DSNs: say only what matters.
        message = "the audit ledger cannot record this request now, so it is refused"
        return status, body(code, message, f"retry after {RETRY_AFTER} s", request_id), headers
    if code == "store_unavailable":
        return status, body(code, "the store is unavailable", None, request_id), headers
    if status < 500 and isinstance(exc, ProctorError):
        return status, body(code, exc.message, exc.hint, request_id), headers
    # Anything else is our bug or a library's: log it here, show only the request id.
    log.error("request %s failed", request_id, exc_info=exc)
    return status, body(code, "internal error", None, request_id), headers


#: Documented on every operation, so that clients (and schemathesis) know the shape.
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorResponse, "description": text}
    for status, text in (
        (400, "Invalid request (code invalid_request, invalid_policy)"),
        (401, "Missing, unknown, expired or badly signed credential (code unauthenticated)"),
        (403, "Refused by Cedar in the caller's own tenant (code forbidden)"),
        (404, "Not found, or not the caller's to see (code not_found)"),
        (409, "Conflict with state (already_exists, approval_required, run_refused, ...)"),
        (413, "Request body too large (code too_large)"),
        (415, "Unsupported content type (code unsupported_media_type)"),
        (422, "Malformed parameters or body (code invalid_request)"),
        (500, "Internal error (code internal), without detail"),
        (503, "Ledger or store cannot write: retry after Retry-After (code ledger_unavailable)"),
    )
}
