"""Ledger events as OCSF 1.1 events, for SIEMs, beside the native ones.

The mapping is a pure function of the event bytes, so a verifier regenerates it
and compares: the OCSF file cannot say something the signed log does not.

- ``sql.select`` / ``sql.write``: Datastore Activity (6005), Read / Write;
- ``http.request``: HTTP Activity (4002), activity by method;
- ``http.request.end``: Network Activity (4001), Close;
- everything else (files, control actions): API Activity (6003).

The decision is in ``action_id`` (1 Allowed, 2 Denied), the deciding policies
in ``policy`` (the first in ``policy.uid``, all of them in ``policy.desc``), and
Proctor's own fields (seq, run, deployment, artifact, approvals) in ``unmapped``.
"""

from __future__ import annotations

import json
from datetime import datetime, timedelta
from typing import Any

OCSF_VERSION = "1.1.0"
_HTTP_ACTIVITY = {
    "CONNECT": 1,
    "DELETE": 2,
    "GET": 3,
    "HEAD": 4,
    "OPTIONS": 5,
    "POST": 6,
    "PUT": 7,
    "TRACE": 8,
}
_encode = json.JSONEncoder(ensure_ascii=False, sort_keys=True, separators=(",", ":")).encode


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
    ):
        return 1, "Create"
    if verb in ("read", "export", "show", "list"):
        return 2, "Read"
    if verb in ("revoke", "remove", "stop", "delete", "reject", "end", "freeze"):
        return 4, "Delete"
    return 99, "Other"


def _endpoint(ev: dict[str, Any]) -> dict[str, Any]:
    actor = ev["actor"]
    return {"uid": actor["id"], "name": actor["type"]}


def to_ocsf(ev: dict[str, Any], origin: str) -> dict[str, Any]:
    """The OCSF event for one parsed ledger event."""
    action = ev["action"]
    details = ev.get("details") or {}
    allowed = ev["decision"] == "allow"
    out: dict[str, Any] = {
        "time": _epoch_ms(ev["time"]),
        "severity_id": 1 if allowed else 3,
        "severity": "Informational" if allowed else "Medium",
        "status_id": 1 if allowed else 2,
        "status": "Success" if allowed else "Failure",
        "action_id": 1 if allowed else 2,
        "action": "Allowed" if allowed else "Denied",
        "disposition_id": 1 if allowed else 2,
        "message": ev["reason"],
        "metadata": {
            "version": OCSF_VERSION,
            "uid": f"{ev['tenant']}:{ev['seq']}",
            "log_name": origin,
            "original_time": ev["time"],
            "product": {"name": "Proctor", "vendor_name": "Proctor"},
        },
        "actor": {"user": {"uid": ev["actor"]["id"], "type": ev["actor"]["type"]}},
        "src_endpoint": _endpoint(ev),
        "unmapped": {
            "seq": ev["seq"],
            "tenant": ev["tenant"],
            "proctor_action": action,
            "resource": ev["resource"],
            "run": ev.get("run"),
            "deployment": ev.get("deployment"),
            "artifact": ev.get("artifact"),
            "approvals": ev.get("approvals", []),
        },
    }
    policies = ev.get("policies") or []
    out["policy"] = {
        "uid": policies[0] if policies else "default-deny",
        "name": policies[0] if policies else "default-deny",
        "desc": ", ".join(policies) if policies else "no policy permits it",
        "version": str(details.get("policy_version", "")),
    }
    if action in ("sql.select", "sql.write"):
        activity, name = (1, "Read") if action == "sql.select" else (5, "Write")
        class_uid, class_name = 6005, "Datastore Activity"
        tables = details.get("tables") or []
        out["database"] = {"name": str(details.get("dataset", "")), "type_id": 99, "type": "SQLite"}
        if tables:
            out["table"] = {"name": str(tables[0].get("table", ""))}
        out["query_info"] = {"uid": str(details.get("sql_hmac", "")), "data": _encode(tables)}
    elif action == "http.request":
        method = str(details.get("method", "")).upper()
        activity = _HTTP_ACTIVITY.get(method, 99)
        name = method.title() if activity != 99 else "Other"
        class_uid, class_name = 4002, "HTTP Activity"
        host = str(details.get("host", ev["resource"].removeprefix("host/")))
        out["dst_endpoint"] = {"hostname": host, "port": int(details.get("port") or 0)}
        if details.get("address"):
            out["dst_endpoint"]["ip"] = str(details["address"])
        out["http_request"] = {
            "http_method": method,
            "url": {
                "hostname": host,
                "path": str(details.get("path", "")),
                "scheme": str(details.get("scheme", "")),
                "port": int(details.get("port") or 0),
            },
        }
    elif action == "http.request.end":
        activity, name = 2, "Close"
        class_uid, class_name = 4001, "Network Activity"
        out["dst_endpoint"] = {
            "hostname": str(details.get("host", "")),
            "port": int(details.get("port") or 0),
        }
        out["traffic"] = {
            "bytes_out": int(details.get("bytes_up") or 0),
            "bytes_in": int(details.get("bytes_down") or 0),
        }
    else:
        activity, name = _api_activity(action)
        class_uid, class_name = 6003, "API Activity"
        out["api"] = {"operation": action, "service": {"name": "proctor"}}
        out["resources"] = [{"uid": ev["resource"], "type": ev["resource"].split("/", 1)[0]}]
    category = class_uid // 1000
    out.update(
        class_uid=class_uid,
        class_name=class_name,
        category_uid=category,
        category_name={
            3: "Identity & Access Management",
            4: "Network Activity",
            6: "Application Activity",
        }[category],
        activity_id=activity,
        activity_name=name,
        type_uid=class_uid * 100 + activity,
    )
    return out


def ocsf_line(ev: dict[str, Any], origin: str) -> bytes:
    return _encode(to_ocsf(ev, origin)).encode("utf-8")
