"""``proctor sandbox run`` as a user runs it, on every backend that works here."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.conftest import run_cli
from tests.sandbox_conftest_helpers import BACKENDS, any_backend


def _events(home: Path) -> list[dict[str, object]]:
    raw = run_cli("audit", "events", "-t", "sandbox", "--jsonl", home=home).raw
    return [json.loads(line) for line in raw.splitlines()]


@pytest.mark.sandbox
@pytest.mark.parametrize("backend", BACKENDS)
def test_run_streams_output_returns_exit_code_and_is_recorded(
    home: Path, tmp_path: Path, backend: str
) -> None:
    code = tmp_path / "code"
    code.mkdir()
    code.chmod(0o755)
    (code / "main.py").write_text("import sys\nprint('hello from', sys.argv[1])\nsys.exit(7)\n")
    (code / "main.py").chmod(0o644)
    res = run_cli(
        "sandbox",
        "run",
        "--backend",
        backend,
        "--dir",
        str(code),
        "--",
        "python3",
        "main.py",
        "the guest",
        home=home,
        check=False,
    )
    assert res.code == 7
    assert res.out == "hello from the guest\n"
    events = _events(home)
    assert [e["action"] for e in events] == ["tenant.create", "sandbox.run", "sandbox.run"]
    start, end = events[1], events[2]
    assert start["reason"] == "started" and end["reason"] == "exit"
    details = end["details"]
    assert isinstance(details, dict)
    assert details["backend"] == backend
    assert details["exit_code"] == 7
    assert str(details["code"]).startswith("sha256:")
    assert details["limits"]["memory_bytes"] == 256 * 1024 * 1024
    if backend == "gvisor":
        assert details["platform"] in ("ptrace", "systrap", "kvm")
    assert "the guest" not in json.dumps(events), "arguments are digested, not logged"
    run_cli("audit", "verify", "-t", "sandbox", home=home)


@pytest.mark.sandbox
@pytest.mark.parametrize("backend", BACKENDS)
def test_limits_end_the_run_with_a_reason(home: Path, backend: str) -> None:
    res = run_cli(
        "sandbox",
        "run",
        "--backend",
        backend,
        "--timeout",
        "1s",
        "--",
        "python3",
        "-c",
        "while True: pass",
        home=home,
        check=False,
    )
    assert res.code != 0
    assert "stopped by timeout" in res.err
    assert _events(home)[-1]["reason"] == "timeout"


def test_bad_limits_are_refused_before_anything_runs(home: Path) -> None:
    for args, message in [
        (("--memory", "lots"), "not a size"),
        (("--timeout", "soon"), "not a duration"),
        (("--backend", "docker"), "unknown sandbox backend"),
        (("--env", "NOEQUALS"), "not KEY=VALUE"),
    ]:
        res = run_cli("sandbox", "run", *args, "--", "true", home=home, check=False)
        assert res.code == 2, res.err
        assert message in res.err
    assert run_cli("tenant", "list", home=home).out.count("sandbox") == 0


@pytest.mark.host
def test_backends_lists_both_drivers(home: Path) -> None:
    out = run_cli("sandbox", "backends").out
    assert "gvisor" in out and "bubblewrap" in out


@pytest.mark.sandbox
def test_nothing_runs_when_the_ledger_cannot_record(tmp_path: Path) -> None:
    """Fail closed: with the home's disk full, the start event cannot be made durable,
    so the program never starts."""
    any_backend()
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt)]).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        home = mnt / "home"
        run_cli("init", "--home", str(home))
        run_cli("tenant", "create", "sandbox", home=home)
        fill = mnt / "fill"
        # Unbuffered: a buffered file would try again to write what did not fit when it
        # is closed, and fail there (it did once the store's size left a partial block).
        with fill.open("wb", buffering=0) as f:
            try:
                while True:
                    f.write(b"\0" * 65536)
                    f.flush()
            except OSError:
                pass
        res = run_cli(
            "sandbox", "run", "--", "python3", "-c", "print('RAN')", home=home, check=False
        )
        assert res.code != 0
        assert "RAN" not in res.out
        # Depending on where the disk ran out: the start event, or the store itself.
        assert any(w in res.err for w in ("durably", "cannot write", "disk I/O error"))
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)
