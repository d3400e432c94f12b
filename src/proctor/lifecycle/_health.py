"""Readiness: whether this runtime can do its work now, each check saying why not
and what fixes it. ``/readyz`` asks it every few seconds, ``proctor doctor`` once.

The checks, in order: the store writes, the ledger appends, the sandbox backend
starts, every witnessed tenant's log is within its witness policy, the home's
keys load, and (under ``serve``) this node holds its lease. Each is a
:class:`Check`; :class:`Health` runs them over an opened home (``governance.Home``)
and keeps what is costly for a while, so a probe every few seconds costs little:

- nothing is appended to the ledger to test it (a probe every five seconds would
  fill the log): the store's write lock is taken and released, and the ledger's
  writer is asked to pass a barrier, which commits nothing;
- a real sandbox (``/usr/bin/true``) is started at most every ``sandbox_every``
  seconds while it keeps working; in between, the backend's preconditions are
  checked each time (its binary, the guest user, cgroups); a failed start is
  tried again at the next check;
- the witness tables are read at most every ``witness_every`` seconds.

What a check says comes in two parts: ``reason``, ``detail`` and ``fix`` name no
tenant, path, host or raw error, and are what ``/readyz`` answers to anyone
(the kubelet has no credential); ``notes`` says which file, which tenant and the
error itself, for the operator of the machine (``proctor doctor``).
"""

from __future__ import annotations

import os
import sqlite3
import threading
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from proctor.errors import ProctorError
from proctor.governance import Home
from proctor.ledger import Signer
from proctor.sandbox import Limits, SandboxDriver, SandboxSpec, get_driver, run_captured
from proctor.store import Engine
from proctor.witness import TenantWitnesses

#: The free space under which the store's file system fails the store check: a
#: batch of events, a checkpoint and SQLite's WAL growth must still fit.
MIN_FREE_BYTES = 64 * 1024 * 1024
#: How long the store check waits for another writer's lock, and the ledger check
#: for its writer to pass the barrier: a probe must answer well inside its timeout.
LOCK_WAIT = 2.0
#: The defaults for ``serve``'s probes: a real sandbox start every 5 minutes,
#: the witness tables read every 10 s, one answer shared by probes within 1 s.
SANDBOX_EVERY = 300.0
WITNESS_EVERY = 10.0
SHARED_FOR = 1.0

#: Every check's name, in the order they are made (``node`` only under serve).
CHECKS = ("store", "ledger", "sandbox", "witnesses", "keys", "node")
#: What /readyz adds to a failing answer: the rest is for the machine's operator.
DOCTOR_HINT = "run `proctor doctor` on the node: it names the file, tenant or error"


@dataclass(frozen=True)
class Check:
    """One check's answer. ``reason`` and ``fix`` are set when it failed; ``detail``
    says what was checked (and found); ``notes`` are for the machine's operator only."""

    name: str
    ok: bool
    detail: str
    reason: str | None = None
    fix: str | None = None
    notes: tuple[str, ...] = ()

    def as_json(self, *, private: bool = False) -> dict[str, Any]:
        doc: dict[str, Any] = {"name": self.name, "ok": self.ok, "detail": self.detail}
        if not self.ok:
            doc["reason"] = self.reason
            doc["fix"] = self.fix
        if private:
            doc["notes"] = list(self.notes)
        return doc


@dataclass(frozen=True)
class Readiness:
    checks: tuple[Check, ...]

    @property
    def ready(self) -> bool:
        return all(c.ok for c in self.checks)

    @property
    def failing(self) -> tuple[Check, ...]:
        return tuple(c for c in self.checks if not c.ok)

    def as_json(self, *, private: bool = False) -> dict[str, Any]:
        return {
            "status": "ready" if self.ready else "not_ready",
            "checks": [c.as_json(private=private) for c in self.checks],
        }


def _fail(name: str, reason: str, fix: str, detail: str = "", notes: tuple[str, ...] = ()) -> Check:
    return Check(name, False, detail or reason, reason, fix, notes)


def _why(exc: BaseException) -> str:
    return exc.message if isinstance(exc, ProctorError) else str(exc) or type(exc).__name__


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover - the loop returns at GiB


# -- the store ----------------------------------------------------------------------


class _Rollback(Exception):
    """Ends the probe's write transaction without committing anything."""


def _sqlite_path(url: str) -> Path:
    return Path(url.removeprefix("sqlite:///"))


def check_store(home: Home) -> Check:
    """The store takes a write: its write lock is taken and released (nothing is
    written); SQLite's file, side files and directory take writes and their file
    system has room; PostgreSQL answers and is neither a standby nor read-only."""
    store = home.store
    if store.engine is Engine.POSTGRESQL:
        return _check_postgres(home)
    return _check_sqlite(_sqlite_path(store.url))


def _check_sqlite(path: Path) -> Check:
    name = "store"
    notes: list[str] = []
    refused = [
        p
        for p in (path, Path(f"{path}-wal"), Path(f"{path}-shm"))
        if p.exists() and not os.access(p, os.W_OK)
    ]
    if not os.access(path.parent, os.W_OK | os.X_OK):
        refused.append(path.parent)
    # access(2) answers for root too: a read-only mount (EROFS) or an immutable file.
    if refused:
        return _fail(
            name,
            "the store's files refuse writes (a read-only file system, an immutable file, "
            "or their permissions)",
            "make the store's file, its -wal and -shm files and their directory writable "
            "by the user serve runs as; remount a read-only file system read-write "
            "(`mount -o remount,rw`), remove an immutable flag (`chattr -i`)",
            notes=tuple(f"not writable: {p}" for p in refused),
        )
    try:
        st = os.statvfs(path.parent)
    except OSError as exc:
        return _fail(name, "the store's file system cannot be asked for its free space",
                     "check the file system holding the store",
                     notes=(f"statvfs {path.parent}: {exc}",))  # fmt: skip
    # Root may write into the blocks a file system keeps back for it; others not.
    free = st.f_frsize * (st.f_bfree if os.geteuid() == 0 else st.f_bavail)
    notes.append(f"{path}: {_size(free)} free on its file system")
    if free < MIN_FREE_BYTES or (st.f_files > 0 and st.f_ffree == 0):
        what = "no inode" if st.f_files > 0 and st.f_ffree == 0 else f"{_size(free)}"
        return _fail(
            name,
            f"the store's file system is full ({what} free, under the "
            f"{_size(MIN_FREE_BYTES)} the ledger keeps in reserve)",
            "free space on the file system that holds the home (old run directories, "
            "logs, other files), or grow the volume; the ledger's events must fit before "
            "any call is answered",
            notes=tuple(notes),
        )
    uri = f"file:{urllib.parse.quote(str(path))}?mode=rw"
    try:
        db = sqlite3.connect(uri, uri=True, timeout=LOCK_WAIT, isolation_level=None)
        try:
            # The lock the ledger's writer takes, taken and given back: it is free
            # (or freed within LOCK_WAIT) and the file may be written.
            db.execute("BEGIN IMMEDIATE")
            db.execute("ROLLBACK")
        finally:
            db.close()
    except sqlite3.Error as exc:
        notes.append(f"{path}: {exc}")
        if "locked" in str(exc) or "busy" in str(exc):
            return _fail(
                name,
                f"another writer has held the store's write lock for over {LOCK_WAIT:g} s",
                "find the process that holds the store open (`fuser -v` on the store's file) "
                "and let it finish or stop it; a second `serve` of the home is refused, a "
                "long command is not",
                notes=tuple(notes),
            )
        return _fail(
            name,
            "the store cannot take a write transaction",
            "check the store's file and its file system (permissions, a read-only mount, "
            "`proctor audit verify`)",
            notes=tuple(notes),
        )
    return Check(name, True, f"SQLite: write lock taken and released; {_size(free)} free",
                 notes=tuple(notes))  # fmt: skip


def _check_postgres(home: Home) -> Check:
    name = "store"
    store = home.store
    try:
        with store.write("proctor:health") as conn:
            row = conn.query_one(
                "SELECT current_setting('transaction_read_only'), pg_is_in_recovery()"
            )
            raise _Rollback(row)
    except _Rollback as done:
        row = done.args[0]
    except (ProctorError, OSError) as exc:
        return _fail(
            name,
            "the store (PostgreSQL) cannot be reached or refused a transaction",
            "check that PostgreSQL is up and reachable from this node, and the store's DSN, "
            "user and database",
            notes=(_why(exc),),
        )
    read_only = row is not None and str(row[0]).lower() == "on"
    recovery = row is not None and bool(row[1])
    if recovery:
        return _fail(
            name,
            "the store (PostgreSQL) is a standby in recovery: it takes no writes",
            "point the store's DSN at the primary (after a failover, at the new primary), "
            "or promote this server",
        )
    if read_only:
        return _fail(
            name,
            "the store's (PostgreSQL) transactions are read-only (default_transaction_read_only"
            " is on)",
            "a provider sets it when storage runs out: free or grow the storage, then "
            "`ALTER SYSTEM RESET default_transaction_read_only` (or the role's, database's "
            "setting) and `SELECT pg_reload_conf()`",
        )
    return Check(name, True, "PostgreSQL: a write transaction taken and rolled back; "
                 "not read-only, not in recovery")  # fmt: skip


# -- the ledger ---------------------------------------------------------------------


class _Barrier:
    """The ledger writer's barrier, waited on from a thread of its own: a writer
    that is stuck would otherwise hold the probe, and every later probe asks only
    once the last barrier has passed (no thread piles up behind a stuck writer)."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._asked = 0.0

    def passes(self, flush: Callable[[], None], wait: float) -> float | None:
        """Seconds the writer has been stuck on a barrier, or None if it passed one."""
        if self._thread is not None and self._thread.is_alive():
            self._thread.join(wait)
            if self._thread.is_alive():
                return time.monotonic() - self._asked
        self._asked = time.monotonic()
        self._thread = threading.Thread(target=flush, name="proctor-health-flush", daemon=True)
        self._thread.start()
        self._thread.join(wait)
        return time.monotonic() - self._asked if self._thread.is_alive() else None


#: How long a failed ledger commit keeps the node unready when nothing has committed
#: since (an idle node would otherwise stay unready after one failure, forever).
FAILURE_WINDOW = 10.0


def check_ledger(home: Home, store: Check, barrier: _Barrier | None = None) -> Check:
    """The ledger can append: it is open, its writer passes a barrier (what is
    queued before it is committed or failed, nothing of its own is), its store
    writes, and its last batch did not fail (within FAILURE_WINDOW, none committed
    since: a failure the store check cannot see, a fence, an fsync's error).
    Nothing is appended."""
    name = "ledger"
    ledger = home.ledger
    if ledger.closed:
        return _fail(name, "the ledger is closed: this process records nothing more",
                     "restart serve")  # fmt: skip
    stuck = (barrier or _Barrier()).passes(ledger.flush, LOCK_WAIT)
    if stuck is not None:
        return _fail(
            name,
            f"the ledger's writer has not finished its batch for {stuck:.0f} s (waiting on "
            "the store's lock, or a write that does not return)",
            "look at the store check and the store's server or disk; if it does not "
            "recover, restart serve (every call waits on this writer)",
        )
    if not store.ok:
        return _fail(name, "the ledger cannot append: its store takes no write",
                     "fix the store (see the store check)")  # fmt: skip
    failed = ledger.last_failure
    if failed is not None and time.time() - failed[0] < FAILURE_WINDOW:
        return _fail(
            name,
            f"the ledger's last commit failed {time.time() - failed[0]:.0f} s ago and none "
            "has succeeded since: calls are refused",
            "look at the store check and the store's server or disk (and serve's log)",
            notes=(failed[1],),
        )
    return Check(name, True, "open; its writer passed a barrier; its store takes writes")


# -- the sandbox backend ------------------------------------------------------------

#: What the real start runs: the smallest program, the smallest limits.
_PROBE = SandboxSpec(argv=("/usr/bin/true",), limits=Limits(memory_bytes=64 << 20,
                     pids=16, wall_seconds=20.0, output_bytes=4096))  # fmt: skip


@dataclass
class _Started:
    at: float  # monotonic
    ok: bool
    seconds: float
    why: str = ""


@dataclass
class _SandboxProbe:
    """The last real start of a sandbox, shared by the checks of one :class:`Health`."""

    every: float
    last: _Started | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)

    def check(self, driver: SandboxDriver) -> Check:
        name = "sandbox"
        status = driver.status()
        if not status.available:
            self.last = None  # fixed later, the backend is started for real again at once
            return _fail(
                name,
                f"the {driver.name} backend cannot start sandboxes: "
                + _public_reason(status.reason),
                _sandbox_fix(driver.name),
                notes=(status.reason,),
            )
        last = self.last
        due = last is None or not last.ok or time.monotonic() - last.at >= self.every
        did = "preconditions checked"
        if due and self.lock.acquire(blocking=False):
            try:
                last = self.last = self._start(driver)
                did = "preconditions checked; started a real sandbox now"
            finally:
                self.lock.release()
        elif due:
            did = "preconditions checked; a real start is under way in another check"
        if last is None:
            return _fail(name, "no real sandbox has been started yet (a first start is under "
                         "way)", "wait for the next check")  # fmt: skip
        ago = time.monotonic() - last.at
        if not last.ok:
            return _fail(
                name,
                f"the {driver.name} backend's preconditions hold, but a real sandbox did not start",
                _sandbox_fix(driver.name),
                detail=f"{did}; the real start {ago:.0f} s ago failed",
                notes=(last.why,),
            )
        when = "now" if ago < 1 else f"{ago:.0f} s ago"
        return Check(name, True, f"{driver.name}: {did}; last real start {when}, "
                     f"{last.seconds:.2f} s", notes=(status.reason,))  # fmt: skip

    @staticmethod
    def _start(driver: SandboxDriver) -> _Started:
        began = time.monotonic()
        try:
            run = run_captured(driver, _PROBE)
        except (ProctorError, OSError) as exc:
            return _Started(began, False, time.monotonic() - began, _why(exc))
        took = time.monotonic() - began
        if run.result.exit_code != 0:
            err = run.stderr.decode(errors="replace").strip()[-300:]
            why = f"/usr/bin/true ended {run.result.reason} {run.result.exit_code}: {err}"
            return _Started(began, False, took, why)
        return _Started(began, True, took)


def _public_reason(reason: str) -> str:
    # The driver's words name binaries and users, nothing of a tenant or path of the
    # home; only the first clause, without its hint, goes out.
    return reason.split(" (hint:", maxsplit=1)[0].split("; ", maxsplit=1)[0][:200]


def _sandbox_fix(backend: str) -> str:
    if backend == "gvisor":
        return ("install gVisor (`apt-get install runsc`), run where /sys/fs/cgroup is "
                "writable, or start serve with `--backend bubblewrap`; `proctor sandbox "
                "backends` says what each backend lacks")  # fmt: skip
    return ("install bubblewrap (`apt-get install bubblewrap`), create the guest user "
            "(`make setup`), run where /sys/fs/cgroup is writable and user namespaces are "
            "allowed; `proctor sandbox backends` says what each backend lacks")  # fmt: skip


# -- witnesses ----------------------------------------------------------------------


def check_witnesses(home: Home) -> Check:
    """Every tenant with witnesses has its newest checkpoint cosigned by a quorum, or
    has gone without that for no longer than its policy's max age (a quiet log
    whose head was cosigned long ago is within it: there is nothing new to cosign)."""
    name = "witnesses"
    tw = TenantWitnesses(home.store, home.ledger)
    try:
        tenants = tw.tenants()
        stale: list[str] = []
        for tenant in tenants:
            status = tw.status(tenant)
            if not status["within_policy"]:
                since = status["uncosigned_for_seconds"]
                stale.append(
                    f"tenant {tenant}: newest checkpoint uncosigned by a quorum for "
                    f"{'?' if since is None else f'{since:.0f}'} s, max age "
                    f"{status['policy']['max_age_seconds']} s, log size {status['log_size']}, "
                    f"cosigned up to {status['newest_cosigned_size'] or 'none'}"
                )
    except ProctorError as exc:
        return _fail(name, "the witness tables cannot be read",
                     "fix the store (see the store check)", notes=(_why(exc),))  # fmt: skip
    if stale:
        return _fail(
            name,
            "a witnessed tenant's log has gone past its witness policy's max age without a "
            "quorum of cosignatures",
            "check that serve's submitter reaches the tenant's witnesses (`proctor witness "
            "status -t T`, serve's log), that the witnesses are up and know the log "
            "(`proctor witness add-log` on the witness), then `proctor witness submit -t T`",
            notes=tuple(stale),
        )
    # No count: /readyz says nothing of the tenants, not even how many are witnessed.
    detail = "every witnessed log within its max age" if tenants else "no tenant has witnesses"
    return Check(name, True, detail, notes=(f"{len(tenants)} tenant(s) with witnesses",))


# -- keys ---------------------------------------------------------------------------


def check_keys(home: Home) -> Check:
    """The home's keys load: the ledger's signing key (the one this ledger signs
    with) and the runtime key, readable by their owner only."""
    name = "keys"
    keys = home.home / "keys"
    signing, runtime = keys / "ledger.pem", keys / "runtime.key"
    try:
        signer = Signer.load(home.config.trust_domain, signing)
        secret = runtime.read_bytes()
        open_to = [p for p in (signing, runtime) if p.stat().st_mode & 0o077]
    except (ProctorError, OSError) as exc:
        return _fail(name, "the home's keys cannot be read",
                     "restore keys/ledger.pem and keys/runtime.key from the home's backup "
                     "(or the Secret they are mounted from), readable by the user serve "
                     "runs as", notes=(_why(exc),))  # fmt: skip
    if signer.verifier.vkey() != home.ledger.vkey():
        return _fail(name, "the signing key on disk is not the one this ledger signs with",
                     "put back the home's own keys/ledger.pem; a key from another home "
                     "would sign checkpoints no verifier of this home accepts",
                     notes=(str(signing),))  # fmt: skip
    if len(secret) != 32:
        return _fail(name, "the runtime key is damaged (not 32 bytes)",
                     "restore keys/runtime.key from the home's backup",
                     notes=(str(runtime),))  # fmt: skip
    if open_to:
        return _fail(name, "a key of the home can be read by other users",
                     "`chmod 600` the home's keys (a Kubernetes Secret: defaultMode 0400)",
                     notes=tuple(f"group or others may read {p}" for p in open_to))  # fmt: skip
    return Check(name, True, "signing key and runtime key load, owner-only")


# -- this node ----------------------------------------------------------------------


def check_node(home: Home, node_id: str) -> Check | None:
    """Under ``serve``: this node is live in its store and its lease has not lapsed.
    None when the store has no node of that id (an API without serve)."""
    from proctor.lifecycle._nodes import nodes

    name = "node"
    try:
        found = [n for n in nodes(home.store) if n.id == node_id]
    except ProctorError as exc:
        return _fail(name, "the store's nodes cannot be read",
                     "fix the store (see the store check)", notes=(_why(exc),))  # fmt: skip
    if not found:
        return None
    node = found[0]
    if node.state != "live" or node.expires_in <= 0:
        return _fail(
            name,
            f"this node no longer holds its lease ({node.state}, "
            f"{'lapsed' if node.expires_in <= 0 else 'not live'})",
            "serve ends when it loses its lease: start it again (it joins as a new node); "
            "check the store's reachability from this node",
        )
    return Check(name, True, f"live; lease held for {node.expires_in:.0f} s more")


# -- all of them --------------------------------------------------------------------


class Health:
    """The readiness checks of one opened home, with what is costly kept a while.

    ``driver``: the sandbox driver runs would use, or its backend's name (or a
    callable giving either, asked at each check: the API's supervisor may be made
    after this); None: the best this host has, as ``serve`` would pick. ``node``:
    this ``serve``'s node id, for the lease check.
    ``sandbox_every``: seconds between real sandbox starts while they work (0: at
    every check, as ``doctor`` does). ``witness_every``: seconds the witness
    check's answer is kept. ``shared_for``: seconds one answer serves every caller.
    """

    def __init__(
        self,
        home: Home,
        *,
        driver: Callable[[], SandboxDriver | str | None] | SandboxDriver | str | None = None,
        node: Callable[[], str | None] | str | None = None,
        sandbox_every: float = SANDBOX_EVERY,
        witness_every: float = WITNESS_EVERY,
        shared_for: float = SHARED_FOR,
    ) -> None:
        self._home = home
        self._driver = driver
        self._node = node
        self._sandbox = _SandboxProbe(sandbox_every)
        self._witness_every = witness_every
        self._witnesses: tuple[float, Check] | None = None
        self._shared_for = shared_for
        self._last: tuple[float, Readiness] | None = None
        self._lock = threading.Lock()
        self._barrier = _Barrier()

    def check(self) -> Readiness:
        """Every check's answer (one answer shared by the callers of ``shared_for``)."""
        with self._lock:
            now = time.monotonic()
            if self._last is not None and now - self._last[0] < self._shared_for:
                return self._last[1]
            result = Readiness(tuple(self._run()))
            self._last = (time.monotonic(), result)
            return result

    def _run(self) -> list[Check]:
        checks: list[Check] = []
        store = _guarded("store", lambda: check_store(self._home))
        checks.append(store)
        checks.append(_guarded("ledger", lambda: check_ledger(self._home, store, self._barrier)))
        checks.append(_guarded("sandbox", self._check_sandbox))
        checks.append(_guarded("witnesses", self._check_witnesses))
        checks.append(_guarded("keys", lambda: check_keys(self._home)))
        node = self._node() if callable(self._node) else self._node
        if node is not None:
            found = check_node(self._home, node)
            if found is not None:
                checks.append(found)
        return checks

    def _check_sandbox(self) -> Check:
        try:
            given = self._driver() if callable(self._driver) else self._driver
            driver = (
                given if given is not None and not isinstance(given, str) else (get_driver(given))
            )
        except ProctorError as exc:
            return _fail("sandbox", "no sandbox backend works on this machine",
                         _sandbox_fix("gvisor"), notes=(_why(exc),))  # fmt: skip
        return self._sandbox.check(driver)

    def _check_witnesses(self) -> Check:
        kept = self._witnesses
        now = time.monotonic()
        if kept is not None and now - kept[0] < self._witness_every:
            return kept[1]
        found = check_witnesses(self._home)
        self._witnesses = (time.monotonic(), found)
        return found


def _guarded(name: str, check: Callable[[], Check]) -> Check:
    """A check that raised is a failed check (fail closed), never a failed probe."""
    try:
        return check()
    except Exception as exc:
        return _fail(name, f"the {name} check itself failed",
                     "report it, with what `proctor doctor` prints",
                     notes=(f"{type(exc).__name__}: {_why(exc)}",))  # fmt: skip
