"""C2SP tlog-tiles paths: each tile has one spelling, and only that one is parsed
(no leading zeroes in L or W, N in 3-digit groups all but the last led by 'x',
W from 1 to 255, L at most 63)."""

from __future__ import annotations

import pytest

from proctor.ledger import TileRef, parse_tile_path, tile_path

ACCEPTED = {
    "tile/0/000": TileRef(0, 0, 256),
    "tile/0/001.p/1": TileRef(0, 1, 1),
    "tile/0/000.p/255": TileRef(0, 0, 255),
    "tile/1/x001/234": TileRef(1, 1234, 256),
    "tile/2/x001/x234/067.p/8": TileRef(2, 1234067, 8),
    "tile/63/999": TileRef(63, 999, 256),
    "tile/entries/000": TileRef(None, 0, 256),
    "tile/entries/x123/456.p/17": TileRef(None, 123456, 17),
}
REFUSED = [
    "tile/0/000.p/01",  # leading zero in the width
    "tile/00/000",  # a level written with two digits
    "tile/01/000",
    "tile/0/000.p/0",
    "tile/0/000.p/256",  # a full tile has no .p/
    "tile/0/000.p/1000",
    "tile/0/0",  # not 3 digits
    "tile/0/00",
    "tile/0/0000",
    "tile/0/x000/001",  # 1 has no leading group
    "tile/0/x1/000",
    "tile/0/001/002",  # all but the last group need their 'x'
    "tile/0/x001",
    "tile/64/000",  # past level 63
    "tile/entries/000.p/01",
    "tile/entries/1",
    "tile/data/000",
    "tile/-1/000",
    "tile/0/000.p/",
    "tile/0/000/",
    "0/000",
    "tile/0/000.p/1/2",
    "",
]


@pytest.mark.parametrize("path", sorted(ACCEPTED))
def test_canonical_paths_parse_and_round_trip(path: str) -> None:
    ref = parse_tile_path(path)
    assert ref == ACCEPTED[path]
    level = "entries" if ref.level is None else ref.level
    assert tile_path(level, ref.index, ref.width) == path


def test_every_other_spelling_is_refused() -> None:
    assert [p for p in REFUSED if parse_tile_path(p) is not None] == []
