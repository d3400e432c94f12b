"""A PostgreSQL database that grants objects to PUBLIC grants them to every run's
login: the database would not refuse what Cedar forbids there. Registering it is
refused unless the operator acknowledges it, with a reason that is recorded."""

from __future__ import annotations

import json
import os
from pathlib import Path

import psycopg

from proctor.testing import PostgresServer
from tests.conftest import run_cli
from tests.pg.test_pg_datasets import make_pg_dataset


def _add(home: Path, dsn: str, *extra: str) -> object:
    os.environ["CRM_DSN"] = dsn
    try:
        return run_cli("dataset", "add", "-t", "acme", "crm", "--postgres-env", "CRM_DSN",
                       "--json", *extra, home=home, check=False)  # fmt: skip
    finally:
        del os.environ["CRM_DSN"]


def _events(home: Path) -> list[dict[str, object]]:
    out = run_cli("audit", "events", "-t", "acme", "--json", home=home).out
    return list(json.loads(out))


def test_a_database_granting_to_public_is_registered_only_when_acknowledged(
    pg_server: PostgresServer, tmp_path: Path
) -> None:
    home = tmp_path / "home"
    run_cli("init", "--home", str(home))
    run_cli("tenant", "create", "acme", home=home)
    name = f"crm_pub_{abs(hash(str(tmp_path))) % 10**9}"
    dsn = make_pg_dataset(pg_server, name)
    with psycopg.connect(pg_server.dsn(name), autocommit=True) as conn:
        conn.execute("CREATE VIEW public.contacts AS SELECT id, email FROM customers")
        conn.execute("GRANT SELECT ON public.contacts TO PUBLIC")
    before = _events(home)

    refused = _add(home, dsn)
    assert refused.code == 2, refused.err  # type: ignore[attr-defined]
    said = " ".join(refused.err.split())  # type: ignore[attr-defined]
    assert "grants to PUBLIC" in said and "public.contacts" in said
    assert "--accept-public-grants" in said
    assert _events(home) == before  # refused: nothing recorded, nothing registered
    assert json.loads(run_cli("dataset", "list", "-t", "acme", "--json", home=home).out) == []
    empty = _add(home, dsn, "--accept-public-grants", "  ")
    assert empty.code == 2 and "needs a reason" in empty.err  # type: ignore[attr-defined]

    added = _add(home, dsn, "--accept-public-grants", "read-only reporting replica (OPS-7)")
    assert added.code == 0, added.err  # type: ignore[attr-defined]
    ev = _events(home)[-1]
    assert ev["action"] == "dataset.register"
    details = ev["details"]
    assert isinstance(details, dict)
    assert details["public_grants"] == ["relation public.contacts"]
    assert details["public_grants_accepted"] == "read-only reporting replica (OPS-7)"

    # Once PUBLIC's grant is revoked, a database registers without a word.
    with psycopg.connect(pg_server.dsn(name), autocommit=True) as conn:
        conn.execute("REVOKE SELECT ON public.contacts FROM PUBLIC")
    os.environ["CRM_DSN"] = dsn
    try:
        run_cli("dataset", "add", "-t", "acme", "crm2", "--postgres-env", "CRM_DSN", home=home)
    finally:
        del os.environ["CRM_DSN"]
    last = _events(home)[-1]
    assert last["resource"] == "dataset/crm2" and "public_grants" not in last["details"]  # type: ignore[operator]
