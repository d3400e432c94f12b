"""Proctor: a compliant runtime for code no person fully reviewed."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from proctor.errors import ProctorError

if TYPE_CHECKING:
    from proctor.client import Client

__all__ = ["Client", "ProctorError", "__version__"]

__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    # The SDK (httpx, rich) loads on first use: `import proctor.ledger` must not pay for it.
    if name == "Client":
        from proctor.client import Client

        return Client
    raise AttributeError(f"module 'proctor' has no attribute {name!r}")
