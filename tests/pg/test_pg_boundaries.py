"""Issue 23, items 1-4: a PostgreSQL dataset answers only the statement that was
decided. Each test tries the attack for real on a real PostgreSQL server: several
statements in one call, the run's role outliving the run, functions and catalog
views that read what no plan node names, and a DSN password in an error."""

from __future__ import annotations

import asyncio
import json
import logging
import os
from dataclasses import replace
from pathlib import Path
from typing import Any

import psycopg
import pytest

from proctor.broker import BadCall, CallDenied, DatasetBinding, RunScope, handle_sql
from proctor.broker._datasets import Refused, TimedOut
from proctor.broker._pg_sql import (
    POSTGRESQL,
    DatasetRoleError,
    _pool,
    _Statement,
    close_pg_pools,
    grant_deployment_role,
    revoke_deployment_role,
)
from proctor.errors import ProctorError
from proctor.testing import PostgresServer
from tests.conftest import LedgerEnv
from tests.integration.test_broker_sql import DEPLOYMENT, TENANT, events, last_event, make_scope
from tests.pg import test_pg_datasets as _datasets
from tests.pg.test_pg_datasets import PgEnv, make_pg_dataset
from tests.unit.test_pgtext import DSN_FORMS, SECRET

pytestmark = pytest.mark.postgres

NOT_RUN = (CallDenied, BadCall)
pg = _datasets.pg  # the fixture: a dataset database, its deployment role, a run's scope


@pytest.fixture
def store_engine() -> str:
    """The ledger's engine is not what these tests are about (the dataset's is):
    SQLite only, so each attack runs once."""
    return "sqlite"


def sql(scope: RunScope, query: str) -> dict[str, Any]:
    return asyncio.run(handle_sql(scope, {"dataset": "crm", "sql": query}))


def superuser(pg: PgEnv) -> psycopg.Connection[Any]:
    return psycopg.connect(pg.dsn, autocommit=True)


def run_role(scope: RunScope) -> str:
    """The role the run's statements log in as (whatever its naming)."""
    pool = _pool(scope, scope.datasets["crm"])
    conn = pool.take()
    try:
        return str(conn.info.user)
    finally:
        pool.give(conn)


# -- 1. one statement per call, enforced by the server ---------------------------

SEVERAL = (
    "SELECT id FROM customers; COMMIT; SELECT lo_create(4242)",
    "SELECT id FROM customers; COMMIT; SELECT pg_sleep(3)",
    "SELECT id FROM customers; ROLLBACK; SELECT lo_create(4243)",
    "SELECT 1; COMMIT",
    "SELECT id FROM customers; ALTER ROLE CURRENT_USER PASSWORD 'guest-pw'",
    "SELECT id FROM customers;; SET statement_timeout = 0",
    "COMMIT",
    "ROLLBACK",
    "SET statement_timeout = 0",
    "RESET ALL",
    "DISCARD ALL",
    "SELECT lo_create(4244)",
    "SELECT id, lo_create(4245) FROM customers",
    "SELECT id, set_config('statement_timeout', '0', false) FROM customers",
    "SELECT id, set_config('transaction_read_only', 'off', true) FROM customers",
    "SELECT id FROM customers WHERE pg_sleep(3) IS NOT NULL",
)


def test_only_one_read_statement_runs_whatever_the_guest_sends(pg: PgEnv) -> None:
    # One database for every form (a fresh one each costs more than the attacks).
    role = run_role(pg.scope)
    password = "SELECT rolpassword FROM pg_authid WHERE rolname = %s"
    with superuser(pg) as conn:
        before = conn.execute(password, (role,)).fetchone()
    for query in SEVERAL:
        with pytest.raises(NOT_RUN):
            sql(pg.scope, query)
        ev = last_event(pg.ledger)
        assert ev["decision"] == "deny" and ev["action"] == "sql.select", query
        with superuser(pg) as conn:
            # Nothing after a COMMIT ran: no large object persists, the role's
            # password is the one the broker set.
            objects = conn.execute("SELECT count(*) FROM pg_largeobject_metadata").fetchone()
            assert objects == (0,), query
            assert conn.execute(password, (role,)).fetchone() == before, query
    close_pg_pools(pg.scope)


def test_the_server_refuses_several_statements_even_past_our_parse(pg: PgEnv) -> None:
    """The guarantee is the database's (the extended query protocol), not a parse of
    ours: a statement that reached the connection unparsed is still one statement."""
    pool = _pool(pg.scope, pg.scope.datasets["crm"])
    for text in (
        "SELECT id FROM customers; COMMIT; SELECT lo_create(4250)",
        "SELECT id FROM customers; SELECT lo_create(4251)",
    ):
        stmt = _Statement(pool, text, (), 5.0)
        try:
            with pytest.raises(Refused) as refused:
                stmt.analyse()
            assert "cannot insert multiple commands" in refused.value.detail
        finally:
            stmt.close()
        # And the fetch step on its own, inside the analysed transaction: there the
        # text also stands in parentheses (the answer's byte budget), where a second
        # statement is a syntax error to the server.
        stmt = _Statement(pool, "SELECT id FROM customers", (), 5.0)
        try:
            accesses = stmt.analyse()
            stmt.sql = text
            with pytest.raises(Exception, match=r"multiple commands|syntax error"):
                stmt.run_read(accesses, 10)
        finally:
            stmt.close()
    close_pg_pools(pg.scope)
    with superuser(pg) as conn:
        assert conn.execute("SELECT count(*) FROM pg_largeobject_metadata").fetchone() == (0,)


# -- 2. the run's role does not outlive the run ------------------------------------


def test_a_password_the_guest_sets_opens_nothing_after_the_run(pg: PgEnv) -> None:
    assert sql(pg.scope, "SELECT id FROM customers WHERE id = 1")["rows"] == [[1]]
    role = run_role(pg.scope)
    # Suppose the guest got a statement of its own through: PostgreSQL lets any
    # role change its own password.
    pool = _pool(pg.scope, pg.scope.datasets["crm"])
    conn = pool.take()
    conn.execute("ALTER ROLE CURRENT_USER PASSWORD 'guest-pw'")
    pool.give(conn)
    close_pg_pools(pg.scope)  # the run ends
    with pytest.raises(psycopg.OperationalError):
        psycopg.connect(pg.dsn, user=role, password="guest-pw").close()


def test_the_roles_password_is_not_derivable_from_the_dsn(pg: PgEnv) -> None:
    assert sql(pg.scope, "SELECT id FROM customers WHERE id = 1")["rows"] == [[1]]
    role = run_role(pg.scope)
    import hashlib
    import hmac

    derived = hmac.new(
        pg.dsn.encode(), f"proctor-pg-role/v1/{role}".encode(), hashlib.sha256
    ).hexdigest()
    with pytest.raises(psycopg.OperationalError):
        psycopg.connect(pg.dsn, user=role, password=derived).close()


def test_undeploy_ends_a_live_runs_login(pg: PgEnv) -> None:
    assert sql(pg.scope, "SELECT id FROM customers WHERE id = 1")["rows"] == [[1]]
    role = run_role(pg.scope)
    assert revoke_deployment_role(pg.dsn, TENANT, DEPLOYMENT, "crm") is True
    with superuser(pg) as conn:
        assert conn.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", (role,)).fetchone() is None
    with pytest.raises(NOT_RUN):
        sql(pg.scope, "SELECT id FROM customers WHERE id = 1")


def test_a_dead_runs_role_is_swept(pg: PgEnv) -> None:
    from proctor.broker import revoke_run_grants

    assert sql(pg.scope, "SELECT id FROM customers WHERE id = 1")["rows"] == [[1]]
    role = run_role(pg.scope)
    # The process that held the run died: nothing released it.
    pg.scope.__dict__.pop("_pg_role_pools", None)
    revoke_run_grants([("postgresql", pg.dsn, "crm")], TENANT, pg.scope.run_id)
    with superuser(pg) as conn:
        assert conn.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", (role,)).fetchone() is None


def test_two_runs_of_one_deployment_each_hold_their_own_login(pg: PgEnv) -> None:
    other = replace(pg.scope, run_id="r2")
    assert sql(pg.scope, "SELECT id FROM customers WHERE id = 1")["rows"] == [[1]]
    assert sql(other, "SELECT id FROM customers WHERE id = 1")["rows"] == [[1]]
    close_pg_pools(pg.scope)  # the first run ends; the second goes on
    assert sql(other, "SELECT id FROM customers WHERE id = 2")["rows"] == [[2]]
    close_pg_pools(other)


# -- 3. decisions on what a statement really reads --------------------------------


def test_query_to_xml_of_a_forbidden_column_is_refused_and_recorded(
    pg: PgEnv, ledger_env: LedgerEnv, tmp_path: Path
) -> None:
    # The database grant holds mrr; this run's policy permits only id and name.
    caps = {"datasets": {"crm": {"tables": {"customers": {"columns": ["id", "name"]}}}}}
    scope = make_scope(ledger_env, tmp_path / "unused.db", caps=caps, run_id="r-xml")
    scope = replace(scope, datasets=pg.scope.datasets)
    try:
        for query in (
            "SELECT id, query_to_xml('select mrr from customers', true, true, '') FROM customers",
            "SELECT query_to_xmlschema('select mrr from customers', true, true, '')",
            "SELECT id, (SELECT query_to_xml('select mrr from customers', true, true, ''))"
            " FROM customers",
            "SELECT * FROM xpath_table('id', 'x', 'customers', 'x', 'true') AS t(id int, x text)",
        ):
            with pytest.raises(NOT_RUN):
                sql(scope, query)
            ev = last_event(pg.ledger)
            assert ev["decision"] == "deny" and ev["action"] == "sql.select"
            # Not in the event's text (its keyed hashes are hex: any digits may occur).
            shown = {k: v for k, v in ev["details"].items() if k != "sql_hmac"}
            assert "900" not in json.dumps([ev["reason"], shown]), ev
    finally:
        close_pg_pools(scope)


CATALOG_READS = (
    "SELECT rolname FROM pg_roles",
    "SELECT datname FROM pg_database",
    "SELECT id, (SELECT string_agg(datname, ',') FROM pg_database) FROM customers",
    "SELECT pid, application_name FROM pg_stat_activity",
    "SELECT id, (SELECT count(*) FROM pg_locks) FROM customers",
    "SELECT id, (SELECT count(*) FROM pg_lock_status()) FROM customers",
    "SELECT name, setting FROM pg_settings",
    "SELECT table_name FROM information_schema.tables",
    "SELECT relname FROM pg_catalog.pg_class",
    "SELECT id FROM customers WHERE 'pg_authid'::regclass IS NOT NULL",
    "SELECT id, CAST('postgres' AS regrole) FROM customers",
    "SELECT id, current_setting('application_name') FROM customers",
    "SELECT id, pg_stat_get_activity(NULL) FROM customers",
    "SELECT id, pg_read_file('postgresql.conf') FROM customers",
    "SELECT id, to_regclass('pg_authid') FROM customers",
    "SELECT id, pg_catalog.pg_advisory_lock(7) FROM customers",
    "SELECT id FROM customers, dblink('dbname=postgres', 'select 1') AS t(x int)",
)


def test_catalogs_and_cluster_state_are_refused_with_a_clear_message(pg: PgEnv) -> None:
    for query in CATALOG_READS:
        with pytest.raises(NOT_RUN) as err:
            sql(pg.scope, query)
        assert any(w in str(err.value) for w in ("catalog", "function", "refused")), query
        assert last_event(pg.ledger)["decision"] == "deny", query


def test_two_tenants_guests_cannot_pass_data_through_the_cluster(
    pg: PgEnv, pg_server: PostgresServer, ledger_env: LedgerEnv, tmp_path: Path
) -> None:
    name = f"crm_b_{abs(hash(str(tmp_path))) % 10**9}"
    dsn_b = make_pg_dataset(pg_server, name)
    grant_deployment_role(dsn_b, TENANT, "other", "crm", {"customers": {"columns": ["id"]}})
    caps = {"datasets": {"crm": {"tables": {"customers": {"columns": ["id"]}}}}}
    reader = make_scope(ledger_env, tmp_path / "unused.db", caps=caps, run_id="r-b")
    reader = replace(
        reader,
        deployment="other",
        datasets={"crm": DatasetBinding("crm", "postgresql", dsn_b)},
    )
    try:
        for send in (
            "SELECT id, pg_advisory_lock(271828) FROM customers WHERE id = 1",
            "SELECT id, pg_try_advisory_lock(271828) FROM customers WHERE id = 1",
            "SELECT id, set_config('application_name', 'hello-from-a', false) FROM customers"
            " WHERE id = 1",
        ):
            with pytest.raises(NOT_RUN):
                sql(pg.scope, send)
        for receive in (
            "SELECT id, (SELECT string_agg(objid::text, ',') FROM pg_locks) FROM customers",
            "SELECT id, (SELECT string_agg(application_name, ',')"
            " FROM pg_stat_get_activity(NULL)) FROM customers",
        ):
            with pytest.raises(NOT_RUN):
                sql(reader, receive)
        with superuser(pg) as conn:
            assert conn.execute(
                "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND objid = 271828"
            ).fetchone() == (0,)
            assert conn.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'hello-from-a'"
            ).fetchone() == (0,)
    finally:
        close_pg_pools(pg.scope)
        close_pg_pools(reader)
        revoke_deployment_role(dsn_b, TENANT, "other", "crm")
        pg_server.drop_database(name)


def test_pure_functions_still_work(pg: PgEnv) -> None:
    out = sql(
        pg.scope,
        "SELECT upper(name), round(mrr / 3.0, 1), date_trunc('day', now()) IS NOT NULL,"
        " coalesce(plan, 'x'), length(trim(country)), extract(year FROM now()) > 2000"
        " FROM customers WHERE id = 1",
    )
    assert out["rows"][0][:2] == ["ADA LOVELACE", 40.0]
    out = sql(
        pg.scope,
        "SELECT country, count(*), string_agg(name, ',' ORDER BY id),"
        " row_number() OVER (ORDER BY country) FROM customers GROUP BY country",
    )
    assert out["row_count"] == 3
    out = sql(pg.scope, "SELECT g FROM generate_series(1, 3) AS g, customers WHERE id = 1")
    assert out["rows"] == [[1], [2], [3]]
    # SQL-standard syntax the parser turns into function calls.
    out = sql(
        pg.scope,
        "SELECT id FROM customers WHERE name SIMILAR TO 'Ada%' AND name LIKE 'A!%' ESCAPE '!'"
        " OR (now(), now()) OVERLAPS (now(), now()) AND id = 1 AND name IS NORMALIZED"
        " AND substring(name FROM 1 FOR 3) = 'Ada' AND position('a' IN name) > 0",
    )
    assert out["rows"] == [[1]]


# -- 4. no DSN password in any message ---------------------------------------------


def _with_password(dsn: str, form: str) -> str:
    """The real server's DSN carrying SECRET the way ``form`` does."""
    base, _, db = dsn.rpartition("/")
    host = base.split("@", 1)[1]
    if form.startswith("host="):
        h, _, port = host.partition(":")
        return f"host={h} port={port} dbname={db} user=postgres password='{SECRET} x'"
    if "?" in form:
        return f"{dsn}?sslmode=disable&PassWord={SECRET}"
    return f"postgresql://postgres:{SECRET}@{host}/{db}"


@pytest.mark.parametrize("form", ["userinfo", "?query", "host=keyword"])
def test_no_error_path_prints_the_dsn_password(pg: PgEnv, ledger_env: LedgerEnv, form: str) -> None:
    dsn = _with_password(pg.dsn, form)
    missing = _with_password(pg.dsn.rpartition("/")[0] + "/no_such_db", form)
    messages: list[str] = []

    def catch(fn: Any, *args: Any) -> None:
        try:
            fn(*args)
        except ProctorError as exc:
            messages.append(f"{exc.message} {exc.hint or ''} {exc!s}")
        except Exception as exc:  # any error path counts
            messages.append(str(exc))
        else:
            raise AssertionError(f"{fn.__name__} did not fail")

    # A sandbox deployment naming a table that is not there (the case).
    catch(grant_deployment_role, dsn, TENANT, DEPLOYMENT, "crm", {"nosuch": {"columns": ["a"]}})
    catch(grant_deployment_role, missing, TENANT, DEPLOYMENT, "crm", {})
    catch(revoke_deployment_role, missing, TENANT, DEPLOYMENT, "crm")
    catch(POSTGRESQL.locate, missing)
    from proctor.store import open_store

    if not form.startswith("host="):
        catch(open_store, missing)
    assert len(messages) >= 4
    for text in messages:
        assert SECRET not in text, text
    assert all(SECRET not in str(e) for e in events(ledger_env))
    with pytest.raises(DatasetRoleError):
        grant_deployment_role(dsn, TENANT, DEPLOYMENT, "crm", {"nosuch": {"columns": ["a"]}})
    assert DSN_FORMS


def test_opening_the_home_drops_the_logins_of_a_dead_owners_run(pg: PgEnv, home: Path) -> None:
    """A process that held a run died (nothing released its login): the next
    opening of the home closes the run and drops the login with it."""
    from proctor.broker._pg_sql import create_run_login, deployment_role, run_login_role
    from proctor.ledger import utc_now
    from proctor.runtime import Runtime

    rt = Runtime.open(home)
    try:
        rt.tenants.create(TENANT, rt.operator)
        rt.resources.add_dataset(TENANT, "crm", pg.dsn, rt.operator)
        run_id = "r-dead-owner"
        login = run_login_role(TENANT, run_id, "crm")
        create_run_login(
            pg.dsn, deployment_role(TENANT, DEPLOYMENT, "crm"), login, allow=lambda t, c: True
        )
        with rt.store.write() as conn:
            conn.execute(
                "INSERT INTO runs (id, tenant, deployment, version, digest, environment,"
                " workload, approvals, backend, status, attempt, limits, started_at, supervisor)"
                " VALUES (?, ?, ?, 1, 'sha256:0', 'sandbox', 'w', '[]', 'bubblewrap', 'running',"
                " 1, '{}', ?, ?)",
                (run_id, TENANT, DEPLOYMENT, utc_now(), f"{os.uname().nodename}:999999999:1"),
            )
    finally:
        rt.close()
    Runtime.open(home).close()
    with superuser(pg) as conn:
        assert (
            conn.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", (login,)).fetchone() is None
        )


def test_registration_warns_of_databases_any_role_may_connect_to(
    pg: PgEnv, pg_server: PostgresServer, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="proctor"):
        assert POSTGRESQL.locate(pg.dsn) == pg.dsn
    # The test cluster is as initdb made it: "postgres" is open to every role.
    assert "postgres" in caplog.text and "REVOKE CONNECT" in caplog.text
    assert SECRET not in caplog.text


def test_a_call_arriving_after_the_run_ended_opens_no_login(pg: PgEnv) -> None:
    assert sql(pg.scope, "SELECT id FROM customers WHERE id = 1")["rows"] == [[1]]
    role = run_role(pg.scope)
    POSTGRESQL.release(pg.scope, pg.scope.datasets["crm"])
    with pytest.raises(NOT_RUN):
        sql(pg.scope, "SELECT id FROM customers WHERE id = 1")
    with superuser(pg) as conn:
        assert conn.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", (role,)).fetchone() is None


def test_a_statement_past_the_time_limit_is_cut_even_past_our_parse(pg: PgEnv) -> None:
    pool = _pool(pg.scope, pg.scope.datasets["crm"])
    stmt = _Statement(pool, "SELECT id, pg_sleep(30) FROM customers WHERE id = 1", (), 0.3)
    try:
        accesses = stmt.analyse()
        with pytest.raises(TimedOut):
            stmt.run_read(accesses, 10)
    finally:
        stmt.close()


MISSING_TABLE_MANIFEST = """
[artifact]
name = "pgjob"
entrypoint = ["python3", "main.py"]
purpose = "count customers"
[datasets.crm.tables.no_such_table]
columns = ["id"]
access = "read"
"""


def test_a_deployment_naming_a_missing_table_shows_no_dsn_password(
    tmp_path: Path, pg_server: PostgresServer, home: Path
) -> None:
    """The issue's observation, through the CLI: the grant's error names the DSN.
    Deploy refuses a manifest whose table the dataset lacks, so the grant's error is
    reached by dropping the table after the deployment."""
    from tests.conftest import run_cli

    name = f"crm_cli_{abs(hash(str(tmp_path))) % 10**9}"
    dsn = make_pg_dataset(pg_server, name) + f"?sslmode=disable&password={SECRET}"
    try:
        run_cli("tenant", "create", "acme", home=home)
        dev = run_cli("principal", "create", "-t", "acme", "dev", "--role", "developer",
                      home=home).out.splitlines()[-1]  # fmt: skip
        alice = run_cli("principal", "create", "-t", "acme", "alice", "--role", "approver",
                        home=home).out.splitlines()[-1]  # fmt: skip
        os.environ["CRM_DSN"] = dsn
        try:
            out = run_cli("dataset", "add", "-t", "acme", "crm", "--postgres-env", "CRM_DSN",
                          home=home)  # fmt: skip
        finally:
            del os.environ["CRM_DSN"]
        art = tmp_path / "art"
        art.mkdir(mode=0o755)
        (art / "main.py").write_text("print('hi')\n")
        (art / "proctor.toml").write_text(MISSING_TABLE_MANIFEST)
        digest = json.loads(run_cli("artifact", "submit", str(art), "-t", "acme", "--json",
                                    "--token", dev, home=home).out)["digest"]  # fmt: skip
        run_cli("approve", digest, "-t", "acme", "--yes", "--token", alice, home=home)
        deploy = ("deploy", digest, "-t", "acme", "--name", "pgjob", "--env", "production",
                  "--instruction", "count", "--token", dev)  # fmt: skip
        refused = run_cli(*deploy, home=home, check=False)
        assert refused.code == 5 and "no table 'no_such_table'" in refused.err, refused.err
        with psycopg.connect(pg_server.dsn(name), autocommit=True) as conn:
            conn.execute("CREATE TABLE no_such_table (id integer)")
        run_cli(*deploy, home=home)
        with psycopg.connect(pg_server.dsn(name), autocommit=True) as conn:
            conn.execute("DROP TABLE no_such_table")
        res = run_cli("run", "pgjob", "-t", "acme", "--backend", "bubblewrap", "--token", dev,
                      home=home, check=False)  # fmt: skip
        shown = res.out + res.err + out.out + out.err + refused.out + refused.err
        assert "no_such_table" in shown and "password=***" in shown
        assert SECRET not in shown
        events = run_cli("audit", "events", "-t", "acme", "--json", home=home).out
        assert SECRET not in events
        assert SECRET not in "".join(
            p.read_text(errors="replace") for p in home.rglob("*.log") if p.is_file()
        )
    finally:
        pg_server.drop_database(name)
