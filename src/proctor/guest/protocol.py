"""The broker protocol's names, shared by the guest and the broker.

Standard library only, and no import at all: inside the sandbox this package is
``proctor_guest``, and the broker (``proctor.broker``) and the supervisor
(``proctor.lifecycle``) import these same names from ``proctor.guest.protocol``,
so the two ends cannot drift apart.
"""

#: The environment variable that names the run's broker socket inside the sandbox.
SOCKET_ENV = "PROCTOR_BROKER"
#: The environment variable that holds the run's broker token.
TOKEN_ENV = "PROCTOR_TOKEN"  # noqa: S105 - a variable name, not a secret
#: The environment variable that holds the run's id.
RUN_ENV = "PROCTOR_RUN"
#: Where the supervisor mounts the run's broker socket inside the sandbox.
SOCKET_PATH = "/run/proctor/broker.sock"
#: The request header that carries the run's token to the broker (the shim adds it).
TOKEN_HEADER = "Proctor-Token"  # noqa: S105 - a header name, not a secret
