"""On CI a backend the machine is built with cannot quietly skip: it fails."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.sandbox_conftest_helpers import unavailable

ROOT = Path(__file__).resolve().parents[2]


def test_a_missing_backend_fails_on_ci(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CI", "1")
    with pytest.raises(pytest.fail.Exception, match=r"runsc is needed on CI .*: broken here"):
        unavailable("runsc", "broken here")


def test_a_missing_backend_skips_elsewhere(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match="runsc does not work here: broken here"):
        unavailable("runsc", "broken here")


def test_the_ci_entry_point_sets_ci() -> None:
    # Run up to the line before `make test`: what it exports is what the suite sees.
    script = (ROOT / ".ci" / "run").read_text().replace("make test", "echo CI=$CI")
    out = subprocess.run(["bash", "-c", script, str(ROOT / ".ci" / "run")], env={"PATH": "/usr/bin:/bin"},
                         capture_output=True, text=True, check=True).stdout  # fmt: skip
    assert out.strip() == "CI=1"
