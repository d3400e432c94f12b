"""What a guest must not be able to do, on every backend that works here.

One probe program per backend tries every forbidden thing and reports; each
check is its own test over that report. The host side makes the attempts
observable: listeners on its loopback, secrets in its temp directory, a data
directory and an SSH key, and symlinks planted in the guest's code directory.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from proctor.sandbox import Limits, Reason, SandboxSpec, run_captured
from tests.sandbox_conftest_helpers import (
    BACKENDS,
    HostListeners,
    assert_nothing_left,
    driver_or_skip,
    host_listeners,  # noqa: F401 - fixture
    snapshot,
)

SECRET = "proctor-test-secret-4f1c"

PROBE = r"""
import ctypes, ctypes.util, errno, json, os, socket, sys, time
facts = json.load(open("/code/facts.json"))
report = {}

def attempt(name, fn):
    try:
        detail = fn()
        report[name] = {"blocked": False, "detail": repr(detail)[:200]}
    except Exception as exc:
        report[name] = {"blocked": True, "detail": f"{type(exc).__name__}: {exc}"[:200]}

def tcp(host, port, family=socket.AF_INET):
    s = socket.socket(family, socket.SOCK_STREAM)
    s.settimeout(2)
    s.connect((host, port))
    return "connected"

def udp(host, port):
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.sendto(b"hello", (host, port))
    return "sent"

attempt("tcp_host_loopback", lambda: tcp("127.0.0.1", facts["tcp_port"]))
attempt("udp_host_loopback", lambda: udp("127.0.0.1", facts["udp_port"]))
if facts["tcp6_port"]:
    attempt("tcp6_host_loopback", lambda: tcp("::1", facts["tcp6_port"], socket.AF_INET6))
attempt("tcp_internet", lambda: tcp("1.1.1.1", 53))
attempt("resolve_name", lambda: socket.getaddrinfo("example.com", 80))
attempt("netlink_socket", lambda: socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, 0))
attempt("packet_socket", lambda: socket.socket(socket.AF_PACKET, socket.SOCK_RAW, 0))

def read(path):
    with open(path, "rb") as f:
        return f.read(200)

attempt("read_etc_shadow", lambda: read("/etc/shadow"))
for key, path in facts["secrets"].items():
    attempt("read_" + key, lambda p=path: read(p))
for link in ("link_absolute", "link_shadow", "link_relative", "link_dir"):
    attempt("symlink_" + link, lambda l=link: read("/code/" + l))

def host_pid1_environ():
    data = open("/proc/1/environ", "rb").read()
    host = bytes.fromhex(facts["host_pid1_environ"])
    if (host and data == host) or facts["secret"].encode() in data:
        return "host pid 1 environ readable"
    raise PermissionError("a different pid 1: " + repr(data[:60]))
attempt("read_host_pid1_environ", host_pid1_environ)

def env_leak():
    if any(facts["secret"] in v for v in os.environ.values()):
        return "host environment leaked"
    raise PermissionError("clean environment")
attempt("host_env_leak", env_leak)

def write(path):
    with open(path, "wb") as f:
        f.write(b"x")
    return "written"

targets = {"escape": "/escape", "code_escape": "/code/escape", "usr_escape": "/usr/escape",
           "etc_escape": "/etc/escape", "proc_escape": "/proc/escape",
           "prefix_escape": facts["prefix"] + "/escape", "dev_escape": "/dev/escape"}
for name, target in targets.items():
    attempt("write_" + name, lambda t=target: write(t))
scratch_ok = write(facts["scratch"] + "/fine")

def host_processes():
    seen = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                seen.append(open(f"/proc/{entry}/cmdline", "rb").read())
            except OSError:
                pass
    # The marker arrives in two halves: the sandbox's own init may show our argv.
    marker = (facts["marker_a"] + facts["marker_b"]).encode()
    if any(marker in c for c in seen) or len(seen) > 20:
        return f"{len(seen)} processes visible"
    raise PermissionError(f"only {len(seen)} sandbox processes visible")
attempt("see_host_processes", host_processes)

libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)

def checked(rc, what):
    if rc == -1:
        e = ctypes.get_errno()
        raise OSError(e, what + ": " + os.strerror(e))
    return rc

def ptrace_child():
    pid = os.fork()
    if pid == 0:
        time.sleep(5)
        os._exit(0)
    try:
        return checked(libc.ptrace(16, pid, None, None), "PTRACE_ATTACH")
    finally:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
attempt("ptrace", ptrace_child)
attempt("mount_tmpfs", lambda: checked(
    libc.mount(b"none", facts["scratch"].encode(), b"tmpfs", 0, None), "mount"))
attempt("unshare_user", lambda: checked(libc.unshare(0x10000000), "unshare"))
attempt("unshare_net", lambda: checked(libc.unshare(0x40000000), "unshare"))
attempt("setuid_root", lambda: checked(libc.setuid(0), "setuid"))
def read_sys():
    if os.listdir("/sys/fs/cgroup"):
        return "host cgroups visible"
    raise PermissionError("empty")
attempt("read_sys", read_sys)

print(json.dumps({"report": report, "scratch": scratch_ok, "uid": os.getuid()}))
"""

CHECKS = [
    "tcp_host_loopback",
    "udp_host_loopback",
    "tcp6_host_loopback",
    "tcp_internet",
    "resolve_name",
    "netlink_socket",
    "packet_socket",
    "read_etc_shadow",
    "read_data_dir",
    "read_ssh_key",
    "read_host_tmp",
    "symlink_link_absolute",
    "symlink_link_shadow",
    "symlink_link_relative",
    "symlink_link_dir",
    "read_host_pid1_environ",
    "host_env_leak",
    "write_escape",
    "write_code_escape",
    "write_usr_escape",
    "write_etc_escape",
    "write_proc_escape",
    "write_prefix_escape",
    "write_dev_escape",
    "see_host_processes",
    "ptrace",
    "mount_tmpfs",
    "unshare_user",
    "unshare_net",
    "setuid_root",
    "read_sys",
]


def _host_pid1_environ() -> bytes:
    # Inside a container even root may be refused this; then only the secret marker counts.
    try:
        return Path("/proc/1/environ").read_bytes()
    except OSError:
        return b""


@pytest.fixture(scope="module", params=BACKENDS)
def probe(
    request: pytest.FixtureRequest,
    host_listeners: HostListeners,  # noqa: F811
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[dict[str, Any]]:
    driver = driver_or_skip(request.param)
    host = tmp_path_factory.mktemp(f"host-{request.param}")
    data_dir = host / "proctor-home"
    data_dir.mkdir()
    (data_dir / "proctor.db").write_text(SECRET)
    ssh = host / "ssh"
    ssh.mkdir()
    (ssh / "id_ed25519").write_text(f"-----BEGIN OPENSSH PRIVATE KEY-----\n{SECRET}\n")
    loose = host / "loose-secret.txt"
    loose.write_text(SECRET)
    code = host / "code"
    code.mkdir()
    (code / "link_absolute").symlink_to(data_dir / "proctor.db")
    (code / "link_shadow").symlink_to("/etc/shadow")
    (code / "link_relative").symlink_to("../" * 12 + str(loose).lstrip("/"))
    (code / "link_dir").symlink_to(ssh)
    (code / "probe.py").write_text(PROBE)
    os.environ["PROCTOR_TEST_HOST_SECRET"] = SECRET  # must never reach the guest
    interpreter_prefix = str(driver.plan.interpreter.prefix)
    facts = {
        "tcp_port": host_listeners.tcp_port,
        "udp_port": host_listeners.udp_port,
        "tcp6_port": host_listeners.tcp6_port,
        "secrets": {
            "data_dir": str(data_dir / "proctor.db"),
            "ssh_key": str(ssh / "id_ed25519"),
            "host_tmp": str(loose),
        },
        "secret": SECRET,
        "host_pid1_environ": _host_pid1_environ().hex(),
        "prefix": interpreter_prefix,
        "scratch": "/scratch",
        "marker_a": "proctor-host-",
        "marker_b": f"marker-{os.getpid()}",
    }
    (code / "link_dir").unlink()
    (code / "link_dir").symlink_to(ssh / "id_ed25519")
    (code / "facts.json").write_text(json.dumps(facts))
    # A host process the guest must not see.
    marker = subprocess.Popen(["/bin/sh", "-c", "sleep 120", facts["marker_a"] + facts["marker_b"]])
    before = snapshot()
    spec = SandboxSpec(
        argv=("python3", "/code/probe.py"),
        code_dir=code,
        scratch_path="/scratch",
        limits=Limits(wall_seconds=60),
    )
    try:
        captured = run_captured(driver, spec)
    finally:
        marker.kill()
        marker.wait()
    assert_nothing_left(before)
    del os.environ["PROCTOR_TEST_HOST_SECRET"]
    assert captured.result.reason is Reason.EXIT, captured.stderr.decode()
    assert captured.result.exit_code == 0, captured.stderr.decode()
    out = json.loads(captured.stdout)
    out["contacts"] = list(host_listeners.contacts)
    yield out


@pytest.mark.parametrize("check", CHECKS)
def test_guest_is_refused(probe: dict[str, Any], check: str) -> None:
    report = probe["report"]
    if check == "tcp6_host_loopback" and check not in report:
        pytest.skip("the host has no IPv6 loopback to listen on")
    assert report[check]["blocked"], f"{check} was allowed: {report[check]['detail']}"


def test_host_listeners_were_never_contacted(probe: dict[str, Any]) -> None:
    assert "tcp_host_loopback" in probe["report"]
    assert probe["contacts"] == []


def test_guest_runs_unprivileged_and_writes_scratch(probe: dict[str, Any]) -> None:
    assert probe["uid"] == 65534
    assert probe["scratch"] == "written"
