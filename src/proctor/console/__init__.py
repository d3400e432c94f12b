"""The web console: pages for the people in the loop (approvers, auditors,
developers, operators), served by ``proctor serve`` at ``/ui/`` on the API's port.

It is a client of the API and nothing more: every page is SDK calls made as the
signed-in person, through the same authentication, Cedar decisions and ledger
events as the CLI (it imports only ``proctor.client`` and ``proctor.errors``, which
the layering test holds). Sign-in is a principal's token or OpenID Connect
(authorization code with PKCE). See docs/console.md.
"""

from proctor.console._app import CSP, Console, ConsoleConfig
from proctor.console._oidc import SignInProvider
from proctor.console._session import PENDING_TTL, MemoryShelf, Shelf

__all__ = [
    "CSP",
    "PENDING_TTL",
    "Console",
    "ConsoleConfig",
    "MemoryShelf",
    "Shelf",
    "SignInProvider",
]
