"""Shared fixtures: real SQLite stores, real homes, the real CLI in a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from proctor.ledger import Actor, EventDraft, Ledger, Signer
from proctor.store import Store, open_store

OPERATOR = Actor("operator", "test-operator")
PROCTOR = str(Path(sys.executable).with_name("proctor"))


def draft(i: int = 0, **extra: object) -> EventDraft:
    return EventDraft(OPERATOR, "test.event", f"thing/{i}", details={"i": i, **extra})


@dataclass
class LedgerEnv:
    path: Path
    store: Store
    signer: Signer
    ledger: Ledger

    def reopen(self) -> LedgerEnv:
        self.ledger.close()
        self.store.close()
        store = open_store(str(self.path))
        return LedgerEnv(self.path, store, self.signer, Ledger(store, self.signer, "test.local"))


@pytest.fixture
def ledger_env(tmp_path: Path) -> Iterator[LedgerEnv]:
    path = tmp_path / "proctor.db"
    store = open_store(str(path), create=True)
    signer = Signer.generate("test.local")
    env = LedgerEnv(path, store, signer, Ledger(store, signer, "test.local"))
    yield env
    env.ledger.close()
    env.store.close()


@dataclass
class CliResult:
    code: int
    out: str
    err: str
    raw: bytes


def run_cli(*args: str, home: Path | None = None, check: bool = True) -> CliResult:
    env = dict(os.environ)
    env.pop("PROCTOR_HOME", None)
    if home is not None:
        env["PROCTOR_HOME"] = str(home)
    env["COLUMNS"] = "200"
    proc = subprocess.run([PROCTOR, *args], capture_output=True, env=env, timeout=120)
    res = CliResult(
        proc.returncode, proc.stdout.decode(errors="replace"), proc.stderr.decode(), proc.stdout
    )
    if check and res.code != 0:
        raise AssertionError(f"proctor {' '.join(args)} failed ({res.code}):\n{res.out}{res.err}")
    return res


@pytest.fixture
def home(tmp_path: Path) -> Path:
    h = tmp_path / "home"
    run_cli("init", "--home", str(h))
    return h


def pytest_sessionstart(session: pytest.Session) -> None:
    """On CI both sandbox drivers exist: a run where none works is a broken CI, not a skip."""
    if os.environ.get("CI"):
        from proctor.sandbox import backends

        if not any(b.available for b in backends()):
            reasons = "; ".join(f"{b.name}: {b.reason}" for b in backends())
            pytest.exit(f"no sandbox backend works on this CI machine ({reasons})", returncode=1)
