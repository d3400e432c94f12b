"""Who a bubblewrap guest is on the host: the dedicated ``proctor-guest`` user, never root.

bwrap started by root with ``--unshare-user`` maps the guest's uid to root's own
(``65534 0 1``): the guest is then host uid 0 in a user namespace, the owner of
every root file it can see, ``/proc/sys`` included. And bwrap resolves the
paths it binds with the credentials the guest will have, so running bwrap as an
unprivileged user would hide from it the interpreter under ``/root``, the run's
code under the runtime's 0700 home and the broker socket's 0700 directory.

So the runtime builds the two user namespaces itself and hands them to bwrap
(``--userns`` then ``--userns2``):

- the outer one maps 0 to host root and 65534 to the dedicated user: bwrap sets
  up the guest's mounts there as root, as it always has;
- the inner one, a child of the outer, maps only 65534, to the outer's 65534,
  that is to the dedicated user. bwrap moves into it after the set-up, and the
  guest's first instruction is ``setpriv`` switching to 65534 and dropping every
  capability and the bounding set. No id of the guest's namespace leads to host
  root, and creating a namespace below it is refused (the outer one's
  ``user.max_user_namespaces`` is spent by the inner one).

A helper (``unshare`` then ``setpriv`` then ``unshare``, one ``sh`` holding
each namespace open) makes them: only root can write another user's id into a
namespace's ``uid_map``, and only from outside.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import select
import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass

from proctor.sandbox._errors import SandboxStartFailed, SandboxUnavailable

#: The host user every bubblewrap guest runs as (scripts/setup.sh creates it).
GUEST_USER = "proctor-guest"
#: The guest's uid and gid inside its namespace (``nobody``, as on gVisor).
GUEST_ID = 65534


def _setup_hint(user: str) -> str:
    return (
        f"run scripts/setup.sh as root (`make setup`), or create it: groupadd --system {user}"
        f" && useradd --system --gid {user} --no-create-home --home-dir /nonexistent"
        f" --shell /usr/sbin/nologin {user}"
    )


_TIMEOUT = 10.0


@dataclass(frozen=True)
class HostIdentity:
    """The host uid and gid a guest's 65534 stands for."""

    user: str
    uid: int
    gid: int


def host_identity(user: str = GUEST_USER) -> HostIdentity:
    """The dedicated guest user, or SandboxUnavailable saying how to create it."""
    try:
        entry = pwd.getpwnam(user)
    except KeyError:
        raise SandboxUnavailable(
            f"there is no {user} user: bubblewrap guests run as it on the host, never as root",
            hint=_setup_hint(user),
        ) from None
    if entry.pw_uid == 0 or entry.pw_gid == 0:
        raise SandboxUnavailable(
            f"user {user} is uid {entry.pw_uid}, gid {entry.pw_gid}: a guest must never be root",
            hint=f"give {user} an unprivileged uid and primary group ({_setup_hint(user)})",
        )
    return HostIdentity(user, entry.pw_uid, entry.pw_gid)


@dataclass(frozen=True)
class Tools:
    """The util-linux programs the namespaces and the guest's first step need."""

    unshare: str
    setpriv: str

    def guest_prefix(self) -> list[str]:
        """What the guest runs first: become 65534 and keep no capability at all."""
        return [
            self.setpriv,
            f"--reuid={GUEST_ID}",
            f"--regid={GUEST_ID}",
            # bwrap starts with no supplementary group (the launcher cleared them)
            # and the inner namespace denies setgroups, so there is nothing to clear.
            "--keep-groups",
            "--inh-caps=-all",
            "--ambient-caps=-all",
            "--bounding-set=-all",
            "--",
        ]


def tools() -> Tools:
    found = {}
    for name in ("unshare", "setpriv"):
        path = shutil.which(name, path="/usr/bin:/bin:/usr/sbin:/sbin")
        if path is None:
            raise SandboxUnavailable(
                f"{name} is not installed; the bubblewrap backend needs it",
                hint="apt-get install util-linux",
            )
        found[name] = path
    return Tools(found["unshare"], found["setpriv"])


def _holder_script(t: Tools) -> str:
    # In the outer namespace, with its capabilities (--keep-caps): say so, wait for
    # the maps, spend the namespace budget on the inner one, then become 65534 and
    # make the inner namespace, which maps only that id.
    inner = (
        f"{t.setpriv} --reuid={GUEST_ID} --regid={GUEST_ID} --keep-groups "
        "--inh-caps=-all --ambient-caps=-all -- "
        f"{t.unshare} --user --map-user={GUEST_ID} --map-group={GUEST_ID} -- "
        "/bin/sh -c 'echo; read -r _'"
    )
    return (
        "echo; read -r _ || exit 1; "
        "echo 1 > /proc/sys/user/max_user_namespaces || exit 1; "
        f"exec {inner}"
    )


def _read_line(proc: subprocess.Popen[bytes], deadline: float) -> None:
    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    while True:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            raise SandboxStartFailed(
                f"the guest's user namespaces were not ready within {_TIMEOUT:.0f} s"
            )
        # One byte at a time: the helper writes nothing else, and nothing is left buffered.
        byte = os.read(fd, 1)
        if not byte:
            raise SandboxStartFailed("the helper making the guest's user namespaces exited")
        if byte == b"\n":
            return


def _write_proc(pid: int, name: str, text: str) -> None:
    with open(f"/proc/{pid}/{name}", "w") as f:
        f.write(text)


@contextlib.contextmanager
def guest_namespaces(identity: HostIdentity, t: Tools) -> Iterator[tuple[int, int]]:
    """The outer and inner user namespaces, as file descriptors, open for the block."""
    if os.geteuid() != 0:
        raise SandboxUnavailable(
            "the bubblewrap backend needs root: only root maps a guest to the "
            f"{identity.user} user",
            hint="run the runtime as root, or use the gvisor backend",
        )
    proc = subprocess.Popen(
        [t.unshare, "--user", "--keep-caps", "--", "/bin/sh", "-c", _holder_script(t)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={"PATH": "/usr/bin:/bin"},
        extra_groups=[],
    )
    fds: list[int] = []
    try:
        deadline = time.monotonic() + _TIMEOUT
        _read_line(proc, deadline)
        fds.append(os.open(f"/proc/{proc.pid}/ns/user", os.O_RDONLY | os.O_CLOEXEC))
        _write_proc(proc.pid, "uid_map", f"0 0 1\n{GUEST_ID} {identity.uid} 1\n")
        _write_proc(proc.pid, "gid_map", f"0 0 1\n{GUEST_ID} {identity.gid} 1\n")
        assert proc.stdin is not None
        proc.stdin.write(b"\n")
        proc.stdin.flush()
        _read_line(proc, deadline)
        fds.append(os.open(f"/proc/{proc.pid}/ns/user", os.O_RDONLY | os.O_CLOEXEC))
        if os.fstat(fds[0]).st_ino == os.fstat(fds[1]).st_ino:
            raise SandboxStartFailed("the helper did not make the guest's inner user namespace")
    except BaseException as exc:
        for fd in fds:
            os.close(fd)
        why = _kill(proc)
        if isinstance(exc, OSError | SandboxStartFailed):
            what = exc.message if isinstance(exc, SandboxStartFailed) else exc.strerror or exc
            raise SandboxStartFailed(
                f"cannot make the guest's user namespaces: {what}" + (f" ({why})" if why else ""),
                hint="`proctor sandbox backends` checks whether bwrap works on this machine",
            ) from exc
        raise
    # The namespaces live on through the descriptors; the helper has done its part.
    _stop(proc)
    try:
        yield fds[0], fds[1]
    finally:
        for fd in fds:
            os.close(fd)


def _kill(proc: subprocess.Popen[bytes]) -> str:
    """Kill the helper; what it said on stderr, for the error message."""
    proc.kill()
    proc.wait()
    why = b""
    if proc.stderr is not None:
        with contextlib.suppress(OSError):
            why = proc.stderr.read(2000)
    _stop(proc)
    return why.decode(errors="replace").strip()


def _stop(proc: subprocess.Popen[bytes]) -> None:
    for pipe in (proc.stdin, proc.stdout, proc.stderr):
        if pipe is not None:
            with contextlib.suppress(OSError):
                pipe.close()
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=_TIMEOUT)
        return
    proc.kill()
    proc.wait()
