"""A guest is never privileged on the host, on either backend.

Issue 13, item 1: a bubblewrap guest was host uid 0 inside a user namespace
(``uid_map`` ``65534 0 1``) and wrote the host's ``/proc/sys`` (core_pattern,
drop_caches, ...). Each probe here runs the real attack from inside a real
sandbox and looks at the result from the host as well: the kernel settings
before and after, the host credentials of the sandbox's processes while the
guest is alive, and the host owner of a file the guest wrote.

No host setting is ever changed, even when a check fails: the guest writes
back the value the host has (read just before), and ``vm/drop_caches``, which
cannot be read, gets ``0``, a value the kernel refuses. ``/proc/sysrq-trigger``
and the ``/sys`` files are only opened, never written.

Item 9's backend difference is here too: code in a directory of mode 0700,
files 0600, runs the same on both backends.
"""

from __future__ import annotations

import json
import os
import pwd
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from proctor.sandbox import (
    BubblewrapDriver,
    Limits,
    Reason,
    SandboxSpec,
    SandboxUnavailable,
    run_captured,
)
from tests.sandbox_conftest_helpers import (
    BACKENDS,
    assert_nothing_left,
    driver_or_skip,
    snapshot,
)

#: Every setting the attacker's suite wrote from a bubblewrap guest.
SYSCTLS = (
    "kernel/core_pattern",
    "vm/drop_caches",
    "kernel/randomize_va_space",
    "fs/suid_dumpable",
    "kernel/kptr_restrict",
    "kernel/dmesg_restrict",
    "kernel/perf_event_paranoid",
    "kernel/panic",
)
#: Opened for writing, never written: a write to either would act.
OPEN_ONLY = (
    "/proc/sysrq-trigger",
    "/sys/kernel/mm/transparent_hugepage/enabled",
    "/sys/fs/cgroup/cgroup.procs",
)
GUEST_USER = "proctor-guest"
_READY = "proctor-guest-probe-ready"

PROBE = r"""
import json, os, sys
facts = json.loads(sys.argv[1])
report = {"sysctl": {}, "open_only": {}}
for name, value in facts["sysctls"].items():
    path = "/proc/sys/" + name
    entry = {"opened": False, "written": False, "error": ""}
    try:
        fd = os.open(path, os.O_WRONLY)
    except OSError as exc:
        entry["error"] = f"open: {exc}"
    else:
        entry["opened"] = True
        try:
            # The host's own value (or one the kernel refuses): nothing changes either way.
            os.write(fd, (value if value is not None else "0").encode() + b"\n")
            entry["written"] = True
        except OSError as exc:
            entry["error"] = f"write: {exc}"
        finally:
            os.close(fd)
    report["sysctl"][name] = entry
for path in facts["open_only"]:
    try:
        os.close(os.open(path, os.O_WRONLY))
        report["open_only"][path] = "opened"
    except OSError as exc:
        report["open_only"][path] = f"refused: {exc}"
report["uid"] = os.getuid()
report["gid"] = os.getgid()
report["groups"] = os.getgroups()
report["uid_map"] = open("/proc/self/uid_map").read()
report["gid_map"] = open("/proc/self/gid_map").read()
with open(facts["scratch"] + "/owned", "w") as f:
    f.write("mine")
report["scratch_owner"] = os.stat(facts["scratch"] + "/owned").st_uid
status = {}
for line in open("/proc/self/status"):
    key, _, value = line.partition(":")
    if key in ("CapEff", "CapPrm", "CapBnd", "CapAmb", "NoNewPrivs"):
        status[key] = value.strip()
report["status"] = status
print(json.dumps(report), flush=True)
print(facts["ready"], flush=True)
# Alive until the host has looked at this process from outside; the host cancels the run.
import time
time.sleep(120)
"""


def _read_sysctl(name: str) -> str | None:
    try:
        return Path("/proc/sys", name).read_text().strip()
    except OSError:
        return None  # write-only (drop_caches)


def _status_ids(pid: int) -> dict[str, list[int]]:
    ids: dict[str, list[int]] = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("Uid", "Gid"):
            ids[key] = [int(v) for v in value.split()]
        if key == "Groups":
            ids[key] = [int(v) for v in value.split()]
    return ids


def _descendants(root: int) -> dict[int, bytes]:
    """Every live process below ``root`` on the host, with its command line."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        parents[int(entry)] = int(stat.rpartition(")")[2].split()[1])
    found: dict[int, bytes] = {}
    frontier = [root]
    while frontier:
        parent = frontier.pop()
        for pid, ppid in parents.items():
            if ppid == parent and pid not in found:
                try:
                    found[pid] = Path(f"/proc/{pid}/cmdline").read_bytes()
                except OSError:
                    continue
                frontier.append(pid)
    return found


def _host_view() -> dict[str, Any]:
    """The sandbox's processes as the host sees them, while the guest is alive."""
    view: dict[str, Any] = {"processes": []}
    for pid, cmdline in _descendants(os.getpid()).items():
        argv = [a.decode(errors="replace") for a in cmdline.split(b"\0") if a]
        try:
            ids = _status_ids(pid)
            uid_map = Path(f"/proc/{pid}/uid_map").read_text()
            gid_map = Path(f"/proc/{pid}/gid_map").read_text()
        except OSError:
            continue
        proc = {"pid": pid, "argv": argv, **ids, "uid_map": uid_map, "gid_map": gid_map}
        # bwrap's own processes carry the guest's argv too; the guest is the interpreter.
        if argv and os.path.basename(argv[0]).startswith("python") and _READY in argv:
            proc["guest"] = True
            owned = Path(f"/proc/{pid}/root/scratch/owned")
            try:
                st = owned.stat()
                proc["scratch_owner"] = [st.st_uid, st.st_gid]
            except OSError as exc:
                proc["scratch_owner"] = f"not visible from the host: {exc.strerror}"
        view["processes"].append(proc)
    return view


def _map_lines(text: str) -> list[tuple[int, int, int]]:
    return [(int(a), int(b), int(c)) for a, b, c in (line.split() for line in text.splitlines())]


def _outside(text: str, inside: int) -> int | None:
    """The id that ``inside`` maps to in the parent namespace, per a uid_map/gid_map."""
    for first, lower, count in _map_lines(text):
        if first <= inside < first + count:
            return lower + inside - first
    return None


@pytest.fixture(scope="module")
def guest_ids() -> tuple[int, int]:
    try:
        pw = pwd.getpwnam(GUEST_USER)
    except KeyError:
        pytest.fail(f"no {GUEST_USER} user: scripts/setup.sh (make setup) creates it")
    return pw.pw_uid, pw.pw_gid


@pytest.fixture(scope="module", params=BACKENDS)
def probe(request: pytest.FixtureRequest) -> Iterator[dict[str, Any]]:
    backend = request.param
    driver = driver_or_skip(backend)
    before_values = {name: _read_sysctl(name) for name in SYSCTLS}
    facts = {
        "sysctls": before_values,
        "open_only": list(OPEN_ONLY),
        "scratch": "/scratch",
        "ready": _READY,
    }
    out = bytearray()
    cancel = threading.Event()
    host: dict[str, Any] = {}

    def on_stdout(data: bytes) -> None:
        out.extend(data)
        if not host and _READY.encode() + b"\n" in out:
            host.update(_host_view())
            cancel.set()

    before = snapshot()
    spec = SandboxSpec(
        argv=("python3", "-c", PROBE, json.dumps(facts), _READY),
        scratch_path="/scratch",
        limits=Limits(wall_seconds=60),
    )
    err = bytearray()
    result = driver.run(spec, on_stdout=on_stdout, on_stderr=err.extend, cancel=cancel)
    assert_nothing_left(before)
    after_values = {name: _read_sysctl(name) for name in SYSCTLS}
    assert host, f"the guest never got ready: {result} {bytes(err).decode(errors='replace')}"
    assert result.reason is Reason.STOPPED, (result, bytes(err))
    report = json.loads(bytes(out).split(b"\n", 1)[0])
    yield {
        "backend": backend,
        "report": report,
        "host": host,
        "before": before_values,
        "after": after_values,
    }


@pytest.mark.parametrize("name", SYSCTLS)
def test_guest_cannot_open_host_sysctl_for_writing(probe: dict[str, Any], name: str) -> None:
    entry = probe["report"]["sysctl"][name]
    assert not entry["opened"], f"/proc/sys/{name} opened for writing: {entry}"
    assert not entry["written"]


def test_host_sysctls_are_unchanged(probe: dict[str, Any]) -> None:
    assert probe["after"] == probe["before"]


@pytest.mark.parametrize("path", OPEN_ONLY)
def test_other_kernel_interfaces_are_read_only_or_absent(probe: dict[str, Any], path: str) -> None:
    assert probe["report"]["open_only"][path].startswith("refused"), probe["report"]["open_only"]


def test_guest_has_no_capabilities(probe: dict[str, Any]) -> None:
    status = probe["report"]["status"]
    for key in ("CapEff", "CapPrm", "CapAmb"):  # gVisor has no ambient set to show
        assert int(status.get(key, "0"), 16) == 0, status
    if probe["backend"] == "bubblewrap":
        # The bounding set too: nothing a file capability could hand back.
        assert int(status["CapBnd"], 16) == 0, status
        assert status["NoNewPrivs"] == "1"


def test_guest_ids_do_not_map_to_host_root(probe: dict[str, Any]) -> None:
    report = probe["report"]
    assert (report["uid"], report["gid"]) == (65534, 65534)
    assert report["groups"] == []
    # Whatever namespace the guest is in, its own ids do not lead to 0 outside it.
    assert _outside(report["uid_map"], report["uid"]) not in (None, 0), report["uid_map"]
    assert _outside(report["gid_map"], report["gid"]) not in (None, 0), report["gid_map"]


def test_bubblewrap_guest_is_the_dedicated_user_on_the_host(
    probe: dict[str, Any], guest_ids: tuple[int, int]
) -> None:
    if probe["backend"] != "bubblewrap":
        pytest.skip("a gVisor guest has no host identity: the sentry serves its system calls")
    uid, gid = guest_ids
    assert uid != 0 and gid != 0
    guests = [p for p in probe["host"]["processes"] if p.get("guest")]
    assert len(guests) == 1, probe["host"]
    guest = guests[0]
    assert guest["Uid"] == [uid] * 4, guest
    assert guest["Gid"] == [gid] * 4, guest
    assert guest["Groups"] == [], guest
    # Seen from the host, the guest's user namespace maps its 65534 to the dedicated user only.
    assert _map_lines(guest["uid_map"]) == [(65534, uid, 1)], guest["uid_map"]
    assert _map_lines(guest["gid_map"]) == [(65534, gid, 1)], guest["gid_map"]


def test_bubblewrap_scratch_files_belong_to_the_dedicated_user(
    probe: dict[str, Any], guest_ids: tuple[int, int]
) -> None:
    if probe["backend"] != "bubblewrap":
        pytest.skip("gVisor's scratch lives in the sentry's memory, never in a host file")
    assert probe["report"]["scratch_owner"] == 65534
    guest = next(p for p in probe["host"]["processes"] if p.get("guest"))
    assert guest["scratch_owner"] == list(guest_ids)


def test_gvisor_sentry_is_not_host_root(probe: dict[str, Any]) -> None:
    if probe["backend"] != "gvisor":
        pytest.skip("bubblewrap has no sentry")
    sentries = [p for p in probe["host"]["processes"] if "boot" in p["argv"]]
    assert len(sentries) == 1, [p["argv"][:3] for p in probe["host"]["processes"]]
    sentry = sentries[0]
    assert 0 not in sentry["Uid"], sentry
    assert 0 not in sentry["Gid"], sentry
    assert all(lower != 0 for _, lower, _ in _map_lines(sentry["uid_map"])), sentry["uid_map"]


# -- code the guest can read whatever its mode (item 9) -------------------------------


def _private_tree(root: Path) -> Path:
    code = root / "code"
    (code / "pkg").mkdir(parents=True)
    (code / "main.py").write_text(
        "import os, pkg\nprint(pkg.VALUE, open('pkg/data.txt').read(), sorted(os.listdir('.')))\n"
    )
    (code / "pkg" / "__init__.py").write_text("VALUE = 'imported'\n")
    (code / "pkg" / "data.txt").write_text("private data")
    (code / "run.sh").write_text("#!/bin/sh\necho shell ran\n")
    for path in (code / "main.py", code / "pkg" / "__init__.py", code / "pkg" / "data.txt"):
        path.chmod(0o600)
    (code / "run.sh").chmod(0o700)
    (code / "pkg").chmod(0o700)
    code.chmod(0o700)
    return code


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("owner", ["root", "another-user"])
def test_code_of_mode_0700_runs_on_both_backends(backend: str, owner: str, tmp_path: Path) -> None:
    driver = driver_or_skip(backend)
    parent = tmp_path / "private"
    parent.mkdir()
    code = _private_tree(parent)
    if owner == "another-user":
        # A user's own private directory, which root reads but nobody else does.
        nobody = pwd.getpwnam("nobody")
        for path in (parent, *parent.rglob("*")):
            os.chown(path, nobody.pw_uid, nobody.pw_gid, follow_symlinks=False)
    parent.chmod(0o700)
    before = snapshot()
    run = run_captured(
        driver,
        SandboxSpec(argv=("python3", "main.py"), code_dir=code, limits=Limits(wall_seconds=30)),
    )
    assert run.result.ok, run.stderr.decode(errors="replace")
    assert run.stdout == b"imported private data ['main.py', 'pkg', 'run.sh']\n"
    shell = run_captured(driver, SandboxSpec(argv=("./run.sh",), code_dir=code))
    assert shell.result.ok, shell.stderr.decode(errors="replace")
    assert shell.stdout == b"shell ran\n"
    assert_nothing_left(before)
    # The host's files are as they were: nothing was chmod-ed to make them readable.
    assert (code.stat().st_mode & 0o777, (code / "main.py").stat().st_mode & 0o777) == (
        0o700,
        0o600,
    )


# Host: its leftover check reads the machine's tables, which another group's
# sandboxes change while it runs (it failed so on a clean clone's run).
@pytest.mark.host
def test_bubblewrap_without_the_guest_user_fails_closed(tmp_path: Path) -> None:
    driver = BubblewrapDriver(guest_user="proctor-no-such-user")
    status = driver.status()
    assert not status.available
    assert "proctor-no-such-user" in status.reason
    before = snapshot()
    with pytest.raises(SandboxUnavailable) as caught:
        driver.run(SandboxSpec(argv=("true",)))
    assert "proctor-no-such-user" in caught.value.message
    assert caught.value.hint is not None and "setup" in caught.value.hint
    assert_nothing_left(before)
