"""Offline verification of an evidence pack, with the verifier key alone.

Cryptography first (signatures, consistency, every event's inclusion), then the
edges of the period (nothing left out before or after), then what the issue
asks an auditor to check on the proven events: every approval of a production
run was granted before the run started, by someone other than the author, for
that digest and capabilities, unexpired and unrevoked; every allowed data access
and egress lies inside the approved capabilities. The store's records in the
pack are then held to the events, and the derived files (OCSF, report) are
regenerated and compared. The first failure raises, named.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import zipfile
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from proctor.errors import ProctorError, VerificationFailed
from proctor.evidence._ocsf import ocsf_line
from proctor.evidence._pack import PACK_FORMAT, iter_lines, lineage_name
from proctor.evidence._policies import DATA_ACTIONS, PolicyCheck, PolicyScan
from proctor.evidence._retention import check_retention_record
from proctor.evidence._summary import Summary, host_port
from proctor.evidence._tree import RangeTree, decode_hashes
from proctor.governance import (
    ENVIRONMENTS,
    capabilities_hash,
    covers,
    decision_problems,
    egress_entry,
    is_production,
    submission_problems,
)
from proctor.ledger import (
    Action,
    Checkpoint,
    ErasureCheck,
    Verifier,
    check_lineage_object,
    erasure_record,
    is_pruned_marker,
    leaf_hash,
    open_checkpoint,
    parse_canonical,
    pruned_leaf_hash,
    verify_consistency,
    verify_inclusion,
)
from proctor.policy import policy_version

_CLOCK_SLACK = 60.0  # seconds between a store row's timestamp and its event's


@dataclass(frozen=True)
class PackReport:
    tenant: str
    origin: str
    events: int
    context: int
    first_seq: int
    end_seq: int
    end_size: int
    production_runs: int
    approvals_checked: int
    accesses_checked: int
    vkey: str
    policy_versions: int = 0  # cited policy versions whose texts hash to them
    decisions_redecided: int = 0  # recorded decisions decided again with those texts
    erasures: int = 0  # proven erasure.request events the lineage objects were held to
    erasures_uncommitted: int = 0  # of which recorded before erasures listed their entries


def _fail(message: str) -> VerificationFailed:
    return VerificationFailed(message)


def _ts(value: str) -> float:
    return datetime.strptime(value, "%Y-%m-%dT%H:%M:%S.%fZ").timestamp()


def _read(zf: zipfile.ZipFile, name: str) -> bytes:
    try:
        return zf.read(name)
    except KeyError:
        raise _fail(f"{name}: missing from the pack") from None


def _load(zf: zipfile.ZipFile, name: str) -> Any:
    try:
        return json.loads(_read(zf, name))
    except ValueError as exc:
        raise _fail(f"{name}: not valid JSON ({exc})") from exc


def _check_manifest(zf: zipfile.ZipFile) -> None:
    manifest = _load(zf, "manifest.json")
    if not isinstance(manifest, dict) or manifest.get("format") != PACK_FORMAT:
        raise _fail("manifest.json: not a Proctor evidence pack manifest")
    files = manifest.get("files")
    if not isinstance(files, dict):
        raise _fail("manifest.json: no file list")
    names = {i.filename for i in zf.infolist() if not i.is_dir()} - {"manifest.json"}
    for extra in sorted(names - set(files)):
        raise _fail(f"{extra}: in the pack but not in its manifest (a file was added)")
    for name in sorted(files):
        h = hashlib.sha256()
        try:
            with zf.open(name) as f:
                while chunk := f.read(1 << 20):
                    h.update(chunk)
        except KeyError:
            raise _fail(
                f"{name}: listed in the manifest but missing (a file was removed)"
            ) from None
        if h.hexdigest() != files[name]:
            raise _fail(f"{name}: its SHA-256 does not match the manifest (the file was altered)")


def _parse_event(data: bytes, where: str) -> dict[str, Any]:
    try:
        ev, canonical = parse_canonical(data)
    except (ValueError, UnicodeDecodeError, ProctorError) as exc:
        raise _fail(f"{where}: not valid JSON ({exc})") from exc
    if not isinstance(ev, dict) or not canonical:
        raise _fail(f"{where}: not a canonical JSON event")
    return ev


def _caps_allow(caps: dict[str, Any], ev: dict[str, Any]) -> str | None:
    """Why an allowed event falls outside ``caps``, or None when it is inside."""
    action = ev["action"]
    d = ev.get("details") or {}
    if action in (Action.SQL_SELECT, Action.SQL_WRITE):
        dataset = str(d.get("dataset", ""))
        spec = (caps.get("datasets") or {}).get(dataset)
        if spec is None:
            return f"dataset {dataset!r} is not in the approved capabilities"
        for t in d.get("tables") or []:
            grant = (spec.get("tables") or {}).get(t.get("table"))
            if grant is None:
                return f"table {dataset}.{t.get('table')} is not approved"
            extra = sorted(set(t.get("columns") or []) - set(grant.get("columns") or []))
            if extra:
                return f"columns {', '.join(extra)} of {dataset}.{t.get('table')} are not approved"
            access = grant.get("access", "read")
            need = "write" if t.get("action", action) == Action.SQL_WRITE else "read"
            if need not in str(access).split("-"):
                return f"{need} access to {dataset}.{t.get('table')} is not approved ({access})"
        return None
    if action == Action.HTTP_REQUEST:
        host, port = host_port(ev)
        # Event format 2: the secrets injected into the request are in its event.
        for item in d.get("inject") or []:
            name = str(item.get("secret") if isinstance(item, dict) else item)
            if name not in (caps.get("secrets") or []):
                return f"secret {name!r} is not approved"
        for entry in caps.get("egress") or []:
            try:
                if covers(egress_entry(str(entry), "egress"), host, port):
                    return None
            except ProctorError:
                continue
        return f"egress to {host}:{port} is not in the approved capabilities"
    if action in (Action.FILE_READ, Action.FILE_WRITE):
        bucket = str(d.get("bucket", ""))
        access = (caps.get("buckets") or {}).get(bucket)
        need = action.split(".")[1]
        if access is None or need not in str(access).split("-"):
            return f"{need} on bucket {bucket!r} is not approved"
        return None
    if action == Action.SECRET_USE:
        name = str(ev["resource"]).removeprefix("secret/")
        if name not in (caps.get("secrets") or []):
            return f"secret {name!r} is not approved"
    return None


def _check_ocsf(path: str, origin: str, first: int) -> str | None:
    """In a worker process: each OCSF line must be the one its event gives."""
    with zipfile.ZipFile(path) as zf:
        ocsf = iter_lines(zf, "ocsf/events.ocsf.jsonl")
        seq = first - 1
        for data in iter_lines(zf, "events/events.jsonl"):
            seq += 1
            try:
                ev = json.loads(data)
            except ValueError:
                return None  # the main check names a malformed event
            if next(ocsf, None) != ocsf_line(ev, origin):
                return f"ocsf/events.ocsf.jsonl: line for event seq {seq} does not match it"
        if next(ocsf, None) is not None:
            return "ocsf/events.ocsf.jsonl: more lines than events"
    return None


def verify_pack(path: Path, vkey: str | None = None) -> PackReport:
    """Verify the pack at ``path``; :class:`VerificationFailed` names the first failure.

    Without ``vkey`` the pack's own ``verifier.key`` is used, which proves only
    that the pack is consistent with itself: an auditor passes the key they hold.
    """
    try:
        zf = zipfile.ZipFile(path)
    except (OSError, zipfile.BadZipFile) as exc:
        raise _fail(f"{path}: not a readable zip ({exc})") from exc
    with zf:
        return _verify(zf, vkey)


def _verify(zf: zipfile.ZipFile, vkey: str | None) -> PackReport:
    # The order of the checks is the order failures are named in: cryptography
    # first, so that an altered event is named as such and not as what it breaks.
    _check_manifest(zf)
    head = _read_head(zf, vkey)
    end_cp = _check_checkpoints(zf, head)
    period = _check_period(zf, head, end_cp)
    objects = _check_lineage(zf)
    erasures = _check_erasures(zf, head, end_cp, period, objects)
    context_docs = _check_context(zf, head, end_cp, period.events)
    if "governance/retention.json" in zf.namelist():
        check_retention_record(_load(zf, "governance/retention.json"), period.events)
    proven = _Proven.index(period.events)
    production, approvals_checked = _check_approvals(proven)
    accesses = _check_accesses(proven, period.data_events)
    policies = _check_policy_texts(zf, proven, period.policies)
    _check_records(zf, proven.grants, proven.submits, proven.runs, proven.ordered)
    _check_report(zf, head, period, context_docs)
    return PackReport(
        head.tenant,
        head.origin,
        head.stop - head.first,
        len(context_docs),
        head.first,
        head.stop,
        end_cp.size,
        production,
        approvals_checked,
        accesses,
        head.verifier.vkey(),
        policy_versions=policies.versions,
        decisions_redecided=policies.redecided,
        erasures=erasures.records,
        erasures_uncommitted=erasures.uncommitted,
    )


@dataclass(frozen=True)
class _Head:
    """What pack.json says the pack is, and the key its checkpoints are held to."""

    meta: dict[str, Any]
    tenant: str
    origin: str
    first: int
    stop: int
    verifier: Verifier


def _read_head(zf: zipfile.ZipFile, vkey: str | None) -> _Head:
    meta = _load(zf, "pack.json")
    if meta.get("format") != PACK_FORMAT:
        raise _fail("pack.json: unknown pack format")
    tenant, origin = str(meta["tenant"]), str(meta["origin"])
    if not origin.endswith(f"/tenant/{tenant}"):
        raise _fail(f"pack.json: origin {origin!r} is not tenant {tenant!r}'s log")
    key_text = vkey or _read(zf, "verifier.key").decode()
    try:
        verifier = Verifier.parse(key_text)
    except ProctorError as exc:
        raise _fail(f"verifier key: {exc.message}") from exc
    return _Head(meta, tenant, origin, int(meta["first_seq"]), int(meta["end_seq"]), verifier)


# -- signatures and the tree --------------------------------------------------------


def _check_checkpoints(zf: zipfile.ZipFile, head: _Head) -> Checkpoint:
    """The signed end checkpoint, and the start one consistent with it."""
    meta, verifier, origin = head.meta, head.verifier, head.origin
    end_cp = open_checkpoint(_read(zf, "checkpoints/end.note").decode(), verifier, origin)
    if end_cp.size != int(meta["end_size"]):
        raise _fail("checkpoints/end.note: its size differs from pack.json's end_size")
    start_size = int(meta["start_size"])
    if start_size:
        start_cp = open_checkpoint(_read(zf, "checkpoints/start.note").decode(), verifier, origin)
        cons = _load(zf, "proofs/consistency.json")
        if (
            start_cp.size != start_size
            or cons.get("old") != start_size
            or cons.get("new") != end_cp.size
        ):
            raise _fail("proofs/consistency.json: sizes do not match the checkpoints")
        try:
            verify_consistency(
                start_size,
                end_cp.size,
                start_cp.root,
                end_cp.root,
                decode_hashes(cons.get("hashes"), "proofs/consistency.json"),
            )
        except VerificationFailed as exc:
            raise _fail(f"proofs/consistency.json: {exc.message}") from exc
    return end_cp


@dataclass
class _Period:
    summary: Summary = field(default_factory=Summary)
    events: dict[int, dict[str, Any]] = field(default_factory=dict)  # governance and run, by seq
    data_events: list[dict[str, Any]] = field(default_factory=list)  # allowed accesses
    policies: PolicyScan = field(default_factory=lambda: PolicyScan(0))  # versions, sample


def _check_period(zf: zipfile.ZipFile, head: _Head, end_cp: Checkpoint) -> _Period:
    """The period's events: in order, the tenant's, dated inside it, and leading with
    the range proof to the signed end checkpoint; their OCSF lines match them."""
    first, stop, meta = head.first, head.stop, head.meta
    period = _Period(policies=PolicyScan(stop - first))
    leaves: list[bytes] = []
    # Regenerating every OCSF line costs as much as everything else in this loop, and
    # needs nothing from it: a second process does it meanwhile, on the other core.
    # (A plain subprocess, not multiprocessing: no re-import of the caller's script.)
    ocsf_check = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "proctor.evidence._verify",
            zf.filename or "",
            head.origin,
            str(first),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    seq = first - 1
    for data in iter_lines(zf, "events/events.jsonl"):
        seq += 1
        ev = _parse_event(data, f"event seq {seq}")
        if ev.get("seq") != seq:
            raise _fail(
                f"event seq {seq}: found seq {ev.get('seq')!r} in its place; events were "
                "removed, inserted or reordered"
            )
        if ev.get("tenant") != head.tenant:
            raise _fail(f"event seq {seq}: belongs to tenant {ev.get('tenant')!r}")
        if not str(meta["from"]) <= ev["time"] < str(meta["to"]):
            raise _fail(f"event seq {seq}: its time {ev['time']} is outside the period")
        if is_pruned_marker(ev):
            # Pruned past retention: the marker keeps the leaf hash the range proof needs.
            leaves.append(_marker_leaf(ev))
            continue
        leaves.append(leaf_hash(data))
        period.summary.add(ev)
        period.policies.add(seq - first, ev, data)
        action = ev["action"]
        if action in DATA_ACTIONS:
            if ev["decision"] == "allow":
                period.data_events.append(ev)
        elif not action.startswith("http."):
            period.events[seq] = ev
    if seq + 1 != stop:
        raise _fail(f"event seq {seq + 1}: missing; pack.json says the period ends before {stop}")
    rp = _load(zf, "proofs/range.json")
    if (rp.get("start"), rp.get("end"), rp.get("size")) != (first, stop, end_cp.size):
        raise _fail("proofs/range.json: its range does not match the pack's events")
    tree = RangeTree(
        first,
        leaves,
        end_cp.size,
        decode_hashes(rp.get("left"), "proofs/range.json"),
        decode_hashes(rp.get("right"), "proofs/range.json"),
    )
    if tree.root() != end_cp.root:
        raise _fail(
            f"event seq {first} to {stop - 1}: these events and proofs/range.json do not "
            "lead to the signed end checkpoint; an event or a proof was altered"
        )
    del leaves
    # Named only after the tree is checked: an altered event must be named as such,
    # not as the OCSF line that no longer matches it.
    out, _ = ocsf_check.communicate()
    if ocsf_check.returncode != 0:
        raise _fail("ocsf/events.ocsf.jsonl: could not be checked")
    if out.strip():
        raise _fail(out.decode().strip())
    return period


# -- context events -----------------------------------------------------------------


def _check_context(
    zf: zipfile.ZipFile, head: _Head, end_cp: Checkpoint, events: dict[int, dict[str, Any]]
) -> list[dict[str, Any]]:
    """The events just outside the period, each proven included, which show it has
    no gap at either edge; added to ``events``, and returned in the pack's order."""
    first, stop, meta = head.first, head.stop, head.meta
    context_docs: list[dict[str, Any]] = []
    proofs = iter_lines(zf, "proofs/context.jsonl")
    for data in iter_lines(zf, "events/context.jsonl"):
        ev = _parse_event(data, "context event")
        cseq = ev.get("seq")
        if type(cseq) is not int or ev.get("tenant") != head.tenant:
            raise _fail(f"context event {cseq!r}: bad seq or tenant")
        raw = next(proofs, None)
        if raw is None:
            raise _fail(f"context event seq {cseq}: no inclusion proof")
        try:
            p = json.loads(raw)
            hashes = decode_hashes(p.get("hashes"), f"proof of context event {cseq}")
            if p.get("index") != cseq or p.get("size") != end_cp.size:
                raise _fail(f"context event seq {cseq}: its proof is for another index or size")
            leaf = _marker_leaf(ev) if is_pruned_marker(ev) else leaf_hash(data)
            verify_inclusion(cseq, end_cp.size, leaf, hashes, end_cp.root)
        except ValueError as exc:
            raise _fail(f"context event seq {cseq}: unreadable proof") from exc
        except VerificationFailed as exc:
            raise _fail(
                f"context event seq {cseq}: {exc.message}; the event or its proof was altered"
            ) from exc
        context_docs.append(ev)
        if first <= cseq < stop:
            raise _fail(f"context event seq {cseq}: inside the period")
        if cseq == first - 1 and not ev["time"] < str(meta["from"]):
            raise _fail(f"event seq {cseq}: dated in the period but left out of it")
        if cseq == stop and not ev["time"] >= str(meta["to"]):
            raise _fail(f"event seq {cseq}: dated in the period but left out of it")
        events[cseq] = ev
    if next(proofs, None) is not None:
        raise _fail("proofs/context.jsonl: more proofs than context events")
    seqs = {int(e["seq"]) for e in context_docs}
    if first > 0 and first - 1 not in seqs:
        raise _fail(
            f"event seq {first - 1}: the event just before the period is missing, so its "
            "start cannot be shown complete"
        )
    if stop < end_cp.size and stop not in seqs:
        raise _fail(
            f"event seq {stop}: the event just after the period is missing, so its end "
            "cannot be shown complete"
        )
    return context_docs


# -- what the proven events say -------------------------------------------------------


@dataclass(frozen=True)
class _Proven:
    """The proven governance and run events, indexed the way the checks look them up."""

    ordered: list[dict[str, Any]]
    submits: dict[str, dict[str, Any]]  # allowed artifact.submit, by digest
    grants: dict[str, dict[str, Any]]  # allowed approval.grant, by approval id
    revokes: dict[str, int]  # approval id -> seq of its first allowed revocation
    runs: dict[str, dict[str, Any]]  # allowed run.start, by run id

    @classmethod
    def index(cls, events: dict[int, dict[str, Any]]) -> _Proven:
        ordered = [events[s] for s in sorted(events)]
        submits = {
            str(e["artifact"]): e
            for e in ordered
            if e["action"] == Action.ARTIFACT_SUBMIT and e["decision"] == "allow"
        }
        grants = {
            str((e.get("details") or {}).get("approval")): e
            for e in ordered
            if e["action"] == Action.APPROVAL_GRANT and e["decision"] == "allow"
        }
        revokes: dict[str, int] = {}
        for e in ordered:
            if e["action"] == Action.APPROVAL_REVOKE and e["decision"] == "allow":
                for a in e.get("approvals") or []:
                    revokes.setdefault(str(a), int(e["seq"]))
        runs = {
            str(e["run"]): e
            for e in ordered
            if e["action"] == Action.RUN_START and e["decision"] == "allow" and e.get("run")
        }
        return cls(ordered, submits, grants, revokes, runs)


def _check_approvals(proven: _Proven) -> tuple[int, int]:
    """Every production run's approvals; returns (production runs, approvals checked)."""
    approvals_checked = 0
    production = 0
    for run_id, start in proven.runs.items():
        d = start.get("details") or {}
        if not is_production(str(d.get("environment"))):
            continue
        production += 1
        approvals_checked += _check_run_approvals(proven, run_id, start)
    return production, approvals_checked


def _check_run_approvals(proven: _Proven, run_id: str, start: dict[str, Any]) -> int:
    """Each approval the run cites: granted before it started, by someone other than
    the author, for its digest and capabilities, unexpired and unrevoked then."""
    digest = str(start.get("artifact"))
    submit = proven.submits.get(digest)
    if submit is None:
        raise _fail(
            f"run {run_id}: the submission of its artifact {digest[:19]}… is not in the pack"
        )
    author = submit["actor"]["id"]
    cited = list(start.get("approvals") or [])
    if not cited:
        raise _fail(f"run {run_id}: a production run with no approval")
    checked = 0
    for approval in cited:
        grant = proven.grants.get(approval)
        if grant is None:
            raise _fail(
                f"approval {approval} of run {run_id}: its approval.grant event is not in the pack"
            )
        checked += 1
        gd = grant.get("details") or {}
        if int(grant["seq"]) > int(start["seq"]) or grant["time"] > start["time"]:
            raise _fail(
                f"approval {approval} of run {run_id}: granted at {grant['time']} "
                f"(seq {grant['seq']}), after the run started at {start['time']} "
                f"(seq {start['seq']})"
            )
        if grant["actor"]["id"] == author:
            raise _fail(
                f"approval {approval} of run {run_id}: granted by {author}, the "
                "artifact's author (separation of duties)"
            )
        if grant.get("artifact") != digest:
            raise _fail(f"approval {approval} of run {run_id}: approves another artifact")
        if gd.get("capabilities_hash") != (submit.get("details") or {}).get("capabilities_hash"):
            raise _fail(f"approval {approval} of run {run_id}: approves other capabilities")
        expires = gd.get("expires_at")
        if expires is not None and str(expires) <= start["time"]:
            raise _fail(
                f"approval {approval} of run {run_id}: expired at {expires}, before the run started"
            )
        revoked = proven.revokes.get(approval)
        if revoked is not None and revoked < int(start["seq"]):
            raise _fail(
                f"approval {approval} of run {run_id}: revoked (seq {revoked}) "
                "before the run started"
            )
    return checked


def _check_accesses(proven: _Proven, data_events: list[dict[str, Any]]) -> int:
    """Every allowed access lies inside its artifact's approved capabilities."""
    accesses = 0
    for ev in data_events:
        digest = str(ev.get("artifact"))
        run = proven.runs.get(str(ev.get("run")))
        if run is not None and run.get("artifact") != digest:
            raise _fail(
                f"event seq {ev['seq']}: names artifact {digest[:19]}… but its run "
                f"{ev.get('run')} runs {str(run.get('artifact'))[:19]}…"
            )
        submit = proven.submits.get(digest)
        if submit is None:
            raise _fail(
                f"event seq {ev['seq']}: the submission of artifact {digest[:19]}… (its "
                "approved capabilities) is not in the pack"
            )
        caps = (submit.get("details") or {}).get("capabilities") or {}
        why = _caps_allow(caps, ev)
        if why is not None:
            raise _fail(
                f"event seq {ev['seq']} ({ev['action']} {ev['resource']}): allowed, but {why}"
            )
        accesses += 1
    return accesses


# -- the report, regenerated ----------------------------------------------------------


def _check_report(
    zf: zipfile.ZipFile, head: _Head, period: _Period, context_docs: list[dict[str, Any]]
) -> None:
    gov_period = [e for s, e in sorted(period.events.items()) if head.first <= s < head.stop]
    report = period.summary.finish(
        context=context_docs,
        period_events=gov_period,
        subprocessors=_load(zf, "governance/subprocessors.json"),
    )
    if json.loads(json.dumps(report)) != _load(zf, "report/report.json"):
        raise _fail("report/report.json: does not match what the events show")


# -- the store's records held to the events -------------------------------------------


def _check_records(
    zf: zipfile.ZipFile,
    grants: dict[str, dict[str, Any]],
    submits: dict[str, dict[str, Any]],
    runs: dict[str, dict[str, Any]],
    ordered: list[dict[str, Any]],
) -> None:
    # The same comparisons the runtime and `audit verify` make (governance/_backing.py).
    for a in _load(zf, "governance/approvals.json"):
        ev = grants.get(str(a.get("id")))
        if ev is None or a.get("decision") != "approve":
            continue
        where = f"governance/approvals.json: approval {a.get('id')}"
        for problem in decision_problems(a, ev):
            raise _fail(f"{where}: {problem}; the approval was backdated or altered")
    for art in _load(zf, "governance/artifacts.json"):
        where = f"governance/artifacts.json: artifact {str(art.get('digest'))[:19]}…"
        manifest = art.get("manifest") or {}
        if capabilities_hash(manifest.get("capabilities") or {}) != art.get("capabilities_hash"):
            raise _fail(f"{where}: its capabilities do not hash to its capabilities_hash")
        ev = submits.get(str(art.get("digest")))
        if ev is not None:
            for problem in submission_problems(art, ev):
                raise _fail(f"{where}: differs from its submission event: {problem}")
    for r in _load(zf, "governance/runs.json"):
        ev = runs.get(str(r.get("id")))
        if ev is None:
            continue
        where = f"governance/runs.json: run {r.get('id')}"
        if (r.get("digest"), r.get("deployment"), list(r.get("approvals") or [])) != (
            ev.get("artifact"),
            ev.get("deployment"),
            list(ev.get("approvals") or []),
        ):
            raise _fail(
                f"{where}: artifact, deployment or approvals differ from its run.start "
                f"event (seq {ev['seq']})"
            )
        if not 0 <= _ts(ev["time"]) - _ts(str(r.get("started_at"))) <= _CLOCK_SLACK:
            raise _fail(f"{where}: start time differs from its run.start event (seq {ev['seq']})")
    deployments = _load(zf, "governance/deployments.json")
    for ev in ordered:
        if ev["action"] not in (Action.DEPLOYMENT_CREATE, Action.DEPLOYMENT_ROLLBACK):
            continue
        d = ev.get("details") or {}
        match = [
            x
            for x in deployments
            if x.get("name") == ev.get("deployment")
            and x.get("digest") == ev.get("artifact")
            and list(x.get("approvals") or []) == list(ev.get("approvals") or [])
            and x.get("environment") == d.get("environment")
            and x.get("instruction") == d.get("instruction")
        ]
        if deployments and not match:
            raise _fail(
                f"governance/deployments.json: no version of {ev.get('deployment')} "
                f"matches its deployment event (seq {ev['seq']})"
            )
    for p in _load(zf, "governance/policies.json"):
        if policy_version(str(p.get("text", ""))) != p.get("version"):
            raise _fail(
                f"governance/policies.json: the text of {p.get('version')} does not hash "
                "to its version"
            )


def _check_lineage(zf: zipfile.ZipFile) -> dict[str, list[tuple[int, str]]]:
    """Every lineage object a period event references is in the pack and is that
    object: its digest, its key count and the Merkle root of its keys as the (proven)
    event says. Returns the (seq, dataset) of the events that reference each."""
    names = set(zf.namelist())
    checked: dict[str, list[tuple[int, str]]] = {}
    for data in iter_lines(zf, "events/events.jsonl"):
        if b'"lineage_object"' not in data:
            continue
        ev = json.loads(data)
        d = ev.get("details") or {}
        ref = d.get("lineage_object")
        if not isinstance(ref, dict):
            raise _fail(f"event seq {ev.get('seq')}: its lineage_object is not an object")
        digest = str(ref.get("digest"))
        reader = (int(ev["seq"]), str(d.get("dataset")))
        if digest in checked:
            checked[digest].append(reader)
            continue
        name = lineage_name(digest)
        blob = zf.read(name) if name in names else None
        problem = check_lineage_object(ref, blob)
        if problem is not None:
            raise _fail(f"event seq {ev.get('seq')}: {name}: {problem}")
        checked[digest] = [reader]
    return checked


def _check_erasures(
    zf: zipfile.ZipFile,
    head: _Head,
    end_cp: Checkpoint,
    period: _Period,
    objects: dict[str, list[tuple[int, str]]],
) -> ErasureCheck:
    """Every erased entry of a lineage object in the pack is one that a proven
    erasure it names lists (``ledger.ErasureCheck``): the erasures of the period, and
    those the pack carries with their proofs against a later signed checkpoint."""
    names = set(zf.namelist())
    events = {
        s: e
        for s, e in period.events.items()
        if e["action"] == Action.ERASURE_REQUEST and e["decision"] == "allow"
    }
    if "erasures/checkpoint.note" in names:
        events.update(_proven_erasures(zf, head, end_cp))
    lists = {"sha256:" + n.removeprefix(_LISTS): zf.read(n) for n in names if n.startswith(_LISTS)}
    records = []
    for seq, ev in sorted(events.items()):
        try:
            records.append(erasure_record(ev, lists))
        except ValueError as exc:
            erasure = (ev.get("details") or {}).get("erasure")
            raise _fail(f"erasure {erasure!r} (event seq {seq}): {exc}") from None
    check = ErasureCheck(records)
    problems: list[str] = []
    for digest, readers in sorted(objects.items()):
        found = check.object(digest, zf.read(lineage_name(digest)), readers)
        problems += [f"{lineage_name(digest)}: {p}" for p in found]
    problems += check.finish()
    if problems:
        # A hidden entry is named first: it is what the forgery was for.
        raise _fail(min(problems, key=lambda p: ": entry " not in p))
    return check


_LISTS = "erasures/lists/"


def _proven_erasures(
    zf: zipfile.ZipFile, head: _Head, end_cp: Checkpoint
) -> dict[int, dict[str, Any]]:
    """The pack's erasure events, each proven included in the signed checkpoint
    ``erasures/checkpoint.note``, itself consistent with the end checkpoint."""
    where = "erasures/checkpoint.note"
    cp = open_checkpoint(_read(zf, where).decode(), head.verifier, head.origin)
    if cp.size < end_cp.size or (cp.size == end_cp.size and cp.root != end_cp.root):
        raise _fail(f"{where}: not a later checkpoint of the log than the end checkpoint")
    if cp.size > end_cp.size:
        cons = _load(zf, "erasures/consistency.json")
        if (cons.get("old"), cons.get("new")) != (end_cp.size, cp.size):
            raise _fail("erasures/consistency.json: sizes do not match the checkpoints")
        try:
            verify_consistency(
                end_cp.size,
                cp.size,
                end_cp.root,
                cp.root,
                decode_hashes(cons.get("hashes"), "erasures/consistency.json"),
            )
        except VerificationFailed as exc:
            raise _fail(f"erasures/consistency.json: {exc.message}") from exc
    out: dict[int, dict[str, Any]] = {}
    proofs = iter_lines(zf, "erasures/proofs.jsonl")
    for data in iter_lines(zf, "erasures/events.jsonl"):
        ev = _parse_event(data, "erasures/events.jsonl")
        seq = ev.get("seq")
        if type(seq) is not int or ev.get("tenant") != head.tenant:
            raise _fail(f"erasures/events.jsonl: event {seq!r}: bad seq or tenant")
        if ev.get("action") != Action.ERASURE_REQUEST:
            raise _fail(f"erasures/events.jsonl: event seq {seq} is not an erasure")
        raw = next(proofs, None)
        if raw is None:
            raise _fail(f"erasures/events.jsonl: event seq {seq}: no inclusion proof")
        try:
            p = json.loads(raw)
            hashes = decode_hashes(p.get("hashes"), f"proof of erasure event {seq}")
            if p.get("index") != seq or p.get("size") != cp.size:
                raise _fail(f"erasure event seq {seq}: its proof is for another index or size")
            verify_inclusion(seq, cp.size, leaf_hash(data), hashes, cp.root)
        except ValueError as exc:
            raise _fail(f"erasure event seq {seq}: unreadable proof") from exc
        except VerificationFailed as exc:
            raise _fail(
                f"erasure event seq {seq}: {exc.message}; the event or its proof was altered"
            ) from exc
        if ev.get("decision") == "allow":
            out[seq] = ev
    if next(proofs, None) is not None:
        raise _fail("erasures/proofs.jsonl: more proofs than erasure events")
    return out


def _check_policy_texts(zf: zipfile.ZipFile, proven: _Proven, scan: PolicyScan) -> PolicyCheck:
    """The cited policy texts are in the pack and hash to their versions, and a sample
    of the recorded decisions comes out the same when decided again with them."""
    # A run that started before the period: its record's environment (the pack's runs
    # are those in progress during it), else its deployment's, if only one.
    by_name: dict[str, set[str]] = {}
    for dep in _load(zf, "governance/deployments.json"):
        by_name.setdefault(str(dep.get("name")), set()).add(str(dep.get("environment")))
    environments = {name: envs.pop() for name, envs in by_name.items() if len(envs) == 1}
    runs = {
        str(r.get("id")): str(r.get("environment"))
        for r in _load(zf, "governance/runs.json")
        if r.get("environment") in ENVIRONMENTS
    }
    return scan.check(zf, proven.runs, environments, run_environments=runs)


if __name__ == "__main__":
    # The OCSF check's worker (see _verify): prints the first mismatch, or nothing.
    problem = _check_ocsf(sys.argv[1], sys.argv[2], int(sys.argv[3]))
    if problem:
        print(problem)


def _marker_leaf(ev: dict[str, Any]) -> bytes:
    try:
        return pruned_leaf_hash(ev)
    except ProctorError as exc:
        raise _fail(exc.message) from exc
