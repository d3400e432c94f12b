"""The capability changes an approver reads, in words: each area, added, dropped, changed."""

from __future__ import annotations

from proctor.governance import parse_manifest
from proctor.governance._artifacts import capability_words, manifest_changes

BASE = """
[artifact]
name = "job"
entrypoint = ["python3", "main.py"]
purpose = "monthly report"

[datasets.crm.tables.customers]
columns = ["id", "email"]
access = "read"

[datasets.crm.tables.orders]
columns = ["id"]
access = "read"

[egress]
hosts = ["old.example.com:443"]

[secrets]
names = ["token"]

[buckets]
reports = "write"

[limits]
memory = "64M"
"""

CHANGED = """
[artifact]
name = "job2"
entrypoint = ["python3", "run.py"]
purpose = "weekly report"

[datasets.crm.tables.customers]
columns = ["id", "country"]
access = "read-write"

[datasets.shop.tables.carts]
columns = ["total"]

[egress]
hosts = ["api.example.com:443"]

[secrets]
names = ["key"]

[buckets]
reports = "read-write"
archive = "read"

[limits]
memory = "128M"
timeout = "60s"

[lifecycle]
mode = "service"
"""


def test_every_change_is_said_in_words_and_widening_is_marked() -> None:
    a, b = parse_manifest(BASE.encode()), parse_manifest(CHANGED.encode())
    changes = manifest_changes(a, b)
    words = {c.text: c.widens for c in changes}
    assert words == {
        "renames the job from job to job2": False,
        "changes the purpose from 'monthly report' to 'weekly report'": True,
        "changes the entrypoint from python3 main.py to python3 run.py": False,
        "changes access to crm.customers from read to read and write": True,
        "adds read and write of crm.customers.country": True,
        "drops read of crm.customers.email": False,
        "drops read of crm.orders (id)": False,
        "adds dataset shop": True,
        "adds read of shop.carts (total)": True,
        "adds egress to api.example.com:443": True,
        "drops egress to old.example.com:443": False,
        "adds secret key": True,
        "drops secret token": False,
        "adds read of bucket archive": True,
        "changes access to bucket reports from write to read and write": True,
        "raises the memory_bytes limit from 67108864 to 134217728": True,
        "sets the wall_seconds limit to 60 (was the runtime's default)": False,
        "changes the lifecycle mode from job to service": True,
        "sets the lifecycle restart to on-failure": False,
    }
    assert all(c.to_json()["text"] == c.text for c in changes)
    # The other way round narrows: nothing widens but the purpose, entrypoint and name.
    back = manifest_changes(b, a)
    assert "drops egress to api.example.com:443" in {c.text for c in back}
    assert {c.area for c in back if c.widens} <= {"purpose", "column", "egress", "secret",
                                                   "table", "access", "dataset", "limit"}  # fmt: skip


def test_an_artifacts_capabilities_in_words() -> None:
    assert capability_words(parse_manifest(BASE.encode()).capabilities) == [
        "read of crm.customers (columns email, id)",
        "read of crm.orders (columns id)",
        "egress to old.example.com:443",
        "the secret token injected into its calls",
        "write of bucket reports",
    ]
    bare = parse_manifest(b'[artifact]\nname="x"\nentrypoint=["true"]\npurpose="p"\n')
    assert capability_words(bare.capabilities) == [
        "nothing: the code can reach nothing outside its sandbox"
    ]


def test_what_a_terminal_would_hide_is_spelled_out() -> None:
    from proctor.cli._artifacts import _shown, _visible

    assert _visible("x = 1\t# ok") == "x = 1\t# ok"
    assert _visible("a\x1b[8mb\x07\u202ec\u2066") == "a\\x1b[8mb\\x07\\u202ec\\u2066"
    assert _visible("nbsp\xa0") == "nbsp\\xa0"
    assert _shown("[bold]x\x1b") == "\\[bold]x\\x1b"
