"""SQL through the broker's authorizer, on a fixed schema in two files that differ only
in the denied cells: no denied marker in any answer, and the same answer from both."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from pathlib import Path

import _harness

_harness.instrumented("proctor.broker._sql")

from tests.fuzz._support import sqlite_ledger  # noqa: E402
from tests.fuzz.test_fuzz_sql import (  # noqa: E402
    Env,
    Schema,
    Table,
    View,
    ask,
    assert_no_leak,
    build,
    scope_for,
)

from proctor.broker import BrokerError  # noqa: E402

customers = Table(0, "customers", ["id", "name", "email", "country"], "ipk", {"name", "country"})
customers.ipk = "id"
events = Table(1, "events", ["email", "kind", "note"], "text", {"kind"})
SCHEMA = Schema([customers, events], [View("v0", customers, ["name", "email"], {"name"})])

SEEDS = [
    b"SELECT name FROM customers",
    b"SELECT name, country FROM customers WHERE country > 'M' ORDER BY name LIMIT 2",
    b"SELECT c.name FROM customers c JOIN events e ON e.kind = c.country",
    b"WITH x AS (SELECT name AS v FROM customers) SELECT group_concat(v) FROM x",
    b"SELECT name AS n\xc2\xa0FROM\xc2\xa0customers\xc2\xa0WHERE, name FROM customers",
    b"SELECT kind FROM events UNION SELECT name FROM customers",
]


def main() -> None:
    scratch = Path(tempfile.mkdtemp(prefix="proctor-fuzz-sql-"))
    loop = asyncio.new_event_loop()
    try:
        with sqlite_ledger(scratch) as ledger:
            env = Env(scratch, ledger, loop)
            build(SCHEMA, scratch / "a.db", "a")
            build(SCHEMA, scratch / "b.db", "b")
            a_scope = scope_for(env, SCHEMA, scratch / "a.db")
            b_scope = scope_for(env, SCHEMA, scratch / "b.db")

            def test_one_input(data: bytes) -> None:
                sql = data.decode("utf-8", "replace")
                a = ask(env, a_scope, sql, [])
                b = ask(env, b_scope, sql, [])
                assert_no_leak(SCHEMA, a, sql)
                assert_no_leak(SCHEMA, b, sql)
                if isinstance(a, BrokerError) or isinstance(b, BrokerError):
                    assert type(a) is type(b), (sql, a, b)
                else:
                    assert a == b, f"{sql!r} answers differently when only denied cells differ"

            _harness.run(test_one_input, SEEDS)
    finally:
        loop.close()
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
