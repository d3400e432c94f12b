"""Absolute-form URLs, hosts and authorities: one host, the one the OS would dial."""

from __future__ import annotations

import _harness

_harness.instrumented("proctor.broker._proxy", "proctor.broker._egress", "proctor.policy._hosts")

from tests.fuzz._oracle_proxy import check_authority, check_host, check_url  # noqa: E402

SEEDS = [
    b"http://example.com/a?b",
    b"http://0x7f.1:8080/",
    b"http://[::ffff:127.0.0.1]/",
    b"http://[fe80::1%25eth0]:80/",
    b"http://2130706433/",
    b"http://user@host/",
    b"http://EXAMPLE.com./",
]


def test_one_input(data: bytes) -> None:
    text = data.decode("latin-1")
    check_url(text)
    check_host(text)
    check_authority(text, None)
    check_authority(text, 80)


if __name__ == "__main__":
    _harness.run(test_one_input, SEEDS)
