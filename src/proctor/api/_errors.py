"""One error shape for every response that is not a success.

``{"error": {"code", "message", "hint", "request_id"}}``: ``code`` is stable (the
SDK maps it back to an exception class), ``message`` is written for people.
Nothing else leaves the server: no traceback, no exception type, no token.
"""

from __future__ import annotations

import logging
from typing import Any

from pydantic import BaseModel

from proctor.errors import RETRYABLE, AuthenticationFailed, ProctorError, answer_of

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
    if isinstance(exc, ApiError):
        return exc.status, exc.code, exc.headers
    answer = answer_of(exc)
    if answer is None:
        return 500, "internal", {}
    status, code = answer
    if code in RETRYABLE:
        return status, code, {"Retry-After": str(RETRY_AFTER)}
    if code == AuthenticationFailed.code:
        return status, code, {"WWW-Authenticate": "Bearer"}
    return status, code, {}


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
        (
            429,
            "Over the principal's request rate or follows: retry after Retry-After "
            "(code rate_limited)",
        ),
        (500, "Internal error (code internal), without detail"),
        (503, "Ledger or store cannot write: retry after Retry-After (code ledger_unavailable)"),
    )
}
