"""The broker's request head parser: a refusal or a head that round-trips."""

from __future__ import annotations

import _harness

_harness.instrumented("proctor.broker._http")

from tests.fuzz._oracle_proxy import check_request_head  # noqa: E402

SEEDS = [
    b"GET /x HTTP/1.1\r\nHost: a\r\n\r\n",
    b"POST /x?y HTTP/1.0\r\nContent-Length: 5\r\nX:  v \r\n\r\n",
    b"OPTIONS * HTTP/1.1\r\nHost: a\r\n\r\n",
]


if __name__ == "__main__":
    _harness.run(check_request_head, SEEDS)
