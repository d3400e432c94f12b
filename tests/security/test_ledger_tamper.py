"""Tampering with a stored or exported log must make verification fail, naming where.

SQLite only: it edits the database file with sqlite3. The same attacks on a
PostgreSQL store are in test_pg_ledger_tamper.py.
"""

from __future__ import annotations

import shutil
import sqlite3
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from proctor.errors import VerificationFailed
from proctor.ledger import Ledger, Signer, verify_export
from proctor.store import open_store
from tests.conftest import draft

N = 120
SIGNER = Signer.generate("test.local")
_SETTINGS = {"deadline": None, "suppress_health_check": [HealthCheck.function_scoped_fixture]}


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("pristine") / "p.db"
    store = open_store(str(path), create=True)
    ledger = Ledger(store, SIGNER, "test.local")
    ledger.create_log("acme", draft(0))
    for i in range(1, N):
        ledger.append("acme", draft(i, note="x" * (i % 7)))
        if i == 49:
            # What an operator could roll the store back to: the log as it was at 50.
            live, snap = sqlite3.connect(path), sqlite3.connect(path.parent / "at50.db")
            live.backup(snap)
            live.close()
            snap.close()
    ledger.export("acme", path.parent / "export")
    ledger.close()
    store.close()  # checkpoints the WAL into the main file
    return path


def _verify(path: Path, trusted: tuple[str, ...] = ()) -> None:
    store = open_store(str(path))
    ledger = Ledger(store, SIGNER, "test.local")
    try:
        ledger.verify("acme", trusted)
    finally:
        ledger.close()
        store.close()


def _copy(pristine: Path, tmp: Path) -> Path:
    dst = tmp / "p.db"
    shutil.copy(pristine, dst)
    return dst


def _mutate(path: Path, sql: str, params: tuple[object, ...] = ()) -> None:
    db = sqlite3.connect(path)
    with db:
        db.execute(sql, params)
    db.close()


def test_pristine_copy_verifies(pristine: Path, tmp_path: Path) -> None:
    _verify(_copy(pristine, tmp_path))


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(seq=st.integers(0, N - 1), pos=st.integers(0, 10_000), bit=st.integers(0, 7))
def test_flipping_any_bit_of_any_event_fails(
    pristine: Path, tmp_path_factory: pytest.TempPathFactory, seq: int, pos: int, bit: int
) -> None:
    path = _copy(pristine, tmp_path_factory.mktemp("flip"))
    db = sqlite3.connect(path)
    (data,) = db.execute(
        "SELECT data FROM ledger_entries WHERE log='acme' AND seq=?", (seq,)
    ).fetchone()
    data = bytearray(data)
    data[pos % len(data)] ^= 1 << bit
    with db:
        db.execute(
            "UPDATE ledger_entries SET data=? WHERE log='acme' AND seq=?", (bytes(data), seq)
        )
    db.close()
    with pytest.raises(VerificationFailed, match=rf"seq {seq}\b"):
        _verify(path)


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(seq=st.integers(0, N - 1))
def test_deleting_any_row_fails(
    pristine: Path, tmp_path_factory: pytest.TempPathFactory, seq: int
) -> None:
    path = _copy(pristine, tmp_path_factory.mktemp("del"))
    _mutate(path, "DELETE FROM ledger_entries WHERE log='acme' AND seq=?", (seq,))
    with pytest.raises(VerificationFailed, match=rf"seq {seq}\b"):
        _verify(path)


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(a=st.integers(0, N - 1), b=st.integers(0, N - 1))
def test_reordering_rows_fails(
    pristine: Path, tmp_path_factory: pytest.TempPathFactory, a: int, b: int
) -> None:
    if a == b:
        return
    path = _copy(pristine, tmp_path_factory.mktemp("swap"))
    db = sqlite3.connect(path)
    with db:
        db.execute("UPDATE ledger_entries SET seq=-1 WHERE log='acme' AND seq=?", (a,))
        db.execute("UPDATE ledger_entries SET seq=? WHERE log='acme' AND seq=?", (a, b))
        db.execute("UPDATE ledger_entries SET seq=? WHERE log='acme' AND seq=-1", (b,))
    db.close()
    with pytest.raises(VerificationFailed, match=rf"seq {min(a, b)}\b"):
        _verify(path)


@settings(
    max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(keep=st.integers(0, N - 1))
def test_truncating_the_log_fails(
    pristine: Path, tmp_path_factory: pytest.TempPathFactory, keep: int
) -> None:
    path = _copy(pristine, tmp_path_factory.mktemp("trunc"))
    _mutate(path, "DELETE FROM ledger_entries WHERE log='acme' AND seq>=?", (keep,))
    with pytest.raises(VerificationFailed, match=rf"seq {keep}\b"):
        _verify(path)


def test_truncation_with_rewound_head_is_caught_by_a_held_checkpoint(
    pristine: Path, tmp_path: Path
) -> None:
    """An operator who rolls the whole store back (events, tiles, head, checkpoints)
    to an earlier size leaves a log that verifies on its own; an auditor who kept any
    later signed checkpoint still catches it."""
    held = (
        sqlite3.connect(pristine)
        .execute("SELECT checkpoint FROM ledger_logs WHERE log='acme'")
        .fetchone()[0]
    )
    rewound = tmp_path / "p.db"
    shutil.copy(pristine.parent / "at50.db", rewound)
    _verify(rewound)
    with pytest.raises(VerificationFailed, match=r"seq 50\b.*commits to 120"):
        _verify(rewound, (held,))


@pytest.mark.parametrize(
    "target",
    ["events.jsonl", "checkpoint", "checkpoints.jsonl", "tile/0/000.p/120"],
)
def test_tampered_export_fails(pristine: Path, tmp_path: Path, target: str) -> None:
    src = pristine.parent / "export"
    dst = tmp_path / "export"
    shutil.copytree(src, dst)
    verify_export(dst, SIGNER.verifier)
    f = dst / target
    data = bytearray(f.read_bytes())
    # Change one character in the middle of the payload (not the framing newline).
    i = len(data) // 2
    while data[i] in b"\n":
        i += 1
    data[i] = ord("A") if data[i] != ord("A") else ord("B")
    f.write_bytes(bytes(data))
    with pytest.raises(VerificationFailed):
        verify_export(dst, SIGNER.verifier)


def test_export_with_a_foreign_key_fails(pristine: Path) -> None:
    with pytest.raises(VerificationFailed, match="no signature"):
        verify_export(pristine.parent / "export", Signer.generate("test.local").verifier)
