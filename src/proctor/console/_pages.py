"""What each console page shows: one function per page, each a few SDK calls and a
template. Nothing here decides: a refusal is the API's, shown as it came."""

from __future__ import annotations

import base64
import io
import json
from collections.abc import Callable, Iterable
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any
from urllib.parse import quote, urlencode

from pygments import highlight
from pygments.formatters import HtmlFormatter
from pygments.lexers import TextLexer, get_lexer_for_filename
from pygments.util import ClassNotFound
from starlette.responses import JSONResponse, Response

from proctor.errors import ProctorError

if TYPE_CHECKING:
    from proctor.console._app import View

#: A file larger than this is shown by size and digest, with a download link.
SHOWN_BYTES = 256 * 1024
_FORMATTER = HtmlFormatter(cssclass="hl", wrapcode=True)


class Refused(Exception):
    """A console-level answer: ``status`` and a message for the person."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def short(value: Any, n: int = 12) -> str:
    text = str(value or "")
    if text.startswith("sha256:"):
        return "sha256:" + text[7 : 7 + n]
    return text if len(text) <= n + 2 else text[:n] + "…"


def _refused(exc: ProctorError) -> str:
    return exc.message


def _try(fn: Callable[[], Any]) -> tuple[Any, str | None]:
    """A section of a page the person's role may not permit: its data, or the API's
    refusal to show in its place."""
    try:
        return fn(), None
    except ProctorError as exc:
        if int(getattr(exc, "status", 0) or 0) in (401,):
            raise
        return None, _refused(exc)


def _t(v: View) -> str:
    return f"{v.request.scope.get('root_path', '').rstrip('/')}/t/{quote(v.tenant)}"


def _events(lines: Iterable[bytes]) -> list[dict[str, Any]]:
    return [json.loads(line) for line in lines]


def _calls(events: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """A run's calls out of its sandbox (not its own start and end), refusals first."""
    calls = [e for e in events if not str(e.get("action", "")).startswith("run.")]
    return sorted(calls, key=lambda e: (e.get("decision") != "deny", e.get("seq", 0)))


def _shortly_before(when: str) -> str:
    start = datetime.fromisoformat(when.replace("Z", "+00:00")) - timedelta(minutes=1)
    return start.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _me(v: View) -> str:
    return f"{v.session.tenant}/{v.session.principal}"


def _live(approval: dict[str, Any]) -> bool:
    if approval.get("revoked_at"):
        return False
    exp = approval.get("expires_at")
    return not (exp and str(exp) <= datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ"))


# -- home and approvals -------------------------------------------------------------


def home(v: View) -> Response:
    queue, queue_refused = _try(lambda: _queue(v))
    runs, runs_refused = _try(lambda: v.client.runs(v.tenant))
    return v.page("home.html", queue=queue, queue_refused=queue_refused,
                  runs=(runs or [])[-10:][::-1], runs_refused=runs_refused, t=_t(v))  # fmt: skip


def _queue(v: View) -> list[dict[str, Any]]:
    """Artifacts that wait for this person: not theirs, not decided by them, and not
    yet approved by a quorum."""
    arts = v.client.artifacts(v.tenant)
    approvals = v.client.approvals(v.tenant)
    quorum, _ = _try(lambda: v.client.quorum(v.tenant))
    required = int(quorum["required"]) if quorum else 1
    me = _me(v)
    out = []
    for art in arts:
        mine = [a for a in approvals if a["digest"] == art["digest"]]
        if art["author"] in (me, v.session.principal):
            continue
        if any(a["principal"] in (me, v.session.principal) and _live(a) for a in mine):
            continue
        live = [a for a in mine if _live(a)]
        if any(a["decision"] == "reject" for a in live):
            continue
        approved = sum(a["decision"] == "approve" for a in live)
        if approved >= required:
            continue
        out.append({**art, "approved": approved, "required": required})
    return sorted(out, key=lambda a: a["submitted_at"], reverse=True)


def approvals(v: View) -> Response:
    queue = _queue(v)
    every = v.client.approvals(v.tenant)
    return v.page("approvals.html", queue=queue, approvals=every[::-1], t=_t(v))


def artifacts(v: View) -> Response:
    arts = v.client.artifacts(v.tenant)
    return v.page("artifacts.html", artifacts=arts[::-1], t=_t(v))


def _file_view(v: View, digest: str, f: dict[str, Any]) -> dict[str, Any]:
    shown = dict(f)
    size = int(f.get("size", 0))
    if f.get("type", "file") != "file" or size > SHOWN_BYTES:
        shown["html"] = None
        return shown
    data = v.client.artifact_file(v.tenant, digest, str(f["path"]))
    text: str | None
    try:
        text = data.decode("utf-8") if b"\x00" not in data[:8192] else None
    except UnicodeDecodeError:
        text = None
    if text is None:
        shown["html"] = None
        return shown
    try:
        lexer = get_lexer_for_filename(str(f["path"]), stripnl=False)
    except ClassNotFound:
        lexer = TextLexer(stripnl=False)
    # A code block that scrolls must take the keyboard's focus (WCAG 2.1.1; axe's
    # scrollable-region-focusable), so its <pre> gets a tabindex.
    shown["html"] = highlight(text, lexer, _FORMATTER).replace("<pre>", '<pre tabindex="0">', 1)
    return shown


def _unused(review: dict[str, Any]) -> list[str]:
    """Capabilities no sandbox run of this digest used: candidates to drop."""
    caps = review.get("capabilities") or {}
    seen = " ".join(str(e.get("resource", "")) for r in review.get("sandbox_runs", [])
                    for e in r.get("events", []))  # fmt: skip
    if not review.get("sandbox_runs"):
        return []
    out = [f"egress to {h}" for h in caps.get("egress", []) if h.split(":")[0] not in seen]
    for ds, spec in sorted((caps.get("datasets") or {}).items()):
        for table in sorted(spec.get("tables", {})):
            if table not in seen:
                out.append(f"dataset {ds}.{table}")
    out += [f"bucket {b}" for b in sorted(caps.get("buckets") or {}) if b not in seen]
    out += [f"secret {s}" for s in caps.get("secrets", []) if s not in seen]
    return out


def _last_approved(v: View, review: dict[str, Any]) -> str | None:
    """The newest other digest of the same name that holds a live approval."""
    arts = {a["digest"]: a for a in v.client.artifacts(v.tenant)}
    approved = {a["digest"] for a in v.client.approvals(v.tenant)
                if a["decision"] == "approve" and _live(a)}  # fmt: skip
    same = [a for d, a in arts.items()
            if d in approved and d != review["digest"] and a["name"] == review["name"]]  # fmt: skip
    return max(same, key=lambda a: a["submitted_at"])["digest"] if same else None


def artifact(v: View) -> Response:
    digest = v.request.path_params["digest"]
    review = v.client.review(v.tenant, digest)
    full = review["digest"]
    files = [_file_view(v, full, f) for f in review["files"]]
    prior = _last_approved(v, review)
    diff = v.client.diff(v.tenant, prior, full) if prior else None
    diff_files = []
    if diff:
        for f in diff.get("files", diff.get("changes", [])):
            diff_files.append(f)
    quorum, _ = _try(lambda: v.client.quorum(v.tenant))
    live = [a for a in review.get("approvals", []) if _live(a) and a["decision"] == "approve"]
    manifest = review.get("manifest") or {}
    return v.page(
        "artifact.html", a=review, files=files, prior=prior, diff=diff, diff_files=diff_files,
        unused=_unused(review), quorum=quorum, approved=len(live), t=_t(v),
        limits=manifest.get("limits") or {}, lifecycle=manifest.get("lifecycle") or {},
        mine=review["author"] in (_me(v), v.session.principal),
    )  # fmt: skip


def artifact_tar(v: View) -> Response:
    out = io.BytesIO()
    full = v.client.download_artifact(v.tenant, v.request.path_params["digest"], out)
    name = full.removeprefix("sha256:")[:16]
    return Response(out.getvalue(), media_type="application/x-tar", headers={
        "Content-Disposition": f'attachment; filename="artifact-{name}.tar"'})  # fmt: skip


def _days(raw: str | None) -> int:
    try:
        days = float(raw or "30")
    except ValueError:
        days = -1
    if not 0 < days <= 366:
        raise Refused(400, "the expiry is a number of days between 1 and 366")
    return int(days * 86400)


def approve(v: View) -> Response:
    digest = v.request.path_params["digest"]
    back = f"{_t(v)}/artifacts/{quote(digest)}"
    try:
        expires = _days(v.form.get("expires_days"))
        got = v.client.approve(v.tenant, digest, expires_seconds=expires,
                               comment=v.form.get("comment", "")[:2000])  # fmt: skip
    except ProctorError as exc:
        return v.back(back, "error", f"not approved: {exc.message}")
    return v.back(back, "ok", f"approved as {got['principal']} (approval {got['id']})")


def reject(v: View) -> Response:
    digest = v.request.path_params["digest"]
    back = f"{_t(v)}/artifacts/{quote(digest)}"
    try:
        got = v.client.reject(v.tenant, digest, comment=v.form.get("comment", "")[:2000])
    except ProctorError as exc:
        return v.back(back, "error", f"not rejected: {exc.message}")
    return v.back(back, "ok", f"rejected as {got['principal']} (record {got['id']})")


# -- deployments and runs -----------------------------------------------------------


def deployments(v: View) -> Response:
    deps = v.client.deployments(v.tenant)
    return v.page("deployments.html", deployments=deps, t=_t(v))


def stop_deployment(v: View) -> Response:
    name = v.request.path_params["name"]
    reason = v.form.get("reason", "").strip()[:500] or "stopped from the console"
    try:
        v.client.stop_deployment(v.tenant, name, reason)
    except ProctorError as exc:
        return v.back(f"{_t(v)}/deployments", "error", f"not stopped: {exc.message}")
    return v.back(f"{_t(v)}/deployments", "ok", f"deployment {name} stopped: {reason}")


def runs(v: View) -> Response:
    dep = v.param("deployment")
    found = v.client.runs(v.tenant, dep)
    return v.page("runs.html", runs=found[::-1][:500], deployment=dep, t=_t(v))


def _output(v: View, run_id: str) -> dict[str, str]:
    out = {}
    for stream in ("stdout", "stderr"):
        data = b"".join(v.client.run_logs(v.tenant, run_id, stream=stream))
        out[stream] = data[-256 * 1024 :].decode("utf-8", "replace")
    return out


def run(v: View) -> Response:
    run_id = v.request.path_params["run_id"]
    doc = v.client.get_run(v.tenant, run_id)
    events, refused = _try(
        lambda: _events(
            v.client.iter_events(v.tenant, run=doc["id"], since=_shortly_before(doc["started_at"]))
        )
    )
    calls = _calls(events or [])
    output, output_refused = _try(lambda: _output(v, doc["id"]))
    return v.page("run.html", run=doc, calls=calls[:500], total=len(calls),
                  denied=sum(c.get("decision") == "deny" for c in calls),
                  calls_refused=refused, output=output, output_refused=output_refused,
                  t=_t(v))  # fmt: skip


def run_output(v: View) -> Response:
    run_id = v.request.path_params["run_id"]
    doc = v.client.get_run(v.tenant, run_id)
    output, refused = _try(lambda: _output(v, doc["id"]))
    return v.page("run_output.html", run=doc, output=output, output_refused=refused, t=_t(v))


# -- the audit log ------------------------------------------------------------------


def _iso(raw: str | None, name: str) -> str | None:
    if raw is None:
        return None
    try:
        when = datetime.fromisoformat(raw.replace("Z", "+00:00"))
    except ValueError as exc:
        raise Refused(400, f"{name} is not a time (ISO 8601, e.g. 2026-12-01T09:00)") from exc
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return when.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def audit(v: View) -> Response:
    f = {k: v.param(k) for k in ("run", "actor", "action", "decision", "since", "until")}
    lines = v.client.events(
        v.tenant, limit=200, newest=True, run=f["run"], action=f["action"],
        decision=f["decision"], since=_iso(f["since"], "since"), until=_iso(f["until"], "until"),
        actor=f["actor"],
    )  # fmt: skip
    events = _events(lines)
    key, _ = _try(v.client.verifier_key)
    return v.page("audit.html", events=events[::-1], filters=f, t=_t(v), vkey=key)


def event(v: View) -> Response:
    seq = int(v.request.path_params["seq"])
    lines = v.client.events(v.tenant, start=seq, limit=1)
    if not lines or json.loads(lines[0]).get("seq") != seq:
        raise Refused(404, f"the log has no event {seq}")
    raw = lines[0]
    checkpoint = v.client.checkpoint(v.tenant)
    size = int(checkpoint.split("\n")[1])
    proof = v.client.inclusion_proof(v.tenant, seq, size) if seq < size else None
    return v.page(
        "event.html", ev=json.loads(raw), pretty=json.dumps(json.loads(raw), indent=2),
        b64=base64.b64encode(raw).decode(), proof=json.dumps(proof) if proof else "",
        checkpoint=checkpoint, size=size, vkey=v.client.verifier_key(), t=_t(v),
    )  # fmt: skip


def consistency(v: View) -> Response:
    """The consistency proof the in-page check asks for (same-origin, as JSON)."""
    try:
        old, new = int(v.param("old") or ""), int(v.param("new") or "")
    except ValueError:
        return JSONResponse({"error": "old and new are tree sizes"}, status_code=400)
    return JSONResponse(v.client.consistency_proof(v.tenant, old, new))


def history(v: View) -> Response:
    at = v.param("at")
    found = v.client.history(v.tenant, _iso(at, "at") or "") if at else None
    return v.page("history.html", at=at or "", found=found, t=_t(v))


def export(v: View) -> Response:
    data = v.client.export_archive(v.tenant)
    return Response(data, media_type="application/gzip", headers={
        "Content-Disposition": f'attachment; filename="{v.tenant}-log.tar.gz"'})  # fmt: skip


def evidence(v: View) -> Response:
    """The evidence pack of a period, as the API gives it (the SDK's evidence_pack)."""
    import tempfile
    from pathlib import Path

    since, until = _iso(v.param("from"), "from"), _iso(v.param("to"), "to")
    if since is None or until is None:
        return v.back(f"{_t(v)}/audit", "error", "an evidence pack needs a start and an end")
    with tempfile.TemporaryDirectory(prefix="proctor-console-") as tmp:
        dest = Path(tmp) / "pack.zip"
        v.client.evidence_pack(v.tenant, since, until, dest)
        data = dest.read_bytes()
    return Response(data, media_type="application/zip", headers={
        "Content-Disposition": f'attachment; filename="{v.tenant}-evidence.zip"'})  # fmt: skip


# -- what the tenant holds ----------------------------------------------------------


def resources(v: View) -> Response:
    sections = {}
    for name, fn in (
        ("datasets", lambda: v.client.datasets(v.tenant)),
        ("secrets", lambda: v.client.secrets(v.tenant)),
        ("buckets", lambda: v.client.buckets(v.tenant)),
        ("subprocessors", lambda: v.client.subprocessors(v.tenant)),
        ("principals", lambda: v.client.principals(v.tenant)),
        ("quorum", lambda: v.client.quorum(v.tenant)),
    ):
        sections[name] = _try(fn)
    return v.page("resources.html", s=sections, t=_t(v))


def bucket(v: View) -> Response:
    name = v.request.path_params["bucket"]
    objects = v.client.bucket_objects(v.tenant, name)
    return v.page("bucket.html", bucket=name, objects=objects, t=_t(v))


def bucket_object(v: View) -> Response:
    name, key = v.request.path_params["bucket"], v.request.path_params["key"]
    data = v.client.get_object(v.tenant, name, key)
    leaf = key.rsplit("/", 1)[-1].replace('"', "")
    return Response(data, media_type="application/octet-stream", headers={
        "Content-Disposition": f'attachment; filename="{leaf}"'})  # fmt: skip


ROUTES: list[tuple[str, Callable[[View], Response], list[str]]] = [
    ("/", home, ["GET"]),
    ("/approvals", approvals, ["GET"]),
    ("/artifacts", artifacts, ["GET"]),
    ("/artifacts/{digest}", artifact, ["GET"]),
    ("/artifacts/{digest}/tar", artifact_tar, ["GET"]),
    ("/artifacts/{digest}/approve", approve, ["POST"]),
    ("/artifacts/{digest}/reject", reject, ["POST"]),
    ("/deployments", deployments, ["GET"]),
    ("/deployments/{name}/stop", stop_deployment, ["POST"]),
    ("/runs", runs, ["GET"]),
    ("/runs/{run_id}", run, ["GET"]),
    ("/runs/{run_id}/output", run_output, ["GET"]),
    ("/audit", audit, ["GET"]),
    ("/audit/consistency", consistency, ["GET"]),
    ("/audit/{seq:int}", event, ["GET"]),
    ("/history", history, ["GET"]),
    ("/export", export, ["GET"]),
    ("/evidence", evidence, ["GET"]),
    ("/resources", resources, ["GET"]),
    ("/buckets/{bucket}", bucket, ["GET"]),
    ("/buckets/{bucket}/objects/{key:path}", bucket_object, ["GET"]),
]

__all__ = ["ROUTES", "Refused", "short", "urlencode"]
