"""The bubblewrap driver: Linux namespaces, a seccomp filter, cgroup limits.

Lighter than gVisor (the guest talks to the host kernel, through the filter)
and used where gVisor cannot run. The guest is the dedicated ``proctor-guest``
user on the host, never root (see ``_identity``), and sees ``/proc`` read-only.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import stat
import subprocess
import tempfile
import threading
import time
import uuid
from collections.abc import Mapping
from pathlib import Path

from proctor.sandbox import _seccomp
from proctor.sandbox._cgroup import RunCgroup, layout
from proctor.sandbox._errors import SandboxSpecInvalid, SandboxStartFailed, SandboxUnavailable
from proctor.sandbox._identity import (
    GUEST_USER,
    HostIdentity,
    guest_namespaces,
    host_identity,
    tools,
)
from proctor.sandbox._model import BackendStatus, SandboxResult, SandboxSpec
from proctor.sandbox._network import network_prefix
from proctor.sandbox._rootfs import RootPlan, guest_env, root_plan
from proctor.sandbox._sources import guest_sources, needing_copies
from proctor.sandbox._supervise import GATE_FAILED, Sink, launch, watch

#: bwrap itself and the init it runs as pid 1 of the new pid namespace.
_OWN_TASKS = 2
#: What the guest's first step (setpriv) needs to become 65534 and drop the rest.
_SETUP_CAPS = ("CAP_SETUID", "CAP_SETGID", "CAP_SETPCAP")


class _Tee:
    """Passes output on and keeps its first bytes, to explain a failed start."""

    def __init__(self, sink: Sink, keep: int = 4096) -> None:
        write = getattr(sink, "write", None) if sink is not None else None
        self._write = write if callable(write) else sink
        self.head = bytearray()
        self._keep = keep

    def __call__(self, data: bytes) -> None:
        if len(self.head) < self._keep:
            self.head += data[: self._keep - len(self.head)]
        if self._write is not None:
            self._write(data)  # type: ignore[operator]


def check_sockets(spec: SandboxSpec) -> None:
    for host in spec.sockets:
        try:
            mode = os.stat(host).st_mode
        except OSError as exc:
            raise SandboxSpecInvalid(f"socket {host} to expose does not exist") from exc
        if not stat.S_ISSOCK(mode):
            raise SandboxSpecInvalid(f"{host} is not a Unix socket; only sockets can be exposed")


class BubblewrapDriver:
    """Runs a spec under ``bwrap`` with every namespace unshared, as the dedicated guest user."""

    name = "bubblewrap"

    def __init__(
        self,
        bwrap: str | None = None,
        plan: RootPlan | None = None,
        *,
        guest_user: str = GUEST_USER,
    ) -> None:
        self._bwrap = bwrap or shutil.which("bwrap") or "/usr/bin/bwrap"
        self._plan = plan
        self._guest_user = guest_user
        self._bpf: bytes | None = None
        self._bpf_tcp: bytes | None = None
        self._bpf_net: bytes | None = None

    @property
    def plan(self) -> RootPlan:
        if self._plan is None:
            self._plan = root_plan()
        return self._plan

    def identity(self) -> HostIdentity:
        """The host user guests run as; SandboxUnavailable (with the fix) when it is missing."""
        return host_identity(self._guest_user)

    def status(self) -> BackendStatus:
        if not os.access(self._bwrap, os.X_OK):
            return BackendStatus(
                self.name, False, "bwrap is not installed (apt-get install bubblewrap)"
            )
        try:
            layout()
            self._filter()
            self.plan  # noqa: B018 - raises when the interpreter cannot be mounted
            identity = self.identity()
            t = tools()
            with guest_namespaces(identity, t) as userns:
                probe = subprocess.run(
                    [
                        self._bwrap,
                        *self._namespace_args(userns),
                        "--ro-bind",
                        "/usr",
                        "/usr",
                        *self._link_args(),
                        "--proc",
                        "/proc",
                        "--",
                        *t.guest_prefix(),
                        "/usr/bin/true",
                    ],
                    capture_output=True,
                    timeout=10,
                    check=False,
                    pass_fds=userns,
                    extra_groups=[],
                )
        except (SandboxUnavailable, SandboxStartFailed) as exc:
            hint = f" (hint: {exc.hint})" if exc.hint else ""
            return BackendStatus(self.name, False, exc.message + hint)
        if probe.returncode != 0:
            why = probe.stderr.decode(errors="replace").strip() or f"exit {probe.returncode}"
            return BackendStatus(self.name, False, f"bwrap cannot create namespaces here: {why}")
        return BackendStatus(
            self.name,
            True,
            f"bwrap works: all namespaces, guest is {identity.user} (uid {identity.uid}) "
            "on the host, seccomp, cgroup limits",
        )

    def _filter(self, loopback_tcp: bool = False, network: bool = False) -> bytes:
        if network:
            if self._bpf_net is None:
                self._bpf_net = _seccomp.compile_bpf(allow_inet_stream=True, allow_inet_dgram=True)
            return self._bpf_net
        if loopback_tcp:
            if self._bpf_tcp is None:
                self._bpf_tcp = _seccomp.compile_bpf(allow_inet_stream=True)
            return self._bpf_tcp
        if self._bpf is None:
            self._bpf = _seccomp.compile_bpf()
        return self._bpf

    def _link_args(self) -> list[str]:
        args: list[str] = []
        for target, link in self.plan.symlinks:
            args += ["--symlink", target, link]
        return args

    @staticmethod
    def _namespace_args(userns: tuple[int, int], network: bool = False) -> list[str]:
        outer, inner = userns
        args = [
            # Set-up as root in the outer namespace, then the guest in the inner one,
            # where 65534 (the dedicated user) is the only id (see _identity).
            "--userns",
            str(outer),
            "--userns2",
            str(inner),
            "--unshare-ipc",
            "--unshare-pid",
            # With a run network the guest stays in the namespace bwrap starts in,
            # the run's own (see run()); without one it gets an empty namespace.
            *(() if network else ("--unshare-net",)),
            "--unshare-uts",
            "--unshare-cgroup-try",
            # bwrap makes sure: no namespace can be created below the guest's.
            "--assert-userns-disabled",
            "--die-with-parent",
            "--new-session",
            "--cap-drop",
            "ALL",
        ]
        for cap in _SETUP_CAPS:
            args += ["--cap-add", cap]
        return args

    def command(
        self,
        spec: SandboxSpec,
        seccomp_fd: int,
        status_fd: int,
        userns: tuple[int, int],
        *,
        sources: Mapping[Path, Path] | None = None,
        guest_prefix: list[str] | None = None,
    ) -> list[str]:
        """The full bwrap command line for ``spec`` (public for tests and the docs).

        ``userns`` are the outer and inner user namespaces' descriptors;
        ``sources`` maps a host directory of the spec to the one to bind instead
        (a copy the guest can read); ``guest_prefix`` is what runs before the
        guest's argv (setpriv, from :func:`_identity.tools`).
        """
        plan = self.plan
        sources = sources or {}
        args = [
            self._bwrap,
            *self._namespace_args(userns, spec.network is not None),
            "--hostname",
            "sandbox",
            "--clearenv",
            *self._parent_dirs(spec),
        ]
        for key, value in guest_env(plan, spec.scratch_path, dict(spec.env)).items():
            args += ["--setenv", key, value]
        for path in plan.ro_binds:
            args += ["--ro-bind", str(path), str(path)]
        args += self._link_args()
        if spec.code_dir is not None:
            args += ["--ro-bind", str(sources.get(spec.code_dir, spec.code_dir)), "/code"]
        for host_dir, guest_dir in spec.ro_dirs.items():
            args += ["--ro-bind", str(sources.get(host_dir, host_dir)), guest_dir]
        # /proc read-only as a whole: /proc/sys, /proc/sysrq-trigger and the rest of the
        # kernel's knobs refuse writes whoever asks. No /sys at all.
        args += ["--proc", "/proc", "--remount-ro", "/proc"]
        args += ["--dev", "/dev", "--remount-ro", "/dev"]
        args += ["--size", str(spec.scratch_bytes), "--perms", "1777", "--tmpfs", spec.scratch_path]
        for host, guest in spec.sockets.items():
            args += ["--bind", str(host), guest]
        if spec.network is not None:
            for host_file, guest_file in spec.network.files.items():
                args += ["--ro-bind", str(host_file), guest_file]
        args += [
            "--remount-ro",
            "/",
            "--seccomp",
            str(seccomp_fd),
            "--json-status-fd",
            str(status_fd),
            "--chdir",
            spec.guest_cwd,
            "--",
            *(guest_prefix if guest_prefix is not None else tools().guest_prefix()),
            *spec.argv,
        ]
        return args

    def _parent_dirs(self, spec: SandboxSpec) -> list[str]:
        """Make every directory above a mount point searchable by the guest.

        bwrap creates the parents of a bind's destination with mode 0700 (its
        options are zero-filled, and zero is taken as the mode the file wants),
        which only ever worked for a guest that was root: the guest would not
        reach the interpreter under /root, the guest library under /opt or the
        broker socket under /run. Made first, 0755, they are made only once.
        """
        targets = [
            *map(str, self.plan.ro_binds),
            "/code",
            *spec.ro_dirs.values(),
            spec.scratch_path,
            *spec.sockets.values(),
            *(spec.network.files.values() if spec.network is not None else ()),
        ]
        parents: list[str] = []
        for target in targets:
            for above in reversed(Path(target).parents):
                if str(above) != "/" and str(above) not in parents:
                    parents.append(str(above))
        args: list[str] = []
        for directory in parents:
            args += ["--perms", "0755", "--dir", directory]
        return args

    def _prepare_sources(
        self, spec: SandboxSpec, cgroup: RunCgroup, run_id: str
    ) -> dict[Path, Path]:
        """Bind what the guest can read in place; copy the rest into a work directory."""
        paths = [*([spec.code_dir] if spec.code_dir is not None else []), *spec.ro_dirs]
        copies = needing_copies(paths)
        if not copies:
            return {}
        # Named and registered before it exists, like gVisor's: a kill mid-copy
        # leaves an entry that names it, for the reaper.
        workdir = Path(tempfile.gettempdir()) / f"proctor-bwrap-{run_id}"
        cgroup.workdir = workdir
        cgroup.register()
        try:
            workdir.mkdir(mode=0o700)
        except OSError as exc:
            cgroup.workdir = None  # someone else's, if it exists: not ours to remove
            raise SandboxUnavailable(f"cannot create {workdir}: {exc.strerror}") from exc
        return guest_sources(paths, copies, workdir)

    def run(
        self,
        spec: SandboxSpec,
        *,
        on_stdout: Sink = None,
        on_stderr: Sink = None,
        cancel: threading.Event | None = None,
    ) -> SandboxResult:
        check_sockets(spec)
        # Before anything of the run exists: without its guest user it does not start.
        identity = self.identity()
        t = tools()
        setup_start = time.monotonic()
        run_id = uuid.uuid4().hex[:16]
        cgroup = RunCgroup(layout(), f"proctor-{run_id}")
        limits = spec.limits
        try:
            sources = self._prepare_sources(spec, cgroup, run_id)
            cgroup.create(
                memory_bytes=limits.memory_bytes, pids=limits.pids + _OWN_TASKS, cpu=limits.cpu
            )
        except BaseException:
            with contextlib.suppress(Exception):
                cgroup.remove()  # the copies, then the entry
            raise
        seccomp_fd = os.memfd_create("proctor-seccomp", os.MFD_CLOEXEC)
        status_r, status_w = os.pipe()
        tee = _Tee(on_stderr)
        try:
            os.write(seccomp_fd, self._filter(spec.loopback_tcp, spec.network is not None))
            os.lseek(seccomp_fd, 0, os.SEEK_SET)
            with guest_namespaces(identity, t) as userns:
                argv = self.command(
                    spec,
                    seccomp_fd,
                    status_w,
                    userns,
                    sources=sources,
                    guest_prefix=t.guest_prefix(),
                )
                if spec.network is not None:
                    # bwrap itself starts in the run's namespace (made by root: the
                    # guest holds no capability over it).
                    argv = [*network_prefix(spec.network), *argv]
                started = time.monotonic()
                # No supplementary group of ours reaches the guest (root's would).
                proc = launch(
                    argv, cgroup, pass_fds=(seccomp_fd, status_w, *userns), extra_groups=()
                )
            os.close(status_w)
            status_w = -1
            outcome = watch(
                proc,
                cgroup,
                limits,
                on_stdout=on_stdout,
                on_stderr=tee,
                started=started,
                cancel=cancel,
            )
            status = _read_status(status_r)
        finally:
            os.close(seccomp_fd)
            os.close(status_r)
            if status_w >= 0:
                os.close(status_w)
            with contextlib.suppress(Exception):
                cgroup.kill()
            cgroup.remove()
        if "child-pid" not in status and outcome.reason.value in ("exit", "signal"):
            message = tee.head.decode(errors="replace").strip()
            if outcome.exit_code == GATE_FAILED and not message:
                message = "the supervisor could not release the sandbox"
            raise SandboxStartFailed(
                f"bubblewrap could not start the sandbox: {message or f'exit {outcome.exit_code}'}",
                hint="`proctor sandbox backends` checks whether bwrap works on this machine",
            )
        return SandboxResult(
            run_id=run_id,
            backend=self.name,
            exit_code=outcome.exit_code,
            reason=outcome.reason,
            duration_seconds=time.monotonic() - started,
            setup_seconds=started - setup_start,
            stdout_bytes=outcome.stdout_bytes,
            stderr_bytes=outcome.stderr_bytes,
            stdout_dropped=outcome.stdout_dropped,
            stderr_dropped=outcome.stderr_dropped,
            memory_peak_bytes=outcome.memory_peak,
            platform=None,
            limits=limits,
        )


def _read_status(fd: int) -> dict[str, object]:
    os.set_blocking(fd, False)
    raw = b""
    with contextlib.suppress(BlockingIOError):
        while chunk := os.read(fd, 65536):
            raw += chunk
    merged: dict[str, object] = {}
    decoder = json.JSONDecoder()
    text = raw.decode(errors="replace")
    pos = 0
    while pos < len(text):
        while pos < len(text) and text[pos].isspace():
            pos += 1
        if pos >= len(text):
            break
        try:
            obj, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            break
        if isinstance(obj, dict):
            merged.update(obj)
    return merged
