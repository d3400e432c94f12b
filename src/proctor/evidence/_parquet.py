"""OCSF as Parquet, laid out for an AWS Security Lake custom source.

Security Lake takes a custom source's data as Parquet objects under the source's
prefix, one OCSF event class per source, partitioned by region, account and day:

    ext/<source>/region=<region>/accountId=<account>/eventDay=<YYYYMMDD>/<file>.parquet

So one directory per class (``<prefix>-<class_uid>``, within Security Lake's 20
characters for a source name), rows sorted by time (they are in log order), and
files kept well below its 256 MB object bound (a new file every
:data:`ROWS_PER_FILE` rows). The rows are exactly the OCSF objects of the pack's
``ocsf/events.ocsf.jsonl`` (``to_ocsf``), with two changes Parquet needs:
``unmapped`` is a ``map<string, string>`` whose values are each one JSON text (its
content differs from event to event, as Security Lake's own tables type it), and an
empty object is null (Parquet has no struct without fields). :func:`read_rows` undoes
both, so a file reads back as the same rows as the JSON lines.

pyarrow is an optional extra: ``pip install 'proctor[parquet]'``.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from proctor.errors import ProctorError, UsageError
from proctor.evidence._ocsf import to_ocsf
from proctor.governance import Home

ROWS_PER_FILE = 100_000
_REGION_RE = re.compile(r"^[a-z]{2}(-[a-z]+)+-\d{1,2}$")
_ACCOUNT_RE = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")
_SOURCE_RE = re.compile(r"^[A-Za-z0-9_-]{1,15}$")


@dataclass(frozen=True)
class ParquetFile:
    path: Path  # relative to the export's directory
    class_uid: int
    class_name: str
    event_day: str
    rows: int


def _pyarrow() -> tuple[Any, Any]:
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise ProctorError(
            "the Parquet export needs pyarrow, which is not installed",
            hint="pip install 'proctor[parquet]'",
        ) from None
    return pa, pq


def check_target(region: str, account: str, source: str) -> None:
    """Refuse names Security Lake would not take, before anything is written."""
    if not _REGION_RE.match(region):
        raise UsageError(f"--region: {region!r} is not an AWS region name",
                         hint="e.g. --region eu-west-1")  # fmt: skip
    if not _ACCOUNT_RE.match(account):
        raise UsageError(
            f"--account-id: {account!r} is not an AWS account id or external id",
            hint="the account (12 digits) or external id your custom source was created with",
        )
    if not _SOURCE_RE.match(source):
        raise UsageError(
            f"--source: {source!r} must be 1 to 15 letters, digits, '-' or '_'",
            hint="each class's source is named <source>-<class_uid>, at most 20 characters",
        )


def _flatten(row: dict[str, Any]) -> dict[str, Any]:
    """A row as Parquet takes it: ``unmapped`` as JSON texts, empty objects null."""

    def clean(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: clean(v) for k, v in value.items()} or None
        if isinstance(value, list):
            return [clean(v) for v in value]
        return value

    out = {k: clean(v) for k, v in row.items() if k != "unmapped"}
    unmapped = row.get("unmapped")
    if isinstance(unmapped, dict) and unmapped:
        out["unmapped"] = [
            (k, json.dumps(v, sort_keys=True, ensure_ascii=False)) for k, v in unmapped.items()
        ]
    return out


def normalized(value: Any) -> Any:
    """``value`` without nulls and empty objects: how a row compares across JSON and
    Parquet (a struct column holds every field of its class, null where a row has none)."""
    if isinstance(value, dict):
        kept = {k: normalized(v) for k, v in value.items() if v is not None}
        return {k: v for k, v in kept.items() if v != {}}
    if isinstance(value, list):
        return [normalized(v) for v in value]
    return value


def read_rows(path: Path) -> list[dict[str, Any]]:
    """The rows of one exported file, as the OCSF objects they were written from
    (normalized: see :func:`normalized`)."""
    _, pq = _pyarrow()
    rows = []
    for row in pq.read_table(path).to_pylist():
        unmapped = row.pop("unmapped", None)
        if unmapped:
            row["unmapped"] = {k: json.loads(v) for k, v in unmapped}
        rows.append(normalized(row))
    return rows


def _day(ms: Any) -> str:
    return datetime.fromtimestamp(int(ms) / 1000, UTC).strftime("%Y%m%d")


def export_parquet(
    rt: Home,
    tenant: str,
    start: str,
    end: str,
    out_dir: Path,
    *,
    region: str,
    account: str,
    source: str = "proctor",
) -> list[ParquetFile]:
    """Write the OCSF objects of ``tenant``'s events with time in [start, end) as
    Parquet under ``out_dir`` in Security Lake's custom-source layout; the files,
    in the order written. ``out_dir`` must not exist or be empty; nothing is left
    of it on failure."""
    rt.tenants.get(tenant)
    check_target(region, account, source)
    if not start < end:
        raise UsageError("--from must be before --to")
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise UsageError(f"{out_dir} exists and is not an empty directory",
                         hint="give a new directory with --out")  # fmt: skip
    pa, pq = _pyarrow()
    origin = rt.ledger.origin(tenant)
    made = not out_dir.exists()
    out_dir.mkdir(parents=True, exist_ok=True)
    written: list[ParquetFile] = []
    pending: dict[tuple[int, str], list[dict[str, Any]]] = {}
    names: dict[int, str] = {}

    def flush(key: tuple[int, str]) -> None:
        rows = pending.pop(key)
        class_uid, day = key
        first, last = rows[0]["metadata"]["sequence"], rows[-1]["metadata"]["sequence"]
        rel = (
            Path("ext") / f"{source}-{class_uid}" / f"region={region}"
            / f"accountId={account}" / f"eventDay={day}" / f"{tenant}-{first}-{last}.parquet"
        )  # fmt: skip
        try:
            flat = [_flatten(r) for r in rows]
            unmapped = [r.pop("unmapped", None) for r in flat]
            # pa.array infers one struct type from every row's fields (Table.from_pylist
            # would take the first row's alone and drop the others' extra fields).
            table = pa.Table.from_struct_array(pa.array(flat))
            if any(unmapped):
                kind = pa.map_(pa.string(), pa.string())
                table = table.append_column("unmapped", pa.array(unmapped, type=kind))
        except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
            raise ProctorError(
                f"class {class_uid} ({names[class_uid]}): its OCSF rows do not fit one "
                f"Parquet schema: {exc}"
            ) from exc
        (out_dir / rel).parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(table, out_dir / rel, compression="zstd")
        written.append(ParquetFile(rel, class_uid, names[class_uid], day, len(rows)))

    try:
        for row in _rows(rt, tenant, start, end, origin):
            class_uid = int(row["class_uid"])
            names[class_uid] = str(row.get("class_name", ""))
            key = (class_uid, _day(row["time"]))
            rows = pending.setdefault(key, [])
            rows.append(row)
            if len(rows) >= ROWS_PER_FILE:
                flush(key)
        for key in sorted(pending):
            flush(key)
    except BaseException:
        if made:
            shutil.rmtree(out_dir, ignore_errors=True)
        else:
            for entry in out_dir.iterdir():
                shutil.rmtree(entry, ignore_errors=True)
        raise
    return written


def _rows(rt: Home, tenant: str, start: str, end: str, origin: str) -> Iterator[dict[str, Any]]:
    for data in rt.ledger.events_between(tenant, start, end):
        yield to_ocsf(json.loads(data), origin)
