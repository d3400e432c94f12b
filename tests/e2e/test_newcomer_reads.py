"""A newcomer's reads (issue 33, items 6, 7, 8, 9, 11, 15, 17), through the real CLI in a
subprocess (and the API where the item has a route), each as a person meets it:

- ``bucket get`` without ``-o`` writes the object to stdout (item 6);
- ``audit events`` and ``runs show``-like tables fit 80 columns without ``--wide``
  (a workload by its run, not its SPIFFE id folded over eight lines), whole with it (7);
- an unknown action or tenant is an error, not an empty answer and exit 0 (8);
- ``retention show`` says what an erasure did, not "None keys" (9);
- ``artifact list`` marks approved digests, ``artifact review`` of a new version names
  the approved one of the same name and shows the diff against it (11);
- ``policy show`` of a tenant with no policies says so and where to look (15);
- ``evidence dpa-annex`` and ``ropa`` print text for people, JSON with ``--json``; a
  second erasure of the same key says nothing was left to erase, locally and through
  the API, and its event says so rather than reading as a second erasure (17).
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from proctor import Client
from proctor.api import ApiServer, serve_api
from proctor.governance import record_key_hmac
from proctor.ledger import Actor, EventDraft, lineage_object
from tests.conftest import PROCTOR, CliResult, run_cli
from tests.e2e.conftest_gov import Gov, build_gov

RUN = "r-0a1b2c3d4e5f6a7b"
WORKLOAD = f"spiffe://proctor.local/tenant/acme/deployment/churn-report/run/{RUN}"


@dataclass
class Home:
    gov: Gov
    server: ApiServer
    old: str  # the approved version of "report"
    new: str  # its successor, not approved


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Home]:
    gov = build_gov(tmp_path_factory.mktemp("reads"))
    rt = gov.rt
    rt.tenants.create("empty", gov.op)
    gov.people["empty-root"] = rt.principals.create("empty", "root", "user", ["admin"], gov.op)
    lkey = rt.keys.lineage_key("acme")
    work = Actor("workload", WORKLOAD)
    for keys in (range(1, 6), range(3, 9)):
        obj, ref = lineage_object(record_key_hmac(lkey, str(k)) for k in keys)
        rt.ledger.append("acme", EventDraft(
            work, "sql.select", "dataset/crm/customers", run=RUN, objects=(obj,),
            reason="allowed by policy acme-crm-read for churn-report and its approval",
            details={"dataset": "crm", "lineage_object": ref},
        ))  # fmt: skip
    rt.resources.put_object("acme", "reports", "churn.md", b"# churn\nall well\n", gov.op)
    rt.resources.put_object("acme", "reports", "blob.bin", b"\x00\x01\xff\xfe", gov.op)
    old = gov.submit("acme", gov.artifact_dir("report", "print('v1')\n"))
    gov.rt.approvals.grant("acme", old, gov.principal("alice"), expires=timedelta(days=1))
    new = gov.submit("acme", gov.artifact_dir("report", "print('v2')\nprint('more')\n"))
    server = serve_api(rt, "127.0.0.1", 0)
    yield Home(gov, server, old, new)
    server.stop()
    rt.close()


def cli(h: Home, *args: str, check: bool = True) -> CliResult:
    return run_cli(*args, home=h.gov.home, check=check)


def _events(h: Home, action: str) -> list[dict[str, Any]]:
    return [e for e in map(json.loads, h.gov.rt.ledger.entries("acme")) if e["action"] == action]


# -- item 6 ---------------------------------------------------------------------------


def test_bucket_get_writes_to_stdout_without_o(home: Home) -> None:
    got = cli(home, "bucket", "get", "-t", "acme", "reports", "churn.md")
    assert got.raw == b"# churn\nall well\n"
    binary = cli(home, "bucket", "get", "-t", "acme", "reports", "blob.bin")
    assert binary.raw == b"\x00\x01\xff\xfe"  # piped: the exact bytes
    remote = run_cli("--server", home.server.url, "bucket", "get", "-t", "acme", "reports",
                     "churn.md", "--token", home.gov.token("root"))  # fmt: skip
    assert remote.raw == b"# churn\nall well\n"


# -- item 7 ---------------------------------------------------------------------------


def _at(columns: int, *args: str, home: Path) -> str:
    env = {**os.environ, "PROCTOR_HOME": str(home), "COLUMNS": str(columns)}
    proc = subprocess.run([PROCTOR, *args], capture_output=True, env=env, timeout=120,
                          check=True)  # fmt: skip
    return proc.stdout.decode()


def test_audit_events_fit_80_columns_and_wide_keeps_the_whole_ids(home: Home) -> None:
    out = _at(80, "audit", "events", "-t", "acme", "--action", "sql.select",
              home=home.gov.home)  # fmt: skip
    lines = out.splitlines()
    assert max(len(line) for line in lines) <= 80, out
    # Each row is at most a few lines (the reason folded), not the SPIFFE id over eight.
    body = [line for line in lines if line.startswith("│")]
    assert len(body) <= 2 * 4, out
    assert f"run {RUN}" in out and "spiffe://" not in out
    wide = _at(80, "audit", "events", "-t", "acme", "--action", "sql.select", "--wide",
               home=home.gov.home)  # fmt: skip
    assert f"workload:{WORKLOAD}" in wide
    assert len([line for line in wide.splitlines() if line.startswith("│")]) == 2


# -- item 8 ---------------------------------------------------------------------------


def test_unknown_action_and_tenant_are_errors(home: Home) -> None:
    res = cli(home, "audit", "events", "-t", "acme", "--action", "no.such.action", check=False)
    assert res.code == 2 and "error: unknown action 'no.such.action'" in res.err, res.err
    assert res.out == ""
    typo = cli(home, "audit", "events", "-t", "acme", "--action", "sql.selct", check=False)
    assert typo.code == 2 and "sql.select" in typo.err
    remote = run_cli("--server", home.server.url, "audit", "events", "-t", "acme", "--action",
                     "no.such.action", "--token", home.gov.token("root"), check=False)  # fmt: skip
    assert remote.code == 2 and "unknown action" in remote.err
    for args in (["retention", "show"], ["hold", "list"], ["bucket", "list"],
                 ["dataset", "list"], ["secret", "list"], ["subprocessor", "list"]):  # fmt: skip
        res = cli(home, *args, "-t", "nope", check=False)
        assert res.code != 0 and "error: unknown tenant 'nope'" in res.err, (args, res.err)


# -- items 9 and 17: an erasure, and the same key again -------------------------------


def test_erasure_shown_and_a_second_erasure_of_the_same_key_says_so(home: Home) -> None:
    first = cli(home, "erase", "-t", "acme", "--dataset", "crm", "--key", "4",
                "--request-ref", "DSR-9")  # fmt: skip
    assert "the key is gone from 2 lineage object(s) of 2 event(s)" in first.out, first.out
    again = cli(home, "erase", "-t", "acme", "--dataset", "crm", "--key", "4",
                "--request-ref", "DSR-10")  # fmt: skip
    assert "nothing to erase" in again.out and "erased already" in again.out, again.out
    # Through the API: the same answer, as data.
    admin = Client(home.server.url, home.gov.token("root"))
    doc = admin.erase("acme", "crm", "4", "DSR-11")
    assert doc["found"] is False and doc["objects"] == 0 and doc["events"] == 0
    erasures = _events(home, "erasure.request")
    assert [e["details"]["objects"] for e in erasures] == [2, 0, 0]
    assert "one record key erased" in erasures[0]["reason"]
    for e in erasures[1:]:
        assert "nothing of the key was left" in e["reason"] and "nothing changed" in e["reason"]
    shown = cli(home, "retention", "show", "-t", "acme", "--wide").out
    assert "None" not in shown, shown
    assert "request DSR-9 on crm: key erased from 2 object(s) of 2 event(s)" in shown, shown
    assert "request DSR-10 on crm: nothing left to erase (erased already)" in shown, shown
    remote = run_cli("--server", home.server.url, "retention", "show", "-t", "acme", "--wide",
                     "--token", home.gov.token("root")).out  # fmt: skip
    assert "request DSR-11 on crm: nothing left to erase (erased already)" in remote, remote
    verified = json.loads(cli(home, "audit", "verify", "-t", "acme", "--json").out)
    assert verified["verified"], verified


# -- item 11 --------------------------------------------------------------------------


def test_artifact_list_marks_approved_and_review_names_the_approved_predecessor(
    home: Home,
) -> None:
    rows = json.loads(cli(home, "artifact", "list", "-t", "acme", "--json").out)
    approved = {r["digest"]: r["approved"] for r in rows}
    assert approved == {home.old: True, home.new: False}
    table = cli(home, "artifact", "list", "-t", "acme", "--wide").out
    (old_line,) = [line for line in table.splitlines() if home.old in line]
    (new_line,) = [line for line in table.splitlines() if home.new in line]
    assert "approved" in old_line and "approved" not in new_line
    review = cli(home, "artifact", "review", "-t", "acme", home.new).out
    assert f"follows the approved report {home.old}" in review, review
    assert "alice" in review and "--diff" in review
    with_diff = cli(home, "artifact", "review", "-t", "acme", home.new, "--diff").out
    assert "+print('more')" in with_diff and "modified main.py" in with_diff, with_diff
    doc = json.loads(cli(home, "artifact", "review", "-t", "acme", home.new, "--diff",
                         "--json").out)  # fmt: skip
    assert doc["approved_predecessor"]["digest"] == home.old
    assert doc["diff"]["old"] == home.old and doc["diff"]["new"] == home.new
    # Through the server, the same.
    remote = run_cli("--server", home.server.url, "artifact", "review", "-t", "acme", home.new,
                     "--token", home.gov.token("bob")).out  # fmt: skip
    assert f"follows the approved report {home.old}" in remote
    # The API's own review document carries it (the console and the SDK read it there).
    sdk = Client(home.server.url, home.gov.token("bob")).review("acme", home.new)
    assert sdk["approved_predecessor"]["digest"] == home.old
    assert sdk["approved_predecessor"]["approvals"][0]["principal"].endswith("alice")
    assert Client(home.server.url, home.gov.token("bob")).review("acme", home.old)[
        "approved_predecessor"] is None  # fmt: skip
    first = cli(home, "artifact", "review", "-t", "acme", home.old).out
    assert "no earlier version of report is approved" in first


# -- item 15 --------------------------------------------------------------------------


def test_policy_show_of_a_tenant_without_policies_says_so(home: Home) -> None:
    out = cli(home, "policy", "show", "-t", "empty").out
    assert "empty has no policies of its own" in out, out
    assert "policy show -t empty --effective --deployment" in out
    doc = json.loads(cli(home, "policy", "show", "-t", "empty", "--json").out)
    assert doc["text"] == "" and doc["version"].startswith("sha256:")
    remote = run_cli("--server", home.server.url, "policy", "show", "-t", "empty",
                     "--token", home.gov.token("empty-root")).out  # fmt: skip
    assert "empty has no policies of its own" in remote, remote


# -- item 17: documents for people ----------------------------------------------------


def test_dpa_annex_and_ropa_are_text_without_json(home: Home, tmp_path: Path) -> None:
    cli(home, "subprocessor", "add", "-t", "acme", "mailer", "--purpose",
        "sends the report", "--location", "EU", "--host", "mail.example.com:443")  # fmt: skip
    annex = cli(home, "evidence", "dpa-annex", "-t", "acme").out
    assert not annex.lstrip().startswith("{"), annex
    assert "Subprocessor annex of acme" in annex and "mailer: sends the report" in annex
    assert "mail.example.com:443" in annex
    assert (
        json.loads(cli(home, "evidence", "dpa-annex", "-t", "acme", "--json").out)["subprocessors"][
            0
        ]["name"]
        == "mailer"
    )
    ropa = cli(home, "evidence", "ropa", "-t", "acme").out
    assert not ropa.lstrip().startswith("{"), ropa
    assert "Records of processing (GDPR Art. 30(2))" in ropa and "Security measures:" in ropa
    assert "mailer: sends the report (EU)" in ropa
    assert json.loads(cli(home, "evidence", "ropa", "-t", "acme", "--json").out)["tenant"] == (
        "acme"
    )
    out = tmp_path / "ropa.json"
    cli(home, "evidence", "ropa", "-t", "acme", "--out", str(out))
    assert json.loads(out.read_text())["tenant"] == "acme"


def test_bucket_get_refuses_binary_to_a_terminal_and_shows_text(home: Home) -> None:
    import pty

    def on_tty(key: str) -> tuple[int, bytes, bytes]:
        leader, follower = pty.openpty()
        env = {**os.environ, "PROCTOR_HOME": str(home.gov.home)}
        proc = subprocess.run([PROCTOR, "bucket", "get", "-t", "acme", "reports", key],
                              stdout=follower, stderr=subprocess.PIPE, env=env,
                              timeout=120)  # fmt: skip
        os.close(follower)
        shown = b""
        try:
            while chunk := os.read(leader, 4096):
                shown += chunk
        except OSError:  # the terminal's other end is closed: all read
            pass
        os.close(leader)
        return proc.returncode, shown, proc.stderr

    code, shown, err = on_tty("blob.bin")
    assert code == 2 and b"is binary (4 bytes)" in err and b"-o FILE" in err, err
    assert b"\x00\x01" not in shown
    code, shown, _ = on_tty("churn.md")
    assert code == 0 and b"all well" in shown


def test_lineage_fits_80_columns_and_wide_keeps_its_columns(home: Home) -> None:
    out = _at(80, "lineage", "-t", "acme", "--dataset", "crm", "--key", "5",
              home=home.gov.home)  # fmt: skip
    assert max(len(line) for line in out.splitlines()) <= 80, out
    assert RUN in out and "2 events" not in out
    assert len([line for line in out.splitlines() if line.startswith("│")]) == 2, out
    wide = _at(80, "lineage", "-t", "acme", "--dataset", "crm", "--key", "5", "--wide",
               home=home.gov.home)  # fmt: skip
    assert "approved by" in wide and max(len(line) for line in wide.splitlines()) > 80


def test_audit_events_take_relative_times(home: Home) -> None:
    recent = json.loads(cli(home, "audit", "events", "-t", "acme", "--since", "1h",
                            "--action", "sql.select", "--json").out)  # fmt: skip
    assert len(recent) == 2
    before = json.loads(cli(home, "audit", "events", "-t", "acme", "--until", "1h",
                            "--json").out)  # fmt: skip
    assert before == []
    bad = cli(home, "audit", "events", "-t", "acme", "--since", "1x", check=False)
    assert bad.code == 2 and "--since" in bad.err and "1h" in bad.err
