"""The ``proctor`` command as a user runs it: a real home, real subprocesses."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import sqlite3
from pathlib import Path

import pytest

from proctor.ledger import (
    Verifier,
    leaf_hash,
    open_checkpoint,
    verify_consistency,
    verify_inclusion,
)
from tests.conftest import copy_home, run_cli


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def two_tenants(initialised_home: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    h = copy_home(initialised_home, tmp_path_factory.mktemp("two-tenants") / "home")
    run_cli("tenant", "create", "acme", home=h)
    run_cli("tenant", "create", "globex", home=h)
    return h


@pytest.fixture
def acme(two_tenants: Path, tmp_path: Path) -> Path:
    return copy_home(two_tenants, tmp_path / "home")


def test_init_makes_a_private_key_and_a_system_log(home: Path) -> None:
    key = home / "keys" / "ledger.pem"
    assert key.stat().st_mode & 0o777 == 0o600
    vkey = run_cli("key", "show", home=home).out.strip()
    v = Verifier.parse(vkey)
    assert v.name == "proctor.local"
    events = [
        json.loads(line)
        for line in run_cli(
            "audit", "events", "-t", "system", "--jsonl", home=home
        ).raw.splitlines()
    ]
    assert [e["action"] for e in events] == ["runtime.init"]
    assert events[0]["actor"]["type"] == "operator"
    again = run_cli("init", "--home", str(home), check=False)
    assert again.code != 0 and "initialised already" in again.err


def test_tenant_creation_is_in_both_logs(acme: Path) -> None:
    listing = run_cli("tenant", "list", home=acme).out
    assert "acme" in listing and "globex" in listing
    system = [
        json.loads(x)
        for x in run_cli("audit", "events", "-t", "system", "--jsonl", home=acme).raw.splitlines()
    ]
    assert [(e["action"], e["resource"]) for e in system[1:]] == [
        ("tenant.create", "tenant/acme"),
        ("tenant.create", "tenant/globex"),
    ]
    first = json.loads(run_cli("audit", "events", "-t", "acme", "--jsonl", home=acme).raw)
    assert (first["seq"], first["action"], first["tenant"]) == (0, "tenant.create", "acme")
    assert system[1]["details"]["origin"] == "proctor.local/tenant/acme"


def test_events_json_are_the_hashed_bytes_and_proofs_verify(acme: Path) -> None:
    run_cli("audit", "export", "-t", "acme", "-o", str(acme / "x1"), home=acme)
    run_cli("audit", "export", "-t", "acme", "-o", str(acme / "x2"), home=acme)
    lines = run_cli("audit", "events", "-t", "acme", "--jsonl", home=acme).raw.splitlines()
    assert len(lines) == 3
    # --json: one array, one event a line, each line the bytes as hashed (and a comma).
    array = run_cli("audit", "events", "-t", "acme", "--json", home=acme).raw
    assert json.loads(array) == [json.loads(x) for x in lines]
    assert array.splitlines() == [b"[", lines[0] + b",", lines[1] + b",", lines[2], b"]"]
    assert run_cli("audit", "events", "-t", "acme", "--json", "--run", "r-0", home=acme,
                   check=False).code != 0  # fmt: skip
    vkey = run_cli("key", "show", home=acme).out.strip()
    note = run_cli("audit", "checkpoint", "-t", "acme", home=acme).out
    cp = open_checkpoint(note, Verifier.parse(vkey), "proctor.local/tenant/acme")
    assert cp.size == 3
    for i, line in enumerate(lines):
        p = json.loads(
            run_cli("audit", "proof", "-t", "acme", "--index", str(i), "--json", home=acme).out
        )
        assert p["index"] == i and p["size"] == 3
        assert base64.b64decode(p["leaf_hash"]) == leaf_hash(line)
        verify_inclusion(i, 3, leaf_hash(line), [base64.b64decode(h) for h in p["hashes"]], cp.root)
    c = json.loads(
        run_cli("audit", "consistency", "-t", "acme", "--old", "1", "--json", home=acme).out
    )
    assert (c["old"], c["new"]) == (1, 3)
    old_root = leaf_hash(lines[0])
    verify_consistency(1, 3, old_root, cp.root, [base64.b64decode(h) for h in c["hashes"]])


def test_time_filters(acme: Path) -> None:
    everything = run_cli("audit", "events", "-t", "acme", "--jsonl", home=acme).raw.splitlines()
    t0 = json.loads(everything[0])["time"]
    assert run_cli("audit", "events", "-t", "acme", "--jsonl", "--until", t0, home=acme).raw == b""
    assert (
        run_cli(
            "audit", "events", "-t", "acme", "--jsonl", "--since", t0, home=acme
        ).raw.splitlines()
        == everything
    )
    assert (
        run_cli("audit", "events", "-t", "acme", "--since", "2000-01-01", home=acme).out.count(
            "tenant.create"
        )
        == 1
    )


def test_verify_and_export_round_trip(acme: Path, tmp_path: Path) -> None:
    assert "verified" in run_cli("audit", "verify", "-t", "acme", home=acme).out
    assert "verified" in run_cli("audit", "verify", "-t", "system", home=acme).out
    out = tmp_path / "export"
    run_cli("audit", "export", "-t", "acme", "-o", str(out), home=acme)
    vkey = run_cli("key", "show", home=acme).out.strip()
    # Offline: no home at all, only the export and the key.
    res = run_cli("audit", "verify", "--from-export", str(out), "--key", vkey)
    assert "verified proctor.local/tenant/acme: 1 events" in res.out
    # The export itself is recorded in the tenant's log.
    events = run_cli("audit", "events", "-t", "acme", "--jsonl", home=acme).raw.splitlines()
    assert json.loads(events[-1])["action"] == "audit.export"


def test_tampered_store_fails_verify_naming_the_sequence(acme: Path) -> None:
    for _ in range(3):
        run_cli("audit", "export", "-t", "acme", "-o", str(acme / os.urandom(4).hex()), home=acme)
    db = sqlite3.connect(acme / "proctor.db")
    with db:
        db.execute(
            "UPDATE ledger_entries SET data = CAST(REPLACE(CAST(data AS TEXT), 'exported', "
            "'EXPORTED') AS BLOB) WHERE log = 'acme' AND seq = 2"
        )
    db.close()
    res = run_cli("audit", "verify", "-t", "acme", home=acme, check=False)
    assert res.code == 3
    assert "seq 2" in res.err
    assert "Traceback" not in res.err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("audit", "events", "-t", "nobody"), "unknown tenant 'nobody'"),
        (("audit", "proof", "-t", "acme", "--index", "5"), "out of range"),
        (("audit", "proof", "-t", "acme", "--index", "0", "--size", "9"), "out of range"),
        (("audit", "consistency", "-t", "acme", "--old", "0"), "between 1 and"),
        # "yesterday" is a time since issue 33 (cli/_when.py); a word that is none is refused.
        (("audit", "events", "-t", "acme", "--since", "the day before"), "is not a time"),
        (("tenant", "create", "Bad_Name"), "invalid tenant name"),
        (("tenant", "create", "system"), "reserved"),
        (("tenant", "create", "acme"), "exists already"),
        (("audit", "verify", "-t", "acme", "--key", "nonsense"), "malformed verifier key"),
    ],
)
def test_bad_input_gets_a_clear_error_and_changes_nothing(
    acme: Path, args: tuple[str, ...], message: str
) -> None:
    before = run_cli("audit", "events", "-t", "system", "--jsonl", home=acme).raw
    res = run_cli(*args, home=acme, check=False)
    assert res.code != 0
    assert message in res.err
    assert "Traceback" not in res.err + res.out
    assert run_cli("audit", "events", "-t", "system", "--jsonl", home=acme).raw == before


def test_malformed_checkpoint_file_is_refused(acme: Path, tmp_path: Path) -> None:
    bad = tmp_path / "cp"
    bad.write_text("{not a checkpoint")
    res = run_cli("audit", "verify", "-t", "acme", "--checkpoint", str(bad), home=acme, check=False)
    assert res.code == 3 and "malformed" in res.err


def test_corrupted_database_is_refused_and_left_alone(acme: Path) -> None:
    db = acme / "proctor.db"
    for extra in ("-wal", "-shm"):
        Path(str(db) + extra).unlink(missing_ok=True)
    db.write_bytes(b"this is not a database" * 100)
    before = _digest(db)
    res = run_cli("audit", "events", "-t", "acme", home=acme, check=False)
    assert res.code != 0
    assert "not a Proctor database or it is corrupted" in res.err
    assert "Traceback" not in res.err
    assert _digest(db) == before


def test_uninitialised_home_is_refused(tmp_path: Path) -> None:
    res = run_cli("tenant", "list", home=tmp_path / "nowhere", check=False)
    assert res.code != 0 and "proctor init" in res.err
    assert not (tmp_path / "nowhere").exists()


@pytest.mark.host
def test_demo_runs(tmp_path: Path) -> None:
    res = run_cli("demo", "--home", str(tmp_path / "demo"))
    assert "rejected" in res.out
    assert res.out.count("[green]") == 0
