"""proctor_guest: what code inside a Proctor sandbox imports.

Standard library only, and no import of the rest of Proctor: inside the sandbox
this directory is mounted read-only as the package ``proctor_guest``.

    from proctor_guest import sql, read, write
    rows = sql("crm", "SELECT id, country FROM customers WHERE plan = ?", ["pro"])["rows"]
    write("reports", "churn.md", b"...")

Plain HTTP(S) goes through the proxy the shim set up (``HTTP_PROXY``), so
urllib, requests, httpx and curl work unchanged. Every call is decided by policy
and recorded before it is answered; a refusal raises :class:`Denied` naming
the policies that decided it; a run over its call rate gets :class:`RateLimited`.
An allowed call whose upstream fails (a connection refused, a certificate that does
not verify) is answered 502 naming the cause and its ledger event: through the proxy,
in the status line (Python: ``Tunnel connection failed: 502 Bad Gateway (proctor
upstream failure seq=N: ...)``) and the ``X-Proctor-Upstream-Failure`` header; from
this library, as :class:`UpstreamFailed`.
"""

from ._client import (
    BrokerUnavailable,
    Denied,
    GuestError,
    NotRecorded,
    RateLimited,
    UpstreamFailed,
    read,
    sql,
    whoami,
    write,
)

__all__ = [
    "BrokerUnavailable",
    "Denied",
    "GuestError",
    "NotRecorded",
    "RateLimited",
    "UpstreamFailed",
    "read",
    "sql",
    "whoami",
    "write",
]
