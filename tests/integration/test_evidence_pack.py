"""Evidence packs after a real workload (the demo): export, verify, CLI, queries."""

from __future__ import annotations

import json
import os
import pwd
import shutil
import socket
import subprocess
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from proctor.cli._evidence import register
from proctor.errors import UsageError, VerificationFailed
from proctor.evidence import (
    RangeTree,
    dpa_annex,
    export_pack,
    key_hmac,
    lineage,
    make_receipt,
    ropa,
    sample_runs,
    verify_pack,
    verify_receipt,
)
from proctor.ledger import leaf_hash, lineage_keys, read_objects, verify_inclusion
from proctor.runtime import Runtime
from tests.conftest import PROCTOR

ALL = ("2000-01-01T00:00:00.000000Z", "2100-01-01T00:00:00.000000Z")


@pytest.fixture
def home(demo_home: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "home"
    shutil.copytree(demo_home, copy, symlinks=True)
    # The config names its store by absolute path: point the copy at its own.
    config = json.loads((copy / "config.json").read_text())
    config["store"] = f"sqlite:///{copy / 'proctor.db'}"
    (copy / "config.json").write_text(json.dumps(config))
    return copy


@pytest.fixture
def rt(home: Path) -> Iterator[Runtime]:
    with Runtime.open(home) as runtime:
        yield runtime


def events(rt: Runtime) -> list[dict[str, object]]:
    return [json.loads(e) for e in rt.ledger.entries("acme")]


def test_full_pack_verifies(rt: Runtime, tmp_path: Path) -> None:
    info = export_pack(rt, "acme", *ALL, tmp_path / "p.zip")
    assert info.first_seq == 0 and info.end_seq == rt.ledger.head("acme").size
    report = verify_pack(tmp_path / "p.zip", rt.ledger.vkey())
    assert report.production_runs == 1 and report.approvals_checked == 1
    assert report.accesses_checked > 5
    with zipfile.ZipFile(tmp_path / "p.zip") as zf:
        # The native events are the hashed bytes, byte for byte.
        assert zf.read("events/events.jsonl") == b"".join(
            e + b"\n" for e in rt.ledger.entries("acme")
        )
        doc = json.loads(zf.read("report/report.json"))
        html = zf.read("report/report.html").decode()
        md = zf.read("report/report.md").decode()
    assert {c["id"] for c in doc["controls"]} >= {"SOC2-CC6.1", "SOC2-CC8.1", "GDPR-28.3.a"}
    assert doc["production_runs"] == 1
    assert any("email" not in k for k in doc["data"]["crm"])
    assert "data:image/png;base64," in html and "@media print" in html
    assert 'id="ev-' in md and "acme/alice" in md


def test_period_pack_carries_context(rt: Runtime, tmp_path: Path) -> None:
    evs = events(rt)
    start = next(e for e in evs if e["action"] == "run.start" and e["deployment"] == "churn")
    end = next(e for e in evs if e["action"] == "file.write" and e["deployment"] == "churn")
    info = export_pack(rt, "acme", str(start["time"]), str(end["time"]), tmp_path / "p.zip")
    assert info.first_seq == start["seq"] and info.end_seq == end["seq"]
    assert info.start_size > 0 and info.context >= 4  # submit, approval, deployment, witnesses
    assert verify_pack(tmp_path / "p.zip").approvals_checked == 1


def test_range_tree_gives_rfc9162_proofs(rt: Runtime, tmp_path: Path) -> None:
    export_pack(rt, "acme", *ALL, tmp_path / "p.zip")
    with zipfile.ZipFile(tmp_path / "p.zip") as zf:
        lines = zf.read("events/events.jsonl").splitlines()
        rp = json.loads(zf.read("proofs/range.json"))
    tree = RangeTree(0, [leaf_hash(x) for x in lines], rp["size"], [], [])
    root = rt.ledger.root_at("acme", rp["size"])
    for i in range(len(lines)):
        path = tree.inclusion(i)
        assert path == list(rt.ledger.inclusion_proof("acme", i, rp["size"]).hashes)
        verify_inclusion(i, rp["size"], leaf_hash(lines[i]), path, root)


def test_receipt_of_the_run_end(rt: Runtime, tmp_path: Path) -> None:
    end = [e for e in events(rt) if e["action"] == "run.end"][-1]
    text = make_receipt(rt, "acme", int(end["seq"]))  # type: ignore[call-overload]
    assert text.startswith("c2sp.org/tlog-proof@v1\nextra ")
    r = verify_receipt(text, rt.ledger.vkey())
    assert r.event == end and r.origin.endswith("/tenant/acme")
    lines = text.split("\n")
    lines[3] = "A" * 43 + "="
    with pytest.raises(VerificationFailed):
        verify_receipt("\n".join(lines), rt.ledger.vkey())


def test_lineage_finds_the_runs_that_read_a_record(rt: Runtime) -> None:
    key = rt.keys.lineage_key("acme")
    read = next(
        e
        for e in events(rt)
        if e["action"] == "sql.select"
        and e["deployment"] == "churn"
        and e["details"].get("lineage_object", {}).get("count")
    )  # type: ignore[index]
    ref = read["details"]["lineage_object"]  # type: ignore[index]
    wanted = set(lineage_keys(read_objects(rt.store, "acme", [ref["digest"]])[ref["digest"]]))
    customer = next(str(i) for i in range(1, 20001) if key_hmac(key, str(i)) in wanted)
    doc = lineage(rt, "acme", "crm", customer)
    runs = {r["run"] for r in doc["read"]}
    assert read["run"] in runs
    assert all(
        r["approved_by"] == ["acme/alice"] for r in doc["read"] if r["environment"] == "production"
    )
    assert lineage(rt, "acme", "crm", "no-such-customer")["read"] == []


def test_sample_is_reproducible(rt: Runtime) -> None:
    a = sample_runs(rt, "acme", 25, "audit-2026")
    assert a == sample_runs(rt, "acme", 25, "audit-2026")
    assert a["population"] == 1 and a["n"] == 1
    item = a["runs"][0]
    assert item["approvals"][0]["principal"] == "acme/alice"
    assert item["artifact"]["author"] == "acme/dev" and item["deployment"]["name"] == "churn"
    with pytest.raises(UsageError):
        sample_runs(rt, "acme", 0, "x")


def test_dpa_annex_and_ropa(rt: Runtime) -> None:
    from proctor.governance._subprocessors import Subprocessors

    Subprocessors(rt.store, rt.ledger).add(
        "acme",
        "benchmarks",
        purpose="churn benchmarks",
        location="EU",
        hosts=["127.0.0.1:1"],
        actor=rt.operator,
    )
    annex = dpa_annex(rt, "acme")
    # The demo registered its stand-in third party (benchmarks-inc) before running.
    names = {s["name"] for s in annex["subprocessors"]}
    assert names == {"benchmarks", "benchmarks-inc"}
    reached = {s["name"]: s for s in annex["subprocessors"]}
    assert reached["benchmarks"]["hosts"] == ["127.0.0.1:1"]
    assert not annex["uncovered"], "all egress the demo made went to a registered subprocessor"
    records = ropa(rt, "acme")["records"]
    assert records[0]["processing"] == "churn"
    assert "RET-142" in records[0]["controller_instruction"]
    assert records[0]["categories_of_data"][0]["columns"] == ["country", "id", "mrr", "plan"]


def test_cli(home: Path, tmp_path: Path) -> None:
    app = typer.Typer()
    register(app)
    runner = CliRunner()
    env = {"PROCTOR_HOME": str(home)}
    pack = tmp_path / "cli.zip"
    r = runner.invoke(
        app,
        [
            "evidence",
            "export",
            "-t",
            "acme",
            "--from",
            "2000-01-01",
            "--to",
            "2100-01-01",
            "-o",
            str(pack),
        ],
        env=env,
    )
    assert r.exit_code == 0, r.output
    with Runtime.open(home) as rt:
        vkey = rt.ledger.vkey()
        end = [e for e in events(rt) if e["action"] == "run.end"][-1]
        (tmp_path / "run.tlog-proof").write_text(make_receipt(rt, "acme", int(end["seq"])))  # type: ignore[call-overload]
    r = runner.invoke(app, ["evidence", "verify", str(pack), "--key", vkey])
    assert r.exit_code == 0 and "verified" in r.output, r.output
    r = runner.invoke(app, ["evidence", "report", str(pack), "-o", str(tmp_path / "rep")])
    assert (tmp_path / "rep" / "report.html").exists()
    r = runner.invoke(app, ["receipt", "verify", str(tmp_path / "run.tlog-proof"), "--key", vkey])
    assert r.exit_code == 0 and "run.end" in r.output, r.output
    r = runner.invoke(
        app,
        [
            "subprocessor",
            "add",
            "-t",
            "acme",
            "stripe",
            "--purpose",
            "pay",
            "--location",
            "IE",
            "--host",
            "api.stripe.com",
        ],
        env=env,
    )
    assert r.exit_code == 0, r.output
    r = runner.invoke(app, ["subprocessor", "list", "-t", "acme", "--json"], env=env)
    listed = {s["name"]: s for s in json.loads(r.output)}
    assert listed["stripe"]["hosts"] == ["api.stripe.com:443"]
    for cmd in (
        ["evidence", "dpa-annex", "--json"],  # text for people without it (issue 33)
        ["evidence", "ropa", "--json"],
        ["evidence", "sample", "--seed", "s", "--json"],
        ["lineage", "--dataset", "crm", "--key", "42", "--json"],
    ):
        r = runner.invoke(app, [*cmd, "-t", "acme"], env=env)
        assert r.exit_code == 0, (cmd, r.output)
        json.loads(r.output)
    # Without --json the sample is for people: each run, who started it and approved it.
    doc = json.loads(runner.invoke(app, ["evidence", "sample", "--seed", "s", "--json",
                                         "-t", "acme"], env=env).output)  # fmt: skip
    r = runner.invoke(app, ["evidence", "sample", "--seed", "s", "-t", "acme"], env=env)
    assert r.exit_code == 0 and not r.output.lstrip().startswith("{"), r.output
    assert f"of {doc['population']} production runs of acme" in r.output
    for item in doc["runs"]:
        assert item["run"]["id"] in r.output and item["artifact"]["digest"] in r.output
        for a in item["approvals"]:
            assert f"approved by: {a['principal']}" in r.output
    r = runner.invoke(app, ["subprocessor", "remove", "-t", "acme", "stripe"], env=env)
    assert r.exit_code == 0, r.output


def test_the_report_names_who_started_each_production_run(home: Path, tmp_path: Path) -> None:
    """The demo's production run was started by a principal (acme/dev). Another is
    started here by the local operator, with no token, in a home set up by someone
    else: the record names the OS user and host that started it, not who ran init."""
    config = json.loads((home / "config.json").read_text())
    config["operator"] = "local-operator:someone-else@elsewhere"
    (home / "config.json").write_text(json.dumps(config))
    env = dict(os.environ, PROCTOR_HOME=str(home))
    env.pop("PROCTOR_TOKEN", None)
    # It fails (the demo's stand-in API is gone with the demo): a production run all the same.
    subprocess.run([PROCTOR, "run", "churn", "-t", "acme"], env=env, capture_output=True,
                   check=False, timeout=120)  # fmt: skip
    me = f"local-operator:{pwd.getpwuid(os.geteuid()).pw_name}@{socket.gethostname()}"
    with Runtime.open(home) as rt:
        export_pack(rt, "acme", *ALL, tmp_path / "p.zip")
        assert verify_pack(tmp_path / "p.zip", rt.ledger.vkey()).production_runs == 2
        sample = sample_runs(rt, "acme", 5, "who")
    assert sorted(item["started_by"] for item in sample["runs"]) == sorted(["acme/dev", me])
    with zipfile.ZipFile(tmp_path / "p.zip") as zf:
        doc = json.loads(zf.read("report/report.json"))
        md = zf.read("report/report.md").decode()
        html = zf.read("report/report.html").decode()
    runs = {r["started_by"]: r for r in doc["runs"] if r["environment"] == "production"}
    assert set(runs) == {"acme/dev", me}
    assert runs["acme/dev"]["started_by_type"] == "user"
    assert runs[me]["started_by_type"] == "operator"
    for r in runs.values():
        # Under which deployment, deployed by whom, approved by whom.
        assert r["deployment"] == "churn" and r["deployed_by"] == "acme/dev"
        assert [a["principal"] for a in r["approval_chain"]] == ["acme/alice"]
        row = next(line for line in md.splitlines() if line.startswith(f"| [{r['run']}]"))
        assert r["started_by"] in row and "deployed by acme/dev" in row
    assert "| started by |" in md and "<th>started by</th>" in html
    assert f"{me} (operator)" in html and "acme/dev (user)" in html
