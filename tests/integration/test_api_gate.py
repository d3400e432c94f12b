"""The API's connection gate as logic: what one address, and what many, may hold;
which connection gives way to a new one; the bounds derived from the descriptor
limit. The gate is driven here as the server drives it (admit, protect, release),
with a real SQLite ledger for what it records."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from proctor.api._limits import ConnectionGate, GateBounds, Held, gate_bounds, source_key
from proctor.ledger import SYSTEM_LOG, Actor, EventDraft, Ledger, Signer
from proctor.store import open_store


@pytest.fixture
def ledger(tmp_path: Path) -> Iterator[Ledger]:
    store = open_store(str(tmp_path / "proctor.db"), create=True)
    ledger = Ledger(store, Signer.generate("test.local"), "test.local")
    ledger.create_log(
        SYSTEM_LOG, EventDraft(Actor("operator", "test"), "runtime.init", "runtime/t")
    )
    yield ledger
    ledger.close()
    store.close()


class Conns:
    """Connections as the server holds them: each closed one is remembered."""

    def __init__(self, gate: ConnectionGate) -> None:
        self.gate = gate
        self.aborted: list[str] = []

    def open(self, source: str, name: str) -> Held | None:
        return self.gate.admit(source, lambda: self.aborted.append(name))


def _gate(ledger: Ledger, per_source: int = 4, total: int = 12) -> ConnectionGate:
    bounds = GateBounds(per_source, total, total - total // 4, 2, 10.0, 20.0)
    return ConnectionGate(ledger, bounds, Actor("runtime", "proctor-api"))


def test_an_address_is_an_ipv4_address_or_an_ipv6_64() -> None:
    assert source_key("192.0.2.7") == "192.0.2.7"
    assert source_key("2001:db8:1:2:aaaa::1") == source_key("2001:db8:1:2:ffff::9")
    assert source_key("2001:db8:1:2::1") == "2001:db8:1:2::/64"
    assert source_key("2001:db8:1:3::1") != source_key("2001:db8:1:2::1")
    assert source_key("::ffff:192.0.2.7") == "192.0.2.7"


def test_bounds_stay_well_below_the_descriptor_limit() -> None:
    b = gate_bounds(256, 64, None, 10.0, 20.0)
    assert (b.total, b.unauthenticated, b.per_source) == (64, 48, 48)
    # The old floor of 256 connections took every descriptor under a limit of 256.
    assert gate_bounds(256, 64, 10_000, 10.0, 20.0).total == 128
    b = gate_bounds(1 << 20, 64, None, 10.0, 20.0)
    assert (b.total, b.per_source) == (1 << 18, 64)
    assert gate_bounds(1024, 64, None, 10.0, 5.0).head == 10.0  # never under first byte


def test_one_address_holds_its_bound_and_closes_only_its_own(ledger: Ledger) -> None:
    gate = _gate(ledger)
    conns = Conns(gate)
    other = conns.open("192.0.2.9", "other")
    held = [conns.open("192.0.2.1", f"a{i}") for i in range(10)]
    assert all(h is not None for h in held)
    # Each connection over its address's bound closed that address's oldest.
    assert conns.aborted == [f"a{i}" for i in range(6)]
    assert gate.held() == 5 and other is not None and other.open
    assert gate.pending() == 6


def test_many_addresses_close_the_largest_holders_oldest_never_a_principals(
    ledger: Ledger,
) -> None:
    gate = _gate(ledger)  # 12 in all, 9 unauthenticated, 4 per address
    conns = Conns(gate)
    victim = conns.open("192.0.2.200", "victim")
    assert victim is not None
    gate.protect(victim, ("acme", "aud"))  # carried an admitted request
    lone = conns.open("192.0.2.100", "lone")
    for a in range(1, 4):
        for i in range(4):
            conns.open(f"192.0.2.{a}", f"{a}.{i}")
    # 1 protected + lone + 12 flood; 9 unauthenticated at most: the three largest
    # holders gave way in turn (each its oldest), the lone connection did not.
    assert gate.unauthenticated() == 9
    assert "victim" not in conns.aborted and "lone" not in conns.aborted
    assert conns.aborted == ["1.0", "2.0", "1.1", "2.1"]
    # A new connection always gets in, so it can authenticate: the largest holder's
    # oldest gives way.
    assert conns.open("192.0.2.201", "newcomer") is not None
    assert conns.aborted[-1] == "3.0"
    assert victim.open and lone is not None and lone.open


def test_when_every_connection_carries_a_principal_a_new_one_is_refused_unread(
    ledger: Ledger,
) -> None:
    gate = _gate(ledger, per_source=4, total=4)  # 3 unauthenticated at most
    conns = Conns(gate)
    held = []
    for i in range(4):
        h = conns.open(f"192.0.2.{i}", f"p{i}")
        assert h is not None
        gate.protect(h, ("acme", f"p{i}"))  # each authenticates before the next comes
        held.append(h)
    assert conns.open("192.0.2.50", "new") is None
    assert conns.aborted == [] and gate.held() == 4
    gate.release(held[0])
    gate.release(held[0])  # twice is harmless
    assert conns.open("192.0.2.50", "new") is not None


def test_a_principal_keeps_only_its_share_of_connections_from_being_closed(
    ledger: Ledger,
) -> None:
    gate = _gate(ledger, per_source=8, total=8)  # per principal: 2
    conns = Conns(gate)
    mine = [conns.open("192.0.2.1", f"m{i}") for i in range(3)]
    for h in mine:
        assert h is not None
        gate.protect(h, ("acme", "ci"))
    assert gate.unauthenticated() == 1  # the third is served but may give way
    for i in range(8):
        conns.open(f"192.0.2.{10 + i}", f"f{i}")
    assert "m0" not in conns.aborted and "m1" not in conns.aborted
    assert "m2" in conns.aborted


def test_what_is_closed_is_recorded_as_one_event(ledger: Ledger) -> None:
    gate = _gate(ledger, per_source=1, total=4)
    conns = Conns(gate)
    conns.open("192.0.2.1", "a")
    conns.open("192.0.2.1", "b")
    gate.closed("idle")
    gate.closed("slow_head")
    assert gate.record() == 3
    assert gate.record() == 0
    events = [json.loads(e) for e in ledger.entries("system")]
    (event,) = [e for e in events if e["action"] == "api.connections.refused"]
    d = event["details"]
    assert (d["over_source"], d["over_total"], d["idle"], d["slow_head"]) == (1, 0, 1, 1)
    assert event["decision"] == "deny" and event["actor"]["id"] == "proctor-api"
