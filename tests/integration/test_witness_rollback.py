"""A store rolled back to a backup taken before the witnesses' last cosignature,
then grown with another history, against ``audit verify --witness`` (issue 31, 1).

The witness is a real ``proctor witness serve`` in a network namespace of its own;
the store is the home's SQLite file, backed up with SQLite's own backup API and
restored over it, as an operator would. The stored cosignatures of the restored
store all verify (they are of the history it holds), so only asking the witness
what it last cosigned reveals the rollback. The tenant's max age is tried with the
ledger's clock back-dated, so the events it stamps are hours old for real."""

from __future__ import annotations

import hashlib
import json
import re
import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from proctor.governance import Tenants
from proctor.ledger import Actor, EventDraft, Ledger
from proctor.runtime import Runtime
from proctor.witness import TenantWitnesses, Witness
from tests.conftest import run_cli
from tests.integration.test_witness import (  # noqa: F401  (the fixture)
    Witnesses,
    witnesses,
)

# Each test makes network namespaces and veth pairs (tests/host_group.py).
pytestmark = pytest.mark.host
OP = Actor("operator", "test-operator")


def _append(home: Path, what: str, n: int) -> int:
    """``n`` events of kind ``what`` appended to acme; the log's new size."""
    rt = Runtime.open(home)
    try:
        for i in range(n):
            rt.ledger.append("acme", EventDraft(OP, f"test.{what}", f"thing/{i}"))
        return rt.ledger.head("acme").size
    finally:
        rt.close()


def _submit(home: Path) -> list[tuple[bool, int | None, str]]:
    rt = Runtime.open(home)
    try:
        return [
            (s.ok, s.status, s.detail) for s in TenantWitnesses(rt.store, rt.ledger).submit("acme")
        ]
    finally:
        rt.close()


def _backup(db: Path, to: Path) -> None:
    """SQLite's online backup of the store file: what a nightly backup job makes."""
    with sqlite3.connect(db) as src, sqlite3.connect(to) as dst:
        src.backup(dst)
    src.close()
    dst.close()


def _restore(backup: Path, db: Path) -> None:
    """The backup put back over the store, its WAL and index gone with the old file."""
    for leftover in (db.with_name(db.name + "-wal"), db.with_name(db.name + "-shm")):
        leftover.unlink(missing_ok=True)
    db.write_bytes(backup.read_bytes())


@contextmanager
def _replaying(answer: str) -> Iterator[str]:
    """An HTTP server on loopback that gives ``answer`` to every GET: its URL."""

    class Replay(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = answer.encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Replay)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(timeout=10)


def _verify(home: Path, *args: str) -> tuple[int, str, dict[str, object] | None]:
    got = run_cli("audit", "verify", "-t", "acme", *args, "--json", home=home, check=False)
    return got.code, got.err, json.loads(got.out) if got.code == 0 else None


def test_a_store_rolled_back_past_the_witness_fails_verify(
    home: Path,
    witnesses: Witnesses,  # noqa: F811
    tmp_path: Path,
) -> None:
    rt = Runtime.open(home)
    try:
        rt.tenants.create("acme", OP)
        w = witnesses.new(tmp_path / "w1", "witness.test/rb1",
                          [(rt.ledger.origin("acme"), rt.ledger.vkey())])  # fmt: skip
        TenantWitnesses(rt.store, rt.ledger).use("acme", "w1", w.vkey, w.url, OP)
    finally:
        rt.close()
    db = home / "proctor.db"  # the home's own SQLite store
    assert db.is_file()
    policy = ("--witness", w.vkey)

    # Cosigned at size N; the backup is taken; the log grows and is cosigned at M.
    n = _append(home, "call", 5)
    assert _submit(home) == [(True, 200, "cosigned")]
    _backup(db, tmp_path / "backup.db")
    # What the witness answered then, recorded by the operator; made here with the
    # witness's own key and clock set an hour back, as if recorded an hour ago.
    then = Witness.open(w.state)
    old_answer = Witness(w.state, then.cosigner, clock=lambda: time.time() - 3600).checkpoint(
        hashlib.sha256(b"proctor.local/tenant/acme").hexdigest()
    )
    assert old_answer is not None and old_answer.split("\n")[1] == str(n)
    m = _append(home, "call", 3)
    assert _submit(home) == [(True, 200, "cosigned")]
    assert w.show()["logs"][0]["size"] == m  # type: ignore[index]
    code, err, ok = _verify(home, *policy)
    assert code == 0, err
    assert ok is not None and ok["witnessed_size"] == m
    assert "last cosigned size" in err and "from the tenant's witnesses" in err

    # A witness that cannot be reached: verification fails closed, saying so.
    w.stop()
    try:
        code, err, _ = _verify(home, *policy)
        assert code == 3, err
        assert "cannot be reached" in err and "--witness-offline" in err
    finally:
        w.start()
    # A URL the auditor pins instead of the store's: asked there, and nothing else.
    code, err, pinned = _verify(home, *policy, "--witness-url", w.url)
    assert code == 0, err
    assert (
        pinned is not None and pinned["witnessing"]["witnesses"][0]["url_from"] == "--witness-url"
    )  # type: ignore[index]

    # The rollback: the backup restored, and another history appended past M.
    _restore(tmp_path / "backup.db", db)
    forked = _append(home, "other", 5)
    assert forked > m
    # The witness refuses to cosign it (a fork at a larger size) ...
    refused = _submit(home)
    assert [(ok_, status) for ok_, status, _ in refused] == [(False, 422)], refused
    # ... plain verify passes (the signatures are the operator's own) ...
    assert run_cli("audit", "verify", "-t", "acme", home=home).code == 0
    # ... the stored cosignatures alone pass too (they are of the restored history) ...
    code, err, offline = _verify(home, *policy, "--witness-offline")
    assert code == 0, err
    assert offline is not None and offline["witnessed_size"] == n
    assert "witnesses not asked" in err
    # ... and asking the witness fails, naming what it cosigned.
    code, err, _ = _verify(home, *policy)
    assert code == 3, err
    assert "does not extend the checkpoint witness witness.test/rb1 last cosigned" in err
    assert f"size {m}" in err
    # The operator points the tenant's registered URL at a replay of the old answer
    # (a checkpoint the forked log does extend): refused, the answer is not fresh ...
    with _replaying(old_answer) as replay:
        with sqlite3.connect(db) as conn:
            conn.execute("UPDATE tenant_witnesses SET url = ? WHERE tenant = 'acme'", (replay,))
        conn.close()
        code, err, _ = _verify(home, *policy)
    assert code == 3, err
    assert re.search(r"made 36\d\d s ago, not when asked: an old answer replayed", err), err
    # ... and an auditor who pins the witness's URL does not use the store's at all.
    code, err, _ = _verify(home, *policy, "--witness-url", w.url)
    assert code == 3 and "does not extend" in err, err

    # Rolled back without growing past M: smaller than what the witness cosigned.
    _restore(tmp_path / "backup.db", db)
    assert _append(home, "other", 1) < m
    code, err, _ = _verify(home, *policy)
    assert code == 3, err
    assert f"has size {m} but the log holds only {n + 1} events" in err


class _Clock:
    """The ledger's clock, hours behind: the events it stamps are old for real."""

    def __init__(self, start: datetime) -> None:
        self.now = start

    def __call__(self) -> str:
        self.now += timedelta(seconds=1)
        return self.now.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


@pytest.fixture
def old_home(home: Path) -> Iterator[tuple[Path, Runtime, Ledger, _Clock]]:
    rt = Runtime.open(home)
    clock = _Clock(datetime.now(UTC) - timedelta(hours=3))
    ledger = Ledger(rt.store, rt.signer, rt.config.trust_domain, clock=clock)
    try:
        yield home, rt, ledger, clock
    finally:
        ledger.close()
        rt.close()


def test_events_left_uncosigned_past_the_max_age_fail_verify(
    old_home: tuple[Path, Runtime, Ledger, _Clock],
    witnesses: Witnesses,  # noqa: F811
    tmp_path: Path,
) -> None:
    home, rt, ledger, clock = old_home
    Tenants(rt.store, ledger).create("acme", OP)
    w = witnesses.new(tmp_path / "w1", "witness.test/ma1",
                      [(ledger.origin("acme"), ledger.vkey())])  # fmt: skip
    tw = TenantWitnesses(rt.store, ledger)
    tw.use("acme", "w1", w.vkey, w.url, OP)
    tw.set_policy("acme", OP, quorum=1, max_age=3600)
    for i in range(3):
        ledger.append("acme", EventDraft(OP, "test.call", f"thing/{i}"))
    assert [s.ok for s in tw.submit("acme")] == [True]
    cosigned = ledger.head("acme").size
    code, err, ok = _verify(home, "--witness", w.vkey)
    assert code == 0, err
    assert ok is not None and ok["witnessing"]["uncosigned_for_seconds"] == 0  # type: ignore[index]

    # The submitter stops (the witness is never told); two calls, three hours ago.
    for i in range(2):
        ledger.append("acme", EventDraft(OP, "test.call", f"late/{i}"))
    code, err, _ = _verify(home, "--witness", w.vkey)
    assert code == 3, err
    assert f"2 event(s) newer than the witnessed checkpoint of size {cosigned}" in err
    assert "more than the tenant's witness max age of 3600 s" in err
    # The tenant's policy is what is applied: a day allows it (the policy's own event
    # is one more uncosigned event, three hours old too).
    tw.set_policy("acme", OP, quorum=1, max_age=86400)
    code, err, ok = _verify(home, "--witness", w.vkey)
    assert code == 0, err
    assert ok is not None and ok["witnessing"]["max_age_seconds"] == 86400  # type: ignore[index]
    assert ok["witnessing"]["uncosigned_for_seconds"] > 3 * 3600 - 60  # type: ignore[index]
    # Cosigned again: nothing waits, under the strict policy too.
    tw.set_policy("acme", OP, quorum=1, max_age=3600)
    assert [s.ok for s in tw.submit("acme")] == [True]
    code, err, ok = _verify(home, "--witness", w.vkey)
    assert code == 0, err
    assert ok is not None and ok["witnessed_size"] == ledger.head("acme").size
    assert clock.now < datetime.now(UTC)  # every event was stamped in the past
