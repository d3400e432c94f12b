"""A newcomer's command line (issue 33, items 2, 4, 5, 10 and 13), through the real CLI
in a subprocess, each as a person meets it:

- ``make demo``/``make setup`` leave a ``proctor`` on PATH (as root), and the demo's
  closing hint names the command the README's quick start uses (item 2);
- a missing ``--from-export`` directory is named as such, not "the Proctor home may
  be damaged"; a demo whose sandbox could not start stops there with the reason (4);
- a usage error (a value out of range, an unknown option, a missing option or
  argument) is one ``error:`` line and a hint, exit 2, never a boxed panel (5);
- durations take days, and a bad one says so among its examples (10).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.conftest import PROCTOR, CliResult, run_cli


def _one_error(res: CliResult) -> list[str]:
    """stderr's lines, after checking it is one ``error:`` line and at most a hint."""
    lines = res.err.splitlines()
    assert lines and lines[0].startswith("error: "), res.err
    assert all(line.startswith("hint: ") for line in lines[1:2]) and len(lines) <= 2, res.err
    assert "Traceback" not in res.err and res.out == "", (res.out, res.err)
    return lines


# -- item 10: days --------------------------------------------------------------------


def test_a_duration_takes_days_and_a_bad_one_names_them(home: Path) -> None:
    bad = run_cli("approve", "sha256:00", "-t", "acme", "--expires", "30x", check=False)
    assert bad.code == 2
    line = _one_error(bad)[0]
    assert "'30x' is not a duration" in line and "30d" in line, line

    run_cli("tenant", "create", "acme", home=home)
    ok = run_cli("history", "-t", "acme", "--at", "now", "--window", "30d", "--json", home=home)
    assert ok.code == 0 and '"runs"' in ok.out, ok
    bad = run_cli("history", "-t", "acme", "--at", "now", "--window", "2w", home=home, check=False)
    assert bad.code == 2 and "30d" in _one_error(bad)[0], bad.err


# -- item 5: usage errors -------------------------------------------------------------


def test_a_usage_error_is_one_error_line_and_a_hint_not_a_panel() -> None:
    cases = {
        ("audit", "events", "-t", "acme", "--limit", "0"): "invalid value for '--limit': 0",
        ("runs", "list", "--no-such-option"): "no such option: --no-such-option",
        ("audit", "export", "-t", "acme"): "missing option '--out' / '-o'",
        ("artifact", "diff", "sha256:00"): "missing argument 'new'",
        ("no-such-command",): "no such command 'no-such-command'",
    }
    for args, said in cases.items():
        res = run_cli(*args, check=False)
        assert res.code == 2, (args, res)
        error, hint = _one_error(res)
        assert error == f"error: {said}" or error.startswith(f"error: {said} "), (args, error)
        # The hint is the usage line and where the rest is, on one line.
        assert hint.startswith("hint: usage: proctor ") and "--help" in hint, (args, hint)
        assert not any(c in res.err for c in "╭╰│─"), res.err
    # A bare group still shows its help, and nothing on stderr.
    res = run_cli("audit", check=False)
    assert res.code == 2 and "Commands" in res.out and res.err == "", res


# -- item 4: no "the Proctor home may be damaged" when the home is not the matter ----


def test_a_missing_export_directory_is_named_not_the_home(home: Path, tmp_path: Path) -> None:
    nope = tmp_path / "nope"
    res = run_cli("audit", "verify", "--from-export", str(nope), home=home, check=False)
    assert res.code != 0
    error = _one_error(res)[0]
    assert error == f"error: {nope} does not exist (looking for {nope}/verifier.key)", error
    assert "damaged" not in res.err and "internal error" not in res.err, res.err
    # A directory that exists but holds no export says so, not "no such file".
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    res = run_cli("audit", "verify", "--from-export", str(elsewhere), home=home, check=False)
    assert res.code == 2
    error = _one_error(res)[0]
    assert error == f"error: {elsewhere} is not an export of a Proctor log (it has no checkpoint)"


@pytest.mark.host
def test_the_demo_stops_at_a_sandbox_that_could_not_start(tmp_path: Path) -> None:
    from proctor.sandbox import get_driver

    if not get_driver("gvisor").status().available:
        pytest.skip("gVisor does not work here: the demo would use another backend")
    demo = tmp_path / "home"
    # An unknown gVisor platform: runsc refuses to start, as a broken runsc does.
    env = {**os.environ, "PROCTOR_GVISOR_PLATFORM": "no-such-platform", "COLUMNS": "200"}
    env.pop("PROCTOR_HOME", None)
    res = subprocess.run([PROCTOR, "demo", "--home", str(demo)], capture_output=True,
                         env=env, timeout=600, text=True)  # fmt: skip
    assert res.returncode == 1, res
    lines = res.stderr.splitlines()
    assert len(lines) == 2, res.stderr
    error, hint = lines
    assert error.startswith("error: the demo stops: run r-") and " failed: " in error, error
    assert "gVisor could not start the sandbox: unknown platform: no-such-platform" in error
    assert "damaged" not in res.stderr
    assert hint.startswith("hint: ") and "proctor sandbox backends" in hint, hint
    # It stopped at the sandbox step: no production step after it.
    assert "3. the build loop" in res.stdout and "4. production" not in res.stdout, res.stdout
    # The run the hint names holds the same reason.
    run_id = error.split("run ", 1)[1].split(" ", 1)[0]
    assert f"proctor runs show {run_id} -t acme --logs --home {demo}" in hint
    shown = run_cli("runs", "show", run_id, "-t", "acme", "--json", home=demo)
    assert "unknown platform: no-such-platform" in shown.out


# -- item 2: `proctor` on PATH, as the README and the demo write it --------------------

ROOT = Path(__file__).resolve().parents[2]
VENV_BIN = Path(PROCTOR).resolve().parent
SYSTEM_PATH = "/usr/sbin:/usr/bin:/sbin:/bin"


def _link(bin_dir: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PROCTOR_BIN_DIR": str(bin_dir)}
    return subprocess.run([ROOT / "scripts" / "link-proctor.sh"], env=env, capture_output=True,
                          text=True, timeout=60, check=True)  # fmt: skip


def test_setup_puts_proctor_on_path_and_the_readme_says_so(tmp_path: Path) -> None:
    # make demo and make test run make setup, which runs scripts/setup.sh, which links.
    makefile = (ROOT / "Makefile").read_text()
    assert "\ndemo: setup\n" in makefile and "\ntest: setup " in makefile
    assert "\nscripts/link-proctor.sh\n" in (ROOT / "scripts" / "setup.sh").read_text()

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    made = _link(bin_dir)
    link = bin_dir / "proctor"
    assert link.is_symlink() and link.resolve() == Path(PROCTOR).resolve(), made
    found = subprocess.run(["proctor", "--version"], env={**os.environ, "PATH": f"{bin_dir}:{SYSTEM_PATH}"},
                           capture_output=True, text=True, timeout=60, check=True)  # fmt: skip
    from proctor import __version__

    assert found.stdout.strip() == __version__
    again = _link(bin_dir)  # idempotent and quiet when it is there already
    assert again.stdout == again.stderr == "" and link.resolve() == Path(PROCTOR).resolve()
    # Another proctor (not a link a setup made) is left alone, and said so.
    link.unlink()
    link.write_text("#!/bin/sh\necho mine\n")
    kept = _link(bin_dir)
    assert link.read_text() == "#!/bin/sh\necho mine\n" and "left alone" in kept.stderr
    # Where it cannot link (not root: the directory is not writable), it says how, and
    # the README's quick start says the same line.
    told = _link(tmp_path / "no-such-dir")
    export = f'export PATH="{ROOT}/.venv/bin:$PATH"'
    assert export in told.stderr, told.stderr
    quick = (ROOT / "README.md").read_text().split("## Quick start", 1)[1].split("\n## ", 1)[0]
    assert "/usr/local/bin/proctor" in quick and 'export PATH="$PWD/.venv/bin:$PATH"' in quick
    assert "\nproctor init\n" in quick  # the first job runs bare `proctor`


def _demo_hint(tmp_path: Path, name: str, path: str) -> list[str]:
    env = {**os.environ, "PATH": path, "COLUMNS": "200"}
    env.pop("PROCTOR_HOME", None)
    res = subprocess.run([PROCTOR, "demo", "--home", str(tmp_path / name / "home")],
                         capture_output=True, text=True, env=env, timeout=600)  # fmt: skip
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("The home is kept at"))
    return [line.strip() for line in lines[at + 2 :]]


@pytest.mark.host
def test_the_demo_closing_hint_runs_proctor_as_the_readme_does(tmp_path: Path) -> None:
    commands = (
        "proctor audit events -t acme; proctor runs list -t acme; proctor history -t acme --at now"
    )
    # With the link setup makes on PATH: bare `proctor`, as the README's first job.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _link(bin_dir)
    assert _demo_hint(tmp_path, "linked", f"{bin_dir}:{SYSTEM_PATH}") == [commands]
    # Without one, first the line that puts it there.
    assert _demo_hint(tmp_path, "unlinked", SYSTEM_PATH) == [
        f"export PATH={VENV_BIN}:$PATH",
        commands,
    ]
