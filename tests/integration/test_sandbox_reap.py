"""A supervisor killed with SIGKILL leaves its sandboxes running; the next one reaps them."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from proctor.sandbox import reap_orphans
from tests.sandbox_conftest_helpers import BACKENDS

pytestmark = pytest.mark.sandbox

OWNER = """
import sys
from proctor.sandbox import SandboxSpec, get_driver
print("starting", flush=True)
get_driver(sys.argv[1]).run(SandboxSpec(argv=("python3", "-c", "import time; time.sleep(300)")))
"""


@pytest.mark.parametrize("backend", BACKENDS)
def test_sandboxes_of_a_dead_owner_are_killed_and_removed(backend: str, tmp_path: Path) -> None:
    registry = Path(os.environ.get("PROCTOR_SANDBOX_REGISTRY", "/run/proctor-sandboxes"))
    before = set(registry.iterdir()) if registry.is_dir() else set()
    owner = subprocess.Popen([sys.executable, "-c", OWNER, backend], stdout=subprocess.PIPE)
    assert owner.stdout is not None and owner.stdout.readline() == b"starting\n"
    deadline = time.monotonic() + 30
    while True:
        # Its entry once renamed into place, never the staged ``.tmp-`` copy.
        now = set(registry.iterdir()) if registry.is_dir() else set()
        mine = {p for p in now - before if not p.name.startswith(".tmp-")}
        if mine:
            break
        assert time.monotonic() < deadline, "the sandbox never registered"
        time.sleep(0.05)
    (entry,) = mine

    def run_cgroups() -> list[Path]:
        return [p for p in Path("/sys/fs/cgroup").glob(f"*/{entry.name}") if p.is_dir()]

    def started() -> bool:
        # The guest runs once its cgroups hold its processes (the registry entry comes
        # first: on a loaded machine, the cgroups and the guest some while after).
        return any((c / "cgroup.procs").exists() and (c / "cgroup.procs").read_text().split()
                   for c in run_cgroups())  # fmt: skip

    while not started():
        assert time.monotonic() < deadline, "the sandbox's guest never started"
        time.sleep(0.05)
    cgroups = run_cgroups()
    assert reap_orphans() == [] or entry.exists(), "a live owner's sandbox is never reaped"
    owner.send_signal(signal.SIGKILL)
    owner.wait()
    survivors = [p for c in cgroups if (c / "cgroup.procs").exists()
                 for p in (c / "cgroup.procs").read_text().split()]  # fmt: skip
    if backend == "gvisor":
        assert survivors, "runsc outlives its parent: this is what reaping is for"
    reaped = reap_orphans()
    assert entry.name in reaped
    assert not entry.exists()
    assert not any(c.exists() for c in cgroups), "the run's cgroups are gone"
    # A killed task leaves its cgroup early in its exit, before it is a zombie: its
    # cgroup can be gone while it still frees its memory (state R or D), briefly.
    deadline = time.monotonic() + 10
    for pid in survivors:
        while not _gone_or_zombie(pid):
            assert time.monotonic() < deadline, f"sandbox process {pid} outlived the reap"
            time.sleep(0.05)


def _gone_or_zombie(pid: str) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
    except (FileNotFoundError, ProcessLookupError):
        return True
