"""Egress address classification: literals read as the OS reads them, special ranges refused."""

from __future__ import annotations

import ipaddress
import socket

import pytest
from hypothesis import given
from hypothesis import strategies as st

from proctor.broker import BadCall
from proctor.broker._egress import (
    SPECIAL_RANGES,
    Host,
    check_address,
    host_matches,
    parse_host,
    parse_ipv4_literal,
    special_ranges,
    split_authority,
)

LOOPBACK_SPELLINGS = [
    "127.0.0.1",
    "127.1",
    "127.0.1",
    "2130706433",
    "0x7f000001",
    "0x7f.1",
    "0X7F.0.0.1",
    "0177.0.0.1",
    "0177.1",
    "017700000001",
    "0x7f.0x0.0x0.0x1",
    "127.0.0.1.",
]
METADATA_SPELLINGS = [
    "169.254.169.254",
    "2852039166",
    "0xa9fea9fe",
    "0251.0376.0251.0376",
    "169.254.43518",
    "0xa9.0xfe.0xa9.0xfe",
    "0xa9.16689662",
]


@pytest.mark.parametrize("text", LOOPBACK_SPELLINGS + METADATA_SPELLINGS + ["0", "1.2.3.4"])
def test_ipv4_literals_read_as_inet_aton_reads_them(text: str) -> None:
    expected = ipaddress.IPv4Address(socket.inet_aton(text.rstrip(".")))
    assert parse_ipv4_literal(text.rstrip(".")) == expected
    assert parse_host(text) == Host(str(expected), expected)


def test_bare_hex_prefix_reads_as_zero() -> None:
    # Older glibc reads "0x" as 0; newer refuses it. Reading it as 0.0.0.0
    # is the side that refuses either way.
    assert parse_ipv4_literal("0x") == ipaddress.IPv4Address(0)
    assert check_address(ipaddress.IPv4Address(0), ()) is not None


@given(st.integers(0, 2**32 - 1), st.integers(1, 4), st.sampled_from(["d", "o", "x"]))
def test_every_inet_aton_form_agrees_with_the_os(number: int, parts: int, base: str) -> None:
    packed = number.to_bytes(4, "big")
    fields = [*packed[: parts - 1], int.from_bytes(packed[parts - 1 :], "big")]
    fmt = {"d": "{}", "o": "0{:o}", "x": "0x{:x}"}[base]
    text = ".".join(fmt.format(f) for f in fields)
    assert parse_ipv4_literal(text) == ipaddress.IPv4Address(socket.inet_aton(text))


@pytest.mark.parametrize(
    "text", ["256.1.1.1", "1.2.3.4.5", "08.1.1.1", "0x1g", "1..2", "", "1.2.3.256", "4294967296"]
)
def test_not_ipv4_literals(text: str) -> None:
    assert parse_ipv4_literal(text) is None
    with pytest.raises(OSError):
        socket.inet_aton(text)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("[::1]", "::1"),
        ("[0:0:0:0:0:0:0:1]", "::1"),
        ("::ffff:127.0.0.1", "127.0.0.1"),
        ("[::ffff:7f00:1]", "127.0.0.1"),
        ("[::ffff:a9fe:a9fe]", "169.254.169.254"),
        ("[fe80::1%25eth0]", "fe80::1"),
        ("fe80::1%lo", "fe80::1"),
        ("[2001:DB8::1]", "2001:db8::1"),
    ],
)
def test_ipv6_literals_unmapped_and_zone_dropped(text: str, expected: str) -> None:
    host = parse_host(text)
    assert host.name == expected
    assert str(host.address) == expected


@pytest.mark.parametrize(
    "text", ["exa mple.com", "a/b", "evil.com@127.0.0.1", "[::1", "[zz::1]", "-x.com", "1.2.3.999"]
)
def test_malformed_hosts_are_bad_calls(text: str) -> None:
    with pytest.raises(BadCall):
        parse_host(text)


def test_names_are_normalized() -> None:
    assert parse_host("API.Example.COM.") == Host("api.example.com", None)


@pytest.mark.parametrize(
    "address",
    [
        "127.0.0.1",
        "127.255.255.254",
        "0.0.0.0",
        "0.1.2.3",
        "10.1.2.3",
        "172.16.0.1",
        "172.31.255.255",
        "192.168.1.1",
        "169.254.169.254",
        "100.64.0.1",
        "100.127.255.255",
        "192.0.0.1",
        "192.0.0.9",
        "192.0.2.1",
        "198.18.0.1",
        "198.19.255.255",
        "198.51.100.7",
        "203.0.113.9",
        "224.0.0.1",
        "239.255.255.250",
        "240.0.0.1",
        "255.255.255.255",
        "192.88.99.1",
        "::",
        "::1",
        "::127.0.0.1",
        "::ffff:10.0.0.1",
        "64:ff9b::7f00:1",
        "64:ff9b:1::1",
        "100::1",
        "2001::1",
        "2001:0:4136:e378:8000:63bf:3fff:fdd2",
        "2001:2::1",
        "2001:db8::1",
        "2002:7f00:1::",
        "3fff::1",
        "fc00::1",
        "fd00:ec2::254",
        "fe80::1",
        "fec0::1",
        "ff02::1",
        "4000::1",
    ],
)
def test_special_addresses_are_refused(address: str) -> None:
    refusal = check_address(ipaddress.ip_address(address), ())
    assert refusal is not None
    assert refusal.ranges
    assert str(refusal.address) in refusal.reason


@pytest.mark.parametrize(
    "address", ["1.1.1.1", "8.8.8.8", "93.184.216.34", "2606:4700::1111", "2a00:1450::1"]
)
def test_public_addresses_pass(address: str) -> None:
    assert check_address(ipaddress.ip_address(address), ()) is None


def test_the_table_covers_what_python_calls_non_global() -> None:
    # Any address Python's own registry copy calls non-global must match an
    # entry of ours (the fallback never has to fire for these samples).
    samples = [net.network_address for net, _ in SPECIAL_RANGES] + [
        net.broadcast_address for net, _ in SPECIAL_RANGES
    ]
    for address in samples:
        if not address.is_global:
            found = special_ranges(address)
            assert found
            assert all(not name.startswith("not globally") for _, name in found), address


@given(st.integers(0, 2**32 - 1))
def test_ipv4_refused_whenever_python_says_not_global(number: int) -> None:
    address = ipaddress.IPv4Address(number)
    if not address.is_global:
        assert check_address(address, ()) is not None


def test_allowed_range_must_lie_inside_the_special_range() -> None:
    loop = ipaddress.ip_address("127.0.0.1")
    assert check_address(loop, ("127.0.0.0/8",)) is None
    assert check_address(loop, ("127.0.0.1/32",)) is None
    # Broader than the registry entry: allowing "everything" opens nothing.
    assert check_address(loop, ("0.0.0.0/0",)) is not None
    assert check_address(loop, ("126.0.0.0/7",)) is not None
    # Another range opens nothing here.
    assert check_address(loop, ("10.0.0.0/8",)) is not None
    assert check_address(ipaddress.ip_address("127.0.0.2"), ("127.0.0.1/32",)) is not None
    # IPv6 loopback sits in several entries; one narrow range inside all of them opens it.
    assert check_address(ipaddress.ip_address("::1"), ("::1/128",)) is None
    assert check_address(ipaddress.ip_address("::1"), ("127.0.0.0/8",)) is not None


def test_mapped_addresses_are_checked_as_ipv4() -> None:
    mapped = ipaddress.ip_address("::ffff:127.0.0.1")
    assert check_address(mapped, ()) is not None
    assert check_address(mapped, ("127.0.0.0/8",)) is None
    assert check_address(ipaddress.ip_address("::ffff:1.1.1.1"), ()) is None


def test_invalid_allowed_range_is_a_bad_call() -> None:
    with pytest.raises(BadCall):
        check_address(ipaddress.ip_address("127.0.0.1"), ("127.0.0.1/8",))


@pytest.mark.parametrize(
    ("authority", "default", "expected"),
    [
        ("api.example.com:443", None, ("api.example.com", 443)),
        ("[::1]:8443", None, ("[::1]", 8443)),
        ("example.com", 80, ("example.com", 80)),
        ("[2001:db8::1]", 80, ("[2001:db8::1]", 80)),
    ],
)
def test_split_authority(authority: str, default: int | None, expected: tuple[str, int]) -> None:
    assert split_authority(authority, default) == expected


@pytest.mark.parametrize(
    "authority", ["example.com", "example.com:0", "example.com:65536", "::1:80", "a:b", "[::1]x"]
)
def test_split_authority_refuses(authority: str) -> None:
    with pytest.raises(BadCall):
        split_authority(authority, None)


def test_secret_host_entries() -> None:
    api = parse_host("api.example.com")
    assert host_matches("api.example.com", api, 443)
    assert host_matches("API.example.com:443", api, 443)
    assert not host_matches("api.example.com:8443", api, 443)
    assert host_matches("*.example.com", api, 443)
    assert host_matches("*.example.com", parse_host("a.b.example.com"), 443)
    assert not host_matches("*.example.com", parse_host("example.com"), 443)
    assert not host_matches("*.example.com", parse_host("evilexample.com"), 443)
    assert not host_matches("*.example.com", parse_host("example.com.evil.org"), 443)
    assert host_matches("127.0.0.1", parse_host("0x7f.1"), 443)
    assert not host_matches("not a host", api, 443)
