"""The pieces of the SQL handler that need no ledger: the keyed variant used for
lineage, what the collecting authorizer reports, request checks, row keys."""

from __future__ import annotations

import sqlite3

import pytest

from proctor.broker import BadCall
from proctor.broker._datasets import parse_request
from proctor.broker._lineage import key_text, keyed_variant
from proctor.broker._sql import ALLOWED_FUNCTIONS, _Accesses

KEY = ["id"]


@pytest.mark.parametrize(
    ("sql", "expected"),
    [
        ("SELECT name FROM customers", 'SELECT name , "customers"."id" FROM customers'),
        ("select * from customers;", 'select * , "customers"."id" from customers;'),
        (
            "SELECT name FROM customers AS c WHERE c.id > 1 ORDER BY 1 LIMIT 2",
            'SELECT name , "c"."id" FROM customers AS c WHERE c.id > 1 ORDER BY 1 LIMIT 2',
        ),
        ("SELECT name FROM main.customers c", 'SELECT name , "c"."id" FROM main.customers c'),
        ('SELECT name FROM "Customers"', 'SELECT name , "customers"."id" FROM "Customers"'),
        (
            "SELECT x FROM customers WHERE (a) IN (1, 2)",
            'SELECT x , "customers"."id" FROM customers WHERE (a) IN (1, 2)',
        ),
        (
            "SELECT 'a FROM b', \"FROM\" /* FROM x */ FROM customers",
            'SELECT \'a FROM b\', "FROM" /* FROM x */ , "customers"."id" FROM customers',
        ),
    ],
)
def test_keyed_variant_appends_the_key(sql: str, expected: str) -> None:
    assert keyed_variant(sql, "customers", KEY) == expected


@pytest.mark.parametrize(
    "sql",
    [
        "SELECT DISTINCT plan FROM customers",
        "SELECT plan FROM customers GROUP BY plan",
        "SELECT plan FROM customers UNION SELECT plan FROM customers",
        "WITH x AS (SELECT 1) SELECT plan FROM customers",
        "SELECT a.plan FROM customers a JOIN customers b ON a.id = b.id",
        "SELECT a.plan FROM customers a, customers b",
        "SELECT plan FROM customers NATURAL JOIN customers",
        "SELECT (SELECT max(id) FROM customers) FROM customers",
        "SELECT id FROM customers WHERE id IN (SELECT id FROM customers)",
        "SELECT id FROM contacts",  # another name: a view, or another table
        "SELECT row_number() OVER () FROM customers",
        "VALUES (1)",
        "SELECT 1",
        "UPDATE customers SET plan = 'x'",
        "SELECT id FROM customers INDEXED BY i",
    ],
)
def test_keyed_variant_declines_other_shapes(sql: str) -> None:
    assert keyed_variant(sql, "customers", KEY) is None


def test_keyed_variant_rowid_and_composite_keys() -> None:
    assert keyed_variant("SELECT a FROM t", "t", ["rowid"]) == 'SELECT a , "t".rowid FROM t'
    assert keyed_variant("SELECT a FROM t", "t", ["x", "y"]) == (
        'SELECT a , "t"."x", "t"."y" FROM t'
    )
    assert keyed_variant('SELECT a FROM t AS "q""r"', "t", KEY) == (
        'SELECT a , "q""r"."id" FROM t AS "q""r"'
    )


def _collect(sql: str) -> _Accesses:
    conn = sqlite3.connect(":memory:")
    conn.executescript(
        "CREATE TABLE customers (id INTEGER PRIMARY KEY, name, email);"
        "CREATE VIEW v AS SELECT id, email FROM customers;"
    )
    acc = _Accesses()
    conn.set_authorizer(acc.collect)
    try:
        conn.execute("EXPLAIN " + sql).fetchall()
    except sqlite3.DatabaseError:
        assert acc.refusal is not None
    return acc


def test_collecting_authorizer_reports_reads_through_views() -> None:
    acc = _collect("SELECT email FROM v")
    assert acc.reads["customers"] == {"id", "email"}
    assert acc.refusal is None and not acc.is_write


def test_collecting_authorizer_reports_writes_and_refusals() -> None:
    acc = _collect("UPDATE customers SET name = 'x' WHERE email = 'y'")
    assert acc.writes == {"customers": {"name"}}
    assert acc.reads["customers"] == {"email"}
    assert _collect("DELETE FROM customers").whole_row_writes == {"customers"}
    assert _collect("PRAGMA table_info(customers)").refusal == "PRAGMA is not allowed"
    assert "ATTACH" in (_collect("ATTACH 'x.db' AS x").refusal or "")
    assert "load_extension" in (_collect("SELECT load_extension('x')").refusal or "")
    assert "transaction" in (_collect("BEGIN").refusal or "")


def test_allow_list_has_no_side_effecting_functions() -> None:
    for name in ("load_extension", "readfile", "writefile", "edit", "fts3_tokenizer"):
        assert name not in ALLOWED_FUNCTIONS


def testparse_request() -> None:
    assert parse_request({"dataset": "crm", "sql": "SELECT 1"}) == ("crm", "SELECT 1", ())
    assert parse_request({"dataset": "crm", "sql": "x", "params": [1, "a", None, 1.5]})[2] == (
        1,
        "a",
        None,
        1.5,
    )
    assert parse_request({"dataset": "crm", "sql": "x", "params": {"a": 1}})[2] == {"a": 1}
    for bad in (
        {"dataset": "", "sql": "x"},
        {"dataset": "crm", "sql": "  "},
        {"dataset": "crm", "sql": "x\x00"},
        {"dataset": "crm", "sql": "x" * 100_001},
        {"dataset": "crm", "sql": "x", "params": [b"x"]},
        {"dataset": "crm", "sql": "x", "params": {"a": [1]}},
        {"dataset": "crm", "sql": "x", "params": 3},
    ):
        with pytest.raises(BadCall):
            parse_request(bad)


def testkey_text() -> None:
    assert key_text([42]) == "42"
    assert key_text(["c-42"]) == "c-42"
    assert key_text([b"\x01\x02"]) == "0102"
    assert key_text([1, "a"]) == '[1,"a"]'
