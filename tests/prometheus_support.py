"""A real Prometheus for the tests that scrape a real serve: Debian's binary, its own
loopback port, configuration and data directory, stopped and removed by the caller's
``with``."""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

PROMETHEUS = shutil.which("prometheus") or "/usr/bin/prometheus"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM, as systemd or the kubelet would; killed if it does not end in a minute."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextmanager
def prometheus(config: Path, port: int, log: Path) -> Iterator[subprocess.Popen[bytes]]:
    """Prometheus on ``127.0.0.1:port`` with ``config``, its data beside it, removed after."""
    if not Path(PROMETHEUS).exists():
        pytest.fail("Debian's prometheus is not installed (make setup installs it)")
    data = Path(tempfile.mkdtemp(prefix="prom-", dir=config.parent))
    with log.open("wb") as err:
        proc = subprocess.Popen(
            [PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={data}",
             f"--web.listen-address=127.0.0.1:{port}"],
            stdout=subprocess.DEVNULL, stderr=err,
        )  # fmt: skip
    try:
        yield proc
    finally:
        stop(proc)
        shutil.rmtree(data, ignore_errors=True)
