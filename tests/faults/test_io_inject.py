"""One failed write or fsync under the ledger's writer, injected with LD_PRELOAD.

``iofail.c`` (compiled here with gcc) makes exactly one chosen call fail with
EIO on the store's files; ``_ledger_child.py`` arms it from inside one batch's
transaction, so the fault hits that batch's commit. What must hold:

- the batch that hit the fault is refused as a whole: every append in it
  raises LedgerError;
- none of its events is in the log, not even half: rows, tiles, checkpoints
  and the head all stop at the last acknowledged event, and ``verify`` passes;
- later appends in the same process succeed, on the same Ledger;
- a fresh process reading the store sees exactly the acknowledged events,
  also when the child dies right after the refusal (``crash``): a failed
  fsync leaves the batch's WAL frames, commit frame included, in the file,
  and SQLite's recovery in the next process would bring the refused events
  back unless the store overwrites them first (it does: see SQLiteStore.write).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from proctor.ledger import Ledger, Signer, leaf_hash
from proctor.runtime import Runtime, init_home
from proctor.store import open_store
from tests.conftest import draft
from tests.faults._ledger_child import FAULT_BATCH

HERE = Path(__file__).parent
CHILD = HERE / "_ledger_child.py"
DB_NAME = "ledger.db"


@pytest.fixture(scope="module")
def shim(tmp_path_factory: pytest.TempPathFactory) -> Path:
    gcc = shutil.which("gcc")
    if gcc is None:
        pytest.skip("gcc is not installed: the LD_PRELOAD shim cannot be built")
    out = tmp_path_factory.mktemp("iofail") / "libiofail.so"
    proc = subprocess.run(
        [gcc, "-shared", "-fPIC", "-O2", "-Wall", "-Werror", "-o", str(out),
         str(HERE / "iofail.c"), "-ldl"],
        capture_output=True, timeout=120, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr.decode()
    return out


def _store_with_log(tmp_path: Path) -> tuple[Path, Path, Signer]:
    db, key = tmp_path / DB_NAME, tmp_path / "ledger.pem"
    signer = Signer.generate("test.local")
    signer.save(key)
    store = open_store(str(db), create=True)
    ledger = Ledger(store, signer, "test.local")
    ledger.create_log("acme", draft(0))
    ledger.close()
    store.close()
    return db, key, signer


def _run_child(
    shim: Path, db: Path, key: Path | None, op: str, nth: int, after: str
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    env = dict(os.environ)
    env.update(
        LD_PRELOAD=str(shim),  # only this child: the test process stays clean
        IOFAIL_LIB=str(shim),
        IOFAIL_OP=op,
        IOFAIL_MATCH=f"{db.name}-wal",
        IOFAIL_ARM_NTH=str(nth),
        PYTHONPATH=os.pathsep.join([str(HERE.parent.parent), env.get("PYTHONPATH", "")]),
    )
    env.pop("IOFAIL_NTH", None)  # armed from inside the batch, not at load
    args = [str(db), str(key), after] if key is not None else ["tenant", str(db.parent)]
    proc = subprocess.run(
        [sys.executable, str(CHILD), *args],
        capture_output=True, env=env, timeout=120, check=False,
    )  # fmt: skip
    err = proc.stderr.decode(errors="replace")
    assert proc.returncode == 0, f"the child failed ({proc.returncode}):\n{err}"
    lines = [json.loads(line) for line in proc.stdout.decode().splitlines()]
    assert lines and lines[-1].get("done"), f"the child did not finish:\n{err}"
    return lines[:-1], lines[-1]


def _check_store(db: Path, signer: Signer, acked: dict[str, dict[str, Any]]) -> int:
    """A fresh reader of the store sees exactly ``acked`` (plus event 0), whole."""
    store = open_store(str(db))
    ledger = Ledger(store, signer, "test.local")
    try:
        head = ledger.head("acme")
        rows = list(ledger.entries("acme"))
        events = [json.loads(e) for e in rows]
        ks = [e["details"].get("k") for e in events[1:]]
        assert sorted(ks) == sorted(acked), (
            "the log holds other events than the acknowledged ones: "
            f"extra {sorted(set(ks) - set(acked))}, missing {sorted(set(acked) - set(ks))}"
        )
        for seq, (event, data) in enumerate(zip(events, rows, strict=True)):
            assert event["seq"] == seq
            if seq:
                ack = acked[event["details"]["k"]]
                assert (ack["seq"], ack["leaf"]) == (seq, leaf_hash(data).hex())
        assert head.size == len(rows) == 1 + len(acked)
        # Tiles and checkpoints stop at the same place: nothing of a refused batch.
        with store.read() as conn:
            tiles = conn.query("SELECT level, idx, hashes FROM ledger_tiles WHERE log = 'acme'")
            sizes = [int(r[0]) for r in conn.query(
                "SELECT size FROM ledger_checkpoints WHERE log = 'acme'")]  # fmt: skip
        assert [(int(t[0]), int(t[1])) for t in tiles] == [(0, 0)]  # fewer than 256 events
        assert bytes(tiles[0][2]) == b"".join(leaf_hash(d) for d in rows)
        assert max(sizes) == head.size
        report = ledger.verify("acme")
        assert report.size == head.size
        return head.size
    finally:
        ledger.close()
        store.close()


@pytest.mark.parametrize(
    ("op", "nth", "after"),
    [
        ("fsync", 1, "continue"),  # the commit's fsync of the WAL
        ("fsync", 1, "crash"),  # ... and the process dies right after the refusal
        ("write", 3, "continue"),  # a frame in the middle of the batch's commit
        ("write", 1, "crash"),  # its first frame, then the process dies
    ],
)
def test_one_failed_io_call_refuses_its_batch_whole(
    shim: Path, tmp_path: Path, op: str, nth: int, after: str
) -> None:
    db, key, signer = _store_with_log(tmp_path)
    reports, done = _run_child(shim, db, key, op, nth, after)
    assert done["hits"] == 1, "the fault was not injected exactly once"

    by_phase: dict[str, list[dict[str, Any]]] = {}
    for r in reports:
        by_phase.setdefault(r["phase"], []).append(r)
    fault = by_phase["fault"]
    assert len(fault) == FAULT_BATCH
    assert all(not r["ok"] and r["error"].startswith("LedgerError") for r in fault), [
        r for r in fault if r["ok"] or not r["error"].startswith("LedgerError")
    ]
    # Everything else was acknowledged: before the fault and, in the same
    # process and on the same Ledger, after it.
    others = [r for r in reports if r["phase"] != "fault"]
    assert all(r["ok"] for r in others), [r for r in others if not r["ok"]]
    assert len(by_phase["before"]) == 40 and len(by_phase["hold"]) == 1
    assert len(by_phase.get("after", [])) == (40 if after == "continue" else 0)
    acked = {r["k"]: r for r in others}
    seqs = sorted(r["seq"] for r in others)
    assert seqs == list(range(1, 1 + len(others))), "acknowledged seqs must be dense"
    if after == "continue":
        assert done["size"] == done["verified"] == 1 + len(acked)

    assert _check_store(db, signer, acked) == 1 + len(acked)
    # And the log still takes appends from a new process.
    store = open_store(str(db))
    ledger = Ledger(store, signer, "test.local")
    try:
        assert ledger.append("acme", draft(1)).seq == 1 + len(acked)
        assert ledger.verify("acme").size == 2 + len(acked)
    finally:
        ledger.close()
        store.close()


def test_a_refused_tenant_creation_leaves_no_tenant(shim: Path, tmp_path: Path) -> None:
    home = tmp_path / "home"
    init_home(home)
    db = home / "proctor.db"
    _, done = _run_child(shim, db, None, "fsync", 1, "")
    assert done["hits"] == 1
    assert done["create"].startswith("LedgerError"), done
    rt = Runtime.open(home)
    try:
        system = [json.loads(e) for e in rt.ledger.entries("system")]
        # Nothing of the refused creation: no row, no log, no system event.
        assert not any(e["resource"] == "tenant/globex" for e in system)
        assert rt.tenants.find("globex") is None
        assert "globex" not in rt.ledger.logs()
        assert rt.ledger.verify("system").size == len(system)
        # And the same name can be created afterwards, once, with both records.
        rt.tenants.create("globex", rt.operator)
        first = json.loads(next(rt.ledger.entries("globex")))
        (record,) = [json.loads(e) for e in rt.ledger.entries("system")
                     if json.loads(e)["resource"] == "tenant/globex"]  # fmt: skip
        assert first["action"] == record["action"] == "tenant.create"
        assert rt.ledger.verify("globex").size == 1
        assert rt.ledger.verify("system").size == len(system) + 1
    finally:
        rt.close()
