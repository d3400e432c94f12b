"""The driver seam, the registry of drivers, and a convenience for capturing output."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from proctor.sandbox._bubblewrap import BubblewrapDriver
from proctor.sandbox._errors import SandboxUnavailable
from proctor.sandbox._gvisor import GVisorDriver
from proctor.sandbox._model import BackendStatus, SandboxResult, SandboxSpec
from proctor.sandbox._supervise import Sink


@runtime_checkable
class SandboxDriver(Protocol):
    """Runs one spec to its end. Every driver kills and removes all it made before returning."""

    @property
    def name(self) -> str: ...

    def status(self) -> BackendStatus: ...

    def run(
        self,
        spec: SandboxSpec,
        *,
        on_stdout: Sink = None,
        on_stderr: Sink = None,
        cancel: threading.Event | None = None,
    ) -> SandboxResult:
        """Run ``spec`` to its end; setting ``cancel`` stops it (reason ``stopped``)."""
        ...


#: In order of preference: gVisor is the default, bubblewrap where gVisor cannot run.
DRIVER_NAMES = ("gvisor", "bubblewrap")

_drivers: dict[str, SandboxDriver] = {}


def get_driver(name: str | None = None) -> SandboxDriver:
    """The driver called ``name``, or the first one that works here when ``name`` is None."""
    if name is None:
        reasons = []
        for candidate in DRIVER_NAMES:
            status = get_driver(candidate).status()
            if status.available:
                return get_driver(candidate)
            reasons.append(f"{candidate}: {status.reason}")
        raise SandboxUnavailable(
            "no sandbox backend works on this machine (" + "; ".join(reasons) + ")",
            hint="install runsc or bubblewrap, and run where /sys/fs/cgroup is writable",
        )
    if name not in DRIVER_NAMES:
        from proctor.sandbox._errors import SandboxSpecInvalid

        raise SandboxSpecInvalid(
            f"unknown sandbox backend {name!r}; choose one of {', '.join(DRIVER_NAMES)}"
        )
    if name not in _drivers:
        _drivers[name] = GVisorDriver() if name == "gvisor" else BubblewrapDriver()
    return _drivers[name]


def backends() -> list[BackendStatus]:
    """Every driver, whether it works on this machine, and why (not)."""
    return [get_driver(name).status() for name in DRIVER_NAMES]


@dataclass(frozen=True)
class CapturedRun:
    result: SandboxResult
    stdout: bytes
    stderr: bytes


def run_captured(driver: SandboxDriver, spec: SandboxSpec) -> CapturedRun:
    """Run ``spec`` and keep its output in memory (at most ``spec.limits.output_bytes``)."""
    out = bytearray()
    err = bytearray()
    result = driver.run(spec, on_stdout=out.extend, on_stderr=err.extend)
    return CapturedRun(result, bytes(out), bytes(err))
