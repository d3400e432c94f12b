"""The CLI convention (docs/cli.md), held on every command of the tree.

The tree is walked from ``proctor.cli._app.app``, so a command added later is
checked too: it needs help text on itself and every option, no ``<bool>``-style
metavar, ``--json`` where it prints (and JSON that parses when given), and on a
corrupted home one error line, no traceback, and the home left as it was.

Most calls run the command line as ``proctor.cli.main`` does (``guarded``, the
one error handler) in this process, stdio and the environment swapped in and the
exit code taken from its ``SystemExit``: the same code a subprocess runs, at a few
milliseconds instead of half a second, so that some 400 calls stay seconds. The commands that run a sandbox
and the checks that depend on the terminal are real subprocesses.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import re
import sqlite3
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import typer.main

from proctor.cli import guarded
from proctor.cli._app import app
from tests.conftest import PROCTOR, copy_home, logging_state, restore_logging, run_cli
from tests.e2e.conftest_gov import Gov, build_gov

JOB = """
import sys
import proctor_guest
rows = proctor_guest.sql("crm", "SELECT id, country FROM customers WHERE id <= 5")["rows"]
print("read", len(rows), "rows")
print("to stderr", file=sys.stderr)
"""
CAPS = """
[datasets.crm.tables.customers]
columns = ["id", "country"]
access = "read"
"""

#: Arguments for the commands that need some; every other command gets ``-t acme``
#: when it takes a tenant, else nothing. Run in the walk's (alphabetical) order, so
#: that e.g. ``deploy`` (of job2) comes before ``deployment stop job2``.
# fmt: off
ARGS: dict[str, list[str]] = {
    "approval list": ["-t", "acme", "--digest", "{D}"],
    "approval show": ["{A}", "-t", "acme"],
    "approval request": ["{D}", "-t", "acme", "--comment", "the walk"],
    "approval state": ["{D}", "-t", "acme"],
    "dataset describe": ["-t", "acme", "crm"],
    "approval revoke": ["{A}", "-t", "acme"],
    "approve": ["{D}", "-t", "acme", "--yes", "--token", "{TOKEN_bob}"],
    "artifact cat": ["-t", "acme", "{D}", "main.py"],
    "ask list": ["-t", "acme"],
    "artifact diff": ["-t", "acme", "{D}", "{D2}"],
    "artifact download": ["-t", "acme", "{D}", "-o", "{TMP}/a.tar"],
    "artifact review": ["-t", "acme", "{D}"],
    "artifact show": ["-t", "acme", "{D}"],
    "artifact submit": ["-t", "acme", "{NEWART}", "--token", "{TOKEN_dev}"],
    "audit consistency": ["-t", "acme", "--old", "1"],
    "audit export": ["-t", "acme", "--out", "{TMP}/log"],
    "audit proof": ["-t", "acme", "--index", "0"],
    "audit verify": ["-t", "acme", "--key", "{VKEY}"],
    "bucket add": ["-t", "acme", "walked"],
    "bucket get": ["-t", "acme", "reports", "in/k.txt", "-o", "{TMP}/k.out"],
    "bucket objects": ["-t", "acme", "reports"],
    "bucket put": ["-t", "acme", "reports", "in/k.txt", "{TMP}/k.txt"],
    "dataset add": ["-t", "acme", "crm2", "--sqlite", "{CRM}"],
    "deploy": ["-t", "acme", "{D}", "--name", "job2", "--env", "production",
               "--instruction", "the walk (CLI-1)"],
    "deployment stop": ["-t", "acme", "job2"],
    "deployment versions": ["-t", "acme", "job"],
    "egress allow-range": ["-t", "acme", "127.0.0.1/32"],
    "egress ca add": ["-t", "acme", "private.walk.test", "--ca-file", "{TMP}/ca.pem"],
    "egress ca remove": ["-t", "acme", "private.walk.test"],
    "egress sandbox-allow": ["-t", "acme", "mock.test:8443"],
    "erase": ["-t", "acme", "--dataset", "crm", "--key", "7", "--request-ref", "DSR-walk"],
    "evidence export": ["-t", "acme", "--from", "2000-01-01", "--to", "2100-01-01",
                        "-o", "{TMP}/pack.zip"],
    "evidence report": ["{TMP}/pack.zip", "-o", "{TMP}/report"],
    "evidence verify": ["{TMP}/pack.zip", "--key", "{VKEY}"],
    "history": ["-t", "acme", "--at", "now"],
    "hold add": ["-t", "acme", "--run", "{R}", "--reason", "the walk"],
    "init": ["--home", "{TMP}/another-home"],
    "lineage": ["-t", "acme", "--dataset", "crm", "--key", "1"],
    "manifest suggest": ["-t", "acme", "--run", "{R}"],
    "policy set": ["-t", "globex", "{TMP}/p.cedar"],
    "policy test": ["-t", "acme", "{TMP}/request.json"],
    "principal create": ["-t", "acme", "erin", "--role", "developer"],
    "principal rotate": ["-t", "acme", "erin"],
    "quorum set": ["-t", "globex", "--required", "1"],
    "receipt get": ["{R}", "-t", "acme", "-o", "{TMP}/receipt"],
    "receipt verify": ["{RECEIPT}", "--key", "{VKEY}"],
    "reject": ["{D2}", "-t", "acme", "--token", "{TOKEN_alice}"],
    "retention set": ["-t", "acme", "--days", "400"],
    "run": ["job", "-t", "acme"],
    "runs show": ["{R}", "-t", "acme"],
    "sandbox run": ["--", "true"],
    "secret set": ["-t", "acme", "api", "--host", "api.example.com", "--from-env", "WALK_SECRET"],
    "subprocessor add": ["-t", "acme", "walk-co", "--purpose", "the walk", "--location", "EU",
                         "--host", "walk.example.com"],
    "subprocessor remove": ["-t", "acme", "walk-co"],
    "tenant create": ["initech"],
    "tenant freeze": ["globex"],
    "tenant quota": ["acme"],
    "tenant unfreeze": ["globex"],
    "witness add-log": ["--state", "{TMP}/witness", "proctor.local/tenant/acme", "{VKEY}"],
    "witness init": ["--state", "{TMP}/witness2", "--name", "walk.test/w2"],
    "witness show": ["--state", "{TMP}/witness"],
    "witness use": ["-t", "acme", "walk-w2", "walk.test/w+fad061bf+BKZ5r/Vd/dboNC9WZvVa8Ow84vr8Ad"
                    "mVYsA3OoWAafxr", "http://127.0.0.1:9"],
    "witness remove": ["-t", "acme", "walk-w"],
}
# fmt: on

#: Commands the --json walk does not run in this process, and why.
NOT_WALKED = {
    "serve": "runs until stopped; its log lines are JSON on stderr (tests of proctor serve)",
    "demo": "a story for people, several seconds long; test_demo_keeps_every_file_in_its_home",
    "audit tail": "follows the log until Ctrl-C (JSON Lines): the tests of audit tail",
    "run": "runs a sandbox: test_every_printing_command_speaks_json runs it as a subprocess",
    "sandbox run": "runs a sandbox: test_every_printing_command_speaks_json runs it too",
    "witness serve": "serves until stopped (its --json is one line): tests/integration/test_witness",
    "hold remove": "needs the id hold add made: tests/e2e/test_retention_cli.py runs it with --json",
    "backup verify": "needs a backup: tests/integration/test_backup.py runs it with --json",
    "ask show": "needs an asked call: tests/integration/test_api_asks.py runs it with --json",
    "ask approve": "needs an asked call: tests/integration/test_api_asks.py runs it",
    "ask deny": "needs an asked call: tests/integration/test_api_asks.py runs it",
    "restore": "needs a backup and a new home: tests/integration/test_backup.py runs it with --json",
}

#: Commands that print but take no --json, and why.
NO_JSON = {
    "artifact cat": "prints a file's exact bytes, which are the answer",
    "mcp": "speaks MCP (JSON-RPC) on stdout and nothing else: tests/e2e/test_mcp_loop.py",
}


#: The command tree, built once: ``app()`` builds it again at every call (what a
#: process does once), which would be most of the time of an in-process call.
ROOT = typer.main.get_command(app)


def _walk() -> Iterator[tuple[str, Any]]:
    def walk(cmd: Any, path: list[str]) -> Iterator[tuple[str, Any]]:
        yield " ".join(path), cmd
        for name, sub in sorted((getattr(cmd, "commands", None) or {}).items()):
            yield from walk(sub, [*path, name])

    yield from walk(ROOT, [])


COMMANDS = [(path, cmd) for path, cmd in _walk() if not getattr(cmd, "commands", None)]


def _params(cmd: Any) -> dict[str, Any]:
    return {p.name: p for p in cmd.params if p.name != "help"}


def _has_json(cmd: Any) -> bool:
    return any("--json" in getattr(p, "opts", ()) for p in cmd.params)


@contextlib.contextmanager
def _environ(env: dict[str, str]) -> Iterator[None]:
    saved = dict(os.environ)
    for key in ("PROCTOR_HOME", "PROCTOR_SERVER", "PROCTOR_TOKEN", "PROCTOR_DEBUG"):
        os.environ.pop(key, None)
    os.environ.update(env)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def invoke(args: list[str], env: dict[str, str] | None = None) -> tuple[int, str, str]:
    """``proctor ARGS`` as ``proctor.cli.main`` runs it (``guarded``), in this process."""
    from proctor.cli._common import REMOTE

    out, err = io.BytesIO(), io.BytesIO()
    o = io.TextIOWrapper(out, encoding="utf-8", write_through=True)
    e = io.TextIOWrapper(err, encoding="utf-8", write_through=True)
    saved = sys.argv, sys.stdout, sys.stderr, sys.stdin
    # A command owns its process's logging (``serve`` turns on JSON lines before it
    # opens the home); here the process is the test run's, so it is put back.
    logs = logging_state()
    sys.argv, sys.stdout, sys.stderr = ["proctor", *args], o, e
    sys.stdin = io.TextIOWrapper(io.BytesIO(b""), encoding="utf-8")
    code = 0
    try:
        with _environ({"COLUMNS": "200", **(env or {})}):
            guarded(lambda: ROOT.main(args=args, prog_name="proctor"))
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    finally:
        sys.argv, sys.stdout, sys.stderr, sys.stdin = saved
        REMOTE.update(url=None, ca=None)
        restore_logging(logs)
    return code, out.getvalue().decode(errors="replace"), err.getvalue().decode(errors="replace")


# -- help ------------------------------------------------------------------------------


def test_every_command_and_option_has_help_and_no_type_metavar() -> None:
    missing: list[str] = []
    for path, cmd in _walk():
        if not (cmd.help or "").strip():
            missing.append(f"proctor {path}: no help text")
        for name, p in _params(cmd).items():
            if not (getattr(p, "help", None) or "").strip():
                missing.append(f"proctor {path}: {name} has no help text")
    assert not missing, "\n".join(missing)
    shown = re.compile(r"<(bool|str|int|float|path|text)>")
    # typer's usage line writes a required argument as `{digest}:TEXT`.
    in_usage = re.compile(r"\{\w+\}|\b\w+:[A-Z]+\b")
    placeholder = re.compile(r"\{\w+\}")
    for path, cmd in _walk():
        code, out, err = invoke([*path.split(), "--help"])
        assert code == 0, (path, err)
        assert not shown.search(out), f"proctor {path} --help shows {shown.search(out)}"
        usage = " ".join(line for line in out.splitlines() if "Usage:" in line)
        assert "Usage:" in usage and not in_usage.search(usage), f"proctor {path}: {usage}"
        # Nowhere in the help a `{old}`-style placeholder (issue 33, item 13), but for
        # braces the command's own words hold (`--template`'s "{secret} is replaced").
        own = " ".join([cmd.help or "", *(f"{getattr(p, 'help', '')} {p.default}"
                                         for p in cmd.params)])  # fmt: skip
        stray = set(placeholder.findall(out)) - set(placeholder.findall(own))
        assert not stray, f"proctor {path} --help shows {sorted(stray)}:\n{out}"
        assert not re.search(r"\{\w+\}:[A-Z]+", out), f"proctor {path} --help:\n{out}"
    # The usage line in a usage error's hint names arguments the same way.
    code, _, err = invoke(["artifact", "diff", "sha256:00"])
    assert code == 2 and "proctor artifact diff [OPTIONS] OLD NEW" in err, err
    assert not placeholder.search(err), err
    code, out, _ = invoke(["--version"])
    from proctor import __version__

    assert code == 0 and out.strip() == __version__
    assert run_cli("--version").out.strip() == __version__  # the real entry point too


# -- --json on a small home, and tables ------------------------------------------------


@pytest.fixture(scope="module")
def walk_home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Gov, dict[str, str]]]:
    """A governed tenant (tests/e2e/conftest_gov.py) with one production run."""
    tmp = tmp_path_factory.mktemp("conventions")
    gov = build_gov(tmp)
    rt, op = gov.rt, gov.op
    rt.subprocessors.add("acme", "enrich-co", purpose="enrichment", location="EU",
                         hosts=["api.example.com"], actor=op)  # fmt: skip
    digest = gov.submit("acme", gov.artifact_dir("job", JOB, CAPS))
    other = gov.submit("acme", gov.artifact_dir("job", JOB.replace("<= 5", "<= 4"), CAPS))
    approval = rt.approvals.grant("acme", digest, gov.principal("alice"))
    rt.deployments.deploy("acme", rt.artifacts.get("acme", digest), "job",
                          environment="production", instruction="the walk (CLI-1)",
                          actor=gov.principal("dev").actor)  # fmt: skip
    (tmp / "p.cedar").write_text('@id("walk") forbid (principal, action, resource);\n')
    (tmp / "request.json").write_text(json.dumps({
        "principal": {"type": "Workload", "id": "spiffe://td/tenant/acme/deployment/job/run/r"},
        "action": "sql.select",
        "resource": {"type": "Table", "id": "acme/crm/customers"},
        "context": {"dataset": "crm", "columns": ["id"]},
    }))  # fmt: skip
    (tmp / "k.txt").write_text("hello\n")
    from tests.e2e.test_egress_ca_cli import make_cert  # egress ca add

    (tmp / "ca.pem").write_bytes(make_cert("walk CA")[0])
    rt.resources.put_object("acme", "reports", "in/k.txt", b"hello\n", op)
    from proctor.witness import TenantWitnesses, Witness  # witness add-log, show and remove

    witness = Witness.init(tmp / "witness", "walk.test/w")
    TenantWitnesses(rt.store, rt.ledger).use(
        "acme", "walk-w", witness.vkey, "http://127.0.0.1:9", op
    )
    values = {
        "D": digest, "D2": other, "A": approval.id, "TMP": str(tmp), "CRM": str(tmp / "crm.db"),
        "NEWART": str(gov.artifact_dir("walked", JOB, CAPS)), "VKEY": rt.ledger.vkey(),
        **{f"TOKEN_{name}": gov.token(name) for name in ("dev", "alice", "bob")},
    }  # fmt: skip
    yield gov, values
    gov.rt.close()


#: Values for required parameters that must parse before a command reads its home.
_VALID = {"since": "2000-01-01", "until": "2100-01-01", "at": "now", "digest": "0" * 64,
          "tenant": "acme", "index": "0", "old": "1", "days": "400"}  # fmt: skip


def _required_only(cmd: Any) -> list[str]:
    """A command's required arguments and options, with values that parse: what reaches
    the home whatever optional flags the command has."""
    args: list[str] = []
    for name, p in _params(cmd).items():
        if not p.required:
            continue
        value = _VALID.get(name, "x")
        is_option = p.opts[0].startswith("-")
        args += [p.opts[0], value] if is_option else [value]
    return args


def _fill(args: list[str], values: dict[str, str]) -> list[str]:
    return [re.sub(r"\{(\w+)\}", lambda m: values[m.group(1)], a) for a in args]


def _args(path: str, cmd: Any) -> list[str]:
    if path in ARGS:
        return list(ARGS[path])
    params = _params(cmd)
    needed = [n for n, p in params.items() if p.required and n != "tenant"]
    assert not needed, f"proctor {path} needs {needed}: add its arguments to ARGS"
    return ["-t", "acme"] if "tenant" in params else []


@pytest.mark.host
def test_every_printing_command_speaks_json(walk_home: tuple[Gov, dict[str, str]]) -> None:
    gov, values = walk_home
    env = {"PROCTOR_HOME": str(gov.home)}
    # The streaming commands, for real: the job's output on stderr, one object on stdout.
    res = run_cli("run", "job", "-t", "acme", "--json", home=gov.home)
    doc = json.loads(res.out)
    assert doc["status"] == "succeeded" and doc["exit_code"] == 0, doc
    assert doc["id"].startswith("r-") and len(doc["id"]) > 12  # whole, never shortened
    assert "read 5 rows" in res.err and "to stderr" in res.err and "read" not in res.out
    values["R"] = doc["id"]
    values["RECEIPT"] = str(gov.home / "runs" / doc["id"] / "receipt.tlog-proof")
    res = run_cli("sandbox", "run", "--json", "--", "sh", "-c", "echo out; echo err >&2",
                  home=gov.home)  # fmt: skip
    box = json.loads(res.out)
    assert box["exit_code"] == 0 and "out" in res.err and "err" in res.err
    # A table never cuts an id, whatever the terminal's width.
    narrow = subprocess.run([PROCTOR, "runs", "list", "-t", "acme"], capture_output=True,
                            env={**os.environ, "PROCTOR_HOME": str(gov.home), "COLUMNS": "50"},
                            timeout=60, check=True)  # fmt: skip
    assert doc["id"] in narrow.stdout.decode()
    # --wide: each table at its natural width, one row a line, whatever the terminal's.
    for cmd in (["runs", "list", "-t", "acme"], ["runs", "show", doc["id"], "-t", "acme"],
                ["audit", "events", "-t", "acme", "--run", doc["id"]],
                ["history", "-t", "acme", "--at", "now"]):  # fmt: skip
        wide = subprocess.run([PROCTOR, *cmd, "--wide"], capture_output=True, timeout=60,
                              env={**os.environ, "PROCTOR_HOME": str(gov.home), "COLUMNS": "50"},
                              check=True).stdout.decode()  # fmt: skip
        rows = [line for line in wide.splitlines() if doc["id"] in line or "│" in line]
        assert max(len(line) for line in rows) > 50, (cmd, wide)
        assert any(doc["id"] in line for line in wide.splitlines()), (cmd, wide)

    os.environ["WALK_SECRET"] = "s3cr3t-walk-value"
    try:
        problems: list[str] = []
        for path, cmd in COMMANDS:
            if path in NOT_WALKED:
                continue
            if not _has_json(cmd):
                if path not in NO_JSON:
                    problems.append(f"proctor {path} takes no --json")
                continue
            args = _fill(_args(path, cmd), values)
            code, out, err = invoke([*path.split(), *args, "--json"], {**env,
                                    "WALK_SECRET": "s3cr3t-walk-value"})  # fmt: skip
            # policy test answers a refusal with exit 1 and its JSON all the same.
            if code not in ((0, 1) if path == "policy test" else (0,)):
                problems.append(f"proctor {path} --json failed ({code}): {err.strip()}")
                continue
            try:
                parsed = json.loads(out)
            except ValueError:
                problems.append(f"proctor {path} --json printed no JSON: {out[:200]!r}")
                continue
            if not isinstance(parsed, (dict, list)) or (
                isinstance(parsed, list) and not all(isinstance(x, dict) for x in parsed)
            ):
                problems.append(f"proctor {path} --json: not an object or array of objects")
            if path.endswith(" list") and not isinstance(parsed, list):
                problems.append(f"proctor {path} --json: a list prints one array (docs/cli.md)")
            assert "s3cr3t-walk-value" not in out + err, f"proctor {path} printed the secret"
        assert not problems, "\n".join(problems)
    finally:
        os.environ.pop("WALK_SECRET", None)
    # The token in principal create's object works.
    code, out, _ = invoke(["principal", "create", "-t", "acme", "frank", "--role", "developer",
                           "--json"], env)  # fmt: skip
    token = json.loads(out)["token"]
    code, out, err = invoke(["runs", "list", "-t", "acme", "--json", "--token", token], env)
    assert code == 0 and values["R"] in {r["id"] for r in json.loads(out)}, err


# -- a corrupted home ------------------------------------------------------------------


def _snapshot(home: Path) -> dict[str, str]:
    """Every file's hash, but SQLite's own side files when they hold nothing: opening a
    store SQLite then refuses leaves an empty write-ahead log and its index behind."""
    return {
        str(p.relative_to(home)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(home.rglob("*"))
        if p.is_file()
        and not (p.name.endswith("-shm") or (p.name.endswith("-wal") and not p.stat().st_size))
    }


def _corrupt(home: Path, how: str) -> None:
    if how == "truncated store":
        db = home / "proctor.db"
        db.write_bytes(db.read_bytes()[:1000])
    elif how == "garbage store":
        (home / "proctor.db").write_bytes(os.urandom(8192))
    elif how == "empty store":  # once taken as a new store, and the home changed
        for side in home.glob("proctor.db-*"):
            side.unlink()
        (home / "proctor.db").write_bytes(b"")
    elif how == "missing key":
        (home / "keys" / "ledger.pem").unlink()
    elif how == "garbage config":
        (home / "config.json").write_text("garbage{")


@pytest.mark.parametrize("how", ["truncated store", "garbage store", "empty store",
                                 "missing key", "garbage config"])  # fmt: skip
def test_a_corrupted_home_gets_one_error_line_and_is_left_alone(
    how: str, initialised_home: Path, tmp_path: Path
) -> None:
    home = copy_home(initialised_home, tmp_path / "home")
    _corrupt(home, how)
    before = _snapshot(home)
    checked = 0
    for path, cmd in COMMANDS:
        if "home" not in _params(cmd) or path == "demo":
            continue  # no home to read (pack and receipt verification, sandbox backends)
        args = [] if path == "init" else _required_only(cmd)  # init: PROCTOR_HOME's home
        code, out, err = invoke([*path.split(), *args], {"PROCTOR_HOME": str(home)})
        lines = [line for line in err.splitlines() if line.strip()]
        assert code != 0, f"proctor {path} on a home with a {how} succeeded: {out[:300]}"
        assert "Traceback" not in err + out, f"proctor {path}:\n{err}"
        assert sum(line.startswith("error:") for line in lines) == 1, f"proctor {path}:\n{err}"
        assert len(lines) <= 2 and all(line.startswith(("error:", "hint:")) for line in lines), (
            f"proctor {path}:\n{err}"
        )
        checked += 1
    assert checked > 40
    assert _snapshot(home) == before, f"a command changed a home with a {how}"


def test_an_unexpected_error_is_one_line_and_a_hint_unless_debugging(tmp_path: Path) -> None:
    """A failure Proctor has no message of its own for (here: the demo given a file as
    its home) is one line and a hint; PROCTOR_DEBUG=1 shows the traceback."""
    not_a_dir = tmp_path / "a-file"
    not_a_dir.write_text("mine\n")
    res = run_cli("demo", "--home", str(not_a_dir), check=False)
    assert res.code == 1 and "Traceback" not in res.err + res.out
    lines = res.err.strip().splitlines()
    assert len(lines) == 2 and lines[0].startswith("error: internal error: "), res.err
    assert lines[1].startswith("hint: ") and "PROCTOR_DEBUG=1" in lines[1]
    # Debugging, the exception itself goes up (and Python prints its traceback).
    with pytest.raises(NotADirectoryError):
        invoke(["demo", "--home", str(not_a_dir)], {"PROCTOR_DEBUG": "1"})
    assert not_a_dir.read_text() == "mine\n"


# -- the demo --------------------------------------------------------------------------


def test_demo_keeps_every_file_in_its_home(demo_home: Path, tmp_path: Path) -> None:
    # The session's demo (tests/conftest.py) ran in a directory of its own.
    assert sorted(p.name for p in demo_home.parent.iterdir()) == [demo_home.name]
    assert (demo_home / "demo" / "acme-evidence.zip").is_file()
    # Again on the same home: refused, naming the flag that replaces it; nothing changed.
    copy = tmp_path / "again"
    import shutil

    shutil.copytree(demo_home, copy, symlinks=True)
    before = _snapshot(copy)
    code, _, err = invoke(["demo", "--home", str(copy)])
    assert code == 2 and f"proctor demo --home {copy} --replace" in err, err
    assert _snapshot(copy) == before
    # A directory that is not a demo's is never written into, nor replaced.
    other = tmp_path / "mine"
    other.mkdir()
    (other / "notes.txt").write_text("mine\n")
    code, _, err = invoke(["demo", "--home", str(other), "--replace"])
    assert code == 2 and "not the home of an earlier demo" in err
    assert [p.name for p in other.iterdir()] == ["notes.txt"]


@pytest.mark.host
def test_two_demos_share_a_folder_and_one_is_replaced(tmp_path: Path) -> None:
    # The symptom: a second demo beside the first wrote into their shared parent
    # and died on the first one's database. Each now keeps to its home, and --replace
    # runs one again from nothing.
    parent = tmp_path / "demos"
    parent.mkdir()
    for name in ("a", "b"):
        run_cli("demo", "--home", str(parent / name))
    assert sorted(p.name for p in parent.iterdir()) == ["a", "b"]
    run_cli("demo", "--home", str(parent / "a"), "--replace")
    assert sorted(p.name for p in parent.iterdir()) == ["a", "b"]
    for name in ("a", "b"):
        home = parent / name
        run_cli("audit", "verify", "-t", "acme", home=home)
        vkey = run_cli("key", "show", home=home).out.strip().splitlines()[-1]
        pack = home / "demo" / "acme-evidence.zip"
        run_cli("evidence", "verify", str(pack), "--key", vkey, home=home)


# -- deploy tells what the tenant lacks ------------------------------------------------


def test_deploy_refuses_what_the_tenant_is_not_ready_for_with_the_fix(tmp_path: Path) -> None:
    gov = build_gov(tmp_path)
    env = {"PROCTOR_HOME": str(gov.home)}
    try:
        caps = textwrap.dedent(CAPS) + textwrap.dedent("""
            [datasets.billing.tables.invoices]
            columns = ["id"]
            access = "read"

            [egress]
            hosts = ["api.example.com"]
            """)  # fmt: skip
        art = gov.artifact_dir("ready", JOB, caps)
        # At submit, the same findings are warnings (on stderr); the submission stands.
        code, out, err = invoke(["artifact", "submit", "-t", "acme", str(art), "--json",
                                 "--token", gov.token("dev")], env)  # fmt: skip
        assert code == 0, err
        digest = json.loads(out)["digest"]
        assert err.count("warning:") == 2 and "proctor dataset add -t acme billing" in err
        gov.rt.approvals.grant("acme", digest, gov.principal("alice"))
        size = gov.rt.ledger.head("acme").size
        deploy = ["deploy", "-t", "acme", digest, "--name", "ready", "--env", "production",
                  "--instruction", "x", "--token", gov.token("dev")]  # fmt: skip
        code, out, err = invoke(deploy, env)
        assert code == 5 and "Traceback" not in err and out == ""
        assert "dataset 'billing'" in err and "api.example.com:443" in err
        assert "proctor dataset add -t acme billing" in err
        assert "proctor subprocessor add -t acme" in err and "--host api.example.com:443" in err
        assert gov.rt.deployments.current("acme") == []
        assert gov.rt.ledger.head("acme").size == size  # refused before anything is recorded
        # The fix the hint names. The dataset registered has the table, not the column.
        billing = tmp_path / "billing.db"
        with contextlib.closing(sqlite3.connect(billing)) as db:
            db.execute("CREATE TABLE invoices (number TEXT, total INTEGER)")
            db.commit()
        for fix in (["dataset", "add", "-t", "acme", "billing", "--sqlite", str(billing)],
                    ["subprocessor", "add", "-t", "acme", "enrich-co", "--purpose", "enrichment",
                     "--location", "EU", "--host", "api.example.com:443"]):  # fmt: skip
            assert invoke(fix, env)[0] == 0
        code, out, err = invoke(deploy, env)
        assert code == 5 and "no column 'id' in 'invoices'" in err, err
        assert "correct datasets.billing.tables" in err
        assert gov.rt.deployments.current("acme") == []
        with contextlib.closing(sqlite3.connect(billing)) as db:
            db.execute("ALTER TABLE invoices ADD COLUMN id INTEGER")
            db.commit()
        code, out, err = invoke([*deploy, "--json"], env)
        assert code == 0 and json.loads(out)["digest"] == digest, err
    finally:
        gov.rt.close()
