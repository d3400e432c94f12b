"""A home whose real run read 10,000 rows, read back as a standard tlog-tiles client
would: the checkpoint, every entry bundle (``tile/entries/N[.p/W]``), every tile of
every level, through the API. The client below is the test's own (paths, bundle
parsing, the tree rebuilt from the entries, proofs built from the served tiles): it
shares no code with the server but the hash functions' definitions."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import httpx
import pytest

from proctor.api import ApiServer, serve_api
from proctor.evidence import key_hmac, lineage
from proctor.ledger import (
    MAX_EVENT_BYTES,
    Actor,
    EventDraft,
    Verifier,
    check_lineage_object,
    leaf_hash,
    node_hash,
    open_checkpoint,
    path_from_ranges,
    read_objects,
    verify_inclusion,
)
from proctor.lifecycle import Supervisor
from tests.e2e.conftest_gov import Gov, build_gov, make_crm
from tests.sandbox_conftest_helpers import any_backend

pytestmark = pytest.mark.sandbox

ROWS = 10_000
MAIN = """
import proctor_guest
out = proctor_guest.sql("big", "SELECT id, country FROM customers")
print("read", out["row_count"], "rows, truncated:", out["truncated"])
"""
CAPS = """
[datasets.big.tables.customers]
columns = ["id", "country"]
access = "read"
"""


@dataclass
class Populated:
    gov: Gov
    server: ApiServer
    token: str  # an auditor's
    stdout: str


@pytest.fixture(scope="module")
def populated(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Populated]:
    tmp = tmp_path_factory.mktemp("served-log")
    gov = build_gov(tmp)
    rt = gov.rt
    make_crm(tmp / "big.db", ROWS)
    rt.resources.add_dataset("acme", "big", tmp / "big.db", gov.op, synthetic=True)
    digest = gov.submit("acme", gov.artifact_dir("bigread", MAIN, CAPS))
    rt.deployments.deploy("acme", rt.artifacts.get("acme", digest), "bigread",
                          environment="sandbox", mode="job", instruction="test", actor=gov.op)  # fmt: skip
    out: list[bytes] = []
    with rt.make_broker() as broker:
        Supervisor(rt, broker, any_backend()[0]).start(
            "acme", "bigread", gov.principal("dev").actor, on_stdout=out.append
        )
    # Past one full tile: full and partial tiles and bundles at level 0, a partial
    # tile at level 1.
    actor = Actor("operator", "test")
    rt.ledger.append_many("acme", [EventDraft(actor, "test.event", f"t/{i}") for i in range(300)])
    _, token = rt.principals.create("acme", "served-aud", "user", ["auditor"], gov.op)
    server = serve_api(rt, "127.0.0.1", 0)
    yield Populated(gov, server, token, b"".join(out).decode())
    server.stop()
    rt.close()


# -- the test's own tlog-tiles client -------------------------------------------------


def _tile(level: int | str, index: int, width: int) -> str:
    """``tile/<L>/<N>[.p/<W>]``, N in groups of three digits, all but the last led by x."""
    digits = str(index)
    digits = "0" * (-len(digits) % 3) + digits
    groups = [digits[i : i + 3] for i in range(0, len(digits), 3)]
    name = "/".join([*(f"x{g}" for g in groups[:-1]), groups[-1]])
    return f"tile/{level}/{name}" + ("" if width == 256 else f".p/{width}")


def _bundle(data: bytes) -> list[bytes]:
    """An entry bundle: each entry a big-endian uint16 length, then its bytes."""
    entries, at = [], 0
    while at < len(data):
        n = int.from_bytes(data[at : at + 2], "big")
        assert at + 2 + n <= len(data), "a bundle's entry runs past its end"
        entries.append(data[at + 2 : at + 2 + n])
        at += 2 + n
    return entries


def _root(hashes: list[bytes]) -> bytes:
    if len(hashes) == 1:
        return hashes[0]
    k = 1 << ((len(hashes) - 1).bit_length() - 1)
    return node_hash(_root(hashes[:k]), _root(hashes[k:]))


def _read(
    get: Callable[[str], bytes], size: int
) -> tuple[list[bytes], dict[tuple[int, int], bytes]]:
    """Every entry and every tile of a tree of ``size`` leaves, each one checked
    against the level below, rebuilt from the entries."""
    entries: list[bytes] = []
    for index in range((size + 255) // 256):
        width = min(256, size - 256 * index)
        got = _bundle(get(_tile("entries", index, width)))
        assert len(got) == width, f"bundle {index}: {len(got)} entries, not {width}"
        entries += got
    tiles: dict[tuple[int, int], bytes] = {}
    below = [leaf_hash(e) for e in entries]
    level = 0
    while below:
        for index in range((len(below) + 255) // 256):
            want = below[256 * index : 256 * index + 256]
            tile = get(_tile(level, index, len(want)))
            assert tile == b"".join(want), f"tile {level}/{index} differs from the entries"
            tiles[(level, index)] = tile
        below = [_root(below[i : i + 256]) for i in range(0, len(below) - 255, 256)]
        level += 1
    return entries, tiles


def _node_from_tiles(tiles: dict[tuple[int, int], bytes]) -> Callable[[int, int], bytes]:
    """mth(start, end) of any leaf range, from the served tiles alone."""

    def node(start: int, height: int) -> bytes:
        level, rest = divmod(height, 8)
        first = start >> (8 * level)
        index, offset = divmod(first, 256)
        tile = tiles[(level, index)]
        hashes = [tile[32 * i : 32 * i + 32] for i in range(offset, offset + (1 << rest))]
        return _root(hashes)

    def mth(start: int, end: int) -> bytes:
        n = end - start
        if n & (n - 1) == 0 and start % n == 0:
            return node(start, n.bit_length() - 1)
        k = 1 << ((n - 1).bit_length() - 1)
        return node_hash(mth(start, start + k), mth(start + k, end))

    return mth


def test_a_tlog_client_reads_every_entry_of_a_log_with_a_10000_row_read(
    populated: Populated,
) -> None:
    assert f"read {ROWS} rows, truncated: False" in populated.stdout
    rt = populated.gov.rt
    headers = {"Authorization": f"Bearer {populated.token}"}
    with httpx.Client(base_url=populated.server.url, headers=headers, timeout=30) as http:

        def get(p: str) -> bytes:
            r = http.get(f"/tenants/acme/log/{p}")
            assert r.status_code == 200, f"{p}: {r.status_code} {r.text}"
            return r.content

        cp = open_checkpoint(
            get("checkpoint").decode(), Verifier.parse(rt.ledger.vkey()), rt.ledger.origin("acme")
        )
        assert cp.size > 256
        entries, tiles = _read(get, cp.size)

    # The tree rebuilt from the entries is the signed one, and every entry is proven
    # included from the served tiles.
    assert _root([leaf_hash(e) for e in entries]) == cp.root
    mth = _node_from_tiles(tiles)
    for i, e in enumerate(entries):
        verify_inclusion(i, cp.size, leaf_hash(e), path_from_ranges(mth, i, cp.size), cp.root)
    assert all(len(e) <= MAX_EVENT_BYTES for e in entries)

    # The 10,000-row read is one small entry; its rows are in its lineage object.
    (read,) = [json.loads(e) for e in entries if b'"sql.select"' in e]
    assert read["decision"] == "allow" and read["details"]["row_count"] == ROWS
    ref = read["details"]["lineage_object"]
    assert ref["count"] == ROWS
    objects = read_objects(rt.store, "acme", [ref["digest"]])
    assert check_lineage_object(ref, objects[ref["digest"]]) is None
    # Lineage finds a row from the middle, and the run that read it.
    doc = lineage(rt, "acme", "big", str(ROWS // 2))
    assert doc["key_hmac"] == key_hmac(rt.keys.lineage_key("acme"), str(ROWS // 2))
    assert [r["run"] for r in doc["read"]] == [read["run"]]
    assert doc["possibly"] == []
