"""Each limit stops a hostile guest with the right reason, and leaves nothing behind."""

from __future__ import annotations

import time

import pytest

from proctor.sandbox import Limits, Reason
from proctor.sandbox._model import MiB
from tests.sandbox_conftest_helpers import BACKENDS, driver_or_skip, no_leftovers, run_code

pytestmark = pytest.mark.usefixtures("no_leftovers")
_ = no_leftovers

FORK_BOMB = """
import os
while True:
    try:
        os.fork()
    except OSError:
        pass
"""

MEMORY_BOMB = """
hoard = []
while True:
    hoard.append(bytearray(8 * 1024 * 1024))
"""

DISK_FILL = """
import errno, os
written = 0
try:
    with open(os.environ["TMPDIR"] + "/fill", "wb") as f:
        while True:
            f.write(b"x" * 65536)
            f.flush()
            written += 65536
except OSError as exc:
    assert exc.errno == errno.ENOSPC, exc
    print("ENOSPC after", written)
"""

HUGE_PRINT = """
import sys
chunk = "x" * (1 << 20)
for _ in range(1024):  # 1 GiB
    sys.stdout.write(chunk)
"""


@pytest.mark.parametrize("backend", BACKENDS)
def test_fork_bomb_ends_with_pids(backend: str) -> None:
    driver = driver_or_skip(backend)
    started = time.monotonic()
    run = run_code(
        driver, FORK_BOMB, limits=Limits(pids=32, memory_bytes=1024 * MiB, wall_seconds=20)
    )
    assert run.result.reason is Reason.PIDS
    # Stopped by the ceiling, not by the wall clock: the host stayed responsive.
    assert time.monotonic() - started < 15


@pytest.mark.parametrize("backend", BACKENDS)
def test_memory_bomb_ends_with_oom(backend: str) -> None:
    driver = driver_or_skip(backend)
    run = run_code(driver, MEMORY_BOMB, limits=Limits(memory_bytes=64 * MiB, wall_seconds=20))
    assert run.result.reason is Reason.OOM
    assert run.result.exit_code != 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_filling_scratch_gets_enospc_and_ends_cleanly(backend: str) -> None:
    driver = driver_or_skip(backend)
    run = run_code(driver, DISK_FILL, scratch_bytes=4 * MiB)
    assert run.result.reason is Reason.EXIT, run.stderr
    assert run.result.exit_code == 0, run.stderr
    written = int(run.stdout.split()[-1])
    assert 0 < written <= 4 * MiB


@pytest.mark.parametrize("backend", BACKENDS)
def test_infinite_loop_ends_with_timeout(backend: str) -> None:
    driver = driver_or_skip(backend)
    run = run_code(driver, "while True: pass", limits=Limits(wall_seconds=1.0))
    assert run.result.reason is Reason.TIMEOUT
    assert 1.0 <= run.result.duration_seconds < 4.0


@pytest.mark.parametrize("backend", BACKENDS)
def test_gigabyte_print_ends_with_output(backend: str) -> None:
    driver = driver_or_skip(backend)
    cap = 1 * MiB
    run = run_code(driver, HUGE_PRINT, limits=Limits(output_bytes=cap, wall_seconds=30))
    assert run.result.reason is Reason.OUTPUT
    assert len(run.stdout) == cap == run.result.stdout_bytes
    assert run.result.truncated
    assert run.result.duration_seconds < 10


@pytest.mark.parametrize("backend", BACKENDS)
def test_daemonised_child_does_not_outlive_the_run(backend: str) -> None:
    driver = driver_or_skip(backend)
    code = "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(60)\n"
    run = run_code(driver, code, limits=Limits(wall_seconds=10))
    assert run.result.reason is Reason.EXIT
    assert run.result.duration_seconds < 5  # no waiting for the orphan
