"""The least-privilege manifest a run's calls called for (``proctor manifest suggest``).

A run's decision events say exactly what its code asked for: every SQL statement's
tables and columns (as its engine reported them, the columns a plan reads through
included), every host and port, every bucket read or written, every secret the
broker injected. From them, and from the refusals the run met, this module builds
the manifest that would have allowed exactly those calls and nothing more:

- a capability is suggested only if a recorded call used it, or asked for it and
  was refused for want of it (Cedar's default deny: no permit), never because the
  submitted manifest had it; hosts are the exact hosts called (a wildcard is never
  needed to allow a call), columns the columns read or written;
- a refusal no manifest line can lift (a special-purpose address, a tenant's
  forbid, a secret's binding or its value echoed, a malformed call, a limit) is
  listed as not suggestable, with why;
- what the manifest says of the code rather than of its reach (name, entrypoint,
  purpose, limits, lifecycle), the request rules of a kept host and the ``[ask]`` marks
  of what is kept are kept as submitted: rules and asks only narrow; a host the
  suggestion adds gets request rules naming exactly the methods and paths its calls
  used, where every call to it was plain HTTP and every path a literal.

The output is TOML that :func:`parse_manifest` accepts (checked before it is
returned), a unified diff against the submitted manifest written the same way, and
for each added or removed line its reason and the seq of the event that needed it.
"""

from __future__ import annotations

import difflib
import ipaddress
import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from proctor.errors import PolicyError, ProctorError, UsageError
from proctor.governance._asks import ASK_RULE
from proctor.governance._environments import SANDBOX_EGRESS_FORBID_ID
from proctor.governance._home import Home
from proctor.governance._manifest import Manifest, egress_entry, parse_manifest
from proctor.governance._runs import RunRecord, Runs
from proctor.governance._subprocessors import FORBID_ID as SUBPROCESSOR_FORBID_ID
from proctor.ledger import Action, EventFilter, iter_events
from proctor.policy import DATA_PLANE_ACTIONS, EgressRule

#: The reason of a submitted line no call used.
UNUSED = "no call of this run used it"
#: Marks an asked call a person's answer (or its timeout) refused: the manifest let it
#: through to the ask, so it used its capability; taken as allowed for what it used.
_ASKED_REFUSED = "_asked_refused"

_SQL = (Action.SQL_SELECT, Action.SQL_WRITE)
_FILES = (Action.FILE_READ, Action.FILE_WRITE)
#: Forbids a manifest line cannot lift, but that refuse a host only until an admin
#: allows it for the environment: the line is still needed, and said to be not enough.
_ENVIRONMENT_FORBIDS = {
    SANDBOX_EGRESS_FORBID_ID: "an admin must also allow it for sandbox runs (egress.sandbox.allow)",
    SUBPROCESSOR_FORBID_ID: "a registered subprocessor must also cover it (subprocessor.add)",
}
_BARE_KEY = re.compile(r"^[A-Za-z0-9_-]+$")

Key = tuple[str, ...]


@dataclass(frozen=True)
class Line:
    """A line of the suggested manifest added, or of the submitted one removed."""

    line: str
    change: str  # "added" | "removed"
    where: str  # the TOML table the line is in
    reason: str
    seq: int | None

    def to_json(self) -> dict[str, Any]:
        return {"line": self.line, "change": self.change, "where": self.where,
                "reason": self.reason, "seq": self.seq}  # fmt: skip


@dataclass(frozen=True)
class Unsuggestable:
    """A refusal the run met that no manifest line can lift."""

    seq: int
    action: str
    resource: str
    reason: str  # the event's
    why: str  # why no line of a manifest would change it

    def to_json(self) -> dict[str, Any]:
        return {"seq": self.seq, "action": self.action, "resource": self.resource,
                "reason": self.reason, "why": self.why}  # fmt: skip


@dataclass(frozen=True)
class Suggestion:
    run: str
    tenant: str
    digest: str
    environment: str
    status: str
    #: The run is still running, or some of its events were pruned: a suggestion
    #: from the calls read so far.
    partial: bool
    manifest: str
    submitted: str
    diff: str
    lines: tuple[Line, ...]
    not_suggestable: tuple[Unsuggestable, ...]
    notes: tuple[str, ...] = ()
    events: int = 0

    def to_json(self) -> dict[str, Any]:
        return {
            "run": self.run,
            "tenant": self.tenant,
            "digest": self.digest,
            "environment": self.environment,
            "status": self.status,
            "partial": self.partial,
            "manifest": self.manifest,
            "diff": self.diff,
            "lines": [x.to_json() for x in self.lines],
            "not_suggestable": [x.to_json() for x in self.not_suggestable],
            "notes": list(self.notes),
            "events": self.events,
        }


# -- what the calls used ---------------------------------------------------------------


@dataclass
class _Need:
    reason: str
    seq: int


@dataclass
class _Table:
    read: bool = False
    write: bool = False
    columns: set[str] = field(default_factory=set)


@dataclass
class _Used:
    """Capabilities the run's calls used or were refused for want of, each with the
    first event that needed it."""

    tables: dict[tuple[str, str], _Table] = field(default_factory=dict)
    hosts: set[str] = field(default_factory=set)
    #: (method, path) of each call to a host (path None: a CONNECT, inside TLS).
    requests: dict[str, set[tuple[str, str | None]]] = field(default_factory=dict)
    secrets: set[str] = field(default_factory=set)
    buckets: dict[str, set[str]] = field(default_factory=dict)  # name -> {read, write}
    needs: dict[Key, _Need] = field(default_factory=dict)
    unsuggestable: list[Unsuggestable] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    pruned: int = 0

    def need(self, key: Key, reason: str, seq: int) -> None:
        if key not in self.needs:
            self.needs[key] = _Need(reason, seq)

    def refuse(self, ev: Mapping[str, Any], why: str) -> None:
        self.unsuggestable.append(
            Unsuggestable(
                int(ev["seq"]),
                str(ev.get("action")),
                str(ev.get("resource")),
                str(ev.get("reason", "")),
                why,
            )
        )


def _outcome(ev: Mapping[str, Any]) -> str:
    if ev.get(_ASKED_REFUSED):
        return f"asked, then {ev.get('reason', '')}"
    if ev.get("decision") == "allow":
        return "allowed"
    return f"refused: {ev.get('reason', '')}"


def _is_default_deny(ev: Mapping[str, Any]) -> bool:
    """Refused by Cedar for want of a permit: what a manifest line lifts."""
    return (
        ev.get("decision") == "deny"
        and not ev.get("policies")
        and not str(ev.get("reason", "")).startswith("refused:")
    )


def _sql(used: _Used, ev: Mapping[str, Any], manifest: Manifest) -> None:
    details = ev.get("details") or {}
    dataset = details.get("dataset")
    grants = details.get("tables") or []
    if details.get("tables_cut") or any(g.get("columns_cut") for g in grants):
        used.notes.append(
            f"seq {ev['seq']}: its event lists only some of the statement's tables or "
            "columns (cut to the event's budget); the tables it names keep their submitted "
            "columns"
        )
    if ev.get("decision") == "deny":
        forbidden = [g for g in grants if g.get("decision") == "deny" and g.get("policies")]
        if not grants or str(ev.get("reason", "")).startswith("refused:"):
            why = "the statement itself was refused, before any capability was asked"
            if "is bound to this run" in str(ev.get("reason", "")):
                why = (f"the dataset {dataset!r} is not bound to the run: add "
                       f"datasets.{dataset} with the tables the statement reads (it was not "
                       "analysed, so the run does not say which)")  # fmt: skip
            used.refuse(ev, why)
            return
        if forbidden:
            names = sorted({p for g in forbidden for p in g.get("policies", [])})
            used.refuse(ev, f"forbidden by {', '.join(names)}: a policy of the tenant or the "
                            "environment, which no manifest line lifts")  # fmt: skip
            return
    if not isinstance(dataset, str):
        return
    for g in grants:
        table, action = str(g.get("table")), g.get("action")
        columns = [str(c) for c in g.get("columns", []) if c]
        t = used.tables.setdefault((dataset, table), _Table())
        if g.get("columns_cut") or details.get("tables_cut"):
            t.columns.update(_submitted_columns(manifest, dataset, table))
        verb = "writes" if action == Action.SQL_WRITE else "reads"
        if action == Action.SQL_WRITE:
            t.write = True
        else:
            t.read = True
        where = f"{dataset}.{table}"
        outcome = _outcome(ev)
        used.need(("table", dataset, table), f"{action} of {where}: {outcome}", int(ev["seq"]))
        mode = "write" if action == Action.SQL_WRITE else "read"
        used.need(("access", dataset, table, mode),
                  f"{action} of {where} {verb} it: {outcome}", int(ev["seq"]))  # fmt: skip
        for c in columns:
            t.columns.add(c)
            why = f"{action} of {where} {verb} column {c}: {outcome}"
            used.need(("column", dataset, table, c), why, int(ev["seq"]))
        if not columns and not _submitted_columns(manifest, dataset, table):
            # count(*) names no column, and a grant lists at least one: which one is the
            # person's choice (any one allows it), not the run's to say.
            why = f"the statement names no column of {where}, and a table's grant lists"
            used.refuse(ev, why + " at least one: add the table with a column of your choice")


def _submitted_columns(manifest: Manifest, dataset: str, table: str) -> list[str]:
    grant = manifest.capabilities.get("datasets", {}).get(dataset, {}).get("tables", {})
    return list(grant.get(table, {}).get("columns", []))


def _entry(details: Mapping[str, Any]) -> str | None:
    host, port = details.get("host"), details.get("port")
    if not isinstance(host, str) or not isinstance(port, int) or isinstance(port, bool):
        return None
    shown = f"[{host}]" if ":" in host else host
    try:
        return egress_entry(f"{shown}:{port}", "egress.hosts")
    except UsageError:
        return None


def _covered(entry: str, manifest: Manifest) -> bool:
    return any(_under(entry, str(a)) for a in manifest.capabilities.get("egress", []))


def _special(host: str, allowed_ranges: Sequence[str]) -> str | None:
    """Why ``host`` (an IP literal) is an address no run reaches, or None."""
    try:
        address = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return None
    if address.is_global:
        return None
    for cidr in allowed_ranges:
        try:
            if address in ipaddress.ip_network(cidr, strict=False):
                return None
        except ValueError:
            continue
    kind = (
        "link-local (a cloud metadata service lives there)" if address.is_link_local
        else "loopback" if address.is_loopback
        else "private-use" if address.is_private
        else "special-purpose"
    )  # fmt: skip
    return (f"{host} is a {kind} address: the broker refuses it whatever a manifest says "
            "(unless an admin allows its range for the tenant)")  # fmt: skip


def _http(used: _Used, ev: Mapping[str, Any], manifest: Manifest, ranges: Sequence[str]) -> None:
    details = ev.get("details") or {}
    entry = _entry(details)
    seq = int(ev["seq"])
    policies = [str(p) for p in ev.get("policies") or []]
    extra = ""
    if ev.get("decision") == "deny":
        if entry is None:
            used.refuse(ev, "a malformed request: it names no host a manifest could list")
            return
        if details.get("special_ranges") or "proctor:egress:special-purpose-address" in policies:
            host = details.get("host")
            why = f"{host} is or resolves to a special-purpose address: the broker refuses it"
            used.refuse(ev, why + " whatever a manifest says")
            return
        if policies and all(p in _ENVIRONMENT_FORBIDS for p in policies):
            extra = "; " + "; ".join(_ENVIRONMENT_FORBIDS[p] for p in policies)
        elif not _is_default_deny(ev):
            if _covered(entry, manifest):
                # Refused for another reason (a broker rule): the code did ask for it.
                used.hosts.add(entry)
                used.need(("host", entry), f"http.request to {entry}: {_outcome(ev)}", seq)
            why = (f"forbidden by {', '.join(policies)}: a policy of the tenant or the broker's "
                   "own rule, which no manifest line lifts") if policies else (
                   "refused before any policy question: " + str(ev.get("reason", "")))  # fmt: skip
            used.refuse(ev, why)
            return
        special = _special(str(details.get("host")), ranges)
        if special is not None:
            used.refuse(ev, special)
            return
    if entry is None:
        return
    used.hosts.add(entry)
    used.need(("host", entry), f"http.request to {entry}: {_outcome(ev)}{extra}", seq)
    path = details.get("path") if details.get("tunnel_seq") is None else None
    used.requests.setdefault(entry, set()).add(
        (str(details.get("method")), path if isinstance(path, str) else None)
    )
    for item in details.get("inject") or []:
        name = item.get("secret") if isinstance(item, Mapping) else None
        if isinstance(name, str):
            used.secrets.add(name)
            used.need(("secret", name), f"injected into the request to {entry}: "
                      f"{_outcome(ev)}", seq)  # fmt: skip


def _file(used: _Used, ev: Mapping[str, Any], manifest: Manifest) -> None:
    details = ev.get("details") or {}
    bucket = details.get("bucket")
    mode = "write" if ev.get("action") == Action.FILE_WRITE else "read"
    if not isinstance(bucket, str):
        used.refuse(ev, "a malformed call: it names no bucket")
        return
    submitted = manifest.capabilities.get("buckets", {}).get(bucket)
    granted = submitted is not None and mode in str(submitted).split("-")
    if ev.get("decision") == "deny" and not _is_default_deny(ev):
        if str(ev.get("reason", "")).startswith("refused:") and granted:
            # Past the permit, refused acting (an object missing): the line was used.
            pass
        else:
            policies = ev.get("policies") or []
            why = (f"forbidden by {', '.join(policies)}: a policy of the tenant, which no "
                   "manifest line lifts") if policies else (
                   "refused before or after its policy question, not for want of a "
                   "permit: " + str(ev.get("reason", "")))  # fmt: skip
            used.refuse(ev, why)
            return
    used.buckets.setdefault(bucket, set()).add(mode)
    verb = "wrote" if mode == "write" else "read"
    key = details.get("key")
    used.need(("bucket", bucket, mode), f"{ev['action']} {verb} {bucket}/{key}: "
              f"{_outcome(ev)}", int(ev["seq"]))  # fmt: skip


def _the_runs(action: str) -> bool:
    """Whether a refusal under ``action`` is one the run met (a call, its start, the
    broker's bounds), not a person's refused request naming the run (an answer)."""
    return action in DATA_PLANE_ACTIONS or action.startswith(("broker.", "run."))


def collect(
    events: Iterable[Mapping[str, Any]], manifest: Manifest, allowed_ranges: Sequence[str] = ()
) -> _Used:
    """What the events of one run used (see the module's docstring)."""
    used = _Used()
    for event in events:
        ev = event
        if "pruned" in ev:
            used.pruned += 1
            continue
        action = ev.get("action")
        if ev.get("decision") == "deny" and ASK_RULE in (ev.get("policies") or []):
            used.refuse(ev, "an asked call a person denied, or left unanswered past ask.timeout:"
                            " the manifest let it be asked; the answer is a person's")  # fmt: skip
            ev = {**ev, "decision": "allow", _ASKED_REFUSED: True}
        if action in _SQL:
            _sql(used, ev, manifest)
        elif action in _FILES:
            _file(used, ev, manifest)
        elif action == Action.HTTP_REQUEST:
            _http(used, ev, manifest, allowed_ranges)
        elif ev.get("decision") == "deny" and _the_runs(str(action)):
            why = "not a capability a manifest grants"
            if action == Action.SECRET_USE:
                why = (
                    "a secret's placeholder sent where the secret is not bound, or its value "
                    "echoed back: the secret's registration decides where it goes"
                )
            elif action in (Action.BROKER_RATE_LIMITED, Action.BROKER_CALL_BOUND):
                why = "a limit of the run, not a capability: raise limits.* if the run needs more"
            used.refuse(ev, why)
    return used


# -- the suggested capabilities -----------------------------------------------------


def capabilities_of(used: _Used, manifest: Manifest) -> dict[str, Any]:
    """The capabilities that allow exactly what ``used`` holds."""
    datasets: dict[str, Any] = {}
    for (dataset, table), t in sorted(used.tables.items()):
        if not t.columns:
            # A statement that names no column (count(*)): a grant lists at least one,
            # and Cedar's containsAll([]) holds for any; the fewest submitted are kept.
            kept = sorted(_submitted_columns(manifest, dataset, table))[:1]
            if not kept:
                continue
            t.columns.update(kept)
        access = "read-write" if t.read and t.write else "write" if t.write else "read"
        tables = datasets.setdefault(dataset, {"tables": {}})["tables"]
        tables[table] = {"columns": sorted(t.columns), "access": access}
    hosts = sorted(used.hosts)
    out: dict[str, Any] = {
        "datasets": datasets,
        "egress": hosts,
        "secrets": sorted(used.secrets),
        "buckets": {
            b: "read-write" if len(modes) == 2 else next(iter(modes))
            for b, modes in sorted(used.buckets.items())
        },
    }
    rules = manifest.capabilities.get("egress_rules") or {}
    kept_rules = {h: r for h, r in rules.items() if h in hosts}
    submitted = set(manifest.capabilities.get("egress", []))
    for host in hosts:
        if host not in submitted and (rule := _rules_of(host, used.requests.get(host, set()))):
            kept_rules[host] = rule
    if kept_rules:
        out["egress_rules"] = kept_rules
    ask = _kept_ask(manifest.capabilities.get("ask") or {}, out)
    if ask:
        out["ask"] = ask
    return out


#: The most paths a suggested request rule lists; past it the host gets none (the calls
#: name ids in their paths, and a person writes the pattern).
_MAX_RULE_PATHS = 16
_LITERAL_PATH = re.compile(r"^/[!$&'()+,\-./0-9:;=@A-Z_a-z~]{0,500}$")


def _rules_of(host: str, requests: set[tuple[str, str | None]]) -> dict[str, Any] | None:
    """Request rules for a host the suggestion adds, allowing exactly the methods and
    paths its calls used, where every call was plain HTTP (method and path known) and
    every path a literal pattern (no ``*``: a pattern would allow more); else None."""
    if not requests or len(requests) > _MAX_RULE_PATHS:
        return None
    if any(path is None or not _LITERAL_PATH.match(path) for _, path in requests):
        return None
    doc = {"methods": sorted({m for m, _ in requests}),
           "paths": sorted({str(p) for _, p in requests})}  # fmt: skip
    try:
        return EgressRule.from_json(host, doc).to_json()
    except PolicyError:
        return None


def _kept_ask(ask: Mapping[str, Any], caps: Mapping[str, Any]) -> dict[str, Any]:
    """The submitted ``[ask]`` over what is kept: a capability whose every use waits for a
    person stays so (dropping it would widen), a host narrowed from an asked wildcard
    is asked as the wildcard was."""
    out: dict[str, Any] = {}
    hosts = [h for h in caps["egress"] if any(_under(h, a) for a in ask.get("egress", []))]
    if hosts:
        out["egress"] = sorted(hosts)
    buckets = [b for b in ask.get("buckets", []) if "write" in caps["buckets"].get(b, "")]
    if buckets:
        out["buckets"] = sorted(buckets)
    tables = []
    for dotted in ask.get("tables", []):
        dataset, _, table = str(dotted).partition(".")
        grant = caps["datasets"].get(dataset, {}).get("tables", {}).get(table)
        if grant is not None and "write" in grant["access"]:
            tables.append(dotted)
    if tables:
        out["tables"] = sorted(tables)
    if out and "timeout_seconds" in ask:
        out["timeout_seconds"] = ask["timeout_seconds"]
    return out


def _under(entry: str, allowed: str) -> bool:
    """Whether egress entry ``allowed`` (exact or ``*.domain:port``) covers ``entry``."""
    host, _, port = entry.rpartition(":")
    a_host, _, a_port = str(allowed).rpartition(":")
    return a_port == port and (
        a_host == host or (a_host.startswith("*.") and host.endswith(a_host[1:]))
    )


# -- TOML, one capability a line ------------------------------------------------------


def _str(value: str) -> str:
    out = ['"']
    for ch in value:
        if ch in '"\\':
            out.append("\\" + ch)
        elif ch == "\n":
            out.append("\\n")
        elif ch == "\t":
            out.append("\\t")
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    out.append('"')
    return "".join(out)


def _key(name: str) -> str:
    return name if _BARE_KEY.match(name) else _str(name)


def _value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return _str(value)
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_value(v) for v in value) + "]"
    raise ProctorError(f"cannot write {type(value).__name__} as TOML")


_LIMIT_KEYS = (("memory_bytes", "memory"), ("wall_seconds", "timeout"), ("pids", "pids"),
               ("cpu", "cpu"), ("output_bytes", "output"),
               ("calls_per_second", "calls_per_second"), ("call_burst", "call_burst"),
               ("calls", "calls"))  # fmt: skip


_Lines = list[tuple[str, Key, str]]
_FIXED: Key = ("fixed",)


def render(manifest: Manifest, capabilities: Mapping[str, Any]) -> _Lines:
    """``manifest`` with ``capabilities`` as TOML lines: (text, the capability the line
    belongs to, the table it is in); one column, host, secret or bucket a line, so a
    diff shows each capability added or removed on its own."""
    lines: _Lines = [
        ("[artifact]", _FIXED, "artifact"),
        (f"name = {_str(manifest.name)}", _FIXED, "artifact"),
        (f"entrypoint = {_value(list(manifest.entrypoint))}", _FIXED, "artifact"),
        (f"purpose = {_str(manifest.purpose)}", _FIXED, "artifact"),
    ]
    _datasets(lines, capabilities.get("datasets", {}))
    _listed(lines, "egress", "hosts", "host", list(capabilities.get("egress", [])))
    for host, rule in sorted((capabilities.get("egress_rules") or {}).items()):
        where = f"egress.rules.{_str(host)}"
        rkey: Key = ("rules", host)
        lines += [("", rkey, where), (f"[{where}]", rkey, where)]
        lines += [(f"{name} = {_value(value)}", rkey, where) for name, value in rule.items()]
    _listed(lines, "secrets", "names", "secret", list(capabilities.get("secrets", [])))
    buckets = capabilities.get("buckets", {})
    if buckets:
        bkey: Key = ("section", "buckets")
        lines += [("", bkey, "buckets"), ("[buckets]", bkey, "buckets")]
        for name, access in sorted(buckets.items()):
            lines.append((f"{_key(name)} = {_str(access)}", ("bucket", name, access), "buckets"))
    _ask(lines, capabilities.get("ask") or {})
    _code(lines, manifest)
    return lines


def _ask(lines: _Lines, ask: Mapping[str, Any]) -> None:
    if not ask:
        return
    key: Key = ("section", "ask")
    lines += [("", key, "ask"), ("[ask]", key, "ask")]
    for kind in ("egress", "buckets", "tables"):
        if ask.get(kind):
            lines.append((f"{kind} = [", key, "ask"))
            lines += [(f"  {_str(i)},", ("ask", kind, i), "ask") for i in ask[kind]]
            lines.append(("]", key, "ask"))
    if "timeout_seconds" in ask:
        lines.append((f"timeout = {_value(ask['timeout_seconds'])}", ("ask-timeout",), "ask"))


def _datasets(lines: _Lines, datasets: Mapping[str, Any]) -> None:
    for dataset, spec in sorted(datasets.items()):
        for table, grant in sorted(spec.get("tables", {}).items()):
            where = f"datasets.{_key(dataset)}.tables.{_key(table)}"
            tkey: Key = ("table", dataset, table)
            access = str(grant.get("access", "read"))
            lines += [
                ("", tkey, where),
                (f"[{where}]", tkey, where),
                (f"access = {_str(access)}", ("access", dataset, table, access), where),
                ("columns = [", tkey, where),
            ]
            for column in grant["columns"]:
                lines.append((f"  {_str(column)},", ("column", dataset, table, column), where))
            lines.append(("]", tkey, where))


def _listed(lines: _Lines, section: str, name: str, kind: str, items: list[str]) -> None:
    if not items:
        return
    key: Key = ("section", section)
    lines += [("", key, section), (f"[{section}]", key, section), (f"{name} = [", key, section)]
    lines += [(f"  {_str(item)},", (kind, item), section) for item in items]
    lines.append(("]", key, section))


def _code(lines: _Lines, manifest: Manifest) -> None:
    """What the manifest says of the code rather than of its reach: kept as submitted."""
    limits = manifest.limits.to_json()
    if limits:
        lines += [("", _FIXED, "limits"), ("[limits]", _FIXED, "limits")]
        for attr, name in _LIMIT_KEYS:
            if attr in limits:
                lines.append((f"{name} = {_value(limits[attr])}", _FIXED, "limits"))
    life = manifest.lifecycle
    lines += [
        ("", _FIXED, "lifecycle"),
        ("[lifecycle]", _FIXED, "lifecycle"),
        (f"mode = {_str(life.mode)}", _FIXED, "lifecycle"),
    ]
    if life.every_seconds is not None:
        every = _value(life.to_json()["every_seconds"])
        lines.append((f"every = {every}", _FIXED, "lifecycle"))
    if life.restart is not None:
        lines.append((f"restart = {_str(life.restart)}", _FIXED, "lifecycle"))


def _text(lines: Sequence[tuple[str, Key, str]]) -> str:
    return "\n".join(text for text, _, _ in lines) + "\n"


_PUNCTUATION = frozenset(
    {"]", "columns = [", "hosts = [", "names = [", "egress = [", "buckets = [", "tables = ["}
)


def _modes(access: str) -> tuple[str, ...]:
    return ("read", "write") if access == "read-write" else (access,)


def _needed(key: Key, used: _Used, had: str | None = None) -> _Need | None:
    """The first event that needed the line of ``key`` (an access line: of the access
    the submitted line, ``had``, did not give, where there is one)."""
    if key[0] in ("access", "bucket"):
        subject, access = key[1:-1], str(key[-1])
        modes = [m for m in _modes(access) if had is None or m not in _modes(had)]
        modes = modes or list(_modes(access))  # narrowed: what the kept access is for
        found = [used.needs[k] for m in modes if (k := (key[0], *subject, m)) in used.needs]
        return min(found, key=lambda n: n.seq) if found else None
    if key[0] == "section":
        kind = {"egress": "host", "secrets": "secret", "buckets": "bucket"}.get(key[1])
        found = [n for k, n in used.needs.items() if k[0] == kind]
        return min(found, key=lambda n: n.seq) if found else None
    if key[0] == "rules":
        return used.needs.get(("host", key[1]))
    if key[0] == "ask":
        need = used.needs.get(_asked_key(str(key[1]), str(key[2])))
        why = "every use waits for a person, as the submitted [ask] says; "
        return None if need is None else _Need(why + need.reason, need.seq)
    return used.needs.get(key)


def _asked_key(kind: str, item: str) -> Key:
    """The capability an ``[ask]`` entry is of."""
    if kind == "egress":
        return ("host", item)
    if kind == "buckets":
        return ("bucket", item, "write")
    dataset, _, table = item.partition(".")
    return ("access", dataset, table, "write")


def _removed_reason(key: Key, used: _Used, suggested: set[Key]) -> str:
    if key[0] in ("access", "bucket"):
        now = [str(k[-1]) for k in suggested if k[0] == key[0] and k[1:-1] == key[1:-1]]
        if now:
            dropped = [m for m in _modes(str(key[-1])) if m not in _modes(now[0])]
            what = ".".join(str(k) for k in key[1:-1])
            what = f"bucket {what}" if key[0] == "bucket" else what
            return f"no call of this run needed {' or '.join(dropped)} access to {what}"
    if key[0] == "host" and str(key[1]).startswith("*."):
        under = sorted(h for h in used.hosts if h.endswith(str(key[1])[1:]))
        if under:
            return "narrowed to the hosts the calls used: " + ", ".join(under)
    return UNUSED


def _changes(
    old: Sequence[tuple[str, Key, str]], new: Sequence[tuple[str, Key, str]], used: _Used
) -> list[Line]:
    before = {(text, key) for text, key, _ in old}
    after = {(text, key) for text, key, _ in new}
    suggested = {key for _, key, _ in new}
    previous = {key[:-1]: str(key[-1]) for _, key, _ in old if key[0] in ("access", "bucket")}
    out: list[Line] = []
    for text, key, where in old:
        if (text, key) in after or not text.strip() or text in _PUNCTUATION:
            continue
        out.append(Line(text, "removed", where, _removed_reason(key, used, suggested), None))
    for text, key, where in new:
        if (text, key) in before or not text.strip() or text in _PUNCTUATION:
            continue
        had = previous.get(key[:-1]) if key[0] in ("access", "bucket") else None
        need = _needed(key, used, had)
        reason, seq = (need.reason, need.seq) if need else ("needed by the lines below it", None)
        out.append(Line(text, "added", where, reason, seq))
    return out


# -- the whole suggestion ------------------------------------------------------------


def suggest(
    run: RunRecord,
    manifest: Manifest,
    events: Iterable[Mapping[str, Any]],
    *,
    allowed_ranges: Sequence[str] = (),
) -> Suggestion:
    """The least-privilege manifest ``run``'s ``events`` (its own, oldest first) call for,
    against ``manifest`` (its artifact's)."""
    seen = list(events)
    used = collect(seen, manifest, allowed_ranges)
    capabilities = capabilities_of(used, manifest)
    old = render(manifest, manifest.capabilities)
    new = render(manifest, capabilities)
    text = _text(new)
    try:
        parse_manifest(text)
    except UsageError as exc:
        # Fail closed: a suggestion that could not be submitted is no suggestion.
        raise ProctorError(
            f"the manifest suggested for run {run.id} does not parse: {exc.message}",
            hint="the run's calls may need more than one manifest can ask for; "
            "see `proctor runs show` for its calls",
        ) from exc
    submitted = _text(old)
    diff = "".join(
        difflib.unified_diff(
            submitted.splitlines(keepends=True), text.splitlines(keepends=True),
            "a/proctor.toml (submitted)", "b/proctor.toml (suggested)",
        )
    )  # fmt: skip
    notes = list(dict.fromkeys(used.notes))
    running = run.status == "running"
    if running:
        notes.append("the run is still running: the suggestion covers its calls so far")
    if used.pruned:
        notes.append(f"{used.pruned} of the run's events were pruned (retention): "
                     "their calls are not in the suggestion")  # fmt: skip
    return Suggestion(
        run=run.id, tenant=run.tenant, digest=run.digest, environment=run.environment,
        status=run.status, partial=running or used.pruned > 0, manifest=text,
        submitted=submitted, diff=diff, lines=tuple(_changes(old, new, used)),
        not_suggestable=tuple(used.unsuggestable), notes=tuple(notes), events=len(seen),
    )  # fmt: skip


def run_events(home: Home, run: RunRecord) -> Iterable[dict[str, Any]]:
    """``run``'s events, oldest first (read from a minute before it started)."""
    started = datetime.fromisoformat(run.started_at.replace("Z", "+00:00"))
    since = (started - timedelta(minutes=1)).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    for data in iter_events(home.ledger, run.tenant, EventFilter(run=run.id, since=since)):
        yield json.loads(data)


def suggest_manifest(home: Home, tenant: str, run_id: str) -> Suggestion:
    """The suggestion for ``tenant``'s run ``run_id`` (any unique prefix). Deciding
    whether the caller may read the run's events is the caller's (``run.events.read``)."""
    run = Runs(home.store).get(tenant, run_id)
    return suggest_for(home, run)


def suggest_for(home: Home, run: RunRecord) -> Suggestion:
    """The suggestion for ``run``, already looked up (and its read decided)."""
    artifact = home.artifacts.get(run.tenant, run.digest)
    return suggest(run, artifact.manifest, run_events(home, run),
                   allowed_ranges=home.egress.get(run.tenant))  # fmt: skip
