"""Node hashes served from C2SP tlog-tiles stored in the store.

Tile (level L, index N) holds up to 256 hashes: those of the aligned subtrees of
``256**L`` leaves numbered ``256*N`` onwards. Any aligned subtree of height h is
therefore at most 128 hashes of one tile away (level ``h // 8``).
"""

from __future__ import annotations

import re
from collections import OrderedDict
from dataclasses import dataclass

from proctor.errors import LedgerError
from proctor.ledger._merkle import HASH_SIZE, node_hash
from proctor.store import Conn

TILE_WIDTH = 256
_TILE_BYTES = TILE_WIDTH * HASH_SIZE


def tile_path(level: int | str, index: int, width: int = TILE_WIDTH) -> str:
    """The C2SP tlog-tiles path ``tile/<L>/<N>[.p/<W>]`` (N as x001/x234/067);
    ``level="entries"`` gives an entry bundle's path."""
    digits = f"{index:03d}"
    while len(digits) % 3:
        digits = "0" + digits
    groups = [digits[i : i + 3] for i in range(0, len(digits), 3)]
    n = "/".join([f"x{g}" for g in groups[:-1]] + [groups[-1]])
    suffix = "" if width == TILE_WIDTH else f".p/{width}"
    return f"tile/{level}/{n}{suffix}"


# Loose on purpose: anything that could name a tile is parsed, then held to the one
# canonical spelling (as golang.org/x/mod/sumdb/tlog's ParseTilePath does).
_TILE_PATH_RE = re.compile(
    r"^tile/(entries|[0-9]{1,3})/((?:x[0-9]{1,4}/){0,7}[0-9]{1,4})(?:\.p/([0-9]{1,4}))?$"
)
#: The highest tile level C2SP tlog-tiles allows.
MAX_LEVEL = 63


@dataclass(frozen=True)
class TileRef:
    """A parsed tile path: ``level`` None for an entry bundle."""

    level: int | None
    index: int
    width: int

    @property
    def partial(self) -> bool:
        return self.width < TILE_WIDTH


def parse_tile_path(path: str) -> TileRef | None:
    """``tile/<L>/<N>[.p/<W>]`` or ``tile/entries/<N>[.p/<W>]`` in its one canonical
    form (no leading zeroes in L or W, N in 3-digit groups all but the last led by
    ``x``, W from 1 to 255), else None."""
    m = _TILE_PATH_RE.match(path)
    if m is None:
        return None
    level_s, n_s, w_s = m.groups()
    level = None if level_s == "entries" else int(level_s)
    if level is not None and level > MAX_LEVEL:
        return None
    index = int("".join(g.lstrip("x") for g in n_s.split("/")))
    width = int(w_s) if w_s is not None else TILE_WIDTH
    if not 1 <= width <= TILE_WIDTH or (w_s is not None and width == TILE_WIDTH):
        return None
    canonical = tile_path("entries" if level is None else level, index, width)
    return TileRef(level, index, width) if canonical == path else None


class FullTileCache:
    """Full tiles never change, so every reader may share them."""

    def __init__(self, capacity: int = 4096) -> None:
        self._tiles: OrderedDict[tuple[str, int, int], bytes] = OrderedDict()
        self._capacity = capacity

    def get(self, key: tuple[str, int, int]) -> bytes | None:
        tile = self._tiles.get(key)
        if tile is not None:
            self._tiles.move_to_end(key)
        return tile

    def put(self, key: tuple[str, int, int], tile: bytes) -> None:
        self._tiles[key] = tile
        if len(self._tiles) > self._capacity:
            self._tiles.popitem(last=False)


class TileNodes:
    """``node(start, height)`` for one log, reading tiles through one transaction."""

    def __init__(
        self,
        conn: Conn,
        log: str,
        cache: FullTileCache,
        partial: dict[tuple[int, int], bytes] | None = None,
    ) -> None:
        self._conn = conn
        self._log = log
        self._cache = cache
        # Tiles already read with something else, by (level, index).
        self._partial: dict[tuple[int, int], bytes] = partial if partial is not None else {}

    @property
    def log(self) -> str:
        return self._log

    def tile(self, level: int, index: int) -> bytes:
        key = (self._log, level, index)
        tile = self._cache.get(key) or self._partial.get((level, index))
        if tile is not None:
            return tile
        row = self._conn.query_one(
            "SELECT hashes FROM ledger_tiles WHERE log = ? AND level = ? AND idx = ?",
            (self._log, level, index),
        )
        tile = bytes(row[0]) if row else b""
        if len(tile) == _TILE_BYTES:
            self._cache.put(key, tile)
        else:
            self._partial[(level, index)] = tile
        return tile

    def __call__(self, start: int, height: int) -> bytes:
        level, rest = divmod(height, 8)
        first = start >> (8 * level)
        count = 1 << rest
        index, offset = divmod(first, TILE_WIDTH)
        tile = self.tile(level, index)
        end = (offset + count) * HASH_SIZE
        if len(tile) < end:
            raise LedgerError(
                f"log {self._log}: the stored tree lacks tile {tile_path(level, index)} "
                f"up to entry {offset + count}; the store is damaged"
            )
        hashes = [tile[i : i + HASH_SIZE] for i in range(offset * HASH_SIZE, end, HASH_SIZE)]
        while len(hashes) > 1:
            hashes = [node_hash(hashes[i], hashes[i + 1]) for i in range(0, len(hashes), 2)]
        return hashes[0]
