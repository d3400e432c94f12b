"""The HTTP API: FastAPI over the embedded runtime, for principals.

``create_app`` builds the application; ``serve_api`` runs it under uvicorn in a
thread (what ``proctor serve`` calls). Authentication is a principal's bearer
token or an OIDC JWT from a configured issuer (``OIDCIssuer``,
``load_oidc_config``); every request is decided by Cedar and recorded in the
ledger. See docs/api.md.
"""

from proctor.api._app import create_app, openapi_document
from proctor.api._auth import OIDCIssuer, load_oidc_config
from proctor.api._context import Limits
from proctor.api._server import DEFAULT_HOST, DEFAULT_PORT, ApiServer, check_tls, serve_api

__all__ = [
    "DEFAULT_HOST",
    "DEFAULT_PORT",
    "ApiServer",
    "Limits",
    "OIDCIssuer",
    "check_tls",
    "create_app",
    "load_oidc_config",
    "openapi_document",
    "serve_api",
]
