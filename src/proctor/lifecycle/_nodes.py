"""Runtime nodes that share one store: membership by lease, fencing, and claims.

Each ``proctor serve`` is a node: a row in ``nodes`` with a lease it renews.
Whether a node is alive is read from that row by the database's own clock
(``Engine.clock``), so two machines whose clocks disagree still agree on who is
dead. A node whose lease has lapsed is dead for every other node; the first to
see it raises its epoch in the statement that marks it dead (so it is marked
once), then records its runs as interrupted and lets its services start
elsewhere.

Fencing: a node that lost its lease without dying (a network cut, a long pause)
must not go on recording as if it held it. :meth:`Node.fence` runs inside every
write transaction the node's ledger commits: it reads the node's row, held
against a concurrent update (``FOR SHARE`` on PostgreSQL), and refuses the
transaction unless the row is live, at the node's epoch and unexpired. So the
statement that marks the node dead either waits for the node's transaction or
makes it fail: nothing the node commits lands after its death. The node itself
gives up when it has not renewed within the lease by its own monotonic clock
(the lease is counted from before the renewal was sent, so it gives up before
anyone else may judge it dead): it stops its runs and ``serve`` exits, to be
started again as a new node.

Claims (``lifecycle_claims``): a service's next run and a schedule's tick are
started by the node whose insert of the claim wins, so each happens once across
all nodes.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from proctor.errors import LedgerError, ProctorError
from proctor.ledger import utc_now
from proctor.store import Conflict, Conn, Store

log = logging.getLogger("proctor.lifecycle")

#: How long a node's lease lasts unrenewed, in seconds.
LEASE_SECONDS = 10.0
_NODES_LOCK = "nodes"


class NodeLost(LedgerError):
    """This node no longer holds its lease: it records nothing more."""

    code = "node_lost"


@dataclass(frozen=True)
class NodeInfo:
    id: str
    host: str
    address: str | None
    backends: tuple[str, ...]
    capacity: int
    epoch: int
    state: str  # live, dead (its lease lapsed), left (it stopped cleanly)
    started_at: str
    expires_in: float  # seconds until its lease lapses (negative: lapsed)

    def as_json(self) -> dict[str, object]:
        return {
            "id": self.id, "host": self.host, "address": self.address,
            "backends": list(self.backends), "capacity": self.capacity, "epoch": self.epoch,
            "state": self.state, "started_at": self.started_at,
            "expires_in": round(self.expires_in, 3),
        }  # fmt: skip


class Node:
    """This process as a node of the store. ``register`` it, renew it (``keep``
    starts a thread that does), ``fence`` its writes, and ``leave`` at the end."""

    def __init__(
        self,
        store: Store,
        node_id: str,
        *,
        address: str | None = None,
        backends: tuple[str, ...] = (),
        capacity: int = 0,
        lease: float = LEASE_SECONDS,
    ) -> None:
        if lease <= 0:
            raise ProctorError("a node's lease must be a positive number of seconds")
        self.store = store
        self.id = node_id
        self.address = address
        self.backends = backends
        self.capacity = capacity or (os.cpu_count() or 1)
        self.lease = lease
        self.epoch = 0
        self._clock = store.engine.clock
        self._lock_shared = store.engine.lock_shared
        self._held_until = 0.0  # monotonic: past it, this node gives itself up
        self.lost: str | None = None
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._left = False

    # -- the lease ---------------------------------------------------------------

    def register(self) -> None:
        sent = time.monotonic()
        with self.store.write(_NODES_LOCK) as conn:
            row = conn.query_one("SELECT epoch FROM nodes WHERE id = ?", (self.id,))
            epoch = 1 if row is None else int(row[0]) + 1
            conn.execute("DELETE FROM nodes WHERE id = ?", (self.id,))
            conn.execute(
                "INSERT INTO nodes (id, host, address, backends, capacity, epoch, state,"  # noqa: S608
                " started_at, lease_expires) VALUES (?, ?, ?, ?, ?, ?, 'live', ?,"
                f" {self._clock} + ?)",
                (self.id, os.uname().nodename, self.address, json.dumps(list(self.backends)),
                 self.capacity, epoch, utc_now(), self.lease),
            )  # fmt: skip
        self.epoch = epoch
        self._held_until = sent + self.lease
        self.lost = None

    def renew(self) -> bool:
        """Extend the lease; False once it is lost (then for good)."""
        if self.lost is not None:
            return False
        sent = time.monotonic()
        try:
            with self.store.write(_NODES_LOCK) as conn:
                changed = conn.execute(
                    f"UPDATE nodes SET lease_expires = {self._clock} + ? WHERE id = ?"  # noqa: S608
                    f" AND epoch = ? AND state = 'live' AND lease_expires > {self._clock}",
                    (self.lease, self.id, self.epoch),
                )
        except ProctorError as exc:
            # Unreachable store: the lease may still hold; give it up only at its end.
            if time.monotonic() >= self._held_until:
                self._lose(f"the lease was not renewed in {self.lease:g} s ({exc.message})")
            return self.lost is None
        if changed != 1:
            self._lose("the lease lapsed and another node took over")
            return False
        self._held_until = sent + self.lease
        return True

    def holds(self) -> bool:
        return self.lost is None and time.monotonic() < self._held_until

    def _lose(self, why: str) -> None:
        if self.lost is None:
            self.lost = why

    def fence(self, conn: Conn) -> None:
        """Refuse the transaction ``conn`` unless this node still holds its lease."""
        if self.lost is not None or time.monotonic() >= self._held_until:
            self._lose(self.lost or "the lease was not renewed in time")
            raise NodeLost(f"this node ({self.id}) has lost its lease: {self.lost}")
        row = conn.query_one(
            f"SELECT 1 FROM nodes WHERE id = ? AND epoch = ? AND state = 'live'"  # noqa: S608
            f" AND lease_expires > {self._clock}{self._lock_shared}",
            (self.id, self.epoch),
        )
        if row is None:
            self._lose("the lease lapsed and another node took over")
            raise NodeLost(f"this node ({self.id}) has lost its lease: {self.lost}")

    def keep(self, on_lost: Callable[[str], object]) -> None:
        """Renew from a thread of its own, ``lease / 4`` apart, and call
        ``on_lost(why)`` once when the lease is gone. A watch of its own judges the
        lease by this process's clock: a renewal stuck on a cut network does not
        keep the node believing it holds the lease."""
        told = threading.Lock()

        def tell() -> None:
            if told.acquire(blocking=False):
                self._lose(self.lost or "the lease was not renewed in time")
                on_lost(self.lost or "")

        def renew() -> None:
            while not self._stop.wait(self.lease / 4):
                if not self.renew():
                    tell()
                    return

        def watch() -> None:
            while not self._stop.wait(min(self.lease / 8, 0.5)):
                if not self.holds():
                    tell()
                    return

        self._threads = [
            threading.Thread(target=renew, name="node-lease", daemon=True),
            threading.Thread(target=watch, name="node-lease-watch", daemon=True),
        ]
        for t in self._threads:
            t.start()

    def leave(self) -> None:
        """Stop renewing and mark the node gone (a clean stop: nothing to take over)."""
        self._stop.set()
        for t in self._threads:
            t.join(timeout=5)
        if self.lost is not None or self._left:
            return
        self._left = True
        try:
            with self.store.write(_NODES_LOCK) as conn:
                conn.execute(
                    "UPDATE nodes SET state = 'left' WHERE id = ? AND epoch = ? AND state = 'live'",
                    (self.id, self.epoch),
                )
        except ProctorError as exc:
            log.warning("proctor serve: could not mark node %s as left: %s", self.id, exc.message)


# -- every node's view of the others -------------------------------------------------


def nodes(store: Store) -> list[NodeInfo]:
    with store.read() as conn:
        rows = conn.query(
            "SELECT id, host, address, backends, capacity, epoch, state, started_at,"  # noqa: S608
            f" lease_expires - {store.engine.clock} FROM nodes ORDER BY started_at, id"
        )
    return [_info(r) for r in rows]


def _info(r: tuple[object, ...]) -> NodeInfo:
    backends = json.loads(str(r[3]))
    return NodeInfo(
        str(r[0]), str(r[1]), None if r[2] is None else str(r[2]), tuple(backends),
        int(str(r[4])), int(str(r[5])), str(r[6]), str(r[7]), float(str(r[8])),
    )  # fmt: skip


def live_ids(store: Store) -> set[str]:
    with store.read() as conn:
        rows = conn.query(
            f"SELECT id FROM nodes WHERE state = 'live' AND lease_expires > {store.engine.clock}"  # noqa: S608
        )
    return {str(r[0]) for r in rows}


def running_per_node(store: Store) -> dict[str, int]:
    """Each live node's runs in progress (0 for a node running none)."""
    with store.read() as conn:
        rows = conn.query(
            "SELECT n.id, COUNT(r.id) FROM nodes n LEFT JOIN runs r"  # noqa: S608
            " ON r.supervisor = n.id AND r.status = 'running'"
            f" WHERE n.state = 'live' AND n.lease_expires > {store.engine.clock} GROUP BY n.id"
        )
    return {str(r[0]): int(r[1]) for r in rows}


def lapsed(store: Store) -> list[str]:
    """Nodes still marked live whose lease has lapsed."""
    with store.read() as conn:
        rows = conn.query(
            f"SELECT id FROM nodes WHERE state = 'live' AND lease_expires <= {store.engine.clock}"  # noqa: S608
        )
    return [str(r[0]) for r in rows]


def declare_dead(store: Store, node_id: str) -> bool:
    """Mark a lapsed node dead and raise its epoch; True for the one caller that did.
    Waits for any transaction the node holds its row in (its fence), so whatever it
    commits lands before this."""
    with store.write(_NODES_LOCK) as conn:
        changed = conn.execute(
            "UPDATE nodes SET state = 'dead', epoch = epoch + 1 WHERE id = ?"  # noqa: S608
            f" AND state = 'live' AND lease_expires <= {store.engine.clock}",
            (node_id,),
        )
    return changed == 1


def claim(store: Store, tenant: str, deployment: str, slot: str, node: Node) -> bool:
    """Whether ``node`` won ``slot`` (a service's next run, a schedule's tick). A node
    whose lease has lapsed wins nothing, even before it notices."""
    try:
        with store.write(f"claim:{tenant}:{deployment}") as conn:
            changed = conn.execute(
                "INSERT INTO lifecycle_claims (tenant, deployment, slot, node, claimed_at)"  # noqa: S608
                " SELECT ?, ?, ?, ?, ? WHERE EXISTS (SELECT 1 FROM nodes WHERE id = ?"
                " AND epoch = ? AND state = 'live'"
                f" AND lease_expires > {store.engine.clock}) ON CONFLICT DO NOTHING",
                (tenant, deployment, slot, node.id, utc_now(), node.id, node.epoch),
            )
    except Conflict:
        return False
    return changed == 1


def prune_claims(store: Store, before: str) -> int:
    """Forget claims made before ``before`` (an ISO time): only the current slot
    of each service and schedule is ever claimed again."""
    with store.write("claims") as conn:
        return conn.execute("DELETE FROM lifecycle_claims WHERE claimed_at < ?", (before,))
