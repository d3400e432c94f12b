"""``proctor backup``, ``backup verify`` and ``restore`` on a real SQLite home.

Under load: a writer appends through its own runtime for the whole backup (the
backup is the real CLI in a subprocess); the backup verifies offline; the restored
home verifies, holds every event up to the backup's checkpoint byte for byte,
appends and checkpoints on from it (consistent with the backup's checkpoint), and
the original, still written, never sees the restored home's events.

Tampering: a byte of a blob, a row of the store copy (alone, and with the manifest
made again and signed with the key the backup holds), the manifest, a checkpoint
signed by another key (alone, and with the manifest signed again), a file added,
another home's backup given the trusted key: each refused with one sentence.
"""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import stat
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from proctor.backup import verify_backup
from proctor.backup._manifest import MANIFEST, SIGNATURE, FileEntry, Manifest, sign_manifest
from proctor.errors import VerificationFailed
from proctor.ledger import Checkpoint, EventDraft, Signer, open_checkpoint
from proctor.runtime import Runtime
from tests.conftest import OPERATOR, run_cli

OP = OPERATOR


def _vkey(home: Path) -> str:
    rt = Runtime.open(home)
    try:
        return rt.ledger.vkey()
    finally:
        rt.close()


@dataclass
class Writer:
    """Appends to acme through a runtime of its own until stopped."""

    home: Path
    stop: threading.Event
    appended: int = 0
    error: BaseException | None = None

    def run(self) -> None:
        rt = Runtime.open(self.home)
        try:
            while not self.stop.is_set():
                rt.ledger.append("acme", EventDraft(OP, "test.load", f"thing/{self.appended}"))
                self.appended += 1
        except BaseException as exc:  # reported by the test
            self.error = exc
        finally:
            rt.close()


def _populate(home: Path) -> None:
    rt = Runtime.open(home)
    try:
        rt.tenants.create("acme", OP)
        for i in range(20):
            rt.ledger.append("acme", EventDraft(OP, "test.before", f"thing/{i}"))
    finally:
        rt.close()
    # A blob, a bucket object and a run's output, as the runtime lays them out.
    blob = home / "blobs" / "sha256" / "ab" / ("ab" + "0" * 62)
    blob.parent.mkdir(parents=True)
    blob.write_bytes(b"artifact bytes " * 100)
    obj = home / "buckets" / "acme" / "reports" / "r.md"
    obj.parent.mkdir(parents=True)
    obj.write_text("# report\n")
    (obj.parent / ".tmp-0123456789abcdef").write_text("# an upload being stag")
    out = home / "runs" / "r-000000000001" / "stdout.log"
    out.parent.mkdir(parents=True)
    out.write_text("hello\n")
    # What a backup leaves out: a run's transient code copy, a link, a stray directory.
    (home / "runs" / "r-000000000001" / "code").mkdir()
    (home / "runs" / "r-000000000001" / "code" / "main.py").write_text("print(1)\n")
    os.symlink("/etc/passwd", home / "buckets" / "acme" / "link")
    (home / "scratch").mkdir()


@pytest.fixture
def loaded(home: Path) -> Iterator[tuple[Path, Writer]]:
    _populate(home)
    writer = Writer(home, threading.Event())
    thread = threading.Thread(target=writer.run)
    thread.start()
    try:
        yield home, writer
    finally:
        writer.stop.set()
        thread.join(timeout=60)
    assert writer.error is None, writer.error


def _size(home: Path, log: str = "acme") -> int:
    con = sqlite3.connect(home / "proctor.db")
    try:
        (n,) = con.execute("SELECT size FROM ledger_logs WHERE log = ?", (log,)).fetchone()
    finally:
        con.close()
    return int(n)


def _events(home: Path, log: str = "acme") -> list[bytes]:
    con = sqlite3.connect(home / "proctor.db")
    try:
        return [bytes(r[0]) for r in con.execute(
            "SELECT data FROM ledger_entries WHERE log = ? ORDER BY seq", (log,))]  # fmt: skip
    finally:
        con.close()


def test_backup_under_load_restores_a_working_home(
    loaded: tuple[Path, Writer], tmp_path: Path
) -> None:
    home, writer = loaded
    vkey = _vkey(home)
    backup = tmp_path / "backup"
    before = writer.appended
    got = run_cli("backup", "-o", str(backup), "--json", home=home)
    after = writer.appended
    assert after > before, "the writer appended while the backup ran"
    doc = json.loads(got.out)
    size = doc["logs"]["acme"]["size"]
    assert 20 + before <= size <= 20 + after + 1
    assert doc["keys"] is True and doc["engine"] == "sqlite"
    assert any(s.startswith("scratch") for s in doc["skipped"])
    assert any("link" in s for s in doc["skipped"])
    # As sensitive as the home: nothing in it for another user.
    for path in [backup, *backup.rglob("*")]:
        mode = stat.S_IMODE(path.lstat().st_mode)
        assert mode == (0o700 if path.is_dir() else 0o600), (path, oct(mode))
    assert not (backup / "home" / "runs" / "r-000000000001" / "code").exists()
    assert not list((backup / "home" / "buckets").rglob(".tmp-*"))  # an upload, half staged
    assert (backup / "home" / "keys" / "ledger.pem").is_file()
    # No secret printed: the private keys' bytes are nowhere in the output.
    pem = (home / "keys" / "ledger.pem").read_text()
    assert pem.splitlines()[1] not in got.out + got.err

    checked = run_cli("backup", "verify", str(backup), "--key", vkey, "--json")
    assert json.loads(checked.out)["logs"]["acme"]["size"] == size

    restored = tmp_path / "restored"
    done = run_cli("restore", str(backup), "--home", str(restored), "--key", vkey, "--json")
    assert json.loads(done.out)["logs"]["acme"]["size"] == size
    writer.stop.set()  # the original keeps its writes; compare them now it rests
    config = json.loads((restored / "config.json").read_text())
    assert config["store"] == "sqlite:///proctor.db"  # its own file, relative
    ok = run_cli("audit", "verify", "-t", "acme", "--json", home=restored)
    assert json.loads(ok.out)["size"] == size
    # Every event up to the backup's checkpoint, byte for byte.
    assert _events(restored) == _events(home)[:size]
    assert (restored / "buckets" / "acme" / "reports" / "r.md").read_text() == "# report\n"
    assert (restored / "runs" / "r-000000000001" / "stdout.log").read_text() == "hello\n"
    assert not (restored / "buckets" / "acme" / "link").exists()

    # The restored home works on: appends, checkpoints consistent with the backup's.
    original_size = _size(home)
    rt = Runtime.open(restored)
    try:
        assert rt.store.url == f"sqlite:///{restored.absolute() / 'proctor.db'}"
        for i in range(5):
            rt.ledger.append("acme", EventDraft(OP, "test.restored", f"after/{i}"))
    finally:
        rt.close()
    note = backup / "checkpoints" / "acme.note"
    run_cli("audit", "verify", "-t", "acme", "--checkpoint", str(note), home=restored)
    assert _size(restored) == size + 5
    # The original was not written by the restored home, and still verifies.
    assert _size(home) == original_size
    assert not any(b"test.restored" in e for e in _events(home))
    run_cli("audit", "verify", "-t", "acme", home=home)
    # The restored home backs up and restores in turn, its restore record its own.
    again = tmp_path / "again"
    run_cli("backup", "-o", str(again), home=restored)
    run_cli("restore", str(again), "--home", str(tmp_path / "twice"), "--key", vkey)
    record = json.loads((tmp_path / "twice" / "restored.json").read_text())
    assert record["logs"]["acme"]["size"] == size + 5


@pytest.fixture
def made(home: Path, tmp_path: Path) -> tuple[Path, str]:
    _populate(home)
    backup = tmp_path / "made"
    run_cli("backup", "-o", str(backup), home=home)
    return backup, _vkey(home)


def _copy(backup: Path, to: Path) -> Path:
    shutil.copytree(backup, to, symlinks=True)
    return to


def _resign(backup: Path, key: Path | Signer, **changes: object) -> None:
    """What someone holding the backup (and so its key) can do: the manifest made
    again for the files as they are now, and signed again."""
    m = Manifest.decode((backup / MANIFEST).read_bytes())
    files = dict(m.files)
    for rel in files:
        data = (backup / rel).read_bytes()
        import hashlib

        files[rel] = FileEntry(hashlib.sha256(data).hexdigest(), len(data))
    fields = {**m.__dict__, "files": files, **changes}
    m2 = Manifest(**fields)  # type: ignore[arg-type]
    signer = key if isinstance(key, Signer) else Signer.load(m.trust_domain, key)
    data, sig = sign_manifest(signer, m2)
    (backup / MANIFEST).write_bytes(data)
    (backup / SIGNATURE).write_text(sig)


def _refused(backup: Path, vkey: str | None, *words: str) -> str:
    args = ["backup", "verify", str(backup)] + (["--key", vkey] if vkey else [])
    got = run_cli(*args, check=False)
    assert got.code == 3, (got.code, got.out, got.err)
    first = got.err.strip().splitlines()[0]
    for w in words:
        assert w in first, first
    assert "Traceback" not in got.err
    return first


def test_a_byte_of_a_blob(made: tuple[Path, str], tmp_path: Path) -> None:
    backup, vkey = made
    b = _copy(backup, tmp_path / "b")
    blob = next((b / "home" / "blobs").rglob("ab0*"))
    data = bytearray(blob.read_bytes())
    data[7] ^= 1
    blob.write_bytes(bytes(data))
    _refused(b, vkey, "home/blobs/sha256/ab/", "SHA-256", "changed after the backup")


def test_a_row_of_the_store_copy(made: tuple[Path, str], tmp_path: Path) -> None:
    backup, vkey = made
    b = _copy(backup, tmp_path / "b")
    con = sqlite3.connect(b / "store" / "proctor.db")
    with con:
        changed = con.execute(
            "UPDATE ledger_entries SET data = CAST(replace(CAST(data AS TEXT), 'thing/3',"
            " 'thing/X') AS BLOB) WHERE log = 'acme'"
            " AND instr(CAST(data AS TEXT), '\"thing/3\"') > 0"
        ).rowcount
    con.close()
    assert changed == 1
    _refused(b, vkey, "store/proctor.db", "SHA-256")
    # Made again and signed with the key the backup holds: the ledger itself refuses.
    _resign(b, b / "home" / "keys" / "ledger.pem")
    first = _refused(b, vkey, "log 'acme' in the store copy")
    assert "seq" in first


def test_the_manifest(made: tuple[Path, str], tmp_path: Path) -> None:
    backup, vkey = made
    b = _copy(backup, tmp_path / "b")
    text = (b / MANIFEST).read_text()
    (b / MANIFEST).write_text(text.replace('"keys":true', '"keys":false'))
    _refused(b, vkey, "signature is over another manifest")
    b2 = _copy(backup, tmp_path / "b2")
    (b2 / SIGNATURE).write_text((b2 / SIGNATURE).read_text().replace("AA", "AB", 1)
                                if "AA" in (b2 / SIGNATURE).read_text()
                                else (b2 / SIGNATURE).read_text()[:-6] + "AAAA=\n")  # fmt: skip
    got = run_cli("backup", "verify", str(b2), "--key", vkey, check=False)
    assert got.code == 3 and "manifest" in got.err.splitlines()[0]
    # Signed again by the key the backup holds, naming a store outside the backup:
    # a restore would read it into the new home. Refused before anything is read.
    b3 = _copy(backup, tmp_path / "b3")
    _resign(b3, b3 / "home" / "keys" / "ledger.pem", store="../../../../etc/passwd")
    _refused(b3, vkey, "names '../../../../etc/passwd' but does not list its digest")


def test_a_checkpoint_signed_by_another_key(made: tuple[Path, str], tmp_path: Path) -> None:
    backup, vkey = made
    b = _copy(backup, tmp_path / "b")
    note = b / "checkpoints" / "acme.note"
    cp = open_checkpoint(note.read_text(), Signer.load("proctor.local",
                         b / "home" / "keys" / "ledger.pem").verifier)  # fmt: skip
    other = Signer.generate("proctor.local")
    forged = other.named(cp.origin).sign_note(Checkpoint(cp.origin, cp.size, cp.root).body(), other)
    note.write_text(forged)
    _refused(b, vkey, "checkpoints/acme.note", "SHA-256")
    # The manifest made again and signed with the backup's key: the checkpoint's
    # signature is still not that key's.
    _resign(b, b / "home" / "keys" / "ledger.pem")
    _refused(b, vkey, "checkpoint of log 'acme'", "not signed by the backup's key")
    # Everything signed again by the other key, its key named in the manifest: only
    # the key the verifier trusts tells.
    _resign(b, other, verifier_key=other.verifier.vkey())
    _refused(b, vkey, "not by the key you trust")
    without = run_cli("backup", "verify", str(b), check=False)
    assert without.code == 3  # the store copy's checkpoints are the real key's


def test_a_file_added_or_removed(made: tuple[Path, str], tmp_path: Path) -> None:
    backup, vkey = made
    b = _copy(backup, tmp_path / "b")
    (b / "home" / "keys" / "extra.pem").write_text("x")
    _refused(b, vkey, "does not list", "home/keys/extra.pem")
    b2 = _copy(backup, tmp_path / "b2")
    (b2 / "home" / "runs" / "r-000000000001" / "stdout.log").unlink()
    _refused(b2, vkey, "lacks", "stdout.log")


def test_another_homes_backup_against_the_trusted_key(
    made: tuple[Path, str], tmp_path: Path
) -> None:
    backup, _ = made
    other = Signer.generate("proctor.local").verifier.vkey()
    _refused(backup, other, "not by the key you trust")
    # The library says the same, and the untampered backup passes with its key.
    with pytest.raises(VerificationFailed):
        verify_backup(backup, other)


def test_bad_input_is_one_line_and_changes_nothing(
    made: tuple[Path, str], home: Path, tmp_path: Path
) -> None:
    backup, vkey = made
    cases = [
        (["backup", "verify", str(tmp_path / "nope")], "is not a directory"),
        (["backup", "verify", str(tmp_path)], "not a Proctor backup"),
        (["backup", "verify", str(backup), "--key", "garbage"], "--key"),
        (["backup", "-o", str(backup), "--home", str(home)], "not an empty directory"),
        (["backup", "-o", str(home / "inside"), "--home", str(home)], "inside the home"),
        (["backup", "--home", str(home)], "give the directory"),
        (["restore", str(backup), "--home", str(home)], "not empty"),
        (["restore", str(backup), "--home", str(backup / "home" / "new")], "inside the backup"),
        (["restore", str(backup), "--home", str(tmp_path / "n"), "--store", "sqlite:///x"],
         "postgresql://"),
        (["restore", str(backup), "--home", str(tmp_path / "n2"), "--store",
          "postgresql://u@127.0.0.1:1/x"], "SQLite store"),
    ]  # fmt: skip
    listing = sorted(p.relative_to(home) for p in home.rglob("*"))
    for args, words in cases:
        got = run_cli(*args, check=False)
        assert got.code == 2, (args, got.code, got.err)
        assert words in got.err.splitlines()[0], (args, got.err)
        assert "Traceback" not in got.err
    assert sorted(p.relative_to(home) for p in home.rglob("*")) == listing
    assert not (home / "inside").exists()
    assert not (tmp_path / "n").exists() and not (tmp_path / "n2").exists()
    run_cli("backup", "verify", str(backup), "--key", vkey)


def test_a_backup_without_keys_verifies_and_does_not_restore(home: Path, tmp_path: Path) -> None:
    _populate(home)
    backup = tmp_path / "audit"
    got = run_cli("backup", "-o", str(backup), "--no-keys", "--json", home=home)
    assert json.loads(got.out)["keys"] is False
    assert not (backup / "home" / "keys").exists() and not (backup / "home" / "ca").exists()
    run_cli("backup", "verify", str(backup), "--key", _vkey(home))
    refused = run_cli("restore", str(backup), "--home", str(tmp_path / "new"), check=False)
    assert refused.code == 2 and "without the home's keys" in refused.err
    assert not (tmp_path / "new").exists()


def test_a_tampered_backup_is_not_restored(made: tuple[Path, str], tmp_path: Path) -> None:
    backup, vkey = made
    b = _copy(backup, tmp_path / "b")
    obj = b / "home" / "buckets" / "acme" / "reports" / "r.md"
    obj.write_text("# another report\n")
    got = run_cli("restore", str(b), "--home", str(tmp_path / "new"), "--key", vkey, check=False)
    assert got.code == 3 and "r.md" in got.err.splitlines()[0]
    assert not (tmp_path / "new").exists()


@pytest.mark.parametrize("how", ["truncated store", "missing key", "garbage config"])
def test_a_damaged_home_is_not_backed_up(home: Path, tmp_path: Path, how: str) -> None:
    if how == "truncated store":
        db = home / "proctor.db"
        db.write_bytes(db.read_bytes()[:1000])
    elif how == "missing key":
        (home / "keys" / "ledger.pem").unlink()
    else:
        (home / "config.json").write_text("garbage{")
    got = run_cli("backup", "-o", str(tmp_path / "b"), "--home", str(home), check=False)
    lines = [line for line in got.err.splitlines() if line.strip()]
    assert got.code != 0 and lines[0].startswith("error:") and len(lines) <= 2, got.err
    assert not (tmp_path / "b").exists()


def test_an_empty_directory_given_is_made_private(made: tuple[Path, str], tmp_path: Path) -> None:
    backup, vkey = made
    new = tmp_path / "new"
    new.mkdir(mode=0o755)
    os.chmod(new, 0o755)
    run_cli("restore", str(backup), "--home", str(new), "--key", vkey)
    assert stat.S_IMODE(new.stat().st_mode) == 0o700
    out = tmp_path / "out"
    out.mkdir()
    os.chmod(out, 0o777)
    run_cli("backup", "-o", str(out), home=new)
    assert stat.S_IMODE(out.stat().st_mode) == 0o700
