"""proctor.toml: every mistake refused with a message naming the key; canonical output."""

from __future__ import annotations

import hashlib

import pytest

from proctor.errors import UsageError
from proctor.governance._manifest import (
    Manifest,
    capabilities_hash,
    check_entrypoint,
    parse_manifest,
)
from proctor.ledger import canonical_json
from proctor.policy import capability_policies, compile_policies

HEAD = """
[artifact]
name = "churn-report"
entrypoint = ["python3", "main.py"]
purpose = "Monthly churn report for the retention team"
"""

FULL = (
    HEAD
    + """
[datasets.crm.tables.customers]
columns = ["id", "country", "plan", "mrr"]
access = "read"
[egress]
hosts = ["enrich.example.com:443"]
[secrets]
names = ["enrich_token"]
[buckets]
reports = "write"
[limits]
memory = "256M"
timeout = "60s"
pids = 32
cpu = 0.5
output = "1M"
calls_per_second = 250
call_burst = 500
[lifecycle]
mode = "job"
"""
)


def test_full_manifest() -> None:
    m = parse_manifest(FULL)
    assert m.name == "churn-report"
    assert m.entrypoint == ("python3", "main.py")
    assert m.purpose == "Monthly churn report for the retention team"
    assert m.capabilities == {
        "datasets": {
            "crm": {
                "tables": {
                    "customers": {"columns": ["country", "id", "mrr", "plan"], "access": "read"}
                }
            }
        },
        "egress": ["enrich.example.com:443"],
        "secrets": ["enrich_token"],
        "buckets": {"reports": "write"},
    }
    assert m.limits.to_json() == {
        "memory_bytes": 256 * 1024 * 1024,
        "wall_seconds": 60,
        "pids": 32,
        "cpu": 0.5,
        "output_bytes": 1024 * 1024,
        "calls_per_second": 250,
        "call_burst": 500,
    }
    assert m.lifecycle.to_json() == {"mode": "job"}


def test_capabilities_are_what_capability_policies_takes() -> None:
    m = parse_manifest(FULL)
    text = capability_policies("acme", "churn", m.capabilities)
    compiled = compile_policies(text)
    assert set(compiled.policy_ids) == {
        "deploy:churn:sql:crm.customers",
        "deploy:churn:egress:enrich.example.com:443",
        "deploy:churn:secret:enrich_token",
        "deploy:churn:file:reports",
    }


def test_capabilities_hash_is_sha256_of_jcs() -> None:
    m = parse_manifest(FULL)
    expected = "sha256:" + hashlib.sha256(canonical_json(m.capabilities)).hexdigest()
    assert m.capabilities_hash == expected == capabilities_hash(m.capabilities)


def test_minimal_manifest_asks_for_nothing() -> None:
    m = parse_manifest(HEAD)
    assert m.capabilities == {"datasets": {}, "egress": [], "secrets": [], "buckets": {}}
    assert m.limits.to_json() == {}
    assert m.lifecycle.to_json() == {"mode": "job"}
    assert capability_policies("t", "d", m.capabilities) == ""


def test_spellings_of_the_same_request_hash_the_same() -> None:
    a = parse_manifest(
        HEAD
        + """
[datasets.crm.tables.customers]
columns = ["mrr", "id", "id"]
[egress]
hosts = ["Enrich.Example.COM.", "enrich.example.com:443", "*.Example.org"]
[secrets]
names = ["b", "a", "b"]
[limits]
timeout = "1m"
"""
    )
    b = parse_manifest(
        HEAD
        + """
[datasets.crm.tables.customers]
columns = ["id", "mrr"]
access = "read"
[egress]
hosts = ["*.example.org:443", "enrich.example.com"]
[secrets]
names = ["a", "b"]
[limits]
timeout = 60
"""
    )
    assert a.capabilities == b.capabilities
    assert a.capabilities_hash == b.capabilities_hash
    assert a.to_json() == b.to_json()
    assert a.capabilities["egress"] == ["*.example.org:443", "enrich.example.com:443"]


def test_any_capability_change_changes_the_hash() -> None:
    base = parse_manifest(FULL).capabilities_hash
    for old, new in [
        ('"mrr"]', '"mrr", "email"]'),
        ('access = "read"', 'access = "read-write"'),
        ("enrich.example.com:443", "enrich.example.com:8443"),
        ('"enrich_token"', '"other_token"'),
        ('reports = "write"', 'reports = "read-write"'),
    ]:
        assert old in FULL
        assert parse_manifest(FULL.replace(old, new)).capabilities_hash != base, new


def test_purpose_and_limits_are_not_capabilities_but_are_in_the_manifest() -> None:
    a = parse_manifest(FULL)
    b = parse_manifest(FULL.replace('"256M"', '"512M"'))
    assert a.capabilities_hash == b.capabilities_hash
    assert a.to_json() != b.to_json()


def test_round_trip_through_json() -> None:
    m = parse_manifest(FULL)
    assert Manifest.from_json(m.to_json()) == m
    s = parse_manifest(HEAD + '[lifecycle]\nmode = "schedule"\nevery = "1h"\n')
    assert s.lifecycle.every_seconds == 3600
    assert Manifest.from_json(s.to_json()) == s


def test_lifecycles() -> None:
    svc = parse_manifest(HEAD + '[lifecycle]\nmode = "service"\n')
    assert svc.lifecycle.to_json() == {"mode": "service", "restart": "on-failure"}
    svc = parse_manifest(HEAD + '[lifecycle]\nmode = "service"\nrestart = "always"\n')
    assert svc.lifecycle.restart == "always"
    sched = parse_manifest(HEAD + '[lifecycle]\nmode = "schedule"\nevery = "15m"\n')
    assert sched.lifecycle.to_json() == {"mode": "schedule", "every_seconds": 900}


def _with(extra: str) -> str:
    return HEAD + extra


BAD: list[tuple[str, str]] = [
    ("not toml = = =", "not valid TOML"),
    ('[artifact]\nname = "x"\nentrypoint = ["a"]\n', "artifact.purpose is missing"),
    (
        '[artifact]\nname = "x"\nentrypoint = ["a"]\npurpose = "   "\n',
        "artifact.purpose must not be empty",
    ),
    ('[artifact]\nname = "x"\nentrypoint = ["a"]\npurpose = 3\n', "must be a string"),
    ('[artifact]\nname = "x"\npurpose = "p"\n', "artifact.entrypoint is missing"),
    (
        '[artifact]\nname = "x"\nentrypoint = "python3 main.py"\npurpose = "p"\n',
        "must be an array of strings (argv), not a string",
    ),
    ('[artifact]\nname = "x"\nentrypoint = []\npurpose = "p"\n', "must not be empty"),
    ('[artifact]\nname = "x"\nentrypoint = ["a", 1]\npurpose = "p"\n', "entrypoint[1]"),
    ('[artifact]\nentrypoint = ["a"]\npurpose = "p"\n', "artifact.name is missing"),
    ('[artifact]\nname = "Bad Name"\nentrypoint = ["a"]\npurpose = "p"\n', "artifact name"),
    ("[limits]\nmemory = 1\n", "proctor.toml has no artifact table"),
    (_with("version = 2\n"), "unknown key 'version'"),
    (_with('[artifact.extra]\nx = "y"\n'), "artifact: unknown key 'extra'"),
    (_with("[network]\nallow = true\n"), "unknown key 'network'"),
    (_with("[datasets.crm]\n"), "datasets.crm names no tables"),
    (_with("[datasets.CRM.tables.t]\ncolumns = ['a']\n"), "invalid dataset name 'CRM'"),
    (
        _with("[datasets.crm.tables.t]\naccess = 'read'\n"),
        "datasets.crm.tables.t.columns is missing",
    ),
    (_with("[datasets.crm.tables.t]\ncolumns = []\n"), "datasets.crm.tables.t.columns is empty"),
    (_with("[datasets.crm.tables.t]\ncolumns = 'id'\n"), "columns must be an array of strings"),
    (
        _with("[datasets.crm.tables.t]\ncolumns = ['id']\naccess = 'admin'\n"),
        "datasets.crm.tables.t.access: unknown access level 'admin'",
    ),
    (
        _with("[datasets.crm.tables.t]\ncolumns = ['id']\nrows = 5\n"),
        "datasets.crm.tables.t: unknown key 'rows'",
    ),
    (_with("[datasets.crm.tables.t]\ncolumns = ['']\n"), "invalid column name ''"),
    (_with("[egress]\nhosts = ['https://x.example.com/']\n"), "is not a host"),
    (_with("[egress]\nhosts = ['bad host']\n"), "invalid host name"),
    (_with("[egress]\nhosts = ['x.example.com:99999']\n"), "invalid port"),
    (_with("[egress]\nhosts = ['a.*.example.com']\n"), "'*' is allowed only"),
    (_with("[egress]\nhosts = ['*.org']\n"), "two labels or more"),
    (_with("[egress]\nhosts = ['127.1']\n"), "not a canonical IPv4 address"),
    (_with("[egress]\nhosts = 'x.example.com'\n"), "egress.hosts must be an array"),
    (_with("[egress]\nallow = ['x.example.com']\n"), "egress: unknown key 'allow'"),
    (_with("[secrets]\nnames = ['Token']\n"), "invalid secret name 'Token'"),
    (_with("[buckets]\nreports = 'rw'\n"), "buckets.reports: unknown access level 'rw'"),
    (_with("[buckets]\nreports = true\n"), "buckets.reports must be a string"),
    (_with("[limits]\nmemory = 'lots'\n"), "limits.memory: 'lots' is not a size"),
    (_with("[limits]\nmemory = '1M'\n"), "below the 8M"),
    (_with("[limits]\ntimeout = '0s'\n"), "limits.timeout must be positive"),
    (_with("[limits]\ntimeout = 'soon'\n"), "limits.timeout: 'soon' is not a duration"),
    (_with("[limits]\ntimeout = '30d'\n"), "longer than 7 days"),
    (_with("[limits]\npids = 0\n"), "limits.pids must be a positive integer"),
    (_with("[limits]\npids = true\n"), "limits.pids must be a positive integer"),
    (_with("[limits]\ncpu = 5000\n"), "limits.cpu must be a number of CPUs"),
    (_with("[limits]\ndisk = '1G'\n"), "limits: unknown key 'disk'"),
    (_with("[limits]\ncalls_per_second = 0\n"), "limits.calls_per_second must be a number"),
    (_with("[limits]\ncalls_per_second = 'fast'\n"), "limits.calls_per_second must be a number"),
    (_with("[limits]\ncalls_per_second = true\n"), "limits.calls_per_second must be a number"),
    (_with("[limits]\ncall_burst = 0\n"), "limits.call_burst must be a positive integer"),
    (_with("[limits]\ncall_burst = 2.5\n"), "limits.call_burst must be a positive integer"),
    (_with("[lifecycle]\nmode = 'daemon'\n"), "lifecycle.mode: unknown mode 'daemon'"),
    (_with("[lifecycle]\nmode = 'schedule'\n"), "lifecycle.every is missing"),
    (_with("[lifecycle]\nmode = 'schedule'\nevery = '0.5s'\n"), "at least 1s"),
    (_with("[lifecycle]\nmode = 'job'\nevery = '1h'\n"), 'applies only to mode = "schedule"'),
    (_with("[lifecycle]\nmode = 'job'\nrestart = 'always'\n"), 'applies only to mode = "service"'),
    (
        _with("[lifecycle]\nmode = 'service'\nrestart = 'sometimes'\n"),
        "unknown restart policy 'sometimes'",
    ),
]


@pytest.mark.parametrize(("text", "message"), BAD, ids=[m for _, m in BAD])
def test_mistakes_are_refused_with_a_clear_message(text: str, message: str) -> None:
    with pytest.raises(UsageError) as info:
        parse_manifest(text)
    assert message in info.value.diagnostics()


def test_invalid_utf8_is_refused() -> None:
    with pytest.raises(UsageError, match="not UTF-8"):
        parse_manifest(b"[artifact]\nname = '\xff'\n")


def test_entrypoint_must_ship() -> None:
    m = parse_manifest(HEAD)
    check_entrypoint(m, {"main.py", "proctor.toml"})
    with pytest.raises(UsageError, match=r"script \(run by python3\) 'main.py' is not a file"):
        check_entrypoint(m, {"proctor.toml"})


@pytest.mark.parametrize(
    ("argv", "files", "ok"),
    [
        ('["python3", "-u", "./src/app.py"]', {"src/app.py"}, True),
        ('["python3", "-u", "./src/app.py"]', set(), False),
        ('["python3", "-m", "app"]', set(), True),
        ('["python3", "-c", "print(1)"]', set(), True),
        ('["/usr/bin/python3", "/opt/tool.py"]', set(), True),
        ('["./run.sh"]', {"run.sh"}, True),
        ('["bin/run"]', set(), False),
        ('["sh", "../escape.sh"]', {"escape.sh"}, False),
        ('["true"]', set(), True),
    ],
)
def test_entrypoint_rules(argv: str, files: set[str], ok: bool) -> None:
    m = parse_manifest(HEAD.replace('entrypoint = ["python3", "main.py"]', f"entrypoint = {argv}"))
    if ok:
        check_entrypoint(m, files)
    else:
        with pytest.raises(UsageError, match=r"artifact\.entrypoint"):
            check_entrypoint(m, files)
