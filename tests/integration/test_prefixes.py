"""A person may type any unique prefix of a run or approval id, on either engine."""

from __future__ import annotations

import pytest

from proctor.errors import NotFound, UsageError
from proctor.governance._prefixes import find_by_prefix
from proctor.store import open_store

IDS = ("r-0a1b2c3d4e5f", "r-0a1b99999999", "r-7777aaaa0000", "r-7777", "x%_-1234")


def test_exact_ids_win_prefixes_resolve_and_ambiguity_is_an_error(store_url: str) -> None:
    store = open_store(store_url, create=True)
    try:
        with store.write() as conn:
            conn.execute("CREATE TABLE things (id TEXT PRIMARY KEY, tenant TEXT, n INTEGER)")
            for n, i in enumerate(IDS):
                conn.execute("INSERT INTO things VALUES (?, ?, ?)", (i, "acme", n))
            conn.execute("INSERT INTO things VALUES (?, ?, ?)", ("r-beef00000000", "other", 9))

        def find(given: str, tenant: str = "acme") -> int:
            with store.read() as conn:
                row = find_by_prefix(
                    conn, "things", "id, n", tenant, given, noun="thing", hint="list them"
                )
            return int(row[1])

        assert find("r-0a1b2c3d4e5f") == 0
        assert find("r-0a1b2") == 0
        assert find(" r-0a1b9 ") == 1
        assert find("r-7777") == 3  # an exact id wins over the longer ids it starts
        assert find("x%_-") == 4  # pattern characters are plain characters
        with pytest.raises(UsageError, match=r"ambiguous: 2 thing ids .*r-0a1b2c3d4e5f"):
            find("r-0a1b")
        with pytest.raises(NotFound, match="no thing 'r-0'"):
            find("r-0")  # too short to be meant
        with pytest.raises(NotFound, match="no thing 'r-%'"):
            find("r-%")
        with pytest.raises(NotFound):
            find("r-beef")  # another tenant's id is not found, not ambiguous
        assert find("r-beef", tenant="other") == 9
    finally:
        store.close()
