"""Fair sharing of the broker's blocking work between runs and tenants.

A brokered SQL statement or file transfer blocks a thread for as long as the
database or the disk takes. On the event loop's default executor (a handful of
threads shared by everything in the process) one run's slow statements queue
every other tenant's calls behind them. Here that work goes to a pool of the
broker's own, and each job first takes a slot that three bounds govern:

* a run has at most :data:`PER_RUN` jobs in flight (its own further calls wait);
* a tenant has at most :data:`PER_TENANT` (all its runs together), fewer than
  the pool's :data:`WORKERS`, so another tenant always finds a free worker;
* when a slot frees, waiting tenants are served in turn (round robin), so a
  tenant with many queued calls cannot keep the pool by asking first.

A job's slot is held until its thread returns, not until its caller stops
waiting: a cancelled call whose statement still runs still counts, so
cancelling and asking again cannot grow one run's share.

Callers use :func:`run_blocking` where they would use ``asyncio.to_thread``.
The bookkeeping is guarded by a lock and waiters are woken on their own loop,
so callers on different event loops (the broker's, a test's ``asyncio.run``)
share one fair pool.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import ParamSpec, TypeVar

from proctor.broker._scope import RunScope

P = ParamSpec("P")
T = TypeVar("T")

#: Threads of the broker's own pool (the work waits on disks and databases, not CPU).
WORKERS = 16
#: At most this many jobs of one tenant run at once (all its runs together).
PER_TENANT = 8
#: At most this many jobs of one run run at once.
PER_RUN = 4


@dataclass
class _Waiter:
    tenant: str
    run: str
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[None]


@dataclass
class _Share:
    """The pool's accounting, under one lock."""

    free: int
    busy_tenant: dict[str, int] = field(default_factory=dict)
    busy_run: dict[str, int] = field(default_factory=dict)
    # tenant -> its waiters in arrival order; the dict's order is the round robin.
    waiting: OrderedDict[str, deque[_Waiter]] = field(default_factory=OrderedDict)


class FairPool:
    """A thread pool shared fairly: see the module's docstring."""

    def __init__(
        self, workers: int = WORKERS, per_tenant: int = PER_TENANT, per_run: int = PER_RUN
    ) -> None:
        if not 1 <= per_run <= per_tenant < workers:
            raise ValueError("need 1 <= per_run <= per_tenant < workers")
        self.workers = workers
        self.per_tenant = per_tenant
        self.per_run = per_run
        self._executor = ThreadPoolExecutor(workers, thread_name_prefix="proctor-broker-work")
        self._lock = threading.Lock()
        self._share = _Share(free=workers)
        self._started = False

    def _start_workers(self) -> None:
        """Start every worker now, once: a pool that grows a thread at a time under
        load reads as a leak to whoever counts threads, and costs the first calls."""
        with self._lock:
            if self._started:
                return
            self._started = True
            # Each waits for all the others, so each submit starts a thread of its own.
            barrier = threading.Barrier(self.workers + 1, timeout=30)
            for _ in range(self.workers):
                self._executor.submit(barrier.wait)
            with contextlib.suppress(threading.BrokenBarrierError):
                barrier.wait()

    def _fits(self, tenant: str, run: str) -> bool:
        s = self._share
        return (
            s.free > 0
            and s.busy_tenant.get(tenant, 0) < self.per_tenant
            and s.busy_run.get(run, 0) < self.per_run
        )

    def _take(self, tenant: str, run: str) -> None:
        s = self._share
        s.free -= 1
        s.busy_tenant[tenant] = s.busy_tenant.get(tenant, 0) + 1
        s.busy_run[run] = s.busy_run.get(run, 0) + 1

    def _give(self, tenant: str, run: str) -> None:
        wake: list[_Waiter] = []
        with self._lock:
            s = self._share
            s.free += 1
            for counts, name in ((s.busy_tenant, tenant), (s.busy_run, run)):
                counts[name] -= 1
                if not counts[name]:
                    del counts[name]
            self._hand_out(wake)
        self._wake(wake)

    def _wake(self, wake: list[_Waiter], me: _Waiter | None = None) -> None:
        for w in wake:
            if w is me:
                w.future.set_result(None)
                continue
            try:
                w.loop.call_soon_threadsafe(_wake, w.future)
            except RuntimeError:
                # Its loop is closed: nobody will run the job; the slot goes back.
                self._give(w.tenant, w.run)

    def _hand_out(self, wake: list[_Waiter]) -> None:
        """Give free slots to waiters, one tenant at a time in turn (lock held)."""
        s = self._share
        progress = True
        while s.free > 0 and s.waiting and progress:
            progress = False
            for tenant in list(s.waiting):
                queue = s.waiting[tenant]
                chosen = next((w for w in queue if self._fits(tenant, w.run)), None)
                if chosen is None:
                    continue
                queue.remove(chosen)
                # This tenant was served: it goes to the back of the turn.
                s.waiting.move_to_end(tenant)
                if not queue:
                    del s.waiting[tenant]
                self._take(tenant, chosen.run)
                wake.append(chosen)
                progress = True
                break

    async def _acquire(self, tenant: str, run: str) -> None:
        loop = asyncio.get_running_loop()
        waiter = _Waiter(tenant, run, loop, loop.create_future())
        wake: list[_Waiter] = []
        with self._lock:
            self._share.waiting.setdefault(tenant, deque()).append(waiter)
            self._hand_out(wake)
        self._wake(wake, waiter)
        try:
            await waiter.future
        except asyncio.CancelledError:
            with self._lock:
                queue = self._share.waiting.get(tenant)
                if queue is not None and waiter in queue:
                    queue.remove(waiter)
                    if not queue:
                        del self._share.waiting[tenant]
                    raise
            # The slot was handed over as we were cancelled: give it back.
            self._give(tenant, run)
            raise

    async def run(
        self, tenant: str, run: str, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs
    ) -> T:
        """``fn(*args, **kwargs)`` on a worker, once ``run`` of ``tenant`` has a slot."""
        if not self._started:
            self._start_workers()
        await self._acquire(tenant, run)
        call = functools.partial(contextvars.copy_context().run, fn, *args, **kwargs)
        try:
            future = self._executor.submit(call)
        except BaseException:
            self._give(tenant, run)
            raise
        # Released when the thread is done, whatever became of the caller.
        future.add_done_callback(lambda _f: self._give(tenant, run))
        return await asyncio.wrap_future(future)

    def busy(self) -> tuple[int, dict[str, int]]:
        """(workers in use, jobs in flight per tenant): for tests and benchmarks."""
        with self._lock:
            return self.workers - self._share.free, dict(self._share.busy_tenant)


def _wake(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


#: The broker's pool, one per process.
POOL = FairPool()


async def run_blocking(scope: RunScope, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
    """``asyncio.to_thread`` for the broker: ``fn`` runs on the fair pool as a job
    of ``scope``'s run and tenant (see the module's docstring)."""
    return await POOL.run(scope.tenant, scope.run_id, fn, *args, **kwargs)


# -- work done on the event loop itself ---------------------------------------------
#
# Some work is cheaper on the loop than the trip to a worker and back (a kept SQLite
# point read: _sql.quick_read, each bounded at a few milliseconds). The loop serves
# every run's calls, so that work is held to a share of it: each run's to
# LOOP_SHARE of a second (LOOP_BURST at once), all runs' together to LOOP_TOTAL.
# Past either, the work goes to the fair pool as any other.

#: The share of each second one run's work on the loop may take.
LOOP_SHARE = 0.25
#: What one run may take at once before its share refills.
LOOP_BURST = 0.05
#: The share of each second all runs' work on the loop may take together.
LOOP_TOTAL = 0.5
#: Runs whose loop time is kept (the least recently seen are forgotten first).
LOOP_RUNS_KEPT = 4096


class _Bucket:
    """Seconds of loop time: refilled at ``rate`` a second up to ``burst``; work
    may start while it is above zero, and what it took is charged after."""

    __slots__ = ("burst", "level", "rate", "when")

    def __init__(self, rate: float, burst: float, now: float) -> None:
        self.rate, self.burst, self.level, self.when = rate, burst, burst, now

    def refill(self, now: float) -> float:
        self.level = min(self.burst, self.level + (now - self.when) * self.rate)
        self.when = now
        return self.level


class LoopShare:
    """The loop time runs' work on the loop may take (see above)."""

    def __init__(
        self,
        share: float = LOOP_SHARE,
        burst: float = LOOP_BURST,
        total: float = LOOP_TOTAL,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._share, self._burst, self._clock = share, burst, clock
        self._total = _Bucket(total, 2 * burst, clock())
        self._runs: OrderedDict[tuple[str, str], _Bucket] = OrderedDict()

    def run(self, scope: RunScope, fn: Callable[[], T | None]) -> T | None:
        """``fn()`` on the loop, now, if ``scope``'s run and all runs are within their
        shares (its time charged to both); None, without calling it, if not."""
        now = self._clock()
        key = (scope.tenant, scope.run_id)
        bucket = self._runs.pop(key, None) or _Bucket(self._share, self._burst, now)
        self._runs[key] = bucket
        while len(self._runs) > LOOP_RUNS_KEPT:
            self._runs.popitem(last=False)
        if bucket.refill(now) <= 0 or self._total.refill(now) <= 0:
            return None
        try:
            return fn()
        finally:
            took = self._clock() - now
            bucket.level -= took
            self._total.level -= took


#: The broker's loop-time shares, one per process (like POOL; only the broker's
#: loop calls it).
LOOP = LoopShare()
