"""RFC 6962 / RFC 9162 Merkle tree hashing and proofs.

Proof generation takes a ``node(start, height)`` function that returns the hash
of the complete, aligned subtree of ``2**height`` leaves starting at leaf
``start``; the ledger serves it from stored tiles, so a proof costs O(log n)
reads. Verification is pure and needs only hashes.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence

from proctor.errors import UsageError, VerificationFailed

HASH_SIZE = 32
NodeFn = Callable[[int, int], bytes]

_sha256 = hashlib.sha256


def leaf_hash(data: bytes) -> bytes:
    return _sha256(b"\x00" + data).digest()


def node_hash(left: bytes, right: bytes) -> bytes:
    return _sha256(b"\x01" + left + right).digest()


EMPTY_ROOT = _sha256(b"").digest()


def _split(n: int) -> int:
    """The largest power of two strictly smaller than ``n`` (n >= 2)."""
    return 1 << ((n - 1).bit_length() - 1)


class _Tree:
    """Hashes of arbitrary ranges, from aligned subtrees, memoised for one proof."""

    def __init__(self, node: NodeFn) -> None:
        self._node = node
        self._memo: dict[tuple[int, int], bytes] = {}

    def mth(self, start: int, end: int) -> bytes:
        n = end - start
        if n & (n - 1) == 0 and start % n == 0:
            return self._node(start, n.bit_length() - 1)
        key = (start, end)
        cached = self._memo.get(key)
        if cached is not None:
            return cached
        k = _split(n)
        h = node_hash(self.mth(start, start + k), self.mth(start + k, end))
        self._memo[key] = h
        return h


def root_from(node: NodeFn, size: int) -> bytes:
    if size == 0:
        return EMPTY_ROOT
    return _Tree(node).mth(0, size)


def inclusion_path(node: NodeFn, index: int, size: int) -> list[bytes]:
    """RFC 9162 §2.1.3.1 PATH(index, D[0:size]), leaf-side first."""
    if not 0 <= index < size:
        raise UsageError(f"index {index} is out of range for a tree of size {size}")
    return path_from_ranges(_Tree(node).mth, index, size)


def path_from_ranges(mth: Callable[[int, int], bytes], index: int, size: int) -> list[bytes]:
    """PATH(index, D[0:size]) given ``mth(start, end)``, the hash of any leaf range
    the path needs (from stored tiles, or from a range an evidence pack carries)."""
    path: list[bytes] = []
    start, end, m = 0, size, index
    while end - start > 1:
        k = _split(end - start)
        if m < k:
            path.append(mth(start + k, end))
            end = start + k
        else:
            path.append(mth(start, start + k))
            start += k
            m -= k
    path.reverse()
    return path


def consistency_path(node: NodeFn, old: int, new: int) -> list[bytes]:
    """RFC 9162 §2.1.4.1 PROOF(old, D[0:new])."""
    if not 0 < old <= new:
        raise UsageError(f"no consistency proof from size {old} to size {new}")
    if old == new:
        return []
    tree = _Tree(node)
    path: list[bytes] = []
    start, end, m, whole = 0, new, old, True
    while True:
        n = end - start
        if m == n:
            if not whole:
                path.append(tree.mth(start, end))
            break
        k = _split(n)
        if m <= k:
            path.append(tree.mth(start + k, end))
            end = start + k
        else:
            path.append(tree.mth(start, start + k))
            start += k
            m -= k
            whole = False
    path.reverse()
    return path


def root_from_inclusion(index: int, size: int, leaf: bytes, path: Sequence[bytes]) -> bytes:
    """RFC 9162 §2.1.3.2: the root that ``path`` proves ``leaf`` is under."""
    if not 0 <= index < size:
        raise VerificationFailed(f"inclusion proof: index {index} is not below size {size}")
    fn, sn, r = index, size - 1, leaf
    for p in path:
        if sn == 0:
            raise VerificationFailed("inclusion proof is longer than the tree is deep")
        if fn & 1 or fn == sn:
            r = node_hash(p, r)
            while not fn & 1 and fn != 0:
                fn >>= 1
                sn >>= 1
        else:
            r = node_hash(r, p)
        fn >>= 1
        sn >>= 1
    if sn != 0:
        raise VerificationFailed("inclusion proof is shorter than the tree is deep")
    return r


def verify_inclusion(
    index: int, size: int, leaf: bytes, path: Sequence[bytes], root: bytes
) -> None:
    if root_from_inclusion(index, size, leaf, path) != root:
        raise VerificationFailed(
            f"inclusion proof for index {index} does not lead to the root of size {size}"
        )


def verify_consistency(
    old: int, new: int, old_root: bytes, new_root: bytes, path: Sequence[bytes]
) -> None:
    """RFC 9162 §2.1.4.2; raises VerificationFailed unless ``new`` extends ``old``."""
    if not 0 < old <= new:
        raise VerificationFailed(f"no consistency between sizes {old} and {new}")
    if old == new:
        if path or old_root != new_root:
            raise VerificationFailed(f"two different roots for the same size {old}")
        return
    nodes = list(path)
    if old & (old - 1) == 0:
        nodes.insert(0, old_root)
    if not nodes:
        raise VerificationFailed("consistency proof is empty")
    fn, sn = old - 1, new - 1
    while fn & 1:
        fn >>= 1
        sn >>= 1
    fr = sr = nodes[0]
    for c in nodes[1:]:
        if sn == 0:
            raise VerificationFailed("consistency proof is too long")
        if fn & 1 or fn == sn:
            fr = node_hash(c, fr)
            sr = node_hash(c, sr)
            while not fn & 1 and fn != 0:
                fn >>= 1
                sn >>= 1
        else:
            sr = node_hash(sr, c)
        fn >>= 1
        sn >>= 1
    if sn != 0 or fr != old_root or sr != new_root:
        raise VerificationFailed(f"the tree of size {new} does not extend the tree of size {old}")


class CompactRange:
    """The peaks of a growing tree: O(log n) state from which the root follows.

    ``on_node(height, hash)`` is told of every complete subtree as it forms, so
    the caller can fill tiles (heights 8, 16, ...) while appending.
    """

    __slots__ = ("peaks", "size")

    def __init__(self, size: int = 0, peaks: list[tuple[int, bytes]] | None = None) -> None:
        self.size = size
        self.peaks: list[tuple[int, bytes]] = peaks or []

    @classmethod
    def from_tree(cls, node: NodeFn, size: int) -> CompactRange:
        peaks: list[tuple[int, bytes]] = []
        start = 0
        for height in range(size.bit_length() - 1, -1, -1):
            if size >> height & 1:
                peaks.append((height, node(start, height)))
                start += 1 << height
        return cls(size, peaks)

    def push(self, leaf: bytes, on_node: Callable[[int, bytes], None] | None = None) -> None:
        peaks = self.peaks
        height, h = 0, leaf
        while peaks and peaks[-1][0] == height:
            h = node_hash(peaks.pop()[1], h)
            height += 1
            if on_node is not None:
                on_node(height, h)
        peaks.append((height, h))
        self.size += 1

    def root(self) -> bytes:
        if not self.peaks:
            return EMPTY_ROOT
        h = self.peaks[-1][1]
        for _, p in reversed(self.peaks[:-1]):
            h = node_hash(p, h)
        return h
