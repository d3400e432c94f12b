"""The readiness checks one by one, on a real home: what a probe costs (no ledger
event, a real sandbox only when due), a write lock another process holds, the
keys. The failures made for real and the probes answering them:
test_readiness.py."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from proctor.ledger import Signer
from proctor.lifecycle import Health
from proctor.lifecycle._health import LOCK_WAIT, check_keys, check_ledger, check_store
from proctor.runtime import Runtime


@pytest.fixture
def rt(home: Path) -> Iterator[Runtime]:
    runtime = Runtime.open(home)
    try:
        yield runtime
    finally:
        runtime.close()


@pytest.mark.host
def test_a_probe_appends_nothing_and_starts_a_real_sandbox_only_when_due(rt: Runtime) -> None:
    sizes = {log: rt.ledger.head(log).size for log in rt.ledger.logs()}
    health = Health(rt, sandbox_every=3600, witness_every=0, shared_for=0)
    first = {c.name: c for c in health.check().checks}
    assert all(c.ok for c in first.values()), first
    assert "started a real sandbox now" in first["sandbox"].detail
    for _ in range(5):
        again = {c.name: c for c in health.check().checks}
        assert again["sandbox"].ok and "started a real sandbox now" not in again["sandbox"].detail
        assert "preconditions checked; last real start" in again["sandbox"].detail
    # Five probes, five checks of the ledger: not one event in any log.
    assert {log: rt.ledger.head(log).size for log in rt.ledger.logs()} == sizes
    # Every check at every call (doctor): a real start each time.
    doctor = Health(rt, sandbox_every=0, witness_every=0, shared_for=0)
    for _ in range(2):
        sandbox = {c.name: c for c in doctor.check().checks}["sandbox"]
        assert "started a real sandbox now" in sandbox.detail


def test_a_write_lock_held_by_another_process_fails_the_store_check(rt: Runtime) -> None:
    db = rt.home / "proctor.db"
    holder = subprocess.Popen(
        [sys.executable, "-c", (
            "import sqlite3, sys\n"
            f"db = sqlite3.connect({str(db)!r}, isolation_level=None)\n"
            "db.execute('BEGIN IMMEDIATE')\n"
            "print('held', flush=True)\n"
            "sys.stdin.read()\n"
        )],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        store = check_store(rt)
        assert not store.ok, store
        assert f"held the store's write lock for over {LOCK_WAIT:g} s" in (store.reason or "")
        assert "fuser" in (store.fix or "") and any("locked" in n for n in store.notes)
        assert not check_ledger(rt, store).ok
    finally:
        assert holder.stdin is not None
        holder.stdin.close()
        holder.wait(timeout=30)
    assert check_store(rt).ok
    assert check_ledger(rt, check_store(rt)).ok


def test_a_failed_commit_fails_the_ledger_check_until_one_succeeds(rt: Runtime) -> None:
    """The store takes writes again, but the ledger's last batch failed and none has
    committed since: not ready (calls were refused); the next commit clears it."""
    from typing import Any

    from proctor.errors import LedgerError
    from tests.conftest import draft

    def refuse(conn: Any) -> None:
        raise LedgerError("this node lost its lease")

    rt.ledger.set_fence(refuse)
    with pytest.raises(LedgerError):
        rt.ledger.append("system", draft(1))
    rt.ledger.set_fence(None)
    store = check_store(rt)
    assert store.ok
    ledger = check_ledger(rt, store)
    assert not ledger.ok and "last commit failed" in (ledger.reason or "")
    assert ledger.notes == ("this node lost its lease",)
    rt.ledger.append("system", draft(2))
    assert check_ledger(rt, check_store(rt)).ok
    rt.ledger.close()
    closed = check_ledger(rt, check_store(rt))
    assert not closed.ok and "closed" in (closed.reason or "")


def test_the_keys_check_finds_a_key_others_read_a_foreign_key_and_a_missing_one(
    rt: Runtime, tmp_path: Path
) -> None:
    keys = rt.home / "keys"
    assert check_keys(rt).ok
    (keys / "runtime.key").chmod(0o644)
    found = check_keys(rt)
    assert (
        not found.ok and "other users" in (found.reason or "") and "chmod 600" in (found.fix or "")
    )
    (keys / "runtime.key").chmod(0o600)
    assert check_keys(rt).ok

    own = keys / "ledger.pem"
    shutil.copy2(own, tmp_path / "ledger.pem")
    own.unlink()
    Signer.generate(rt.config.trust_domain).save(own)  # another home's key, 0600
    found = check_keys(rt)
    assert not found.ok and "not the one this ledger signs with" in (found.reason or "")
    own.unlink()
    found = check_keys(rt)
    assert not found.ok and "cannot be read" in (found.reason or "")
    assert any("ledger.pem" in n for n in found.notes)  # named to the operator only
    assert str(rt.home) not in (found.reason or "") + (found.fix or "")
    shutil.copy2(tmp_path / "ledger.pem", own)
    os.chmod(own, 0o600)
    assert check_keys(rt).ok
