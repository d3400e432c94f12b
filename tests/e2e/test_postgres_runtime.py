"""The whole runtime on PostgreSQL: the store and ledger in one database, a
PostgreSQL dataset read by guest code in a real sandbox, the deployment's database
role granted exactly the approved columns and dropped at undeploy."""

from __future__ import annotations

import json
import os
from pathlib import Path

import psycopg
import pytest

from tests.conftest import run_cli
from tests.pg.test_pg_datasets import make_pg_dataset
from tests.sandbox_conftest_helpers import driver_or_skip

pytestmark = [pytest.mark.postgres, pytest.mark.sandbox]
BACKEND = "bubblewrap"

JOB = """
import proctor_guest
r = proctor_guest.sql("crm", "SELECT id, country FROM customers ORDER BY id")
print("rows", r["row_count"])
try:
    proctor_guest.sql("crm", "SELECT email FROM customers")
    print("email READ")
except proctor_guest.Denied:
    print("email denied")
"""
MANIFEST = """
[artifact]
name = "pgjob"
entrypoint = ["python3", "main.py"]
purpose = "count customers per country"
[datasets.crm.tables.customers]
columns = ["id", "country"]
access = "read"
"""


def test_runtime_on_postgresql_with_a_postgresql_dataset(
    tmp_path: Path, pg_dsn: str, pg_server: object
) -> None:
    driver_or_skip(BACKEND)
    home = tmp_path / "home"
    run_cli("init", "--home", str(home), "--store", pg_dsn)
    config = json.loads((home / "config.json").read_text())
    assert config["store"].startswith("postgresql://")
    assert not (home / "proctor.db").exists()
    data_dsn = make_pg_dataset(pg_server, f"crm_{os.getpid()}")  # type: ignore[arg-type]
    run_cli("tenant", "create", "acme", home=home)
    dev = run_cli("principal", "create", "-t", "acme", "dev", "--role", "developer",
                  home=home).out.splitlines()[-1]  # fmt: skip
    alice = run_cli("principal", "create", "-t", "acme", "alice", "--role", "approver",
                    home=home).out.splitlines()[-1]  # fmt: skip
    os.environ["CRM_DSN"] = data_dsn
    try:
        run_cli("dataset", "add", "-t", "acme", "crm", "--postgres-env", "CRM_DSN", home=home)
    finally:
        del os.environ["CRM_DSN"]
    events = run_cli("audit", "events", "-t", "acme", "--json", home=home).out
    assert data_dsn not in events, "the DSN stays with the runtime"
    art = tmp_path / "art"
    art.mkdir(mode=0o755)
    (art / "main.py").write_text(JOB)
    (art / "proctor.toml").write_text(MANIFEST)
    for f in art.iterdir():
        f.chmod(0o644)
    digest = json.loads(run_cli("artifact", "submit", str(art), "-t", "acme", "--json",
                                "--token", dev, home=home).out)["digest"]  # fmt: skip
    run_cli("approve", digest, "-t", "acme", "--yes", "--token", alice, home=home)
    run_cli("deploy", digest, "-t", "acme", "--name", "pgjob", "--env", "production",
            "--instruction", "count", "--token", dev, home=home)  # fmt: skip
    res = run_cli("run", "pgjob", "-t", "acme", "--backend", BACKEND, "--token", dev, home=home)
    assert "rows" in res.out and "email denied" in res.out
    with psycopg.connect(data_dsn) as conn:
        roles = [r[0] for r in conn.execute(
            "SELECT rolname FROM pg_roles WHERE rolname LIKE 'proctor%'").fetchall()]  # fmt: skip
        assert roles, "the deployment's role exists while it is deployed"
        assert not [r for r in roles if r.startswith("proctor_run_")], "the run's login is gone"
        granted = conn.execute(
            "SELECT column_name FROM information_schema.column_privileges"
            " WHERE grantee = %s AND table_name = 'customers' ORDER BY column_name",
            (roles[0],),
        ).fetchall()
        assert [g[0] for g in granted] == ["country", "id"]
    run_cli("deployment", "stop", "-t", "acme", "pgjob", "--token", dev, home=home)
    with psycopg.connect(data_dsn) as conn:
        left = conn.execute(
            "SELECT count(*) FROM pg_roles WHERE rolname = %s", (roles[0],)
        ).fetchone()
        assert left == (0,), "undeploy dropped the role"
    verify = run_cli("audit", "verify", "-t", "acme", home=home).out
    assert "verified" in verify
