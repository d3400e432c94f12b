"""The parse-tree floor of what a PostgreSQL statement reads (broker/_pg_reads.py):
every reference resolved to the base column it reads, whatever the shape."""

from __future__ import annotations

import pglast
import pytest
from pglast import ast as pgast

from proctor.broker._pg_reads import Unaccounted, statement_reads

SCHEMA = {
    ("public", "customers"): ["id", "name", "email", "country", "plan", "mrr"],
    ("public", "invoices"): ["id", "customer", "amount"],
    ("sales", "leads"): ["id", "email"],
}
CUSTOMERS = set(SCHEMA[("public", "customers")])


def reads(sql: str) -> dict[str, set[str]]:
    (raw,) = pglast.parse_sql(sql)
    assert isinstance(raw.stmt, pgast.SelectStmt)
    found = statement_reads(raw.stmt, lambda schema, name: SCHEMA.get((schema, name)))
    return {t: {c for c in cols if c} for t, cols in found.items()}


@pytest.mark.parametrize(
    "sql, expected",
    [
        ("SELECT id FROM customers", {"customers": {"id"}}),
        ("SELECT count(*) FROM customers", {"customers": set()}),
        ("SELECT * FROM customers", {"customers": CUSTOMERS}),
        ("SELECT c.* FROM customers c", {"customers": CUSTOMERS}),
        ("SELECT to_jsonb(c) FROM customers c", {"customers": CUSTOMERS}),
        ("SELECT c FROM customers c", {"customers": CUSTOMERS}),
        ("SELECT x FROM (SELECT mrr AS x FROM customers OFFSET 0) s", {"customers": {"mrr"}}),
        ("SELECT s.x FROM (SELECT mrr FROM customers) s(x)", {"customers": {"mrr"}}),
        ("SELECT a FROM customers AS c(a, b)", {"customers": {"id"}}),
        (
            "WITH s AS MATERIALIZED (SELECT id, mrr FROM customers) SELECT * FROM s",
            {"customers": {"id", "mrr"}},
        ),
        (
            "SELECT id FROM customers UNION ALL SELECT mrr FROM customers",
            {"customers": {"id", "mrr"}},
        ),
        (
            "SELECT array_agg(s) FROM (SELECT id, mrr FROM customers OFFSET 0) s",
            {"customers": {"id", "mrr"}},
        ),
        (
            "WITH RECURSIVE r(n, x) AS (SELECT 1, ''::text UNION ALL SELECT n + 1,"
            " (SELECT string_agg(amount::text, ',') FROM invoices WHERE n > 0) FROM r"
            " WHERE n < 2) SELECT c.id, r.x FROM r, customers c",
            {"customers": {"id"}, "invoices": {"amount"}},
        ),
        (
            "SELECT id FROM customers c WHERE EXISTS (SELECT 1 FROM invoices i"
            " WHERE i.customer = c.id AND amount > mrr)",
            {"customers": {"id", "mrr"}, "invoices": {"customer", "amount"}},
        ),
        (
            "SELECT c.id, l.m FROM customers c,"
            " LATERAL (SELECT c2.mrr AS m FROM customers c2 WHERE c2.id = c.id) l",
            {"customers": {"id", "mrr"}},
        ),
        (
            "SELECT j.key FROM customers c, jsonb_each(to_jsonb(c)) j",
            {"customers": CUSTOMERS},
        ),
        (
            "SELECT id FROM customers JOIN invoices USING (id)",
            {"customers": {"id"}, "invoices": {"id"}},
        ),
        ("SELECT mrr AS m FROM customers ORDER BY m", {"customers": {"mrr"}}),
        ("SELECT id FROM customers ORDER BY mrr", {"customers": {"id", "mrr"}}),
        ("SELECT DISTINCT ON (mrr) id FROM customers", {"customers": {"id", "mrr"}}),
        (
            "SELECT id, rank() OVER w FROM customers WINDOW w AS (ORDER BY mrr)",
            {"customers": {"id", "mrr"}},
        ),
        (
            "SELECT country FROM customers GROUP BY 1 HAVING max(mrr) > 1",
            {"customers": {"country", "mrr"}},
        ),
        # A CTE named like a table is the CTE, inside the statement that defines it.
        ("WITH customers AS (SELECT 1 AS id) SELECT id FROM customers", {}),
        ("SELECT email FROM sales.leads", {"sales.leads": {"email"}}),
        # A sub-select reads what it names, whether or not the outer query uses it.
        ("SELECT 1 FROM (SELECT email FROM customers) s", {"customers": {"email"}}),
    ],
)
def test_every_reference_is_resolved_to_what_it_reads(
    sql: str, expected: dict[str, set[str]]
) -> None:
    assert reads(sql) == expected


@pytest.mark.parametrize(
    "sql",
    [
        "SELECT id FROM customers NATURAL JOIN invoices",
        "SELECT nosuch FROM customers",
        "SELECT id FROM nosuch",
        "SELECT c.nosuch FROM customers c",
    ],
)
def test_what_cannot_be_resolved_is_refused(sql: str) -> None:
    with pytest.raises(Unaccounted):
        reads(sql)
