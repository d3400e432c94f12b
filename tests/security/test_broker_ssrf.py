"""SSRF through the egress proxy: every spelling of an internal address is refused and recorded.

The policy here permits every host, so what refuses is the address check
alone. Refusals happen before any dial, so nothing leaves this machine; the
one test that must really dial non-loopback addresses does it inside a
network namespace of its own, where those addresses are on its loopback.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from proctor.broker._egress import SPECIAL_ADDRESS_RULE
from tests.conftest import LedgerEnv
from tests.integration.test_broker_proxy import Env, proxy_env

ANY_HOST = """@id("test:any-host")
permit (principal, action == Proctor::Action::"http.request", resource);
"""


@pytest.fixture
def env(ledger_env: LedgerEnv, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Env]:
    yield from proxy_env(ledger_env, tmp_path, monkeypatch)


LOOPBACK = [
    "127.0.0.1",
    "127.1",
    "127.0.1",
    "2130706433",
    "0x7f000001",
    "0x7f.1",
    "0X7F.0.0.1",
    "0177.0.0.1",
    "0177.1",
    "017700000001",
    "127.0.0.1.",
    "127.127.127.127",
    "0",
    "0.0.0.0",
    "0x0",
    "[::1]",
    "[0:0:0:0:0:0:0:1]",
    "[::ffff:127.0.0.1]",
    "[::ffff:7f00:1]",
    "[::127.0.0.1]",
    "[64:ff9b::127.0.0.1]",
    "[2002:7f00:1::1]",
    "[::]",
    "[fe80::1%25lo]",
    "localhost",
    "LOCALHOST.",
]
METADATA = [
    "169.254.169.254",
    "2852039166",
    "0xa9fea9fe",
    "0251.0376.0251.0376",
    "169.254.43518",
    "0xa9.0xfe.0xa9.0xfe",
    "[::ffff:169.254.169.254]",
    "[::ffff:a9fe:a9fe]",
    "[fd00:ec2::254]",
]
PRIVATE = ["10.0.0.1", "172.16.0.1", "192.168.0.1", "100.64.0.1", "[fc00::1]", "[2001::1]"]


@pytest.mark.parametrize("spelling", LOOPBACK + METADATA + PRIVATE)
def test_special_addresses_refused_in_every_spelling(env: Env, spelling: str) -> None:
    env.scope(policy_text=ANY_HOST, allowed=())
    port = env.http.port
    forward = f"GET http://{spelling}:{port}/ HTTP/1.1\r\nHost: x\r\n\r\n".encode()
    connect = f"CONNECT {spelling}:{port} HTTP/1.1\r\n\r\n".encode()
    for request in (forward, connect):
        status, headers, body = env.raw(request)
        assert status == 403, (spelling, body)
        assert headers["connection"] == "close"
        answer = json.loads(body)
        assert answer["error"] == "denied"
        assert answer["policies"] == [SPECIAL_ADDRESS_RULE]
    assert env.http.connections == 0
    events = env.events()
    assert len(events) == 2
    for event in events:
        assert event["action"] == "http.request"
        assert event["decision"] == "deny"
        assert event["policies"] == [SPECIAL_ADDRESS_RULE]
        assert event["details"]["permitted_by"] == ["test:any-host"]


@pytest.mark.parametrize("spelling", ["0x7f.1", "2130706433", "[::ffff:127.0.0.1]", "localhost"])
def test_policy_denies_before_the_name_is_resolved(env: Env, spelling: str) -> None:
    env.scope([f"127.0.0.1:{env.http.port}"], allowed=("127.0.0.0/8",))
    status, _, body = env.raw(f"CONNECT {spelling}:443 HTTP/1.1\r\n\r\n".encode())
    assert status == 403
    assert json.loads(body)["policies"] == []
    assert env.resolver.calls == {}
    assert env.http.connections == 0


def test_a_name_with_any_special_address_is_refused(env: Env) -> None:
    # A public answer beside an internal one is a rebinding setup; refuse both.
    env.resolver.answers["mixed.test"] = [["1.1.1.1", "10.0.0.1"]]
    env.resolver.answers["inside.test"] = [["::ffff:169.254.169.254"]]
    env.scope(policy_text=ANY_HOST, allowed=())
    for name in ("mixed.test", "inside.test"):
        status, _, body = env.raw(f"CONNECT {name}:443 HTTP/1.1\r\n\r\n".encode())
        assert status == 403, body
        assert env.resolver.calls[name] == 1
    refused = env.events()
    assert [e["details"]["address"] for e in refused] == ["10.0.0.1", "169.254.169.254"]


def test_allowing_every_range_opens_nothing(env: Env) -> None:
    env.scope(policy_text=ANY_HOST, allowed=("0.0.0.0/0", "::/0"))
    status, _, _ = env.raw(f"CONNECT 127.0.0.1:{env.http.port} HTTP/1.1\r\n\r\n".encode())
    assert status == 403
    assert env.http.connections == 0


def test_the_allowed_range_is_exactly_what_opens(env: Env) -> None:
    env.scope(policy_text=ANY_HOST, allowed=("127.0.0.1/32",))
    status, _, _ = env.raw(f"GET http://127.0.0.1:{env.http.port}/ HTTP/1.1\r\n\r\n".encode())
    assert status == 200
    status, _, _ = env.raw(f"GET http://127.0.0.2:{env.http.port}/ HTTP/1.1\r\n\r\n".encode())
    assert status == 403
    status, _, _ = env.raw(f"GET http://[::1]:{env.http.port}/ HTTP/1.1\r\n\r\n".encode())
    assert status == 403


def test_request_smuggling_shapes_are_refused(env: Env) -> None:
    env.scope([f"127.0.0.1:{env.http.port}"])
    port = env.http.port
    for request in (
        f"POST http://127.0.0.1:{port}/ HTTP/1.1\r\nTransfer-Encoding: gzip, chunked\r\n\r\n",
        f"POST http://127.0.0.1:{port}/ HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n",
        f"POST http://127.0.0.1:{port}/ HTTP/1.1\r\nContent-Length: -1\r\n\r\n",
    ):
        status, _, _ = env.raw(request.encode())
        assert status == 400
    assert env.http.connections == 0


# -- inside a network namespace: real dials to non-loopback addresses --------------

_NETNS_SCRIPT = textwrap.dedent(
    """
    import asyncio, ipaddress, json, subprocess, sys, tempfile
    from pathlib import Path
    from proctor.broker import RunScope
    from proctor.broker._proxy import EgressProxy
    from proctor.ledger import Actor, EventDraft, Ledger, Signer
    from proctor.policy import compile_policies
    from proctor.store import open_store

    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    ADDRS = ["1.1.1.1", "10.0.0.1", "169.254.169.254"]
    for a in ADDRS:
        subprocess.run(["ip", "addr", "add", f"{a}/32", "dev", "lo"], check=True)

    counts = {a: 0 for a in ADDRS}
    answers = {"public.test": [["1.1.1.1"]], "internal.test": [["10.0.0.1"]],
               "rebind.test": [["1.1.1.1"], ["10.0.0.1"]]}
    calls = {}

    async def resolver(name, port):
        calls[name] = calls.get(name, 0) + 1
        rounds = answers[name]
        return [ipaddress.ip_address(a) for a in rounds[min(calls[name], len(rounds)) - 1]]

    async def upstream(address):
        async def on(reader, writer):
            counts[address] += 1
            await reader.readuntil(b"\\r\\n\\r\\n")
            writer.write(b"HTTP/1.1 200 OK\\r\\nContent-Length: 2\\r\\n\\r\\nok")
            await writer.drain()
            writer.close()
        return await asyncio.start_server(on, address, 8080)

    async def main():
        home = Path(tempfile.mkdtemp())
        store = open_store(str(home / "p.db"), create=True)
        ledger = Ledger(store, Signer.generate("netns.test"), "netns.test")
        first = EventDraft(Actor("operator", "t"), "tenant.create", "tenant/acme")
        ledger.create_log("acme", first)
        policy = compile_policies(sys.argv[1])
        scope = RunScope("acme", "r1", "spiffe://netns.test/tenant/acme/deployment/d/run/r1",
                         "d", None, (), "sandbox", policy, ledger)
        proxy = EgressProxy(resolver=resolver)
        servers = [await upstream(a) for a in ADDRS]

        async def on_proxy(reader, writer):
            head = (await reader.readuntil(b"\\r\\n\\r\\n")).decode().split("\\r\\n")
            method, target, _ = head[0].split(" ")
            await proxy.handle_forward(scope, method, target, [], reader, writer)

        front = await asyncio.start_server(on_proxy, "127.0.0.1", 0)
        port = front.sockets[0].getsockname()[1]

        async def get(url):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(f"GET {url} HTTP/1.1\\r\\n\\r\\n".encode())
            data = await reader.read()
            writer.close()
            return int(data.split(b" ")[1])

        statuses = {}
        for key, url in [("public", "http://public.test:8080/"),
                         ("internal", "http://internal.test:8080/"),
                         ("metadata", "http://169.254.169.254:8080/"),
                         ("metadata_hex", "http://0xa9fea9fe:8080/"),
                         ("rebind_1", "http://rebind.test:8080/"),
                         ("rebind_2", "http://rebind.test:8080/")]:
            statuses[key] = await get(url)
        # A direct dial works in here, so a zero count means the proxy never dialed.
        r, w = await asyncio.open_connection("10.0.0.1", 8080)
        w.write(b"GET / HTTP/1.1\\r\\n\\r\\n")
        await r.read()
        w.close()
        for s in servers + [front]:
            s.close()
        ledger.close()
        print(json.dumps({"statuses": statuses, "counts": counts, "calls": calls}))

    asyncio.run(main())
    """
)


def _can_unshare() -> bool:
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        return False
    probe = subprocess.run(["unshare", "--net", "true"], capture_output=True)
    return probe.returncode == 0


@pytest.mark.host
@pytest.mark.skipif(not _can_unshare(), reason="needs unshare --net (root or user namespaces)")
def test_real_dials_in_a_private_network_namespace(tmp_path: Path) -> None:
    script = tmp_path / "netns_proxy.py"
    script.write_text(_NETNS_SCRIPT)
    child_env = dict(os.environ)
    child_env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2] / "src")
    proc = subprocess.run(
        ["unshare", "--net", sys.executable, str(script), ANY_HOST],
        capture_output=True,
        text=True,
        timeout=60,
        env=child_env,
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["statuses"] == {
        "public": 200,
        "internal": 403,
        "metadata": 403,
        "metadata_hex": 403,
        "rebind_1": 200,
        "rebind_2": 403,
    }
    # 10.0.0.1 was reached once, by the test's own direct dial, never by the proxy.
    assert result["counts"] == {"1.1.1.1": 2, "10.0.0.1": 1, "169.254.169.254": 0}
    # One lookup per request: the address checked is the address dialed.
    assert result["calls"] == {"public.test": 1, "internal.test": 1, "rebind.test": 2}
