"""Shared fixtures: real stores (SQLite files and a real PostgreSQL), real homes,
the real CLI in a subprocess."""

from __future__ import annotations

import itertools
import logging
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from proctor.ledger import Actor, EventDraft, Ledger, Signer
from proctor.store import Store, open_store

pytest_plugins = ["tests.host_group", "pytester"]

OPERATOR = Actor("operator", "test-operator")
PROCTOR = str(Path(sys.executable).with_name("proctor"))


def wait_until(cond: Callable[[], Any], what: str, timeout: float = 60.0) -> Any:
    """``cond()``'s first truthy value, polled; fails naming ``what`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def draft(i: int = 0, **extra: object) -> EventDraft:
    return EventDraft(OPERATOR, "test.event", f"thing/{i}", details={"i": i, **extra})


@dataclass
class LedgerEnv:
    path: Path  # the SQLite file; on PostgreSQL a path that does not exist
    store: Store
    signer: Signer
    ledger: Ledger
    url: str = ""  # what open_store() opens: the file, or a PostgreSQL DSN

    def __post_init__(self) -> None:
        self.url = self.url or str(self.path)

    def reopen(self) -> LedgerEnv:
        self.ledger.close()
        self.store.close()
        store = open_store(self.url)
        env = LedgerEnv(self.path, store, self.signer, Ledger(store, self.signer, "test.local"))
        env.url = self.url
        return env


# -- the process's logging ------------------------------------------------------
#
# ``proctor serve`` sets the loggers below up for its own process (JSON lines on
# stderr, from INFO, not propagated). A test that runs a command in this process
# and left them so would make every later test's runs format and keep log records:
# the load test's heap bound once failed on exactly that. So each test must leave
# them as it found them, and the check below names the test that did not.

_LOGGERS = ("", "proctor", "proctor.lifecycle", "uvicorn", "uvicorn.access", "uvicorn.error")
#: What every later test's runs log through. uvicorn's loggers are left out of the
#: check: an API server started in this process configures them (its LOGGING_CONFIG)
#: the same way each time, and nothing Proctor logs per call goes through them.
_CHECKED = ("", "proctor", "proctor.lifecycle")
LoggingState = tuple[tuple[str, int, bool, bool, tuple[logging.Handler, ...]], ...]


def logging_state(names: tuple[str, ...] = _LOGGERS) -> LoggingState:
    out = []
    for name in names:
        lg = logging.getLogger(name)
        out.append((name, lg.level, lg.propagate, lg.disabled, tuple(lg.handlers)))
    return tuple(out)


def restore_logging(state: LoggingState) -> None:
    for name, level, propagate, disabled, handlers in state:
        lg = logging.getLogger(name)
        lg.setLevel(level)
        lg.propagate, lg.disabled = propagate, disabled
        lg.handlers[:] = list(handlers)


@pytest.fixture(autouse=True)
def _logging_left_as_found() -> Iterator[None]:
    # pytest's own capture handlers come and go on the root logger around each
    # phase: there only the level and switches are compared.
    before = logging_state(_CHECKED)
    yield
    after = logging_state(_CHECKED)
    changed = [
        name or "root"
        for (name, *b), (_, *a) in zip(before, after, strict=True)
        if (b[:3] if not name else b) != (a[:3] if not name else a)
    ]
    assert not changed, f"the test left the logging of {changed} changed"


# -- store engines -------------------------------------------------------------
#
# Every test that uses ``ledger_env`` (or ``store_url``) runs on both engines:
# SQLite, and PostgreSQL on one server started for the whole session (initdb in
# a temporary directory, a loopback port, stopped at the end), with a fresh
# database per test. Without PostgreSQL's binaries the PostgreSQL cases skip,
# except on CI, where that is a broken machine (``unavailable``).

ENGINES = ("sqlite", "postgresql")
_db_numbers = itertools.count()


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "postgres: needs a PostgreSQL server (started by the tests)")


@pytest.fixture(scope="session")
def pg_server() -> Iterator[object]:
    from proctor.testing import PostgresServer, PostgresUnavailable

    server = PostgresServer(durable=False)
    try:
        server.start()
    except PostgresUnavailable as exc:
        from tests.sandbox_conftest_helpers import unavailable

        unavailable("PostgreSQL", exc.message)
    yield server
    server.stop()


@pytest.fixture
def pg_dsn(pg_server: object) -> Iterator[str]:
    """A fresh, empty PostgreSQL database on the session's server."""
    from proctor.testing import PostgresServer

    assert isinstance(pg_server, PostgresServer)
    name = f"proctor_test_{os.getpid()}_{next(_db_numbers)}"
    dsn = pg_server.create_database(name)
    yield dsn
    pg_server.drop_database(name)


@pytest.fixture(params=ENGINES)
def store_engine(request: pytest.FixtureRequest) -> str:
    if request.param == "postgresql":
        request.applymarker(pytest.mark.postgres)
    return str(request.param)


@pytest.fixture
def store_url(store_engine: str, tmp_path: Path, request: pytest.FixtureRequest) -> str:
    """Where a new store goes: a SQLite file, or a fresh PostgreSQL database."""
    if store_engine == "postgresql":
        return str(request.getfixturevalue("pg_dsn"))
    return str(tmp_path / "proctor.db")


@pytest.fixture(scope="session")
def pg_migrated_template(pg_server: object) -> str:
    """A database migrated to the current schema that nobody may connect to: each
    ``ledger_env`` store is a copy of it (``CREATE DATABASE ... TEMPLATE``), about
    100 ms cheaper per test than migrating an empty one. The migrations themselves
    are tested from an empty database (``store_url``, tests/integration/test_store_migrations.py)."""
    import psycopg

    from proctor.testing import PostgresServer

    assert isinstance(pg_server, PostgresServer)
    name = f"proctor_template_{os.getpid()}"
    open_store(pg_server.create_database(name), create=True).close()
    with psycopg.connect(pg_server.dsn(), autocommit=True) as conn:
        conn.execute(f'ALTER DATABASE "{name}" WITH ALLOW_CONNECTIONS false')
    return name


@pytest.fixture
def migrated_store_url(
    store_engine: str, tmp_path: Path, request: pytest.FixtureRequest
) -> Iterator[str]:
    """Where a store at the current schema goes: a SQLite file (migrated when opened),
    or a PostgreSQL database copied from ``pg_migrated_template``."""
    if store_engine != "postgresql":
        yield str(tmp_path / "proctor.db")
        return
    from proctor.testing import PostgresServer

    server = request.getfixturevalue("pg_server")
    assert isinstance(server, PostgresServer)
    template = request.getfixturevalue("pg_migrated_template")
    name = f"proctor_test_{os.getpid()}_{next(_db_numbers)}"
    yield server.create_database(name, template=template)
    server.drop_database(name)


@pytest.fixture
def ledger_env(migrated_store_url: str, tmp_path: Path) -> Iterator[LedgerEnv]:
    store_url = migrated_store_url
    path = tmp_path / "proctor.db"
    store = open_store(store_url, create=True)
    signer = Signer.generate("test.local")
    env = LedgerEnv(path, store, signer, Ledger(store, signer, "test.local"), url=store_url)
    yield env
    env.ledger.close()
    env.store.close()


@dataclass
class CliResult:
    code: int
    out: str
    err: str
    raw: bytes


def run_cli(*args: str, home: Path | None = None, check: bool = True) -> CliResult:
    env = dict(os.environ)
    env.pop("PROCTOR_HOME", None)
    if home is not None:
        env["PROCTOR_HOME"] = str(home)
    env["COLUMNS"] = "200"
    proc = subprocess.run([PROCTOR, *args], capture_output=True, env=env, timeout=120)
    res = CliResult(
        proc.returncode, proc.stdout.decode(errors="replace"), proc.stderr.decode(), proc.stdout
    )
    if check and res.code != 0:
        raise AssertionError(f"proctor {' '.join(args)} failed ({res.code}):\n{res.out}{res.err}")
    return res


def copy_home(template: Path, to: Path) -> Path:
    """A copy of an initialised home at ``to``: the same files (one signing key for
    the copies of one template), its own SQLite file. ``proctor init`` costs a second
    of process start and key generation; a copy of its result costs milliseconds."""
    shutil.copytree(template, to, symlinks=True)
    config = to / "config.json"
    # Homes keep their store path relative; the replace is for a template that
    # holds an absolute one (tests that rewrite it so).
    config.write_text(config.read_text().replace(str(template), str(to)))
    return to


@pytest.fixture(scope="session")
def initialised_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One ``proctor init`` per session, run for real; tests get copies (``home``)."""
    h = tmp_path_factory.mktemp("template") / "home"
    run_cli("init", "--home", str(h))
    return h


@pytest.fixture
def home(initialised_home: Path, tmp_path: Path) -> Path:
    return copy_home(initialised_home, tmp_path / "home")


@pytest.fixture(scope="session")
def demo_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One real ``proctor demo`` per session (the evidence tests read copies of it)."""
    home = tmp_path_factory.mktemp("evidence") / "home"
    subprocess.run([PROCTOR, "demo", "--home", str(home)], check=True, capture_output=True,
                   timeout=120)  # fmt: skip
    return home


def pytest_runtest_setup(item: pytest.Item) -> None:
    """A test parametrized by sandbox ``backend`` needs that backend: one that does not
    work here is a skip, or on CI a failure, named before the test body runs."""
    callspec = getattr(item, "callspec", None)
    backend = callspec.params.get("backend") if callspec is not None else None
    from tests.sandbox_conftest_helpers import SANDBOXES, driver_or_skip

    if backend in SANDBOXES:
        driver_or_skip(backend)


def pytest_sessionstart(session: pytest.Session) -> None:
    """On CI both sandbox drivers exist: a run where none works is a broken CI, not a skip."""
    if os.environ.get("CI"):
        from proctor.sandbox import backends

        if not any(b.available for b in backends()):
            reasons = "; ".join(f"{b.name}: {b.reason}" for b in backends())
            pytest.exit(f"no sandbox backend works on this CI machine ({reasons})", returncode=1)
