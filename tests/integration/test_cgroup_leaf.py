"""cgroup v2's "no internal processes" rule, met the way a pod meets it.

In a container the runtime's own cgroup is not the hierarchy's root, and the
kernel refuses to enable a controller for its children (EBUSY) while the
runtime sits in it: every run then failed with "cannot create the run's
cgroup". The runtime moves the processes of its cgroup into a leaf beside the
runs first. Driven on this machine's real cgroup2 tree (the unified hierarchy
of a hybrid layout, with the one controller it offers), the test's own cgroup
holding a real process; the root's setting is put back as it was.
"""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from proctor.sandbox._cgroup import LEAF, enable_for_children, runs_parent

pytestmark = pytest.mark.host

UNIFIED = Path("/sys/fs/cgroup/unified")


def _controller() -> str:
    root = UNIFIED if (UNIFIED / "cgroup.controllers").exists() else Path("/sys/fs/cgroup")
    offered = (root / "cgroup.controllers").read_text().split() if root.exists() else []
    if os.geteuid() != 0 or not offered:
        pytest.skip("no cgroup2 tree with a controller to enable here (needs root)")
    return offered[0]


@pytest.fixture
def parent() -> Iterator[tuple[Path, str, subprocess.Popen[bytes]]]:
    controller = _controller()
    root = UNIFIED if (UNIFIED / "cgroup.controllers").exists() else Path("/sys/fs/cgroup")
    was = set((root / "cgroup.subtree_control").read_text().split())
    if controller not in was:
        (root / "cgroup.subtree_control").write_text(f"+{controller}")
    group = root / f"proctor-leaftest-{os.getpid()}"
    group.mkdir()
    sleeper = subprocess.Popen(["sleep", "120"])
    (group / "cgroup.procs").write_text(str(sleeper.pid))
    try:
        yield group, controller, sleeper
    finally:
        sleeper.kill()
        sleeper.wait()
        for child in (group / "run-x", group / LEAF, group):
            with contextlib.suppress(FileNotFoundError):
                child.rmdir()
        if controller not in was:
            (root / "cgroup.subtree_control").write_text(f"-{controller}")


def test_a_cgroup_holding_the_runtime_moves_it_into_a_leaf_and_runs_nest_beside(
    parent: tuple[Path, str, subprocess.Popen[bytes]],
) -> None:
    group, controller, sleeper = parent
    # What the kernel says without the leaf: the failure every run met in a pod.
    with pytest.raises(OSError) as refused:
        (group / "cgroup.subtree_control").write_text(f"+{controller}")
    assert refused.value.errno == errno.EBUSY
    enable_for_children(group, {controller})
    assert controller in (group / "cgroup.subtree_control").read_text().split()
    assert str(sleeper.pid) in (group / LEAF / "cgroup.procs").read_text().split()
    assert (group / "cgroup.procs").read_text().split() == []
    (group / "run-x").mkdir()
    assert controller in (group / "run-x" / "cgroup.controllers").read_text().split()
    # Enabled already: a second call moves nothing and changes nothing.
    enable_for_children(group, {controller})
    # The runtime, now in the leaf, nests its next runs beside it, not under it.
    assert runs_parent(group / LEAF) == group
    assert runs_parent(group) == group
