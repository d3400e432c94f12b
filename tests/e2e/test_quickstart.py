"""README.md's quick start, run verbatim as a newcomer would: every ``sh`` block of its
"Quick start" section, in order, in an empty directory with a new PROCTOR_HOME.

A line that needs the network would end in ``# needs the network`` and be left out;
there is none today (the job's third party is a stand-in on loopback).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
from pathlib import Path

import pytest

from tests.conftest import PROCTOR

README = Path(__file__).resolve().parents[2] / "README.md"
NETWORK = "# needs the network"

pytestmark = pytest.mark.sandbox


def quickstart_script() -> str:
    text = README.read_text(encoding="utf-8")
    section = text.split("\n## Quick start\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"^```sh\n(.*?)^```$", section, flags=re.S | re.M)
    assert blocks, "the quick start has no ```sh block"
    lines = [line for block in blocks for line in block.splitlines()]
    return "\n".join(line for line in lines if not line.rstrip().endswith(NETWORK)) + "\n"


def test_the_readme_quick_start_runs_verbatim(tmp_path: Path) -> None:
    script = quickstart_script()
    for needed in ("subprocessor add", "secret set", "bucket add", "egress allow-range",
                   "dataset add", "artifact submit", "approve", "deploy", "run "):  # fmt: skip
        assert f"proctor {needed}" in script, f"the quick start lacks proctor {needed}"
    work = tmp_path / "newcomer"
    work.mkdir()
    env = {
        **os.environ,
        "PATH": f"{Path(PROCTOR).parent}{os.pathsep}{os.environ['PATH']}",
        "PROCTOR_HOME": str(tmp_path / "home"),
        "COLUMNS": "120",
    }
    for key in ("PROCTOR_SERVER", "PROCTOR_TOKEN", "PROCTOR_STORE"):
        env.pop(key, None)
    proc = subprocess.Popen(
        ["bash", "-euo", "pipefail", "-c", script], cwd=work, env=env,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
    )  # fmt: skip
    try:
        out, err = proc.communicate(timeout=300)
    finally:
        # Whatever the script started in the background (its stand-in API) ends with it.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
    text = out.decode(errors="replace") + err.decode(errors="replace")
    assert proc.returncode == 0, f"the quick start failed ({proc.returncode}):\n{text}"
    assert "Traceback" not in text
    assert "customers by country: [['DE', 50], ['FR', 50]]" in text
    # What the job wrote, fetched by the README's own `bucket get`, and the code alice
    # approved read back by `artifact cat`, byte for byte.
    assert json.loads((work / "by-country.json").read_text()) == [["DE", 50], ["FR", 50]]
    assert (work / "approved-main.py").read_bytes() == (work / "my-job" / "main.py").read_bytes()
    for needed in ("bucket get", "artifact cat"):
        assert f"proctor {needed}" in script, f"the quick start lacks proctor {needed}"
    runs = subprocess.run([PROCTOR, "runs", "list", "-t", "acme", "--json"], env=env,
                          capture_output=True, check=True, timeout=60)  # fmt: skip
    (run,) = json.loads(runs.stdout)
    assert run["status"] == "succeeded" and run["environment"] == "production"
