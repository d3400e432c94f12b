"""A home is its directory: a copy opens its own store, a moved one keeps working,
and a store outside the home is named in the errors a person reads.

The attack this holds: ``cp -a`` of a home whose config held the store's absolute
path made every command on the copy append to the original's ledger.
"""

from __future__ import annotations

import json
import shutil
import sqlite3
from pathlib import Path

import pytest

from tests.conftest import run_cli


def _system_size(home: Path) -> int:
    con = sqlite3.connect(home / "proctor.db")
    try:
        (n,) = con.execute("SELECT count(*) FROM ledger_entries WHERE log = 'system'").fetchone()
    finally:
        con.close()
    return int(n)


def _tenants(home: Path) -> set[str]:
    con = sqlite3.connect(home / "proctor.db")
    try:
        return {str(r[0]) for r in con.execute("SELECT name FROM tenants")}
    finally:
        con.close()


def _as_written_before(home: Path) -> None:
    """Rewrite the config as ``init`` wrote it before paths were kept relative."""
    config = json.loads((home / "config.json").read_text())
    config["store"] = f"sqlite:///{home / 'proctor.db'}"
    (home / "config.json").write_text(json.dumps(config))


@pytest.fixture
def original(tmp_path: Path) -> Path:
    home = tmp_path / "original"
    run_cli("init", "--home", str(home))
    run_cli("tenant", "create", "acme", home=home)
    return home


def test_init_keeps_the_store_path_relative(original: Path) -> None:
    config = json.loads((original / "config.json").read_text())
    assert config["store"] == "sqlite:///proctor.db"
    assert str(original) not in (original / "config.json").read_text()


@pytest.mark.parametrize("written", ["relative", "absolute (older homes)"])
def test_a_copied_home_writes_to_its_own_store(
    original: Path, tmp_path: Path, written: str
) -> None:
    if written != "relative":
        _as_written_before(original)
    before = _system_size(original)
    copy = tmp_path / "copy"
    shutil.copytree(original, copy, symlinks=True)  # cp -a

    run_cli("tenant", "create", "globex", home=copy)

    assert _tenants(copy) == {"acme", "globex"}
    assert _tenants(original) == {"acme"}, "the copy wrote to the original's store"
    assert _system_size(original) == before
    assert _system_size(copy) > before
    run_cli("audit", "verify", "-t", "globex", home=copy)
    run_cli("audit", "verify", "-t", "acme", home=original)


@pytest.mark.parametrize("written", ["relative", "absolute (older homes)"])
def test_a_moved_home_keeps_working(original: Path, tmp_path: Path, written: str) -> None:
    if written != "relative":
        _as_written_before(original)
    moved = tmp_path / "elsewhere" / "home"
    moved.parent.mkdir()
    shutil.move(str(original), str(moved))

    run_cli("tenant", "create", "globex", home=moved)

    assert _tenants(moved) == {"acme", "globex"}
    run_cli("audit", "verify", "-t", "acme", home=moved)


def test_a_store_outside_the_home_is_named_in_errors(original: Path, tmp_path: Path) -> None:
    outside = tmp_path / "data" / "ledger.db"
    outside.parent.mkdir()
    shutil.move(str(original / "proctor.db"), str(outside))
    for suffix in ("-wal", "-shm"):
        if (original / f"proctor.db{suffix}").exists():
            shutil.move(str(original / f"proctor.db{suffix}"), str(outside) + suffix)
    config = json.loads((original / "config.json").read_text())
    config["store"] = f"sqlite:///{outside}"
    (original / "config.json").write_text(json.dumps(config))

    ok = run_cli("tenant", "list", home=original)
    assert "acme" in ok.out
    refused = run_cli("tenant", "create", "acme", home=original, check=False)
    assert refused.code != 0
    assert "already" in refused.err
    assert f"this home's store is {outside}, outside the home" in " ".join(refused.err.split())

    outside.rename(outside.with_name("gone.db"))
    missing = run_cli("tenant", "list", home=original, check=False)
    assert missing.code != 0
    assert str(outside) in " ".join(missing.err.split())
