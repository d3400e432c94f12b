"""``proctor serve``: keep services up, fire schedules, stop what loses its footing.

One ``serve`` per home: a second is refused when it is built (see _lock.py).
Each ``serve`` is a node of its store (see _nodes.py): several homes sharing a
PostgreSQL store are several nodes, and a service's next run or a schedule's
tick is started by the one node whose claim of it wins. A node that finds
another's lease lapsed records that node's runs as interrupted, and its
services start again wherever the next claim wins. A node that loses its own
lease stops every run it has and ``serve`` ends (``Server.lost`` says why).

One loop, once a second, reads the store (so a `proctor deploy`, `freeze` or
`approval revoke` made by another process takes effect here): a service whose
run ended is restarted with exponential backoff, and stopped for good after too
many failures in a window (a crash loop, recorded); a schedule fires once in each
interval of its period (by the wall clock, so every node counts the same ones);
a frozen tenant's runs are stopped.
When told to stop (SIGTERM, SIGINT), it stops every run it supervises, the
API's included, and records each ``run.end`` (interrupted: supervisor
stopping) before it returns.
Each run watches its own approvals (see Supervisor). On start, runs that a
previous, dead supervisor left 'running' are recorded as interrupted, after its
sandboxes and broker sockets are removed; then, every few seconds, so are the
runs of any other process of this host that died meanwhile (a `proctor run`
killed with SIGKILL), without waiting for a restart.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

from proctor.broker import reap_broker_sockets
from proctor.errors import ProctorError
from proctor.governance import Deployment, Home, Retention, RunRecord
from proctor.ledger import Actor
from proctor.lifecycle._jsonlog import log_event
from proctor.lifecycle._lock import ServeLock
from proctor.lifecycle._nodes import (
    LEASE_SECONDS,
    Node,
    NodeLost,
    claim,
    declare_dead,
    lapsed,
    prune_claims,
    running_per_node,
)
from proctor.lifecycle._queue import Request, RunQueue
from proctor.lifecycle._supervisor import SUPERVISOR_STOPPING, AlreadyRunning, Supervisor
from proctor.sandbox import SandboxCleanupFailed, reap_orphans
from proctor.witness import Submitter, TenantWitnesses, submit_interval

log = logging.getLogger("proctor.lifecycle")
BACKOFF = (1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 60.0)
SWEEP_SECONDS = 5.0
PRUNE_SECONDS = 6 * 3600.0
#: The reason a node's runs end with when it loses its lease.
NODE_LOST = "node lost its lease"
#: How long a slot waits for a less loaded node before any node takes it.
_UNCLAIMED = 3.0
#: How long a claimed slot may go without its run before it can be claimed again.
_RECLAIM = 30.0


@dataclass
class _Slot:
    tenant: str
    name: str
    version: int = 0
    thread: threading.Thread | None = None
    cancel: threading.Event = field(default_factory=threading.Event)
    last_start: float | None = None
    last: RunRecord | None = None
    attempt: int = 0
    elsewhere: bool = False  # the last start found a run of it in progress
    tried: str | None = None  # the last slot this node tried to claim

    @property
    def running(self) -> bool:
        return self.thread is not None and self.thread.is_alive()


class Server:
    def __init__(
        self,
        supervisor: Supervisor,
        *,
        tick: float = 1.0,
        crash_limit: int = 5,
        crash_window: float = 300.0,
        backoff: tuple[float, ...] = BACKOFF,
        sweep: float = SWEEP_SECONDS,
        lease: float = LEASE_SECONDS,
        address: str | None = None,
    ) -> None:
        self.supervisor = supervisor
        self.rt = supervisor.rt
        self.tick_seconds = tick
        self.crash_limit = crash_limit
        self.crash_window = crash_window
        self.backoff = backoff
        self.sweep_seconds = sweep
        self.actor = Actor("runtime", f"supervisor:{supervisor.supervisor_id}")
        self._slots: dict[tuple[str, str], _Slot] = {}
        self._stop = threading.Event()
        # Taken first, before the API or any run: a second serve of this home is
        # refused here, not left to double every schedule.
        self._lock: ServeLock | None = ServeLock(
            self.rt.home, self.rt.store, supervisor.supervisor_id
        ).acquire()
        #: Why this node stopped holding its lease, if it did (then serve ends).
        self.lost: str | None = None
        #: What asked it to stop (a signal's name), for the log.
        self.stop_cause: str | None = None
        #: The runs that did not end in time when it stopped.
        self.unfinished: list[str] = []
        self.node = Node(self.rt.store, supervisor.supervisor_id, address=address,
                         backends=(supervisor.driver.name,), lease=lease)  # fmt: skip
        try:
            self.node.register()
        except BaseException:
            self.close()
            raise
        # Every write this node's ledger commits holds the lease in its transaction.
        self.rt.ledger.set_fence(self.node.fence)
        #: Runs asked of any node's API, for whichever node has room (_queue.py).
        self.queue = RunQueue(self.rt.store, self.node)
        supervisor.queue = self.queue
        self._taken: set[str] = set()
        self._offset, self._offset_at = 0.0, -1e9  # the database's clock less ours
        # Kept from now, not from serve(): what the caller starts first (the API)
        # may take longer than a lease.
        self.node.keep(self._lose)

    def close(self) -> None:
        """Leave the store's nodes and let another serve take over (done when
        :meth:`serve` returns)."""
        node: Node | None = getattr(self, "node", None)
        if node is not None and node.epoch:
            node.leave()
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    def stop(self, cause: str | None = None) -> None:
        """Ask :meth:`serve` to stop; ``cause`` (a signal's name, ``SIGTERM``) is
        what its ``serve.stopping`` log line says. Safe from a signal handler: it
        only sets events; the line is written by the loop."""
        if self.stop_cause is None:
            self.stop_cause = cause or "stop requested"
        self._stop.set()
        self.queue.kick.set()

    def reap(self) -> None:
        """Remove what killed predecessors left: their sandboxes first (they hold
        the sockets), then their broker sockets, then the record of their runs.
        Only what belongs to dead processes: a live runtime beside us keeps its own."""
        try:
            reap_orphans()
        except SandboxCleanupFailed as exc:
            # Left registered for the next attempt; what runs here is not at stake.
            log.warning("proctor serve: %s", exc.message)
        reap_broker_sockets()
        closed = self.supervisor.mark_interrupted(self.actor)
        log_event(log, "reap", runs=[r.id for r in closed], interrupted=len(closed))
        self.close_orphaned_asks()

    def close_orphaned_asks(self) -> None:
        """Close every ask whose run no longer runs (its serve was killed while a call
        waited): abandoned, recorded, never left waiting on nobody."""
        try:
            closed = self.rt.asks.abandon_orphans(self.actor)
        except ProctorError as exc:
            log.warning("proctor serve: asks of ended runs not closed yet: %s", exc.message)
            return
        if closed:
            log_event(log, "asks.abandoned", asks=[a.id for a in closed], runs=sorted(
                {a.run for a in closed}))  # fmt: skip

    def sweep(self) -> None:
        """Close the runs of this host's processes that died since the last look
        (their sandboxes and sockets first). Our own runs are ours to end."""
        closed = self.rt.close_orphaned_runs(self.actor, skip=self.supervisor.supervisor_id)
        if closed:
            log_event(log, "reap", runs=[run for _, run in closed], interrupted=len(closed))
            self.close_orphaned_asks()

    def sweep_nodes(self) -> None:
        """Find the nodes whose lease lapsed: the first node to see one marks it dead
        and records its runs as interrupted (then their services start elsewhere)."""
        for node in lapsed(self.rt.store):
            if node == self.node.id or not declare_dead(self.rt.store, node):
                continue  # ours is the lease thread's to judge; another node won this one
            gone = self.rt.close_orphaned_runs(self.actor, node=node)
            if gone:
                self.close_orphaned_asks()
            requeued, ended = self.queue.release(node)
            log_event(log, "node.dead", logging.WARNING, node=node,
                      runs=[run for _, run in gone], interrupted=len(gone),
                      requests_requeued=requeued, requests_ended=ended)  # fmt: skip

    def take_requests(self) -> None:
        """Take queued run requests while this node has room (a node running fewer
        runs gets the first chance, as with claims)."""
        while len(self._taken) < self.node.capacity and not self._stop.is_set():
            waited = self.queue.waiting_since()
            if waited is None or (waited < _UNCLAIMED and not self._least_loaded()):
                return
            request = self.queue.take()
            if request is None:
                return
            self._run_request(request)

    def _run_request(self, request: Request) -> None:
        self._taken.add(request.id)
        log_event(log, "request.take", request=request.id, tenant=request.tenant,
                  deployment=request.deployment, actor=request.actor.id)  # fmt: skip

        def started(run_id: str) -> None:
            self.queue.started(request.id, run_id)

        def body() -> None:
            try:
                record = self.supervisor.start(request.tenant, request.deployment,
                                               request.actor, on_start=started)  # fmt: skip
                self.queue.done(request.id, record.id, None)
            except ProctorError as exc:
                doc = {"error": {"code": exc.code, "message": exc.message, "hint": exc.hint}}
                with contextlib.suppress(ProctorError):  # a lost node: the others end it
                    self.queue.done(request.id, None, doc)
            finally:
                self._taken.discard(request.id)

        threading.Thread(target=body, name=f"request-{request.id}", daemon=True).start()

    def _lose(self, why: str) -> None:
        """This node's lease is gone: stop everything, record nothing more."""
        self.lost = why
        log_event(log, "node.lost", logging.ERROR, node=self.node.id, reason=why)
        self._stop.set()
        self.queue.kick.set()
        # Its runs are stopped now, not at the loop's next turn: each call they make
        # is refused already (the fence), and another node is about to take over.
        threading.Thread(target=self.supervisor.shutdown, args=(NODE_LOST,),
                         daemon=True).start()  # fmt: skip

    def serve(self) -> None:
        log_event(log, "node.join", node=self.node.id, epoch=self.node.epoch,
                  lease_seconds=self.node.lease)  # fmt: skip
        with contextlib.suppress(NodeLost):
            self.reap()
        next_sweep = time.monotonic() + self.sweep_seconds
        # Checkpoints go to each tenant's witnesses from a thread of their own: a
        # witness that is slow or down never holds up a tick or a call.
        submitter = Submitter(TenantWitnesses(self.rt.store, self.rt.ledger), submit_interval())
        submitter.start()
        next_prune = time.monotonic()  # retention: at start, then every PRUNE_SECONDS
        try:
            while not self._stop.is_set():
                if time.monotonic() >= next_prune:
                    next_prune = time.monotonic() + PRUNE_SECONDS
                    with contextlib.suppress(ProctorError):  # a busy store: next pass
                        prune_all(self.rt, self.actor)
                        prune_claims(self.rt.store, _day_before())
                        self.queue.prune(_day_before())
                # A failed tick (a busy store, say) is tried again at the next one.
                with contextlib.suppress(ProctorError):
                    self.sweep_nodes()
                    self.take_requests()
                    self.tick()
                if time.monotonic() >= next_sweep:
                    next_sweep = time.monotonic() + self.sweep_seconds
                    with contextlib.suppress(ProctorError, OSError):
                        self.sweep()
                # A request queued here wakes the loop at once; others wait a tick.
                self.queue.kick.wait(self.tick_seconds)
                self.queue.kick.clear()
        finally:
            # Every run of this process, whoever started it (a slot, the API), is
            # stopped and its end recorded before we exit: a run left 'running'
            # with its sandbox alive would wait for the next serve to be closed.
            # The operator sees the stop begin (and why) before the runs' own run.end
            # lines; ``proctor serve`` writes serve.stopped once the API is down too.
            signum = self.stop_cause if (self.stop_cause or "").startswith("SIG") else None
            log_event(log, "serve.stopping", node=self.node.id, signal=signum,
                      reason=_stop_reason(self.lost, self.stop_cause))  # fmt: skip
            submitter.stop()
            unfinished = self.supervisor.shutdown(NODE_LOST if self.lost else SUPERVISOR_STOPPING)
            self.unfinished = list(unfinished)
            if unfinished:
                log.error("proctor serve: runs %s did not end in time", ", ".join(unfinished))
            for slot in self._slots.values():
                slot.cancel.set()
            for slot in self._slots.values():
                if slot.thread is not None:
                    slot.thread.join(timeout=30)
            self.close()

    def tick(self) -> None:
        now = time.monotonic()
        for tenant in self.rt.tenants.list():
            deployments = {d.name: d for d in self.rt.deployments.current(tenant.name)}
            for name, dep in deployments.items():
                slot = self._slots.setdefault((tenant.name, name), _Slot(tenant.name, name))
                if tenant.status == "frozen" or dep.status != "active":
                    slot.cancel.set()
                    continue
                if slot.running and slot.version != dep.version:
                    slot.cancel.set()  # a new version was deployed: replace the old run
                    continue
                if slot.running:
                    continue
                if self.supervisor.runs.running_one(tenant.name, name) is not None:
                    # Started by someone else (`proctor run`, the API): one run at a
                    # time, and its end is no crash of ours. Looked up, not recorded.
                    continue
                if dep.mode == "service":
                    self._service(slot, dep, now)
                elif dep.mode == "schedule":
                    self._schedule(slot, dep, now)

    def _launch(self, slot: _Slot, dep: Deployment) -> None:
        slot.cancel = threading.Event()
        slot.version = dep.version
        slot.attempt += 1
        slot.last_start = time.monotonic()

        def body() -> None:
            try:
                slot.last = self.supervisor.start(
                    slot.tenant, slot.name, self.actor, cancel=slot.cancel, attempt=slot.attempt
                )
            except AlreadyRunning:
                slot.last, slot.elsewhere = None, True  # another start won: not a crash
            except ProctorError as exc:
                slot.last = None  # refused and recorded by the supervisor
                log_event(log, "run.refused", logging.WARNING, tenant=slot.tenant,
                          deployment=slot.name, attempt=slot.attempt, reason=exc.message,
                          actor=self.actor.id)  # fmt: skip

        slot.thread = threading.Thread(target=body, name=f"run-{slot.name}", daemon=True)
        slot.thread.start()

    def _claim(self, slot: _Slot, name: str, since: float) -> bool:
        """Whether this node starts what ``name`` stands for (tried once per slot).
        A node leaves a slot to a live node running fewer runs than it, so work
        spreads, unless the slot has waited ``_UNCLAIMED`` seconds (since ``since``,
        epoch seconds) and that node is not taking it."""
        if slot.tried == name:
            return False
        if self._now() - since < _UNCLAIMED and not self._least_loaded():
            return False
        slot.tried = name
        return claim(self.rt.store, slot.tenant, slot.name, name, self.node)

    def _now(self) -> float:
        """Epoch seconds by the database's clock, as every node reads it: ticks and
        slots are numbered alike on machines whose clocks disagree. The offset
        from this machine's clock is read again each minute."""
        if time.monotonic() - self._offset_at > 60.0:
            with contextlib.suppress(ProctorError):  # a busy store: this clock a while
                with self.rt.store.read() as conn:
                    row = conn.query_one(f"SELECT {self.rt.store.engine.clock}")
                if row is not None:
                    self._offset = float(row[0]) - time.time()
                    self._offset_at = time.monotonic()
        return time.time() + self._offset

    def _least_loaded(self) -> bool:
        load = running_per_node(self.rt.store)
        mine = load.get(self.node.id, 0)
        return all(count >= mine for count in load.values())

    def _service(self, slot: _Slot, dep: Deployment, now: float) -> None:
        # Read from the store, not from this node's memory: whichever node starts the
        # next run, the backoff and the crash loop count every node's runs.
        slot.thread = None
        last = self.supervisor.runs.latest(slot.tenant, slot.name)
        if last is not None and last.status == "running":
            return  # started since the tick looked: its end is the next slot
        failures = 0
        if last is not None and last.status == "failed":
            failures = self.supervisor.runs.failed_since(
                slot.tenant, slot.name, self._now() - self.crash_window
            )
            delay = self.backoff[min(max(failures, 1) - 1, len(self.backoff) - 1)]
            if _seconds_since(last.ended_at, self._now()) < delay:
                return
        now_db = self._now()
        free_since = now_db - _seconds_since(last.ended_at if last else None, now_db)
        # A claim whose node never started the run (it died just after, or its start
        # was refused) would hold the slot for ever: each _RECLAIM seconds the slot
        # is a new one. Two runs never follow: the store allows one running at a time.
        waited = now_db - free_since if last is not None else now_db
        generation = int(max(waited, 0) // _RECLAIM)
        name = f"after:{last.id if last else '-'}:{generation}"
        if not self._claim(slot, name, free_since):
            return
        if failures >= self.crash_limit:
            self.rt.deployments.set_status(
                slot.tenant, slot.name, "stopped", self.actor,
                f"crash loop: {failures} failures in {self.crash_window:.0f} s",
            )  # fmt: skip
            log_event(log, "service.stopped", logging.WARNING, tenant=slot.tenant,
                      deployment=slot.name, failures=failures, reason="crash loop")  # fmt: skip
            return
        if last is not None:
            log_event(log, "service.restart", tenant=slot.tenant, deployment=slot.name,
                      attempt=slot.attempt + 1, failures=failures, last_run=last.id,
                      last_status=last.status)  # fmt: skip
        self._launch(slot, dep)

    def _schedule(self, slot: _Slot, dep: Deployment, now: float) -> None:
        every = max(dep.every_seconds or 1.0, 0.001)
        slot.thread = None
        tick = int(self._now() // every)
        if self._claim(slot, f"tick:{every:g}:{tick}", tick * every):
            log_event(log, "schedule.fire", tenant=slot.tenant, deployment=slot.name,
                      every_seconds=every, version=dep.version, tick=tick)  # fmt: skip
            self._launch(slot, dep)


def _stop_reason(lost: str | None, cause: str | None) -> str:
    if lost is not None:
        return f"{NODE_LOST}: {lost}"
    if cause is not None and cause.startswith("SIG"):
        return f"signal {cause}"
    return cause or "stop requested"


def _seconds_since(iso: str | None, now: float) -> float:
    if not iso:
        return 1e9
    when = datetime.fromisoformat(iso.replace("Z", "+00:00"))
    return now - when.timestamp()


def _day_before() -> str:
    return (datetime.now(UTC) - timedelta(days=1)).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def prune_all(rt: Home, actor: Actor) -> None:
    """Prune each tenant's events past its retention period (governance.Retention);
    a tenant whose prune fails is logged and tried again at the next pass."""
    retention = Retention(rt.store, rt.ledger)
    for tenant in rt.tenants.list():
        try:
            result = retention.prune(tenant.name, actor)
        except ProctorError as exc:
            log_event(log, "retention.prune_failed", tenant=tenant.name, error=exc.message)
            continue
        if result.pruned:
            log_event(log, "retention.prune", tenant=tenant.name, pruned=result.pruned,
                      held=result.held, cutoff=result.cutoff, rule=result.rule)  # fmt: skip
        if result.misdated or result.unverified:
            # The prune went by the signed times; what it saw of a store changed by hand
            # is for the operator (`proctor audit verify`).
            log_event(log, "retention.prune_tampering", logging.WARNING, tenant=tenant.name,
                      misdated=list(result.misdated[:20]), misdated_count=len(result.misdated),
                      unverified=list(result.unverified[:20]),
                      unverified_count=len(result.unverified))  # fmt: skip
