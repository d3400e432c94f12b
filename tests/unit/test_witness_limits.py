"""The witness server's connection bounds as plain logic: what counts as one client,
and the gate's per-address and total bounds (the server itself is tried for real in
tests/integration/test_witness_serve_limits.py)."""

from __future__ import annotations

import pytest

from proctor.witness._limits import MAX_TOTAL, RESERVE, ConnectionGate, client_key, total_for


def test_one_client_is_an_ipv4_address_or_an_ipv6_64() -> None:
    assert client_key("10.0.0.7") == "10.0.0.7"
    # Any address of one /64 is one client: a host there can take many.
    assert client_key("2001:db8:1:2::1") == client_key("2001:db8:1:2:ffff::9")
    assert client_key("2001:db8:1:2::1") != client_key("2001:db8:1:3::1")
    assert client_key("::ffff:10.0.0.7") == "10.0.0.7"


def test_the_gate_keeps_three_quarters_for_other_clients() -> None:
    gate = ConnectionGate(per_address=100, total=16)
    assert gate.per_address == 4  # asked for 100: a quarter of the total at most
    assert [gate.admit("10.0.0.1") for _ in range(6)] == [True] * 4 + [False] * 2
    assert gate.refused == 2
    for i in range(2, 5):
        assert all(gate.admit(f"10.0.0.{i}") for _ in range(4))
    assert gate.held() == 16
    assert not gate.admit("10.0.0.9")  # the total is reached
    gate.release("10.0.0.1")
    assert gate.admit("10.0.0.1") and not gate.admit("10.0.0.1")
    with pytest.raises(ValueError):
        ConnectionGate(0, 16)


def test_the_total_leaves_a_reserve_of_descriptors() -> None:
    assert total_for(256) == 256 - RESERVE
    assert total_for(1 << 20) == MAX_TOTAL
    assert total_for(10) == 8
