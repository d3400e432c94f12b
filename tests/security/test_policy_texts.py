"""The policy texts that decided are in the pack, pinned by the versions the log cites.

Each run's calls cite the version of the set they were decided under (the tenant's
own set, the deployment's permits, the environment's forbid). `run.start` stores
that text in the ledger with it, the pack carries it as ``policies/<hex>.cedar``, and
`verify` holds each cited version to its text and decides a sample of the recorded
calls again with it. An operator who alters or drops a text (fixing the unsigned
manifest) is caught, and so is a log whose recorded decision the cited policy
would not have made, even when the operator signs that log with the real key.
"""

from __future__ import annotations

import hashlib
import json
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from proctor.api import serve_api
from proctor.client import Client
from proctor.errors import NotFound
from proctor.evidence import export_pack, verify_pack
from proctor.ledger import Actor, EventDraft, read_objects
from proctor.lifecycle import effective_policy
from proctor.runtime import Runtime
from tests.conftest import copy_home, run_cli
from tests.security.test_evidence_tamper import ALL, fails, rewrite


@pytest.fixture(scope="module")
def demo(demo_home: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, str]:
    base = tmp_path_factory.mktemp("policies")
    home = copy_home(demo_home, base / "home")
    with Runtime.open(home) as rt:
        export_pack(rt, "acme", *ALL, base / "full.zip")
        vkey = rt.ledger.vkey()
    return home, base / "full.zip", vkey


def _events(pack: Path) -> list[dict[str, object]]:
    with zipfile.ZipFile(pack) as zf:
        return [json.loads(x) for x in zf.read("events/events.jsonl").splitlines()]


def _churn_version(pack: Path) -> str:
    start = next(
        e for e in _events(pack) if e["action"] == "run.start" and e["deployment"] == "churn"
    )
    return str(start["details"]["policy_version"])  # type: ignore[index]


def test_the_texts_that_decided_are_carried_verified_and_decide_again_alike(
    demo: tuple[Path, Path, str],
) -> None:
    home, pack, vkey = demo
    report = verify_pack(pack, vkey)
    cited = {
        str(e["details"]["policy_version"])  # type: ignore[index]
        for e in _events(pack)
        if "policy_version" in e["details"]  # type: ignore[operator]
    }
    # The sandbox run's set, the production run's, and the role policy that refused the
    # author's own approval.
    assert len(cited) == 3 and report.policy_versions == 3
    assert report.decisions_redecided >= 20  # every Cedar decision of the demo's two runs
    with zipfile.ZipFile(pack) as zf:
        texts = {v: zf.read("policies/" + v.removeprefix("sha256:") + ".cedar") for v in cited}
    for version, text in texts.items():
        assert "sha256:" + hashlib.sha256(text).hexdigest() == version
    churn = texts[_churn_version(pack)].decode()
    # The permits the run used, the production forbid: the whole set, not the tenant's own.
    assert '@id("deploy:churn:sql:crm.customers")' in churn
    assert '["country", "id", "mrr", "plan"].containsAll(context.columns)' in churn
    assert '@id("tenant:subprocessors")' in churn
    refused = next(e for e in _events(pack) if e["action"] == "approval.grant")
    assert refused["policies"] == ["control:separation-of-duties"]
    control = texts[str(refused["details"]["policy_version"])].decode()  # type: ignore[index]
    assert '@id("control:separation-of-duties")' in control
    with Runtime.open(home) as rt:
        # Stored with run.start (and the refusal), not rebuilt at export.
        assert read_objects(rt.store, "acme", cited) == texts
        # A period that starts after the production run did: its calls are still decided
        # again (the environment from the run's record in the pack).
        first = next(e for e in _events(pack) if e["action"] == "sql.select"
                     and e["deployment"] == "churn")  # fmt: skip
        export_pack(rt, "acme", str(first["time"]), ALL[1], pack.parent / "late.zip")
    late = verify_pack(pack.parent / "late.zip", vkey)
    assert late.policy_versions == 1 and late.decisions_redecided >= 8


def test_an_altered_or_missing_policy_text_fails_verify(
    demo: tuple[Path, Path, str], tmp_path: Path
) -> None:
    _, pack, vkey = demo
    version = _churn_version(pack)
    name = "policies/" + version.removeprefix("sha256:") + ".cedar"

    def widen(files: dict[str, bytes]) -> None:
        # An operator who would show that email was approved after all.
        text = files[name].replace(b'["country", "id",', b'["country", "email", "id",')
        assert text != files[name]
        files[name] = text

    fails(
        rewrite(pack, tmp_path / "altered.zip", widen),
        vkey,
        rf"{name}: does not hash to policy version {version}, which event seq \d+ cites "
        r"\(the text was altered\)",
    )

    def drop(files: dict[str, bytes]) -> None:
        del files[name]

    fails(
        rewrite(pack, tmp_path / "missing.zip", drop),
        vkey,
        rf"cites policy version {version}, whose text {name} is not in the pack \(missing\)",
    )


def test_a_decision_the_cited_policy_would_not_make_is_caught(
    demo_home: Path, tmp_path: Path
) -> None:
    """The operator holds the signing key: a log it writes verifies. A recorded refusal
    of columns the run was permitted (a run framed as having tried what it did not)
    cites the production set, which allows it: deciding it again tells."""
    home = copy_home(demo_home, tmp_path / "home")
    with Runtime.open(home) as rt:
        evs = [json.loads(e) for e in rt.ledger.entries("acme")]
        real = next(
            e for e in evs
            if e["action"] == "sql.select" and e["deployment"] == "churn"
            and e["decision"] == "allow"
        )  # fmt: skip
        d = real["details"]
        tables = [{**t, "decision": "deny", "policies": []} for t in d["tables"]]
        rt.ledger.append(
            "acme",
            EventDraft(
                Actor("workload", real["actor"]["id"]), "sql.select", real["resource"],
                decision="deny", policies=(), reason="denied: no policy permits it",
                deployment="churn", run=real["run"], artifact=real["artifact"],
                approvals=tuple(real["approvals"]),
                details={"dataset": d["dataset"], "policy_version": d["policy_version"],
                         "sql_hmac": d["sql_hmac"], "synthetic": False, "tables": tables},
            ),
        )  # fmt: skip
        export_pack(rt, "acme", *ALL, tmp_path / "forged.zip")
        vkey = rt.ledger.vkey()
    fails(
        tmp_path / "forged.zip",
        vkey,
        r"\(sql.select dataset/crm/table/customers\): decided again with policy sha256:[0-9a-f]+, "
        r"gives allow by deploy:churn:sql:crm.customers, but the log records deny by no policy",
    )


def test_a_log_written_before_texts_were_stored_gets_them_rebuilt(
    demo_home: Path, tmp_path: Path
) -> None:
    """A log whose runs did not store their text: the exporter rebuilds each set from the
    tenant's policies, the deployments' capabilities and the register, and keeps only
    one that hashes to the cited version; one it cannot rebuild is named by verify."""
    home = copy_home(demo_home, tmp_path / "home")
    with Runtime.open(home) as rt:
        cited = {
            str(json.loads(e)["details"]["policy_version"])
            for e in rt.ledger.entries("acme")
            if b'"policy_version"' in e
        }
        with rt.store.write() as conn:
            for version in cited:
                conn.execute("DELETE FROM ledger_objects WHERE digest = ?", (version,))
        assert read_objects(rt.store, "acme", cited) == {}
        export_pack(rt, "acme", *ALL, tmp_path / "rebuilt.zip")
        assert verify_pack(tmp_path / "rebuilt.zip", rt.ledger.vkey()).policy_versions == 3
        # The register changed since: the production set cannot be rebuilt any more.
        rt.subprocessors.add(
            "acme", "later", purpose="p", location="EU", hosts=["later.example.com"],
            actor=rt.operator,
        )  # fmt: skip
        export_pack(rt, "acme", *ALL, tmp_path / "unrebuilt.zip")
        fails(tmp_path / "unrebuilt.zip", rt.ledger.vkey(), r"is not in the pack \(missing\)")


@pytest.fixture(scope="module")
def server(demo: tuple[Path, Path, str]) -> Iterator[tuple[Runtime, str, str]]:
    home = demo[0]
    rt = Runtime.open(home)
    _, token = rt.principals.create("acme", "pol-aud", "user", ["auditor"], rt.operator)
    api = serve_api(rt, "127.0.0.1", 0)
    yield rt, api.url, token
    api.stop()
    rt.close()


def test_policy_show_effective_and_history_name_the_set_the_runs_used(
    demo: tuple[Path, Path, str], server: tuple[Runtime, str, str]
) -> None:
    home, pack, _ = demo
    version = _churn_version(pack)
    local = json.loads(
        run_cli("policy", "show", "-t", "acme", "--effective", "--deployment", "churn",
                "--json", home=home).out
    )  # fmt: skip
    assert local["policy_version"] == version and local["recorded"] == [version]
    assert "deploy:churn:sql:crm.customers" in local["policy_ids"]
    assert "tenant:subprocessors" in local["policy_ids"]
    assert "sha256:" + hashlib.sha256(local["text"].encode()).hexdigest() == version
    people = run_cli("policy", "show", "-t", "acme", "--effective", "--deployment", "churn",
                     home=home).out  # fmt: skip
    assert f"is decided under: version {version}" in people
    assert '@id("deploy:churn:egress:' in people
    # Through the API and the SDK: the same document.
    rt, url, token = server
    assert Client(url, token).effective_policy("acme", "churn", 1) == local
    remote = run_cli("--server", url, "policy", "show", "-t", "acme", "--token", token,
                     "--effective", "--deployment", "churn", "--json").out  # fmt: skip
    assert json.loads(remote) == local
    own = run_cli("--server", url, "policy", "show", "-t", "acme", "--token", token,
                  "--json").out  # fmt: skip
    current = rt.policies.current("acme")
    assert json.loads(own) == {"tenant": "acme", "version": current.version, "text": current.text}
    with pytest.raises(NotFound, match="has no version 9"):
        effective_policy(rt, "acme", "churn", 9)
    # history: the runs' effective sets, not the tenant's own empty one.
    hist = json.loads(run_cli("history", "-t", "acme", "--at", "now", "--window", "1d",
                              "--json", home=home).out)  # fmt: skip
    runs = {r["deployment"]: r["policy_version"] for r in hist["runs"]}
    assert runs["churn"] == version and version in hist["policy_versions"]
    assert len(hist["policy_versions"]) == 2
    churn = next(d for d in hist["deployments"] if d["name"] == "churn")
    assert churn["policy_versions"] == [version]
    assert hist["tenant_policy_version"].startswith("sha256:e3b0c442")  # the empty own set
    assert version in run_cli("history", "-t", "acme", "--at", "now", "--window", "1d",
                              home=home).out  # fmt: skip
