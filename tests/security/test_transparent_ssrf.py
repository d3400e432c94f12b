"""SSRF through transparent egress: a real sandboxed guest that opens connections
itself (no proxy) to internal addresses, in every spelling its own resolver turns
into one, and to names the broker resolves to one, is refused and recorded.

The whole runtime (broker, the run's network, the sandbox) runs inside a network
namespace this test makes, where 10.0.0.1, 10.0.0.2, 169.254.169.254, 1.1.1.1
and 127.0.0.1 are on the namespace's own loopback with a listener of the test's
behind each: a connection wrongly let through would really arrive (the test's own
direct dial at the end shows they answer), so a zero count is the broker's
refusal, not an unreachable address. An address the run's ``allowed_ranges``
opens (10.0.0.2) and a public one (1.1.1.1) are reached, decided on the address.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from proctor.broker._egress import SPECIAL_ADDRESS_RULE
from proctor.sandbox import network_available
from tests.sandbox_conftest_helpers import BACKENDS, driver_or_skip

ANY_HOST = """@id("test:any-host")
permit (principal, action == Proctor::Action::"http.request", resource);
"""

#: Spellings the guest's own resolver (glibc, inet_aton rules) reads as an address,
#: and IPv4-mapped IPv6 ones an AF_INET6 socket sends as IPv4.
METADATA = ["169.254.169.254", "2852039166", "0xa9fea9fe", "0251.0376.0251.0376",
            "169.254.43518", "0xa9.0xfe.0xa9.0xfe", "::ffff:169.254.169.254",
            "::ffff:a9fe:a9fe"]  # fmt: skip
PRIVATE = ["10.0.0.1", "10.1", "167772161", "012.0.0.1", "0xa.0.0.1", "::ffff:10.0.0.1"]
#: Names the broker's resolver (the test's) answers with special addresses.
NAMES = [
    "internal.test",
    "metadata.test",
    "mixed.test",
    "mapped.test",
    "loopback.test",
    "v6loop.test",
    "nat64.test",
    "ula.test",
]
#: The guest's own loopback: never leaves the guest (no listener there, nothing decided).
LOCAL = ["127.0.0.1", "127.1", "2130706433", "0.0.0.0", "::1", "::ffff:127.0.0.1"]
ALLOWED = ["public.test", "1.1.1.1", "10.0.0.2", "opened.test", "::ffff:10.0.0.2"]

GUEST = r"""
import json, socket, sys
attempts = json.loads(sys.argv[1])
out = {"dns": {}}
for name in ("internal.test", "metadata.test", "never.test", "localhost"):
    try:
        out["dns"][name] = sorted({i[4][0] for i in socket.getaddrinfo(name, 8080)})
    except OSError as e:
        out["dns"][name] = "error: " + type(e).__name__

def dial(host):
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    addr = socket.getaddrinfo(host, 8080, family, socket.SOCK_STREAM)[0][4]
    s = socket.socket(family, socket.SOCK_STREAM)
    s.settimeout(10)
    s.connect(addr)
    return s, addr[0]

for key, host, kind in attempts:
    try:
        s, addr = dial(host)
    except OSError as e:
        out[key] = "refused: " + type(e).__name__
        continue
    try:
        if kind == "http":
            s.sendall(f"GET / HTTP/1.1\r\nHost: {host if ':' not in host else '[' + host + ']'}\r\n"
                      "Connection: close\r\n\r\n".encode())
        else:
            s.sendall(b"\x00ping")
        data = b""
        while True:
            chunk = s.recv(4096)
            if not chunk:
                break
            data += chunk
        text = data.decode(errors="replace")
        if "reached " in text:
            out[key] = "reached " + text.rsplit("reached ", 1)[1].strip()
        else:
            out[key] = "refused: " + (text.split("\r\n", 1)[0] or "closed")
    except OSError as e:
        out[key] = "refused: " + type(e).__name__
    finally:
        s.close()
    out[key + "@"] = addr
print(json.dumps(out), flush=True)
"""

CHILD = textwrap.dedent(
    """
    import asyncio, ipaddress, json, os, socket, socketserver, subprocess, sys, tempfile
    import threading
    from pathlib import Path
    from proctor.broker import Broker, EgressProxy, Handlers, RunScope
    from proctor.broker._egress import UpstreamFailed
    from proctor.ledger import Actor, EventDraft, Ledger, Signer
    from proctor.lifecycle import brokered_spec
    from proctor.policy import compile_policies
    from proctor.sandbox import GuestNetwork, Limits, get_driver
    from proctor.store import open_store

    backend, policy_text, code, attempts = sys.argv[1], sys.argv[2], Path(sys.argv[3]), sys.argv[4]
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    ADDRS = ["1.1.1.1", "10.0.0.1", "10.0.0.2", "169.254.169.254", "127.0.0.1", "::1"]
    for a in ADDRS[:4]:
        subprocess.run(["ip", "addr", "add", f"{a}/32", "dev", "lo"], check=True)

    counts = {a: 0 for a in ADDRS}
    lock = threading.Lock()

    class Listener(socketserver.BaseRequestHandler):
        def handle(self):
            address = self.server.server_address[0]
            with lock:
                counts[address] += 1
            self.request.settimeout(5)
            try:
                data = self.request.recv(4096)
            except OSError:
                return
            body = f"reached {address}".encode()
            if data.startswith(b"GET"):
                self.request.sendall(b"HTTP/1.1 200 OK\\r\\nContent-Length: %d\\r\\n"
                                     b"Connection: close\\r\\n\\r\\n%s" % (len(body), body))
            else:
                self.request.sendall(body)

    class Listener6(socketserver.ThreadingTCPServer):
        address_family = socket.AF_INET6

    servers = []
    for a in ADDRS:
        s = (Listener6 if ":" in a else socketserver.ThreadingTCPServer)((a, 8080), Listener)
        s.daemon_threads = True
        threading.Thread(target=s.serve_forever, daemon=True).start()
        servers.append(s)

    answers = {"public.test": [["1.1.1.1"]], "internal.test": [["10.0.0.1"]],
               "metadata.test": [["169.254.169.254"]], "mixed.test": [["1.1.1.1", "10.0.0.1"]],
               "mapped.test": [["::ffff:10.0.0.1"]], "loopback.test": [["127.0.0.1"]],
               "rebind.test": [["1.1.1.1"], ["10.0.0.1"]], "opened.test": [["10.0.0.2"]],
               "v6loop.test": [["::1"]], "nat64.test": [["64:ff9b::a00:1"]],
               "ula.test": [["fd00::1"]]}
    calls = {}

    async def resolver(name, port):
        calls[name] = calls.get(name, 0) + 1
        if name not in answers:
            raise UpstreamFailed(f"could not resolve {name}")
        rounds = answers[name]
        return [ipaddress.ip_address(a) for a in rounds[min(calls[name], len(rounds)) - 1]]

    home = Path(tempfile.mkdtemp())
    store = open_store(str(home / "p.db"), create=True)
    ledger = Ledger(store, Signer.generate("netns.test"), "netns.test")
    ledger.create_log("acme", EventDraft(Actor("operator", "t"), "tenant.create", "tenant/acme"))
    scope = RunScope("acme", "r1", "spiffe://netns.test/tenant/acme/deployment/d/run/r1", "d",
                     None, (), "sandbox", compile_policies(policy_text), ledger,
                     allowed_ranges=("10.0.0.2/32",))
    proxy = EgressProxy(home / "ca", resolver=resolver, connect_timeout=5)
    out, err = [], []
    with Broker(Handlers.for_proxy(proxy), os.urandom(32)) as broker:
        channel = broker.open_run(scope, ttl=300)
        network = GuestNetwork.create()
        try:
            broker.attach_network(scope.run_id, network)
            spec = brokered_spec(channel, ("python3", "/code/main.py", attempts), code_dir=code,
                                 limits=Limits(wall_seconds=120, memory_bytes=1 << 30, pids=128),
                                 network=network)
            result = get_driver(backend).run(spec, on_stdout=out.append, on_stderr=err.append)
        finally:
            broker.close_run(scope.run_id)
            network.close()
    # The addresses answer a direct dial in here: a zero count above is a refusal.
    for a in ("10.0.0.1", "169.254.169.254", "127.0.0.1", "::1"):
        with socket.create_connection((a, 8080), timeout=5) as c:
            c.sendall(b"x")
            c.recv(64)
    for s in servers:
        s.shutdown()
        s.server_close()
    events = [json.loads(e) for e in ledger.entries("acme")]
    ledger.close()
    stdout = b"".join(out).decode(errors="replace").strip().splitlines()
    print(json.dumps({"exit": result.exit_code, "guest": json.loads(stdout[-1]) if stdout else None,
                      "stderr": b"".join(err).decode(errors="replace")[-2000:],
                      "counts": counts, "calls": calls, "events": events}))
    """
)


def _attempts() -> list[tuple[str, str, str]]:
    out = []
    for host in METADATA + PRIVATE + NAMES + ALLOWED + LOCAL:
        out.append((f"{host} raw", host, "raw"))
        out.append((f"{host} http", host, "http"))
    out += [("rebind.test 1", "rebind.test", "raw"), ("rebind.test 2", "rebind.test", "raw")]
    return out


@pytest.mark.host
@pytest.mark.skipif(not network_available(), reason="needs root, iproute2 and nftables")
@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs unshare")
@pytest.mark.parametrize("backend", BACKENDS)
def test_internal_addresses_refused_through_the_transparent_path(
    backend: str, tmp_path: Path
) -> None:
    driver_or_skip(backend)
    code = tmp_path / "code"
    code.mkdir()
    (code / "main.py").write_text(GUEST)
    os.chmod(tmp_path, 0o755)
    os.chmod(code, 0o755)
    (code / "main.py").chmod(0o644)
    env = dict(os.environ)
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2] / "src")
    attempts = _attempts()
    proc = subprocess.run(
        ["unshare", "--net", sys.executable, "-c", CHILD, backend, ANY_HOST, str(code),
         json.dumps(attempts)],
        capture_output=True, text=True, timeout=180, env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["exit"] == 0, result["stderr"]
    guest: dict[str, Any] = result["guest"]

    # DNS in the run never gives the real address; a name never dialed is never
    # looked up on the host (nor is any literal).
    for name in ("internal.test", "metadata.test", "never.test"):
        (fake,) = guest["dns"][name]
        assert fake.startswith(("198.18.", "198.19.")), guest["dns"]
    assert guest["dns"]["localhost"] == ["127.0.0.1"]

    refused = [k for k, _, _ in attempts if k.split(" ")[0] in METADATA + PRIVATE + NAMES]
    refused.append("rebind.test 2")
    for key in refused:
        assert guest[key].startswith("refused"), (key, guest[key])
    # The guest's resolver read each spelling as the address (inet_aton, mapped v6).
    for spelling in METADATA:
        assert guest[f"{spelling} raw@"] in ("169.254.169.254", "::ffff:169.254.169.254")
    for spelling in PRIVATE:
        assert guest[f"{spelling} raw@"] in ("10.0.0.1", "::ffff:10.0.0.1")
    for host in LOCAL:
        for kind in ("raw", "http"):
            assert guest[f"{host} {kind}"].startswith("refused"), (host, guest[f"{host} {kind}"])
    # Nothing reached the internal listeners but the test's own dial.
    counts = result["counts"]
    assert counts["10.0.0.1"] == 1, counts
    assert counts["169.254.169.254"] == 1, counts
    assert counts["127.0.0.1"] == 1, counts
    assert counts["::1"] == 1, counts

    # What policy and allowed_ranges open is reached, decided on the address.
    assert guest["public.test raw"] == "reached 1.1.1.1"
    assert guest["public.test http"] == "reached 1.1.1.1"
    assert guest["1.1.1.1 raw"] == guest["1.1.1.1 http"] == "reached 1.1.1.1"
    assert guest["rebind.test 1"] == "reached 1.1.1.1"
    for host in ("10.0.0.2", "opened.test", "::ffff:10.0.0.2"):
        for kind in ("raw", "http"):
            assert guest[f"{host} {kind}"] == "reached 10.0.0.2", (host, kind, guest)
    assert counts["1.1.1.1"] == 5 and counts["10.0.0.2"] == 6, counts

    # One lookup per connection to a name; never one for a literal or a name not dialed.
    calls = result["calls"]
    assert calls == {"internal.test": 2, "metadata.test": 2, "mixed.test": 2, "mapped.test": 2,
                     "loopback.test": 2, "public.test": 2, "opened.test": 2,
                     "rebind.test": 2, "v6loop.test": 2, "nat64.test": 2,
                     "ula.test": 2}, calls  # fmt: skip

    events = result["events"]
    decisions = [e for e in events if e["action"] == "http.request"]
    assert all(e["details"]["via"] == "transparent" for e in decisions)
    denied = [e for e in decisions if e["decision"] != "allow"]
    # Each refused connection is one deny event naming the address rule.
    assert len(denied) == len(refused), [(e["resource"], e["policies"]) for e in denied]
    assert all(e["policies"] == [SPECIAL_ADDRESS_RULE] for e in denied)
    assert all(e["details"]["permitted_by"] == ["test:any-host"] for e in denied)
    by_resource: dict[str, list[dict[str, Any]]] = {}
    for e in denied:
        by_resource.setdefault(e["resource"], []).append(e)
    assert len(by_resource["host/169.254.169.254:8080"]) == 2 * len(METADATA)
    assert len(by_resource["host/10.0.0.1:8080"]) == 2 * len(PRIVATE)
    for name, address in (("internal.test", "10.0.0.1"), ("metadata.test", "169.254.169.254"),
                          ("mixed.test", "10.0.0.1"), ("mapped.test", "10.0.0.1"),
                          ("loopback.test", "127.0.0.1"), ("v6loop.test", "::1"),
                          ("nat64.test", "64:ff9b::a00:1"), ("ula.test", "fd00::1")):  # fmt: skip
        refusals = by_resource[f"host/{name}:8080"]
        assert {e["details"]["address"] for e in refusals} == {address}, name
        # Decided on the name its fake address stands for, which the guest dialed.
        assert all(e["details"]["original_address"].startswith("198.1") for e in refusals)
    assert [e["details"]["address"] for e in by_resource["host/rebind.test:8080"]] == ["10.0.0.1"]
    allowed = [e for e in decisions if e["decision"] == "allow"]
    literal = [e for e in allowed if e["resource"] == "host/10.0.0.2:8080"]
    assert len(literal) == 4  # 10.0.0.2 and its mapped spelling, raw and HTTP
    assert all("resolved" not in e["details"] and e["details"]["address"] == "10.0.0.2"
               for e in literal)  # fmt: skip
    ends = [e for e in events if e["action"] == "http.request.end"]
    assert sorted(e["details"]["decision_seq"] for e in ends) == sorted(e["seq"] for e in allowed)
