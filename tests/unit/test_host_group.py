"""The host guard (tests/host_group.py) fails a test that touches the host unmarked.

The two-process split of ``make test`` is only safe while every test that starts a
sandbox, mounts or makes a namespace carries the ``host`` mark; the guard is what
keeps that true as tests are added. Here it is tried on a small suite of its own,
in a pytest subprocess: an unmarked test starting a host tool in its own process,
one whose child process starts one through a shell, and a marked one.
"""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

SUITE = """
import subprocess

import pytest


def test_unmarked_in_this_process():
    subprocess.run(["unshare", "--help"], capture_output=True)


def test_unmarked_in_a_child():
    subprocess.run(["sh", "-c", "mount --version"], capture_output=True)


@pytest.mark.host
def test_marked():
    subprocess.run(["unshare", "--help"], capture_output=True, check=True)
"""


# It starts host tools itself (in the inner suite's marked test): a host test.
@pytest.mark.host
def test_an_unmarked_test_that_starts_a_host_tool_fails_and_says_why(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    pytester.makepyfile(test_inner=SUITE)
    res = pytester.runpytest_subprocess("-p", "tests.host_group", "-p", "no:cacheprovider")
    # In this process: refused where it happens, and named again at the test's end
    # (the code under test may have caught it). In a child: the body passes, the
    # stand-in's line fails the test's end.
    res.assert_outcomes(passed=2, failed=1, errors=2)
    out = res.stdout.str()
    assert "unshare started by a test not marked host" in out
    assert "a host tool started in a child process" in out and ": mount --version" in out
