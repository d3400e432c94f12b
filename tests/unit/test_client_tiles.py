"""The SDK writes tile paths itself (it imports nothing of the server): the same as
the ledger's."""

from __future__ import annotations

import pytest

from proctor.client._client import _tile_path
from proctor.ledger import tile_path


@pytest.mark.parametrize("index", [0, 1, 999, 1000, 1234567, 10**9 + 7])
@pytest.mark.parametrize("width", [256, 1, 17, 255])
def test_the_sdk_tile_path_is_the_ledgers(index: int, width: int) -> None:
    for level in (0, 1, 5):
        assert _tile_path(level, index, width) == tile_path(level, index, width)
