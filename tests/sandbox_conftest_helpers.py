"""Shared pieces of the sandbox tests: the backend parameter, what a test does when a
backend is missing, leftovers, a host listener."""

from __future__ import annotations

import functools
import glob
import os
import socket
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import NoReturn

import pytest

from proctor.sandbox import (
    BackendStatus,
    CapturedRun,
    Limits,
    SandboxDriver,
    SandboxSpec,
    get_driver,
    run_captured,
)
from proctor.sandbox._cgroup import layout

#: Every sandbox backend, working here or not: a test parametrized over them reports a
#: broken one (skipped, or failed on CI) instead of leaving it out of the run unseen.
SANDBOXES = ("gvisor", "bubblewrap")

BACKENDS = [
    pytest.param("gvisor", marks=[pytest.mark.gvisor, pytest.mark.sandbox], id="gvisor"),
    pytest.param(
        "bubblewrap", marks=[pytest.mark.bubblewrap, pytest.mark.sandbox], id="bubblewrap"
    ),
]


@functools.cache
def status(name: str) -> BackendStatus:
    return get_driver(name).status()


def unavailable(what: str, why: str) -> NoReturn:
    """A test needs ``what`` (a sandbox backend, PostgreSQL) and it does not work here.

    A developer's machine may lack it: the test skips, saying why. The CI machine
    is built with every backend (``CI`` is set, by .ci/run and by the runner), so
    there it is a failure: a broken runsc must turn the run red, not quietly skip
    every gVisor case.
    """
    if os.environ.get("CI"):
        pytest.fail(f"{what} is needed on CI but does not work here: {why}", pytrace=False)
    pytest.skip(f"{what} does not work here: {why}")


def driver_or_skip(name: str) -> SandboxDriver:
    """The driver of backend ``name``; if it does not work here, see ``unavailable``."""
    st = status(name)
    if not st.available:
        unavailable(name, st.reason)
    return get_driver(name)


def working() -> list[str]:
    """The backends that work here, for a test that needs one of them, any one."""
    return [name for name in SANDBOXES if status(name).available]


def any_backend() -> list[str]:
    """``working()``, at least one; with none, see ``unavailable``."""
    names = working()
    if not names:
        why = "; ".join(f"{name}: {status(name).reason}" for name in SANDBOXES)
        unavailable("a sandbox backend", why)
    return names


def python(code: str, **kwargs: object) -> SandboxSpec:
    return SandboxSpec(argv=("python3", "-c", code), **kwargs)  # type: ignore[arg-type]


def run_code(driver: SandboxDriver, code: str, **kwargs: object) -> CapturedRun:
    kwargs.setdefault("limits", Limits(wall_seconds=20))
    return run_captured(driver, python(code, **kwargs))


@dataclass(frozen=True)
class Snapshot:
    cgroups: frozenset[str]
    tempdirs: frozenset[str]
    processes: frozenset[int]
    mounts: frozenset[str]


def snapshot() -> Snapshot:
    cgroups: set[str] = set()
    lay = layout()
    parents = [*lay.v1.values(), *([lay.v2] if lay.v2 is not None else [])]
    for parent in parents:
        cgroups.update(glob.glob(str(parent / "proctor-*")))
    tempdirs = set(glob.glob(os.path.join(tempfile.gettempdir(), "proctor-gvisor-*")))
    tempdirs |= set(glob.glob(os.path.join(tempfile.gettempdir(), "proctor-bwrap-*")))
    procs: set[int] = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmd = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue
        if b"runsc" in cmd or b"bwrap" in cmd or b"proctor-gate" in cmd:
            procs.add(int(entry))
    mounts = frozenset(
        line.split()[4] for line in Path("/proc/self/mountinfo").read_text().splitlines()
    )
    return Snapshot(frozenset(cgroups), frozenset(tempdirs), frozenset(procs), mounts)


def assert_nothing_left(before: Snapshot) -> None:
    after = snapshot()
    assert after.cgroups - before.cgroups == set(), "run cgroups left behind"
    assert after.tempdirs - before.tempdirs == set(), "bundle directories left behind"
    assert after.processes - before.processes == set(), "sandbox processes left behind"
    assert after.mounts - before.mounts == set(), "mounts left behind"


@pytest.fixture
def no_leftovers() -> Iterator[None]:
    before = snapshot()
    yield
    assert_nothing_left(before)


@dataclass
class HostListeners:
    """TCP and UDP listeners on the host's loopback that record every contact."""

    tcp_port: int
    udp_port: int
    tcp6_port: int | None
    contacts: list[str] = field(default_factory=list)


@pytest.fixture(scope="module")
def host_listeners() -> Iterator[HostListeners]:
    tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    tcp.bind(("127.0.0.1", 0))
    tcp.listen(8)
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    udp.bind(("127.0.0.1", 0))
    tcp6: socket.socket | None = None
    try:
        tcp6 = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
        tcp6.bind(("::1", 0))
        tcp6.listen(8)
    except OSError:
        tcp6 = None
    listeners = HostListeners(
        tcp.getsockname()[1], udp.getsockname()[1], tcp6.getsockname()[1] if tcp6 else None
    )
    stop = threading.Event()

    def serve(sock: socket.socket, kind: str) -> None:
        sock.settimeout(0.2)
        while not stop.is_set():
            try:
                if kind == "udp":
                    _, addr = sock.recvfrom(4096)
                else:
                    conn, addr = sock.accept()
                    conn.close()
                listeners.contacts.append(f"{kind} from {addr}")
            except TimeoutError:
                continue
            except OSError:
                return

    threads = [threading.Thread(target=serve, args=(tcp, "tcp"), daemon=True)]
    threads.append(threading.Thread(target=serve, args=(udp, "udp"), daemon=True))
    if tcp6 is not None:
        threads.append(threading.Thread(target=serve, args=(tcp6, "tcp6"), daemon=True))
    for t in threads:
        t.start()
    yield listeners
    stop.set()
    for t in threads:
        t.join()
    for s in (tcp, udp, tcp6):
        if s is not None:
            s.close()
