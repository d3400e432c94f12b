"""The manifest's ``[ask]`` table: the capabilities whose calls wait for a person."""

from __future__ import annotations

import pytest

from proctor.errors import UsageError
from proctor.governance import Manifest, parse_manifest

BASE = """[artifact]
name = "a"
entrypoint = ["python3", "-c", "1"]
purpose = "p"
[egress]
hosts = ["api.example.com"]
[buckets]
reports = "write"
inbox = "read"
[datasets.crm.tables.customers]
columns = ["id"]
access = "read-write"
[datasets.crm.tables.plans]
columns = ["id"]
"""


def test_ask_is_normalized_part_of_the_capabilities_and_their_hash() -> None:
    plain = parse_manifest(BASE)
    asked = parse_manifest(
        BASE + '[ask]\negress = ["API.example.com:443", "api.example.com"]\n'
        'buckets = ["reports"]\ntables = ["crm.customers"]\ntimeout = "30s"\n'
    )
    assert "ask" not in plain.capabilities  # a manifest without it keeps its digest
    assert asked.capabilities["ask"] == {
        "egress": ["api.example.com:443"], "buckets": ["reports"],
        "tables": ["crm.customers"], "timeout_seconds": 30,
    }  # fmt: skip
    # The approver approves that these calls will be asked: another hash.
    assert asked.capabilities_hash != plain.capabilities_hash
    assert Manifest.from_json(asked.to_json()).capabilities == asked.capabilities
    default = parse_manifest(BASE + '[ask]\nbuckets = ["reports"]\n')
    assert default.capabilities["ask"]["timeout_seconds"] == 300


@pytest.mark.parametrize(
    ("ask", "message"),
    [
        ("bogus = 1", "ask: unknown key 'bogus'"),
        ('egress = ["other.example.com"]', "not one of egress.hosts"),
        ('buckets = ["inbox"]', "inbox is not a bucket the manifest writes"),
        ('tables = ["crm.plans"]', "'crm.plans' is not a table the manifest writes"),
        ('tables = ["crm"]', "is not a table the manifest writes"),
        ('timeout = "5m"', "ask names no egress host"),
        ('buckets = ["reports"]\ntimeout = "2d"', "longer than 24 hours"),
        ('buckets = ["reports"]\ntimeout = "soon"', "is not a duration"),
        ('buckets = "reports"', "must be an array of strings"),
    ],
)
def test_bad_ask_is_refused_naming_the_key(ask: str, message: str) -> None:
    with pytest.raises(UsageError) as info:
        parse_manifest(BASE + "[ask]\n" + ask + "\n")
    assert message in info.value.message


def test_an_approver_reads_which_calls_ask_and_a_dropped_ask_widens() -> None:
    from proctor.governance._artifact_diff import capability_words, manifest_changes

    asked = parse_manifest(BASE + '[ask]\negress = ["api.example.com"]\nbuckets = ["reports"]\n')
    words = capability_words(asked.capabilities)
    assert "each call to api.example.com:443 waits for a person's answer (at most 300 s)" in words
    assert "each write to bucket reports waits for a person's answer (at most 300 s)" in words
    dropped = manifest_changes(asked, parse_manifest(BASE + '[ask]\nbuckets = ["reports"]\n'))
    assert [(c.area, c.subject, c.widens, c.text) for c in dropped] == [
        ("ask", "api.example.com:443", True,
         "no longer asks a person before calls to api.example.com:443"),
    ]  # fmt: skip
    added = manifest_changes(parse_manifest(BASE), asked)
    assert {(c.text, c.widens) for c in added} == {
        ("asks a person before calls to api.example.com:443", False),
        ("asks a person before writes to bucket reports", False),
    }
