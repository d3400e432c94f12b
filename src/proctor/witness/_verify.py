"""A verifier asks the witnesses it names what they last cosigned.

Cosignatures held in the store being verified say only what the witnesses cosigned
of the history that store holds: an operator who restores a backup taken before the
witnesses' last cosignature, and appends another history, keeps the older stored
cosignatures, and the rewritten tail simply looks "not cosigned yet". Only the
witness knows it cosigned more. So a verifier that names a witness asks it, with the
read-only ``GET /<hex SHA-256 of the origin>/checkpoint`` of ``witness serve``, for
the newest checkpoint it cosigned of the log; checks the log's signature on it and
the witness's cosignature with the key the verifier gave (never a key from the
store); and then holds the log to it: the log must be at least that large and
extend it (a consistency proof), and no event newer than what a quorum of the
witnesses cosigned may be older than the tenant's max age.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import httpx

from proctor.errors import VerificationFailed
from proctor.ledger import (
    SYSTEM_LOG,
    Checkpoint,
    CosignatureVerifier,
    Ledger,
    Verifier,
    VerifyReport,
    open_checkpoint,
    split_note,
    verify_consistency,
)
from proctor.store import Store
from proctor.witness._policy import witnessed
from proctor.witness._tenant import DEFAULT_MAX_AGE, TenantWitnesses

#: How long a verifier waits for one witness's answer (seconds).
ASK_TIMEOUT = 10.0
#: How far a witness's answer's cosignature time may be from the verifier's clock.
ANSWER_SKEW = 300
#: A witness's answer is one checkpoint note: anything larger is not one.
MAX_ANSWER = 64 * 1024


def checkpoint_path(origin: str) -> str:
    """The witness's read path for the newest checkpoint it cosigned of ``origin``."""
    return f"/{hashlib.sha256(origin.encode()).hexdigest()}/checkpoint"


@dataclass(frozen=True)
class WitnessAnswer:
    """What one witness the verifier named said it last cosigned (or why it said nothing)."""

    name: str
    vkey: str
    url: str | None
    #: Where the URL came from: "--witness-url", "the tenant's witnesses" or None.
    url_from: str | None
    checkpoint: Checkpoint | None = None
    note: str | None = None
    #: The time of the witness's cosignature on its answer (made when it answered).
    cosigned_at: int | None = None
    error: str | None = None

    def as_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "vkey": self.vkey,
            "url": self.url,
            "url_from": self.url_from,
            "size": None if self.checkpoint is None else self.checkpoint.size,
            "cosigned_at": self.cosigned_at,
            "error": self.error,
        }


def require_extends(
    old: tuple[int, bytes],
    new: tuple[int, bytes],
    proof: Sequence[bytes],
    *,
    old_name: str,
    new_name: str,
) -> None:
    """Refuse unless the tree ``new`` (size, root) extends the tree ``old``, by
    ``proof`` (RFC 9162 consistency, from ``old`` to ``new``)."""
    (old_size, old_root), (new_size, new_root) = old, new
    hint = (
        "a witness cosigns only a history that extends what it cosigned before: this one "
        "was restored from a backup or rebuilt after the witness saw it; keep the store as "
        "it is and compare it with the witness's state ('proctor witness show')"
    )
    if old_size > new_size:
        raise VerificationFailed(
            f"{old_name} has size {old_size} but {new_name} holds only {new_size} events: "
            "a history that was rolled back after it was cosigned",
            hint=hint,
        )
    if old_size == 0:
        return  # the empty tree is a prefix of every tree
    try:
        verify_consistency(old_size, new_size, old_root, new_root, proof)
    except VerificationFailed as exc:
        raise VerificationFailed(
            f"{new_name} (size {new_size}) does not extend {old_name} (size {old_size}): "
            "the history was forked or rewritten after it was cosigned",
            hint=hint,
        ) from exc


def fetch_cosigned(http: httpx.Client, url: str, origin: str) -> str:
    """The witness at ``url``'s answer for ``origin``: the newest checkpoint note it
    cosigned, not yet checked. Raises with a reason people can act on."""
    where = url.rstrip("/") + checkpoint_path(origin)
    # Whoever answers at the URL may not be the witness: read at most MAX_ANSWER
    # bytes, within one overall deadline, whatever it sends.
    deadline = time.monotonic() + ASK_TIMEOUT
    body = b""
    try:
        with http.stream("GET", where) as resp:
            status = resp.status_code
            for chunk in resp.iter_bytes():
                body += chunk
                if len(body) > MAX_ANSWER or time.monotonic() > deadline:
                    status = -1
                    break
    except httpx.HTTPError as exc:
        why = str(exc) or type(exc).__name__
        raise VerificationFailed(f"cannot be reached at {url}: {why}") from exc
    if status == 404:
        raise VerificationFailed(f"at {url} has cosigned no checkpoint of {origin}")
    if status != 200:
        what = f"answered {status}" if status > 0 else "answered too much or too slowly"
        raise VerificationFailed(f"at {url} {what} to {checkpoint_path(origin)}, not a checkpoint")
    try:
        return body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise VerificationFailed(f"at {url} answered something that is not a note") from exc


def ask_witnesses(
    origin: str,
    log_key: Verifier,
    witness_keys: Sequence[str],
    urls: Mapping[str, tuple[str, str]],
    pinned: Sequence[str] = (),
    timeout: float = ASK_TIMEOUT,
) -> list[WitnessAnswer]:
    """Ask each named witness for the newest checkpoint of ``origin`` it cosigned.

    ``urls`` maps a witness's verifier key to (its URL, where the URL came from).
    ``pinned`` are URLs the verifier gave itself: when there are any, only they are
    asked, and each answer counts for the named witness whose key cosigned it.
    """
    keys = {v.vkey(): v for v in (CosignatureVerifier.parse(k) for k in witness_keys)}
    answers: dict[str, WitnessAnswer] = {}
    asked: list[tuple[str, str, list[CosignatureVerifier]]] = []
    if pinned:
        asked = [(url, "--witness-url", list(keys.values())) for url in pinned]
    else:
        for vkey, witness in keys.items():
            if vkey in urls:
                asked.append((*urls[vkey], [witness]))
            else:
                answers[vkey] = WitnessAnswer(
                    witness.name, vkey, None, None,
                    error="has no URL known: the tenant does not use it ('proctor witness "
                    "use'); give --witness-url",
                )  # fmt: skip
    with httpx.Client(timeout=timeout, follow_redirects=False) as http:
        for url, source, candidates in asked:
            got = _ask_one(http, url, source, origin, log_key, candidates)
            answers.setdefault(got.vkey or url, got)
    for vkey, witness in keys.items():
        if vkey not in answers:
            answers[vkey] = WitnessAnswer(
                witness.name, vkey, None, None, error="did not answer at any --witness-url"
            )
    return list(answers.values())


def _ask_one(
    http: httpx.Client,
    url: str,
    source: str,
    origin: str,
    log_key: Verifier,
    candidates: Sequence[CosignatureVerifier],
) -> WitnessAnswer:
    """Ask ``url``; the answer belongs to the candidate witness whose key cosigned it."""
    only = candidates[0] if len(candidates) == 1 else None
    name = only.name if only else f"at {url}"
    vkey = only.vkey() if only else ""
    try:
        note = fetch_cosigned(http, url, origin)
    except VerificationFailed as exc:
        return WitnessAnswer(name, vkey, url, source, error=exc.message)
    try:
        cp = open_checkpoint(note, log_key, origin)
    except VerificationFailed as exc:
        why = f"at {url} answered a checkpoint the log's key did not sign: {exc.message}"
        return WitnessAnswer(name, vkey, url, source, error=why)
    text, lines = split_note(note)
    for witness in candidates:
        for line in lines:
            try:
                stamp = witness.check_line(text, line)
            except VerificationFailed as exc:
                why = f"at {url} answered a cosignature that does not verify: {exc.message}"
                return WitnessAnswer(witness.name, witness.vkey(), url, source, error=why)
            if stamp is not None:
                late = _stale(stamp, time.time())
                if late is not None:
                    why = f"at {url} answered a cosignature {late}"
                    return WitnessAnswer(witness.name, witness.vkey(), url, source, error=why)
                return WitnessAnswer(witness.name, witness.vkey(), url, source, cp, note, stamp)
    return WitnessAnswer(
        name, vkey, url, source,
        error=f"at {url} answered a checkpoint of size {cp.size} without a cosignature by "
        + (f"its key {vkey}" if only else "any --witness key"),
    )  # fmt: skip


def _stale(stamp: int, now: float) -> str | None:
    """Why a cosignature made at ``stamp`` is no answer given now (None: it is).

    The witness cosigns its answer when it gives it: one made long ago is an old
    answer replayed (by whoever controls the URL, or the path to it), which would
    hide what the witness cosigned since."""
    if stamp < now - ANSWER_SKEW:
        return f"made {now - stamp:.0f} s ago, not when asked: an old answer replayed"
    if stamp > now + ANSWER_SKEW:
        return f"made {stamp - now:.0f} s in the future: the witness's clock or this one is wrong"
    return None


def hold_to_answers(
    answers: Sequence[WitnessAnswer],
    quorum: int,
    head: tuple[int, bytes],
    proof: Callable[[int, int], Sequence[bytes]],
) -> int:
    """Refuse unless the log whose verified head is ``head`` (size, root) extends the
    newest checkpoint every answering witness cosigned, and at least ``quorum`` named
    witnesses answered. Returns the size that ``quorum`` of them cosigned (the largest
    size at least ``quorum`` answers reach): what the log's max age is measured from.

    A witness that answers a checkpoint the log does not extend refuses the log
    whatever the quorum: it is proof that the history it saw was replaced."""
    size = head[0]
    for a in answers:
        if a.checkpoint is None:
            continue
        old = (a.checkpoint.size, a.checkpoint.root)
        steps = proof(a.checkpoint.size, size) if 0 < a.checkpoint.size < size else ()
        require_extends(old, head, steps,
                        old_name=f"the checkpoint witness {a.name} last cosigned",
                        new_name="the log")  # fmt: skip
    sizes = sorted((a.checkpoint.size for a in answers if a.checkpoint is not None), reverse=True)
    if len(sizes) < quorum:
        missing = [a for a in answers if a.checkpoint is None]
        detail = "; ".join(f"witness {a.name} {a.error}" for a in missing)
        raise VerificationFailed(
            f"{len(sizes)} of the witnesses you named told what they last cosigned; the "
            f"policy needs {quorum}: {detail}",
            hint="bring the witnesses back (or name their URLs with --witness-url); "
            "--witness-offline checks only the cosignatures the store holds, which cannot "
            "catch a store rolled back to before the witnesses' last cosignature",
        )
    return sizes[quorum - 1]


def parse_event_time(stamp: str) -> datetime:
    """The ledger's event time (``%Y-%m-%dT%H:%M:%S.%fZ``) as an aware datetime."""
    for form in ("%Y-%m-%dT%H:%M:%S.%fZ", "%Y-%m-%dT%H:%M:%SZ"):
        try:
            return datetime.strptime(stamp, form).replace(tzinfo=UTC)
        except ValueError:
            continue
    raise VerificationFailed(f"an event time {stamp!r} is not the ledger's format")


def require_fresh(
    witnessed_size: int,
    size: int,
    first_uncovered: str | None,
    max_age: int,
    now: datetime,
) -> float:
    """Refuse when the oldest event newer than the witnessed checkpoint (the event of
    seq ``witnessed_size``, at ``first_uncovered``) has gone uncosigned for more than
    ``max_age`` seconds at ``now``. Returns how long it has (0 when none is newer)."""
    if witnessed_size >= size or first_uncovered is None:
        return 0.0
    age = (now - parse_event_time(first_uncovered)).total_seconds()
    if age > max_age:
        raise VerificationFailed(
            f"{size - witnessed_size} event(s) newer than the witnessed checkpoint of size "
            f"{witnessed_size} have gone uncosigned for {age:.0f} s, more than the tenant's "
            f"witness max age of {max_age} s (the oldest is event {witnessed_size})",
            hint="a log kept away from its witnesses can be rewritten unseen: find out why "
            "the submitter stopped ('proctor witness list', 'proctor witness submit')",
        )
    return max(0.0, age)


@dataclass(frozen=True)
class WitnessReport:
    """What ``audit verify --witness`` checked against the witnesses, and what not."""

    #: True: the witnesses were asked; False: only cosignatures held with the log.
    asked: bool
    quorum: int
    #: The size a quorum of the witnesses cosigned (that the log extends).
    witnessed_size: int
    answers: tuple[WitnessAnswer, ...]
    #: The tenant's max age applied, and how long the oldest newer event went without.
    max_age: int
    uncosigned_for: float

    def as_json(self) -> dict[str, Any]:
        return {
            "asked": self.asked,
            "quorum": self.quorum,
            "witnessed_size": self.witnessed_size,
            "witnesses": [a.as_json() for a in self.answers],
            "max_age_seconds": self.max_age,
            "uncosigned_for_seconds": round(self.uncosigned_for, 1),
        }


def verify_witnessed_log(
    store: Store,
    ledger: Ledger,
    log: str,
    witness_keys: Sequence[str],
    quorum: int,
    *,
    trusted: Sequence[str] = (),
    pinned: Sequence[str] = (),
    offline: bool = False,
    now: datetime | None = None,
) -> tuple[VerifyReport, WitnessReport]:
    """Verify ``log`` in the store (``Ledger.verify``) and hold it to its witnesses.

    Unless ``offline``, each named witness is asked first (at a URL of ``pinned``, or
    the one the tenant registered for that key) for the newest checkpoint it cosigned:
    the log must extend every answer, and ``quorum`` of them must answer. ``offline``
    instead takes the largest checkpoint whose cosignatures the store holds (and any
    ``trusted`` note), which cannot reveal a store rolled back to before the
    witnesses' last cosignature. Either way, no event newer than what the quorum
    cosigned may have waited longer than the tenant's max age."""
    tenant_witnesses = TenantWitnesses(store, ledger)
    trusted = list(trusted)
    answers: list[WitnessAnswer] = []
    stored_size = 0
    if offline:
        stored_size, note = witnessed(
            [*tenant_witnesses.cosigned_notes(log), *trusted], witness_keys, quorum
        )
        trusted.append(note)
    else:
        registered = {}
        if log != SYSTEM_LOG:
            for w in tenant_witnesses.list(log):
                registered[w.vkey] = (w.url, "the tenant's witnesses")
        # Asked before the log is read: an honest log read afterwards is at least as
        # large as anything the witnesses cosigned of it.
        # The runtime's key verifies every checkpoint of every log (older ones carry
        # only its signature, not one under the log's origin).
        answers = ask_witnesses(ledger.origin(log), Verifier.parse(ledger.vkey()),
                                witness_keys, registered, pinned)  # fmt: skip
    report = ledger.verify(log, trusted)
    if offline:
        size = stored_size
    else:
        size = hold_to_answers(
            answers,
            quorum,
            (report.size, report.root),
            lambda old, new: ledger.consistency_proof(log, old, new).hashes,
        )
    max_age = DEFAULT_MAX_AGE
    if log != SYSTEM_LOG:
        max_age = tenant_witnesses.policy(log).max_age_seconds
    first = None
    if size < report.size:
        data = next(iter(list(ledger.entries(log, size, size + 1))), None)
        first = str(json.loads(data).get("time", "")) if data is not None else None
    waited = require_fresh(size, report.size, first, max_age, now or datetime.now(UTC))
    return report, WitnessReport(not offline, quorum, size, tuple(answers), max_age, waited)
