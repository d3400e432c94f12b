"""The committed openapi.json is the document the app serves; every operation
documents the one error shape; the public surfaces are exactly what they say."""

from __future__ import annotations

import json
import os
from pathlib import Path

import proctor.api
import proctor.client
from proctor.api import openapi_document

COMMITTED = Path(__file__).resolve().parents[2] / "openapi.json"


def test_committed_document_is_current() -> None:
    generated = json.dumps(openapi_document(), indent=2, sort_keys=True) + "\n"
    if os.environ.get("PROCTOR_UPDATE_OPENAPI"):
        COMMITTED.write_text(generated)
    assert COMMITTED.read_text() == generated, (
        "openapi.json is stale: run `python -m proctor.api openapi > openapi.json`"
    )


def test_every_operation_documents_errors_and_auth() -> None:
    doc = openapi_document()
    public = {"/healthz", "/readyz", "/key"}
    for path, item in doc["paths"].items():
        for method, op in item.items():
            if path in public:
                continue
            for status in ("400", "401", "403", "404", "409", "413", "422", "503"):
                ref = op["responses"][status]["content"]["application/json"]["schema"]["$ref"]
                assert ref == "#/components/schemas/ErrorResponse", (method, path, status)
            assert op.get("security") == [{"HTTPBearer": []}], (method, path)
    error = doc["components"]["schemas"]["ErrorBody"]
    assert set(error["required"]) == {"code", "message"}


def test_tlog_paths_are_served() -> None:
    paths = openapi_document()["paths"]
    assert "/tenants/{tenant}/log/checkpoint" in paths
    assert "/tenants/{tenant}/log/tile/{path}" in paths


def test_public_surfaces() -> None:
    assert sorted(proctor.api.__all__) == sorted(
        ["DEFAULT_HOST", "DEFAULT_PORT", "ApiServer", "Limits", "OIDCIssuer", "check_tls",
         "create_app", "load_oidc_config", "openapi_document", "serve_api"]
    )  # fmt: skip
    assert sorted(proctor.client.__all__) == sorted(
        [
            "IN_PROCESS_BASE",
            "ASGIApp",
            "Client",
            "InProcessTransport",
            "RemoteError",
            "error_from_response",
            "pack_directory",
        ]
    )
    for module in (proctor.api, proctor.client):
        for name in module.__all__:
            assert hasattr(module, name)
