"""A restored home among real sandboxes and a real witness.

A real job runs in the original while the backup is taken; the restored home
records that run interrupted (its owner is gone), runs the next job for real, and
verifies from the backup's checkpoint on, while the original never sees it. A real
``witness serve`` cosigns the live log after the backup: the restored home's
``audit verify --witness`` fails, naming how many entries it is behind the newest
cosigned checkpoint, whether it grew since or not.
"""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
from pathlib import Path

import pytest

from proctor.ledger import EventDraft
from proctor.runtime import Runtime
from proctor.witness import TenantWitnesses
from tests.conftest import OPERATOR, PROCTOR, copy_home, run_cli, wait_until
from tests.integration.test_witness import (  # noqa: F401  (the fixture)
    Witnesses,
    witnesses,
)

# Sandboxes, network namespaces and veth pairs (tests/host_group.py).
pytestmark = pytest.mark.host


def _query(home: Path, sql: str) -> list[tuple[object, ...]]:
    con = sqlite3.connect(home / "proctor.db")
    try:
        return con.execute(sql).fetchall()
    finally:
        con.close()


def test_a_job_runs_through_the_backup_and_the_restored_home_runs_the_next(
    demo_home: Path, tmp_path: Path
) -> None:
    home = copy_home(demo_home, tmp_path / "home")
    env_home = {"PROCTOR_HOME": str(home)}

    job = subprocess.Popen(
        [PROCTOR, "run", "churn-sandbox", "-t", "acme", "--json"],
        env={**os.environ, **env_home}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    try:
        wait_until(lambda: _query(home, "SELECT id FROM runs WHERE status = 'running'"),
                   "the job to start", timeout=60)  # fmt: skip
        backup = tmp_path / "backup"
        run_cli("backup", "-o", str(backup), home=home)
        # Restored while the original's job may still run: the restore closes the
        # run in the new home and leaves the original's sandbox alone.
        restored = tmp_path / "restored"
        run_cli("restore", str(backup), "--home", str(restored))
    finally:
        out, err = job.communicate(timeout=120)
    assert job.returncode == 0, err
    assert json.loads(out)["status"] == "succeeded"
    ran = json.loads(out)["id"]
    m = json.loads((backup / "manifest.json").read_text())
    size = m["logs"]["acme"]["size"]
    # The backup caught the job in the middle: its start, not its end.
    events = [json.loads(e) for (e,) in _query(home, "SELECT data FROM ledger_entries WHERE "
                                                     "log = 'acme' ORDER BY seq")]  # fmt: skip
    mine = [i for i, e in enumerate(events) if e.get("run") == ran]
    assert mine[0] < size <= mine[-1], (mine[0], size, mine[-1])
    run_cli("backup", "verify", str(backup))
    original = _query(home, "SELECT size FROM ledger_logs WHERE log = 'acme'")
    # The next job, for real, in the restored home.
    got = run_cli("run", "churn-sandbox", "-t", "acme", "--json", home=restored)
    rec = json.loads(got.out)
    assert rec["status"] == "succeeded" and rec["exit_code"] == 0
    # The job the backup caught running is interrupted there, by the restore itself
    # (its sandbox is the original's, and was left alone) ...
    status = _query(restored, f"SELECT status, reason FROM runs WHERE id = '{ran}'")
    assert status == [("interrupted", "restored from a backup taken while it ran")]
    # ... and the log verifies on from the backup's checkpoint.
    note = backup / "checkpoints" / "acme.note"
    run_cli("audit", "verify", "-t", "acme", "--checkpoint", str(note), home=restored)
    assert (restored / "runs" / rec["id"] / "stdout.log").is_file()
    # The original: untouched by the restored home, its own run succeeded there.
    assert _query(home, "SELECT size FROM ledger_logs WHERE log = 'acme'") == original
    assert _query(home, f"SELECT status FROM runs WHERE id = '{ran}'") == [("succeeded",)]
    assert not _query(home, f"SELECT id FROM runs WHERE id = '{rec['id']}'")
    run_cli("audit", "verify", "-t", "acme", home=home)


def _append(home: Path, n: int, what: str = "call") -> int:
    rt = Runtime.open(home)
    try:
        for i in range(n):
            rt.ledger.append("acme", EventDraft(OPERATOR, f"test.{what}", f"thing/{i}"))
        return rt.ledger.head("acme").size
    finally:
        rt.close()


def _submit(home: Path) -> list[tuple[bool, int | None]]:
    rt = Runtime.open(home)
    try:
        return [(s.ok, s.status) for s in TenantWitnesses(rt.store, rt.ledger).submit("acme")]
    finally:
        rt.close()


def test_a_restored_home_is_reported_behind_the_witness(
    home: Path,
    witnesses: Witnesses,  # noqa: F811
    tmp_path: Path,
) -> None:
    rt = Runtime.open(home)
    try:
        rt.tenants.create("acme", OPERATOR)
        w = witnesses.new(tmp_path / "w1", "witness.test/bk1",
                          [(rt.ledger.origin("acme"), rt.ledger.vkey())])  # fmt: skip
        TenantWitnesses(rt.store, rt.ledger).use("acme", "w1", w.vkey, w.url, OPERATOR)
    finally:
        rt.close()
    _append(home, 5)
    assert _submit(home) == [(True, 200)]
    backup = tmp_path / "backup"
    run_cli("backup", "-o", str(backup), home=home)
    n = json.loads((backup / "manifest.json").read_text())["logs"]["acme"]["size"]
    # The live log goes on and is cosigned after the backup.
    m = _append(home, 4)
    assert _submit(home) == [(True, 200)]
    assert w.show()["logs"][0]["size"] == m  # type: ignore[index]
    policy = ("--witness", w.vkey)
    assert run_cli("audit", "verify", "-t", "acme", *policy, home=home).code == 0

    restored = tmp_path / "restored"
    run_cli("restore", str(backup), "--home", str(restored))
    # Plain verification passes: the restored log is sound, as far as it goes ...
    run_cli("audit", "verify", "-t", "acme", home=restored)
    # ... and asking the witness says how far it does not go.
    got = run_cli("audit", "verify", "-t", "acme", *policy, home=restored, check=False)
    assert got.code == 3, got.err
    first = got.err.splitlines()[0]
    assert f"has size {m} but the log holds only {n} events" in first, first
    assert f"{m - n} entries behind the newest cosigned checkpoint (size {m})" in first, first
    # Grown past what the witness cosigned, it is still behind, and said so.
    assert _append(restored, m - n + 2, "restored") > m
    got = run_cli("audit", "verify", "-t", "acme", *policy, home=restored, check=False)
    assert got.code == 3, got.err
    first = got.err.splitlines()[0]
    assert "does not extend" in first and f"{m - n} entries behind" in first, first
    # The witness refuses the restored home's history; the original is still its log.
    assert [ok for ok, _ in _submit(restored)] == [False]
    assert run_cli("audit", "verify", "-t", "acme", *policy, home=home).code == 0
