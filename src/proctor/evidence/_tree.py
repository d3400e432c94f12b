"""One proof for a whole contiguous range of a log: the range multi-proof.

An evidence pack holds every event of its period, so the inclusion of all of
them in the end checkpoint's tree is proved at once by the hashes of what lies
outside the range: the aligned subtrees left of it (one per set bit of its
start) and the aligned subtrees right of it, up to the tree size. With the
events themselves, that is enough to rebuild the root, and to derive the RFC
9162 inclusion proof of any one event offline. Per-event proofs written out
would be ~1 GB for a million events; these are O(log n) hashes.
"""

from __future__ import annotations

import base64
import hashlib
from collections.abc import Callable, Sequence
from typing import Any

from proctor.errors import VerificationFailed
from proctor.ledger import node_hash, path_from_ranges

NodeFn = Callable[[int, int], bytes]
_sha256 = hashlib.sha256


def left_blocks(start: int) -> list[tuple[int, int]]:
    """The aligned subtrees (start, height) that tile [0, start), largest first."""
    out: list[tuple[int, int]] = []
    pos = 0
    for height in range(start.bit_length() - 1, -1, -1):
        if start >> height & 1:
            out.append((pos, height))
            pos += 1 << height
    return out


def right_blocks(end: int, size: int) -> list[tuple[int, int]]:
    """The aligned subtrees (start, height) that tile [end, size), greedily from ``end``."""
    out: list[tuple[int, int]] = []
    pos = end
    while pos < size:
        height = 0
        while pos % (2 << height) == 0 and pos + (2 << height) <= size:
            height += 1
        out.append((pos, height))
        pos += 1 << height
    return out


def _b64(h: bytes) -> str:
    return base64.b64encode(h).decode()


def range_proof(node: NodeFn, start: int, end: int, size: int) -> dict[str, Any]:
    """The multi-proof for leaves [start, end) of the tree of ``size`` leaves."""
    return {
        "start": start,
        "end": end,
        "size": size,
        "left": [_b64(node(s, h)) for s, h in left_blocks(start)],
        "right": [_b64(node(s, h)) for s, h in right_blocks(end, size)],
    }


def _split(n: int) -> int:
    return 1 << ((n - 1).bit_length() - 1)


class RangeTree:
    """The tree of ``size`` leaves, known inside [start, end) and at the proof's blocks."""

    def __init__(
        self,
        start: int,
        leaves: Sequence[bytes],
        size: int,
        left: Sequence[bytes],
        right: Sequence[bytes],
    ) -> None:
        end = start + len(leaves)
        if not 0 <= start <= end <= size:
            raise VerificationFailed(
                f"range proof: leaves {start} to {end} do not fit a tree of {size}"
            )
        lb, rb = left_blocks(start), right_blocks(end, size)
        if len(left) != len(lb) or len(right) != len(rb):
            raise VerificationFailed(
                "range proof: wrong number of boundary hashes "
                f"({len(left)} + {len(right)}, expected {len(lb)} + {len(rb)})"
            )
        self.start, self.end, self.size = start, end, size
        self.known: dict[tuple[int, int], bytes] = {}
        for (s, h), value in zip([*lb, *rb], [*left, *right], strict=True):
            self.known[(s, s + (1 << h))] = value
        # levels[h] = (index of the first aligned block of 2**h leaves inside the
        # range, the hashes of every such block): one pass, ~n hashes in all.
        self.levels: list[tuple[int, list[bytes]]] = [(start, list(leaves))]
        height = 0
        while True:
            lo, hashes = self.levels[height]
            nlo = -(-start // (2 << height))
            nhi = end // (2 << height)
            if nhi <= nlo:
                break
            off = 2 * nlo - lo
            self.levels.append(
                (
                    nlo,
                    [
                        _sha256(b"\x01" + hashes[k] + hashes[k + 1]).digest()
                        for k in range(off, off + 2 * (nhi - nlo), 2)
                    ],
                )
            )
            height += 1

    def mth(self, s: int, e: int) -> bytes:
        got = self.known.get((s, e))
        if got is not None:
            return got
        n = e - s
        if n & (n - 1) == 0 and s % n == 0:
            height = n.bit_length() - 1
            if height < len(self.levels):
                lo, hashes = self.levels[height]
                j = s >> height
                if lo <= j < lo + len(hashes):
                    return hashes[j - lo]
            if n == 1:
                raise VerificationFailed(f"range proof: leaf {s} is neither exported nor proved")
        if n < 2:
            raise VerificationFailed(f"range proof: subtree [{s}, {e}) is not covered")
        k = _split(n)
        return node_hash(self.mth(s, s + k), self.mth(s + k, e))

    def root(self) -> bytes:
        if self.size == 0:
            return _sha256(b"").digest()
        return self.mth(0, self.size)

    def inclusion(self, index: int) -> list[bytes]:
        """RFC 9162 §2.1.3.1 PATH(index, D[0:size]) for a leaf inside the range."""
        if not self.start <= index < self.end:
            raise VerificationFailed(f"event seq {index} is not in the pack's range")
        return path_from_ranges(self.mth, index, self.size)


def decode_hashes(values: Any, what: str) -> list[bytes]:
    if not isinstance(values, list):
        raise VerificationFailed(f"{what}: expected a list of hashes")
    out = []
    for v in values:
        try:
            raw = base64.b64decode(str(v), validate=True)
        except ValueError as exc:
            raise VerificationFailed(f"{what}: a hash is not base64") from exc
        if len(raw) != 32:
            raise VerificationFailed(f"{what}: a hash is not 32 bytes")
        out.append(raw)
    return out
