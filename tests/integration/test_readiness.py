"""Readiness (``/readyz``, ``proctor doctor``) against real failures, each made for
real and then fixed: a store the kernel refuses writes to (an immutable file, which
root cannot write either), a store on a full file system, a sandbox backend whose
binary is gone (covered by a bind mount in a mount namespace of the test's own), a
witnessed log left uncosigned past its max age (a ledger clock three hours behind,
then a real witness's cosignature), and a PostgreSQL store whose transactions are
read-only. Each failure is also shown to be real (an append fails while it lasts)
and the probe recovers once it is fixed. ``/readyz`` names no tenant, file or
error; ``proctor doctor``, run as a subprocess, names them, with the fix."""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import socket
import subprocess
import threading
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest

from proctor.api import serve_api
from proctor.errors import LedgerError
from proctor.governance import Tenants
from proctor.ledger import SYSTEM_LOG, EventDraft, Ledger
from proctor.lifecycle._health import check_ledger, check_store
from proctor.runtime import Runtime, init_home
from proctor.witness import TenantWitnesses, Witness, WitnessServer
from tests.conftest import OPERATOR, PROCTOR, copy_home, run_cli, wait_until

ROOT_ONLY = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (chattr, mount, unshare)")


def _ready(url: str) -> tuple[int, dict[str, Any]]:
    resp = httpx.get(url + "/readyz", timeout=60)
    return resp.status_code, resp.json()


def _failing(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in doc["checks"] if not c["ok"]}


def _until(url: str, status: int, what: str) -> dict[str, Any]:
    def answered() -> dict[str, Any] | None:
        code, doc = _ready(url)
        return doc if code == status else None

    found: dict[str, Any] = wait_until(answered, what, timeout=90)
    return found


def _append(rt: Runtime, i: int) -> None:
    rt.ledger.append(SYSTEM_LOG, EventDraft(OPERATOR, "test.event", f"thing/{i}"))


@pytest.fixture
def served(home: Path) -> Iterator[tuple[Runtime, str]]:
    rt = Runtime.open(home)
    server = serve_api(rt, port=0)
    try:
        yield rt, server.url
    finally:
        server.stop()
        rt.close()


# -- the store ------------------------------------------------------------------------


def _chattr(flag: str, files: list[Path]) -> None:
    subprocess.run(["chattr", flag, *map(str, files)], check=True, capture_output=True)


@ROOT_ONLY
@pytest.mark.host
def test_a_store_the_kernel_refuses_writes_to_is_not_ready_until_fixed(
    served: tuple[Runtime, str], home: Path
) -> None:
    rt, url = served
    first = _until(url, 200, "the first readiness")
    assert [c["name"] for c in first["checks"]] == ["store", "ledger", "sandbox", "witnesses",
                                                     "keys"]  # fmt: skip
    assert "hint" not in first or first["hint"] is None
    db = home / "proctor.db"
    # Immutable: refused to root as well. Not the -shm file: SQLite maps it, and a
    # write to an immutable mapping ends the process (SIGBUS).
    files = [db, Path(f"{db}-wal")]
    _chattr("+i", files)
    try:
        with pytest.raises(LedgerError):
            _append(rt, 1)  # the failure is real: the ledger cannot append
        doc = _until(url, 503, "not ready with a read-only store")
        failing = _failing(doc)
        assert set(failing) == {"store", "ledger"}, doc
        assert "refuse writes" in failing["store"]["reason"]
        assert "chattr -i" in failing["store"]["fix"]
        assert "store takes no write" in failing["ledger"]["reason"]
        assert doc["status"] == "not_ready" and "proctor doctor" in doc["hint"]
        body = json.dumps(doc)
        assert str(home) not in body and "proctor.db" not in body  # no file named to anyone
        health = httpx.get(url + "/healthz", timeout=30).json()
        assert set(health) == {"status", "version"}  # liveness says nothing more
    finally:
        _chattr("-i", files)
    # The failed commit keeps the ledger check failing until one succeeds (or for
    # FAILURE_WINDOW): the next append is the recovery.
    _append(rt, 2)
    doc = _until(url, 200, "ready again")
    assert all(c["ok"] for c in doc["checks"])


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """A 96 MiB tmpfs of the test's own, unmounted at the end."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=96m,mode=0700", "proctor-test", str(mnt)],
                   check=True, capture_output=True)  # fmt: skip
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=True, capture_output=True)


@ROOT_ONLY
@pytest.mark.host
def test_a_store_on_a_full_file_system_is_not_ready_until_space_is_freed(
    small_fs: Path, initialised_home: Path
) -> None:
    home = copy_home(initialised_home, small_fs / "home")
    rt = Runtime.open(home)
    server = serve_api(rt, port=0)
    filler = small_fs / "filler"
    try:
        url = server.url
        _until(url, 200, "the first readiness")
        fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            for size in (1 << 20, 4096, 1):  # to the last byte
                try:
                    while True:
                        os.write(fd, b"\0" * size)
                except OSError as exc:
                    assert exc.errno == errno.ENOSPC
        finally:
            os.close(fd)
        assert os.statvfs(small_fs).f_bfree == 0
        with pytest.raises(LedgerError):
            for i in range(64):  # the WAL has a few pages left over: fill them too
                _append(rt, i)
        doc = _until(url, 503, "not ready on a full file system")
        failing = _failing(doc)
        assert set(failing) == {"store", "ledger"}, doc
        assert "file system is full" in failing["store"]["reason"]
        assert "free space" in failing["store"]["fix"]
        assert str(small_fs) not in json.dumps(doc)
        filler.unlink()
        doc = _until(url, 200, "ready once space is freed")
        _append(rt, 100)
    finally:
        server.stop()
        rt.close()


@pytest.mark.postgres
def test_a_postgresql_store_whose_transactions_are_read_only_fails_the_store_check(
    pg_dsn: str, tmp_path: Path
) -> None:
    import psycopg

    init_home(tmp_path / "home", store=pg_dsn)
    rt = Runtime.open(tmp_path / "home")
    try:
        assert check_store(rt).ok
        dbname = pg_dsn.rsplit("/", 1)[1]
        admin = pg_dsn.rsplit("/", 1)[0] + "/postgres"
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(f'ALTER DATABASE "{dbname}" SET default_transaction_read_only = on')
        try:
            # A new connection (a thread of its own) gets the database's setting, as
            # every connection does after a provider turns it on and reloads.
            found: list[Any] = []
            t = threading.Thread(target=lambda: found.append(check_store(rt)))
            t.start()
            t.join()
            store = found[0]
            assert not store.ok and "read-only" in (store.reason or ""), store
            assert "default_transaction_read_only" in (store.fix or "")
            assert not check_ledger(rt, store).ok
        finally:
            with psycopg.connect(admin, autocommit=True) as conn:
                conn.execute(f'ALTER DATABASE "{dbname}" RESET default_transaction_read_only')
        found.clear()
        t = threading.Thread(target=lambda: found.append(check_store(rt)))
        t.start()
        t.join()
        assert found[0].ok, found[0]
    finally:
        rt.close()


# -- the sandbox backend ------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _runsc_paths() -> list[str]:
    found = {p for p in (shutil.which("runsc"), "/usr/bin/runsc") if p and os.path.exists(p)}
    return sorted(found)


def _doctor_in(pid: int, home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``proctor doctor`` as a person runs it, in the mount namespace of ``pid``."""
    env = {**os.environ, "PROCTOR_HOME": str(home), "COLUMNS": "200"}
    return subprocess.run(["nsenter", "--target", str(pid), "--mount", PROCTOR, "doctor",
                           "--backend", "gvisor", *args], capture_output=True, text=True,
                          env=env, timeout=120, check=False)  # fmt: skip


@ROOT_ONLY
@pytest.mark.host
def test_a_sandbox_backend_whose_binary_is_gone_is_not_ready_until_it_is_back(
    home: Path, tmp_path: Path
) -> None:
    """``proctor serve --backend gvisor`` in a mount namespace of the test's own, where
    runsc is covered by /dev/null (not executable): the host keeps its runsc."""
    runsc = _runsc_paths()
    if not runsc:
        from tests.sandbox_conftest_helpers import unavailable

        unavailable("gVisor", "runsc is not installed")
    port = _free_port()
    cover = " && ".join(f"mount --bind /dev/null {p}" for p in runsc)
    env = {**os.environ, "PROCTOR_HOME": str(home)}
    log = tmp_path / "serve.log"  # a file: a pipe nobody reads would stall serve's log
    serve = subprocess.Popen(
        ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c",
         f'{cover} && exec "$0" "$@"', PROCTOR, "serve", "--backend", "gvisor",
         "--api-port", str(port), "--no-console"],
        env=env, stdout=subprocess.DEVNULL, stderr=log.open("wb"),
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:

        def answered() -> tuple[int, dict[str, Any]] | None:
            assert serve.poll() is None, log.read_text()
            try:
                return _ready(url)
            except httpx.HTTPError:
                return None

        code, doc = wait_until(answered, "serve's API", timeout=90)
        assert code == 503, doc
        failing = _failing(doc)
        assert set(failing) == {"sandbox"}, doc
        assert "runsc is not installed" in failing["sandbox"]["reason"]
        assert "--backend bubblewrap" in failing["sandbox"]["fix"]
        # serve's own node is among the checks, and holds its lease.
        assert {c["name"]: c["ok"] for c in doc["checks"]}["node"] is True

        # doctor, in the same namespace: FAIL, the fix, exit 1; --json says the same.
        res = _doctor_in(serve.pid, home)
        assert res.returncode == 1, res.stdout + res.stderr
        lines = res.stdout.splitlines()
        assert any(ln.startswith("sandbox") and "FAIL" in ln and "runsc is not installed" in ln
                   for ln in lines), res.stdout  # fmt: skip
        assert any(ln.strip().startswith("fix: install gVisor") for ln in lines), res.stdout
        assert any(ln.startswith("store") and "OK" in ln for ln in lines), res.stdout
        assert lines[-1] == "not ready: 1 check(s) failed", res.stdout
        res = _doctor_in(serve.pid, home, "--json")
        out = json.loads(res.stdout)
        assert res.returncode == 1 and out["ready"] is False and out["status"] == "not_ready"
        assert [c["name"] for c in out["checks"] if not c["ok"]] == ["sandbox"]

        # runsc back (in that namespace only): ready, a real sandbox started for it.
        for p in runsc:
            subprocess.run(["nsenter", "--target", str(serve.pid), "--mount", "umount", p],
                           check=True, capture_output=True)  # fmt: skip
        doc = _until(url, 200, "ready with runsc back")
        sandbox = {c["name"]: c for c in doc["checks"]}["sandbox"]
        assert sandbox["ok"] and "real" in sandbox["detail"], sandbox
        res = _doctor_in(serve.pid, home)
        assert res.returncode == 0, res.stdout + res.stderr
        assert "started a real sandbox now" in res.stdout and res.stdout.splitlines()[-1] == "ready"

        # Gone again after serve has used it (its platform probed and kept): seen at once.
        for p in runsc:
            subprocess.run(["nsenter", "--target", str(serve.pid), "--mount", "mount", "--bind",
                            "/dev/null", p], check=True, capture_output=True)  # fmt: skip
        doc = _until(url, 503, "not ready with runsc gone again")
        assert set(_failing(doc)) == {"sandbox"}, doc
        for p in runsc:
            subprocess.run(["nsenter", "--target", str(serve.pid), "--mount", "umount", p],
                           check=True, capture_output=True)  # fmt: skip
        _until(url, 200, "ready with runsc back again")
    finally:
        serve.send_signal(signal.SIGTERM)
        try:
            serve.wait(timeout=60)
        except subprocess.TimeoutExpired:
            serve.kill()
            serve.wait()


# -- witnesses ------------------------------------------------------------------------


class _Clock:
    """The ledger's clock, hours behind: the checkpoints it signs are old for real."""

    def __init__(self, start: datetime) -> None:
        self.now = start

    def __call__(self) -> str:
        self.now += timedelta(seconds=1)
        return self.now.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


@pytest.mark.host
def test_a_witnessed_log_left_uncosigned_past_its_max_age_is_not_ready_until_cosigned(
    served: tuple[Runtime, str], home: Path, tmp_path: Path
) -> None:
    rt, url = served
    old = Ledger(rt.store, rt.signer, rt.config.trust_domain,
                 clock=_Clock(datetime.now(UTC) - timedelta(hours=3)))  # fmt: skip
    witness = Witness.init(tmp_path / "w", "witness.test/ready")
    server = WitnessServer(witness, "127.0.0.1", 0)
    server.start()
    try:
        Tenants(rt.store, old).create("acme", OPERATOR)
        witness.add_log(old.origin("acme"), old.vkey())
        tw = TenantWitnesses(rt.store, old)
        tw.use("acme", "w1", witness.vkey, "http://{}:{}".format(*server.address), OPERATOR)
        for i in range(3):
            old.append("acme", EventDraft(OPERATOR, "test.call", f"thing/{i}"))
        # Three hours uncosigned, max age one hour (the default).
        doc = _until(url, 503, "not ready with a stale witnessed log")
        failing = _failing(doc)
        assert set(failing) == {"witnesses"}, doc
        assert "max age" in failing["witnesses"]["reason"]
        assert "proctor witness submit" in failing["witnesses"]["fix"]
        assert "acme" not in json.dumps(doc)  # no tenant named to an unauthenticated probe
        # What every node shares can be left out of a probe (and alerted on instead).
        resp = httpx.get(url + "/readyz", params={"exclude": "witnesses"}, timeout=60)
        assert resp.status_code == 200, resp.text
        assert resp.json()["excluded"] == ["witnesses"]
        assert "witnesses" not in {c["name"] for c in resp.json()["checks"]}
        typo = httpx.get(url + "/readyz", params={"exclude": "witness"}, timeout=60)
        assert typo.status_code == 400 and "witnesses" in typo.json()["error"]["hint"]

        # The operator's doctor names the tenant and how long.
        res = run_cli("doctor", home=home, check=False)
        assert res.code == 1, res.out + res.err
        assert any(ln.startswith("witnesses") and "FAIL" in ln for ln in res.out.splitlines())
        assert "tenant acme: newest checkpoint uncosigned by a quorum for" in res.out
        assert "max age 3600 s" in res.out
        assert res.out.splitlines()[-1] == "not ready: 1 check(s) failed"

        # A fresh cosignature from the real witness: ready again.
        assert [s.ok for s in tw.submit("acme")] == [True]
        doc = _until(url, 200, "ready once the log is cosigned")
        assert {c["name"]: c for c in doc["checks"]}["witnesses"]["ok"]
        res = run_cli("doctor", "--json", home=home, check=False)
        assert res.code == 0 and json.loads(res.out)["ready"] is True, res.out + res.err
    finally:
        server.stop()
        old.close()
