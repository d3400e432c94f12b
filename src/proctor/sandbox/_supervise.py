"""Launching a sandbox tool inside its run's cgroup, and watching it to the end.

The first process is held at a gate (a POSIX shell waiting for one line on
stdin) until the supervisor has moved it into the run's cgroup, so nothing of
the sandbox ever runs outside its limits. Doing the same in ``preexec_fn``
would not be safe in a threaded parent such as the warm pool.
"""

from __future__ import annotations

import contextlib
import math
import os
import selectors
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import BinaryIO, Protocol

from proctor.sandbox._cgroup import RunCgroup
from proctor.sandbox._errors import SandboxStartFailed
from proctor.sandbox._model import Limits, Reason

# Exit 125 if the supervisor died before opening the gate: never run unconfined.
_GATE = 'read -r _ || exit 125; exec "$@"'
_GATE_FAILED = 125
#: The wall-clock guard: a process of its own session, outside the run's cgroup,
#: that outlives the owner (a SIGKILL of ``serve`` included). While the owner
#: lives it blocks, costing nothing, on a pipe only the owner holds open (the
#: owner enforces the limit itself and ends the guard with the run). At EOF the
#: owner is gone: from then on it looks every 0.2 s, leaves as soon as the run's
#: cgroup is gone (a successor reaped it), and once the limit plus a grace has
#: passed kills everything in the cgroup. POSIX shell builtins but ``sleep``: $1
#: the deadline in /proc/uptime seconds, $2 cgroup.kill or "", then each
#: cgroup.procs file.
_GUARD = r"""
end=$1; kill_file=$2; shift 2
while read -r _; do :; done
while :; do
  [ -e "$1" ] || exit 0
  read -r up _ < /proc/uptime
  [ "${up%.*}" -ge "$end" ] && break
  sleep 0.2
done
[ -n "$kill_file" ] && { echo 1 > "$kill_file"; } 2>/dev/null
n=0
while [ "$n" -lt 600 ]; do
  left=
  for f in "$@"; do
    [ -r "$f" ] || continue
    while read -r pid; do kill -9 "$pid" 2>/dev/null; left=1; done < "$f"
  done
  [ -z "$left" ] && exit 0
  n=$((n + 1)); sleep 0.05
done
"""
#: How long after the run's own deadline the guard acts.
GUARD_GRACE = 2.0
_READ_CHUNK = 65536
_COUNTER_INTERVAL = 0.05
_EXIT_GRACE = 0.5


class _Writer(Protocol):
    def write(self, data: bytes, /) -> object: ...


Sink = Callable[[bytes], object] | BinaryIO | _Writer | None


def _writer(sink: Sink) -> Callable[[bytes], object] | None:
    if sink is None:
        return None
    write = getattr(sink, "write", None)
    if callable(write):
        return write  # type: ignore[no-any-return]
    if callable(sink):
        return sink
    raise TypeError(f"output sink {sink!r} is neither callable nor has write()")


@dataclass
class Outcome:
    exit_code: int
    reason: Reason
    started: float
    ended: float
    stdout_bytes: int = 0
    stderr_bytes: int = 0
    stdout_dropped: int = 0
    stderr_dropped: int = 0
    memory_peak: int | None = None


def launch(
    argv: Sequence[str],
    cgroup: RunCgroup,
    *,
    pass_fds: Sequence[int] = (),
    env: dict[str, str] | None = None,
    keep_stdin: bool = False,
    extra_groups: Sequence[int] | None = None,
) -> subprocess.Popen[bytes]:
    """Start ``argv`` inside ``cgroup``: gate first, attach, then open the gate.

    ``extra_groups`` replaces the supplementary groups (``()``: none at all).
    """
    try:
        proc = subprocess.Popen(
            ["/bin/sh", "-c", _GATE, "proctor-gate", *argv],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            pass_fds=tuple(pass_fds),
            env=env if env is not None else {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"},
            start_new_session=True,
            extra_groups=list(extra_groups) if extra_groups is not None else None,
        )
    except OSError as exc:
        raise SandboxStartFailed(f"cannot start {argv[0]}: {exc.strerror}") from exc
    assert proc.stdin is not None
    try:
        cgroup.attach(proc.pid)
        proc.stdin.write(b"\n")
        proc.stdin.flush()
        if not keep_stdin:
            proc.stdin.close()
    except BaseException:
        proc.kill()
        proc.wait()
        for pipe in (proc.stdin, proc.stdout, proc.stderr):
            if pipe is not None:
                with contextlib.suppress(OSError):
                    pipe.close()
        raise
    return proc


def _uptime() -> float:
    with open("/proc/uptime", "rb") as f:
        return float(f.read().split()[0])


@dataclass
class Guard:
    """A run's wall-clock guard (see ``_GUARD``) and the pipe that tells it we live."""

    proc: subprocess.Popen[bytes]
    alive_fd: int


def start_guard(cgroup: RunCgroup, seconds: float) -> Guard | None:
    """Start the run's wall-clock guard: if this process dies, what is left in
    ``cgroup`` is killed ``seconds`` from now. None if it cannot be started
    (this process still enforces the limit itself while it lives)."""
    procs = [str(d / "cgroup.procs") for d in cgroup.directories]
    if not procs:
        return None
    kill_file = str(cgroup.v2 / "cgroup.kill") if cgroup.v2 is not None else ""
    try:
        end = math.ceil(_uptime() + max(0.0, seconds))
        # Not inheritable: only this process holds the write end, so its death
        # (however it comes) is the guard's EOF.
        read_fd, alive_fd = os.pipe()
    except (OSError, ValueError):
        return None
    try:
        proc = subprocess.Popen(
            ["/bin/sh", "-c", _GUARD, "proctor-guard", str(end), kill_file, *procs],
            stdin=read_fd,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"},
            start_new_session=True,
        )
    except OSError:
        os.close(alive_fd)
        return None
    finally:
        os.close(read_fd)
    return Guard(proc, alive_fd)


def stop_guard(guard: Guard | None) -> None:
    """End the guard: the run is over and its cgroup empty."""
    if guard is None:
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(guard.proc.pid, signal.SIGKILL)
    guard.proc.wait()
    os.close(guard.alive_fd)


def _shell_code(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode


def watch(
    proc: subprocess.Popen[bytes],
    cgroup: RunCgroup,
    limits: Limits,
    *,
    on_stdout: Sink,
    on_stderr: Sink,
    started: float,
    stop: Callable[[], None] | None = None,
    cancel: threading.Event | None = None,
) -> Outcome:
    """Stream output to the sinks until the tool exits or a limit ends the run.

    Always returns with everything in the cgroup dead. ``stop`` is called after
    the cgroup is killed, for the driver's own teardown (runsc delete).
    """
    assert proc.stdout is not None and proc.stderr is not None
    sinks = {
        proc.stdout.fileno(): (_writer(on_stdout), "stdout"),
        proc.stderr.fileno(): (_writer(on_stderr), "stderr"),
    }
    delivered = {"stdout": 0, "stderr": 0}
    dropped = {"stdout": 0, "stderr": 0}
    budget = limits.output_bytes
    deadline = started + limits.wall_seconds
    # The limit holds even if this process dies before it: see _GUARD.
    guard = start_guard(cgroup, deadline - time.monotonic() + GUARD_GRACE)
    kill_reason: Reason | None = None
    exited_at: float | None = None
    next_counters = 0.0
    sel = selectors.DefaultSelector()
    for fd in sinks:
        os.set_blocking(fd, False)
        sel.register(fd, selectors.EVENT_READ)
    try:
        while sel.get_map():
            now = time.monotonic()
            if now >= deadline:
                kill_reason = Reason.TIMEOUT
                break
            if cancel is not None and cancel.is_set():
                kill_reason = Reason.STOPPED
                break
            for key, _ in sel.select(timeout=min(deadline - now, _COUNTER_INTERVAL)):
                fd = int(key.fd)
                try:
                    data = os.read(fd, _READ_CHUNK)
                except BlockingIOError:
                    continue
                if not data:
                    sel.unregister(fd)
                    continue
                write, name = sinks[fd]
                room = budget - delivered["stdout"] - delivered["stderr"]
                if len(data) > room:
                    dropped[name] += len(data) - room
                    data = data[:room]
                    kill_reason = Reason.OUTPUT
                if data:
                    delivered[name] += len(data)
                    if write is not None:
                        write(data)
                if kill_reason:
                    break
            if kill_reason:
                break
            now = time.monotonic()
            if now >= next_counters:
                next_counters = now + _COUNTER_INTERVAL
                # The kernel has already refused the allocation or the fork; ending
                # the run here, like the OOM killer would, keeps a retrying fork
                # bomb from spinning until the wall-clock limit.
                # pids before oom: a fork bomb's children often exhaust memory as well.
                if cgroup.pids_refusals():
                    kill_reason = Reason.PIDS
                    break
                if cgroup.oom_kills():
                    kill_reason = Reason.OOM
                    break
            if proc.poll() is not None:
                exited_at = exited_at or now
                if now - exited_at > _EXIT_GRACE:
                    break  # the tool is gone; whatever still holds a pipe is killed below
    finally:
        sel.close()
        memory_peak = cgroup.memory_peak()
        if kill_reason is not None or proc.poll() is None:
            cgroup.kill()
        if stop is not None:
            stop()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
        # Sweep anything that outlived the tool (a daemonised child, a gofer).
        cgroup.kill()
        stop_guard(guard)
        for pipe in (proc.stdin, proc.stdout, proc.stderr):
            if pipe is not None:
                with contextlib.suppress(OSError):
                    pipe.close()
    ended = time.monotonic()
    exit_code = _shell_code(proc.returncode)
    if kill_reason is None:
        if cgroup.pids_refusals():
            kill_reason = Reason.PIDS
        elif cgroup.oom_kills():
            kill_reason = Reason.OOM
        elif exit_code > 128 and exit_code - 128 in {s.value for s in signal.Signals}:
            kill_reason = Reason.SIGNAL
        else:
            kill_reason = Reason.EXIT
    if kill_reason in (Reason.TIMEOUT, Reason.OUTPUT) and exit_code < 128:
        exit_code = 128 + signal.SIGKILL
    return Outcome(
        exit_code=exit_code,
        reason=kill_reason,
        started=started,
        ended=ended,
        stdout_bytes=delivered["stdout"],
        stderr_bytes=delivered["stderr"],
        stdout_dropped=dropped["stdout"],
        stderr_dropped=dropped["stderr"],
        memory_peak=memory_peak,
    )


GATE_FAILED = _GATE_FAILED
