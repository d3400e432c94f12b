"""The broker socket's request parser (``proctor.broker._http``) on a real StreamReader."""

from __future__ import annotations

import _harness

_harness.instrumented("proctor.broker._http")

from tests.fuzz._oracle_http import check  # noqa: E402

SEEDS = [
    b"GET /v1/whoami HTTP/1.1\r\nProctor-Token: x\r\n\r\n",
    b'POST /v1/sql HTTP/1.1\r\nContent-Length: 17\r\n\r\n{"dataset": "a"}',
    b"PUT /v1/files/b/k HTTP/1.0\r\nContent-Length: 3\r\nX: y\r\n\r\nabc",
    b"CONNECT example.com:443 HTTP/1.1\r\nHost: example.com\r\n\r\n",
    b"GET http://example.com/ HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
]


def test_one_input(data: bytes) -> None:
    # The first byte picks where the stream is cut, to reach the incremental paths.
    cuts = [data[0] * 7] if data else []
    check(data[1:], cuts)


if __name__ == "__main__":
    _harness.run(test_one_input, [b"\x03" + s for s in SEEDS])
