"""``proctor backup`` and ``restore`` of a home whose store is a real PostgreSQL.

The backup is pg_dump of a snapshot the backup holds open while it reads the
ledger's heads and copies the ledger's tables (for ``backup verify`` without a
server), taken while a writer appends for the whole of it. The restore goes into
a new, empty database only: the original's database (not empty) is refused, so a
restored home can never write to it.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import sqlite3
import threading
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from proctor.ledger import EventDraft
from proctor.runtime import Runtime
from tests.conftest import OPERATOR, run_cli

pytestmark = pytest.mark.postgres
_numbers = itertools.count()


@pytest.fixture
def new_db(pg_server: object) -> Iterator[str]:
    from proctor.testing import PostgresServer

    assert isinstance(pg_server, PostgresServer)
    name = f"proctor_restore_{os.getpid()}_{next(_numbers)}"
    yield pg_server.create_database(name)
    pg_server.drop_database(name)


def _events(dsn: str) -> list[bytes]:
    with psycopg.connect(dsn) as db:
        return [bytes(r[0]) for r in db.execute(
            "SELECT data FROM ledger_entries WHERE log = 'acme' ORDER BY seq")]  # fmt: skip


def _size(dsn: str) -> int:
    with psycopg.connect(dsn) as db:
        row = db.execute("SELECT size FROM ledger_logs WHERE log = 'acme'").fetchone()
    assert row is not None
    return int(row[0])


def test_a_postgresql_home_backed_up_under_load_and_restored(
    pg_dsn: str, new_db: str, tmp_path: Path
) -> None:
    home = tmp_path / "home"
    run_cli("init", "--home", str(home), "--store", pg_dsn)
    rt = Runtime.open(home)
    try:
        rt.tenants.create("acme", OPERATOR)
        vkey = rt.ledger.vkey()
    finally:
        rt.close()
    stop = threading.Event()
    appended = [0]
    errors: list[BaseException] = []

    def write() -> None:
        w = Runtime.open(home)
        try:
            while not stop.is_set():
                w.ledger.append("acme", EventDraft(OPERATOR, "test.load", f"t/{appended[0]}"))
                appended[0] += 1
        except BaseException as exc:
            errors.append(exc)
        finally:
            w.close()

    thread = threading.Thread(target=write)
    thread.start()
    try:
        while appended[0] < 10:
            threading.Event().wait(0.01)
        before = appended[0]
        backup = tmp_path / "backup"
        got = run_cli("backup", "-o", str(backup), "--json", home=home)
        after = appended[0]
    finally:
        stop.set()
        thread.join(timeout=60)
    assert not errors, errors
    assert after > before
    doc = json.loads(got.out)
    assert doc["engine"] == "postgresql"
    size = doc["logs"]["acme"]["size"]
    assert before <= size <= after + 2
    assert (backup / "store" / "proctor.pgdump").is_file()
    run_cli("backup", "verify", str(backup), "--key", vkey)

    # Refused: no database given, and the original's (it holds a store): left as it was.
    original = _events(pg_dsn)
    missing = run_cli("restore", str(backup), "--home", str(tmp_path / "r0"), check=False)
    assert missing.code == 2 and "--store" in missing.err
    onto = run_cli("restore", str(backup), "--home", str(tmp_path / "r1"), "--store", pg_dsn,
                   check=False)  # fmt: skip
    assert onto.code == 2 and "not empty" in onto.err.splitlines()[0], onto.err
    assert not (tmp_path / "r0").exists() and not (tmp_path / "r1").exists()
    assert _events(pg_dsn) == original and _size(pg_dsn) == len(original)

    restored = tmp_path / "restored"
    run_cli("restore", str(backup), "--home", str(restored), "--store", new_db, "--key", vkey)
    assert json.loads((restored / "config.json").read_text())["store"] == new_db
    ok = run_cli("audit", "verify", "-t", "acme", "--json", home=restored)
    assert json.loads(ok.out)["size"] == size
    assert _events(new_db) == _events(pg_dsn)[:size]
    original = _size(pg_dsn)
    r = Runtime.open(restored)
    try:
        for i in range(3):
            r.ledger.append("acme", EventDraft(OPERATOR, "test.restored", f"after/{i}"))
    finally:
        r.close()
    note = backup / "checkpoints" / "acme.note"
    run_cli("audit", "verify", "-t", "acme", "--checkpoint", str(note), home=restored)
    assert _size(new_db) == size + 3
    assert _size(pg_dsn) == original
    assert not any(b"test.restored" in e for e in _events(pg_dsn))


def test_a_row_of_the_ledger_copy_is_caught(pg_dsn: str, tmp_path: Path) -> None:
    home = tmp_path / "home"
    # A password in the URL (the test server trusts loopback and ignores it): pg_dump
    # gets it from its environment, and no output shows it.
    run_cli("init", "--home", str(home), "--store", pg_dsn.replace("@", ":s3cret-pw@", 1))
    rt = Runtime.open(home)
    try:
        rt.tenants.create("acme", OPERATOR)
        for i in range(5):
            rt.ledger.append("acme", EventDraft(OPERATOR, "test.x", f"thing/{i}"))
    finally:
        rt.close()
    backup = tmp_path / "backup"
    made = run_cli("backup", "-o", str(backup), "--json", home=home)
    assert "s3cret-pw" not in made.out + made.err
    b = tmp_path / "b"
    shutil.copytree(backup, b)
    con = sqlite3.connect(b / "store" / "ledger.db")
    with con:
        con.execute("UPDATE ledger_entries SET data = CAST(replace(CAST(data AS TEXT),"
                    " 'thing/2', 'thing/9') AS BLOB) WHERE log = 'acme'")  # fmt: skip
    con.close()
    got = run_cli("backup", "verify", str(b), check=False)
    assert got.code == 3 and "store/ledger.db" in got.err.splitlines()[0], got.err
    b2 = tmp_path / "b2"
    shutil.copytree(backup, b2)
    dump = b2 / "store" / "proctor.pgdump"
    data = bytearray(dump.read_bytes())
    data[len(data) // 2] ^= 0xFF
    dump.write_bytes(bytes(data))
    got = run_cli("backup", "verify", str(b2), check=False)
    assert got.code == 3 and "store/proctor.pgdump" in got.err.splitlines()[0], got.err


def test_the_password_goes_to_the_tools_environment_not_their_command_line() -> None:
    from proctor.store._copy import _without_password

    bare, env = _without_password("postgresql://proctor:s3cret@127.0.0.1:5432/db?sslmode=disable")
    assert "s3cret" not in bare and env["PGPASSWORD"] == "s3cret"
    assert "host=127.0.0.1" in bare and "dbname=db" in bare and "sslmode=disable" in bare
