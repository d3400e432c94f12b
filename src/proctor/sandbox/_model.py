"""The data a sandbox run takes and gives back: spec, limits, result, backend status."""

from __future__ import annotations

import enum
import posixpath
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING

from proctor.sandbox._errors import SandboxSpecInvalid

if TYPE_CHECKING:
    from proctor.sandbox._network import GuestNetwork

MiB = 1024 * 1024

#: Guest paths the drivers build themselves; a spec may not mount over them.
RESERVED_GUEST_PATHS = ("/", "/usr", "/proc", "/dev", "/sys", "/lib", "/lib64", "/bin", "/sbin")


class Reason(enum.StrEnum):
    """Why a run ended. Exactly one per run, the first cause the supervisor saw."""

    EXIT = "exit"  # the program ended by itself (any exit code)
    SIGNAL = "signal"  # the program was killed by a signal nobody in the runtime sent
    OOM = "oom"  # the kernel's OOM killer acted inside the run's memory cgroup
    PIDS = "pids"  # the run hit its pids ceiling
    TIMEOUT = "timeout"  # wall-clock limit reached; the whole tree was killed
    OUTPUT = "output"  # stdout + stderr went past the output cap; the tree was killed
    STOPPED = "stopped"  # the runtime stopped it (freeze, revoked approval, shutdown)


@dataclass(frozen=True)
class Limits:
    """Resource ceilings of one run, enforced by the kernel (cgroups) and the supervisor.

    ``cpu`` is a number of CPUs (0.5 = half a core) turned into a CFS quota.
    ``output_bytes`` caps stdout and stderr together.
    """

    memory_bytes: int = 256 * MiB
    pids: int = 64
    cpu: float = 1.0
    wall_seconds: float = 30.0
    output_bytes: int = 16 * MiB

    def __post_init__(self) -> None:
        if self.memory_bytes < 8 * MiB:
            raise SandboxSpecInvalid(
                f"memory limit {self.memory_bytes} bytes is below the 8 MiB an interpreter needs"
            )
        if self.pids < 1:
            raise SandboxSpecInvalid(f"pids limit must be at least 1, not {self.pids}")
        if not 0.01 <= self.cpu <= 1024:
            raise SandboxSpecInvalid(
                f"cpu share must be between 0.01 and 1024 CPUs, not {self.cpu}"
            )
        if not 0 < self.wall_seconds <= 7 * 24 * 3600:
            raise SandboxSpecInvalid(f"wall time must be positive, not {self.wall_seconds}")
        if self.output_bytes < 0:
            raise SandboxSpecInvalid(f"output cap must not be negative, not {self.output_bytes}")


def _guest_path(path: str, what: str) -> str:
    if not path.startswith("/"):
        raise SandboxSpecInvalid(f"{what} {path!r} must be an absolute guest path")
    normal = posixpath.normpath(path)
    if normal in RESERVED_GUEST_PATHS or any(
        normal.startswith(r + "/") for r in RESERVED_GUEST_PATHS if r != "/"
    ):
        raise SandboxSpecInvalid(f"{what} {path!r} is inside a path the sandbox builds itself")
    return normal


@dataclass(frozen=True)
class SandboxSpec:
    """What to run and with what: the one input of every driver.

    ``code_dir`` is mounted read-only at ``/code`` (and is the working directory
    when given). ``scratch_bytes`` sizes a tmpfs at ``scratch_path``, the only
    writable place. ``sockets`` maps a host Unix socket path to the guest path
    where it appears: the only way out of the sandbox.
    """

    argv: tuple[str, ...]
    code_dir: Path | None = None
    env: Mapping[str, str] = field(default_factory=dict)
    scratch_bytes: int = 64 * MiB
    scratch_path: str = "/tmp"  # noqa: S108 - a path inside the guest, on its own tmpfs
    limits: Limits = field(default_factory=Limits)
    sockets: Mapping[Path, str] = field(default_factory=dict)
    cwd: str | None = None
    #: Extra host directories mounted read-only (host path -> guest path), e.g. the
    #: guest library the broker's runs import.
    ro_dirs: Mapping[Path, str] = field(default_factory=dict)
    #: Let the guest make TCP sockets. Its network namespace holds only loopback, so
    #: they reach nothing but the guest itself: this is for the broker shim's local
    #: proxy listener, which ordinary HTTP clients must reach over TCP. UDP, raw,
    #: netlink and packet sockets stay refused.
    loopback_tcp: bool = False
    #: The run's network (:class:`._network.GuestNetwork`): the guest joins its
    #: namespace, where every TCP connection and UDP datagram reaches the broker's
    #: relay and nothing else; UDP sockets are allowed then (DNS). None: loopback only.
    network: GuestNetwork | None = None

    def __post_init__(self) -> None:
        argv = tuple(self.argv)
        if not argv or not argv[0]:
            raise SandboxSpecInvalid("a sandbox needs a command to run (argv is empty)")
        if any("\0" in a for a in argv):
            raise SandboxSpecInvalid("argv must not contain NUL bytes")
        object.__setattr__(self, "argv", argv)
        for key, value in self.env.items():
            if not key or "=" in key or "\0" in key or "\0" in value:
                raise SandboxSpecInvalid(f"environment variable name {key!r} is not valid")
        # Frozen in fact, not only in name: a caller keeping the dict cannot change a spec.
        object.__setattr__(self, "env", MappingProxyType(dict(self.env)))
        if self.code_dir is not None:
            code = Path(self.code_dir)
            if not code.is_dir():
                raise SandboxSpecInvalid(f"code directory {code} does not exist")
            object.__setattr__(self, "code_dir", code.resolve())
        if self.scratch_bytes < 64 * 1024:
            raise SandboxSpecInvalid("scratch must be at least 64 KiB")
        scratch = _guest_path(self.scratch_path, "scratch path")
        if scratch == "/code":
            raise SandboxSpecInvalid("scratch cannot be mounted at /code")
        object.__setattr__(self, "scratch_path", scratch)
        sockets: dict[Path, str] = {}
        seen = {"/code", scratch}
        for host, guest in self.sockets.items():
            host_path = Path(host)
            if not host_path.is_absolute():
                raise SandboxSpecInvalid(f"socket {host} must be an absolute host path")
            guest_norm = _guest_path(guest, "socket guest path")
            if guest_norm in seen or guest_norm.startswith(("/code/", scratch + "/")):
                raise SandboxSpecInvalid(f"socket guest path {guest} collides with another mount")
            seen.add(guest_norm)
            sockets[host_path] = guest_norm
        object.__setattr__(self, "sockets", MappingProxyType(sockets))
        ro_dirs: dict[Path, str] = {}
        for host, guest in self.ro_dirs.items():
            host_path = Path(host)
            if not host_path.is_absolute() or not host_path.is_dir():
                raise SandboxSpecInvalid(f"read-only mount {host} must be an existing directory")
            guest_norm = _guest_path(guest, "read-only mount guest path")
            if guest_norm in seen or guest_norm.startswith(("/code/", scratch + "/")):
                raise SandboxSpecInvalid(f"read-only mount {guest} collides with another mount")
            seen.add(guest_norm)
            ro_dirs[host_path.resolve()] = guest_norm
        object.__setattr__(self, "ro_dirs", MappingProxyType(ro_dirs))
        if self.cwd is not None:
            object.__setattr__(self, "cwd", posixpath.normpath(self.cwd))
            if not self.cwd.startswith("/"):
                raise SandboxSpecInvalid(f"working directory {self.cwd!r} must be absolute")

    @property
    def guest_cwd(self) -> str:
        if self.cwd is not None:
            return self.cwd
        return "/code" if self.code_dir is not None else self.scratch_path


@dataclass(frozen=True)
class SandboxResult:
    """What happened to one run. ``exit_code`` follows the shell: 128+N for signal N."""

    run_id: str
    backend: str
    exit_code: int
    reason: Reason
    duration_seconds: float  # from launching the tool to the end of clean-up
    setup_seconds: float  # building the bundle, cgroup and mounts before launch
    stdout_bytes: int  # bytes delivered to the stdout sink
    stderr_bytes: int
    stdout_dropped: int  # bytes the guest wrote past the output cap, never delivered
    stderr_dropped: int
    memory_peak_bytes: int | None = None  # of the whole sandbox tree, from the cgroup
    platform: str | None = None  # gVisor platform (ptrace, systrap, kvm); None for others
    limits: Limits = field(default_factory=Limits)

    @property
    def ok(self) -> bool:
        return self.reason is Reason.EXIT and self.exit_code == 0

    @property
    def truncated(self) -> bool:
        return self.stdout_dropped > 0 or self.stderr_dropped > 0


@dataclass(frozen=True)
class BackendStatus:
    """Whether a driver can work here, and in words why (not)."""

    name: str
    available: bool
    reason: str
