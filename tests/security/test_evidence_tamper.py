"""Every alteration of an evidence pack is caught by `verify`, and named.

Each test rewrites the pack the way an operator hiding something would, and
fixes the manifest too (it is unsigned), so only the deeper checks can catch it.
"""

from __future__ import annotations

import base64
import hashlib
import json
import shutil
import zipfile
from collections.abc import Callable
from pathlib import Path

import pytest

from proctor.errors import VerificationFailed
from proctor.evidence import export_pack, verify_pack
from proctor.ledger import Actor, EventDraft, Signer
from proctor.runtime import Runtime, init_home
from tests.conftest import copy_home

ALL = ("2000-01-01T00:00:00.000000Z", "2100-01-01T00:00:00.000000Z")
Edit = Callable[[dict[str, bytes]], None]


@pytest.fixture(scope="module")
def demo(demo_home: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, str]:
    """A full pack and a period pack (approval in the context) of the demo."""
    base = tmp_path_factory.mktemp("tamper")
    home = copy_home(demo_home, base / "home")
    with Runtime.open(home) as rt:
        export_pack(rt, "acme", *ALL, base / "full.zip")
        evs = [json.loads(e) for e in rt.ledger.entries("acme")]
        start = next(e for e in evs if e["action"] == "run.start" and e["deployment"] == "churn")
        export_pack(rt, "acme", start["time"], ALL[1], base / "period.zip")
        vkey = rt.ledger.vkey()
    return base / "full.zip", base / "period.zip", vkey


def rewrite(src: Path, dst: Path, edit: Edit, fix_manifest: bool = True) -> Path:
    with zipfile.ZipFile(src) as zf:
        files = {n: zf.read(n) for n in zf.namelist()}
    edit(files)
    if fix_manifest:
        manifest = json.loads(files["manifest.json"])
        manifest["files"] = {
            n: hashlib.sha256(d).hexdigest() for n, d in files.items() if n != "manifest.json"
        }
        files["manifest.json"] = json.dumps(manifest).encode()
    with zipfile.ZipFile(dst, "w") as zf:
        for n, d in files.items():
            zf.writestr(n, d)
    return dst


def lines(files: dict[str, bytes], name: str) -> list[bytes]:
    return files[name].splitlines()


def set_lines(files: dict[str, bytes], name: str, new: list[bytes]) -> None:
    files[name] = b"".join(x + b"\n" for x in new)


def fails(pack: Path, vkey: str, match: str) -> None:
    with pytest.raises(VerificationFailed, match=match):
        verify_pack(pack, vkey)


def test_untouched_packs_verify(demo: tuple[Path, Path, str]) -> None:
    verify_pack(demo[0], demo[2])
    verify_pack(demo[1], demo[2])


def test_altered_event(demo: tuple[Path, Path, str], tmp_path: Path) -> None:
    def edit(files: dict[str, bytes]) -> None:
        evs = lines(files, "events/events.jsonl")
        i = next(i for i, e in enumerate(evs) if b'"decision":"deny"' in e)
        evs[i] = evs[i].replace(b'"decision":"deny"', b'"decision":"allow"')
        set_lines(files, "events/events.jsonl", evs)

    fails(rewrite(demo[0], tmp_path / "x.zip", edit), demo[2], "do not lead to the signed end")


def test_added_event(demo: tuple[Path, Path, str], tmp_path: Path) -> None:
    def edit(files: dict[str, bytes]) -> None:
        evs = lines(files, "events/events.jsonl")
        set_lines(files, "events/events.jsonl", [*evs[:5], evs[4], *evs[5:]])

    fails(rewrite(demo[0], tmp_path / "x.zip", edit), demo[2], "removed, inserted or reordered")


def test_removed_event(demo: tuple[Path, Path, str], tmp_path: Path) -> None:
    def edit(files: dict[str, bytes]) -> None:
        evs = lines(files, "events/events.jsonl")
        set_lines(files, "events/events.jsonl", evs[:-1])

    fails(rewrite(demo[0], tmp_path / "x.zip", edit), demo[2], "missing")


def test_removed_last_event_and_rewritten_meta(
    demo: tuple[Path, Path, str], tmp_path: Path
) -> None:
    def edit(files: dict[str, bytes]) -> None:
        evs = lines(files, "events/events.jsonl")
        set_lines(files, "events/events.jsonl", evs[:-1])
        meta = json.loads(files["pack.json"])
        meta["end_seq"] -= 1
        files["pack.json"] = json.dumps(meta).encode()

    fails(rewrite(demo[0], tmp_path / "x.zip", edit), demo[2], "range")


def test_altered_range_proof(demo: tuple[Path, Path, str], tmp_path: Path) -> None:
    def edit(files: dict[str, bytes]) -> None:
        rp = json.loads(files["proofs/range.json"])
        rp["left"][0] = base64.b64encode(b"\x00" * 32).decode()
        files["proofs/range.json"] = json.dumps(rp).encode()

    fails(rewrite(demo[1], tmp_path / "x.zip", edit), demo[2], "do not lead to the signed end")


def test_altered_context_proof(demo: tuple[Path, Path, str], tmp_path: Path) -> None:
    def edit(files: dict[str, bytes]) -> None:
        proofs = [json.loads(x) for x in lines(files, "proofs/context.jsonl")]
        proofs[0]["hashes"][0] = base64.b64encode(b"\x01" * 32).decode()
        set_lines(files, "proofs/context.jsonl", [json.dumps(p).encode() for p in proofs])

    fails(rewrite(demo[1], tmp_path / "x.zip", edit), demo[2], "context event seq")


def test_removed_approval(demo: tuple[Path, Path, str], tmp_path: Path) -> None:
    def edit(files: dict[str, bytes]) -> None:
        evs = lines(files, "events/context.jsonl")
        proofs = lines(files, "proofs/context.jsonl")
        keep = [
            i
            for i, e in enumerate(evs)
            if b'"action":"approval.grant","actor":{"id":"acme/alice"' not in e
        ]
        set_lines(files, "events/context.jsonl", [evs[i] for i in keep])
        set_lines(files, "proofs/context.jsonl", [proofs[i] for i in keep])

    fails(
        rewrite(demo[1], tmp_path / "x.zip", edit),
        demo[2],
        "approval.grant event is not in the pack",
    )


def test_altered_approval_event(demo: tuple[Path, Path, str], tmp_path: Path) -> None:
    def edit(files: dict[str, bytes]) -> None:
        evs = lines(files, "events/context.jsonl")
        evs = [e.replace(b'"id":"acme/alice"', b'"id":"acme/mallory"') for e in evs]
        set_lines(files, "events/context.jsonl", evs)

    fails(rewrite(demo[1], tmp_path / "x.zip", edit), demo[2], "context event seq")


def test_backdated_approval_record(demo: tuple[Path, Path, str], tmp_path: Path) -> None:
    def edit(files: dict[str, bytes]) -> None:
        approvals = json.loads(files["governance/approvals.json"])
        for a in approvals:
            a["created_at"] = "2020-01-01T00:00:00.000000Z"
        files["governance/approvals.json"] = json.dumps(approvals).encode()

    fails(rewrite(demo[1], tmp_path / "x.zip", edit), demo[2], "backdated")


def test_altered_ocsf_and_report(demo: tuple[Path, Path, str], tmp_path: Path) -> None:
    def ocsf(files: dict[str, bytes]) -> None:
        files["ocsf/events.ocsf.jsonl"] = files["ocsf/events.ocsf.jsonl"].replace(
            b'"action_id":2', b'"action_id":1', 1
        )

    def report(files: dict[str, bytes]) -> None:
        doc = json.loads(files["report/report.json"])
        doc["decisions"]["deny"] = 0
        files["report/report.json"] = json.dumps(doc).encode()

    fails(rewrite(demo[0], tmp_path / "o.zip", ocsf), demo[2], "ocsf")
    fails(rewrite(demo[0], tmp_path / "r.zip", report), demo[2], "report")


def test_manifest_catches_files_changed_added_removed(
    demo: tuple[Path, Path, str], tmp_path: Path
) -> None:
    def change(files: dict[str, bytes]) -> None:
        files["report/report.md"] += b"all good\n"

    def add(files: dict[str, bytes]) -> None:
        files["extra.txt"] = b"x"

    def remove(files: dict[str, bytes]) -> None:
        del files["report/report.md"]

    fails(rewrite(demo[0], tmp_path / "a.zip", change, False), demo[2], "altered")
    fails(rewrite(demo[0], tmp_path / "b.zip", add, False), demo[2], "added")
    fails(rewrite(demo[0], tmp_path / "c.zip", remove, False), demo[2], "removed")


def test_another_key(demo: tuple[Path, Path, str]) -> None:
    other = Signer.generate("proctor.local").verifier.vkey()
    fails(demo[0], other, "signature")


# -- logs the runtime would never write, signed by an operator who bypassed it ------


def forged(tmp_path: Path, mutate: str) -> tuple[Path, str]:
    init_home(tmp_path / "h", "proctor.test")
    with Runtime.open(tmp_path / "h") as rt:
        rt.tenants.create("acme", rt.operator)
        digest = "sha256:" + "ab" * 32
        caps = {
            "datasets": {"crm": {"tables": {"customers": {"columns": ["id"], "access": "read"}}}},
            "egress": ["api.example.com:443"],
        }
        from proctor.governance import capabilities_hash

        ch = capabilities_hash(caps)
        dev, alice = Actor("user", "acme/dev"), Actor("user", "acme/alice")
        approver = dev if mutate == "self" else alice
        L = rt.ledger
        L.append(
            "acme",
            EventDraft(
                dev,
                "artifact.submit",
                f"artifact/{digest}",
                artifact=digest,
                details={"capabilities": caps, "capabilities_hash": ch},
            ),
        )
        grant = EventDraft(
            approver,
            "approval.grant",
            f"artifact/{digest}",
            artifact=digest,
            approvals=("apr_1",),
            details={"approval": "apr_1", "capabilities_hash": ch},
        )
        start = EventDraft(
            dev,
            "run.start",
            "run/r1",
            deployment="d",
            run="r1",
            artifact=digest,
            approvals=("apr_1",),
            details={"environment": "production"},
        )
        if mutate == "late":
            L.append("acme", start)
            L.append("acme", grant)
        else:
            L.append("acme", grant)
            L.append("acme", start)
        w = Actor("workload", "spiffe://proctor.test/tenant/acme/deployment/d/run/r1")
        cols = ["id", "email"] if mutate == "columns" else ["id"]
        L.append(
            "acme",
            EventDraft(
                w,
                "sql.select",
                "dataset/crm/table/customers",
                policies=("p",),
                deployment="d",
                run="r1",
                artifact=digest,
                approvals=("apr_1",),
                details={
                    "dataset": "crm",
                    "tables": [{"table": "customers", "columns": cols, "action": "sql.select"}],
                },
            ),
        )
        host = "evil.example" if mutate == "egress" else "api.example.com"
        L.append(
            "acme",
            EventDraft(
                w,
                "http.request",
                f"host/{host}:443",
                policies=("p",),
                deployment="d",
                run="r1",
                artifact=digest,
                details={"host": host, "port": 443, "method": "GET"},
            ),
        )
        export_pack(rt, "acme", *ALL, tmp_path / "f.zip")
        return tmp_path / "f.zip", L.vkey()


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        ("none", None),
        ("late", "after the run started"),
        ("self", "the artifact's author"),
        ("columns", "columns email of crm.customers are not approved"),
        ("egress", "egress to evil.example:443 is not in the approved capabilities"),
    ],
)
def test_semantic_checks(tmp_path: Path, mutate: str, match: str | None) -> None:
    pack, vkey = forged(tmp_path, mutate)
    if match is None:
        assert verify_pack(pack, vkey).accesses_checked == 2
    else:
        fails(pack, vkey, match)
    shutil.rmtree(tmp_path / "h")
