"""``proctor.toml``: random TOML documents shaped like manifests, valid manifests with
lines and bytes mutated, and raw bytes. Each gives a Manifest that can be digested,
stored, turned into Cedar permits and sandbox limits, or a ProctorError with a message;
never another exception (``_oracle_manifest.check_manifest``)."""

from __future__ import annotations

import datetime
import json
import math
from pathlib import Path
from typing import Any

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from tests.fuzz._oracle_manifest import check_manifest
from tests.fuzz._support import TIMEOUT, fuzz_settings

pytestmark = pytest.mark.timeout(TIMEOUT)

ROOT = Path(__file__).resolve().parents[2]

VALID = [
    (ROOT / "examples" / "churn-report" / "proctor.toml").read_text(),
    """
[artifact]
name = "svc"
entrypoint = ["python3", "-m", "http.server"]
purpose = "A small service"

[datasets.crm.tables.customers]
columns = ["id", "name", "country"]
access = "read-write"

[datasets.crm.tables."odd \\"name\\""]
columns = ["a b", "é"]

[egress]
hosts = ["api.example.com", "*.example.org:8443", "[2001:db8::1]:443", "192.0.2.1:80"]

[secrets]
names = ["crm_token"]

[buckets]
reports = "read-write"

[limits]
memory = "1.5G"
timeout = 90
cpu = 0.5
output = 65536

[lifecycle]
mode = "service"
restart = "always"
""",
    """
[artifact]
name = "nightly"
entrypoint = ["/usr/bin/env", "sh", "run.sh"]
purpose = "Nightly export"

[lifecycle]
mode = "schedule"
every = "1h"
""",
]

# -- a tiny TOML writer (the standard library only reads TOML) ----------------------


def toml_string(text: str) -> str:
    return json.dumps(text).replace("\x7f", "\\u007f")


def toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, str):
        return toml_string(value)
    if isinstance(value, datetime.datetime | datetime.date | datetime.time):
        return value.isoformat()
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return (
            "{" + ", ".join(f"{toml_string(k)} = {toml_value(v)}" for k, v in value.items()) + "}"
        )
    raise TypeError(type(value))


def toml_document(doc: dict[str, Any]) -> str:
    return "".join(f"{toml_string(k)} = {toml_value(v)}\n" for k, v in doc.items())


# -- documents shaped like manifests, with any value anywhere ------------------------

SIZES = ["256M", "1.5G", "0", "7M", "8M", "1T", "1e3", "9" * 400, "1" + "0" * 30 + "M", "-1M"]
DURATIONS = ["30s", "5m", "1h", "0s", "100ms", "8d", "7d", "1" + "0" * 400, "nan", "-1s"]
scalars = st.one_of(
    st.text(max_size=20),
    st.integers(-(2**63), 2**63 - 1),
    st.sampled_from([0, 1, -1, 2**53, 2**53 + 1, 2**63 - 1, 7 * 24 * 3600 + 1]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.booleans(),
    st.datetimes(timezones=st.just(datetime.UTC)),
    st.sampled_from(SIZES + DURATIONS),
)
anything = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
GOOD_NAMES = ["crm", "customers", "orders", "a" * 63, "x_1"]
BAD_NAMES = ["Crm", "a" * 64, "", "x-y", "é", "a b", "'", '"', "\\", "1x", "a\x00"]
TABLES = ["customers", "odd name", 'q"uote', "é", "a.b", "\\x", "'; drop"]
HOSTS = ["api.example.com", "*.example.org", "[2001:db8::1]:443", "192.0.2.1:80", "x:8080"]
BAD_HOSTS = ["*.*.x", "a*.x", "::1", "127.1", "0x7f.1", "http://x", "x:0", "x:65536"]
BAD_HOSTS += ["x:" + "9" * 5000, "ÄÖ.example", "xn--bcher-kva.example", "[::1", "a..b"]

# Each part of a manifest: a strategy for good values, and one for typed bad ones.
PARTS: dict[str, tuple[st.SearchStrategy[Any], st.SearchStrategy[Any]]] = {
    "name": (
        st.sampled_from(["churn-report", "a", "a.b_c-d"]),
        st.sampled_from(["-a", "A", "a" * 65, "", "a/b"]),
    ),
    "entrypoint": (
        st.sampled_from([["python3", "-c", "print(1)"], ["/usr/bin/env"], ["node", "-e", "1"]]),
        st.sampled_from([["python3", "main.py"], ["python3", "../x.py"], [], [""], ["sh", "\x00"]])
        | st.just("python3 main.py"),
    ),
    "purpose": (
        st.sampled_from(["Reports", "Monthly churn\nper country", "é"]),
        st.sampled_from([" ", "x" * 2001, "a\x07b", ""]),
    ),
    "dataset": (st.sampled_from(GOOD_NAMES), st.sampled_from(BAD_NAMES) | st.text(max_size=8)),
    "table": (st.sampled_from(TABLES), st.sampled_from(["", "a/b", "\x00"]) | st.text(max_size=8)),
    "columns": (
        st.lists(st.sampled_from(["id", "name", "a b", "é", 'q"', "\\", "x" * 200]), min_size=1),
        st.sampled_from([[], [""], ["\x01"]]) | st.lists(st.text(max_size=6), max_size=3),
    ),
    "access": (
        st.sampled_from(["read", "write", "read-write"]),
        st.sampled_from(["rw", "READ", ""]),
    ),
    "hosts": (
        st.lists(st.sampled_from(HOSTS), max_size=4),
        st.lists(st.sampled_from(BAD_HOSTS) | st.text(max_size=12), min_size=1, max_size=3),
    ),
    "secrets": (
        st.lists(st.sampled_from(GOOD_NAMES), max_size=3),
        st.lists(st.sampled_from(BAD_NAMES), min_size=1, max_size=2),
    ),
    "bucket": (st.sampled_from(GOOD_NAMES), st.sampled_from(BAD_NAMES)),
    "memory": (st.sampled_from(["256M", "1.5G", "8M", 1 << 30, "1T"]), st.sampled_from(SIZES)),
    "timeout": (st.sampled_from(["30s", "5m", 90, 0.5, "7d"]), st.sampled_from(DURATIONS)),
    "pids": (st.sampled_from([1, 64, 4096]), st.sampled_from([0, -1, 2**31, 2**62, True, "64"])),
    "cpu": (st.sampled_from([0.5, 1, 2.0, 1024]), st.sampled_from([0.001, 1025, "2", True, -1])),
    "output": (st.sampled_from(["1M", 0, 65536]), st.sampled_from(SIZES)),
    "mode": (st.sampled_from(["job", "service", "schedule"]), st.sampled_from(["cron", "", "Job"])),
    "every": (st.sampled_from(["1h", "30s", 60]), st.sampled_from([*DURATIONS, "0.5s"])),
    "restart": (
        st.sampled_from(["always", "on-failure", "never"]),
        st.sampled_from(["sometimes", ""]),
    ),
}


# Names are TOML keys, always strings; any other part may be any value at all.
BROKEN = {
    name: bad if name in ("dataset", "table", "bucket") else bad | anything
    for name, (_, bad) in PARTS.items()
}
LIMIT_KEYS = st.sets(st.sampled_from(["memory", "timeout", "pids", "cpu", "output"]))
BROKEN_PARTS = st.lists(st.sampled_from([*PARTS, "extra", "missing"]), max_size=2)


@st.composite
def manifest_documents(draw: st.DrawFn) -> dict[str, Any]:
    """A manifest whose parts are good except (usually) one or two, which get a typed
    bad value or any TOML value at all: so each check is reached, and many pass."""
    broken = set(draw(BROKEN_PARTS))

    def part(name: str) -> Any:
        return draw(PARTS[name][0] if name not in broken else BROKEN[name])

    doc: dict[str, Any] = {
        "artifact": {k: part(k) for k in ("name", "entrypoint", "purpose")},
    }
    if "missing" in broken:
        del doc["artifact"][draw(st.sampled_from(["name", "entrypoint", "purpose"]))]
    if draw(st.booleans()):
        doc["datasets"] = {
            part("dataset"): {
                "tables": {
                    part("table"): {"columns": part("columns"), "access": part("access")}
                    for _ in range(draw(st.integers(1, 2)))
                }
            }
        }
    if draw(st.booleans()):
        doc["egress"] = {"hosts": part("hosts")}
    if draw(st.booleans()):
        doc["secrets"] = {"names": part("secrets")}
    if draw(st.booleans()):
        doc["buckets"] = {part("bucket"): part("access")}
    if draw(st.booleans()):
        keys = draw(LIMIT_KEYS)
        doc["limits"] = {k: part(k) for k in keys}
    if draw(st.booleans()):
        mode = part("mode")
        doc["lifecycle"] = {"mode": mode}
        if mode == "schedule" or "every" in broken:
            doc["lifecycle"]["every"] = part("every")
        if mode == "service" or "restart" in broken:
            doc["lifecycle"]["restart"] = part("restart")
    if "extra" in broken:
        where = draw(st.sampled_from([doc, doc["artifact"]]))
        where[draw(st.text(max_size=8))] = draw(anything)
    return doc


@fuzz_settings(500)
@given(doc=manifest_documents())
def test_manifest_shaped_documents(doc: dict[str, Any]) -> None:
    check_manifest(toml_document(doc))


@st.composite
def mutated_manifests(draw: st.DrawFn) -> bytes:
    lines = draw(st.sampled_from(VALID)).splitlines(keepends=True)
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["drop", "dup", "value", "insert"]))
        at = draw(st.integers(0, max(len(lines) - 1, 0)))
        if op == "drop" and lines:
            del lines[at]
        elif op == "dup" and lines:
            lines.insert(at, lines[at])
        elif op == "value" and lines and "=" in lines[at]:
            key = lines[at].split("=", 1)[0]
            lines[at] = f"{key}= {toml_value(draw(anything))}\n"
        else:
            lines.insert(at, draw(st.text(max_size=30)) + "\n")
    data = bytearray("".join(lines).encode("utf-8", "surrogatepass"))
    for _ in range(draw(st.integers(0, 3))):
        if data:
            data[draw(st.integers(0, len(data) - 1))] = draw(st.integers(0, 255))
    return bytes(data)


@fuzz_settings(500)
@given(source=mutated_manifests() | st.binary(max_size=200))
@example(
    source=b'[artifact]\nname = "a"\nentrypoint = ["sh"]\npurpose = "p"\n[limits]\nmemory = "'
    + b"9" * 400
    + b'"\n'
)
@example(
    source=b'[artifact]\nname = "a"\nentrypoint = ["sh"]\npurpose = "p"\n[limits]\nmemory = 9007199254740993\n'
)
@example(
    source=b'[artifact]\nname = "a"\nentrypoint = ["sh"]\npurpose = "p"\n[limits]\npids = 4611686018427387904\n'
)
@example(
    source=b'[artifact]\nname = "a"\nentrypoint = ["sh"]\npurpose = "p"\n[egress]\nhosts = ["x:'
    + b"9" * 5000
    + b'"]\n'
)
def test_mutated_manifests(source: bytes) -> None:
    check_manifest(source)


def test_the_valid_manifests_are_accepted() -> None:
    """The mutation bases parse: the test above starts from real manifests."""
    for text in VALID:
        assert check_manifest(text) is not None
