"""Ledger events as OCSF 1.8.0 events, for SIEMs, beside the native ones.

The mapping is a pure function of the event bytes, so a verifier regenerates it
and compares: the OCSF file cannot say something the signed log does not.

1.8.0 is the newest released OCSF version (1.9.0, with its ``record_integrity``
profile, is unreleased). Each line is valid against the official schema with
the profiles it declares in ``metadata.profiles`` (tests/ocsf_validate.py):

- ``sql.*`` and ``file.*``: Datastore Activity (6005) with ``database`` /
  ``table`` or ``databucket``;
- ``http.request``: HTTP Activity (4002), activity by method;
- ``http.request.end``: Network Activity (4001), Close, with the traffic;
- everything else (secrets, control-plane actions): API Activity (6003).

The decision is in ``action`` / ``disposition`` / ``status`` (the
``security_control`` profile), the deciding policies in ``policy`` (the first)
and ``authorizations`` (all); the run is ``metadata.correlation_uid``; a
workload's deployment and artifact are ``actor.app_name`` / ``actor.app_uid``
(another actor's are ``resources`` of an API Activity). What has no home in the
schema goes to ``unmapped`` (docs/evidence.md lists it).
"""

from __future__ import annotations

import json
from datetime import datetime, timedelta
from functools import lru_cache
from typing import Any

from proctor import __version__

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


def _dst(host: str | None, port: int | None, address: str | None) -> dict[str, Any] | None:
    out: dict[str, Any] = {}
    _put(out, "hostname", host)
    _put(out, "port", port)
    _put(out, "ip", address)
    return out or None


@lru_cache(maxsize=256)
def _who(
    actor_type: str, actor_id: str, run: str | None, deployment: str | None, artifact: str | None
) -> tuple[str, str, str]:
    """``actor``, ``src_endpoint`` and the actor's observable, encoded: a run's
    events share them, and a verifier regenerates every line of a pack."""
    type_id, type_name = _USER_TYPE.get(actor_type, (99, "Other"))
    user: dict[str, Any] = {"uid": actor_id, "name": actor_id, "type_id": type_id}
    user["type"] = actor_type if type_id == 99 else type_name
    actor: dict[str, Any] = {"user": user}
    if actor_type == "workload":
        _put(actor, "app_name", deployment)
        _put(actor, "app_uid", artifact)
        # A workload calls from its run's sandbox: that is the source endpoint.
        src: dict[str, Any] = {"uid": run or actor_id, "name": f"sandbox of run {run}"}
        _put(src, "svc_name", deployment)
    else:
        # A principal's address is not recorded in the event; saying so beats
        # passing an identity off as a network endpoint.
        src = {"name": "not recorded"}
    seen = {"name": "actor.user.uid", "type_id": 31, "type": "User Object: uid", "value": actor_id}
    return _encode(actor), _encode(src), _encode(seen)


@lru_cache(maxsize=256)
def _decided(allowed: bool, policies: tuple[str, ...], version: str | None) -> str:
    """The decision's attributes (security_control profile), encoded."""
    decision = "allow" if allowed else "deny"
    if policies:
        authorizations = [{"decision": decision, "policy": _policy(p, version)} for p in policies]
        policy = _policy(policies[0], version)
    else:
        policy = _policy("default-deny", None, "no policy permits it")
        authorizations = [{"decision": decision, "policy": policy}]
    out: dict[str, Any] = {
        "severity_id": 1 if allowed else 3,
        "severity": "Informational" if allowed else "Medium",
        "status_id": 1 if allowed else 2,
        "status": "Success" if allowed else "Failure",
        "action_id": 1 if allowed else 2,
        "action": "Allowed" if allowed else "Denied",
        "disposition_id": 1 if allowed else 2,
        "disposition": "Allowed" if allowed else "Blocked",
        # A refused call is what a security team wants raised; an allowed one is not.
        "is_alert": not allowed,
        "policy": policy,
        "authorizations": authorizations,
    }
    return _encode(out)[1:-1]


def to_ocsf(ev: dict[str, Any], origin: str) -> dict[str, Any]:
    """The OCSF event for one parsed ledger event."""
    return dict(json.loads(ocsf_line(ev, origin)))


def ocsf_line(ev: dict[str, Any], origin: str) -> bytes:
    """The OCSF event for one parsed ledger event, as the pack's line."""
    action = str(ev["action"])
    seq = int(ev["seq"])
    # A pruned entry's marker (docs/ledger.md) has no actor, resource or decision.
    resource = str(ev.get("resource") or f"event/{seq}")
    raw_details = ev.get("details")
    details: dict[str, Any] = raw_details if isinstance(raw_details, dict) else {}
    # Details keys that land in a standard attribute; the rest go to ``unmapped``.
    mapped: set[str] = {"policy_version"}
    allowed = ev.get("decision", "allow") == "allow"
    time_ms = _epoch_ms(ev["time"])
    run = _str(ev.get("run"))
    deployment = _str(ev.get("deployment"))
    artifact = _str(ev.get("artifact"))
    who = ev.get("actor") or {"type": "runtime", "id": "proctor"}
    actor_type, actor_id = str(who["type"]), str(who["id"])
    workload = actor_type == "workload"
    # Top-level fields this mapping does not know (a marker's ``pruned``) are kept.
    unmapped: dict[str, Any] = {k: v for k, v in ev.items() if k not in _EVENT_KEYS}

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
    _put(metadata, "correlation_uid", run)

    actor, src, seen = _who(actor_type, actor_id, run, deployment, artifact)
    observables: list[dict[str, Any]] = []
    policies = tuple(str(p) for p in ev.get("policies") or ())
    decided = _decided(allowed, policies, _str(details.get("policy_version")))

    out: dict[str, Any] = {
        "time": time_ms,
        "timezone_offset": 0,
        "message": str(ev.get("reason") or action),
    }

    if action.startswith(("sql.", "file.")):
        class_uid, class_name = 6005, "Datastore Activity"
        if action.startswith("sql."):
            activity, name = (4, "Query") if action == "sql.select" else (5, "Write")
            out["type_id"], out["type"] = 1, "Database"
            out["database"] = {
                "name": str(details.get("dataset") or resource.removeprefix("dataset/")),
                "type_id": 1,
                "type": "Relational",
            }
            mapped.add("dataset")
            tables = details.get("tables")
            if isinstance(tables, list) and tables and isinstance(tables[0], dict):
                table = _str(tables[0].get("table"))
                if table:
                    out["table"] = {"name": table}
        else:
            activity, name = (1, "Read") if action == "file.read" else (5, "Write")
            out["type_id"], out["type"] = 2, "Databucket"
            bucket = _str(details.get("bucket"))
            out["databucket"] = {
                "name": bucket or resource,
                "type_id": 99,
                "type": "Proctor bucket",
            }
            mapped.add("bucket")
            key = _str(details.get("key"))
            if key:
                file: dict[str, Any] = {"name": key.rsplit("/", 1)[-1], "path": key, "type_id": 1}
                file["type"] = "Regular File"
                _put(file, "size", _int(details.get("bytes")))
                digest = _str(details.get("sha256"))
                if digest:
                    file["hashes"] = [{"algorithm_id": 3, "algorithm": "SHA-256", "value": digest}]
                out["databucket"]["file"] = file
                mapped.update(("key", "bytes", "sha256"))
    elif action == "http.request":
        class_uid, class_name = 4002, "HTTP Activity"
        method = str(details.get("method") or "").upper()
        activity, name = _HTTP_ACTIVITY.get(method, (99, "Other"))
        host = _str(details.get("host"))
        port = _int(details.get("port"))
        scheme = _str(details.get("scheme"))
        path = _str(details.get("path"))
        _put(out, "dst_endpoint", _dst(host, port, _str(details.get("address"))))
        mapped.update(("host", "port", "address"))
        request: dict[str, Any] = {}
        if activity != 99:
            request["http_method"] = method
            mapped.add("method")
        target = f"{host}:{port}" if host and port is not None else host
        if target:
            url: dict[str, Any] = {
                "url_string": f"{scheme}://{target}{path or ''}" if scheme else target
            }
            _put(url, "hostname", host)
            _put(url, "port", port)
            _put(url, "scheme", scheme)
            _put(url, "path", path)
            request["url"] = url
            mapped.update(("scheme", "path"))
        if not request:
            # The class needs an http_request or http_response; a refused request
            # with neither a known method nor a host still has its raw target.
            request["url"] = {"url_string": str(details.get("target") or resource)}
            mapped.add("target")
        out["http_request"] = request
    elif action == "http.request.end":
        class_uid, class_name = 4001, "Network Activity"
        activity, name = 2, "Close"
        host = _str(details.get("host"))
        out["dst_endpoint"] = _dst(
            host, _int(details.get("port")), _str(details.get("address"))
        ) or {"name": resource}
        up, down = _int(details.get("bytes_up")) or 0, _int(details.get("bytes_down")) or 0
        out["traffic"] = {"bytes_out": up, "bytes_in": down, "bytes": up + down}
        _put(out, "duration", _int(details.get("duration_ms")))
        # duration is whole ms: the exact figure stays in unmapped.
        mapped.update(("host", "port", "address", "bytes_up", "bytes_down"))
    else:
        class_uid, class_name = 6003, "API Activity"
        activity, name = _api_activity(action)
        out["api"] = {"operation": action, "service": {"name": "proctor"}}
        resources = [{"uid": resource, "type": resource.split("/", 1)[0]}]
        if not workload:
            if deployment and resource != f"deployment/{deployment}":
                resources.append({"uid": f"deployment/{deployment}", "type": "deployment"})
            if artifact and resource != f"artifact/{artifact}":
                resources.append({"uid": artifact, "type": "artifact"})
        out["resources"] = resources
        for i, r in enumerate(resources):
            observables.append(
                {
                    "name": f"resources[{i}].uid",
                    "type_id": 10,
                    "type": "Resource UID",
                    "value": r["uid"],
                }
            )
    if not workload and class_uid != 6003:
        _put(unmapped, "deployment", deployment)
        _put(unmapped, "artifact", artifact)

    dst = out.get("dst_endpoint") or {}
    if "hostname" in dst:
        observables.append(
            {
                "name": "dst_endpoint.hostname",
                "type_id": 1,
                "type": "Hostname",
                "value": dst["hostname"],
            }
        )
    if "ip" in dst:
        observables.append(
            {"name": "dst_endpoint.ip", "type_id": 2, "type": "IP Address", "value": dst["ip"]}
        )

    approvals = ev.get("approvals") or []
    if approvals:
        unmapped["approvals"] = approvals
    rest = {k: v for k, v in details.items() if k not in mapped}
    if rest:
        unmapped["details"] = rest
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
        type_name=f"{class_name}: {name}",
    )
    # The shared parts are spliced in encoded; members' order means nothing in JSON.
    seen_all = seen + "," + _encode(observables)[1:-1] if observables else seen
    return (
        f'{{{decided},{_encode(out)[1:-1]},"metadata":{_encode(metadata)[:-1]},'
        f'"product":{_PRODUCT}}},"actor":{actor},"src_endpoint":{src},'
        f'"observables":[{seen_all}]}}'
    ).encode()
