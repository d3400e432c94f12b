"""One cgroup per run, on cgroup v1, v2 or the hybrid of both.

The kernel enforces the limits; this module only creates the group, puts the
sandbox's first process in it before that process does anything, reads the
counters that tell why a run ended, kills everything in it, and removes it.
"""

from __future__ import annotations

import contextlib
import enum
import errno
import functools
import json
import os
import shutil
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from proctor.sandbox._errors import SandboxCleanupFailed, SandboxUnavailable
from proctor.sandbox._owners import owner_alive, owner_name, parse_owner

CGROUP_ROOT = Path("/sys/fs/cgroup")
_V1_CONTROLLERS = ("memory", "pids", "cpu")
_CFS_PERIOD_US = 100_000
_V2_KEY = "v2"  # the unified hierarchy's directory in a registry entry


class CgroupMode(enum.StrEnum):
    V1 = "v1"
    V2 = "v2"
    HYBRID = "hybrid"  # v1 controllers, plus a v2 tree that at least offers cgroup.kill


@dataclass(frozen=True)
class CgroupLayout:
    """Where each controller lives on this machine, and where this process sits in it."""

    mode: CgroupMode
    v1: dict[str, Path]  # controller -> directory of this process's cgroup in that hierarchy
    v2: Path | None  # this process's cgroup directory in the unified hierarchy


def _is_cgroup2(path: Path) -> bool:
    return (path / "cgroup.controllers").exists()


def _own_paths() -> tuple[dict[str, str], str | None]:
    by_controller: dict[str, str] = {}
    unified: str | None = None
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        hid, controllers, path = line.split(":", 2)
        if hid == "0" and controllers == "":
            unified = path
            continue
        for c in controllers.split(","):
            by_controller[c] = path
    return by_controller, unified


def detect(root: Path = CGROUP_ROOT) -> CgroupLayout:
    """Find out whether the machine has cgroup v1, v2 or a hybrid, and where we are in it."""
    if not root.is_dir():
        raise SandboxUnavailable(f"{root} does not exist: this kernel exposes no cgroups")
    own_v1, own_v2 = _own_paths()
    if _is_cgroup2(root):
        if own_v2 is None:
            raise SandboxUnavailable("/proc/self/cgroup names no cgroup v2 path")
        return CgroupLayout(CgroupMode.V2, {}, runs_parent(root / own_v2.lstrip("/")))
    v1: dict[str, Path] = {}
    for controller in _V1_CONTROLLERS:
        mount = root / controller
        if (mount / "cgroup.procs").exists() and controller in own_v1:
            v1[controller] = mount / own_v1[controller].lstrip("/")
    missing = [c for c in ("memory", "pids") if c not in v1]
    if missing:
        raise SandboxUnavailable(
            f"cgroup v1 controllers {', '.join(missing)} are not mounted under {root}",
            hint="mount them, or boot with cgroup v2 (systemd.unified_cgroup_hierarchy=1)",
        )
    unified = root / "unified"
    if _is_cgroup2(unified) and own_v2 is not None:
        return CgroupLayout(CgroupMode.HYBRID, v1, unified / own_v2.lstrip("/"))
    return CgroupLayout(CgroupMode.V1, v1, None)


def _write(path: Path, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


def _read_kv(path: Path) -> dict[str, int]:
    out: dict[str, int] = {}
    with contextlib.suppress(OSError):
        for line in path.read_text().splitlines():
            key, _, value = line.partition(" ")
            with contextlib.suppress(ValueError):
                out[key] = int(value)
    return out


class RunCgroup:
    """The cgroup(s) of one run: created with limits, filled, read, killed, removed."""

    def __init__(self, layout: CgroupLayout, name: str, workdir: Path | None = None) -> None:
        self.layout = layout
        self.name = name
        self.v1 = {c: parent / name for c, parent in layout.v1.items()}
        self.v2 = layout.v2 / name if layout.v2 is not None else None
        #: The run's own files (gVisor's bundle and runsc state), removed with it.
        self.workdir = workdir
        self._created: list[Path] = []

    @classmethod
    def existing(
        cls,
        layout: CgroupLayout,
        name: str,
        workdir: Path | None = None,
        recorded: dict[str, str] | None = None,
    ) -> RunCgroup:
        """A run's cgroup made by another (perhaps dead) process, to kill and remove.

        ``recorded`` are the directories its owner registered: under the owner's
        own cgroup, which need not be ours (a `proctor run` from a login shell,
        reaped by a `proctor serve` under systemd). Only directories named after
        the run below the cgroup mount are taken.
        """
        cgroup = cls(layout, name, workdir)
        if recorded is not None:
            dirs = {k: Path(v) for k, v in recorded.items() if _is_run_dir(Path(v), name)}
            cgroup.v2 = dirs.pop(_V2_KEY, None)
            cgroup.v1 = dirs
        cgroup._created = [d for d in cgroup.directories if d.exists()]
        return cgroup

    def recorded(self) -> dict[str, str]:
        """Where this run's cgroup directories are, for the registry."""
        dirs = {c: str(p) for c, p in self.v1.items()}
        if self.v2 is not None:
            dirs[_V2_KEY] = str(self.v2)
        return dirs

    @property
    def directories(self) -> list[Path]:
        dirs = list(self.v1.values())
        if self.v2 is not None:
            dirs.append(self.v2)
        return dirs

    def register(self) -> None:
        """Record this process as the run's owner, before anything of the run exists:
        whatever a SIGKILL interrupts from here on, a successor finds and removes."""
        try:
            _register(self.name, self.workdir, self.recorded())
        except OSError as exc:
            raise SandboxUnavailable(
                f"cannot register the run {self.name} in {REGISTRY}: {exc.strerror}",
                hint="the runtime needs write access to it (run as root, or set "
                "PROCTOR_SANDBOX_REGISTRY to a directory of this user)",
            ) from exc

    def create(self, *, memory_bytes: int, pids: int, cpu: float) -> None:
        if not (REGISTRY / self.name).exists():
            self.register()
        try:
            self._create(memory_bytes=memory_bytes, pids=pids, cpu=cpu)
        except OSError as exc:
            with contextlib.suppress(SandboxCleanupFailed):
                self.remove()
            raise SandboxUnavailable(
                f"cannot create the run's cgroup {self.name}: {exc.strerror} ({exc.filename})",
                hint="the runtime needs write access to /sys/fs/cgroup (run as root, "
                "or delegate a cgroup subtree to this user)",
            ) from exc

    def _create(self, *, memory_bytes: int, pids: int, cpu: float) -> None:
        quota = max(1000, int(cpu * _CFS_PERIOD_US))
        if self.layout.mode is CgroupMode.V2:
            assert self.v2 is not None
            parent = self.v2.parent
            # Controllers must be enabled in the parent before a child can use them.
            wanted = {"memory", "pids", "cpu"} & set(
                (parent / "cgroup.controllers").read_text().split()
            )
            enable_for_children(parent, wanted)
            self.v2.mkdir()
            self._created.append(self.v2)
            _write(self.v2 / "memory.max", str(memory_bytes))
            with contextlib.suppress(FileNotFoundError):
                _write(self.v2 / "memory.swap.max", "0")
            _write(self.v2 / "pids.max", str(pids))
            with contextlib.suppress(FileNotFoundError):
                _write(self.v2 / "cpu.max", f"{quota} {_CFS_PERIOD_US}")
            return
        for path in self.v1.values():
            path.mkdir()
            self._created.append(path)
        mem = self.v1["memory"]
        _write(mem / "memory.limit_in_bytes", str(memory_bytes))
        # No swap either: memsw must follow the plain limit, and exists only with swap accounting.
        with contextlib.suppress(FileNotFoundError, PermissionError):
            _write(mem / "memory.memsw.limit_in_bytes", str(memory_bytes))
        _write(self.v1["pids"] / "pids.max", str(pids))
        if "cpu" in self.v1:
            _write(self.v1["cpu"] / "cpu.cfs_period_us", str(_CFS_PERIOD_US))
            _write(self.v1["cpu"] / "cpu.cfs_quota_us", str(quota))
        if self.v2 is not None:
            self.v2.mkdir()
            self._created.append(self.v2)

    def attach(self, pid: int) -> None:
        """Move ``pid`` in; it must not have forked yet, or its children escape the limits."""
        for path in self.directories:
            _write(path / "cgroup.procs", str(pid))

    def oom_kills(self) -> int:
        if self.layout.mode is CgroupMode.V2:
            assert self.v2 is not None
            return _read_kv(self.v2 / "memory.events").get("oom_kill", 0)
        return _read_kv(self.v1["memory"] / "memory.oom_control").get("oom_kill", 0)

    def pids_refusals(self) -> int:
        if self.layout.mode is CgroupMode.V2:
            assert self.v2 is not None
            return _read_kv(self.v2 / "pids.events").get("max", 0)
        return _read_kv(self.v1["pids"] / "pids.events").get("max", 0)

    def memory_peak(self) -> int | None:
        if self.layout.mode is CgroupMode.V2:
            assert self.v2 is not None
            path = self.v2 / "memory.peak"
        else:
            path = self.v1["memory"] / "memory.max_usage_in_bytes"
        try:
            return int(path.read_text())
        except (OSError, ValueError):
            return None

    def pids(self) -> set[int]:
        found: set[int] = set()
        for path in self.directories:
            with contextlib.suppress(FileNotFoundError):
                found.update(int(p) for p in (path / "cgroup.procs").read_text().split())
        return found

    def kill(self, timeout: float = 10.0) -> None:
        """SIGKILL everything in the run, and wait until the cgroup is empty."""
        if self.v2 is not None and self.v2.exists():
            with contextlib.suppress(FileNotFoundError, PermissionError, OSError):
                _write(self.v2 / "cgroup.kill", "1")
        deadline = time.monotonic() + timeout
        while True:
            # Without cgroup.kill a forking tree could outrun one pass; the pids
            # ceiling bounds how many passes that can take.
            remaining = self.pids()
            if not remaining:
                return
            for pid in remaining:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            if time.monotonic() > deadline:
                raise SandboxCleanupFailed(
                    f"processes {sorted(remaining)} of run {self.name} survive SIGKILL",
                    hint="they may be stuck in uninterruptible sleep (D state); check `ps`",
                )
            time.sleep(0.01)

    def remove(self, timeout: float = 5.0) -> None:
        """Remove the cgroup directories, then the work directory, then the registry
        entry: last, so that a SIGKILL anywhere in between leaves it for a successor."""
        deadline = time.monotonic() + timeout
        for path in reversed(self._created):
            while True:
                try:
                    path.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError as exc:
                    # EBUSY while the last killed task is still being reaped.
                    if time.monotonic() > deadline:
                        raise SandboxCleanupFailed(
                            f"cannot remove cgroup {path}: {exc.strerror}"
                        ) from exc
                    time.sleep(0.01)
        self._created.clear()
        if self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)
            if self.workdir.exists():
                raise SandboxCleanupFailed(f"cannot remove {self.workdir}")
        _unregister(self.name)


@functools.cache
def layout() -> CgroupLayout:
    """The machine's layout, detected once per process (it does not change under us)."""
    return detect()


#: Which process owns each live sandbox, so that a supervisor restarted after a
#: crash can find and remove what its dead predecessor left running. On tmpfs:
#: a reboot clears it, as it clears the cgroups it describes.
REGISTRY = Path(os.environ.get("PROCTOR_SANDBOX_REGISTRY", "/run/proctor-sandboxes"))
_STAGING = ".tmp-"


#: The leaf a cgroup v2 parent's own processes move into so that runs can nest
#: beside them (the kernel's "no internal processes" rule).
LEAF = "proctor-supervisor"


def runs_parent(own: Path) -> Path:
    """Where this process's runs nest on cgroup v2: beside it, once it has moved
    into :data:`LEAF` (its parent), else under its own cgroup."""
    return own.parent if own.name == LEAF else own


def enable_for_children(parent: Path, controllers: set[str]) -> None:
    """Enable ``controllers`` for ``parent``'s children. cgroup v2 refuses that
    (EBUSY) while ``parent`` itself holds processes, unless it is the root of the
    hierarchy; in a container it never is (the pod's cgroup holds ``serve``). Then
    every process of ``parent`` first moves into the leaf child :data:`LEAF`, as
    container runtimes do for themselves, and runs nest beside it."""
    enabled = set((parent / "cgroup.subtree_control").read_text().split())
    for controller in sorted(controllers - enabled):
        try:
            _write(parent / "cgroup.subtree_control", f"+{controller}")
        except OSError as exc:
            if exc.errno != errno.EBUSY:
                raise
            _move_into_leaf(parent)
            _write(parent / "cgroup.subtree_control", f"+{controller}")


def _move_into_leaf(parent: Path) -> None:
    leaf = parent / LEAF
    leaf.mkdir(exist_ok=True)
    for pid in (parent / "cgroup.procs").read_text().split():
        # A process gone meanwhile (ESRCH) needs no moving.
        with contextlib.suppress(ProcessLookupError):
            _write(leaf / "cgroup.procs", pid)


def _is_run_dir(path: Path, name: str) -> bool:
    return (
        path.is_absolute()
        and path.name == name
        and ".." not in path.parts
        and CGROUP_ROOT in path.parents
    )


def _is_workdir(path: Path) -> bool:
    return path.is_absolute() and ".." not in path.parts and path.name.startswith("proctor-")


def _register(name: str, workdir: Path | None, cgroups: dict[str, str]) -> None:
    REGISTRY.mkdir(mode=0o700, parents=True, exist_ok=True)
    owner = owner_name()
    entry = {
        "pid": os.getpid(),
        "start": owner.partition("-")[2],
        "workdir": str(workdir or ""),
        "cgroups": cgroups,
    }
    # Written aside and renamed: a SIGKILL mid-write must not leave an entry that
    # names nobody (it would never be reaped). The staging name carries the owner.
    staged = REGISTRY / f"{_STAGING}{owner}-{name}"
    staged.write_text(json.dumps(entry))
    staged.replace(REGISTRY / name)


def _unregister(name: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        (REGISTRY / name).unlink()


def reap_orphans() -> list[str]:
    """Kill and remove every sandbox whose owning process is gone; returns their names.

    A process that died with SIGKILL never ran its clean-up: its sandbox may still
    be running (runsc does not die with its parent), holding its cgroup and work
    directory. The owner is matched by pid and start time, so a reused pid is not
    mistaken for the owner, and a live owner's sandboxes are never touched.
    Raises SandboxCleanupFailed, after trying every orphan, if some could not be
    removed; their entries stay for the next attempt.
    """
    reaped: list[str] = []
    failures: list[str] = []
    if not REGISTRY.is_dir():
        return reaped
    for path in sorted(REGISTRY.iterdir()):
        if path.name.startswith(_STAGING):
            owner = parse_owner("-".join(path.name[len(_STAGING) :].split("-")[:2]))
            if owner is not None and not owner_alive(*owner):
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
            continue
        try:
            entry = json.loads(path.read_text())
            pid, start = int(entry["pid"]), entry.get("start")
            workdir = Path(entry["workdir"]) if entry.get("workdir") else None
            if workdir is not None and not _is_workdir(workdir):
                workdir = None  # not a directory a driver makes: not ours to delete
            cgroups = entry.get("cgroups")
            recorded = {str(k): str(v) for k, v in cgroups.items()} if cgroups else None
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            continue  # not an entry this module wrote
        if owner_alive(pid, start):
            continue  # its owner is alive: not ours to touch
        cgroup = RunCgroup.existing(layout(), path.name, workdir, recorded)
        try:
            cgroup.kill()
            cgroup.remove()  # the entry goes last, with the work directory
        except SandboxCleanupFailed as exc:
            failures.append(exc.message)
            continue
        reaped.append(path.name)
    if failures:
        raise SandboxCleanupFailed(
            f"{len(failures)} orphaned sandbox(es) could not be removed: " + "; ".join(failures)
        )
    return reaped
