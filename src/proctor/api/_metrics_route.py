"""``GET /metrics``: the runtime's Prometheus metrics, for the operator's scraper.

The metrics are the whole runtime's (every tenant's calls, runs and refusals; with
``serve --metrics-tenant-labels``, tenants' names), so no tenant's principal is
entitled to them, whatever its role: a principal acts only inside its own tenant.
The scraper shows the operator's own credential instead, as Vault asks a token for
``/v1/sys/metrics`` and Consul one with ``agent:read``: the bearer token in the file
given to ``serve --metrics-token-file`` (Prometheus reads the same file:
``authorization: {credentials_file: ...}``). Without that option the API serves no
metrics (404; ``serve --metrics-port`` serves them apart, on loopback by default).

A scrape is not recorded in the ledger: one every 15 s would be most of a quiet
log, and it reads counts, not any tenant's data. Each is a line of serve's log.
"""

from __future__ import annotations

import hmac
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request, Security
from fastapi.responses import Response
from fastapi.security import HTTPAuthorizationCredentials

from proctor import telemetry

# The API's one bearer scheme: here it carries the scrape token, not a principal's.
from proctor.api._context import _bearer
from proctor.api._errors import ERROR_RESPONSES, ApiError, unauthenticated
from proctor.errors import UsageError

router = APIRouter()

#: A scrape token shorter than this is refused at start: it must not be guessable.
MIN_TOKEN = 32

_EXPOSITION: dict[int | str, dict[str, Any]] = {
    **ERROR_RESPONSES,
    200: {
        "content": {
            "text/plain": {"schema": {"type": "string"}},
            "application/openmetrics-text": {"schema": {"type": "string"}},
        },
        "description": "The metrics in Prometheus's text format, or OpenMetrics when the "
        "Accept header asks for it",
    },
}


def read_metrics_token(path: Path) -> str:
    """The scrape token in ``path`` (its first line, stripped); one clear error if the
    file cannot be read or the token is too short to be a secret."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise UsageError(
            f"cannot read the metrics token file {path}: {why}",
            hint="give --metrics-token-file a readable file holding one random token",
        ) from None
    token = text.strip().split("\n", 1)[0].strip() if text.strip() else ""
    if len(token) < MIN_TOKEN or any(c.isspace() for c in token):
        raise UsageError(
            f"the metrics token in {path} is shorter than {MIN_TOKEN} characters or holds spaces",
            hint="make one with `openssl rand -hex 32 > FILE` (Prometheus reads the same file)",
        )
    return token


@router.get("/metrics", response_class=Response, responses=_EXPOSITION, tags=["meta"])
def get_metrics(
    request: Request,
    credentials: HTTPAuthorizationCredentials | None = Security(_bearer),  # noqa: B008
) -> Response:
    """The runtime's metrics (docs/operations.md), for the operator's scraper: needs the
    token of ``serve --metrics-token-file``; no tenant principal's token is accepted."""
    expected: str | None = request.app.state.proctor.metrics_token
    if expected is None:
        raise ApiError(
            404,
            "not_found",
            "this API serves no metrics",
            hint="start serve with --metrics-token-file (or scrape serve --metrics-port)",
        )
    given = credentials.credentials if credentials is not None else ""
    # Compared in constant time; a principal's token is no scrape token.
    if not hmac.compare_digest(given.encode(), expected.encode()):
        raise unauthenticated("the metrics need the operator's scrape token")
    body, content_type = telemetry.exposition(request.headers.get("accept"))
    return Response(body, media_type=content_type)
