"""What changed between two artifacts: the view an approver reviews. Files by path
(a unified diff for text, sizes and hashes otherwise), and the manifest line by
line, each change said in words and marked when it lets the code do more.
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from proctor.governance._artifact_walk import ArtifactFile
from proctor.governance._manifest import Manifest

if TYPE_CHECKING:
    from proctor.governance._artifacts import Artifact

# Past this size a unified diff is more noise than review.
MAX_TEXT_DIFF_BYTES = 512 * 1024


@dataclass(frozen=True)
class FileChange:
    """A file added, removed or changed between two artifacts.

    ``change`` is ``added``, ``removed`` or ``modified`` (content, mode or
    link target). ``diff`` is a unified diff for text files; ``binary``
    says the content is not text, so only sizes and hashes are shown.
    """

    path: str
    change: str
    old: ArtifactFile | None
    new: ArtifactFile | None
    binary: bool = False
    diff: str | None = None

    @property
    def summary(self) -> str:
        """One line for people: sizes and hashes where the content is not shown as text."""
        old, new = self.old, self.new
        if (old is not None and old.link is not None) or (new is not None and new.link is not None):
            return f"link {_entry(old)} -> {_entry(new)}"
        if old is not None and new is not None and old.sha256 == new.sha256:
            return f"mode {old.mode:04o} -> {new.mode:04o}"
        sizes = " -> ".join(f"{f.size} bytes" for f in (old, new) if f is not None)
        hashes = " -> ".join(f.sha256[:16] + "…" for f in (old, new) if f is not None)
        mode = ""
        if old is not None and new is not None and old.mode != new.mode:
            mode = f", mode {old.mode:04o} -> {new.mode:04o}"
        if self.binary:
            return f"binary, {sizes}, sha256 {hashes}{mode}"
        if self.diff is None:
            return f"too large to show as text, {sizes}, sha256 {hashes}{mode}"
        return f"text, {sizes}{mode}"

    def to_json(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "change": self.change,
            "old": self.old.to_json() if self.old else None,
            "new": self.new.to_json() if self.new else None,
            "binary": self.binary,
            "diff": self.diff,
            "summary": self.summary,
        }


def _entry(f: ArtifactFile | None) -> str:
    if f is None:
        return "(none)"
    return f"to {f.link}" if f.link is not None else f"(file, {f.size} bytes)"


@dataclass(frozen=True)
class CapabilityChange:
    """One line of the manifest's review.

    ``area``: name, purpose, entrypoint, dataset, table, column, access,
    egress, secret, bucket, limit or lifecycle. ``widens`` marks a change
    that lets the code do more than before (a new column, host, secret,
    write access, a larger limit, a new purpose): what an approver must not
    miss.
    """

    area: str
    subject: str
    change: str
    old: str | None
    new: str | None
    widens: bool
    #: The change in words, e.g. "adds egress to api.example.com:443".
    text: str = ""

    def to_json(self) -> dict[str, Any]:
        return {
            "area": self.area,
            "subject": self.subject,
            "change": self.change,
            "old": self.old,
            "new": self.new,
            "widens": self.widens,
            "text": self.text,
        }


@dataclass(frozen=True)
class ArtifactDiff:
    old: Artifact
    new: Artifact
    files: tuple[FileChange, ...]
    capabilities: tuple[CapabilityChange, ...]

    @property
    def widens(self) -> bool:
        return any(c.widens for c in self.capabilities)

    @property
    def same_capabilities(self) -> bool:
        return self.old.capabilities_hash == self.new.capabilities_hash

    def to_json(self) -> dict[str, Any]:
        return {
            "old": self.old.digest,
            "new": self.new.digest,
            "same_capabilities": self.same_capabilities,
            "widens": self.widens,
            "capabilities": [c.to_json() for c in self.capabilities],
            "files": [f.to_json() for f in self.files],
        }


def file_changes(
    a_files: list[ArtifactFile],
    b_files: list[ArtifactFile],
    read: Callable[[ArtifactFile], bytes],
) -> tuple[FileChange, ...]:
    """The files added, removed or modified from ``a_files`` to ``b_files``, by path;
    ``read`` gives a file's verified content."""
    a_by_path = {f.path: f for f in a_files}
    b_by_path = {f.path: f for f in b_files}
    changes: list[FileChange] = []
    for path in sorted(a_by_path.keys() | b_by_path.keys()):
        fa, fb = a_by_path.get(path), b_by_path.get(path)
        if fa == fb:
            continue
        change = "added" if fa is None else "removed" if fb is None else "modified"
        changes.append(_file_change(path, change, fa, fb, read))
    return tuple(changes)


def _file_change(
    path: str,
    change: str,
    fa: ArtifactFile | None,
    fb: ArtifactFile | None,
    read: Callable[[ArtifactFile], bytes],
) -> FileChange:
    if (fa is not None and fa.link is not None) or (fb is not None and fb.link is not None):
        return FileChange(path, change, fa, fb)
    if fa is not None and fb is not None and fa.sha256 == fb.sha256:
        return FileChange(path, change, fa, fb)  # mode only
    if any(f is not None and f.size > MAX_TEXT_DIFF_BYTES for f in (fa, fb)):
        return FileChange(path, change, fa, fb)
    old = read(fa) if fa is not None else b""
    new = read(fb) if fb is not None else b""
    old_text, new_text = _text(old), _text(new)
    if old_text is None or new_text is None:
        return FileChange(path, change, fa, fb, binary=True)
    lines = difflib.unified_diff(
        old_text.splitlines(keepends=True),
        new_text.splitlines(keepends=True),
        fromfile="/dev/null" if fa is None else f"a/{path}",
        tofile="/dev/null" if fb is None else f"b/{path}",
    )
    return FileChange(path, change, fa, fb, diff="".join(_terminated(lines)))


def _text(data: bytes) -> str | None:
    if b"\x00" in data[:8192]:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def _terminated(lines: Iterator[str]) -> Iterator[str]:
    for line in lines:
        if line.endswith("\n"):
            yield line
        else:
            yield line + "\n\\ No newline at end of file\n"


# -- capability review -------------------------------------------------------

_GRANTS = {"read": {"read"}, "write": {"write"}, "read-write": {"read", "write"}}


# What adds one change: area, subject, old, new, whether it widens, the words.
_Add = Callable[[str, str, Any, Any, bool, str], None]


def manifest_changes(a: Manifest, b: Manifest) -> list[CapabilityChange]:
    """The manifest lines that differ, each marked whether it lets the code do more,
    and said in words ("adds egress to api.example.com:443")."""
    out: list[CapabilityChange] = []

    def add(area: str, subject: str, old: Any, new: Any, widens: bool, text: str) -> None:
        change = "added" if old is None else "removed" if new is None else "changed"
        out.append(CapabilityChange(area, subject, change, _show(old), _show(new), widens, text))

    _job_changes(a, b, add)
    _dataset_changes(a.capabilities["datasets"], b.capabilities["datasets"], add)
    for area, key, noun in (("egress", "egress", "egress to"), ("secret", "secrets", "secret")):
        sa, sb = set(a.capabilities[key]), set(b.capabilities[key])
        for item in sorted(sb - sa):
            add(area, item, None, item, True, f"adds {noun} {item}")
        for item in sorted(sa - sb):
            add(area, item, item, None, False, f"drops {noun} {item}")
    _rule_changes(a.capabilities.get("egress_rules", {}),
                  b.capabilities.get("egress_rules", {}), add)  # fmt: skip
    _bucket_changes(a.capabilities["buckets"], b.capabilities["buckets"], add)
    _ask_changes(a.capabilities.get("ask") or {}, b.capabilities.get("ask") or {}, add)
    _limit_changes(a.limits.to_json(), b.limits.to_json(), add)
    _lifecycle_changes(a.lifecycle.to_json(), b.lifecycle.to_json(), add)
    return out


def _ask_changes(a: dict[str, Any], b: dict[str, Any], add: _Add) -> None:
    """Calls that ask a person (``ask``): no longer asking lets the code act without
    one (widens); asking more only holds it back."""
    for key, noun in (("egress", "calls to"), ("buckets", "writes to bucket"),
                      ("tables", "writes to table")):  # fmt: skip
        sa, sb = set(a.get(key, ())), set(b.get(key, ()))
        for item in sorted(sb - sa):
            add("ask", item, None, item, False, f"asks a person before {noun} {item}")
        for item in sorted(sa - sb):
            add("ask", item, item, None, True, f"no longer asks a person before {noun} {item}")
    ta, tb = a.get("timeout_seconds"), b.get("timeout_seconds")
    if ta is not None and tb is not None and ta != tb:
        add("ask", "timeout", ta, tb, False, f"changes the ask timeout from {ta} s to {tb} s")


def _rule_changes(a: dict[str, Any], b: dict[str, Any], add: _Add) -> None:
    """An egress host's request rules: dropping or changing them may let the code do
    more (marked as widening); adding them only narrows what it may do."""
    for entry in sorted(set(a) | set(b)):
        old, new = a.get(entry), b.get(entry)
        if old == new:
            continue
        subject = f"rules of {entry}"
        if new is None:
            add("egress", subject, old, None, True, f"drops the request rules of {entry}")
        elif old is None:
            add("egress", subject, None, new, False, f"adds request rules to {entry}: "
                + rule_words(new))  # fmt: skip
        else:
            add("egress", subject, old, new, True, f"changes the request rules of {entry} to "
                + rule_words(new))  # fmt: skip


def rule_words(rule: dict[str, Any]) -> str:
    """One host's request rules, in words."""
    parts = []
    if "methods" in rule:
        parts.append("methods " + ", ".join(rule["methods"]))
    if "paths" in rule:
        parts.append("paths " + ", ".join(rule["paths"]))
    for key, words in (("request_bytes", "request bodies up to {} bytes"),
                       ("response_bytes", "response bodies up to {} bytes"),
                       ("run_request_bytes", "{} request body bytes per run"),
                       ("run_response_bytes", "{} response body bytes per run")):  # fmt: skip
        if key in rule:
            parts.append(words.format(rule[key]))
    if rule.get("body_digests"):
        parts.append("bodies recorded as digests")
    return "; ".join(parts)


def _job_changes(a: Manifest, b: Manifest, add: _Add) -> None:
    if a.name != b.name:
        add("name", "name", a.name, b.name, False, f"renames the job from {a.name} to {b.name}")
    if a.purpose != b.purpose:
        # A new purpose is new processing, whatever the code: review it as such.
        add(
            "purpose",
            "purpose",
            a.purpose,
            b.purpose,
            True,
            f"changes the purpose from {a.purpose!r} to {b.purpose!r}",
        )
    if a.entrypoint != b.entrypoint:
        add(
            "entrypoint",
            "entrypoint",
            list(a.entrypoint),
            list(b.entrypoint),
            False,
            f"changes the entrypoint from {' '.join(a.entrypoint)} to {' '.join(b.entrypoint)}",
        )


def _dataset_changes(da: dict[str, Any], db: dict[str, Any], add: _Add) -> None:
    for ds in sorted(da.keys() | db.keys()):
        ta = da.get(ds, {}).get("tables", {})
        tb = db.get(ds, {}).get("tables", {})
        if ds not in da:
            add("dataset", ds, None, ds, True, f"adds dataset {ds}")
        elif ds not in db:
            add("dataset", ds, ds, None, False, f"drops dataset {ds}")
        for table in sorted(ta.keys() | tb.keys()):
            _table_changes(f"{ds}.{table}", ta.get(table), tb.get(table), add)


def _table_changes(subject: str, ga: Any, gb: Any, add: _Add) -> None:
    if ga is None:
        add(
            "table",
            subject,
            None,
            _grant(gb),
            True,
            f"adds {_ACCESS[gb['access']]} of {subject} ({', '.join(gb['columns'])})",
        )
        return
    if gb is None:
        add(
            "table",
            subject,
            _grant(ga),
            None,
            False,
            f"drops {_ACCESS[ga['access']]} of {subject} ({', '.join(ga['columns'])})",
        )
        return
    if ga["access"] != gb["access"]:
        widens = not _GRANTS[gb["access"]] <= _GRANTS[ga["access"]]
        add(
            "access",
            subject,
            ga["access"],
            gb["access"],
            widens,
            f"changes access to {subject} from {_ACCESS[ga['access']]} to {_ACCESS[gb['access']]}",
        )
    ca, cb = set(ga["columns"]), set(gb["columns"])
    for column in sorted(cb - ca):
        add(
            "column",
            f"{subject}.{column}",
            None,
            column,
            True,
            f"adds {_ACCESS[gb['access']]} of {subject}.{column}",
        )
    for column in sorted(ca - cb):
        add(
            "column",
            f"{subject}.{column}",
            column,
            None,
            False,
            f"drops {_ACCESS[ga['access']]} of {subject}.{column}",
        )


def _bucket_changes(ba: dict[str, Any], bb: dict[str, Any], add: _Add) -> None:
    for name in sorted(ba.keys() | bb.keys()):
        old: Any = ba.get(name)
        new: Any = bb.get(name)
        if old == new:
            continue
        widens = new is not None and (old is None or not _GRANTS[new] <= _GRANTS[old])
        if old is None:
            text = f"adds {_ACCESS[new]} of bucket {name}"
        elif new is None:
            text = f"drops {_ACCESS[old]} of bucket {name}"
        else:
            text = f"changes access to bucket {name} from {_ACCESS[old]} to {_ACCESS[new]}"
        add("bucket", name, old, new, widens, text)


def _limit_changes(la: dict[str, Any], lb: dict[str, Any], add: _Add) -> None:
    for key in sorted(la.keys() | lb.keys()):
        old_l, new_l = la.get(key), lb.get(key)
        if old_l != new_l:
            # An unset limit is the runtime's default, which the manifest cannot compare.
            widens = old_l is not None and new_l is not None and new_l > old_l
            if old_l is None:
                text = f"sets the {key} limit to {new_l} (was the runtime's default)"
            elif new_l is None:
                text = f"drops the {key} limit of {old_l} (the runtime's default applies)"
            else:
                verb = "raises" if new_l > old_l else "lowers"
                text = f"{verb} the {key} limit from {old_l} to {new_l}"
            add("limit", key, old_l, new_l, widens, text)


def _lifecycle_changes(ya: dict[str, Any], yb: dict[str, Any], add: _Add) -> None:
    for key in sorted(ya.keys() | yb.keys()):
        if ya.get(key) != yb.get(key):
            widens = key == "mode" and ya.get(key) == "job"
            if ya.get(key) is None:
                text = f"sets the lifecycle {key} to {yb.get(key)}"
            elif yb.get(key) is None:
                text = f"drops the lifecycle {key} {ya.get(key)}"
            else:
                text = f"changes the lifecycle {key} from {ya.get(key)} to {yb.get(key)}"
            add("lifecycle", key, ya.get(key), yb.get(key), widens, text)


#: What an access grants, in words.
_ACCESS = {"read": "read", "write": "write", "read-write": "read and write"}


def capability_words(capabilities: dict[str, Any]) -> list[str]:
    """What the code may do outside its sandbox, one sentence each, for an approver."""
    lines: list[str] = []
    for ds, spec in sorted(capabilities["datasets"].items()):
        for table, grant in sorted(spec["tables"].items()):
            lines.append(
                f"{_ACCESS[grant['access']]} of {ds}.{table}"
                f" (columns {', '.join(grant['columns'])})"
            )
    lines += [f"egress to {host}" for host in capabilities["egress"]]
    lines += [f"requests to {entry} only as its rules allow: {rule_words(rule)}"
              for entry, rule in sorted(capabilities.get("egress_rules", {}).items())]  # fmt: skip
    lines += [f"the secret {name} injected into its calls" for name in capabilities["secrets"]]
    lines += [f"{_ACCESS[access]} of bucket {name}"
              for name, access in sorted(capabilities["buckets"].items())]  # fmt: skip
    ask = capabilities.get("ask") or {}
    for key, noun in (("egress", "each call to"), ("buckets", "each write to bucket"),
                      ("tables", "each write to table")):  # fmt: skip
        lines += [f"{noun} {item} waits for a person's answer (at most"
                  f" {ask['timeout_seconds']} s)" for item in ask.get(key, ())]  # fmt: skip
    return lines or ["nothing: the code can reach nothing outside its sandbox"]


def _grant(grant: dict[str, Any]) -> str:
    return f"{grant['access']}: {', '.join(grant['columns'])}"


def _show(value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, str):
        return value
    return json.dumps(value)
