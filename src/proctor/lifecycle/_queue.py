"""Run requests handed out through the store, so that a run asked of any node
runs on whichever node has room (issue 19).

A request is queued by the node that was asked (its API), taken by one node
(``FOR UPDATE SKIP LOCKED`` on PostgreSQL: takers never wait on one another or
take one request twice), started (the request learns its run id) and done (the
run's record, or the refusal). The requester follows the run by its id: its
output is in the home's shared ``runs/`` directory (docs/deploy.md). A request
taken by a node that dies is queued again if its run had not started; if it had,
the run is recorded interrupted by whichever node finds the death, and the
request ends with that.
"""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import dataclass
from typing import Any

from proctor.ledger import Actor, utc_now
from proctor.lifecycle._nodes import Node, live_ids
from proctor.store import Store


@dataclass(frozen=True)
class Request:
    id: str
    tenant: str
    deployment: str
    actor: Actor
    state: str  # queued, taken, started, done
    node: str | None
    run_id: str | None
    error: dict[str, Any] | None
    created_at: str


_COLUMNS = "id, tenant, deployment, actor, state, node, run_id, error, created_at"


def _request(r: tuple[Any, ...]) -> Request:
    actor = json.loads(str(r[3]))
    return Request(
        str(r[0]), str(r[1]), str(r[2]), Actor(str(actor["type"]), str(actor["id"])),
        str(r[4]), None if r[5] is None else str(r[5]), None if r[6] is None else str(r[6]),
        None if r[7] is None else json.loads(str(r[7])), str(r[8]),
    )  # fmt: skip


class RunQueue:
    """The store's run requests, as one node sees them."""

    def __init__(self, store: Store, node: Node) -> None:
        self.store = store
        self._node = node
        self.node = node.id
        self._skip = store.engine.lock_skip
        self._clock = store.engine.clock
        #: Set when this node queued a request: its loop takes it at once.
        self.kick = threading.Event()
        self._several: tuple[float, bool] = (0.0, False)

    def wanted(self) -> bool:
        """Whether runs go through the queue: when this node has company (with one
        node, a run starts where it was asked, as without a queue)."""
        at, several = self._several
        if time.monotonic() - at > 2.0:
            several = len(live_ids(self.store)) > 1
            self._several = (time.monotonic(), several)
        return several

    def submit(self, tenant: str, deployment: str, actor: Actor) -> str:
        rid = "q-" + os.urandom(8).hex()
        with self.store.write(f"node:{self.node}") as conn:
            conn.execute(
                f"INSERT INTO run_requests ({_COLUMNS}) VALUES (?, ?, ?, ?, 'queued',"  # noqa: S608
                " NULL, NULL, NULL, ?)",
                (rid, tenant, deployment, json.dumps(actor.as_json()), utc_now()),
            )
        self.kick.set()
        return rid

    def waiting_since(self) -> float | None:
        """How long the oldest queued request has waited, in seconds (None: none)."""
        with self.store.read() as conn:
            row = conn.query_one("SELECT MIN(created_at) FROM run_requests WHERE state = 'queued'")
        if row is None or row[0] is None:
            return None
        from datetime import datetime

        when = datetime.fromisoformat(str(row[0]).replace("Z", "+00:00"))
        return max(time.time() - when.timestamp(), 0.0)

    def take(self) -> Request | None:
        """The oldest queued request, now this node's; None when there is none."""
        with self.store.write(f"node:{self.node}") as conn:
            row = conn.query_one(
                f"SELECT {_COLUMNS} FROM run_requests WHERE state = 'queued'"  # noqa: S608
                f" ORDER BY created_at, id LIMIT 1{self._skip}"
            )
            if row is None:
                return None
            # A node whose lease has lapsed takes nothing, even before it notices.
            taken = conn.execute(
                "UPDATE run_requests SET state = 'taken', node = ?, taken_at = ? WHERE id = ?"  # noqa: S608
                " AND state = 'queued' AND EXISTS (SELECT 1 FROM nodes WHERE id = ?"
                f" AND epoch = ? AND state = 'live' AND lease_expires > {self._clock})",
                (self.node, utc_now(), row[0], self.node, self._node.epoch),
            )
        if taken != 1:
            return None
        return _request((*row[:4], "taken", self.node, *row[6:]))

    def started(self, rid: str, run_id: str) -> None:
        with self.store.write(f"node:{self.node}") as conn:
            conn.execute(
                "UPDATE run_requests SET state = 'started', run_id = ? WHERE id = ?",
                (run_id, rid),
            )

    def done(self, rid: str, run_id: str | None, error: dict[str, Any] | None) -> None:
        with self.store.write(f"node:{self.node}") as conn:
            conn.execute(
                "UPDATE run_requests SET state = 'done', run_id = COALESCE(?, run_id),"
                " error = ?, done_at = ? WHERE id = ?",
                (run_id, None if error is None else json.dumps(error), utc_now(), rid),
            )

    def get(self, rid: str) -> Request | None:
        with self.store.read() as conn:
            row = conn.query_one(
                f"SELECT {_COLUMNS} FROM run_requests WHERE id = ?",  # noqa: S608
                (rid,),
            )
        return None if row is None else _request(row)

    def release(self, node: str) -> tuple[int, int]:
        """A dead node's requests: those not started are queued again, the started
        ones end (their run was recorded interrupted). Returns (requeued, ended)."""
        error = {"error": {"code": "node_lost", "message": f"the node running it ({node}) died"}}
        with self.store.write(f"node:{self.node}") as conn:
            requeued = conn.execute(
                "UPDATE run_requests SET state = 'queued', node = NULL, taken_at = NULL"
                " WHERE node = ? AND state = 'taken'",
                (node,),
            )
            ended = conn.execute(
                "UPDATE run_requests SET state = 'done', error = ?, done_at = ?"
                " WHERE node = ? AND state = 'started'",
                (json.dumps(error), utc_now(), node),
            )
        return requeued, ended

    def prune(self, before: str) -> int:
        """Forget requests done before ``before`` (their runs are in ``runs``)."""
        with self.store.write(f"node:{self.node}") as conn:
            return conn.execute(
                "DELETE FROM run_requests WHERE state = 'done' AND done_at < ?", (before,)
            )
