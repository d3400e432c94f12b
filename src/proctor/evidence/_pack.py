"""Evidence packs: one zip an auditor checks with the verifier key alone.

Layout (every file listed with its SHA-256 in ``manifest.json``):

- ``pack.json``: tenant, origin, period, the exported range, sizes;
- ``events/events.jsonl``: every event of the period, the bytes exactly as hashed;
- ``events/context.jsonl``: governance events from before the period that the
  period's runs rely on (submissions, approvals, revocations, deployments,
  policies, the register), and the two events just outside the period, whose
  times prove that nothing at its edges was left out;
- ``ocsf/events.ocsf.jsonl``: the period's events as OCSF 1.8.0 (``_ocsf``);
- ``checkpoints/start.note``, ``checkpoints/end.note``: signed checkpoints at the
  period's start and covering its end; ``proofs/consistency.json`` between them;
- ``proofs/range.json``: the range multi-proof of every period event against the
  end checkpoint; ``proofs/context.jsonl``: an inclusion proof per context event;
- ``governance/*.json``: policies with versions, artifacts (manifests, digests),
  approvals, deployments, runs, the subprocessor register, from the store;
- ``verifier.key``; ``report/report.{md,html,json}``, ``report/activity.png``;
- ``lineage/<hex>``: every lineage object a period event references (by
  ``details.lineage_object.digest``, ``sha256:<hex>``), its bytes as stored;
- ``policies/<hex>.cedar``: the text of every policy version a period event cites
  (``details.policy_version``), the bytes that hash to it (``_policies.py``);
- ``erasures/events.jsonl``: every ``erasure.request`` event of the log up to the
  head at export (the bytes as hashed), ``erasures/proofs.jsonl`` an inclusion proof
  each against ``erasures/checkpoint.note`` (the head's signed checkpoint),
  ``erasures/consistency.json`` from the end checkpoint to it, and
  ``erasures/lists/<hex>`` the entry list each erasure's event commits to: what
  ``verify`` holds every erased lineage object to (an erasure after the period
  still explains a leaf in a period object). Absent if the log records no erasure.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
import shutil
import tempfile
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from proctor.errors import UsageError
from proctor.evidence._ocsf import ocsf_line
from proctor.evidence._policies import cited_version, policy_name, policy_texts
from proctor.evidence._render import chart_png, cited_seqs, render_html, render_markdown
from proctor.evidence._retention import render_html as retention_html
from proctor.evidence._retention import render_markdown as retention_markdown
from proctor.evidence._retention import retention_record
from proctor.evidence._summary import Summary
from proctor.evidence._tree import range_proof
from proctor.evidence._witnessed import witness_files
from proctor.governance import Home, Retention, Runs, Subprocessors
from proctor.ledger import (
    Action,
    canonical_json,
    is_pruned_marker,
    leaf_hash,
    node_hash,
    read_objects,
    utc_now,
)

PACK_FORMAT = "proctor-evidence-pack/1"
# Governance actions whose earlier events a period's runs may rely on.
_CONTEXT_RE = re.compile(
    rb'"action":"(artifact\.submit|approval\.[a-z]+|deployment\.[a-z]+|policy\.set|quorum\.set'
    rb'|subprocessor\.[a-z]+|dataset\.register)"'
)


@dataclass(frozen=True)
class PackInfo:
    path: Path
    tenant: str
    first_seq: int
    end_seq: int
    events: int
    context: int
    end_size: int
    start_size: int


class _Nodes:
    """``node(start, height)`` from the ledger's public tiles, cached per tile."""

    def __init__(self, rt: Home, log: str) -> None:
        self._rt = rt
        self._log = log
        self._tiles: dict[tuple[int, int], bytes] = {}

    def __call__(self, start: int, height: int) -> bytes:
        level, rest = divmod(height, 8)
        first = start >> (8 * level)
        index, offset = divmod(first, 256)
        tile = self._tiles.get((level, index))
        if tile is None:
            tile = self._tiles[(level, index)] = self._rt.ledger.tile(self._log, level, index)
        count = 1 << rest
        hashes = [tile[i : i + 32] for i in range(offset * 32, (offset + count) * 32, 32)]
        if len(hashes) != count or any(len(h) != 32 for h in hashes):
            raise UsageError(f"the stored tree of {self._log} lacks a tile; run `audit verify`")
        while len(hashes) > 1:
            hashes = [node_hash(hashes[i], hashes[i + 1]) for i in range(0, len(hashes), 2)]
        return hashes[0]


class _Writer:
    """A zip whose files are hashed as they are written, for the manifest."""

    def __init__(self, path: Path) -> None:
        self.zip = zipfile.ZipFile(path, "x", compression=zipfile.ZIP_DEFLATED, compresslevel=1)
        self.hashes: dict[str, str] = {}
        self.open_streams: set[_Stream] = set()

    def put(self, name: str, data: bytes) -> None:
        self.hashes[name] = hashlib.sha256(data).hexdigest()
        self.zip.writestr(name, data)

    def stream(self, name: str, *, spool: bool = False) -> _Stream:
        return _Stream(self, name, spool)

    def abort(self) -> None:
        for stream in list(self.open_streams):
            with contextlib.suppress(Exception):
                stream.raw.close()
        with contextlib.suppress(Exception):
            self.zip.close()

    def close(self) -> None:
        manifest = {"format": PACK_FORMAT, "files": dict(sorted(self.hashes.items()))}
        self.zip.writestr("manifest.json", canonical_json(manifest) + b"\n")
        self.zip.close()


class _Stream:
    """A file written line by line. A zip takes one writer at a time, so a file
    written alongside another is spooled to a temporary file and copied in on close."""

    def __init__(self, writer: _Writer, name: str, spool: bool) -> None:
        self._writer = writer
        self._name = name
        self._hash = hashlib.sha256()
        self._spool = spool
        self._f: IO[bytes] = (
            # Closed in close() (or abort()): the stream outlives this call.
            tempfile.TemporaryFile()  # noqa: SIM115
            if spool
            else writer.zip.open(name, "w", force_zip64=True)
        )
        self._buf: list[bytes] = []
        self._size = 0
        writer.open_streams.add(self)

    @property
    def raw(self) -> IO[bytes]:
        return self._f

    def line(self, data: bytes) -> None:
        self._buf.append(data)
        self._buf.append(b"\n")
        self._size += len(data) + 1
        if self._size > 1 << 20:
            self._flush()

    def _flush(self) -> None:
        chunk = b"".join(self._buf)
        self._hash.update(chunk)
        self._f.write(chunk)
        self._buf.clear()
        self._size = 0

    def close(self) -> None:
        self._flush()
        if self._spool:
            self._f.seek(0)
            with self._writer.zip.open(self._name, "w", force_zip64=True) as out:
                shutil.copyfileobj(self._f, out, 1 << 20)
        self._f.close()
        self._writer.open_streams.discard(self)
        self._writer.hashes[self._name] = self._hash.hexdigest()


def _json(value: Any) -> bytes:
    return json.dumps(value, indent=2, sort_keys=True, ensure_ascii=False).encode() + b"\n"


def _governance(rt: Home, tenant: str, digests: set[str], start: str, end: str) -> dict[str, Any]:
    policies: list[dict[str, Any]] = [
        {"version": p.version, "seq": p.seq, "set_at": p.set_at, "set_by": p.set_by, "text": p.text}
        for p in rt.policies.history(tenant)
    ]
    # In force over the period: the one current at its start and every later one set in it.
    in_force = [p for p in policies if str(p["set_at"]) < end]
    before = [p for p in in_force if str(p["set_at"]) <= start]
    in_force = ([before[-1]] if before else []) + [p for p in in_force if str(p["set_at"]) > start]
    deployments = []
    seen: set[str] = set()
    for dep in rt.deployments.current(tenant):
        for version in rt.deployments.versions(tenant, dep.name):
            deployments.append(version.as_json())
            digests.add(version.digest)
            seen.add(version.name)
    runs = [r.as_json() for r in Runs(rt).between(tenant, start, end)]
    digests.update(str(r["digest"]) for r in runs)
    artifacts = []
    approvals: list[dict[str, Any]] = []
    for digest in sorted(digests):
        found = rt.artifacts.find(tenant, digest)
        if found is None:
            continue
        artifacts.append(found.to_json())
        approvals.extend(a.as_json() for a in rt.approvals.for_artifact(tenant, digest))
    subprocessors = [s.as_json() for s in Subprocessors(rt.store, rt.ledger).list(tenant)]
    return {
        "policies": in_force,
        "artifacts": artifacts,
        "approvals": approvals,
        "deployments": deployments,
        "runs": runs,
        "subprocessors": subprocessors,
        "retention": retention_record(rt, tenant),
    }


def _period_bounds(rt: Home, tenant: str, start: str) -> int:
    """The seq of the first event at or after ``start`` (the log's size if none)."""
    gen = rt.ledger.events_between(tenant, start, None)
    try:
        first = next(gen, None)
    finally:
        # A generator: closing it ends its read transaction now, not at collection.
        getattr(gen, "close", lambda: None)()
    if first is None:
        return rt.ledger.head(tenant).size
    return int(json.loads(first)["seq"])


def export_pack(rt: Home, tenant: str, start: str, end: str, out_zip: Path) -> PackInfo:
    """Write the evidence pack of ``tenant`` for events with time in [start, end)."""
    rt.tenants.get(tenant)
    if not start < end:
        raise UsageError("--from must be before --to")
    if out_zip.exists():
        raise UsageError(f"{out_zip} exists already")
    origin = rt.ledger.origin(tenant)
    first = _period_bounds(rt, tenant, start)
    writer = _Writer(out_zip)
    try:
        summary = Summary()
        leaves: list[bytes] = []
        governance_events: list[dict[str, Any]] = []
        digests: set[str] = set()
        lineage: set[str] = set()
        versions: set[str] = set()
        events_out = writer.stream("events/events.jsonl")
        ocsf_out = writer.stream("ocsf/events.ocsf.jsonl", spool=True)
        seq = first - 1
        for data in rt.ledger.events_between(tenant, start, end):
            ev = json.loads(data)
            seq = int(ev["seq"])
            events_out.line(data)
            ocsf_out.line(ocsf_line(ev, origin))
            leaves.append(leaf_hash(data))
            if is_pruned_marker(ev):
                continue  # a pruned entry: its OCSF line and place only, nothing to summarise
            summary.add(ev)
            if _CONTEXT_RE.search(data):
                governance_events.append(ev)
            if ev.get("artifact"):
                digests.add(str(ev["artifact"]))
            _lineage_ref(ev, lineage)
            if (version := cited_version(data)) is not None:
                versions.add(version)
        events_out.close()
        ocsf_out.close()
        _put_lineage(writer, rt, tenant, lineage)
        _put_policies(writer, rt, tenant, versions)
        stop = seq + 1
        if stop != first + len(leaves):
            raise UsageError("the period's events are not contiguous; run `proctor audit verify`")
        head = rt.ledger.head(tenant)
        checkpoints = rt.ledger.checkpoints(tenant)
        # The end checkpoint must also hold the event right after the period (its
        # witness), when there is one.
        need = stop + 1 if stop < head.size else stop
        end_cp = next(((s, n) for s, _, n in checkpoints if s >= max(need, 1)), None)
        if end_cp is None:
            end_cp = (head.size, head.checkpoint)
        end_size, end_note = end_cp
        start_cp = None
        for s, _, n in checkpoints:
            if 0 < s <= first:
                start_cp = (s, n)
        context_seqs = set()
        context_events: list[bytes] = []
        for data in rt.ledger.entries(tenant, 0, first):
            if _CONTEXT_RE.search(data):
                context_events.append(data)
        if first > 0:
            context_events.extend(rt.ledger.entries(tenant, first - 1, first))
        if stop < end_size:
            context_events.extend(rt.ledger.entries(tenant, stop, stop + 1))
        context_out = writer.stream("events/context.jsonl")
        proofs_out = writer.stream("proofs/context.jsonl", spool=True)
        context_docs = []
        for data in context_events:
            ev = json.loads(data)
            if int(ev["seq"]) in context_seqs:
                continue
            context_seqs.add(int(ev["seq"]))
            context_out.line(data)
            proof = rt.ledger.inclusion_proof(tenant, int(ev["seq"]), end_size)
            proofs_out.line(canonical_json(proof.as_json()))
            context_docs.append(ev)
            if ev.get("artifact"):
                digests.add(str(ev["artifact"]))
        context_out.close()
        proofs_out.close()
        nodes = _Nodes(rt, tenant)
        writer.put("proofs/range.json", _json(range_proof(nodes, first, stop, end_size)))
        writer.put("checkpoints/end.note", end_note.encode())
        if start_cp is not None:
            writer.put("checkpoints/start.note", start_cp[1].encode())
            cons = rt.ledger.consistency_proof(tenant, start_cp[0], end_size)
            writer.put("proofs/consistency.json", _json(cons.as_json()))
        _put_erasures(writer, rt, tenant, end_size)
        docs = _governance(rt, tenant, digests, start, end)
        for name, value in docs.items():
            writer.put(f"governance/{name}.json", _json(value))
        writer.put("verifier.key", (rt.ledger.vkey() + "\n").encode())
        meta: dict[str, Any] = {
            "format": PACK_FORMAT,
            "tenant": tenant,
            "origin": origin,
            "from": start,
            "to": end,
            "first_seq": first,
            "end_seq": stop,
            "start_size": 0 if start_cp is None else start_cp[0],
            "end_size": end_size,
            "exported_at": utc_now(),
            "events": len(leaves),
            "context": len(context_docs),
        }
        # The tenant's witnesses: how old its newest cosigned checkpoint is, and that one.
        for name, data in witness_files(rt, tenant, end_size).items():
            writer.put(name, data)
        writer.put("pack.json", _json(meta))
        report = summary.finish(
            context=context_docs,
            period_events=governance_events,
            subprocessors=docs["subprocessors"],
        )
        write_report(writer, meta, report, _appendix(rt, tenant, report, context_docs),
                     retention=docs["retention"])  # fmt: skip
    except BaseException:
        writer.abort()
        out_zip.unlink(missing_ok=True)
        raise
    writer.close()
    return PackInfo(
        out_zip,
        tenant,
        first,
        stop,
        len(leaves),
        len(context_docs),
        end_size,
        int(meta["start_size"]),
    )


def _appendix(
    rt: Home, tenant: str, report: dict[str, Any], context: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    # Fetched again by seq rather than kept while streaming: a million parsed
    # events would not fit in memory; the cited ones are a few hundred.
    by_seq = {int(e["seq"]): e for e in context}
    out = []
    for seq in sorted(cited_seqs(report)):
        ev = by_seq.get(seq)
        if ev is None:
            ev = json.loads(next(iter(rt.ledger.entries(tenant, seq, seq + 1))))
        out.append(ev)
    return out


def write_report(
    writer: _Writer,
    meta: dict[str, Any],
    report: dict[str, Any],
    appendix: list[dict[str, Any]],
    retention: dict[str, Any] | None = None,
) -> None:
    writer.put("report/report.json", _json(report))
    png = chart_png(report)
    if png is not None:
        writer.put("report/activity.png", png)
    writer.put(
        "report/report.md",
        render_markdown(meta, report, appendix, "activity.png" if png else None)
        .replace("\n## Events cited\n", retention_markdown(retention) + "\n## Events cited\n", 1)
        .encode(),
    )
    page = render_html(meta, report, appendix, png)
    page = page.replace(
        "<h2>Events cited</h2>", retention_html(retention) + "<h2>Events cited</h2>", 1
    )
    writer.put("report/report.html", page.encode())


def iter_lines(zf: zipfile.ZipFile, name: str) -> Iterator[bytes]:
    with zf.open(name) as f:
        for line in f:
            yield line.rstrip(b"\n")


def _lineage_ref(ev: dict[str, Any], into: set[str]) -> None:
    ref = (ev.get("details") or {}).get("lineage_object")
    if isinstance(ref, dict) and isinstance(ref.get("digest"), str):
        into.add(ref["digest"])


def lineage_name(digest: str) -> str:
    """Where a pack holds the lineage object ``sha256:<hex>``."""
    return "lineage/" + digest.removeprefix("sha256:")


def _put_lineage(writer: _Writer, rt: Home, tenant: str, digests: set[str]) -> None:
    """The lineage objects the period's events reference; one missing from the store
    is left out, and `evidence verify` names it."""
    for digest, data in sorted(read_objects(rt.store, tenant, digests).items()):
        writer.put(lineage_name(digest), data)


def _put_erasures(writer: _Writer, rt: Home, tenant: str, end_size: int) -> None:
    """The log's erasures, proven against its head, and their entry lists (see the
    module text); nothing if it records none."""
    head = rt.ledger.head(tenant)
    seqs = [
        int(e["seq"])
        for e in Retention(rt.store, rt.ledger).history(tenant)
        if e["action"] == Action.ERASURE_REQUEST
        and e["decision"] == "allow"
        and e["seq"] < head.size
    ]
    if not seqs:
        return
    events = writer.stream("erasures/events.jsonl")
    proofs = writer.stream("erasures/proofs.jsonl", spool=True)
    lists: set[str] = set()
    for seq in seqs:
        (data,) = rt.ledger.entries(tenant, seq, seq + 1)
        events.line(data)
        proofs.line(canonical_json(rt.ledger.inclusion_proof(tenant, seq, head.size).as_json()))
        ref = (json.loads(data).get("details") or {}).get("entries")
        if isinstance(ref, dict) and isinstance(ref.get("digest"), str):
            lists.add(ref["digest"])
    events.close()
    proofs.close()
    writer.put("erasures/checkpoint.note", head.checkpoint.encode())
    if head.size > end_size:
        cons = rt.ledger.consistency_proof(tenant, end_size, head.size)
        writer.put("erasures/consistency.json", _json(cons.as_json()))
    for digest, data in sorted(read_objects(rt.store, tenant, lists).items()):
        writer.put(erasure_list_name(digest), data)


def erasure_list_name(digest: str) -> str:
    """Where a pack holds the erasure entry list ``sha256:<hex>``."""
    return "erasures/lists/" + digest.removeprefix("sha256:")


def _put_policies(writer: _Writer, rt: Home, tenant: str, versions: set[str]) -> None:
    """The text of each policy version the period's events cite; one that cannot be
    found is left out, and `evidence verify` names it."""
    for version, text in sorted(policy_texts(rt, tenant, versions).items()):
        writer.put(policy_name(version), text.encode("utf-8"))
