"""Issue 15, approvers: the code an approver signs off can be read, byte for byte,
through the CLI, the API and the SDK; a change is shown with its content and its
capability changes in words; `approve` shows what it approves before it asks.

One governed home (tests/e2e/conftest_gov.py) and one API server on loopback for
the module; every CLI call is a real subprocess."""

from __future__ import annotations

import hashlib
import io
import json
import subprocess
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from proctor.api import ApiServer, serve_api
from proctor.client import Client
from proctor.errors import ControlDenied, NotFound, UsageError
from proctor.governance import ArtifactFile, artifact_digest, parse_manifest
from proctor.lifecycle import Runs
from tests.conftest import PROCTOR, run_cli
from tests.e2e.conftest_gov import Gov, build_gov
from tests.sandbox_conftest_helpers import working

BINARY = bytes(range(256)) + b"\x00\xff\xfe" * 100
MANIFEST = """\
[artifact]
name = "{name}"
entrypoint = ["python3", "main.py"]
purpose = "weekly churn figures"

[datasets.fake.tables.customers]
columns = [{columns}]
access = "read"
{egress}"""
MAIN = """\
import proctor_guest
rows = proctor_guest.sql("fake", "SELECT id, country FROM customers WHERE id <= 3")["rows"]
print("read", len(rows), "rows")
try:
    proctor_guest.sql("fake", "SELECT email FROM customers")
except Exception as exc:
    print("refused:", type(exc).__name__)
"""


@dataclass
class Env:
    gov: Gov
    server: ApiServer
    v1: str
    v2: str
    tmp: Path

    def cli(self, *args: str, who: str | None = "alice", check: bool = True) -> Any:
        full = list(args) + (["--token", self.gov.token(who)] if who else [])
        return run_cli(*full, home=self.gov.home, check=check)

    def remote(self, *args: str, who: str = "alice", check: bool = True) -> Any:
        return run_cli("--server", self.server.url, *args, "--token", self.gov.token(who),
                       check=check)  # fmt: skip

    def client(self, who: str = "alice") -> Client:
        return Client(self.server.url, self.gov.token(who))


def _write(d: Path, name: str, columns: str, egress: str, files: dict[str, bytes]) -> Path:
    d.mkdir()
    (d / "proctor.toml").write_text(MANIFEST.format(name=name, columns=columns, egress=egress))
    for path, data in files.items():
        (d / path).parent.mkdir(parents=True, exist_ok=True)
        (d / path).write_bytes(data)
    (d / "main.py").write_text(MAIN)
    for f in d.rglob("*"):
        f.chmod(0o755 if f.is_dir() else 0o644)
    return d


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    tmp = tmp_path_factory.mktemp("approver")
    gov = build_gov(tmp)
    v1 = _write(
        tmp / "v1",
        "churn",
        '"id", "country"',
        "",
        {
            "lib/util.py": b"def f():\n    return 1\n",
            "lib/old.py": b"x = 1\n",
            "data/model.bin": BINARY,
            "notes/café.txt": b"ok\n",
        },
    )
    (v1 / "lib" / "link.py").symlink_to("util.py")
    v2 = _write(
        tmp / "v2",
        "churn",
        '"id"',
        '\n[egress]\nhosts = ["api.example.com:443"]\n',
        {
            # What a terminal would hide: the approver is shown it spelled out.
            "lib/util.py": b"def f():\n    return 2  # \x1b[8msteal()\x1b[0m \xe2\x80\xae\n",
            "lib/new.py": b"y = 2\n",
            "data/model.bin": BINARY + b"\x01",
            "notes/café.txt": b"ok\n",
        },
    )
    (v2 / "lib" / "link.py").symlink_to("util.py")
    digests = [
        json.loads(run_cli("artifact", "submit", str(d), "-t", "acme", "--json", "--token",
                           gov.token("dev"), home=gov.home).out)["digest"]
        for d in (v1, v2)
    ]  # fmt: skip
    server = serve_api(gov.rt, "127.0.0.1", 0)
    yield Env(gov, server, digests[0], digests[1], tmp)
    server.stop()
    gov.rt.close()


def _tree_digest(tar_bytes: bytes) -> str:
    """The digest recomputed from the tar alone, as `artifact submit` computes it."""
    files, manifest = [], None
    with tarfile.open(fileobj=io.BytesIO(tar_bytes)) as tar:
        for m in tar.getmembers():
            if m.issym():
                t = m.linkname.encode()
                files.append(ArtifactFile(m.name, 0o777, hashlib.sha256(t).hexdigest(), len(t),
                                          m.linkname))  # fmt: skip
            elif m.isfile():
                data = tar.extractfile(m).read()  # type: ignore[union-attr]
                files.append(ArtifactFile(m.name, m.mode, hashlib.sha256(data).hexdigest(),
                                          len(data)))  # fmt: skip
                if m.name == "proctor.toml":
                    manifest = parse_manifest(data)
    assert manifest is not None
    return artifact_digest(files, manifest)


def test_an_approver_reads_the_code_back_byte_for_byte(env: Env) -> None:
    v1 = env.tmp / "v1"
    prefix = env.v1.removeprefix("sha256:")[:10]
    # CLI, local home: the exact bytes, binary and non-ASCII names too, by a prefix.
    # The tenant is the token's when not given, and for the local operator the one
    # tenant that has the digest.
    assert env.cli("artifact", "cat", "-t", "acme", prefix, "notes/café.txt").raw == b"ok\n"
    assert env.cli("artifact", "cat", prefix, "data/model.bin").raw == BINARY
    assert (
        env.cli("artifact", "cat", prefix, "main.py", who=None).raw == (v1 / "main.py").read_bytes()
    )
    # The same through the API (CLI --server and the SDK): every file.
    assert env.remote("artifact", "cat", env.v1, "data/model.bin").raw == BINARY
    # `show --files` names each file by its full sha256, also through the API.
    shown = env.remote("artifact", "show", prefix, "--files").out
    assert "weekly churn figures" in shown and hashlib.sha256(BINARY).hexdigest() in shown
    with env.client() as c:
        for path in ("main.py", "data/model.bin", "notes/café.txt", "proctor.toml", "lib/util.py"):
            assert c.artifact_file("acme", prefix, path) == (v1 / path).read_bytes(), path
        resp = httpx.get(f"{env.server.url}/tenants/acme/artifacts/{prefix}/files/main.py",
                         headers={"Authorization": f"Bearer {env.gov.token('alice')}"})  # fmt: skip
        assert resp.headers["content-type"] == "text/plain; charset=utf-8"
        assert resp.headers["x-proctor-digest"] == env.v1
        # The whole tree as a tar, whose digest recomputes, through the SDK and the CLI.
        buf = io.BytesIO()
        assert c.download_artifact("acme", prefix, buf) == env.v1
        assert _tree_digest(buf.getvalue()) == env.v1
    out = env.tmp / "v1.tar"
    meta = json.loads(env.cli("artifact", "download", "-t", "acme", prefix, "-o", str(out),
                              "--json").out)  # fmt: skip
    assert meta["digest"] == env.v1 and meta["bytes"] == out.stat().st_size
    assert _tree_digest(out.read_bytes()) == env.v1
    remote_tar = env.tmp / "v1-remote.tar"
    env.remote("artifact", "download", "-t", "acme", env.v1, "-o", str(remote_tar))
    assert remote_tar.read_bytes() == out.read_bytes()
    # -o - is stdout, as for `bucket get` (it once wrote a file named "-").
    assert env.cli("artifact", "download", "-t", "acme", prefix, "-o", "-").raw == out.read_bytes()
    assert env.remote("artifact", "download", env.v1, "-o", "-").raw == out.read_bytes()
    both = env.cli("artifact", "download", prefix, "-o", "-", "--json", check=False)
    assert both.code == 2 and "--json needs -o FILE" in both.err and both.raw == b""
    assert not Path("-").exists()
    # Submitting what the tar extracts to is the same artifact.
    unpacked = env.tmp / "unpacked"
    with tarfile.open(out) as tar:
        tar.extractall(unpacked, filter="data")
    again = env.cli("artifact", "submit", str(unpacked), "-t", "acme", "--json", who="dev")
    assert json.loads(again.out)["digest"] == env.v1


def test_reading_an_artifact_is_refused_outside_the_artifact_and_the_tenant(env: Env) -> None:
    # Paths that are not in the artifact: a clear error, nothing read.
    for bad, says in (("../../etc/passwd", "not a path inside the artifact"),
                      ("nosuch.py", "no file 'nosuch.py'")):  # fmt: skip
        res = env.cli("artifact", "cat", "-t", "acme", env.v1, bad, check=False)
        assert res.code == 2 and says in res.err and res.raw == b"", (bad, res.err)
    with env.client() as c:
        for bad, exc in (("../proctor.toml", UsageError), ("./main.py", UsageError),
                         ("/etc/passwd", UsageError), ("lib/../main.py", UsageError),
                         ("lib/link.py", UsageError), ("nosuch.py", NotFound)):  # fmt: skip
            with pytest.raises(exc):
                c.artifact_file("acme", env.v1, bad)
    # Another tenant's principal: refused by Cedar on the local home; through the API
    # another tenant does not exist for it (404, as for every other path); and acme's
    # digest is nothing in its own tenant. Every new path, CLI local, --server and SDK.
    for args in (["artifact", "cat", "-t", "acme", env.v1, "main.py"],
                 ["artifact", "download", "-t", "acme", env.v1, "-o", str(env.tmp / "x.tar")]):  # fmt: skip
        res = env.cli(*args, who="globex-alice", check=False)
        assert res.code == 5 and "main.py" not in res.out, (args, res.err)
        res = env.remote(*args, who="globex-alice", check=False)
        assert res.code == 2 and "unknown tenant 'acme'" in res.err, (args, res.err)
    res = env.cli("artifact", "cat", "-t", "globex", env.v1, "main.py", who="globex-alice",
                  check=False)  # fmt: skip
    assert res.code == 2 and "no artifact" in res.err
    assert not (env.tmp / "x.tar").exists()
    with env.client("globex-alice") as c:
        for call in (lambda: c.artifact_file("acme", env.v1, "main.py"),
                     lambda: c.download_artifact("acme", env.v1, io.BytesIO()),
                     lambda: c.review("acme", env.v1),
                     lambda: c.diff("acme", env.v1, env.v2),
                     lambda: c.artifact_file("globex", env.v1, "main.py")):  # fmt: skip
            with pytest.raises(NotFound):
                call()
    # Each refusal was decided and recorded.
    logged = [json.loads(e) for t in ("acme", "globex") for e in env.gov.rt.ledger.entries(t)]
    denied = [e for e in logged if e["decision"] == "deny" and e["actor"]["id"] == "globex/alice"]
    assert len(denied) >= 8, denied


def test_a_diff_shows_every_file_with_content_and_the_capability_changes_in_words(
    env: Env,
) -> None:
    text = env.cli("artifact", "diff", "-t", "acme", env.v1, env.v2).out
    for line in ("adds egress to api.example.com:443", "drops read of fake.customers.country",
                 "3 changed, 1 added, 1 removed", "-    return 1", "+    return 2", "+y = 2",
                 "-x = 1", "removed  lib/old.py", "added    lib/new.py"):  # fmt: skip
        assert line in text, line
    assert "\\x1b[8msteal()\\x1b[0m \\u202e" in text and "\x1b" not in text
    # So does cat on a terminal (and only there: piped, the bytes are exact).
    code, shown = _on_a_terminal(env.gov, ["artifact", "cat", env.v2, "lib/util.py"], b"",
                                 "alice", stdout_too=True)  # fmt: skip
    code_part = shown.split("def f():")[1]
    assert code == 0 and "\\x1b[8msteal()" in code_part and "\x1b" not in code_part, shown
    assert "control or bidirectional characters" in shown
    assert f"binary, {len(BINARY)} bytes -> {len(BINARY) + 1} bytes, sha256" in text
    doc = json.loads(env.cli("artifact", "diff", "-t", "acme", env.v1[:12], env.v2[:12],
                             "--json").out)  # fmt: skip
    assert doc["old"] == env.v1 and doc["widens"] is True
    assert {c["text"] for c in doc["capabilities"]} == {
        "adds egress to api.example.com:443",
        "drops read of fake.customers.country",
    }
    files = {f["path"]: f for f in doc["files"]}
    assert set(files) == {
        "lib/util.py",
        "lib/new.py",
        "lib/old.py",
        "data/model.bin",
        "proctor.toml",
    }
    assert files["lib/new.py"]["diff"].endswith("+y = 2\n")
    assert files["data/model.bin"]["binary"] and files["data/model.bin"]["diff"] is None
    # The API and the SDK give the same document.
    with env.client() as c:
        assert c.diff("acme", env.v1, env.v2[:12]) == doc
    assert json.loads(env.remote("artifact", "diff", "-t", "acme", env.v1, env.v2,
                                 "--json").out) == doc  # fmt: skip


@pytest.mark.sandbox
def test_approve_shows_what_it_approves_and_asks_first(env: Env) -> None:
    gov, digest = env.gov, env.v1
    backend = ([b for b in ("bubblewrap", "gvisor") if b in working()] or ["bubblewrap"])[0]
    run_cli("deploy", digest, "-t", "acme", "--name", "try", "--env", "sandbox",
            "--instruction", "try it", "--token", gov.token("dev"), home=gov.home)  # fmt: skip
    res = run_cli("run", "try", "-t", "acme", "--backend", backend, "--token", gov.token("dev"),
                  home=gov.home)  # fmt: skip
    assert "read 3 rows" in res.out and "refused:" in res.out, res.out + res.err
    [run_record] = Runs(gov.rt).of_artifact("acme", digest)
    # Without --yes on a stdin that is not a terminal: a clear error, nothing approved.
    proc = subprocess.run(
        [PROCTOR, "approve", digest[:14], "-t", "acme", "--token", gov.token("alice")],
        capture_output=True, stdin=subprocess.DEVNULL, timeout=120,
        env={**_env(gov), "COLUMNS": "200"},
    )  # fmt: skip
    err = proc.stderr.decode()
    assert proc.returncode == 2 and "not a terminal" in err and "--yes" in err, err
    assert gov.rt.approvals.for_artifact("acme", digest) == []
    # What was shown before the question: purpose, capabilities in words, files, and the
    # sandbox run's calls, its refusal first.
    shown = proc.stdout.decode()
    for needle in ("weekly churn figures", "read of fake.customers (columns country, id)",
                   "data/model.bin", "1 refused", "deny", "sql.select"):  # fmt: skip
        assert needle in shown, (needle, shown)
    assert run_record.id in shown
    # On a terminal it asks; "n" approves nothing.
    code, said = _on_a_terminal(gov, ["approve", digest, "-t", "acme"], b"n\n", "alice")
    assert code == 2 and f"Approve {digest} for 30d?" in said and "was not approved" in said
    assert gov.rt.approvals.for_artifact("acme", digest) == []
    # With --yes and --json: the review on stderr, the approval alone on stdout.
    res = env.cli("approve", digest[:14], "-t", "acme", "--yes", "--json")
    approval = json.loads(res.out)
    assert approval["digest"] == digest and approval["decision"] == "approve"
    assert "weekly churn figures" in res.err
    # The review through the API and the SDK is the same document.
    with env.client() as c:
        review = c.review("acme", digest[:14])
    assert review["digest"] == digest and review["approvals"][0]["id"] == approval["id"]
    [run] = review["sandbox_runs"]
    assert run["id"] == run_record.id and run["refused"] == 1
    assert run["events"][0]["decision"] == "deny"
    assert "read of fake.customers (columns country, id)" in review["capabilities_words"]
    # Every approval of the tenant, without naming a digest (locally and over the API).
    listed = json.loads(env.cli("approval", "list", "-t", "acme", "--json").out)
    assert [a["id"] for a in listed] == [approval["id"]]
    assert json.loads(env.remote("approval", "list", "-t", "acme", "--json").out) == listed
    # An approval id by a unique prefix (revoked through it, then shown by it).
    env.cli("approval", "revoke", approval["id"][:10], "-t", "acme", who="root")
    assert gov.rt.approvals.get("acme", approval["id"]).revoked_at is not None
    shown = json.loads(env.remote("approval", "show", approval["id"][:10], "-t", "acme",
                                  "--json").out)  # fmt: skip
    assert shown["id"] == approval["id"] and shown["revoked_at"] is not None


def test_an_ambiguous_prefix_is_refused_with_the_candidates(env: Env) -> None:
    hexpart = env.v2.removeprefix("sha256:")
    twin = "sha256:" + hexpart[:8] + "0" * 56
    with env.gov.rt.store.write() as conn:
        conn.execute(
            "INSERT INTO artifacts (tenant, digest, name, manifest, capabilities_hash,"
            " purpose, author, submitted_at, size)"
            " SELECT tenant, ?, name, manifest, capabilities_hash, purpose, author,"
            " submitted_at, size FROM artifacts WHERE digest = ?",
            (twin, env.v2),
        )
    try:
        for args in (["artifact", "cat", "-t", "acme", hexpart[:8], "main.py"],
                     ["artifact", "show", "-t", "acme", hexpart[:8]],
                     ["approve", hexpart[:8], "-t", "acme", "--yes"]):  # fmt: skip
            res = env.cli(*args, check=False)
            assert res.code == 2 and "ambiguous: 2 artifacts" in res.err, (args, res.err)
            assert "more digits" in res.err
        with env.client() as c, pytest.raises(UsageError, match="ambiguous"):
            c.artifact_file("acme", hexpart[:8], "main.py")
        assert env.gov.rt.approvals.for_artifact("acme", env.v2) == []
    finally:
        with env.gov.rt.store.write() as conn:
            conn.execute("DELETE FROM artifacts WHERE digest = ?", (twin,))


def test_the_author_cannot_approve_through_a_shortened_digest(env: Env) -> None:
    """Separation of duties holds whatever spelling of the digest the API is given."""
    gov = env.gov
    if "carol" not in gov.people:
        gov.people["carol"] = gov.rt.principals.create("acme", "carol", "user",
                                                       ["developer", "approver"], gov.op)  # fmt: skip
    own = _write(env.tmp / "carols", "carols", '"id"', "", {"lib/util.py": b"z = 3\n"})
    with env.client("carol") as c:
        digest = c.submit_artifact("acme", own)["digest"]
        for spelling in (digest, digest.removeprefix("sha256:")[:8], digest[:14].upper()):
            with pytest.raises(ControlDenied, match="separation-of-duties"):
                c.approve("acme", spelling)
    assert gov.rt.approvals.for_artifact("acme", digest) == []


def _on_a_terminal(
    gov: Gov, args: list[str], answer: bytes, who: str, stdout_too: bool = False
) -> tuple[int, str]:
    """``proctor ARGS`` with a pseudo-terminal as stdin that answers ``answer`` (and,
    with ``stdout_too``, as its stdout and stderr, read back from the terminal)."""
    import os

    master, slave = os.openpty()
    out_to = slave if stdout_too else subprocess.PIPE
    try:
        proc = subprocess.Popen(
            [PROCTOR, *args, "--token", gov.token(who)], stdin=slave, stdout=out_to,
            stderr=out_to if stdout_too else subprocess.STDOUT,
            env={**_env(gov), "COLUMNS": "200"},
        )  # fmt: skip
        os.write(master, answer)
        if not stdout_too:
            out, _ = proc.communicate(timeout=120)
            return proc.returncode, out.decode()
        os.close(slave)
        slave = -1
        chunks = []
        while True:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: every writer of the terminal has closed it
                break
            if not chunk:
                break
            chunks.append(chunk)
        return proc.wait(timeout=120), b"".join(chunks).decode(errors="replace")
    finally:
        os.close(master)
        if slave >= 0:
            os.close(slave)


def _env(gov: Gov) -> dict[str, str]:
    import os

    env = dict(os.environ)
    env["PROCTOR_HOME"] = str(gov.home)
    return env
