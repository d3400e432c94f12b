"""A node's lease and its fence, on both store engines (lifecycle/_nodes.py).

The lease is judged by the database's clock; a node found dead is marked once,
with its epoch raised; from then on nothing the dead node's ledger commits
lands, even if its process lives on (a network cut, a pause), and its own lease
thread tells it so.
"""

from __future__ import annotations

import threading
import time

import pytest

from proctor.ledger import Ledger, Signer
from proctor.lifecycle import Node, NodeLost, nodes
from proctor.lifecycle._nodes import claim, declare_dead, lapsed, live_ids, running_per_node
from proctor.store import Store, open_store
from tests.conftest import draft


def _ledger(url: str) -> tuple[Ledger, Store]:
    store = open_store(url, create=True)
    ledger = Ledger(store, Signer.generate("test.local"), "test.local")
    ledger.create_log("acme", draft(0))
    return ledger, store


def _wait(cond: object, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():  # type: ignore[operator]
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_a_lapsed_node_is_marked_dead_once_and_records_nothing_more(
    store_url: str,
) -> None:
    ledger, store = _ledger(store_url)
    a = Node(store, "host:1:1", backends=("bubblewrap",), lease=0.5)
    b = Node(store, "host:2:2", lease=30.0)
    a.register()
    b.register()
    ledger.set_fence(a.fence)
    assert ledger.append("acme", draft(1)).seq == 1  # a holds its lease: recorded
    assert live_ids(store) == {"host:1:1", "host:2:2"}
    assert declare_dead(store, "host:1:1") is False  # not lapsed: nobody may take it
    # a stops renewing (its process paused, its network cut): its lease lapses.
    _wait(lambda: lapsed(store) == ["host:1:1"])
    assert declare_dead(store, "host:1:1") is True
    assert declare_dead(store, "host:1:1") is False  # marked once
    size = ledger.verify("acme").size
    with pytest.raises(NodeLost, match="lost its lease"):
        ledger.append("acme", draft(2))
    assert ledger.verify("acme").size == size  # nothing landed
    # Renewing does not bring it back: the epoch moved on, for good.
    assert a.renew() is False and a.lost is not None
    (info,) = [n for n in nodes(store) if n.id == "host:1:1"]
    assert info.state == "dead" and info.epoch == 2 and info.backends == ("bubblewrap",)
    # The other node's writes go on.
    ledger.set_fence(b.fence)
    assert ledger.append("acme", draft(3)).seq == size
    ledger.close()
    store.close()


def test_a_node_that_cannot_renew_gives_itself_up_before_anyone_takes_over(
    store_url: str,
) -> None:
    ledger, store = _ledger(store_url)
    node = Node(store, "host:3:3", lease=0.6)
    node.register()
    ledger.set_fence(node.fence)
    lost = threading.Event()
    node.keep(lambda why: lost.set())
    ledger.append("acme", draft(1))
    # The lease thread renews it: still held well past one lease.
    time.sleep(1.5)
    assert node.holds() and not lost.is_set()
    ledger.append("acme", draft(2))
    # Another node takes it over (as if its renewals had stopped reaching the store).
    with store.write("nodes") as conn:
        conn.execute("UPDATE nodes SET state = 'dead', epoch = epoch + 1 WHERE id = 'host:3:3'")
    _wait(lost.is_set)
    assert not node.holds()
    with pytest.raises(NodeLost):
        ledger.append("acme", draft(3))
    node.leave()  # a lost node does not mark itself 'left': it is dead for the others
    assert [n.state for n in nodes(store)] == ["dead"]
    ledger.close()
    store.close()


def test_a_slot_is_claimed_once_and_work_counts_per_node(store_url: str) -> None:
    store = open_store(store_url, create=True)
    a, b = Node(store, "h:1:1"), Node(store, "h:2:2")
    a.register()
    b.register()
    assert claim(store, "acme", "nightly", "tick:60:1", a) is True
    assert claim(store, "acme", "nightly", "tick:60:1", b) is False
    assert claim(store, "acme", "nightly", "tick:60:2", b) is True
    # A node whose lease lapsed (or that left) claims nothing, though no one took it.
    c = Node(store, "h:3:3", lease=0.2)
    c.register()
    time.sleep(0.3)
    assert claim(store, "acme", "nightly", "tick:60:3", c) is False
    assert claim(store, "acme", "nightly", "tick:60:3", a) is True
    assert running_per_node(store) == {"h:1:1": 0, "h:2:2": 0}
    a.leave()
    assert [n.state for n in nodes(store) if n.id == "h:1:1"] == ["left"]
    assert running_per_node(store) == {"h:2:2": 0}
    store.close()


def test_a_queued_request_is_taken_once_and_never_by_a_lapsed_node(store_url: str) -> None:
    from proctor.ledger import Actor
    from proctor.lifecycle._queue import RunQueue

    store = open_store(store_url, create=True)
    live, lapsing = Node(store, "h:1:1"), Node(store, "h:2:2", lease=0.2)
    live.register()
    lapsing.register()
    asked = RunQueue(store, live)
    rid = asked.submit("acme", "nightly", Actor("user", "acme/dev"))
    time.sleep(0.3)
    assert RunQueue(store, lapsing).take() is None  # its lease lapsed: nothing taken
    got = asked.take()
    assert got is not None and got.id == rid and got.actor == Actor("user", "acme/dev")
    assert asked.take() is None  # taken once
    asked.started(rid, "r-1")
    # The node dies with the run started: the request ends, it is not run again.
    assert asked.release("h:1:1") == (0, 1)
    done = asked.get(rid)
    assert done is not None and done.state == "done" and done.error is not None
    # One taken but not started goes back to the queue.
    rid2 = asked.submit("acme", "nightly", Actor("user", "acme/dev"))
    assert asked.take() is not None
    assert asked.release("h:1:1") == (1, 0)
    again = asked.get(rid2)
    assert again is not None and again.state == "queued" and again.node is None
    store.close()


def test_a_node_numbers_ticks_by_the_databases_clock(
    store_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Two machines whose clocks disagree must number a schedule's ticks alike: serve
    # reads "now" as the database's clock. This machine is made an hour fast.
    from types import SimpleNamespace

    from proctor.lifecycle import _serve

    store = open_store(store_url, create=True)
    node = SimpleNamespace(rt=SimpleNamespace(store=store), _offset=0.0, _offset_at=-1e9)
    real = time.time()
    monkeypatch.setattr(_serve.time, "time", lambda: real + 3600.0)
    now = _serve.Server._now(node)  # type: ignore[arg-type]
    assert abs(now - real) < 30, now - real
    store.close()
