"""Ordinary runs on real backends: output, exit codes, code dirs, exposed sockets, the pool."""

from __future__ import annotations

import io
import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from proctor.sandbox import (
    GVisorDriver,
    Limits,
    Reason,
    SandboxSpec,
    WarmPool,
    backends,
    run_captured,
)
from tests.sandbox_conftest_helpers import (
    BACKENDS,
    assert_nothing_left,
    driver_or_skip,
    no_leftovers,
    run_code,
    snapshot,
)

pytestmark = pytest.mark.usefixtures("no_leftovers")
_ = no_leftovers


@pytest.mark.host
def test_backends_say_why() -> None:
    statuses = {s.name: s for s in backends()}
    assert set(statuses) == {"gvisor", "bubblewrap"}
    for status in statuses.values():
        assert status.reason


@pytest.mark.parametrize("backend", BACKENDS)
def test_exit_code_and_streams(backend: str) -> None:
    driver = driver_or_skip(backend)
    code = "import sys, os\nprint('out')\nprint('err', file=sys.stderr)\nsys.exit(3)"
    run = run_code(driver, code)
    assert (run.result.exit_code, run.result.reason) == (3, Reason.EXIT)
    assert (run.stdout, run.stderr) == (b"out\n", b"err\n")
    assert run.result.backend == backend
    assert (run.result.platform is not None) == (backend == "gvisor")


@pytest.mark.parametrize("backend", BACKENDS)
def test_code_dir_env_and_file_sink(backend: str, tmp_path: Path) -> None:
    driver = driver_or_skip(backend)
    code = tmp_path / "code"
    code.mkdir()
    (code / "main.py").write_text(
        "import os\nprint(os.getcwd(), os.environ['GREETING'], open('data.txt').read())"
    )
    (code / "data.txt").write_text("payload")
    sink = io.BytesIO()
    spec = SandboxSpec(argv=("python3", "main.py"), code_dir=code, env={"GREETING": "hi"})
    result = driver.run(spec, on_stdout=sink)
    assert result.ok
    assert sink.getvalue() == b"/code hi payload\n"


@pytest.mark.parametrize("backend", BACKENDS)
def test_guest_runs_the_host_interpreter(backend: str) -> None:
    # The prefix may sit under a private directory (/root/.pyenv): the guest, which is
    # not root, must still reach it, not fall through PATH to another python3.
    driver = driver_or_skip(backend)
    run = run_code(driver, "import os, sys; print(os.path.realpath(sys.executable))")
    assert run.result.ok, run.stderr
    assert run.stdout.decode().strip() == str(driver.plan.interpreter.executable)  # type: ignore[attr-defined]


@pytest.mark.parametrize("backend", BACKENDS)
def test_killed_by_signal(backend: str) -> None:
    driver = driver_or_skip(backend)
    run = run_code(driver, "import os, signal\nos.kill(os.getpid(), signal.SIGABRT)")
    assert run.result.reason is Reason.SIGNAL
    assert run.result.exit_code == 128 + 6


class _EchoServer:
    """A host Unix socket server answering b"pong" to b"ping", counting connections."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.connections = 0
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(str(path))
        os.chmod(path, 0o777)
        self.sock.listen(4)
        self.sock.settimeout(0.2)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self.connections += 1
            with conn:
                if conn.recv(16) == b"ping":
                    conn.sendall(b"pong")

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.sock.close()


@pytest.fixture
def servers(tmp_path: Path) -> Iterator[tuple[_EchoServer, _EchoServer]]:
    sockdir = tmp_path / "run"
    sockdir.mkdir()
    os.chmod(tmp_path, 0o755)
    os.chmod(sockdir, 0o755)
    broker = _EchoServer(sockdir / "broker.sock")
    other = _EchoServer(sockdir / "other.sock")
    yield broker, other
    broker.close()
    other.close()


CONNECT = """
import json, socket, sys
results = {}
for path in sys.argv[1:]:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(5)
    try:
        s.connect(path)
        s.sendall(b"ping")
        results[path] = s.recv(16).decode()
    except OSError as exc:
        results[path] = type(exc).__name__
print(json.dumps(results))
"""


@pytest.mark.parametrize("backend", BACKENDS)
def test_exposed_socket_is_the_only_way_out(
    backend: str, servers: tuple[_EchoServer, _EchoServer]
) -> None:
    import json

    driver = driver_or_skip(backend)
    broker, other = servers
    guest_broker = "/run/proctor/broker.sock"
    probes = [guest_broker, "/run/proctor/other.sock", str(other.path), str(broker.path)]
    spec = SandboxSpec(
        argv=("python3", "-c", CONNECT, *probes),
        sockets={broker.path: guest_broker},
        limits=Limits(wall_seconds=20),
    )
    run = run_captured(driver, spec)
    assert run.result.ok, run.stderr
    results = json.loads(run.stdout)
    assert results[guest_broker] == "pong"
    assert all(results[p] != "pong" for p in probes[1:]), results
    assert (broker.connections, other.connections) == (1, 0)


def test_spec_refuses_a_socket_that_is_not_one(tmp_path: Path) -> None:
    from proctor.sandbox import SandboxSpecInvalid, get_driver

    driver = get_driver("bubblewrap")
    plain = tmp_path / "plain"
    plain.write_text("")
    with pytest.raises(SandboxSpecInvalid, match="not a Unix socket"):
        driver.run(SandboxSpec(argv=("true",), sockets={plain: "/run/x.sock"}))


@pytest.mark.gvisor
@pytest.mark.sandbox
def test_warm_pool_serves_each_sandbox_once() -> None:
    driver = driver_or_skip("gvisor")
    assert isinstance(driver, GVisorDriver)
    before = snapshot()
    template = SandboxSpec(argv=("unused",), limits=Limits(wall_seconds=10))
    with WarmPool(driver, template, size=2) as pool:
        pool.wait_full()
        seen = []
        for i in range(3):
            out = bytearray()
            started = time.monotonic()
            result = pool.run(
                [
                    "python3",
                    "-c",
                    f"import os; print({i}, os.getpid(), os.listdir('/tmp'))"
                    "; open('/tmp/mark', 'w').write('x')",
                ],
                on_stdout=out.extend,
            )
            assert result.ok
            assert time.monotonic() - started < 5
            value, _pid, listing = out.decode().split(" ", 2)
            assert value == str(i)
            # Single use: the previous run's scratch file is never visible.
            assert "mark" not in listing
            seen.append(result.run_id)
        assert len(set(seen)) == 3
    assert_nothing_left(before)


@pytest.mark.gvisor
@pytest.mark.sandbox
def test_warm_pool_applies_limits_from_dispatch() -> None:
    driver = driver_or_skip("gvisor")
    assert isinstance(driver, GVisorDriver)
    template = SandboxSpec(argv=("unused",), limits=Limits(wall_seconds=1.0))
    with WarmPool(driver, template, size=1) as pool:
        pool.wait_full()
        time.sleep(1.2)  # idle time in the pool does not count against the run
        result = pool.run(["python3", "-c", "import time; time.sleep(0.2); print('ok')"])
        assert result.reason is Reason.EXIT
        result = pool.run(["python3", "-c", "while True: pass"])
        assert result.reason is Reason.TIMEOUT


@pytest.mark.gvisor
@pytest.mark.sandbox
def test_warm_pool_reads_a_private_code_dir(tmp_path: Path) -> None:
    driver = driver_or_skip("gvisor")
    assert isinstance(driver, GVisorDriver)
    code = tmp_path / "code"
    code.mkdir(mode=0o700)
    (code / "job.py").write_text("print('pooled', open('data.txt').read())")
    (code / "data.txt").write_text("private")
    for name in ("job.py", "data.txt"):
        (code / name).chmod(0o600)
    template = SandboxSpec(argv=("unused",), code_dir=code, limits=Limits(wall_seconds=10))
    with WarmPool(driver, template, size=1) as pool:
        out = bytearray()
        result = pool.run(["python3", "job.py"], on_stdout=out.extend)
    assert result.ok
    assert out == b"pooled private\n"
