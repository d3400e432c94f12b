"""Isolation drivers: run one untrusted program so that it cannot touch the host.

Two backends behind one :class:`SandboxDriver` protocol: ``gvisor`` (``runsc``,
the default) and ``bubblewrap`` (``bwrap`` with a seccomp filter). Both build
the guest's root from explicit read-only binds, give it no network, a small
scratch tmpfs and kernel-enforced limits, and remove everything they made
before returning.

    result = get_driver().run(SandboxSpec(argv=("python3", "-c", "print(1)")),
                              on_stdout=sys.stdout.buffer.write)
"""

from proctor.sandbox._bubblewrap import BubblewrapDriver
from proctor.sandbox._cgroup import reap_orphans
from proctor.sandbox._driver import (
    DRIVER_NAMES,
    CapturedRun,
    SandboxDriver,
    backends,
    get_driver,
    run_captured,
)
from proctor.sandbox._errors import (
    SandboxCleanupFailed,
    SandboxSpecInvalid,
    SandboxStartFailed,
    SandboxUnavailable,
)
from proctor.sandbox._gvisor import GVisorDriver
from proctor.sandbox._model import (
    BackendStatus,
    Limits,
    Reason,
    SandboxResult,
    SandboxSpec,
)
from proctor.sandbox._network import GuestNetwork
from proctor.sandbox._network import available as network_available
from proctor.sandbox._owners import (
    owned_dir,
    owner_alive,
    process_start_time,
    reap_owned_dirs,
    release_owned_dir,
)
from proctor.sandbox._pool import WarmPool
from proctor.sandbox._supervise import Sink

__all__ = [
    "DRIVER_NAMES",
    "BackendStatus",
    "BubblewrapDriver",
    "CapturedRun",
    "GVisorDriver",
    "GuestNetwork",
    "Limits",
    "Reason",
    "SandboxCleanupFailed",
    "SandboxDriver",
    "SandboxResult",
    "SandboxSpec",
    "SandboxSpecInvalid",
    "SandboxStartFailed",
    "SandboxUnavailable",
    "Sink",
    "WarmPool",
    "backends",
    "get_driver",
    "network_available",
    "owned_dir",
    "owner_alive",
    "process_start_time",
    "reap_orphans",
    "reap_owned_dirs",
    "release_owned_dir",
    "run_captured",
]
