"""``loopback_tcp``: the guest may talk TCP to itself (the broker shim's proxy), and
still reaches nothing outside: not the host's loopback, no UDP, raw or netlink."""

from __future__ import annotations

import ast
import contextlib
import socket
import threading
from pathlib import Path

import pytest

from proctor.sandbox import SandboxSpec, get_driver, run_captured
from tests.sandbox_conftest_helpers import BACKENDS

PROBE = r"""
import socket, sys, threading
port = int(sys.argv[1])
results = {}
srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
srv.bind(("127.0.0.1", 3128)); srv.listen()
def serve():
    c, _ = srv.accept(); c.sendall(b"pong"); c.close()
t = threading.Thread(target=serve); t.start()
c = socket.create_connection(("127.0.0.1", 3128), timeout=5)
results["own_loopback"] = c.recv(4).decode()
t.join()
try:
    socket.create_connection(("127.0.0.1", port), timeout=2)
    results["host_loopback"] = "CONNECTED"
except OSError as e:
    results["host_loopback"] = "refused"
for name, fam, typ in [("udp", socket.AF_INET, socket.SOCK_DGRAM),
                       ("udp6", socket.AF_INET6, socket.SOCK_DGRAM),
                       ("raw", socket.AF_INET, socket.SOCK_RAW),
                       ("netlink", socket.AF_NETLINK, socket.SOCK_RAW),
                       ("packet", socket.AF_PACKET, socket.SOCK_RAW)]:
    try:
        socket.socket(fam, typ)
        results[name] = "OPEN"
    except OSError:
        results[name] = "refused"
print(results)
"""


@pytest.mark.sandbox
@pytest.mark.parametrize("backend", BACKENDS)
def test_loopback_tcp_reaches_only_the_guest_itself(backend: str, tmp_path: Path) -> None:
    host = socket.socket()
    host.bind(("127.0.0.1", 0))
    host.listen()
    host.settimeout(0.2)
    hits: list[object] = []
    ended = threading.Event()

    def watch() -> None:
        # Until the run has ended (a guest cannot connect after that), then one more
        # accept for a connection still in the backlog.
        while True:
            last = ended.is_set()
            with contextlib.suppress(OSError):
                hits.append(host.accept())
            if last:
                return

    watcher = threading.Thread(target=watch)
    watcher.start()
    lib = tmp_path / "lib"
    lib.mkdir()
    lib.chmod(0o755)
    (lib / "probe.py").write_text(PROBE)
    (lib / "probe.py").chmod(0o644)
    try:
        spec = SandboxSpec(
            argv=("python3", "/opt/lib/probe.py", str(host.getsockname()[1])),
            ro_dirs={lib: "/opt/lib"},
            loopback_tcp=True,
        )
        run = run_captured(get_driver(backend), spec)
    finally:
        ended.set()
        watcher.join()
        host.close()
    assert run.result.exit_code == 0, run.stderr.decode()
    results = ast.literal_eval(run.stdout.decode())
    assert results == {
        "own_loopback": "pong",
        "host_loopback": "refused",
        "udp": "refused",
        "udp6": "refused",
        "raw": "refused",
        "netlink": "refused",
        "packet": "refused",
    }
    assert hits == [], "the host's listener must never see the guest"


@pytest.mark.sandbox
@pytest.mark.parametrize("backend", BACKENDS)
def test_guest_threads_work(backend: str) -> None:
    code = "import threading; t=threading.Thread(target=print, args=('ok',)); t.start(); t.join()"
    run = run_captured(get_driver(backend), SandboxSpec(argv=("python3", "-c", code)))
    assert run.stdout == b"ok\n", run.stderr.decode()
