"""`evidence export --format ocsf-parquet`: the pack's OCSF rows as Parquet, one class per
Security Lake custom source, read back with pyarrow."""

from __future__ import annotations

import json
import re
import zipfile
from datetime import UTC, datetime
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from proctor.errors import UsageError
from proctor.evidence import export_pack, export_parquet, read_rows
from proctor.evidence._parquet import normalized
from proctor.runtime import Runtime
from tests.conftest import copy_home, run_cli
from tests.security.test_evidence_tamper import ALL

_LAYOUT = re.compile(
    r"^ext/proctor-(\d{4})/region=eu-west-1/accountId=123456789012/eventDay=(\d{8})/"
    r"acme-\d+-\d+\.parquet$"
)


def test_the_parquet_export_reads_back_as_the_packs_ocsf_lines(
    demo_home: Path, tmp_path: Path
) -> None:
    home = copy_home(demo_home, tmp_path / "home")
    out = tmp_path / "lake"
    done = run_cli("evidence", "export", "-t", "acme", "--from", ALL[0], "--to", ALL[1],
                   "-o", str(out), "--format", "ocsf-parquet", "--region", "eu-west-1",
                   "--account-id", "123456789012", "--json", home=home)  # fmt: skip
    files = json.loads(done.out)["files"]
    with Runtime.open(home) as rt:
        export_pack(rt, "acme", *ALL, tmp_path / "pack.zip")
    with zipfile.ZipFile(tmp_path / "pack.zip") as zf:
        lines = [json.loads(x) for x in zf.read("ocsf/events.ocsf.jsonl").splitlines()]
    assert {f["path"] for f in files} == {
        str(p.relative_to(out)) for p in out.rglob("*") if p.is_file()
    }
    rows: list[dict[str, object]] = []
    for f in files:
        m = _LAYOUT.match(f["path"])
        assert m is not None, f["path"]
        got = read_rows(out / f["path"])
        # One OCSF class per file and per source, as Security Lake requires; sorted by time.
        assert {r["class_uid"] for r in got} == {int(m.group(1))} == {f["class_uid"]}
        times = [int(r["time"]) for r in got]  # type: ignore[call-overload]
        assert times == sorted(times) and len(got) == f["rows"]
        days = {datetime.fromtimestamp(t / 1000, UTC).strftime("%Y%m%d") for t in times}
        assert days == {m.group(2)}
        schema = pq.read_schema(out / f["path"])
        if "unmapped" in schema.names:
            assert str(schema.field("unmapped").type).startswith("map<string, string")
        rows.extend(got)
    rows.sort(key=lambda r: r["metadata"]["sequence"])  # type: ignore[index]
    assert len(rows) == len(lines) > 40
    assert rows == [normalized(x) for x in lines]
    assert len(files) >= 3  # the demo's API, Datastore and HTTP Activity


def test_bad_input_writes_nothing(demo_home: Path, tmp_path: Path) -> None:
    home = copy_home(demo_home, tmp_path / "home")
    used = tmp_path / "used"
    used.mkdir()
    (used / "keep.txt").write_text("mine")
    with Runtime.open(home) as rt:
        with pytest.raises(UsageError, match="not an empty directory"):
            export_parquet(rt, "acme", *ALL, used, region="eu-west-1", account="1")
        for region, account, source in (
            ("eu-west", "1", "proctor"),
            ("eu-west-1", "a/b", "proctor"),
            ("eu-west-1", "1", "a-much-too-long-name"),
        ):
            with pytest.raises(UsageError):
                export_parquet(rt, "acme", *ALL, tmp_path / "new", region=region,
                               account=account, source=source)  # fmt: skip
    assert [p.name for p in used.iterdir()] == ["keep.txt"]
    assert not (tmp_path / "new").exists()
