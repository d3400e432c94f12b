"""A C2SP tlog-tiles client of the tests' own: it fetches a checkpoint, tiles and
entry bundles by path and checks them with its own RFC 6962 code (nothing of the
ledger's Merkle code), so a served log or a static export is read the way any
standard client would read it. No tests here."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass

from proctor.ledger import Checkpoint, Verifier, open_checkpoint

#: Bytes at a path, or None when the path is not there (a 404).
Fetch = Callable[[str], bytes | None]


def path(level: int | str, n: int, width: int = 256) -> str:
    digits = str(n).rjust(3 * max(1, -(-len(str(n)) // 3)), "0")
    groups = [digits[i : i + 3] for i in range(0, len(digits), 3)]
    name = "/".join([*(f"x{g}" for g in groups[:-1]), groups[-1]])
    return f"tile/{level}/{name}" + ("" if width == 256 else f".p/{width}")


def _leaf(data: bytes) -> bytes:
    return hashlib.sha256(b"\x00" + data).digest()


def _node(left: bytes, right: bytes) -> bytes:
    return hashlib.sha256(b"\x01" + left + right).digest()


def mth(leaves: list[bytes]) -> bytes:
    """RFC 6962 Merkle Tree Hash of leaf hashes."""
    if not leaves:
        return hashlib.sha256(b"").digest()
    if len(leaves) == 1:
        return leaves[0]
    k = 1 << ((len(leaves) - 1).bit_length() - 1)
    return _node(mth(leaves[:k]), mth(leaves[k:]))


def audit_path(m: int, leaves: list[bytes]) -> list[bytes]:
    """RFC 6962 PATH(m, D[n])."""
    if len(leaves) <= 1:
        return []
    k = 1 << ((len(leaves) - 1).bit_length() - 1)
    if m < k:
        return [*audit_path(m, leaves[:k]), mth(leaves[k:])]
    return [*audit_path(m - k, leaves[k:]), mth(leaves[:k])]


def root_from_path(index: int, size: int, leaf: bytes, proof: list[bytes]) -> bytes:
    """RFC 9162 2.1.3.2: the root an inclusion proof leads to."""
    fn, sn, r = index, size - 1, leaf
    for p in proof:
        if sn == 0:
            raise AssertionError("inclusion proof too long")
        if fn & 1 or fn == sn:
            r = _node(p, r)
            while not fn & 1 and fn:
                fn, sn = fn >> 1, sn >> 1
        else:
            r = _node(r, p)
        fn, sn = fn >> 1, sn >> 1
    assert sn == 0, "inclusion proof too short"
    return r


@dataclass
class TreeRead:
    checkpoint: Checkpoint
    entries: list[bytes]
    leaves: list[bytes]
    fetched: list[str]


def read_tree(fetch: Fetch, size: int) -> tuple[list[bytes], list[bytes], list[str]]:
    """Every tile (all levels) and entry bundle of the tree of ``size``: returns its
    entries and leaf hashes after checking each tile hash and entry against them."""
    fetched: list[str] = []

    def get(p: str) -> bytes:
        fetched.append(p)
        data = fetch(p)
        assert data is not None, f"{p} is not there"
        return data

    leaves: list[bytes] = []
    entries: list[bytes] = []
    for n in range(-(-size // 256)):
        width = min(256, size - n * 256)
        tile = get(path(0, n, width))
        assert len(tile) == 32 * width, f"tile 0/{n} is {len(tile)} bytes"
        hashes = [tile[i : i + 32] for i in range(0, len(tile), 32)]
        fetched.append(path("entries", n, width))
        bundle = fetch(path("entries", n, width))
        if bundle is None and width < 256:
            # C2SP tlog-tiles: a partial bundle may be gone once its full one exists.
            bundle = get(path("entries", n))
        assert bundle is not None, f"{path('entries', n, width)} is not there"
        got: list[bytes] = []
        at = 0
        while at < len(bundle) and len(got) < width:
            length = int.from_bytes(bundle[at : at + 2], "big")
            got.append(bundle[at + 2 : at + 2 + length])
            at += 2 + length
        assert len(got) == width, f"bundle {n} holds {len(got)} entries, not {width}"
        assert [_leaf(e) for e in got] == hashes, f"bundle {n} does not hash to tile 0/{n}"
        leaves += hashes
        entries += got
    level = 1
    while size >> (8 * level):
        count, span = size >> (8 * level), 256**level
        for n in range(-(-count // 256)):
            width = min(256, count - n * 256)
            tile = get(path(level, n, width))
            assert len(tile) == 32 * width
            for j in range(width):
                first = (n * 256 + j) * span
                want = mth(leaves[first : first + span])
                assert tile[32 * j : 32 * j + 32] == want, f"tile {level}/{n} hash {j}"
        level += 1
    return entries, leaves, fetched


def read_log(fetch: Fetch, verifier: Verifier, origin: str) -> TreeRead:
    """The log as a standard client reads it: the signed checkpoint, then every
    tile and bundle of its tree; the root from the tiles is the signed one, and
    an inclusion proof of a few entries leads to it."""
    note = fetch("checkpoint")
    assert note is not None, "no checkpoint"
    cp = open_checkpoint(note.decode(), verifier, origin)
    entries, leaves, fetched = read_tree(fetch, cp.size)
    assert mth(leaves) == cp.root, "the tiles do not hash to the signed root"
    for index in {0, cp.size // 2, cp.size - 1}:
        proof = audit_path(index, leaves)
        assert root_from_path(index, cp.size, leaves[index], proof) == cp.root
    return TreeRead(cp, entries, leaves, fetched)
