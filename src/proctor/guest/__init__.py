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
"""

from ._client import (
    BrokerUnavailable,
    Denied,
    GuestError,
    NotRecorded,
    RateLimited,
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
    "read",
    "sql",
    "whoami",
    "write",
]
