"""Request framing through the egress proxy, judged by h11 on what goes upstream:
one request, the same body, nothing left over (request smuggling)."""

from __future__ import annotations

import _harness

_harness.instrumented("proctor.broker._http")

from tests.fuzz._oracle_proxy import check_forward  # noqa: E402

from proctor.broker._http import parse_request_head  # noqa: E402
from proctor.broker._scope import BadCall  # noqa: E402

SMUGGLED = b"GET /smuggled HTTP/1.1\r\nHost: upstream.test\r\n\r\n"
SEEDS = [
    b"Transfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n" + SMUGGLED,
    b"Transfer-Encoding: chunked\r\n\r\n5;a=b\r\nhello\r\n0\r\nX-T: 1\r\n\r\n" + SMUGGLED,
    b"Content-Length: 5\r\n\r\nhello" + SMUGGLED,
    b"Content-Length: 5\r\nConnection: close\r\n\r\nhello" + SMUGGLED,
    b"Expect: 100-continue\r\nContent-Length: 0\r\n\r\n" + SMUGGLED,
]


def test_one_input(data: bytes) -> None:
    head, sep, stream = data.partition(b"\r\n\r\n")
    if not sep:
        return
    try:
        parsed = parse_request_head(b"POST /x HTTP/1.1\r\n" + head + b"\r\n\r\n")
    except BadCall:
        return
    check_forward(parsed.method, parsed.headers, stream)


if __name__ == "__main__":
    _harness.run(test_one_input, SEEDS)
