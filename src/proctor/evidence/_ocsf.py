"""Ledger events as OCSF 1.8.0 events, for SIEMs, beside the native ones.

The mapping is a pure function of the event bytes, so a verifier regenerates it
and compares: the OCSF file cannot say something the signed log does not.

1.8.0 is the newest released OCSF version (1.9.0, with its ``record_integrity``
profile, is unreleased). Each line is valid against the official schema with
the profiles it declares in ``metadata.profiles`` (tests/ocsf_validate.py):

- ``sql.*`` and ``file.*``: Datastore Activity (6005) with ``database`` /
  ``table`` or ``databucket``;
- ``http.request``: HTTP Activity (4002), activity by method;
- ``http.request.end``: HTTP Activity, with ``http_response``, when it records a
  status; else (a tunnel's bytes, a connection that ended before any response)
  Network Activity (4001), Close; both with the traffic;
- everything else (secrets, control-plane actions): API Activity (6003).

The decision is in ``action`` / ``disposition`` (the ``security_control``
profile), how the action ended in ``status``, the deciding policies in ``policy``
(the first) and ``authorizations`` (all); the run is ``metadata.correlation_uid``;
a workload's deployment and artifact are ``actor.app_name`` / ``actor.app_uid``
(another actor's are ``resources`` of an API Activity). What has no home in the
schema goes to ``unmapped`` (docs/evidence.md lists it).

A line says only what its event records: no policy an event does not cite (an
allowed control-plane event cites none: it names none, not the default deny), no
address in a ``hostname`` field, no source endpoint made up, no status the event
does not hold (docs/evidence.md, per attribute, says what each is set from).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from datetime import datetime, timedelta
from functools import lru_cache
from ipaddress import ip_address
from typing import Any

from proctor import __version__
from proctor.ledger import Action

OCSF_VERSION = "1.8.0"
_HTTP_ACTIVITY = {
    "CONNECT": (1, "Connect"),
    "DELETE": (2, "Delete"),
    "GET": (3, "Get"),
    "HEAD": (4, "Head"),
    "OPTIONS": (5, "Options"),
    "POST": (6, "Post"),
    "PUT": (7, "Put"),
    "TRACE": (8, "Trace"),
    "PATCH": (9, "Patch"),
}
# Proctor's actor types as OCSF user types (the user object's type_id enum).
_USER_TYPE = {
    "user": (1, "User"),
    "operator": (2, "Admin"),
    "runtime": (3, "System"),
    "service": (4, "Service"),
    "agent": (4, "Service"),
    "workload": (4, "Service"),
}
_CATEGORY = {4: "Network Activity", 6: "Application Activity"}
# The profiles every line declares: ``security_control`` for the decision and the
# policies, ``host`` for ``actor``. HTTP and Network Activity take ``actor`` only
# from ``host``; API and Datastore Activity define it themselves, but a compiler
# of the schema's sources (ocsf-lib's) marks it ``host`` there too, so declaring
# it keeps the line valid by either reading.
_PROFILES = ["host", "security_control"]
_EVENT_KEYS = frozenset(
    {"v", "seq", "time", "tenant", "actor", "action", "resource", "decision", "policies"}
    | {"reason", "deployment", "run", "artifact", "approvals", "details"}
)
# Keys keep the mapping's order (deterministic, so a verifier regenerates the same
# bytes): sorting them cost a third of the encoding.
_encode = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode


_PRODUCT = _encode(
    {"name": "Proctor", "vendor_name": "Proctor", "uid": "proctor", "version": __version__}
)


_EPOCH = datetime(1970, 1, 1)
_MS = timedelta(milliseconds=1)


def _epoch_ms(time: str) -> int:
    # The string is UTC (fixed width, "Z"); fromisoformat is C and ~10x strptime.
    return (datetime.fromisoformat(time[:-1]) - _EPOCH) // _MS


def _api_activity(action: str) -> tuple[int, str]:
    verb = action.rsplit(".", 1)[-1]
    if verb in (
        "create",
        "submit",
        "register",
        "grant",
        "add",
        "set",
        "start",
        "allow",
        "init",
        "write",
        "issue",
    ):
        return 1, "Create"
    if verb in ("read", "export", "show", "list", "use", "key"):
        return 2, "Read"
    if verb in ("rollback", "unfreeze", "enable", "disable", "restart", "manage", "policy"):
        return 3, "Update"
    if verb in ("revoke", "remove", "stop", "delete", "reject", "end", "freeze"):
        return 4, "Delete"
    return 99, "Other"


def _int(value: Any) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return int(value)


def _str(value: Any) -> str | None:
    return value if isinstance(value, str) and value else None


def _put(obj: dict[str, Any], key: str, value: Any) -> None:
    if value is not None:
        obj[key] = value


def _policy(uid: str, version: str | None, desc: str | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"uid": uid, "name": uid, "is_applied": True}
    _put(out, "version", version)
    _put(out, "desc", desc)
    return out


@lru_cache(maxsize=1024)
def _is_ip(text: str) -> bool:
    # Cached: a run's calls name the same few hosts, and a failed parse raises.
    try:
        ip_address(text.removeprefix("[").removesuffix("]"))
    except ValueError:
        return False
    return True


def _endpoint(host: str | None, port: int | None, address: str | None) -> dict[str, Any]:
    """A network endpoint: a name in ``hostname``, an address in ``ip``, never the
    one in the other's field (an IP literal the guest wrote is its address)."""
    out: dict[str, Any] = {}
    if host is not None and _is_ip(host):
        address = address or host.removeprefix("[").removesuffix("]")
        host = None
    _put(out, "hostname", host)
    _put(out, "port", port)
    if address is not None and _is_ip(address):
        out["ip"] = address
    return out


def _seen(where: str, endpoint: dict[str, Any]) -> list[dict[str, Any]]:
    """The observables of an endpoint, typed as what each value is."""
    out = []
    if "hostname" in endpoint:
        out.append(
            {
                "name": f"{where}.hostname",
                "type_id": 1,
                "type": "Hostname",
                "value": endpoint["hostname"],
            }
        )
    if "ip" in endpoint:
        out.append(
            {"name": f"{where}.ip", "type_id": 2, "type": "IP Address", "value": endpoint["ip"]}
        )
    return out


# The ids of the runtime's own actors that name the host they act on
# (``supervisor:<host>:<pid>:<start>``, ``sweeper:...``) and of the local operator
# (``local-operator:<user>@<host>``, the OS user of the process that acted).
_RUNTIME_ON_HOST = re.compile(r"^(?:supervisor|sweeper):(.+):\d+:[^:]*$")


def _source(
    actor_type: str, actor_id: str, run: str | None, deployment: str | None
) -> dict[str, Any] | None:
    """Where the action came from, as far as the event tells: None when it does not."""
    if actor_type == "workload":
        # A workload calls from its run's sandbox, one per run.
        src: dict[str, Any] = {"uid": run or actor_id, "name": f"sandbox of run {run}"}
        _put(src, "svc_name", deployment)
        return src
    host = None
    if actor_type == "operator" and actor_id.startswith("local-operator:") and "@" in actor_id:
        host = actor_id.rsplit("@", 1)[1]
    elif actor_type == "runtime":
        match = _RUNTIME_ON_HOST.match(actor_id)
        host = match.group(1) if match else None
    if host:
        # The process that acted ran on that host: that is the source.
        src = _endpoint(host, None, None)
        if actor_type == "runtime":
            src["svc_name"] = "proctor"
        return src
    if actor_type == "runtime":
        return {"name": actor_id, "svc_name": "proctor"}
    return None


@lru_cache(maxsize=256)
def _who(
    actor_type: str, actor_id: str, run: str | None, deployment: str | None, artifact: str | None
) -> tuple[str, str | None, str, str]:
    """``actor``, ``src_endpoint`` (None when the event does not say where the
    action came from), the actor's observables, and the ``src_endpoint`` that
    API and Datastore Activity, which require one, take instead of None; all
    encoded: a run's events share them, and a verifier regenerates every line."""
    type_id, type_name = _USER_TYPE.get(actor_type, (99, "Other"))
    user: dict[str, Any] = {"uid": actor_id, "name": actor_id, "type_id": type_id}
    user["type"] = actor_type if type_id == 99 else type_name
    actor: dict[str, Any] = {"user": user}
    if actor_type == "workload":
        _put(actor, "app_name", deployment)
        _put(actor, "app_uid", artifact)
    src = _source(actor_type, actor_id, run, deployment)
    seen = [
        {"name": "actor.user.uid", "type_id": 31, "type": "User Object: uid", "value": actor_id}
    ]
    if src is not None:
        seen += _seen("src_endpoint", src)
    # A principal's address is not in the event. The source is then what is known
    # of it, the principal's client, its kind unknown; no address or id is made up.
    unknown = {"name": f"client of {actor_id}", "type_id": 0, "type": "Unknown"}
    return (
        _encode(actor),
        _encode(src) if src is not None else None,
        _encode(seen)[1:-1],
        _encode(unknown),
    )


# What a denial that cites no policy says when Cedar's default deny decided it
# (``Decision.why``; the control plane's ``no role of <principal> permits it``, the
# API's ``no role of <principal> permits <action>``).
_DEFAULT_DENY = re.compile(r"no policy permits it|no role of .+ permits ")


def _version(
    policy: str, version: str | None, control_version: str | None, run_start: bool
) -> str | None:
    """The version of the Cedar set ``policy`` belongs to, as far as the event says."""
    if policy.startswith("proctor:"):
        return None  # a rule of Proctor's own (the broker's, the API's), not Cedar
    if policy.startswith("control:"):
        # An allowed run.start's policy_version is the run's set, not the role policy.
        return control_version or (None if run_start else version)
    return version


@lru_cache(maxsize=256)
def _decided(
    allowed: bool,
    policies: tuple[str, ...],
    version: str | None,
    control_version: str | None,
    basis: str,
    run_start: bool,
) -> str:
    """The decision's attributes (security_control profile), encoded.

    ``basis``: ``default`` for Cedar's default deny, ``failed`` when the cited
    policies failed to evaluate, ``""`` otherwise. An event that cites no policy
    and was not Cedar's default deny (a control-plane action the event does not
    say how it was authorized, a run's end, a refusal of the broker's own or the
    supervisor's) names none: the reason in ``message`` says what decided."""
    decision = "allow" if allowed else "deny"
    out: dict[str, Any] = {
        "severity_id": 1 if allowed else 3,
        "severity": "Informational" if allowed else "Medium",
        "action_id": 1 if allowed else 2,
        "action": "Allowed" if allowed else "Denied",
        "disposition_id": 1 if allowed else 2,
        "disposition": "Allowed" if allowed else "Blocked",
        # A refused call is what a security team wants raised; an allowed one is not.
        "is_alert": not allowed,
    }
    desc = "its evaluation failed" if basis == "failed" else None
    cited = [_policy(p, _version(p, version, control_version, run_start), desc) for p in policies]
    if not policies and basis == "default":
        # Cedar denies what no policy permits: the set (its version) permitted nothing.
        cited = [_policy("default-deny", version, "no policy permits it")]
    if cited:
        out["policy"] = cited[0]
        out["authorizations"] = [{"decision": decision, "policy": p} for p in cited]
    return _encode(out)[1:-1]


def _outcome(action: str, allowed: bool, details: dict[str, Any]) -> tuple[int, str, str | None]:
    """``status_id``, ``status`` and ``status_detail``: how the action ended, which
    for an allowed one the event may record apart from the decision."""
    if not allowed:
        return 2, "Failure", None
    if action == Action.RUN_END:
        return _run_ended(_str(details.get("status")))
    failure = None
    if action.startswith("sql."):
        failure = _str(details.get("outcome"))
        if failure == "ok":
            failure = None
    elif action == Action.HTTP_REQUEST_END:
        failure = _str(details.get("error"))
    return (1, "Success", None) if failure is None else (2, "Failure", failure)


def _run_ended(ended: str | None) -> tuple[int, str, str | None]:
    if ended is None or ended == "succeeded":
        return 1, "Success", None
    if ended == "stopped":
        return 99, "Stopped", ended  # asked to stop: neither a success nor a failure
    return 2, "Failure", ended


# The actions whose ``details.status`` is an HTTP status (run.end's is the run's).
_HTTP_STATUS_IN = frozenset({Action.HTTP_REQUEST, Action.HTTP_REQUEST_END, Action.BROKER_REQUEST})
# The details key each action's outcome is read from (_outcome).
_OUTCOME_KEY: dict[str, str] = {Action.RUN_END: "status", Action.HTTP_REQUEST_END: "error"}


def to_ocsf(ev: dict[str, Any], origin: str) -> dict[str, Any]:
    """The OCSF event for one parsed ledger event."""
    return dict(json.loads(ocsf_line(ev, origin)))


def _url(
    scheme: str | None, host: str | None, port: int | None, path: str | None
) -> dict[str, Any]:
    authority = f"[{host}]" if host and ":" in host else host
    target = f"{authority}:{port}" if authority and port is not None else authority
    url: dict[str, Any] = {
        "url_string": f"{scheme}://{target}{path or ''}" if scheme else str(target)
    }
    if host and not _is_ip(host):
        url["hostname"] = host  # an address is in the url_string and dst_endpoint.ip
    _put(url, "port", port)
    _put(url, "scheme", scheme)
    _put(url, "path", path)
    return url


def _api_request(
    out: dict[str, Any],
    details: dict[str, Any],
    mapped: set[str],
    observables: list[dict[str, Any]],
) -> str | None:
    """What the API records of a request it decided: the control-plane action asked
    for, the request's id, its HTTP method and path, and the client's address (the
    encoded ``src_endpoint``, or None without one)."""
    asked = _str(details.get("action"))
    if asked:
        out["api"]["operation"] = asked
        mapped.add("action")
    request_id = _str(details.get("request_id"))
    if request_id:
        out["api"]["request"] = {"uid": request_id}
        mapped.add("request_id")
    request: dict[str, Any] = {}
    method = str(details.get("method") or "").upper()
    if method in _HTTP_ACTIVITY:
        request["http_method"] = method
        mapped.add("method")
    path = _str(details.get("path"))
    if path:
        request["url"] = {"path": path}
        mapped.add("path")
    if request:
        out["http_request"] = request
    client = _str(details.get("source"))
    if client is None or not _is_ip(client):
        return None
    mapped.add("source")
    src = {"ip": client}
    observables += _seen("src_endpoint", src)
    return _encode(src)


class _Draft:
    """One line being built: what every mapper reads (the event's parts) and fills
    (``out`` in its key order, the details keys it ``mapped``, ``observables``, and
    ``src``, the encoded source endpoint, which an API request may name)."""

    __slots__ = (
        "action",
        "artifact",
        "code",
        "deployment",
        "details",
        "mapped",
        "observables",
        "out",
        "resource",
        "src",
        "workload",
    )

    def __init__(
        self,
        action: str,
        resource: str,
        details: dict[str, Any],
        out: dict[str, Any],
        src: str | None,
    ) -> None:
        self.action = action
        self.resource = resource
        self.details = details
        self.out = out
        self.src = src
        # Details keys that land in a standard attribute; the rest go to ``unmapped``.
        self.mapped: set[str] = {"policy_version", "control_policy_version"}
        self.observables: list[dict[str, Any]] = []
        self.code: int | None = None
        self.workload = False
        self.deployment: str | None = None
        self.artifact: str | None = None


# What a mapper answers: class_uid, class_name, activity_id, activity_name.
_Class = tuple[int, str, int, str]


def _sql_activity(d: _Draft) -> _Class:
    details, out = d.details, d.out
    activity, name = (4, "Query") if d.action == Action.SQL_SELECT else (5, "Write")
    out["type_id"], out["type"] = 1, "Database"
    out["database"] = {
        "name": str(details.get("dataset") or d.resource.removeprefix("dataset/")),
        "type_id": 1,
        "type": "Relational",
    }
    d.mapped.add("dataset")
    tables = details.get("tables")
    if isinstance(tables, list) and tables and isinstance(tables[0], dict):
        table = _str(tables[0].get("table"))
        if table:
            out["table"] = {"name": table}
    return 6005, "Datastore Activity", activity, name


def _file_activity(d: _Draft) -> _Class:
    details, out = d.details, d.out
    activity, name = (1, "Read") if d.action == Action.FILE_READ else (5, "Write")
    out["type_id"], out["type"] = 2, "Databucket"
    bucket = _str(details.get("bucket"))
    out["databucket"] = {
        "name": bucket or d.resource,
        "type_id": 99,
        "type": "Proctor bucket",
    }
    d.mapped.add("bucket")
    key = _str(details.get("key"))
    if key:
        file: dict[str, Any] = {"name": key.rsplit("/", 1)[-1], "path": key, "type_id": 1}
        file["type"] = "Regular File"
        _put(file, "size", _int(details.get("bytes")))
        digest = _str(details.get("sha256"))
        if digest:
            file["hashes"] = [{"algorithm_id": 3, "algorithm": "SHA-256", "value": digest}]
        out["databucket"]["file"] = file
        d.mapped.update(("key", "bytes", "sha256"))
    return 6005, "Datastore Activity", activity, name


def _http_request(d: _Draft) -> _Class:
    details, out, mapped = d.details, d.out, d.mapped
    method = str(details.get("method") or "").upper()
    activity, name = _HTTP_ACTIVITY.get(method, (99, "Other"))
    host = _str(details.get("host"))
    port = _int(details.get("port"))
    _put(out, "dst_endpoint", _endpoint(host, port, _str(details.get("address"))) or None)
    mapped.update(("host", "port"))
    request: dict[str, Any] = {}
    if activity != 99:
        request["http_method"] = method
        mapped.add("method")
    if host:
        path = _str(details.get("path"))
        request["url"] = _url(_str(details.get("scheme")), host, port, path)
        mapped.update(("scheme", "path"))
    if not request:
        # The class needs an http_request or http_response; a refused request
        # with neither a known method nor a host still has its raw target.
        request["url"] = {"url_string": str(details.get("target") or d.resource)}
        mapped.add("target")
    out["http_request"] = request
    if d.code is not None:
        # A request refused inside a tunnel: the status Proctor answered it with.
        out["http_response"] = {"code": d.code}
        mapped.add("status")
    return 4002, "HTTP Activity", activity, name


def _http_request_end(d: _Draft) -> _Class:
    details, out, mapped = d.details, d.out, d.mapped
    host = _str(details.get("host"))
    port = _int(details.get("port"))
    out["dst_endpoint"] = _endpoint(host, port, _str(details.get("address"))) or {
        "name": d.resource
    }
    up, down = _int(details.get("bytes_up")) or 0, _int(details.get("bytes_down")) or 0
    out["traffic"] = {"bytes_out": up, "bytes_in": down, "bytes": up + down}
    _put(out, "duration", _int(details.get("duration_ms")))
    # duration is whole ms: the exact figure stays in unmapped.
    mapped.update(("host", "port", "bytes_up", "bytes_down"))
    code = d.code
    if code is None:
        code = _int(details.get("answered"))
        if code is not None:
            mapped.add("answered")
    if code is None:
        # Bytes through a tunnel, or a connection that ended before any response.
        return 4001, "Network Activity", 2, "Close"
    # An HTTP exchange that ended with a response: HTTP Activity, its response's
    # status (the last one's, when a tunnel carried several).
    response: dict[str, Any] = {"code": code}
    if "status" in details and _int(details.get("requests")) == 1 and "error" not in details:
        response["length"] = down  # all of the one response, as relayed
    out["http_response"] = response
    mapped.add("status")
    return 4002, "HTTP Activity", 99, "Close"  # the request's method is in its decision's event


def _api_activity_line(d: _Draft) -> _Class:
    out, resource, deployment, artifact = d.out, d.resource, d.deployment, d.artifact
    out["api"] = {"operation": d.action, "service": {"name": "proctor"}}
    resources = [{"uid": resource, "type": resource.split("/", 1)[0]}]
    if not d.workload:
        if deployment and resource != f"deployment/{deployment}":
            resources.append({"uid": f"deployment/{deployment}", "type": "deployment"})
        if artifact and resource != f"artifact/{artifact}":
            resources.append({"uid": artifact, "type": "artifact"})
    out["resources"] = resources
    for i, r in enumerate(resources):
        d.observables.append(
            {
                "name": f"resources[{i}].uid",
                "type_id": 10,
                "type": "Resource UID",
                "value": r["uid"],
            }
        )
    if d.code is not None:
        # A broker request refused: the status the broker answered it with.
        out["http_response"] = {"code": d.code}
        d.mapped.add("status")
    if d.action == Action.API_REQUEST:
        d.src = _api_request(out, d.details, d.mapped, d.observables) or d.src
    return 6003, "API Activity", *_api_activity(d.action)


# The mapper of each action: by its name, then by its prefix; any other action is
# API Activity.
_BY_ACTION: dict[str, Callable[[_Draft], tuple[int, str, int, str]]] = {
    Action.HTTP_REQUEST: _http_request,
    Action.HTTP_REQUEST_END: _http_request_end,
}
_BY_PREFIX = (("sql.", _sql_activity), ("file.", _file_activity))


def _mapper(action: str) -> Callable[[_Draft], _Class]:
    mapper = _BY_ACTION.get(action)
    if mapper is not None:
        return mapper
    for prefix, by_prefix in _BY_PREFIX:
        if action.startswith(prefix):
            return by_prefix
    return _api_activity_line


def _metadata(ev: dict[str, Any], action: str, seq: int, origin: str, time_ms: int) -> Any:
    metadata: dict[str, Any] = {
        "version": OCSF_VERSION,
        "uid": f"{ev['tenant']}:{seq}",
        "sequence": seq,
        "event_code": action,
        "log_name": origin,
        "log_provider": "Proctor ledger",
        "tenant_uid": str(ev["tenant"]),
        "original_time": str(ev["time"]),
        "logged_time": time_ms,
    }
    _put(metadata, "correlation_uid", _str(ev.get("run")))
    return metadata


def _decision(ev: dict[str, Any], action: str, allowed: bool, details: dict[str, Any]) -> str:
    """The encoded decision attributes of the event (``_decided``)."""
    policies = tuple(str(p) for p in ev.get("policies") or ())
    reason = str(ev.get("reason") or "")
    basis = ""
    if not allowed and not policies and _DEFAULT_DENY.search(reason):
        basis = "default"
    elif not allowed and "policy evaluation failed" in reason:
        basis = "failed"
    return _decided(
        allowed,
        policies,
        _str(details.get("policy_version")),
        _str(details.get("control_policy_version")),
        basis,
        allowed and action == Action.RUN_START,
    )


def _unmapped(
    ev: dict[str, Any], d: _Draft, class_uid: int, status_detail: str | None
) -> dict[str, Any]:
    """What has no home in the schema: top-level fields this mapping does not know
    (a marker's ``pruned``), another actor's deployment and artifact outside API
    Activity, the approvals, and the details keys no attribute took."""
    unmapped: dict[str, Any] = {k: v for k, v in ev.items() if k not in _EVENT_KEYS}
    if not d.workload and class_uid != 6003:
        _put(unmapped, "deployment", d.deployment)
        _put(unmapped, "artifact", d.artifact)
    if status_detail is not None:
        d.mapped.add(_OUTCOME_KEY.get(d.action, "outcome"))
    dst = d.out.get("dst_endpoint") or {}
    if dst.get("ip") == d.details.get("address"):
        d.mapped.add("address")  # else kept in unmapped: it is not an address
    d.observables += _seen("dst_endpoint", dst)
    approvals = ev.get("approvals") or []
    if approvals:
        unmapped["approvals"] = approvals
    rest = {k: v for k, v in d.details.items() if k not in d.mapped}
    if rest:
        unmapped["details"] = rest
    return unmapped


def ocsf_line(ev: dict[str, Any], origin: str) -> bytes:
    """The OCSF event for one parsed ledger event, as the pack's line: the parts
    every class shares, then the class's own from its action's mapper."""
    action = str(ev["action"])
    seq = int(ev["seq"])
    raw_details = ev.get("details")
    details: dict[str, Any] = raw_details if isinstance(raw_details, dict) else {}
    allowed = ev.get("decision", "allow") == "allow"
    time_ms = _epoch_ms(ev["time"])
    metadata = _metadata(ev, action, seq, origin, time_ms)
    who = ev.get("actor") or {"type": "runtime", "id": "proctor"}
    actor_type, actor_id = str(who["type"]), str(who["id"])
    deployment, artifact = _str(ev.get("deployment")), _str(ev.get("artifact"))
    actor, src, seen, unknown_src = _who(
        actor_type, actor_id, _str(ev.get("run")), deployment, artifact
    )
    decided = _decision(ev, action, allowed, details)
    status_id, status, status_detail = _outcome(action, allowed, details)
    reason = str(ev.get("reason") or "")
    out: dict[str, Any] = {
        "time": time_ms,
        "timezone_offset": 0,
        "message": reason or action,
        "status_id": status_id,
        "status": status,
    }
    _put(out, "status_detail", status_detail)

    # A pruned entry's marker (docs/ledger.md) has no actor, resource or decision.
    d = _Draft(action, str(ev.get("resource") or f"event/{seq}"), details, out, src)
    d.workload = actor_type == "workload"
    d.deployment, d.artifact = deployment, artifact
    # A recorded HTTP status: the upstream's (a completion) or the one Proctor
    # answered (a refusal); a completion without the upstream's, Proctor's own answer.
    d.code = _int(details.get("status")) if action in _HTTP_STATUS_IN else None
    class_uid, class_name, activity, name = _mapper(action)(d)

    unmapped = _unmapped(ev, d, class_uid, status_detail)
    if unmapped:
        out["unmapped"] = unmapped
    metadata["profiles"] = _PROFILES
    category = class_uid // 1000
    out.update(
        class_uid=class_uid,
        class_name=class_name,
        category_uid=category,
        category_name=_CATEGORY[category],
        activity_id=activity,
        activity_name=name,
        type_uid=class_uid * 100 + activity,
        # The type's caption is the schema's, "Other" for 99 whatever the activity's name.
        type_name=f"{class_name}: {name if activity != 99 else 'Other'}",
    )
    src = d.src
    if src is None and class_uid in (6003, 6005):
        src = unknown_src  # these classes require a source endpoint
    source = f'"src_endpoint":{src},' if src is not None else ""
    # The shared parts are spliced in encoded; members' order means nothing in JSON.
    observables = d.observables
    seen_all = seen + "," + _encode(observables)[1:-1] if observables else seen
    return (
        f'{{{decided},{_encode(out)[1:-1]},"metadata":{_encode(metadata)[:-1]},'
        f'"product":{_PRODUCT}}},"actor":{actor},{source}'
        f'"observables":[{seen_all}]}}'
    ).encode()
