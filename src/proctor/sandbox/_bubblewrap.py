"""The bubblewrap driver: Linux namespaces, a seccomp filter, cgroup limits.

Lighter than gVisor (the guest talks to the host kernel, through the filter)
and used where gVisor cannot run.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import stat
import subprocess
import threading
import time
import uuid

from proctor.sandbox import _seccomp
from proctor.sandbox._cgroup import RunCgroup, layout
from proctor.sandbox._errors import SandboxSpecInvalid, SandboxStartFailed, SandboxUnavailable
from proctor.sandbox._model import BackendStatus, SandboxResult, SandboxSpec
from proctor.sandbox._rootfs import RootPlan, guest_env, root_plan
from proctor.sandbox._supervise import GATE_FAILED, Sink, launch, watch

#: bwrap itself and the init it runs as pid 1 of the new pid namespace.
_OWN_TASKS = 2
_GUEST_UID = 65534


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
    """Runs a spec under ``bwrap`` with every namespace unshared."""

    name = "bubblewrap"

    def __init__(self, bwrap: str | None = None, plan: RootPlan | None = None) -> None:
        self._bwrap = bwrap or shutil.which("bwrap") or "/usr/bin/bwrap"
        self._plan = plan
        self._bpf: bytes | None = None
        self._bpf_tcp: bytes | None = None

    @property
    def plan(self) -> RootPlan:
        if self._plan is None:
            self._plan = root_plan()
        return self._plan

    def status(self) -> BackendStatus:
        if not os.access(self._bwrap, os.X_OK):
            return BackendStatus(
                self.name, False, "bwrap is not installed (apt-get install bubblewrap)"
            )
        try:
            layout()
            self._filter()
            self.plan  # noqa: B018 - raises when the interpreter cannot be mounted
        except SandboxUnavailable as exc:
            return BackendStatus(self.name, False, exc.message)
        probe = subprocess.run(
            [
                self._bwrap,
                "--unshare-all",
                "--unshare-user",
                "--ro-bind",
                "/usr",
                "/usr",
                *self._link_args(),
                "--",
                "/usr/bin/true",
            ],
            capture_output=True,
            timeout=10,
            check=False,
        )
        if probe.returncode != 0:
            why = probe.stderr.decode(errors="replace").strip() or f"exit {probe.returncode}"
            return BackendStatus(self.name, False, f"bwrap cannot create namespaces here: {why}")
        return BackendStatus(self.name, True, "bwrap works: all namespaces, seccomp, cgroup limits")

    def _filter(self, loopback_tcp: bool = False) -> bytes:
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

    def command(self, spec: SandboxSpec, seccomp_fd: int, status_fd: int) -> list[str]:
        """The full bwrap command line for ``spec`` (public for tests and the docs)."""
        plan = self.plan
        args = [
            self._bwrap,
            "--unshare-all",
            "--unshare-user",
            "--disable-userns",
            "--die-with-parent",
            "--new-session",
            "--cap-drop",
            "ALL",
            "--uid",
            str(_GUEST_UID),
            "--gid",
            str(_GUEST_UID),
            "--hostname",
            "sandbox",
            "--clearenv",
        ]
        for key, value in guest_env(plan, spec.scratch_path, dict(spec.env)).items():
            args += ["--setenv", key, value]
        for path in plan.ro_binds:
            args += ["--ro-bind", str(path), str(path)]
        args += self._link_args()
        if spec.code_dir is not None:
            args += ["--ro-bind", str(spec.code_dir), "/code"]
        for host_dir, guest_dir in spec.ro_dirs.items():
            args += ["--ro-bind", str(host_dir), guest_dir]
        args += ["--proc", "/proc", "--dev", "/dev", "--remount-ro", "/dev"]
        args += ["--size", str(spec.scratch_bytes), "--perms", "1777", "--tmpfs", spec.scratch_path]
        for host, guest in spec.sockets.items():
            args += ["--bind", str(host), guest]
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
            *spec.argv,
        ]
        return args

    def run(
        self,
        spec: SandboxSpec,
        *,
        on_stdout: Sink = None,
        on_stderr: Sink = None,
        cancel: threading.Event | None = None,
    ) -> SandboxResult:
        check_sockets(spec)
        setup_start = time.monotonic()
        run_id = uuid.uuid4().hex[:16]
        cgroup = RunCgroup(layout(), f"proctor-{run_id}")
        limits = spec.limits
        cgroup.create(
            memory_bytes=limits.memory_bytes, pids=limits.pids + _OWN_TASKS, cpu=limits.cpu
        )
        seccomp_fd = os.memfd_create("proctor-seccomp", os.MFD_CLOEXEC)
        status_r, status_w = os.pipe()
        tee = _Tee(on_stderr)
        try:
            os.write(seccomp_fd, self._filter(spec.loopback_tcp))
            os.lseek(seccomp_fd, 0, os.SEEK_SET)
            argv = self.command(spec, seccomp_fd, status_w)
            started = time.monotonic()
            proc = launch(argv, cgroup, pass_fds=(seccomp_fd, status_w))
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
