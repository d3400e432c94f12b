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
        # Too short to be taken, and refused with how many it matches, not "no thing".
        with pytest.raises(UsageError, match=r"'r-0' is ambiguous: 2 thing ids") as short:
            find("r-0")
        assert "at least 4 characters" in str(short.value.hint)
        with pytest.raises(UsageError, match=r"'r-' is ambiguous: 4 thing ids"):
            find("r-")  # the other tenant's r-beef… is not counted
        with pytest.raises(NotFound, match="no thing 'r-9'"):
            find("r-9")  # short, and matching nothing: not found
        with pytest.raises(NotFound, match="no thing 'r-%'"):
            find("r-%")
        with pytest.raises(NotFound):
            find("r-beef")  # another tenant's id is not found, not ambiguous
        assert find("r-beef", tenant="other") == 9
    finally:
        store.close()


def test_a_name_several_rows_share_resolves_to_that_name(store_url: str) -> None:
    """A deployment's name (one row per version): an exact name, or a unique prefix of
    one; two names starting alike are ambiguous however many versions each has."""
    from proctor.governance._prefixes import resolve_prefix

    store = open_store(store_url, create=True)
    try:
        with store.write() as conn:
            conn.execute("CREATE TABLE deps (name TEXT, tenant TEXT, version INTEGER)")
            for name, versions in (("nightly-report", 3), ("batch-daily", 2),
                                   ("batch-weekly", 1), ("batch", 1)):  # fmt: skip
                for v in range(versions):
                    conn.execute("INSERT INTO deps VALUES (?, ?, ?)", (name, "acme", v))
            conn.execute("INSERT INTO deps VALUES (?, ?, ?)", ("hourly-sync", "other", 1))

        def resolve(given: str, tenant: str = "acme") -> str:
            with store.read() as conn:
                return resolve_prefix(conn, "deps", "name", tenant, given, noun="deployment",
                                      what="name", hint="list them")  # fmt: skip

        assert resolve("nightly-report") == "nightly-report"
        assert resolve("nigh") == "nightly-report"  # three versions, one name
        assert resolve("batch") == "batch"  # an exact name wins
        assert resolve("batch-d ") == "batch-daily"
        with pytest.raises(UsageError, match=r"ambiguous: 3 deployment names .*batch-daily"):
            resolve("batc")
        with pytest.raises(NotFound, match="no deployment 'hourly'"):
            resolve("hourly")  # another tenant's
        with pytest.raises(UsageError, match="'nig' is too short to name a deployment"):
            resolve("nig")  # one name starts with it, but too short to be meant
        with pytest.raises(UsageError, match=r"'b' is ambiguous: 3 deployment names"):
            resolve("b")
    finally:
        store.close()


def test_an_ambiguous_prefix_is_refused_with_its_exact_count(store_url: str) -> None:
    """Past the five ids shown, the count is still the count (docs/cli.md), not "more
    than 5"; short prefixes are counted the same way."""
    store = open_store(store_url, create=True)
    try:
        with store.write() as conn:
            conn.execute("CREATE TABLE things (id TEXT PRIMARY KEY, tenant TEXT, n INTEGER)")
            for n in range(12):
                conn.execute("INSERT INTO things VALUES (?, ?, ?)", (f"r-aaaa{n:08x}", "acme", n))
        for given in ("r-aaaa0", "r-", "r"):
            with store.read() as conn, pytest.raises(UsageError, match="ambiguous: 12 thing ids"):
                find_by_prefix(conn, "things", "id", "acme", given, noun="thing", hint="-")
    finally:
        store.close()
