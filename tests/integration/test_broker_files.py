"""Bucket objects through the broker: real files, real Cedar, a real ledger."""

from __future__ import annotations

import asyncio
import hashlib
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from proctor.broker import BadCall, BrokerError, CallDenied, CallRefused, RunScope
from proctor.broker._act import act
from proctor.broker._calls import CURRENT, Acted, Call
from proctor.broker._files import (
    FILE_READ,
    FILE_WRITE,
    FileRequest,
    ObjectNotFound,
    ObjectTooLarge,
    check_key,
    read_object,
    write_object,
)
from proctor.broker._http import BodyStream
from tests.conftest import LedgerEnv
from tests.integration.test_broker_sql import events, last_event, make_dataset, make_scope


@dataclass
class Files:
    ledger: LedgerEnv
    root: Path  # buckets_dir: <root>/<bucket>/...
    scope: RunScope

    def write(self, bucket: str, key: str, data: bytes, **kw: Any) -> dict[str, Any]:
        return asyncio.run(write_object(self.scope, bucket, key, data, **kw))

    def read(self, bucket: str, key: str, **kw: Any) -> bytes:
        return asyncio.run(read_object(self.scope, bucket, key, **kw))

    def tree(self) -> list[str]:
        """Every file and directory under the buckets, temporaries included."""
        return sorted(str(p.relative_to(self.root)) for p in self.root.rglob("*"))


@pytest.fixture
def files(ledger_env: LedgerEnv, tmp_path: Path) -> Iterator[Files]:
    root = tmp_path / "buckets"
    for bucket in ("reports", "inbox", "other"):
        (root / bucket).mkdir(parents=True)
    (root / "inbox" / "brief.txt").write_bytes(b"what to do\n")
    ds = make_dataset(tmp_path / "crm.db")
    # default_caps: reports read-write, inbox read; "other" not granted.
    yield Files(ledger_env, root, make_scope(ledger_env, ds, buckets_dir=root))


def test_round_trip_is_recorded_with_sha256(files: Files) -> None:
    data = b"churn report\n" * 100
    digest = hashlib.sha256(data).hexdigest()
    assert files.write("reports", "2026/q1/churn.md", data) == {"sha256": digest, "bytes": 1300}
    assert (files.root / "reports" / "2026" / "q1" / "churn.md").read_bytes() == data
    assert files.read("reports", "2026/q1/churn.md") == data
    written, read = events(files.ledger, "file.")[-2:]
    for ev, action in ((written, "file.write"), (read, "file.read")):
        assert ev["action"] == action
        assert ev["decision"] == "allow"
        assert ev["policies"] == ["deploy:churn:file:reports"]
        assert ev["resource"] == "bucket/reports/2026/q1/churn.md"
        assert ev["details"]["sha256"] == digest and ev["details"]["bytes"] == 1300
        assert ev["details"]["bucket"] == "reports" and ev["details"]["key"] == "2026/q1/churn.md"
    assert "churn report" not in str(events(files.ledger))


def test_overwrite_is_atomic_and_leaves_no_temporaries(files: Files) -> None:
    files.write("reports", "a.txt", b"one")
    files.write("reports", "a.txt", b"two")
    assert files.read("reports", "a.txt") == b"two"
    assert files.tree() == ["inbox", "inbox/brief.txt", "other", "reports", "reports/a.txt"]
    assert (os.stat(files.root / "reports" / "a.txt").st_mode & 0o777) == 0o600


def test_read_only_bucket(files: Files) -> None:
    assert files.read("inbox", "brief.txt") == b"what to do\n"
    with pytest.raises(CallDenied) as info:
        files.write("inbox", "brief.txt", b"overwritten")
    ev = last_event(files.ledger)
    assert ev["action"] == "file.write" and ev["decision"] == "deny"
    assert ev["reason"] == "denied: no policy permits it" and ev["policies"] == []
    assert "file.write" in info.value.message
    assert (files.root / "inbox" / "brief.txt").read_bytes() == b"what to do\n"


def test_ungranted_bucket(files: Files) -> None:
    (files.root / "other" / "x").write_bytes(b"secret")
    with pytest.raises(CallDenied):
        files.read("other", "x")
    with pytest.raises(CallDenied):
        files.write("other", "y", b"z")
    assert [e["decision"] for e in events(files.ledger, "file.")] == ["deny", "deny"]
    assert not (files.root / "other" / "y").exists()


def test_ledger_failure_writes_nothing(files: Files) -> None:
    files.ledger.ledger.close()
    with pytest.raises(CallRefused):
        files.write("reports", "new/file.txt", b"data")
    assert not (files.root / "reports" / "new" / "file.txt").exists()
    # The directory may have been made; no object and no temporary file is left.
    assert [p for p in files.tree() if p.startswith("reports/") and not p.endswith("new")] == []


def test_ledger_failure_returns_nothing_on_read(files: Files) -> None:
    files.ledger.ledger.close()
    with pytest.raises(CallRefused):
        files.read("inbox", "brief.txt")


def test_missing_object_is_recorded(files: Files) -> None:
    with pytest.raises(ObjectNotFound):
        files.read("reports", "nope.txt")
    ev = last_event(files.ledger)
    assert ev["decision"] == "deny" and ev["reason"].startswith("refused: no object")


def test_size_cap(files: Files) -> None:
    with pytest.raises(ObjectTooLarge):
        files.write("reports", "big.bin", b"x" * 101, max_bytes=100)
    assert not (files.root / "reports" / "big.bin").exists()
    assert last_event(files.ledger)["details"]["bytes"] == 101
    files.write("reports", "ok.bin", b"x" * 100, max_bytes=100)
    with pytest.raises(ObjectTooLarge):
        files.read("reports", "ok.bin", max_bytes=99)


TRAVERSALS = [
    "../inbox/brief.txt",
    "../../etc/passwd",
    "a/../../inbox/brief.txt",
    "/etc/passwd",
    "//etc/passwd",
    "..",
    ".",
    "./a",
    "a/./b",
    "a//b",
    "a/",
    "",
    ".hidden",
    ".tmp-0123456789abcdef",
    "a\x00b",
    "a\\..\\b",
    "..\\inbox\\brief.txt",
    "%2e%2e/inbox/brief.txt",
    "\uff0e\uff0e/inbox",  # fullwidth dots
    "a/\u2215b",  # division slash
    "caf\u00e9.txt",
    "a b",
    "a\nb",
    "x" * 1025,
    "/".join(["d"] * 33),
]


@pytest.mark.parametrize("key", TRAVERSALS)
def test_bad_keys_are_refused_and_recorded(files: Files, key: str) -> None:
    before = files.tree()
    for call in (lambda: files.read("reports", key), lambda: files.write("reports", key, b"x")):
        with pytest.raises(BadCall):
            call()
        ev = last_event(files.ledger)
        assert ev["decision"] == "deny" and ev["reason"].startswith("refused: ")
    assert files.tree() == before


@pytest.mark.parametrize("bucket", ["../reports", "reports/..", "Reports", "", "a/b", "inbox\x00"])
def test_bad_bucket_names_are_refused(files: Files, bucket: str) -> None:
    with pytest.raises(BadCall):
        files.read(bucket, "brief.txt")
    assert last_event(files.ledger)["decision"] == "deny"


def test_symlinks_are_refused(files: Files, tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.txt").write_bytes(b"secret")
    reports = files.root / "reports"
    (reports / "link.txt").symlink_to(outside / "secret.txt")
    (reports / "linkdir").symlink_to(outside)
    for key in ("link.txt", "linkdir/secret.txt"):
        with pytest.raises(CallDenied):
            files.read("reports", key)
        assert last_event(files.ledger)["reason"].startswith("refused: ")
    with pytest.raises(CallDenied):
        files.write("reports", "linkdir/new.txt", b"x")
    with pytest.raises(CallDenied):
        files.write("reports", "link.txt", b"x")
    assert sorted(p.name for p in outside.iterdir()) == ["secret.txt"]
    assert (outside / "secret.txt").read_bytes() == b"secret"


def test_symlinked_bucket_is_refused(files: Files, tmp_path: Path) -> None:
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (outside / "x").write_bytes(b"secret")
    os.rmdir(files.root / "reports")
    (files.root / "reports").symlink_to(outside)
    with pytest.raises(CallDenied):
        files.read("reports", "x")


def test_special_files_are_refused(files: Files) -> None:
    os.mkfifo(files.root / "reports" / "pipe")
    (files.root / "reports" / "dir").mkdir()
    for key in ("pipe", "dir"):
        with pytest.raises(CallDenied):
            files.read("reports", key)
    with pytest.raises(CallDenied):
        files.write("reports", "dir", b"x")


def test_missing_bucket_directory(files: Files) -> None:
    os.rmdir(files.root / "reports")
    with pytest.raises(BrokerError):
        files.write("reports", "a.txt", b"x")
    assert not (files.root / "reports").exists()


def test_check_key_accepts_ordinary_keys() -> None:
    for key in ("a", "a.txt", "reports/2026-01/churn_v2.md", "A-Z/0-9/x.tar.gz", "a..b"):
        assert check_key(key) == key


def _acted(
    files: Files, kind: Any, make: Callable[[], FileRequest]
) -> tuple[Acted, tuple[str, ...], int]:
    """``kind``'s decide and act stages alone (no record stage) on the request
    ``make`` builds: what the act returned, the stages passed and how many events
    were appended meanwhile (a held write is discarded)."""
    call = Call(files.scope, kind=kind)
    before = len(events(files.ledger))

    async def go() -> Acted:
        token = CURRENT.set(call)
        request = make()
        try:
            ruling = await kind.decide(call, request)
            assert ruling.refusal is None
            acted: Acted = await act(call, kind, request, ruling)
        finally:
            CURRENT.reset(token)
        if acted.discard is not None:
            await acted.discard()
        return acted

    acted = asyncio.run(go())
    return acted, call.trace, len(events(files.ledger)) - before


def test_a_refusal_found_acting_is_left_to_the_record_stage(files: Files) -> None:
    """An object missing is found by the act, which records nothing itself: the
    record stage writes the call's one event, the refusal (no second return into
    the record stage from inside the act)."""
    acted, trace, appended = _acted(files, FILE_READ, lambda: FileRequest("reports", "nope.txt"))
    assert isinstance(acted.refusal, ObjectNotFound) and acted.answer is None
    assert trace == ("decide", "act") and appended == 0
    before = len(events(files.ledger))
    with pytest.raises(ObjectNotFound):
        files.read("reports", "nope.txt")
    (ev,) = events(files.ledger)[before:]
    assert ev["action"] == "file.read" and ev["decision"] == "deny"
    assert ev["reason"] == "refused: no object 'nope.txt' in bucket 'reports'"
    assert ev["details"]["bucket"] == "reports" and ev["details"]["key"] == "nope.txt"


def _short_body(data: bytes, announced: int) -> BodyStream:
    reader = asyncio.StreamReader()
    reader.feed_data(data)
    reader.feed_eof()
    return BodyStream(reader, announced)


def test_a_write_whose_body_ends_early_is_recorded_once_and_leaves_nothing(
    files: Files,
) -> None:
    """The body ends before its announced length while it is being staged: one
    refusal event, recorded by the record stage, and the staged file is removed."""
    acted, _, appended = _acted(
        files, FILE_WRITE, lambda: FileRequest("reports", "short.txt", _short_body(b"12345", 10))
    )
    assert isinstance(acted.refusal, BadCall) and appended == 0
    assert acted.discard is not None
    assert files.tree() == ["inbox", "inbox/brief.txt", "other", "reports"]
    before = len(events(files.ledger))

    async def write() -> Any:
        return await write_object(files.scope, "reports", "short.txt", _short_body(b"12345", 10))

    with pytest.raises(BadCall, match="ended early"):
        asyncio.run(write())
    (ev,) = events(files.ledger)[before:]
    assert ev["action"] == "file.write" and ev["decision"] == "deny"
    assert ev["reason"] == "refused: the request body ended early"
    assert files.tree() == ["inbox", "inbox/brief.txt", "other", "reports"]


def test_an_act_refusal_the_ledger_cannot_take_is_not_recorded_and_writes_nothing(
    files: Files, tmp_path: Path
) -> None:
    (files.root / "reports" / "link.txt").symlink_to(tmp_path / "nowhere")
    files.ledger.ledger.close()
    with pytest.raises(CallRefused):
        files.write("reports", "link.txt", b"x")
    with pytest.raises(CallRefused):
        files.read("reports", "nope.txt")
    assert files.tree() == ["inbox", "inbox/brief.txt", "other", "reports", "reports/link.txt"]
