"""Which tests touch the host, and a guard that holds every other test to not doing so.

A test that starts a sandbox, mounts something, makes a namespace or a cgroup
changes what the whole machine shows: the leftover checks after each sandbox test
(``tests/sandbox_conftest_helpers.py``: cgroups, sandbox processes, bundle
directories, mounts) read the machine's tables, not one test's. Those tests are
marked ``host`` (a ``sandbox`` mark, or use of the session's ``demo_home``, implies
it) and run one at a time, in one pytest process; every other test runs beside
them in a second one (``make test``, ``scripts/test.sh``).

That split is only safe if "not host" is true, so it is checked rather than
trusted: while a test not marked ``host`` runs,

* starting one of the host's tools from this process (``runsc``, ``bwrap``,
  ``unshare``, ``nsenter``, ``ip``, ``mount``, ``umount``) or making a directory
  under ``/sys/fs/cgroup`` raises (an audit hook), and
* ``PATH`` starts with a directory of stand-ins for the same tools, so a child
  process (the CLI in a subprocess) that starts one fails and leaves a line that
  fails the test at its end.

Either way the failure names the tool and asks for the mark; it is the same on
every run, never a race between two processes.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

HOST_TOOLS = ("runsc", "bwrap", "unshare", "nsenter", "ip", "mount", "umount")
#: Fixtures that start sandboxes (``demo_home``) or read the whole machine's state
#: (``no_leftovers``: its cgroups, processes, mounts): a test that uses one is a host test.
HOST_FIXTURES = ("demo_home", "no_leftovers")
_VIOLATIONS_ENV = "PROCTOR_TEST_HOST_VIOLATIONS"
_MESSAGE = "{what} by a test not marked host: mark it `@pytest.mark.host` (tests/host_group.py)"

_state: dict[str, Any] = {"guarded": False, "path": None, "shims": None, "seen": []}


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "host: starts sandboxes or changes the host's mounts, namespaces or cgroups: "
        "runs one at a time, in the host process of `make test` (tests/host_group.py)",
    )


def is_host(item: pytest.Item) -> bool:
    if item.get_closest_marker("host") or item.get_closest_marker("sandbox"):
        return True
    return any(name in HOST_FIXTURES for name in getattr(item, "fixturenames", ()))


# First: `-m host` / `-m "not host"` select on the mark this adds.
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if is_host(item):
            item.add_marker(pytest.mark.host)


def _audit(event: str, args: tuple[Any, ...]) -> None:
    if not _state["guarded"]:
        return
    if event == "subprocess.Popen":
        exe, argv = args[0], args[1]
        if exe is None:  # the program is argv's first word (a shell's tools meet the shims)
            words = argv.split() if isinstance(argv, (str, bytes)) else list(argv or [])
            exe = words[0] if words else ""
        name = os.path.basename(os.fsdecode(exe))
    elif event in ("os.posix_spawn", "os.exec"):
        name = os.path.basename(os.fsdecode(args[0]))
    elif event == "os.mkdir":
        path = os.fsdecode(args[0])
        if path.startswith("/sys/fs/cgroup"):
            _refuse(f"a cgroup ({path}) made")
        return
    else:
        return
    if name in HOST_TOOLS:
        _refuse(f"{name} started")


def _refuse(what: str) -> None:
    # Kept as well as raised: the code under test may catch the error and carry on
    # (a run then just "fails"); the test's end still names the cause.
    _state["seen"].append(what)
    raise PermissionError(_MESSAGE.format(what=what))


sys.addaudithook(_audit)


def _shims(root: Path) -> Path:
    shims = root / "host-tool-shims"
    shims.mkdir(exist_ok=True)
    for tool in HOST_TOOLS:
        script = shims / tool
        script.write_text(
            "#!/bin/sh\n"
            f'echo "${{PYTEST_CURRENT_TEST:-?}}: {tool} $*" >> "${_VIOLATIONS_ENV}"\n'
            f'echo "proctor tests: {tool} started by a test not marked host'
            ' (tests/host_group.py)" >&2\n'
            "exit 97\n"
        )
        script.chmod(0o755)
    return shims


def pytest_sessionstart(session: pytest.Session) -> None:
    # The drivers keep the tool paths they find on first use: find them now, on the
    # real PATH, so a guarded test can never leave a stand-in in a cached driver.
    from proctor.sandbox import backends

    backends()
    root = Path(session.config._tmp_path_factory.getbasetemp())  # type: ignore[attr-defined]
    _state["shims"] = _shims(root)
    os.environ[_VIOLATIONS_ENV] = str(root / "host-tool-violations")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    # Around set-up too: a session fixture made for this test starts its tools here.
    guarded = not is_host(item) and _state["shims"] is not None
    if guarded:
        _state["path"] = os.environ.get("PATH", "")
        os.environ["PATH"] = f"{_state['shims']}{os.pathsep}{_state['path']}"
        _state["guarded"] = True
    try:
        yield
    finally:
        if guarded:
            _state["guarded"] = False
            os.environ["PATH"] = _state["path"]


@pytest.fixture(autouse=True)
def _no_host_tools_in_children(request: pytest.FixtureRequest) -> Iterator[None]:
    log = Path(os.environ.get(_VIOLATIONS_ENV, "/nonexistent"))
    before = log.stat().st_size if log.exists() else 0
    _state["seen"].clear()
    yield
    seen, _state["seen"] = _state["seen"], []
    assert not seen, _MESSAGE.format(what=" and ".join(sorted(set(seen))))
    if is_host(request.node) or not log.exists():
        return
    with log.open("rb") as f:
        f.seek(before)
        new = f.read().decode(errors="replace").strip()
    assert not new, _MESSAGE.format(what=f"a host tool started in a child process ({new})")
