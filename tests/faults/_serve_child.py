"""A sandbox owner that SIGKILLs itself at one chosen point of a run's life.

``python _serve_child.py BACKEND POINT``: runs one sandbox with the real driver
and dies, with no clean-up at all, at POINT (see POINTS). What it leaves is for
``reap_orphans`` in tests/faults/test_serve_kill.py. The points are found by
wrapping the functions the drivers call, so each kill lands exactly between
two steps of set-up or tear-down.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from proctor.sandbox import SandboxSpec, _cgroup, _gvisor, get_driver

#: point -> what has happened when the owner dies.
POINTS = {
    "staged": "its registry entry is written aside, not yet in place",
    "registered": "its registry entry is in place, nothing else exists",
    "bundle": "gVisor's work directory and bundle exist, no cgroup",
    "cgroup": "the first of the run's cgroup directories exists",
    "attached": "the launcher sits in the run's cgroup, waiting at its gate",
    "running": "the guest runs (runsc outlives its parent)",
    "teardown": "the first cgroup directory is removed, the others are not",
    "workdir": "the cgroups are gone, gVisor's work directory is not",
}
GVISOR_ONLY = {"bundle", "workdir"}


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def after(fn: Callable[..., Any], when: Callable[..., bool] = lambda *a, **k: True) -> Any:
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        result = fn(*args, **kwargs)
        if when(*args, **kwargs):
            die()
        return result

    return wrapped


def before(fn: Callable[..., Any], when: Callable[..., bool]) -> Any:
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        if when(*args, **kwargs):
            die()
        return fn(*args, **kwargs)

    return wrapped


def is_run_cgroup(path: Path, *_: Any, **__: Any) -> bool:
    return str(path).startswith(str(_cgroup.CGROUP_ROOT)) and path.name.startswith("proctor-")


def main(backend: str, point: str) -> None:
    guest_sleep = "60"
    if point == "staged":
        Path.replace = before(  # type: ignore[method-assign]
            Path.replace, lambda src, dst: Path(dst).parent == _cgroup.REGISTRY
        )
    elif point == "registered":
        _cgroup._register = after(_cgroup._register)
    elif point == "bundle":
        _gvisor.GVisorDriver._write_bundle = after(  # type: ignore[method-assign]
            _gvisor.GVisorDriver._write_bundle
        )
    elif point == "cgroup":
        Path.mkdir = after(Path.mkdir, is_run_cgroup)  # type: ignore[method-assign]
    elif point == "attached":
        _cgroup.RunCgroup.attach = after(_cgroup.RunCgroup.attach)  # type: ignore[method-assign]
    elif point == "teardown":
        guest_sleep = "0"
        Path.rmdir = after(Path.rmdir, is_run_cgroup)  # type: ignore[method-assign]
    elif point == "workdir":
        guest_sleep = "0"
        shutil.rmtree = before(  # type: ignore[assignment]
            shutil.rmtree, lambda path, *a, **k: Path(path).name.startswith("proctor-gvisor-")
        )
    elif point != "running":
        raise SystemExit(f"unknown point {point!r}")

    def on_stdout(data: bytes) -> None:
        if point == "running" and b"up" in data:
            die()

    code = f"import time; print('up', flush=True); time.sleep({guest_sleep})"
    get_driver(backend).run(SandboxSpec(argv=("python3", "-c", code)), on_stdout=on_stdout)
    # Reaching here means the point was never passed: the parent treats exit 0 as a failure.
    print(f"{point}: the run ended without passing the point", file=sys.stderr)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
