"""A warm pool of pre-started, single-use gVisor sandboxes.

Starting gVisor costs about half a second, almost all of it before the guest's
first instruction. A pool pays that ahead of time: each sandbox is booted with
the run's mounts and limits and holds a resident interpreter blocked on its
stdin. A run hands it one job and the sandbox is destroyed afterwards; nothing
is ever reused, so no state leaks from one run to the next. A background
thread refills the pool.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import posixpath
import select
import subprocess
import threading
import time
import weakref
from collections import deque
from collections.abc import Mapping, Sequence

from proctor.errors import SandboxError
from proctor.sandbox._errors import SandboxSpecInvalid, SandboxStartFailed
from proctor.sandbox._gvisor import GVisorDriver, _Prepared
from proctor.sandbox._model import SandboxResult, SandboxSpec
from proctor.sandbox._supervise import Sink, launch, watch
from proctor.telemetry import collect_with, metrics

_READY = b"\0proctor-ready\n"
_BOOT_TIMEOUT = 15.0

# Runs in the guest. Kept free of imports beyond what the interpreter has loaded
# anyway, so the job starts in the state a fresh `python -c` would see.
_LOADER = r"""
import os, sys
os.write(1, b"\0proctor-ready\n")
_line = sys.stdin.buffer.readline()
if not _line:
    os._exit(0)
import json as _json
_job = _json.loads(_line)
del _json, _line
os.environ.clear()
os.environ.update(_job["env"])
os.chdir(_job["cwd"])
_argv = _job["argv"]
if _job["mode"] == "inline":
    sys.argv = ["-c", *_argv[3:]]
    sys.path[0] = ""
    _code = compile(_argv[2], "<string>", "exec")
    del _job, _argv
    exec(_code, {"__name__": "__main__", "__builtins__": __builtins__})
elif _job["mode"] == "script":
    import runpy
    sys.argv = _argv[1:]
    sys.path[0] = os.path.dirname(os.path.abspath(_argv[1]))
    del _job
    runpy.run_path(sys.argv[0], run_name="__main__")
else:
    os.execvp(_argv[0], _argv)
"""


# The live pools, read at each scrape: the gauge is what they hold then, whenever
# the metrics were turned on.
_pools: weakref.WeakSet[WarmPool] = weakref.WeakSet()
_pools_lock = threading.Lock()
_pool_backends: set[str] = set()
_pools_measured: list[bool] = []


def _measured(pool: WarmPool) -> None:
    with _pools_lock:
        if not _pools_measured:
            collect_with(_pool_sizes)
            _pools_measured.append(True)
        _pools.add(pool)
        _pool_backends.add(pool.driver.name)


def _pool_sizes() -> None:
    with _pools_lock:
        pools = list(_pools)
    # A backend whose pools are all gone reads 0, not the last size seen.
    sizes = dict.fromkeys(_pool_backends, 0)
    for pool in pools:
        name = pool.driver.name
        sizes[name] = sizes.get(name, 0) + len(pool._ready)
    gauge = metrics().warm_pool_size
    for name, size in sizes.items():
        gauge.labels(name).set(size)


@dataclasses.dataclass
class _Warm:
    prepared: _Prepared
    proc: subprocess.Popen[bytes]


class WarmPool:
    """Keeps ``size`` gVisor sandboxes booted for ``template``; each serves one run.

    Every run gets the template's code directory, scratch, sockets and limits;
    only the command and extra environment come with the run. The wall-clock
    limit counts from the moment the job is handed over.
    """

    def __init__(self, driver: GVisorDriver, template: SandboxSpec, size: int = 2) -> None:
        if size < 1:
            raise ValueError("a warm pool holds at least one sandbox")
        if template.network is not None:
            # One network would be shared by every sandbox the pool boots: one run
            # could reach another's relay, and its DNS names with it.
            raise SandboxSpecInvalid("a warm pool's template cannot carry a run's network")
        self.driver = driver
        self.size = size
        self.template = template
        interpreter = driver.plan.interpreter
        self._python_names = {"python", "python3", interpreter.executable.name}
        self._boot_spec = dataclasses.replace(
            template, argv=(str(interpreter.executable), "-c", _LOADER)
        )
        self._ready: deque[_Warm] = deque()
        self._booting = 0
        self._closed = False
        self._error: SandboxError | None = None
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        _measured(self)

    def __enter__(self) -> WarmPool:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> None:
        self.driver.platform  # noqa: B018 - probe in the caller's thread, errors surface here
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._refill, name="proctor-warm-pool", daemon=True
            )
            self._thread.start()

    def wait_full(self, timeout: float = 60.0) -> None:
        """Block until every slot holds a booted sandbox (benchmarks, tests)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while len(self._ready) < self.size:
                if self._error is not None:
                    raise self._error
                left = deadline - time.monotonic()
                if left <= 0:
                    raise SandboxStartFailed(f"warm pool not full after {timeout:.0f} s")
                self._cond.wait(left)

    def _refill(self) -> None:
        while True:
            if not self._claim_slot():
                return
            warm: _Warm | None = None
            try:
                warm = self._boot()
            except SandboxError as exc:
                with self._cond:
                    self._error = exc
                    self._cond.notify_all()
                time.sleep(1.0)  # a broken machine should not be hammered
            finally:
                with self._cond:
                    self._booting -= 1
                    if warm is not None:
                        if self._closed:
                            self._destroy(warm)
                        else:
                            self._error = None
                            self._ready.append(warm)
                    self._cond.notify_all()

    def _claim_slot(self) -> bool:
        """Wait until a slot is free; False when the pool closes instead."""
        with self._cond:
            while not self._closed and len(self._ready) + self._booting >= self.size:
                self._cond.wait()
            if self._closed:
                return False
            self._booting += 1
            return True

    def _boot(self) -> _Warm:
        prepared = self.driver._prepare(self._boot_spec)
        try:
            proc = launch(prepared.argv, prepared.cgroup, keep_stdin=True)
            assert proc.stdout is not None
            fd = proc.stdout.fileno()
            got = b""
            deadline = time.monotonic() + _BOOT_TIMEOUT
            # Read exactly the marker: what follows belongs to the job.
            while len(got) < len(_READY):
                left = deadline - time.monotonic()
                if left <= 0 or not select.select([fd], [], [], left)[0]:
                    raise SandboxStartFailed(
                        f"warm sandbox did not boot within {_BOOT_TIMEOUT:.0f} s"
                    )
                chunk = os.read(fd, len(_READY) - len(got))
                if not chunk:
                    raise SandboxStartFailed("warm sandbox exited while booting")
                got += chunk
            if got != _READY:
                raise SandboxStartFailed("warm sandbox wrote something unexpected while booting")
            return _Warm(prepared, proc)
        except BaseException:
            with contextlib.suppress(Exception):
                self.driver._teardown(prepared)
            raise

    def _destroy(self, warm: _Warm) -> None:
        for pipe in (warm.proc.stdin, warm.proc.stdout, warm.proc.stderr):
            if pipe is not None:
                with contextlib.suppress(OSError):
                    pipe.close()
        with contextlib.suppress(SandboxError):
            self.driver._teardown(warm.prepared)
        with contextlib.suppress(subprocess.TimeoutExpired):
            warm.proc.wait(timeout=5)

    def _take(self, timeout: float) -> _Warm:
        deadline = time.monotonic() + timeout
        with self._cond:
            if not self._ready and not self._closed:
                metrics().warm_pool_misses.labels(self.driver.name).inc()
            while not self._ready:
                if self._closed:
                    raise SandboxError("the warm pool is closed")
                left = deadline - time.monotonic()
                if left <= 0:
                    if self._error is not None:
                        raise self._error
                    raise SandboxStartFailed(f"no warm sandbox became ready within {timeout:.0f} s")
                self._cond.wait(left)
            warm = self._ready.popleft()
            self._cond.notify_all()  # wakes the refiller
            return warm

    def _job(self, argv: Sequence[str], env: Mapping[str, str]) -> bytes:
        mode = "exec"
        if posixpath.basename(argv[0]) in self._python_names and len(argv) >= 2:
            if argv[1] == "-c" and len(argv) >= 3:
                mode = "inline"
            elif not argv[1].startswith("-"):
                mode = "script"
        from proctor.sandbox._rootfs import guest_env

        full_env = guest_env(
            self.driver.plan, self.template.scratch_path, {**self.template.env, **env}
        )
        job = {"argv": list(argv), "env": full_env, "cwd": self.template.guest_cwd, "mode": mode}
        return json.dumps(job).encode() + b"\n"

    def run(
        self,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        on_stdout: Sink = None,
        on_stderr: Sink = None,
        acquire_timeout: float = 30.0,
    ) -> SandboxResult:
        """Run ``argv`` in a pre-booted sandbox, then destroy that sandbox."""
        if not argv:
            raise ValueError("a run needs a command")
        job = self._job(argv, env or {})
        warm = self._take(acquire_timeout)
        prepared, proc = warm.prepared, warm.proc
        assert proc.stdin is not None
        try:
            started = time.monotonic()
            try:
                proc.stdin.write(job)
                proc.stdin.close()
            except BrokenPipeError:
                pass  # died while waiting; watch() reports how (oom, signal)
            outcome = watch(
                proc,
                prepared.cgroup,
                self.template.limits,
                on_stdout=on_stdout,
                on_stderr=on_stderr,
                started=started,
            )
        finally:
            self.driver._teardown(prepared)
        spec = dataclasses.replace(self.template, argv=tuple(argv))
        return self.driver._result(prepared, spec, outcome, setup_seconds=0.0)

    def close(self) -> None:
        """Destroy every idle sandbox and stop refilling."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=_BOOT_TIMEOUT + 5)
        with self._cond:
            idle = list(self._ready)
            self._ready.clear()
        for warm in idle:
            self._destroy(warm)
