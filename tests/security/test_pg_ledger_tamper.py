"""Tampering with a log stored in PostgreSQL makes verification fail, as on SQLite.

Someone with write access to the database (a DBA, a stolen credential) edits
the ledger's tables directly; each case starts from a copy of one pristine
database (``CREATE DATABASE ... TEMPLATE``).
"""

from __future__ import annotations

from collections.abc import Iterator

import psycopg
import pytest

from proctor.errors import VerificationFailed
from proctor.ledger import Ledger, Signer
from proctor.store import open_store
from proctor.testing import PostgresServer
from tests.conftest import draft

pytestmark = pytest.mark.postgres

N = 120
SIGNER = Signer.generate("test.local")


@pytest.fixture(scope="module")
def pristine(pg_server: PostgresServer) -> Iterator[str]:
    name = "proctor_tamper_pristine"
    dsn = pg_server.create_database(name)
    store = open_store(dsn, create=True)
    ledger = Ledger(store, SIGNER, "test.local")
    ledger.create_log("acme", draft(0))
    for i in range(1, N):
        ledger.append("acme", draft(i, note="x" * (i % 7)))
    ledger.close()
    store.close()
    yield name
    pg_server.drop_database(name)


@pytest.fixture
def copy(pg_server: PostgresServer, pristine: str, request: pytest.FixtureRequest) -> Iterator[str]:
    name = f"proctor_tamper_{abs(hash(request.node.nodeid)) % 10**9}"
    yield pg_server.create_database(name, template=pristine)
    pg_server.drop_database(name)


def _verify(dsn: str) -> None:
    store = open_store(dsn)
    ledger = Ledger(store, SIGNER, "test.local")
    try:
        ledger.verify("acme")
    finally:
        ledger.close()
        store.close()


def _mutate(dsn: str, *statements: str) -> None:
    with psycopg.connect(dsn) as conn:
        for sql in statements:
            conn.execute(sql)


def test_pristine_copy_verifies(copy: str) -> None:
    _verify(copy)


@pytest.mark.parametrize(
    "statements",
    [
        # One bit of one event.
        [
            "UPDATE ledger_entries SET data = set_byte(data, 20, get_byte(data, 20) # 1)"
            " WHERE seq = 57"
        ],
        # An event deleted, the later ones renumbered to close the gap.
        [
            "DELETE FROM ledger_entries WHERE seq = 33",
            "UPDATE ledger_entries SET seq = seq - 1 WHERE seq > 33",
        ],
        # Two events swapped.
        [
            "UPDATE ledger_entries e SET data = o.data FROM ledger_entries o"
            " WHERE e.log = o.log AND ((e.seq = 10 AND o.seq = 11) OR (e.seq = 11 AND o.seq = 10))"
        ],
        # The log truncated, its head and checkpoints rewound to match.
        ["DELETE FROM ledger_entries WHERE seq >= 100", "UPDATE ledger_logs SET size = 100"],
        # A stored tile hash changed.
        [
            "UPDATE ledger_tiles SET hashes = set_byte(hashes, 0, get_byte(hashes, 0) # 255)"
            " WHERE level = 0 AND idx = 0"
        ],
        # A checkpoint replaced by a forged one.
        [
            "UPDATE ledger_checkpoints SET note = replace(note, 'test.local', 'evil.local')"
            " WHERE size = 60"
        ],
    ],
    ids=["bit", "delete", "swap", "truncate", "tile", "checkpoint"],
)
def test_direct_edits_in_the_database_fail_verification(copy: str, statements: list[str]) -> None:
    _mutate(copy, *statements)
    with pytest.raises(VerificationFailed):
        _verify(copy)
