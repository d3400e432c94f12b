"""The runtime's side of witnessing: the witnesses a tenant uses, the cosignatures
they returned, and the submitter that asks them.

Tables (migration 9): ``tenant_witnesses`` (name, verifier key, URL),
``witness_policy`` (how many cosignatures a checkpoint needs and how long the
newest checkpoint may go without them), ``witness_cosignatures`` (one signature
line per log, checkpoint size and witness). Using or removing a witness is a
governance event in the tenant's log, written in the transaction of the row.

The submitter runs beside the calls, never on their path: a call's event is
durable locally whatever the witnesses do. Each pass sends a witness the log's
newest checkpoint with a consistency proof from the last size that witness
cosigned; a witness that was down is caught up at its next pass from there.
"""

from __future__ import annotations

import builtins
import contextlib
import logging
import os
import re
import threading
import time
import weakref
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, ClassVar
from urllib.parse import urlsplit

import httpx

from proctor import telemetry
from proctor.errors import AlreadyExists, NotFound, ProctorError, UsageError
from proctor.ledger import (
    Action,
    Actor,
    CosignatureVerifier,
    EventDraft,
    Ledger,
    add_signatures,
    cosigned_by,
    make_receipt,
    split_note,
    utc_now,
)
from proctor.store import Conn, Store

log = logging.getLogger("proctor.witness")

_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9._-]{0,62}$")
#: How often the submitter asks, at most, by default (seconds).
DEFAULT_INTERVAL = 10.0
#: The default tenant setting: how long the newest checkpoint may go uncosigned.
DEFAULT_MAX_AGE = 3600
_TIMEOUT = 5.0


def submit_interval() -> float:
    """How often ``proctor serve`` submits: ``PROCTOR_WITNESS_INTERVAL`` seconds if it
    is a number of at least 0.1, else the default (a bad value must not stop serve)."""
    try:
        value = float(os.environ.get("PROCTOR_WITNESS_INTERVAL", DEFAULT_INTERVAL))
    except ValueError:
        log.warning("PROCTOR_WITNESS_INTERVAL is not a number: using %s s", DEFAULT_INTERVAL)
        return DEFAULT_INTERVAL
    return max(0.1, value)


@dataclass(frozen=True)
class TenantWitness:
    tenant: str
    name: str
    vkey: str
    url: str
    created_at: str
    created_by: str

    def as_json(self) -> dict[str, Any]:
        return {
            "tenant": self.tenant,
            "name": self.name,
            "vkey": self.vkey,
            "url": self.url,
            "created_at": self.created_at,
            "created_by": self.created_by,
        }


@dataclass(frozen=True)
class WitnessPolicy:
    quorum: int
    max_age_seconds: int

    def as_json(self) -> dict[str, Any]:
        return {"quorum": self.quorum, "max_age_seconds": self.max_age_seconds}


@dataclass(frozen=True)
class Submission:
    """What one witness answered to one submission."""

    witness: str
    size: int
    ok: bool
    status: int | None
    detail: str

    def as_json(self) -> dict[str, Any]:
        return {
            "witness": self.witness,
            "size": self.size,
            "ok": self.ok,
            "status": self.status,
            "detail": self.detail,
        }


def _check_url(url: str) -> str:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise UsageError(
            f"invalid witness URL {url!r}",
            hint="the witness's submission prefix, e.g. http://10.0.0.2:7380",
        )
    return url.rstrip("/")


def _seconds_since(stamp: int) -> float:
    return max(0.0, time.time() - stamp)


class TenantWitnesses:
    """The witnesses of each tenant and the cosignatures they returned."""

    def __init__(self, store: Store, ledger: Ledger) -> None:
        self._store = store
        self._ledger = ledger

    # -- configuration ----------------------------------------------------------

    def use(self, tenant: str, name: str, vkey: str, url: str, actor: Actor) -> TenantWitness:
        if not _NAME_RE.match(name):
            raise UsageError(
                f"invalid witness name {name!r}",
                hint="lowercase letters, digits, '.', '_' or '-', up to 63 characters",
            )
        verifier = CosignatureVerifier.parse(vkey)
        url = _check_url(url)
        created_at = utc_now()

        def insert(conn: Conn) -> None:
            if conn.query_one("SELECT 1 FROM tenants WHERE name = ?", (tenant,)) is None:
                raise NotFound(f"unknown tenant {tenant!r}")
            if conn.query_one(
                "SELECT 1 FROM tenant_witnesses WHERE tenant = ? AND name = ?", (tenant, name)
            ):
                raise AlreadyExists(
                    f"tenant {tenant!r} uses a witness {name!r} already",
                    hint="'proctor witness remove' it first to change its key or URL",
                )
            conn.execute(
                "INSERT INTO tenant_witnesses (tenant, name, vkey, url, created_at, created_by)"
                " VALUES (?, ?, ?, ?, ?, ?)",
                (tenant, name, verifier.vkey(), url, created_at, actor.id),
            )

        self._ledger.append(
            tenant,
            EventDraft(
                actor,
                Action.WITNESS_USE,
                f"witness/{name}",
                reason="witness added",
                details={"vkey": verifier.vkey(), "url": url},
            ),
            hook=insert,
        )
        return TenantWitness(tenant, name, verifier.vkey(), url, created_at, actor.id)

    def remove(self, tenant: str, name: str, actor: Actor) -> None:
        def delete(conn: Conn) -> None:
            if not conn.query_one(
                "SELECT 1 FROM tenant_witnesses WHERE tenant = ? AND name = ?", (tenant, name)
            ):
                raise NotFound(f"tenant {tenant!r} uses no witness {name!r}")
            conn.execute(
                "DELETE FROM tenant_witnesses WHERE tenant = ? AND name = ?", (tenant, name)
            )

        self._ledger.append(
            tenant,
            EventDraft(actor, Action.WITNESS_REMOVE, f"witness/{name}", reason="witness removed"),
            hook=delete,
        )

    def list(self, tenant: str) -> builtins.list[TenantWitness]:
        with self._store.read() as conn:
            rows = conn.query(
                "SELECT name, vkey, url, created_at, created_by FROM tenant_witnesses"
                " WHERE tenant = ? ORDER BY name",
                (tenant,),
            )
        return [TenantWitness(tenant, *(str(v) for v in r)) for r in rows]

    def tenants(self) -> builtins.list[str]:
        with self._store.read() as conn:
            rows = conn.query("SELECT DISTINCT tenant FROM tenant_witnesses ORDER BY tenant")
        return [str(r[0]) for r in rows]

    def policy(self, tenant: str) -> WitnessPolicy:
        with self._store.read() as conn:
            row = conn.query_one(
                "SELECT quorum, max_age_seconds FROM witness_policy WHERE tenant = ?", (tenant,)
            )
        if row is None:
            return WitnessPolicy(1, DEFAULT_MAX_AGE)
        return WitnessPolicy(int(row[0]), int(row[1]))

    def set_policy(
        self, tenant: str, actor: Actor, *, quorum: int | None, max_age: int | None
    ) -> WitnessPolicy:
        old = self.policy(tenant)
        new = WitnessPolicy(
            old.quorum if quorum is None else quorum,
            old.max_age_seconds if max_age is None else max_age,
        )
        if new.quorum < 1:
            raise UsageError("--quorum must be at least 1")
        if new.max_age_seconds < 1:
            raise UsageError("--max-age must be at least 1 second")

        def upsert(conn: Conn) -> None:
            if conn.query_one("SELECT 1 FROM tenants WHERE name = ?", (tenant,)) is None:
                raise NotFound(f"unknown tenant {tenant!r}")
            conn.execute("DELETE FROM witness_policy WHERE tenant = ?", (tenant,))
            conn.execute(
                "INSERT INTO witness_policy (tenant, quorum, max_age_seconds) VALUES (?, ?, ?)",
                (tenant, new.quorum, new.max_age_seconds),
            )

        self._ledger.append(
            tenant,
            EventDraft(
                actor,
                Action.WITNESS_POLICY,
                f"tenant/{tenant}",
                reason="witness policy set",
                details=new.as_json(),
            ),
            hook=upsert,
        )
        return new

    # -- cosignatures -----------------------------------------------------------

    def _lines(self, conn: Conn, log: str, size: int) -> builtins.list[str]:
        return [
            str(r[0])
            for r in conn.query(
                "SELECT line FROM witness_cosignatures WHERE log = ? AND size = ? ORDER BY witness",
                (log, size),
            )
        ]

    def cosigned(self, log: str, note: str) -> str:
        """``note`` (a checkpoint of ``log``) with every stored cosignature of its size."""
        text, _ = split_note(note)
        size = int(text.split("\n")[1])
        with self._store.read() as conn:
            lines = self._lines(conn, log, size)
        return add_signatures(note, lines) if lines else note

    def cosigned_notes(self, log: str) -> builtins.list[str]:
        """Every checkpoint of ``log`` that a witness cosigned, with the stored
        cosignatures, newest first (a witness policy then picks one)."""
        with self._store.read() as conn:
            sizes = [
                int(r[0])
                for r in conn.query(
                    "SELECT DISTINCT size FROM witness_cosignatures WHERE log = ?"
                    " ORDER BY size DESC",
                    (log,),
                )
            ]
            notes = []
            for size in sizes:
                row = conn.query_one(
                    "SELECT note FROM ledger_checkpoints WHERE log = ? AND size = ?", (log, size)
                )
                if row is not None:
                    notes.append(add_signatures(str(row[0]), self._lines(conn, log, size)))
        return notes

    def newest_cosigned(self, log: str, quorum: int = 1) -> tuple[int, str] | None:
        """The largest checkpoint of ``log`` holding ``quorum`` stored cosignatures:
        (size, the note with them)."""
        with self._store.read() as conn:
            row = conn.query_one(
                "SELECT size FROM witness_cosignatures WHERE log = ?"
                " GROUP BY size HAVING COUNT(*) >= ? ORDER BY size DESC LIMIT 1",
                (log, quorum),
            )
            if row is None:
                return None
            size = int(row[0])
            note = conn.query_one(
                "SELECT note FROM ledger_checkpoints WHERE log = ? AND size = ?", (log, size)
            )
            lines = self._lines(conn, log, size)
        if note is None:
            return None
        return size, add_signatures(str(note[0]), lines)

    def _last_size(self, log: str, witness: str) -> int:
        with self._store.read() as conn:
            row = conn.query_one(
                "SELECT MAX(size) FROM witness_cosignatures WHERE log = ? AND witness = ?",
                (log, witness),
            )
        return int(row[0]) if row is not None and row[0] is not None else 0

    def status(self, tenant: str) -> dict[str, Any]:
        """How well witnessed the tenant's log is, for the evidence pack and `witness status`.

        ``newest_cosigned_age_seconds`` is how long ago the newest checkpoint with
        the policy's quorum was cosigned; ``uncosigned_for_seconds`` how long the log
        has had a newer checkpoint without that quorum (0 when the head has it);
        ``within_policy`` whether that is within the tenant's ``max_age_seconds``.
        """
        policy = self.policy(tenant)
        witnesses = self.list(tenant)
        head = self._ledger.head(tenant)
        newest = self.newest_cosigned(tenant, policy.quorum)
        age: float | None = None
        size: int | None = None
        if newest is not None:
            size, note = newest
            verifiers = [CosignatureVerifier.parse(w.vkey) for w in witnesses]
            stamps = sorted(cosigned_by(note, verifiers).values(), reverse=True)
            if len(stamps) >= policy.quorum:
                age = _seconds_since(stamps[policy.quorum - 1])
        # How long since the first checkpoint after the newest cosigned one was signed:
        # the log has gone that long without enough cosignatures.
        since = 0.0 if size == head.size else self._uncosigned_age(tenant, size or 0)
        within = bool(witnesses) and since is not None and since <= policy.max_age_seconds
        return {
            "tenant": tenant,
            "witnesses": [w.as_json() for w in witnesses],
            "policy": policy.as_json(),
            "log_size": head.size,
            "newest_cosigned_size": size,
            "newest_cosigned_age_seconds": None if age is None else round(age, 1),
            "uncosigned_for_seconds": None if since is None else round(since, 1),
            "within_policy": within,
            "per_witness": {w.name: self._last_size(tenant, w.name) for w in witnesses},
        }

    def uncosigned_since(self, tenant: str) -> float | None:
        """Since when (epoch seconds) the tenant's log has had a checkpoint newer than
        the newest one a quorum of its witnesses cosigned; None while its head has
        them (or nothing newer was signed yet). What ``status`` holds to the max age
        as ``uncosigned_for_seconds``, read in three small queries for the metric."""
        quorum = self.policy(tenant).quorum
        head = self._ledger.head(tenant)
        with self._store.read() as conn:
            row = conn.query_one(
                "SELECT MAX(size) FROM (SELECT size FROM witness_cosignatures WHERE log = ?"
                " GROUP BY size HAVING COUNT(*) >= ?) AS cosigned",
                (tenant, quorum),
            )
            size = int(row[0]) if row is not None and row[0] is not None else 0
            if size >= head.size:
                return None
            first = conn.query_one(
                "SELECT MIN(time) FROM ledger_checkpoints WHERE log = ? AND size > ?",
                (tenant, size),
            )
        if first is None or first[0] is None:
            return None
        when = datetime.strptime(str(first[0]), "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=UTC)
        return when.timestamp()

    def _uncosigned_age(self, log: str, after: int) -> float | None:
        with self._store.read() as conn:
            row = conn.query_one(
                "SELECT MIN(time) FROM ledger_checkpoints WHERE log = ? AND size > ?", (log, after)
            )
        if row is None or row[0] is None:
            return None
        when = datetime.strptime(str(row[0]), "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=UTC)
        return (datetime.now(UTC) - when).total_seconds()

    # -- submitting ------------------------------------------------------------

    def submit(self, tenant: str, client: httpx.Client | None = None) -> builtins.list[Submission]:
        """Send the tenant's newest checkpoint to each of its witnesses once;
        store the cosignatures that verify."""
        witnesses = self.list(tenant)
        if not witnesses:
            return []
        own = client is None
        http = client or httpx.Client(timeout=_TIMEOUT)
        try:
            return [self._submit_one(tenant, w, http) for w in witnesses]
        finally:
            if own:
                http.close()

    def _submit_one(self, tenant: str, w: TenantWitness, http: httpx.Client) -> Submission:
        head = self._ledger.head(tenant)
        old = self._last_size(tenant, w.name)
        if old == head.size:
            return Submission(w.name, head.size, True, None, "cosigned already")
        for _attempt in range(2):
            if old > head.size:
                # The witness cosigned more of this log than the log now holds: the
                # store was rolled back. Nothing to send; an operator must look.
                return Submission(
                    w.name,
                    head.size,
                    False,
                    409,
                    f"the witness cosigned size {old}, larger than the log's "
                    f"{head.size}: the log was rolled back",
                )
            proof: builtins.list[bytes] = []
            if 0 < old < head.size:
                proof = list(self._ledger.consistency_proof(tenant, old, head.size).hashes)
            body = add_checkpoint_body(old, proof, head.checkpoint)
            try:
                resp = http.post(w.url + "/add-checkpoint", content=body)
            except httpx.HTTPError as exc:
                return Submission(w.name, head.size, False, None, f"unreachable: {exc}")
            if resp.status_code == 409 and resp.headers.get("content-type", "").startswith(
                "text/x.tlog.size"
            ):
                text = resp.text.strip()
                if not text.isdigit() or int(text) == old:
                    break
                old = int(text)  # the witness's own size: prove from there
                continue
            if resp.status_code != 200:
                return Submission(w.name, head.size, False, resp.status_code, resp.text.strip())
            return self._store_cosignature(tenant, w, head.size, head.checkpoint, resp.text)
        return Submission(w.name, head.size, False, 409, "the witness's size keeps changing")

    def _store_cosignature(
        self, tenant: str, w: TenantWitness, size: int, note: str, answer: str
    ) -> Submission:
        verifier = CosignatureVerifier.parse(w.vkey)
        text, _ = split_note(note)
        line = next((ln for ln in answer.split("\n") if ln and _checks(verifier, text, ln)), None)
        if line is None:
            return Submission(w.name, size, False, 200, "no valid cosignature in the answer")
        with self._store.write() as conn:
            conn.execute(
                "DELETE FROM witness_cosignatures WHERE log = ? AND size = ? AND witness = ?",
                (tenant, size, w.name),
            )
            conn.execute(
                "INSERT INTO witness_cosignatures (log, size, witness, line, time)"
                " VALUES (?, ?, ?, ?, ?)",
                (tenant, size, w.name, line, utc_now()),
            )
        return Submission(w.name, size, True, 200, "cosigned")


def _checks(verifier: CosignatureVerifier, text: str, line: str) -> bool:
    try:
        return verifier.check_line(text, line) is not None
    except ProctorError:
        return False


def add_checkpoint_body(old: int, proof: list[bytes], note: str) -> bytes:
    """A C2SP tlog-witness ``add-checkpoint`` request body."""
    import base64

    lines = [f"old {old}"] + [base64.b64encode(h).decode() for h in proof]
    return ("\n".join(lines) + "\n\n" + note).encode()


class _Lag:
    """The running submitters, whose tenants' witness lag each scrape reads."""

    lock = threading.Lock()
    live: ClassVar[weakref.WeakSet[Submitter]] = weakref.WeakSet()
    registered = False  # the scrape callback, once per process
    shown = False  # the untenanted series was given once: it stays, at 0 when none lags


def _witness_lag() -> None:
    """Before a scrape: ``proctor_witness_checkpoint_age_seconds``, how long each
    tenant's log has gone without a checkpoint its witnesses' quorum cosigned (0 while
    its head has one), as of the last pass; with tenant labels off, one series, the
    tenant furthest behind. Computed from when it fell behind, so it grows between
    passes as it does in fact."""
    now = time.time()
    lag: dict[str, float] = {}
    for submitter in builtins.list(_Lag.live):
        for tenant, since in dict(submitter.behind).items():
            age = 0.0 if since is None else max(0.0, now - since)
            lag[tenant] = max(lag.get(tenant, 0.0), age)
    gauge = telemetry.metrics().witness_age
    if telemetry.tenant_labels():
        for tenant, age in lag.items():
            gauge.labels(tenant).set(age)
    elif lag or _Lag.shown:
        gauge.labels("").set(max(lag.values(), default=0.0))
        _Lag.shown = True


class Submitter:
    """A thread that submits every tenant's new checkpoints to its witnesses, at most
    every ``interval`` seconds. Failures are logged and retried at the next pass.
    After each pass it notes how far behind each tenant's witnessing is (the
    metrics' witness lag, read at each scrape)."""

    def __init__(self, witnesses: TenantWitnesses, interval: float = DEFAULT_INTERVAL) -> None:
        self._witnesses = witnesses
        self._interval = interval
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._http: httpx.Client | None = None
        self.passes = 0
        #: Per witnessed tenant, since when its log lacks a cosigned head (None: it has one).
        self.behind: dict[str, float | None] = {}

    def run_once(self) -> builtins.list[Submission]:
        done: builtins.list[Submission] = []
        if self._http is None:
            # One client for the submitter's life: kept-alive connections to the
            # witnesses, and one TLS context instead of one a pass.
            self._http = httpx.Client(timeout=_TIMEOUT)
        try:
            tenants = self._witnesses.tenants()
        except ProctorError as exc:  # the store is down: the next pass tries again
            log.warning("witness submission skipped: %s", exc.message)
            tenants = []
        for tenant in tenants:
            try:
                done += self._witnesses.submit(tenant, self._http)
            except ProctorError as exc:
                log.warning("witness submission for %s failed: %s", tenant, exc.message)
            with contextlib.suppress(ProctorError):  # the store is busy: last pass's
                self.behind[tenant] = self._witnesses.uncosigned_since(tenant)
        for gone in set(self.behind) - set(tenants):
            del self.behind[gone]  # its witnesses were removed
        for s in done:
            if not s.ok:
                log.warning("witness %s refused or missed size %d: %s", s.witness, s.size, s.detail)
        self.passes += 1
        return done

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.run_once()
            except Exception:  # a bug here must not end the loop: calls do not depend on it
                log.exception("witness submitter pass failed")
            self._stop.wait(self._interval)

    def start(self) -> None:
        with _Lag.lock:
            if not _Lag.registered:
                _Lag.registered = True
                telemetry.collect_with(_witness_lag)
            _Lag.live.add(self)
        self._thread = threading.Thread(target=self._loop, name="witness-submitter", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        _Lag.live.discard(self)
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=_TIMEOUT * 2)
        if self._http is not None and (self._thread is None or not self._thread.is_alive()):
            self._http.close()
            self._http = None


def witnessed_receipt(witnesses: TenantWitnesses, ledger: Ledger, tenant: str, receipt: str) -> str:
    """``receipt`` (a tlog-proof of one event of ``tenant``) made again against the
    newest checkpoint its witnesses cosigned, if that one holds the event, so that it
    carries their cosignatures; else ``receipt`` as it is."""
    index_line = next((ln for ln in receipt.split("\n") if ln.startswith("index ")), "")
    if not index_line[6:].isdigit():
        return receipt
    seq = int(index_line[6:])
    try:
        cosigned = witnesses.newest_cosigned(tenant)
    except ProctorError:
        return receipt  # no witnesses' tables (an older store): the receipt as written
    if cosigned is None or cosigned[0] <= seq:
        return receipt
    return make_receipt(ledger, tenant, seq, cosigned)
