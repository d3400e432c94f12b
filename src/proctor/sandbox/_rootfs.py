"""What the guest sees of the host: the interpreter, /usr, and nothing else.

Both drivers build the guest's root from this one plan of explicit read-only
binds, so that no host directory is visible by accident: no host /, /run,
/var/run, /tmp, /home, /root, and never the runtime's data directory. (With
gVisor's ``--host-uds=open`` every host socket inside a bound directory would
be reachable, which is why /run and /tmp must never be bound.)
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path

from proctor.sandbox._errors import SandboxUnavailable

#: Host directories never bound as a whole, whatever asks for them.
FORBIDDEN_HOST_DIRS = tuple(
    Path(p)
    for p in (
        "/",
        "/run",
        "/var",
        "/var/run",
        "/tmp",  # noqa: S108 - listed to be refused
        "/home",
        "/root",
        "/etc",
        "/proc",
        "/sys",
        "/dev",
    )
)
#: Top-level names that Debian (and most current distributions) make symlinks into /usr.
MERGED_USR_LINKS = ("bin", "sbin", "lib", "lib64", "lib32", "libx32")

GUEST_PATH = "/usr/local/bin:/usr/bin:/bin"


@dataclass(frozen=True)
class Interpreter:
    """The host's real Python, which the guest runs from a read-only bind of its prefix."""

    executable: Path  # resolved, never a pyenv shim or a venv's symlink
    prefix: Path  # the directory bound into the guest (may be /usr)

    @property
    def bin_dir(self) -> Path:
        return self.executable.parent


def host_interpreter() -> Interpreter:
    """The base interpreter of the running Python (through any venv), by its real path."""
    base = getattr(sys, "_base_executable", None) or sys.executable
    executable = Path(os.path.realpath(base))
    prefix = Path(os.path.realpath(sys.base_prefix))
    if not executable.is_file():
        raise SandboxUnavailable(f"cannot find the host interpreter at {executable}")
    if not executable.is_relative_to(prefix):
        # A distribution Python lives in /usr/bin with its prefix /usr; anything
        # else outside its prefix would need a bind we cannot reason about.
        raise SandboxUnavailable(
            f"interpreter {executable} lies outside its prefix {prefix}; cannot mount it alone"
        )
    if prefix in FORBIDDEN_HOST_DIRS:
        raise SandboxUnavailable(f"interpreter prefix {prefix} is a directory never bound whole")
    return Interpreter(executable, prefix)


@dataclass(frozen=True)
class RootPlan:
    """Read-only binds (host -> guest, same path) and the /usr symlinks to recreate."""

    ro_binds: tuple[Path, ...]
    symlinks: tuple[tuple[str, str], ...]  # (target, guest link path)
    interpreter: Interpreter

    @property
    def guest_path_env(self) -> str:
        if self.interpreter.bin_dir == Path("/usr/bin"):
            return GUEST_PATH
        return f"{self.interpreter.bin_dir}:{GUEST_PATH}"


def root_plan(interpreter: Interpreter | None = None) -> RootPlan:
    interp = interpreter or host_interpreter()
    binds: list[Path] = [Path("/usr")]
    if not interp.prefix.is_relative_to("/usr"):
        binds.append(interp.prefix)
    links: list[tuple[str, str]] = []
    for name in MERGED_USR_LINKS:
        host = Path("/") / name
        if host.is_symlink():
            target = os.readlink(host)
            resolved = Path(os.path.realpath(host))
            if resolved.is_relative_to("/usr"):
                links.append((target, f"/{name}"))
        elif host.is_dir() and name in ("lib", "lib64", "bin"):
            # Not a merged-/usr system: the loader and libc live here, so bind it.
            binds.append(host)
    return RootPlan(tuple(binds), tuple(links), interp)


def guest_env(plan: RootPlan, scratch: str, extra: dict[str, str] | None = None) -> dict[str, str]:
    """A clean environment: nothing of the host's leaks in."""
    env = {
        "PATH": plan.guest_path_env,
        "HOME": scratch,
        "TMPDIR": scratch,
        "LANG": "C.UTF-8",
        "PYTHONDONTWRITEBYTECODE": "1",
        "PYTHONUNBUFFERED": "1",
    }
    env.update(extra or {})
    return env
