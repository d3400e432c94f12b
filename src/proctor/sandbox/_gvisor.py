"""The gVisor driver: ``runsc`` with an OCI bundle this module writes, one per run.

The guest's system calls are served by gVisor's own kernel (the sentry); the
host kernel sees only the sentry's narrow, seccomp-filtered use of it. The
bundle's root is an empty read-only directory with explicit read-only binds,
so nothing of the host is visible unless listed here.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import tempfile
import threading
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from proctor.sandbox import _seccomp
from proctor.sandbox._bubblewrap import check_sockets
from proctor.sandbox._cgroup import RunCgroup, layout
from proctor.sandbox._errors import SandboxCleanupFailed, SandboxStartFailed, SandboxUnavailable
from proctor.sandbox._identity import GUEST_ID
from proctor.sandbox._model import BackendStatus, Limits, MiB, Reason, SandboxResult, SandboxSpec
from proctor.sandbox._network import runsc_prefix
from proctor.sandbox._rootfs import RootPlan, guest_env, root_plan
from proctor.sandbox._sources import guest_sources, needing_copies
from proctor.sandbox._supervise import Outcome, Sink, launch, watch

#: runsc, the sentry, the gofer and the ptrace stub master use about 40 host
#: tasks idle; each guest process adds a stub process of about 3 threads.
#: The host pids ceiling is translated so that ``Limits.pids`` means guest processes.
_BASE_TASKS = 96
_TASKS_PER_GUEST_PID = 4
#: The sentry and gofer themselves, charged to the same memory cgroup as the guest.
_MEMORY_OVERHEAD = 64 * MiB
_PLATFORM_ORDER = ("systrap", "kvm", "ptrace")
_PROBE_TIMEOUT = 5.0


@dataclass
class _Prepared:
    run_id: str
    container_id: str
    workdir: Path
    cgroup: RunCgroup
    argv: list[str]

    @property
    def state_dir(self) -> Path:
        return self.workdir / "state"

    @property
    def log_path(self) -> Path:
        return self.workdir / "runsc.log"


def _runsc_errors(log: Path) -> list[str]:
    errors: list[str] = []
    with contextlib.suppress(OSError):
        for line in log.read_text(errors="replace").splitlines():
            with contextlib.suppress(ValueError):
                entry = json.loads(line)
                if isinstance(entry, dict) and entry.get("level") in ("error", "fatal"):
                    errors.append(str(entry.get("msg", "")))
    return errors


class GVisorDriver:
    """Runs a spec under gVisor's ``runsc`` with no network and a read-only root."""

    name = "gvisor"

    def __init__(
        self, runsc: str | None = None, *, platform: str | None = None, plan: RootPlan | None = None
    ) -> None:
        self._runsc = runsc or shutil.which("runsc") or "/usr/bin/runsc"
        self._platform = platform or os.environ.get("PROCTOR_GVISOR_PLATFORM") or None
        self._plan = plan
        self._lock = threading.Lock()

    @property
    def plan(self) -> RootPlan:
        if self._plan is None:
            self._plan = root_plan()
        return self._plan

    # -- platform -----------------------------------------------------------------

    @property
    def platform(self) -> str:
        """The gVisor platform in use, probed once: systrap or kvm where they work, else ptrace."""
        with self._lock:
            if self._platform is None:
                self._platform = self._probe_platform()
            return self._platform

    def _probe_platform(self) -> str:
        if not os.access(self._runsc, os.X_OK):
            raise SandboxUnavailable("runsc is not installed (apt-get install runsc)")
        cache_key = self._cache_key()
        cached = _read_platform_cache().get(cache_key)
        if cached in _PLATFORM_ORDER:
            return cached
        listing = subprocess.run(
            [self._runsc, "platforms"], capture_output=True, text=True, timeout=10, check=False
        )
        # Releases before 2023 have no `platforms` command: probe every name then.
        listed = listing.stdout.split() if listing.returncode == 0 else list(_PLATFORM_ORDER)
        tried: list[str] = []
        for candidate in _PLATFORM_ORDER:
            if candidate not in listed:
                continue
            if candidate == "kvm" and not os.access("/dev/kvm", os.R_OK | os.W_OK):
                continue
            why = self._probe(candidate)
            if why is None:
                _write_platform_cache(cache_key, candidate)
                return candidate
            tried.append(f"{candidate}: {why}")
        raise SandboxUnavailable(
            "no gVisor platform works on this machine (" + "; ".join(tried or ["none listed"]) + ")"
        )

    def _cache_key(self) -> str:
        # A probe that hangs (kvm) costs seconds: remember the answer for this
        # runsc binary on this kernel, and probe again when either changes.
        real = os.path.realpath(self._runsc)
        st = os.stat(real)
        kvm = os.access("/dev/kvm", os.R_OK | os.W_OK)
        return f"{real}:{st.st_size}:{st.st_mtime_ns}:{os.uname().release}:kvm={kvm}"

    def _probe(self, platform: str) -> str | None:
        """Run ``true`` on ``platform``; None if it worked, else why not."""
        spec = SandboxSpec(argv=("/usr/bin/true",), limits=Limits(wall_seconds=_PROBE_TIMEOUT))
        prepared = self._prepare(spec, platform=platform)
        err = bytearray()
        try:
            proc = launch(prepared.argv, prepared.cgroup)
            outcome = watch(
                proc,
                prepared.cgroup,
                spec.limits,
                on_stdout=None,
                on_stderr=err.extend,
                started=time.monotonic(),
            )
        finally:
            self._teardown(prepared)
        if outcome.reason is Reason.TIMEOUT:
            # kvm on a nested or paravirtualised host hangs instead of failing.
            return f"no answer within {_PROBE_TIMEOUT:.0f} s"
        if outcome.exit_code != 0:
            errors = _runsc_errors(prepared.log_path) if prepared.log_path.exists() else []
            why = errors[-1] if errors else err.decode(errors="replace").strip()
            return why[:300] or f"exit {outcome.exit_code}"
        return None

    def status(self) -> BackendStatus:
        # Asked again each time: the platform is probed once, and runsc removed since
        # must not go on being reported as working (a readiness probe asks this).
        if not os.access(self._runsc, os.X_OK):
            return BackendStatus(self.name, False, "runsc is not installed (apt-get install runsc)")
        try:
            layout()
            self.plan  # noqa: B018 - raises when the interpreter cannot be mounted
            platform = self.platform
        except SandboxUnavailable as exc:
            return BackendStatus(self.name, False, exc.message)
        return BackendStatus(
            self.name, True, f"runsc works with platform {platform}, no network, cgroup limits"
        )

    # -- bundle -------------------------------------------------------------------

    def config(
        self, spec: SandboxSpec, sources: Mapping[Path, Path] | None = None
    ) -> dict[str, object]:
        """The OCI runtime config for ``spec`` (public for tests and the docs).

        ``sources`` maps a host directory of the spec to the one to bind instead
        (a copy the guest can read, see ``_sources``).
        """
        plan = self.plan
        sources = sources or {}
        env = guest_env(plan, spec.scratch_path, dict(spec.env))
        mounts: list[dict[str, object]] = [
            {"destination": "/proc", "type": "proc", "source": "proc"},
        ]
        for path in plan.ro_binds:
            mounts.append(
                {
                    "destination": str(path),
                    "type": "bind",
                    "source": str(path),
                    "options": ["rbind", "ro"],
                }
            )
        if spec.code_dir is not None:
            mounts.append(
                {
                    "destination": "/code",
                    "type": "bind",
                    "source": str(sources.get(spec.code_dir, spec.code_dir)),
                    "options": ["rbind", "ro"],
                }
            )
        for host_dir, guest_dir in spec.ro_dirs.items():
            mounts.append(
                {
                    "destination": guest_dir,
                    "type": "bind",
                    "source": str(sources.get(host_dir, host_dir)),
                    "options": ["rbind", "ro"],
                }
            )
        mounts.append(
            {
                "destination": spec.scratch_path,
                "type": "tmpfs",
                "source": "tmpfs",
                "options": ["nosuid", "nodev", f"size={spec.scratch_bytes}", "mode=1777"],
            }
        )
        for host, guest in spec.sockets.items():
            mounts.append(
                {"destination": guest, "type": "bind", "source": str(host), "options": ["bind"]}
            )
        network: dict[str, str] = {"type": "network"}
        if spec.network is not None:
            for host_file, guest_file in spec.network.files.items():
                mounts.append({"destination": guest_file, "type": "bind",
                               "source": str(host_file), "options": ["bind", "ro"]})  # fmt: skip
            # gVisor takes the namespace's interface into its own network stack.
            network["path"] = spec.network.guest_path()
        no_caps: list[str] = []
        return {
            "ociVersion": "1.0.2",
            "process": {
                "terminal": False,
                "user": {"uid": GUEST_ID, "gid": GUEST_ID},
                "args": list(spec.argv),
                "env": [f"{k}={v}" for k, v in env.items()],
                "cwd": spec.guest_cwd,
                "capabilities": {
                    k: no_caps
                    for k in ("bounding", "effective", "inheritable", "permitted", "ambient")
                },
                "noNewPrivileges": True,
                "rlimits": [{"type": "RLIMIT_NOFILE", "hard": 1024, "soft": 1024}],
            },
            "root": {"path": "rootfs", "readonly": True},
            "hostname": "sandbox",
            "mounts": mounts,
            "linux": {
                "namespaces": [
                    *({"type": t} for t in ("pid", "ipc", "uts", "mount")),
                    network,
                ],
                "seccomp": _seccomp.oci_seccomp(
                    allow_inet_stream=spec.loopback_tcp or spec.network is not None,
                    allow_inet_dgram=spec.network is not None,
                ),
                "maskedPaths": [],
                "readonlyPaths": [],
            },
        }

    def _write_bundle(self, spec: SandboxSpec, bundle: Path, sources: Mapping[Path, Path]) -> None:
        rootfs = bundle / "rootfs"
        rootfs.mkdir(parents=True)
        guest_dirs = [
            "/proc",
            "/dev",
            "/code",
            spec.scratch_path,
            *map(str, self.plan.ro_binds),
            *spec.ro_dirs.values(),
        ]
        for d in guest_dirs:
            (rootfs / d.lstrip("/")).mkdir(parents=True, exist_ok=True)
        for target, link in self.plan.symlinks:
            (rootfs / link.lstrip("/")).symlink_to(target)
        files = [*spec.sockets.values(), *(spec.network.files.values() if spec.network else ())]
        for guest in files:
            dest = rootfs / guest.lstrip("/")
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.touch()
        (bundle / "config.json").write_text(json.dumps(self.config(spec, sources)))

    def _prepare(self, spec: SandboxSpec, *, platform: str | None = None) -> _Prepared:
        run_id = uuid.uuid4().hex[:16]
        # A fresh name (64 random bits, created exclusively), registered before it
        # exists: a supervisor killed while writing the bundle leaves an entry
        # naming it, not an orphan directory nobody knows about.
        workdir = Path(tempfile.gettempdir()) / f"proctor-gvisor-{run_id}"
        cgroup = RunCgroup(layout(), f"proctor-{run_id}", workdir)
        cgroup.register()
        try:
            workdir.mkdir(mode=0o700)
        except OSError as exc:
            cgroup.workdir = None  # someone else's, if it exists: not ours to remove
            with contextlib.suppress(Exception):
                cgroup.remove()
            raise SandboxUnavailable(f"cannot create {workdir}: {exc.strerror}") from exc
        try:
            # The guest (65534 in the sentry) reads its code in place only where
            # anyone may; else a copy in the work directory, as bubblewrap does.
            paths = [*([spec.code_dir] if spec.code_dir is not None else []), *spec.ro_dirs]
            sources = guest_sources(paths, needing_copies(paths), workdir)
            bundle = workdir / "bundle"
            self._write_bundle(spec, bundle, sources)
            (workdir / "state").mkdir()
            limits = spec.limits
            # Scratch is a tmpfs inside the sentry, so its pages count as memory too.
            cgroup.create(
                memory_bytes=limits.memory_bytes + spec.scratch_bytes + _MEMORY_OVERHEAD,
                pids=_BASE_TASKS + _TASKS_PER_GUEST_PID * limits.pids,
                cpu=limits.cpu,
            )
            container_id = f"proctor-{run_id}"
            argv = [
                *(runsc_prefix() if spec.network is not None else ()),
                self._runsc,
                "--root",
                str(workdir / "state"),
                "--network=sandbox" if spec.network is not None else "--network=none",
                f"--platform={platform or self.platform}",
                # The supervisor has put runsc in the run's cgroup already; without
                # this runsc would move the sandbox into cgroups of its own naming.
                "--ignore-cgroups",
                "--oci-seccomp",
                "--log",
                str(workdir / "runsc.log"),
                "--log-format=json",
            ]
            if spec.sockets:
                # Safe only because the root holds nothing but explicit binds: with
                # this flag every host socket visible inside would be reachable.
                argv.append("--host-uds=open")
            argv += ["run", "--bundle", str(bundle), container_id]
        except BaseException:
            with contextlib.suppress(Exception):
                cgroup.remove()  # the cgroup, the work directory, then the entry
            raise
        return _Prepared(run_id, container_id, workdir, cgroup, argv)

    def _teardown(self, prepared: _Prepared) -> None:
        """Kill the whole tree, then remove the cgroup, runsc's state and the bundle.

        runsc keeps no state outside its private ``--root`` and mounts nothing in
        the host's mount namespace (the gofer binds inside a namespace of its
        own), so once the cgroup is empty removing the work directory is the
        whole of ``runsc delete``. Calling runsc itself on a killed sandbox
        would wait a second or two for an answer that cannot come.
        """
        errors: list[str] = []
        try:
            prepared.cgroup.kill()
        except SandboxCleanupFailed as exc:
            errors.append(exc.message)
            # Last resort when SIGKILL did not empty the cgroup: let runsc try.
            subprocess.run(
                [
                    self._runsc,
                    "--root",
                    str(prepared.state_dir),
                    "delete",
                    "--force",
                    prepared.container_id,
                ],
                capture_output=True,
                timeout=30,
                check=False,
            )
        try:
            # The cgroup, then the work directory (bundle, runsc state, log), then
            # the registry entry, so that a kill in between leaves it reapable.
            prepared.cgroup.remove()
        except SandboxCleanupFailed as exc:
            errors.append(exc.message)
        if errors:
            raise SandboxCleanupFailed("; ".join(errors))

    # -- runs ---------------------------------------------------------------------

    def run(
        self,
        spec: SandboxSpec,
        *,
        on_stdout: Sink = None,
        on_stderr: Sink = None,
        cancel: threading.Event | None = None,
    ) -> SandboxResult:
        check_sockets(spec)
        platform = self.platform
        setup_start = time.monotonic()
        prepared = self._prepare(spec, platform=platform)
        try:
            started = time.monotonic()
            proc = launch(prepared.argv, prepared.cgroup)
            outcome = watch(
                proc,
                prepared.cgroup,
                spec.limits,
                on_stdout=on_stdout,
                on_stderr=on_stderr,
                started=started,
                cancel=cancel,
            )
            self._raise_start_failure(prepared, outcome)
        finally:
            self._teardown(prepared)
        return self._result(prepared, spec, outcome, setup_seconds=started - setup_start)

    def _raise_start_failure(self, prepared: _Prepared, outcome: Outcome) -> None:
        if outcome.reason is not Reason.EXIT or outcome.exit_code != 128:
            return
        errors = _runsc_errors(prepared.log_path)
        if errors:
            raise SandboxStartFailed(
                f"gVisor could not start the sandbox: {errors[-1]}",
                hint="`proctor sandbox backends` checks whether runsc works on this machine",
            )

    def _result(
        self, prepared: _Prepared, spec: SandboxSpec, outcome: Outcome, *, setup_seconds: float
    ) -> SandboxResult:
        return SandboxResult(
            run_id=prepared.run_id,
            backend=self.name,
            exit_code=outcome.exit_code,
            reason=outcome.reason,
            duration_seconds=time.monotonic() - outcome.started,
            setup_seconds=setup_seconds,
            stdout_bytes=outcome.stdout_bytes,
            stderr_bytes=outcome.stderr_bytes,
            stdout_dropped=outcome.stdout_dropped,
            stderr_dropped=outcome.stderr_dropped,
            memory_peak_bytes=outcome.memory_peak,
            platform=self.platform,
            limits=spec.limits,
        )


def _cache_path() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return Path(base) / "proctor" / "gvisor-platform.json"


def _read_platform_cache() -> dict[str, str]:
    try:
        data = json.loads(_cache_path().read_text())
    except (OSError, ValueError):
        return {}
    return {str(k): str(v) for k, v in data.items()} if isinstance(data, dict) else {}


def _write_platform_cache(key: str, platform: str) -> None:
    path = _cache_path()
    # A cache that cannot be written only costs the next process another probe.
    with contextlib.suppress(OSError):
        path.parent.mkdir(parents=True, exist_ok=True)
        data = _read_platform_cache()
        data[key] = platform
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data))
        tmp.replace(path)
