"""Artifacts on a real store and ledger: digests, refusals, blobs, materialize, diff, CLI."""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from proctor.errors import NotFound, UsageError, VerificationFailed
from proctor.governance import Tenants
from proctor.governance._artifacts import Artifacts, artifact_digest
from proctor.ledger import SYSTEM_LOG, EventDraft
from tests.conftest import OPERATOR, CliResult, LedgerEnv, copy_home, run_cli

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "churn-report"

MANIFEST = """\
[artifact]
name = "churn-report"
entrypoint = ["python3", "main.py"]
purpose = "Monthly churn report for the retention team"

[datasets.crm.tables.customers]
columns = ["id", "country", "plan", "mrr"]
access = "read"

[egress]
hosts = ["enrich.example.com:443"]

[buckets]
reports = "write"
"""


def make_artifact(root: Path, files: dict[str, str | bytes] | None = None) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    content: dict[str, str | bytes] = {
        "proctor.toml": MANIFEST,
        "main.py": "print('churn')\n",
        "lib/util.py": "def f():\n    return 1\n",
    }
    content.update(files or {})
    for rel, data in content.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(data, str):
            path.write_text(data)
        else:
            path.write_bytes(data)
    return root


@pytest.fixture
def arts(ledger_env: LedgerEnv, tmp_path: Path) -> Iterator[Artifacts]:
    ledger_env.ledger.create_log(SYSTEM_LOG, EventDraft(OPERATOR, "runtime.init", "runtime/test"))
    tenants = Tenants(ledger_env.store, ledger_env.ledger)
    tenants.create("acme", OPERATOR)
    tenants.create("globex", OPERATOR)
    yield Artifacts(ledger_env.store, ledger_env.ledger, tmp_path / "blobs")


def events(env: LedgerEnv, tenant: str = "acme") -> list[dict[str, object]]:
    return [json.loads(e) for e in env.ledger.entries(tenant)]


def blob_files(tmp_path: Path) -> list[Path]:
    return [p for p in (tmp_path / "blobs" / "sha256").rglob("*") if p.is_file()]


# -- submission and digest -----------------------------------------------------


def test_submit_records_the_event_with_the_row(
    arts: Artifacts, ledger_env: LedgerEnv, tmp_path: Path
) -> None:
    a = arts.submit("acme", make_artifact(tmp_path / "a"), OPERATOR)
    assert a.digest.startswith("sha256:") and len(a.digest) == 71
    assert a.name == "churn-report" and a.file_count == 3
    assert a.author == OPERATOR.id
    assert a.capabilities["egress"] == ["enrich.example.com:443"]
    ev = events(ledger_env)[-1]
    assert ev["action"] == "artifact.submit"
    assert ev["resource"] == f"artifact/{a.digest}" and ev["artifact"] == a.digest
    details = ev["details"]
    assert isinstance(details, dict)
    assert details["digest"] == a.digest
    assert details["capabilities_hash"] == a.capabilities_hash
    assert details["purpose"] == a.purpose
    assert details["files"] == 3 and details["bytes"] == a.size
    assert "print('churn')" not in json.dumps(ev)
    assert arts.get("acme", a.digest) == a
    assert [x.digest for x in arts.list("acme")] == [a.digest]
    assert {f.path for f in arts.files("acme", a.digest)} == {
        "proctor.toml",
        "main.py",
        "lib/util.py",
    }
    for blob in blob_files(tmp_path):
        assert stat.S_IMODE(blob.stat().st_mode) == 0o444


def test_same_content_is_the_same_artifact(
    arts: Artifacts, ledger_env: LedgerEnv, tmp_path: Path
) -> None:
    a = arts.submit("acme", make_artifact(tmp_path / "a"), OPERATOR)
    size = ledger_env.ledger.head("acme").size
    again = arts.submit("acme", make_artifact(tmp_path / "b"), OPERATOR)
    assert again == a
    assert ledger_env.ledger.head("acme").size == size, "a resubmission records nothing"


def test_order_on_disk_and_permission_noise_do_not_change_the_digest(
    arts: Artifacts, tmp_path: Path
) -> None:
    a = make_artifact(tmp_path / "a")
    b = tmp_path / "b"
    # Created in the opposite order, with other non-executable permission bits.
    (b / "lib").mkdir(parents=True)
    (b / "lib" / "util.py").write_text("def f():\n    return 1\n")
    (b / "main.py").write_text("print('churn')\n")
    (b / "proctor.toml").write_text(MANIFEST)
    os.chmod(b / "main.py", 0o600)
    os.chmod(b / "lib", 0o700)
    assert arts.submit("acme", a, OPERATOR).digest == arts.submit("acme", b, OPERATOR).digest


@pytest.mark.parametrize(
    "change",
    ["one byte", "mode", "manifest", "manifest comment", "new file", "rename"],
)
def test_any_change_makes_a_new_digest(arts: Artifacts, tmp_path: Path, change: str) -> None:
    base = arts.submit("acme", make_artifact(tmp_path / "a"), OPERATOR).digest
    d = make_artifact(tmp_path / "b")
    if change == "one byte":
        (d / "main.py").write_text("print('churn!')\n")
    elif change == "mode":
        os.chmod(d / "main.py", 0o755)
    elif change == "manifest":
        (d / "proctor.toml").write_text(MANIFEST.replace("retention team", "sales team"))
    elif change == "manifest comment":
        (d / "proctor.toml").write_text("# reviewed\n" + MANIFEST)
    elif change == "new file":
        (d / "README").write_text("hi\n")
    elif change == "rename":
        (d / "lib" / "util.py").rename(d / "lib" / "utils.py")
    new = arts.submit("acme", d, OPERATOR)
    assert new.digest != base
    assert len(arts.list("acme")) == 2


def test_digest_is_recomputable_from_files_and_manifest(arts: Artifacts, tmp_path: Path) -> None:
    a = arts.submit("acme", make_artifact(tmp_path / "a"), OPERATOR)
    files = arts.files("acme", a.digest)
    assert artifact_digest(list(reversed(files)), a.manifest) == a.digest


def test_vcs_metadata_and_bytecode_are_skipped(arts: Artifacts, tmp_path: Path) -> None:
    base = arts.submit("acme", make_artifact(tmp_path / "a"), OPERATOR)
    d = make_artifact(
        tmp_path / "b",
        {".git/HEAD": "ref: refs/heads/main\n", "lib/__pycache__/util.cpython-311.pyc": b"\0\1"},
    )
    assert arts.submit("acme", d, OPERATOR).digest == base.digest


def test_symlinks_inside_are_kept(arts: Artifacts, tmp_path: Path) -> None:
    d = make_artifact(tmp_path / "a")
    (d / "run.py").symlink_to("main.py")
    (d / "lib" / "main_link.py").symlink_to("../main.py")
    (d / "alias").symlink_to("lib")
    a = arts.submit("acme", d, OPERATOR)
    links = {f.path: f.link for f in arts.files("acme", a.digest) if f.link}
    assert links == {"run.py": "main.py", "lib/main_link.py": "../main.py", "alias": "lib"}


@pytest.mark.parametrize(
    ("name", "target", "message"),
    [
        ("out", "../outside.txt", "points outside the artifact"),
        ("deep", "lib/../../outside.txt", "points outside the artifact"),
        ("abs", "/etc/passwd", "absolute path"),
        ("dangling", "missing.py", "is not in the artifact"),
        # Lexically lib/sub/outside.txt, a file of the artifact; really ../outside.txt.
        ("through", "lib/sub/top/../outside.txt", "points outside the artifact"),
        ("into-git", ".git/config", "is not in the artifact"),
    ],
)
def test_symlinks_out_are_refused(
    arts: Artifacts, ledger_env: LedgerEnv, tmp_path: Path, name: str, target: str, message: str
) -> None:
    (tmp_path / "outside.txt").write_text("secret\n")
    d = make_artifact(tmp_path / "a", {".git/config": "[core]\n"})
    (d / "lib" / "sub").mkdir()
    (d / "lib" / "sub" / "outside.txt").write_text("decoy\n")
    (d / "lib" / "sub" / "top").symlink_to("../..")
    (d / name).symlink_to(target)
    size = ledger_env.ledger.head("acme").size
    with pytest.raises(UsageError, match=message):
        arts.submit("acme", d, OPERATOR)
    assert arts.list("acme") == []
    assert ledger_env.ledger.head("acme").size == size
    assert blob_files(tmp_path) == []


def test_symlink_loops_are_refused(arts: Artifacts, tmp_path: Path) -> None:
    d = make_artifact(tmp_path / "a")
    (d / "x").symlink_to("y")
    (d / "y").symlink_to("x")
    with pytest.raises(UsageError, match="too many levels of symlinks"):
        arts.submit("acme", d, OPERATOR)


def test_fifo_is_refused(arts: Artifacts, tmp_path: Path) -> None:
    d = make_artifact(tmp_path / "a")
    os.mkfifo(d / "lib" / "pipe")
    with pytest.raises(UsageError, match="lib/pipe is a FIFO"):
        arts.submit("acme", d, OPERATOR)


def test_socket_is_refused(arts: Artifacts, tmp_path: Path) -> None:
    d = make_artifact(tmp_path / "a")
    sock = socket.socket(socket.AF_UNIX)
    try:
        sock.bind(str(d / "s.sock"))
        with pytest.raises(UsageError, match=r"s\.sock is a socket"):
            arts.submit("acme", d, OPERATOR)
    finally:
        sock.close()


def test_device_file_is_refused(arts: Artifacts, tmp_path: Path) -> None:
    d = make_artifact(tmp_path / "a")
    try:
        os.mknod(d / "null", 0o600 | stat.S_IFCHR, os.makedev(1, 3))
    except PermissionError:
        pytest.skip("making a device node needs CAP_MKNOD")
    with pytest.raises(UsageError, match="null is a character device"):
        arts.submit("acme", d, OPERATOR)


def test_oversize_and_too_many_files_are_refused_and_change_nothing(
    arts: Artifacts, ledger_env: LedgerEnv, tmp_path: Path
) -> None:
    d = make_artifact(tmp_path / "a", {"data.bin": os.urandom(200_000)})
    size = ledger_env.ledger.head("acme").size
    with pytest.raises(UsageError, match="larger than"):
        arts.submit("acme", d, OPERATOR, max_bytes=100_000)
    with pytest.raises(UsageError, match="more than 3 files"):
        arts.submit("acme", d, OPERATOR, max_files=3)
    assert arts.list("acme") == []
    assert ledger_env.ledger.head("acme").size == size
    assert blob_files(tmp_path) == []
    assert list((tmp_path / "blobs" / "tmp").iterdir()) == []


def test_missing_manifest_and_missing_entrypoint_are_refused(
    arts: Artifacts, tmp_path: Path
) -> None:
    d = make_artifact(tmp_path / "a")
    (d / "main.py").unlink()
    with pytest.raises(UsageError, match=r"'main\.py' is not a file of the artifact"):
        arts.submit("acme", d, OPERATOR)
    (d / "proctor.toml").unlink()
    with pytest.raises(UsageError, match=r"has no proctor\.toml"):
        arts.submit("acme", d, OPERATOR)
    with pytest.raises(UsageError, match="is not a directory"):
        arts.submit("acme", tmp_path / "nope", OPERATOR)


def test_unknown_tenant(arts: Artifacts, tmp_path: Path) -> None:
    with pytest.raises(NotFound, match="unknown tenant 'nobody'"):
        arts.submit("nobody", make_artifact(tmp_path / "a"), OPERATOR)


# -- lookup ------------------------------------------------------------------------


def test_get_by_prefix_and_ambiguity(
    arts: Artifacts, ledger_env: LedgerEnv, tmp_path: Path
) -> None:
    a = arts.submit("acme", make_artifact(tmp_path / "a"), OPERATOR)
    hexpart = a.digest.removeprefix("sha256:")
    assert arts.get("acme", hexpart[:8]) == a
    assert arts.get("acme", "sha256:" + hexpart[:12].upper()) == a
    # A second row sharing the first 10 digits (made directly: finding a real
    # collision of 10 hex digits would take a million submissions).
    twin = "sha256:" + hexpart[:10] + "0" * 54
    with ledger_env.store.write() as conn:
        conn.execute(
            "INSERT INTO artifacts (tenant, digest, name, manifest, capabilities_hash,"
            " purpose, author, submitted_at, size)"
            " SELECT tenant, ?, name, manifest, capabilities_hash, purpose, author,"
            " submitted_at, size FROM artifacts WHERE digest = ?",
            (twin, a.digest),
        )
    with pytest.raises(UsageError, match="is ambiguous: 2 artifacts") as info:
        arts.get("acme", hexpart[:8])
    assert "more digits" in info.value.diagnostics()
    assert arts.get("acme", a.digest) == a
    for bad in ("ab", "xyz123", "sha256:" + "g" * 64):
        with pytest.raises(UsageError, match="is not an artifact digest"):
            arts.get("acme", bad)
    with pytest.raises(NotFound):
        arts.get("acme", "ffffffff")


def test_tenants_do_not_see_each_others_artifacts(arts: Artifacts, tmp_path: Path) -> None:
    a = arts.submit("acme", make_artifact(tmp_path / "a"), OPERATOR)
    assert arts.list("globex") == []
    with pytest.raises(NotFound):
        arts.get("globex", a.digest)
    with pytest.raises(NotFound):
        arts.files("globex", a.digest)
    with pytest.raises(NotFound):
        arts.materialize("globex", a.digest, tmp_path / "out")
    # The same code submitted by globex is globex's own artifact, with its own author.
    b = arts.submit("globex", make_artifact(tmp_path / "b"), OPERATOR)
    assert b.digest == a.digest and b.tenant == "globex"


# -- materialize -----------------------------------------------------------------


def test_materialize_round_trip(arts: Artifacts, tmp_path: Path) -> None:
    d = make_artifact(tmp_path / "a", {"bin/run.sh": "#!/bin/sh\necho hi\n"})
    os.chmod(d / "bin" / "run.sh", 0o700)
    (d / "run.py").symlink_to("main.py")
    a = arts.submit("acme", d, OPERATOR)
    old = os.umask(0o077)
    try:
        out = arts.materialize("acme", a.digest, tmp_path / "code")
    finally:
        os.umask(old)
    assert (out / "main.py").read_text() == "print('churn')\n"
    assert (out / "proctor.toml").read_text() == MANIFEST
    assert os.readlink(out / "run.py") == "main.py"
    assert stat.S_IMODE((out / "bin" / "run.sh").stat().st_mode) == 0o755
    assert stat.S_IMODE((out / "main.py").stat().st_mode) == 0o644
    for directory in (out, out / "bin", out / "lib"):
        assert stat.S_IMODE(directory.stat().st_mode) == 0o755
    # What was written is what was submitted: submitting it again is the same artifact.
    assert arts.submit("acme", out, OPERATOR).digest == a.digest
    with pytest.raises(UsageError, match="exists already"):
        arts.materialize("acme", a.digest, out)


def test_tampered_blob_is_detected(arts: Artifacts, tmp_path: Path) -> None:
    a = arts.submit("acme", make_artifact(tmp_path / "a"), OPERATOR)
    main = next(f for f in arts.files("acme", a.digest) if f.path == "main.py")
    blob = tmp_path / "blobs" / "sha256" / main.sha256[:2] / main.sha256
    os.chmod(blob, 0o644)
    blob.write_text("print('pwned')\n")
    with pytest.raises(VerificationFailed, match=r"main\.py does not match its hash"):
        arts.materialize("acme", a.digest, tmp_path / "code")
    assert not (tmp_path / "code").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".code")] == []
    blob.unlink()
    with pytest.raises(VerificationFailed, match="missing"):
        arts.materialize("acme", a.digest, tmp_path / "code")


# -- diff ------------------------------------------------------------------------


def test_diff_shows_code_and_capability_changes(arts: Artifacts, tmp_path: Path) -> None:
    old = arts.submit(
        "acme",
        make_artifact(tmp_path / "a", {"logo.png": b"\x89PNG\0\1\2", "gone.py": "x = 1\n"}),
        OPERATOR,
    )
    manifest = (
        MANIFEST.replace('"mrr"]', '"mrr", "email"]')
        .replace('hosts = ["enrich.example.com:443"]', 'hosts = ["api.other.example:443"]')
        .replace('reports = "write"', 'reports = "read-write"')
        .replace("retention team", "sales team")
        + '\n[secrets]\nnames = ["token"]\n\n[limits]\nmemory = "1G"\n'
    )
    d = make_artifact(
        tmp_path / "b",
        {
            "proctor.toml": manifest,
            "main.py": "print('churn')\nprint('more')\n",
            "logo.png": b"\x89PNG\0\1\2\3",
            "new.py": "y = 2\n",
        },
    )
    new = arts.submit("acme", d, OPERATOR)
    diff = arts.diff("acme", old.digest[:12], new.digest)
    files = {f.path: f for f in diff.files}
    assert {p: f.change for p, f in files.items()} == {
        "gone.py": "removed",
        "logo.png": "modified",
        "main.py": "modified",
        "new.py": "added",
        "proctor.toml": "modified",
    }
    assert files["logo.png"].binary and files["logo.png"].diff is None
    main_diff = files["main.py"].diff
    assert main_diff is not None
    assert "--- a/main.py" in main_diff and "+print('more')" in main_diff
    assert files["new.py"].diff is not None and "+y = 2" in files["new.py"].diff

    caps = {(c.area, c.subject, c.change): c for c in diff.capabilities}
    assert caps[("column", "crm.customers.email", "added")].widens
    assert caps[("egress", "api.other.example:443", "added")].widens
    assert not caps[("egress", "enrich.example.com:443", "removed")].widens
    assert caps[("secret", "token", "added")].widens
    bucket = caps[("bucket", "reports", "changed")]
    assert (bucket.old, bucket.new, bucket.widens) == ("write", "read-write", True)
    assert caps[("purpose", "purpose", "changed")].widens
    assert ("limit", "memory_bytes", "added") in caps
    assert diff.widens and not diff.same_capabilities
    as_json = diff.to_json()
    assert as_json["old"] == old.digest and as_json["widens"] is True


def test_diff_of_narrowing_and_mode_change(arts: Artifacts, tmp_path: Path) -> None:
    old = arts.submit("acme", make_artifact(tmp_path / "a"), OPERATOR)
    d = make_artifact(
        tmp_path / "b",
        {"proctor.toml": MANIFEST.replace('"plan", "mrr"]', '"plan"]')},
    )
    os.chmod(d / "main.py", 0o755)
    new = arts.submit("acme", d, OPERATOR)
    diff = arts.diff("acme", old.digest, new.digest)
    assert [(c.area, c.subject, c.change, c.widens) for c in diff.capabilities] == [
        ("column", "crm.customers.mrr", "removed", False)
    ]
    mode = next(f for f in diff.files if f.path == "main.py")
    assert mode.old is not None and mode.new is not None
    assert (mode.old.mode, mode.new.mode, mode.diff) == (0o644, 0o755, None)
    assert not diff.widens


def test_the_demo_example_is_a_valid_artifact(arts: Artifacts, tmp_path: Path) -> None:
    a = arts.submit("acme", EXAMPLE, OPERATOR)
    assert a.name == "churn-report"
    assert a.capabilities["datasets"] == {
        "crm": {
            "tables": {"customers": {"columns": ["country", "id", "mrr", "plan"], "access": "read"}}
        }
    }
    assert a.capabilities["buckets"] == {"reports": "write"}
    assert len(a.capabilities["egress"]) == 1
    out = arts.materialize("acme", a.digest, tmp_path / "code")
    compiled = subprocess.run(
        [sys.executable, "-m", "py_compile", str(out / "main.py")], capture_output=True
    )
    assert compiled.returncode == 0, compiled.stderr


# -- the CLI -------------------------------------------------------------------

# Mounts the sub-app on the real `proctor` app when the app does not have it
# yet, then runs the real entry point (its error handling and exit codes).
_SHIM = """\
import sys
from proctor.cli import main
from proctor.cli._app import app
from proctor.cli._artifacts import artifact_app
if not any(g.name == "artifact" for g in app.registered_groups):
    app.add_typer(artifact_app, name="artifact")
sys.argv[0] = "proctor"
main()
"""


def artifact_cli(*args: str, home: Path, check: bool = True) -> CliResult:
    env = dict(os.environ, PROCTOR_HOME=str(home), COLUMNS="200")
    proc = subprocess.run(
        [sys.executable, "-c", _SHIM, "artifact", *args],
        capture_output=True,
        env=env,
        timeout=120,
    )
    res = CliResult(proc.returncode, proc.stdout.decode(), proc.stderr.decode(), proc.stdout)
    if check and res.code != 0:
        raise AssertionError(f"proctor artifact {' '.join(args)} failed:\n{res.out}{res.err}")
    return res


def audit(home: Path, tenant: str = "acme") -> list[dict[str, object]]:
    out = run_cli("audit", "events", "-t", tenant, "--jsonl", home=home).raw
    return [json.loads(line) for line in out.splitlines()]


@pytest.fixture(scope="module")
def acme_template(initialised_home: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    h = copy_home(initialised_home, tmp_path_factory.mktemp("acme") / "home")
    run_cli("tenant", "create", "acme", home=h)
    return h


@pytest.fixture
def acme(acme_template: Path, tmp_path: Path) -> Path:
    return copy_home(acme_template, tmp_path / "home")


def test_cli_submit_show_list_diff(acme: Path, tmp_path: Path) -> None:
    first = artifact_cli("submit", "-t", "acme", str(make_artifact(tmp_path / "a")), home=acme)
    assert "submitted churn-report" in first.out
    digest = next(w for w in first.out.split() if w.startswith("sha256:"))
    assert "dataset crm, table customers: read country, id, mrr, plan" in first.out

    shown = json.loads(artifact_cli("show", "-t", "acme", digest[:14], "--json", home=acme).out)
    assert shown["digest"] == digest
    assert shown["manifest"]["purpose"] == "Monthly churn report for the retention team"
    assert {f["path"] for f in shown["files"]} == {"proctor.toml", "main.py", "lib/util.py"}
    text = artifact_cli("show", "-t", "acme", digest, "--files", home=acme).out
    assert "egress enrich.example.com:443" in text and "lib/util.py" in text

    d = make_artifact(
        tmp_path / "b",
        {
            "main.py": "print('churn v2')\n",
            "proctor.toml": MANIFEST.replace('"mrr"]', '"mrr", "email"]'),
        },
    )
    second = json.loads(artifact_cli("submit", "-t", "acme", str(d), "--json", home=acme).out)
    listing = artifact_cli("list", "-t", "acme", home=acme).out
    assert digest[:19] in listing and second["digest"][:19] in listing
    listed = json.loads(artifact_cli("list", "-t", "acme", "--json", home=acme).out)
    assert [x["digest"] for x in listed] == [digest, second["digest"]]

    diff = artifact_cli("diff", "-t", "acme", digest, second["digest"], home=acme).out
    assert "+ adds read of crm.customers.email" in diff and "(widens)" in diff
    assert "-print('churn')" in diff and "+print('churn v2')" in diff
    as_json = json.loads(
        artifact_cli("diff", "-t", "acme", digest, second["digest"], "--json", home=acme).out
    )
    assert as_json["widens"] is True

    submits = [e for e in audit(acme) if e["action"] == "artifact.submit"]
    assert [e["artifact"] for e in submits] == [digest, second["digest"]]


@pytest.mark.parametrize(
    ("files", "message"),
    [
        ({"proctor.toml": "[artifact]\n"}, "artifact.name is missing"),
        (
            {"proctor.toml": MANIFEST.replace('access = "read"', 'access = "everything"')},
            "unknown access level 'everything'",
        ),
        (
            {"proctor.toml": MANIFEST.replace('purpose = "Monthly', 'purpose = " "\n#')},
            "purpose must not be empty",
        ),
        (
            {"proctor.toml": MANIFEST.replace("enrich.example.com:443", "https://x/")},
            "is not a host",
        ),
    ],
)
def test_cli_bad_input_changes_nothing(
    acme: Path, tmp_path: Path, files: dict[str, str | bytes], message: str
) -> None:
    before = audit(acme)
    res = artifact_cli(
        "submit", "-t", "acme", str(make_artifact(tmp_path / "a", files)), home=acme, check=False
    )
    assert res.code == 2, res.out + res.err
    assert "error:" in res.err and message in res.err
    assert "Traceback" not in res.err
    assert audit(acme) == before
    assert json.loads(artifact_cli("list", "-t", "acme", "--json", home=acme).out) == []


def test_cli_refusals(acme: Path, tmp_path: Path) -> None:
    d = make_artifact(tmp_path / "a")
    (d / "leak").symlink_to("/etc/passwd")
    res = artifact_cli("submit", "-t", "acme", str(d), home=acme, check=False)
    assert res.code == 2 and "leak: the symlink points to the absolute path" in res.err
    res = artifact_cli("show", "-t", "acme", "deadbeef", home=acme, check=False)
    assert res.code == 2 and "no artifact deadbeef" in res.err
    res = artifact_cli("submit", "-t", "nobody", str(d), home=acme, check=False)
    assert res.code == 2 and "unknown tenant 'nobody'" in res.err


@pytest.mark.parametrize("path", ["../evil.py", "/tmp/evil.py", "lib/../../evil.py", "run.py/x"])
def test_materialize_refuses_tampered_paths_in_the_store(
    arts: Artifacts, ledger_env: LedgerEnv, tmp_path: Path, path: str
) -> None:
    d = make_artifact(tmp_path / "a")
    (d / "run.py").symlink_to("main.py")
    a = arts.submit("acme", d, OPERATOR)
    main = next(f for f in arts.files("acme", a.digest) if f.path == "main.py")
    with ledger_env.store.write() as conn:
        conn.execute(
            "INSERT INTO artifact_files (digest, path, mode, sha256, size, link)"
            " VALUES (?, ?, 420, ?, ?, NULL)",
            (a.digest, path, main.sha256, main.size),
        )
    with pytest.raises(VerificationFailed, match="stored artifact path"):
        arts.materialize("acme", a.digest, tmp_path / "code")
    assert not (tmp_path / "code").exists()
    assert not (tmp_path / "evil.py").exists()
