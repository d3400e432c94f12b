"""Every event fits the ledger's bound (MAX_EVENT_BYTES), whatever a call reads:
SQL reads of 1 to 100,000 rows keep their row keys in a lineage object, statements
naming thousands of columns or hundreds of tables are recorded with cut lists, and
an event over the bound is refused loudly, leaving the log as it was."""

from __future__ import annotations

import json
import logging
import sqlite3
from pathlib import Path
from typing import Any

import pytest

from proctor.broker import CallDenied
from proctor.errors import LedgerError
from proctor.evidence import key_hmac
from proctor.governance import Policies
from proctor.ledger import (
    CUT_MARKER,
    MAX_EVENT_BYTES,
    Actor,
    EventDraft,
    check_lineage_object,
    lineage_keys,
    lineage_leaf,
    lineage_object,
    lineage_proof,
    lineage_salt,
    lineage_seqs,
    read_objects,
    verify_inclusion,
)
from tests.conftest import LedgerEnv
from tests.integration.test_broker_sql import TENANT, ensure_log, make_dataset, make_scope, sql

ROWS = 100_000
OPERATOR = Actor("operator", "test")


def _last(env: LedgerEnv) -> tuple[bytes, dict[str, object]]:
    size = env.ledger.head(TENANT).size
    (data,) = env.ledger.entries(TENANT, size - 1, size)
    return data, json.loads(data)


def _last_of(env: LedgerEnv, seq: int) -> tuple[bytes, dict[str, Any]]:
    data = next(iter(env.ledger.entries(TENANT, seq, seq + 1)))
    return data, json.loads(data)


def test_reads_of_1_to_100000_rows_make_events_under_the_bound(
    ledger_env: LedgerEnv, tmp_path: Path
) -> None:
    # 5 named customers plus ids 1000..: 100,000 rows in all.
    ds = make_dataset(tmp_path / "crm.db", extra_rows=ROWS - 5)
    scope = make_scope(ledger_env, ds, row_limit=ROWS)
    seqs = {}
    for n in (1, 10, 1_000, 10_000, ROWS):
        out = sql(scope, f"SELECT id, plan FROM customers ORDER BY id LIMIT {n}")
        assert out["row_count"] == n and out["truncated"] is False
        data, ev = _last(ledger_env)
        assert len(data) <= MAX_EVENT_BYTES, (n, len(data))
        d = ev["details"]
        assert isinstance(d, dict) and d["row_count"] == n and "keys_hmac" not in d
        ref = d["lineage_object"]
        assert ref["count"] == n
        obj = read_objects(ledger_env.store, TENANT, [ref["digest"]])[ref["digest"]]
        assert check_lineage_object(ref, obj) is None
        seqs[n] = ev["seq"]
    # The size of every event of the five reads is the same within a few bytes.
    sizes = [len(e) for e in ledger_env.ledger.entries(TENANT) if b'"sql.select"' in e]
    assert max(sizes) - min(sizes) < 16

    # A row from the middle of the 100,000 (customer 51000): found by the key index
    # in the largest read only, and provable from the event's root alone.
    middle = key_hmac(scope.lineage_key, "51000")
    assert lineage_seqs(ledger_env.store, TENANT, middle) == {seqs[ROWS]}
    _, big = _last_of(ledger_env, seqs[ROWS])
    ref = big["details"]["lineage_object"]
    data = read_objects(ledger_env.store, TENANT, [ref["digest"]])[ref["digest"]]
    assert middle in lineage_keys(data)
    index, path = lineage_proof(data, middle)
    leaf = lineage_leaf(middle, lineage_salt(data, middle))
    verify_inclusion(index, ROWS, leaf, path, bytes.fromhex(ref["root"]))
    assert len(path) == 17  # log2(100,000), rounded up: the other keys stay unrevealed
    # The same rows read again: the same keys, but each read its own salts (so an
    # erasure leaves no salt behind in an object it did not rewrite).
    sql(scope, "SELECT id FROM customers WHERE id = 1")
    sql(scope, "SELECT id FROM customers WHERE id = 1")
    a, b = [json.loads(e) for e in ledger_env.ledger.entries(TENANT)][-2:]
    ra, rb = a["details"]["lineage_object"], b["details"]["lineage_object"]
    assert ra["count"] == rb["count"] == 1 and ra["digest"] != rb["digest"]
    assert ledger_env.ledger.verify(TENANT).size == ledger_env.ledger.head(TENANT).size


def test_statements_naming_thousands_of_columns_or_hundreds_of_tables_stay_bounded(
    ledger_env: LedgerEnv, tmp_path: Path
) -> None:
    ds = make_dataset(tmp_path / "crm.db")
    conn = sqlite3.connect(ds)
    cols = ", ".join(f"column_with_a_long_descriptive_name_{i:04d} INTEGER" for i in range(1500))
    conn.execute(f"CREATE TABLE wide ({cols})")
    tables = [f"table_number_{i:03d}_with_a_long_name_to_fill_an_event" for i in range(200)]
    for t in tables:
        conn.execute(f"CREATE TABLE {t} (id INTEGER PRIMARY KEY)")
    conn.commit()
    conn.close()
    scope = make_scope(ledger_env, ds)

    with pytest.raises(CallDenied):
        sql(scope, "SELECT * FROM wide")
    data, ev = _last(ledger_env)
    assert len(data) <= MAX_EVENT_BYTES
    d = ev["details"]
    assert isinstance(d, dict) and d["tables"][0]["columns_cut"] > 1000
    assert str(ev["reason"]).endswith(CUT_MARKER)

    many = ", ".join(f"(SELECT count(*) FROM {t})" for t in tables)
    with pytest.raises(CallDenied):
        sql(scope, f"SELECT {many} FROM customers")
    data, ev = _last(ledger_env)
    assert len(data) <= MAX_EVENT_BYTES
    d = ev["details"]
    assert isinstance(d, dict) and d["tables_cut"] > 0
    assert len(d["tables"]) + d["tables_cut"] == len(tables) + 1


def test_an_event_over_the_bound_is_refused_loudly_and_changes_nothing(
    ledger_env: LedgerEnv, caplog: pytest.LogCaptureFixture
) -> None:
    ensure_log(ledger_env)
    ledger = ledger_env.ledger
    before = ledger.head(TENANT)
    big = EventDraft(Actor("operator", "test"), "test.event", "r", details={"p": "x" * 20_000})
    with (
        caplog.at_level(logging.ERROR, logger="proctor.ledger"),
        pytest.raises(LedgerError, match="over the ledger's bound of 16384 bytes"),
    ):
        ledger.append(TENANT, big)
    assert any("over the 16384-byte bound" in r.getMessage() for r in caplog.records)
    after = ledger.head(TENANT)
    assert (after.size, after.root) == (before.size, before.root)
    # The next event takes the place the refused one did not.
    ok = ledger.append(TENANT, EventDraft(Actor("operator", "test"), "test.event", "r"))
    assert ok.seq == before.size

    # In one batch, an event over the bound fails alone: the others' objects are
    # indexed at their own places, the failed one's are not stored at all.
    drafts = []
    for i in range(3):
        obj, ref = lineage_object([f"{i:032x}"])
        pad = {"p": "x" * 20_000} if i == 1 else {}
        drafts.append(
            EventDraft(OPERATOR, "test.event", "r", details={"lineage_object": ref, **pad},
                       objects=(obj,))
        )  # fmt: skip
    with pytest.raises(LedgerError, match="over the ledger's bound"):
        ledger.append_many(TENANT, drafts)
    got = [json.loads(e) for e in ledger.entries(TENANT, ok.seq + 1)]
    assert [lineage_seqs(ledger_env.store, TENANT, f"{i:032x}") for i in range(3)] == [
        {got[0]["seq"]},
        set(),
        {got[1]["seq"]},
    ]
    assert read_objects(ledger_env.store, TENANT, [drafts[1].objects[0].digest]) == {}


def test_a_policy_set_of_400_policies_is_recorded_under_the_bound(ledger_env: LedgerEnv) -> None:
    ensure_log(ledger_env)
    with ledger_env.store.write() as conn:
        conn.execute(
            "INSERT INTO tenants (name, created_at, created_by) VALUES (?, ?, ?)",
            (TENANT, "2026-01-01T00:00:00.000000Z", "test"),
        )
    text = "\n".join(
        f'@id("policy-number-{i:04d}-with-a-rather-long-name")\n'
        "forbid (principal, action, resource);"
        for i in range(400)
    )
    version = Policies(ledger_env.store, ledger_env.ledger).set(TENANT, text, OPERATOR).version
    data, ev = _last(ledger_env)
    assert len(data) <= MAX_EVENT_BYTES and ev["action"] == "policy.set"
    d = ev["details"]
    assert isinstance(d, dict) and d["version"] == version  # the version pins the text
    assert len(d["policies"]) == 64 and d["policies_cut"] == 400 - 64
