"""Every OCSF line of real packs is valid OCSF 1.8.0 (tests/ocsf_validate.py).

Two workloads: the demo (a real ``proctor demo`` home: control-plane actions,
approvals, a production run with SQL, files and egress) exported as a pack, and
a real broker serving one run (tests/fuzz/_support.py) driven through every
endpoint, allowed and refused, plus HTTP and CONNECT to a loopback upstream, so
that each action the broker records has its OCSF line checked.
"""

from __future__ import annotations

import json
import shutil
import threading
import zipfile
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from ipaddress import ip_address
from pathlib import Path
from typing import Any

import pytest

from proctor.broker import EgressProxy
from proctor.broker._egress import IPAddress
from proctor.evidence import export_pack
from proctor.evidence._ocsf import ocsf_line
from proctor.runtime import Runtime
from tests.fuzz._support import Served, exchange, served_broker
from tests.ocsf_validate import validate
from tests.security.test_broker_every_answer import CAPS, TOKEN, _all_cases, _world, request

ALL = ("2000-01-01T00:00:00.000000Z", "2100-01-01T00:00:00.000000Z")


def _is_ip(text: Any) -> bool:
    try:
        ip_address(str(text))
    except ValueError:
        return False
    return True


def _fields(obj: Any, name: str) -> Iterator[Any]:
    """Every value of a member called ``name``, at any depth."""
    if isinstance(obj, dict):
        for key, value in obj.items():
            if key == name:
                yield value
            yield from _fields(value, name)
    elif isinstance(obj, list):
        for item in obj:
            yield from _fields(item, name)


def _untruths(events: list[dict[str, Any]], lines: list[bytes]) -> list[str]:
    """What a line says that its event does not (issue 31, item 8)."""
    found = []
    for ev, line in zip(events, lines, strict=True):
        out, text, at = json.loads(line), line.decode(), f"seq {ev['seq']} {ev['action']}"
        if ev["decision"] == "allow" and ("default-deny" in text or "no policy permits" in text):
            found.append(f"{at}: allowed, yet cites the default deny")
        if "not recorded" in text:
            found.append(f"{at}: a 'not recorded' placeholder")
        found += [f"{at}: hostname {h!r} is an IP" for h in _fields(out, "hostname") if _is_ip(h)]
        found += [f"{at}: ip {a!r} is not an IP" for a in _fields(out, "ip") if not _is_ip(a)]
        for seen in out["observables"]:
            if seen["type_id"] == 1 and _is_ip(seen["value"]):
                found.append(f"{at}: {seen['name']} typed Hostname holds an IP")
            if seen["type_id"] == 2 and not _is_ip(seen["value"]):
                found.append(f"{at}: {seen['name']} typed IP Address holds no IP")
        status = ev["details"].get("status")
        if ev["action"] == "http.request.end" and status is None:
            status = ev["details"].get("answered")  # Proctor's own answer, none upstream
        recorded = ev["action"].startswith("http.") and isinstance(status, int)
        if recorded and out.get("http_response", {}).get("code") != status:
            found.append(f"{at}: status {status} recorded, not its http_response.code")
        if recorded and out["class_uid"] != 4002:
            found.append(f"{at}: status {status} recorded, not HTTP Activity")
    return found


def _errors(lines: list[bytes]) -> dict[int, list[str]]:
    found: dict[int, list[str]] = {}
    for i, line in enumerate(lines):
        errors = validate(json.loads(line)).errors
        if errors:
            found[i] = errors
    return found


def test_demo_pack_ocsf_lines_are_valid(demo_home: Path, tmp_path: Path) -> None:
    home = tmp_path / "home"
    shutil.copytree(demo_home, home, symlinks=True)
    config = json.loads((home / "config.json").read_text())
    config["store"] = f"sqlite:///{home / 'proctor.db'}"
    (home / "config.json").write_text(json.dumps(config))
    with Runtime.open(home) as rt:
        export_pack(rt, "acme", *ALL, tmp_path / "p.zip")
    with zipfile.ZipFile(tmp_path / "p.zip") as zf:
        lines = zf.read("ocsf/events.ocsf.jsonl").splitlines()
        events = [json.loads(e) for e in zf.read("events/events.jsonl").splitlines()]
    assert len(lines) == len(events) > 30
    assert _errors(lines) == {}
    parsed = [json.loads(line) for line in lines]
    classes = {p["class_uid"] for p in parsed}
    assert {6003, 6005} <= classes
    actions = {e["action"] for e in events}
    assert {"approval.grant", "artifact.submit", "deployment.create", "run.start"} <= actions
    # Each line is its event's: same sequence number, same decision.
    for ev, p in zip(events, parsed, strict=True):
        assert p["metadata"]["sequence"] == ev["seq"]
        assert p["action_id"] == (1 if ev["decision"] == "allow" else 2)
    # The demo holds what the old mapping misstated: allowed control-plane events
    # that cite no policy, an IP literal as the egress host, principals' actions
    # whose address is not recorded, and an HTTP exchange whose status is recorded.
    assert any(e["decision"] == "allow" and not e["policies"] for e in events)
    assert any(_is_ip(e["details"].get("host")) for e in events)
    assert any(e["actor"]["type"] == "user" for e in events)
    assert any(e["action"] == "http.request.end" and "status" in e["details"] for e in events)
    assert _untruths(events, lines) == []


class _Upstream(BaseHTTPRequestHandler):
    def _answer(self) -> None:
        self.send_response(200)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"ok")

    do_GET = do_PATCH = _answer

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def upstream() -> Iterator[int]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Upstream)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


async def _loopback(name: str, port: int) -> list[IPAddress]:
    return [ip_address("127.0.0.1")]


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, upstream: int) -> Iterator[Served]:
    tmp = tmp_path_factory.mktemp("ocsf-broker")
    caps = {**CAPS, "egress": [f"api.test:{upstream}"]}
    proxy = EgressProxy(tmp / "ca", resolver=_loopback, connect_timeout=2)
    with served_broker(tmp, caps, proxy, allowed_ranges=("127.0.0.0/8",), **_world(tmp)) as s:
        yield s


def test_broker_workload_ocsf_lines_are_valid(served: Served, upstream: int) -> None:
    wires = [case.wire for case in _all_cases()]
    wires += [
        request("GET", f"http://api.test:{upstream}/hello?x=1"),
        request("PATCH", f"http://api.test:{upstream}/item", b"{}"),
        request("CONNECT", f"api.test:{upstream}"),
        request("POST", "/v1/sql", b'{"dataset": "crm", "sql": "DELETE FROM customers"}'),
    ]
    for wire in wires:
        exchange(served.socket, wire.replace(TOKEN.encode(), served.token.encode()))
    events = [json.loads(e) for e in served.ledger.entries("acme")]
    origin = served.ledger.origin("acme")
    lines = [ocsf_line(ev, origin) for ev in events]
    assert _errors(lines) == {}
    seen = {(e["action"], e["decision"]) for e in events}
    assert {
        ("sql.select", "allow"),
        ("sql.select", "deny"),
        ("sql.write", "deny"),
        ("file.read", "allow"),
        ("file.write", "deny"),
        ("http.request", "allow"),
        ("http.request", "deny"),
        ("http.request.end", "allow"),
        ("broker.request", "deny"),
        ("broker.auth", "deny"),
        ("broker.whoami", "allow"),
    } <= seen, seen
    methods = {
        json.loads(line)["activity_name"] for line in lines if json.loads(line)["class_uid"] == 4002
    }
    assert {"Get", "Patch", "Connect"} <= methods
    assert _untruths(events, lines) == []
    # Each exchange with the upstream ended in a response whose status was recorded.
    codes = [json.loads(line).get("http_response", {}).get("code") for line in lines]
    ends = [e for e in events if e["action"] == "http.request.end"]
    assert [e["details"].get("status") for e in ends].count(200) >= 2, ends
    assert codes.count(200) >= 2
    # The broker's refusals carry the status it answered.
    refused = [(e, json.loads(line)) for e, line in zip(events, lines, strict=True)
               if e["action"] == "broker.request"]  # fmt: skip
    assert refused and all(o["http_response"]["code"] == e["details"]["status"] for e, o in refused)
