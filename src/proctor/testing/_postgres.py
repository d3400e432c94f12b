"""A throwaway PostgreSQL server: ``initdb`` in a temporary directory, a loopback
port, ``pg_ctl start``, and ``pg_ctl stop`` plus removal at the end.

PostgreSQL refuses to run as root, so when the caller is root the cluster
belongs to the ``postgres`` system user (Debian's package creates it) and every
server command runs through ``runuser -u postgres --``. Authentication is
``trust`` on loopback for the superuser only (the server is for tests and
benches, never data); every other role logs in with its password (SCRAM), as
on a real deployment, so that a test of who logs in with which password means
something.
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import re
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path
from types import TracebackType

from proctor.errors import ProctorError

_SUPERUSER = "postgres"
_DB_NAME_RE = re.compile(r"^[a-z_][a-z0-9_]{0,62}$")


class PostgresUnavailable(ProctorError):
    """PostgreSQL's server binaries are missing or the server would not start."""


def postgres_bin_dir() -> Path | None:
    """The directory holding ``initdb`` and ``pg_ctl``: ``$PROCTOR_PG_BIN``, the
    newest Debian ``/usr/lib/postgresql/<v>/bin``, or ``PATH``."""
    env = os.environ.get("PROCTOR_PG_BIN")
    if env:
        return Path(env) if (Path(env) / "initdb").exists() else None
    found = sorted(
        glob.glob("/usr/lib/postgresql/*/bin/initdb"),
        key=lambda p: int(re.sub(r"\D", "", Path(p).parent.parent.name) or 0),
    )
    if found:
        return Path(found[-1]).parent
    initdb = shutil.which("initdb")
    return Path(initdb).parent if initdb else None


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class PostgresServer:
    """One private PostgreSQL cluster on ``127.0.0.1:<port>``.

    ``durable=False`` turns ``fsync`` off for speed (tests: a killed client
    process is what they exercise, not a power cut); benches keep it on.
    """

    def __init__(
        self, *, durable: bool = True, max_connections: int = 300, netns: str | None = None,
        address: str = "127.0.0.1", clients: str = "127.0.0.1/32",
    ) -> None:  # fmt: skip
        """``netns``: start the server inside that network namespace, listening on
        ``address`` for ``clients`` (a CIDR) and on a Unix socket that
        :meth:`local_dsn` names (reachable from any namespace by its path)."""
        self.durable = durable
        self.max_connections = max_connections
        self.port = 0
        self.netns = netns
        self.address = address
        self.clients = clients
        self._bin = postgres_bin_dir()
        self._root: Path | None = None
        self._running = False
        self._run_as: list[str] = []

    @property
    def data_dir(self) -> Path:
        assert self._root is not None
        return self._root / "data"

    def dsn(self, dbname: str = "postgres", user: str = _SUPERUSER) -> str:
        return f"postgresql://{user}@{self.address}:{self.port}/{dbname}"

    def local_dsn(self, dbname: str = "postgres", user: str = _SUPERUSER) -> str:
        """Through the Unix socket (a server in a network namespace only)."""
        assert self._root is not None and self.netns is not None
        return f"postgresql://{user}@/{dbname}?host={self._root / 'sock'}&port={self.port}"

    def _cmd(self, name: str, *args: str) -> list[str]:
        assert self._bin is not None
        return [*self._run_as, str(self._bin / name), *args]

    def start(self) -> PostgresServer:
        if self._bin is None:
            raise PostgresUnavailable(
                "PostgreSQL's server binaries (initdb, pg_ctl) are not installed",
                hint="install the Debian package `postgresql` (make setup does)",
            )
        root = Path(tempfile.mkdtemp(prefix="proctor-pg-"))
        self._root = root
        if os.geteuid() == 0:
            try:
                pw = pwd.getpwnam("postgres")
            except KeyError as exc:
                raise PostgresUnavailable(
                    "running as root but there is no `postgres` user"
                ) from exc
            os.chown(root, pw.pw_uid, pw.pw_gid)
            self._run_as = ["runuser", "-u", "postgres", "--"]
        if self.netns is not None:
            (root / "sock").mkdir()
            if os.geteuid() == 0:
                shutil.chown(root / "sock", "postgres", "postgres")
            self._run_as = ["ip", "netns", "exec", self.netns, *self._run_as]
        try:
            self._run(
                self._cmd(
                    "initdb", "-D", str(self.data_dir), "-U", _SUPERUSER, "--auth=trust",
                    "-E", "UTF8", "--locale=C", "--no-sync",
                )
            )  # fmt: skip
            sockets = f"'{root / 'sock'}'" if self.netns is not None else "''"
            conf = {
                "listen_addresses": f"'{self.address}'",
                "unix_socket_directories": sockets,
                "max_connections": str(self.max_connections),
                "shared_buffers": "'128MB'",
                "fsync": "on" if self.durable else "off",
                "synchronous_commit": "on",
                "full_page_writes": "on" if self.durable else "off",
                "max_wal_size": "'1GB'",
                "logging_collector": "off",
            }
            with (self.data_dir / "postgresql.conf").open("a", encoding="utf-8") as f:
                for key, value in conf.items():
                    f.write(f"{key} = {value}\n")
            local = f"local all {_SUPERUSER} trust\n" if self.netns is not None else ""
            (self.data_dir / "pg_hba.conf").write_text(
                f"{local}host all {_SUPERUSER} {self.clients} trust\n"
                f"host all all {self.clients} scram-sha-256\n",
                encoding="utf-8",
            )
            for _attempt in range(5):
                self.port = _free_port()
                proc = subprocess.run(
                    self._cmd(
                        "pg_ctl", "-D", str(self.data_dir), "-l", str(root / "server.log"),
                        "-o", f"-p {self.port}", "-w", "-t", "60", "start",
                    ),
                    capture_output=True, timeout=90, check=False,
                )  # fmt: skip
                if proc.returncode == 0:
                    self._running = True
                    return self
            log = (root / "server.log").read_text(errors="replace")[-2000:]
            raise PostgresUnavailable(f"PostgreSQL would not start:\n{log}")
        except BaseException:
            self.stop()
            raise

    def _run(self, cmd: list[str]) -> None:
        proc = subprocess.run(cmd, capture_output=True, timeout=120, check=False)
        if proc.returncode != 0:
            out = (proc.stdout + proc.stderr).decode(errors="replace")[-2000:]
            raise PostgresUnavailable(f"{Path(cmd[-1]).name} failed: {out}")

    def create_database(self, name: str, template: str | None = None) -> str:
        """A fresh database, empty or a copy of ``template`` (which nobody may be
        connected to); returns its DSN."""
        for given in (name, template or name):
            if not _DB_NAME_RE.match(given):
                raise ValueError(f"bad database name {given!r}")
        import psycopg

        copied = f' TEMPLATE "{template}"' if template else ""
        admin = self.local_dsn() if self.netns is not None else self.dsn()
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"{copied}')
        return self.dsn(name)

    def drop_database(self, name: str) -> None:
        if not _DB_NAME_RE.match(name):
            raise ValueError(f"bad database name {name!r}")
        import psycopg

        admin = self.local_dsn() if self.netns is not None else self.dsn()
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')

    def stop(self) -> None:
        if self._running:
            with contextlib.suppress(subprocess.SubprocessError, OSError):
                subprocess.run(
                    self._cmd("pg_ctl", "-D", str(self.data_dir), "-m", "immediate", "-w", "stop"),
                    capture_output=True, timeout=60, check=False,
                )  # fmt: skip
            self._running = False
        if self._root is not None:
            shutil.rmtree(self._root, ignore_errors=True)
            self._root = None

    def __enter__(self) -> PostgresServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
