"""The broker of one Proctor home, wired with every real handler, and where
brokers put their runs' sockets.

Sockets go under one directory per owning process (``<pid>-<start time>``), so
that what a SIGKILL leaves behind is found by owner and removed by whichever
process looks next (``reap_broker_sockets``).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from proctor.broker._mitm import TrustLookup
from proctor.broker._proxy import EgressProxy
from proctor.broker._scope import BrokerError, RateLimit
from proctor.broker._server import Broker, Handlers
from proctor.sandbox import owned_dir, reap_owned_dirs


def broker_socket_root() -> Path:
    """Where brokers put their runs' sockets: one directory per owning process,
    named ``<pid>-<start time>``, so that a server restarted after a SIGKILL
    removes what its dead predecessor left (see ``reap_broker_sockets``).
    ``PROCTOR_BROKER_SOCKETS`` overrides; on tmpfs by default, like the sockets'
    sandboxes' registry."""
    env = os.environ.get("PROCTOR_BROKER_SOCKETS")
    if env:
        return Path(env)
    if os.geteuid() == 0:
        return Path("/run/proctor-brokers")
    return Path(tempfile.gettempdir()) / f"proctor-brokers-{os.geteuid()}"


def reap_broker_sockets() -> list[Path]:
    """Remove the socket directories of every broker whose process is gone."""
    return reap_owned_dirs(broker_socket_root())


def make_broker(
    ca_dir: Path,
    token_key: bytes,
    *,
    upstream_cafile: str | None = None,
    rate_limit: RateLimit | None = None,
    upstream_trust: TrustLookup | None = None,
) -> Broker:
    """A broker with every real handler: SQL, buckets, and the egress proxy whose
    tenant CAs live under ``ca_dir``; ``token_key`` signs its runs' tokens.
    ``upstream_trust(tenant, host)``: the CA certificates a tenant registered for a
    host (PEM, or None), which alone verify that host where the broker ends TLS."""
    proxy = EgressProxy(ca_dir, upstream_cafile=upstream_cafile, upstream_trust=upstream_trust)
    handlers = Handlers.for_proxy(proxy)
    root = broker_socket_root()
    for _ in range(3):
        # Sockets under this process's own directory: what a SIGKILL leaves
        # behind is found by owner and reaped by the next `proctor serve`.
        owned = owned_dir(root)
        try:
            return Broker(handlers, token_key, socket_root=owned, rate_limit=rate_limit)
        except FileNotFoundError:
            continue  # another runtime of this process removed it, empty, just now
    raise BrokerError(f"cannot make a broker socket directory under {root}")
