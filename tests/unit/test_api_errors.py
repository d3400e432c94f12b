"""Error codes: each server-side exception has one stable code and status, and the SDK
turns each code back into the same exception class."""

from __future__ import annotations

import pytest

from proctor.api._errors import describe
from proctor.broker import CallRefused
from proctor.client import RemoteError, error_from_response
from proctor.errors import (
    AlreadyExists,
    LedgerError,
    NotFound,
    PolicyError,
    ProctorError,
    StoreError,
    UsageError,
)
from proctor.governance import (
    ApprovalRequired,
    AuthenticationFailed,
    ControlDenied,
    NotApproved,
    ProductionName,
    SyntheticOnly,
)
from proctor.lifecycle import RunRefused

CASES = [
    (AuthenticationFailed("bad token"), 401, "unauthenticated"),
    (ControlDenied("no"), 403, "forbidden"),
    (NotFound("gone"), 404, "not_found"),
    (AlreadyExists("twice"), 409, "already_exists"),
    (ApprovalRequired("quorum"), 409, "approval_required"),
    (SyntheticOnly("real data"), 409, "synthetic_only"),
    (NotApproved("mode"), 409, "not_approved"),
    (ProductionName("churn"), 409, "production_name"),
    (RunRefused("frozen"), 409, "run_refused"),
    (PolicyError("bad cedar"), 400, "invalid_policy"),
    (UsageError("bad"), 400, "invalid_request"),
    (LedgerError("disk"), 503, "ledger_unavailable"),
    (StoreError("locked"), 503, "store_unavailable"),
]


@pytest.mark.parametrize(("exc", "status", "code"), CASES)
def test_round_trip(exc: ProctorError, status: int, code: str) -> None:
    got_status, doc, headers = describe(exc, "req_1")
    assert (got_status, doc["error"]["code"]) == (status, code)
    assert doc["error"]["request_id"] == "req_1"
    if status == 503:
        assert headers["Retry-After"].isdigit()
        # The cause's text may name paths: only a fixed message is shown.
        assert doc["error"]["message"] != exc.message
    back = error_from_response(got_status, doc, None)
    assert type(back) is type(exc)
    assert back.code == code and back.status == status  # type: ignore[attr-defined]


def test_broker_refusal_is_ledger_unavailable() -> None:
    assert describe(CallRefused("x"), None)[0] == 503


def test_unexpected_errors_say_nothing() -> None:
    status, doc, _ = describe(RuntimeError("secret /etc/shadow pt_abc"), "req_2")
    assert status == 500 and doc["error"] == {
        "code": "internal", "message": "internal error", "hint": None, "request_id": "req_2"
    }  # fmt: skip


def test_unknown_codes_and_bodies() -> None:
    e = error_from_response(418, {"error": {"code": "teapot", "message": "short and stout"}}, "r")
    assert isinstance(e, RemoteError) and e.message == "short and stout"
    e = error_from_response(502, "<html>bad gateway</html>", "r")
    assert isinstance(e, RemoteError) and "502" in e.message
