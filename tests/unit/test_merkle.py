"""Merkle proofs checked against an independent, recursive reading of RFC 9162."""

from __future__ import annotations

import hashlib

import pytest
from hypothesis import given
from hypothesis import strategies as st

from proctor.errors import UsageError, VerificationFailed
from proctor.ledger import verify_consistency, verify_inclusion
from proctor.ledger._merkle import (
    CompactRange,
    consistency_path,
    inclusion_path,
    root_from,
)

# --- an independent reference, written from the RFC's recursive definitions ---


def _h(b: bytes) -> bytes:
    return hashlib.sha256(b).digest()


def ref_mth(leaves: list[bytes]) -> bytes:
    if not leaves:
        return _h(b"")
    if len(leaves) == 1:
        return _h(b"\x00" + leaves[0])
    k = 1
    while k * 2 < len(leaves):
        k *= 2
    return _h(b"\x01" + ref_mth(leaves[:k]) + ref_mth(leaves[k:]))


def _k(n: int) -> int:
    k = 1
    while k * 2 < n:
        k *= 2
    return k


def ref_root_from_path(m: int, n: int, leaf: bytes, path: list[bytes]) -> bytes:
    """Undo PATH(m, D[n]) recursively: the last element is the top-level sibling."""
    if n == 1:
        assert path == []
        return leaf
    assert path, "path too short"
    k = _k(n)
    *rest, last = path
    if m < k:
        return _h(b"\x01" + ref_root_from_path(m, k, leaf, rest) + last)
    return _h(b"\x01" + last + ref_root_from_path(m - k, n - k, leaf, rest))


def ref_roots_from_consistency(
    m: int, n: int, proof: list[bytes], b: bool, old_root: bytes
) -> tuple[bytes, bytes]:
    """Undo SUBPROOF(m, D[n], b): returns the (old, new) subtree hashes it proves."""
    if m == n:
        if b:
            assert proof == []
            return old_root, old_root
        assert len(proof) == 1
        return proof[0], proof[0]
    k = _k(n)
    *rest, last = proof
    if m <= k:
        o, nw = ref_roots_from_consistency(m, k, rest, b, old_root)
        return o, _h(b"\x01" + nw + last)
    o, nw = ref_roots_from_consistency(m - k, n - k, rest, False, old_root)
    return _h(b"\x01" + last + o), _h(b"\x01" + last + nw)


class MemTree:
    """Aligned subtree hashes computed naively, to drive the proof generators."""

    def __init__(self, n: int) -> None:
        self.leaves = [f"leaf-{i}".encode() for i in range(n)]

    def node(self, start: int, height: int) -> bytes:
        return ref_mth(self.leaves[start : start + (1 << height)])


def test_empty_and_single_roots() -> None:
    t = MemTree(1)
    assert root_from(t.node, 0) == hashlib.sha256(b"").digest()
    assert root_from(t.node, 1) == _h(b"\x00leaf-0")


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 7, 8, 9, 31, 64, 100])
def test_inclusion_every_index_small(n: int) -> None:
    t = MemTree(n)
    root = ref_mth(t.leaves)
    for m in range(n):
        path = inclusion_path(t.node, m, n)
        leaf = _h(b"\x00" + t.leaves[m])
        assert ref_root_from_path(m, n, leaf, path) == root
        verify_inclusion(m, n, leaf, path, root)


def test_compact_range_matches_reference() -> None:
    t = MemTree(300)
    cr = CompactRange()
    for i, leaf in enumerate(t.leaves):
        cr.push(_h(b"\x00" + leaf))
        assert cr.root() == ref_mth(t.leaves[: i + 1])


@given(st.data())
def test_inclusion_rejects_any_wrong_input(data: st.DataObject) -> None:
    n = data.draw(st.integers(2, 200))
    m = data.draw(st.integers(0, n - 1))
    t = MemTree(n)
    root = ref_mth(t.leaves)
    path = inclusion_path(t.node, m, n)
    leaf = _h(b"\x00" + t.leaves[m])
    verify_inclusion(m, n, leaf, path, root)
    other = data.draw(st.integers(0, n - 1).filter(lambda x: x != m))
    with pytest.raises(VerificationFailed):
        verify_inclusion(other, n, leaf, path, root)
    if path:
        i = data.draw(st.integers(0, len(path) - 1))
        bad = list(path)
        bad[i] = bytes(32)
        with pytest.raises(VerificationFailed):
            verify_inclusion(m, n, leaf, bad, root)
        with pytest.raises(VerificationFailed):
            verify_inclusion(m, n, leaf, path[:-1], root)
    with pytest.raises(VerificationFailed):
        verify_inclusion(m, n, leaf, [*path, bytes(32)], root)


@given(st.data())
def test_consistency_against_reference(data: st.DataObject) -> None:
    n = data.draw(st.integers(1, 300))
    m = data.draw(st.integers(1, n))
    t = MemTree(n)
    old_root, new_root = ref_mth(t.leaves[:m]), ref_mth(t.leaves)
    proof = consistency_path(t.node, m, n)
    if m < n:
        assert ref_roots_from_consistency(m, n, proof, True, old_root) == (old_root, new_root)
    verify_consistency(m, n, old_root, new_root, proof)
    if m < n:
        with pytest.raises(VerificationFailed):
            verify_consistency(m, n, old_root, _h(b"x"), proof)
        with pytest.raises(VerificationFailed):
            verify_consistency(m, n, _h(b"x"), new_root, proof)
        i = data.draw(st.integers(0, len(proof) - 1))
        bad = list(proof)
        bad[i] = bytes(32)
        with pytest.raises(VerificationFailed):
            verify_consistency(m, n, old_root, new_root, bad)


def test_out_of_range_requests_are_refused() -> None:
    t = MemTree(4)
    with pytest.raises(UsageError):
        inclusion_path(t.node, 4, 4)
    with pytest.raises(UsageError):
        consistency_path(t.node, 0, 4)
    with pytest.raises(UsageError):
        consistency_path(t.node, 5, 4)
    with pytest.raises(VerificationFailed):
        verify_inclusion(4, 4, bytes(32), [], bytes(32))
