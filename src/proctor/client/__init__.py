"""The Python SDK: ``Client(url, token)`` over Proctor's HTTP API.

Shared by programs and the CLI's ``--server`` mode. Errors arrive as the same
``proctor`` exceptions the embedded runtime raises, chosen by the response's
stable error code.
"""

from proctor.client._client import Client, RemoteError, error_from_response, pack_directory
from proctor.client._in_process import IN_PROCESS_BASE, ASGIApp, InProcessTransport

__all__ = [
    "IN_PROCESS_BASE",
    "ASGIApp",
    "Client",
    "InProcessTransport",
    "RemoteError",
    "error_from_response",
    "pack_directory",
]
