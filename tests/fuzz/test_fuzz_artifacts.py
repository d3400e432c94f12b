"""Uploaded artifact archives and submitted directories, built to escape.

Archives (``extract_artifact``, what ``POST /tenants/{t}/artifacts`` unpacks): entries
with ``..``, absolute names, backslashes, NUL and control characters; symlinks out and
chains of symlinks that only leave through each other; hard links, devices, FIFOs,
setuid bits; one name twice; huge and many files; deep nesting; gzip bombs; truncated
and corrupted streams. Each is refused with a message or unpacked, and nothing around
the destination changes (``_oracle_archive``). What is unpacked then goes through
``Artifacts.submit`` on a real store and ledger, as the API does, and comes back out
of ``materialize`` the same.

Directories (``Artifacts.submit``, what ``proctor artifact submit`` reads): the same
shapes on a real filesystem, FIFOs and sockets included; never a hang, never a byte
from outside the directory in a blob.
"""

from __future__ import annotations

import contextlib
import gzip
import io
import os
import signal
import socket
import stat
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from hypothesis import assume, example, given
from hypothesis import strategies as st

from proctor.api._errors import ApiError
from proctor.api._tar import extract_artifact
from proctor.errors import ProctorError, UsageError
from proctor.governance import Artifacts, Tenants
from proctor.ledger import SYSTEM_LOG, Actor, EventDraft, Ledger, Signer
from proctor.store import open_store
from tests.fuzz._oracle_archive import check_extract, check_inside, snapshot
from tests.fuzz._support import TIMEOUT, fuzz_settings, one_in

pytestmark = pytest.mark.timeout(TIMEOUT)

MANIFEST = b"""[artifact]
name = "fuzzed"
entrypoint = ["python3", "-c", "print(1)"]
purpose = "Fuzzing the artifact unpacker"
"""
AUTHOR = Actor("user", "dev")

# -- archives ---------------------------------------------------------------------------

COMPONENTS = ["a", "b", "d", "up", "link", "..", ".", "", "é", "x y", "\\", "a\\..\\b", "main.py"]
SPECIAL_NAMES = [
    "proctor.toml",
    "/etc/passwd",
    "../escape",
    "a/../../escape",
    "./a",
    "a//b",
    "dir/",
    "a\x00b",
    "a\nb",
    "a/" * 70 + "x",
    "x" * 1100,
    "\udcff",
]
TARGETS = [
    "..",
    "../..",
    "../../..",
    "../" * 12,
    ".",
    "a",
    "d",
    "up/..",
    "link/..",
    "up/../..",
    "/etc",
    "/",
    "a/b/../..",
    "",
    "main.py",
    "proctor.toml",
    "\x00",
]
KINDS = [
    tarfile.REGTYPE,
    tarfile.REGTYPE,
    tarfile.DIRTYPE,
    tarfile.SYMTYPE,
    tarfile.SYMTYPE,
    tarfile.LNKTYPE,
    tarfile.CHRTYPE,
    tarfile.BLKTYPE,
    tarfile.FIFOTYPE,
    tarfile.CONTTYPE,
]
MODES = [0o644, 0o755, 0o4755, 0o2755, 0o1777, 0o6777, 0o000]


@dataclass(frozen=True)
class Entry:
    name: str
    kind: bytes
    data: bytes = b""
    link: str = ""
    mode: int = 0o644


NAME_S = st.sampled_from(SPECIAL_NAMES) | st.lists(
    st.sampled_from(COMPONENTS), min_size=1, max_size=4
).map("/".join)
TARGET_S = st.sampled_from(TARGETS) | st.lists(
    st.sampled_from(COMPONENTS), min_size=1, max_size=4
).map("/".join)
ENTRY_S = st.builds(
    Entry,
    name=NAME_S,
    kind=st.sampled_from(KINDS),
    data=st.binary(max_size=40),
    link=TARGET_S,
    mode=st.sampled_from(MODES),
)
# Entries an honest archive has: the shapes the refusals above must not catch.
SAFE_COMPONENTS = ["a", "b", "c", "lib", "src", "main.py", "x.txt", ".hidden", "é", "a b"]
SAFE_NAME_S = st.lists(st.sampled_from(SAFE_COMPONENTS), min_size=1, max_size=3).map("/".join)
SAFE_ENTRY_S = st.builds(
    Entry,
    name=SAFE_NAME_S,
    kind=st.sampled_from([tarfile.REGTYPE] * 4 + [tarfile.DIRTYPE, tarfile.SYMTYPE]),
    data=st.binary(max_size=40),
    link=st.sampled_from(["main.py", "x.txt", "a", "../x.txt", "lib/../main.py", "."]),
    mode=st.sampled_from(MODES),
)
MANIFEST_ENTRY = st.sampled_from(
    [
        Entry("proctor.toml", tarfile.REGTYPE, MANIFEST),
        Entry("pkg/proctor.toml", tarfile.REGTYPE, MANIFEST),
    ]
)
# Chains that only leave through each other (each link alone stays inside), and
# the shape of the CVE-2025-4517 archive with short names.
CHAINS = [
    [
        Entry("sub", tarfile.DIRTYPE),
        Entry("sub/up", tarfile.SYMTYPE, link=".."),
        Entry("m", tarfile.SYMTYPE, link="sub/up/.."),
        Entry("m/pwned", tarfile.REGTYPE, b"x"),
    ],
    [
        Entry("d", tarfile.DIRTYPE),
        Entry("a", tarfile.SYMTYPE, link="d"),
        Entry("d/d", tarfile.DIRTYPE),
        Entry("a/b", tarfile.SYMTYPE, link="d"),
        Entry("l", tarfile.SYMTYPE, link="a/b/../../.."),
        Entry("escape", tarfile.SYMTYPE, link="l/.."),
        Entry("escape/pwned", tarfile.REGTYPE, b"x"),
    ],
    [
        Entry("x", tarfile.SYMTYPE, link="."),
        Entry("y", tarfile.SYMTYPE, link="x/x/x/.."),
        Entry("proctor.toml", tarfile.SYMTYPE, link="../outside.txt"),
        Entry("proctor.toml", tarfile.REGTYPE, MANIFEST),
    ],
]


def build(entries: list[Entry], fmt: int) -> bytes | None:
    buf = io.BytesIO()
    try:
        with tarfile.open(fileobj=buf, mode="w", format=fmt) as tar:
            for e in entries:
                info = tarfile.TarInfo(e.name)
                info.type = e.kind
                info.mode = e.mode
                info.linkname = e.link if e.kind in (tarfile.SYMTYPE, tarfile.LNKTYPE) else ""
                content = e.kind in (tarfile.REGTYPE, tarfile.CONTTYPE)
                info.size = len(e.data) if content else 0
                tar.addfile(info, io.BytesIO(e.data) if content else None)
    except (ValueError, UnicodeError, tarfile.TarError):
        return None  # the writer refuses it; the mutations below reach such bytes anyway
    return buf.getvalue()


@st.composite
def archives(draw: st.DrawFn) -> bytes:
    entries = draw(st.lists(SAFE_ENTRY_S, max_size=6, unique_by=lambda e: e.name))
    for _ in range(draw(st.sampled_from([0, 0, 1, 1, 2]))):
        entries.insert(draw(st.integers(0, len(entries))), draw(ENTRY_S))
    if not draw(one_in(4)):
        entries.insert(draw(st.integers(0, len(entries))), draw(MANIFEST_ENTRY))
    if draw(one_in(5)):
        entries += draw(st.sampled_from(CHAINS))
    data = build(entries, draw(st.sampled_from([tarfile.PAX_FORMAT, tarfile.GNU_FORMAT])))
    assume(data is not None)
    assert data is not None
    if draw(one_in(4)):
        data = gzip.compress(data, mtime=0)
    if draw(one_in(10)):
        data = data[: draw(st.integers(0, len(data)))]  # truncated
    if draw(one_in(10)):
        raw = bytearray(data)
        for _ in range(draw(st.integers(1, 4))):
            if raw:
                raw[draw(st.integers(0, len(raw) - 1))] = draw(st.integers(0, 255))
        data = bytes(raw)
    return data


@dataclass
class Env:
    tmp: Path
    arts: Artifacts
    n: int = 0

    def base(self) -> Path:
        self.n += 1
        path = self.tmp / f"case{self.n}"
        path.mkdir()
        return path


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    tmp = tmp_path_factory.mktemp("artifacts")
    store = open_store(str(tmp / "proctor.db"), create=True)
    ledger = Ledger(store, Signer.generate("test.local"), "test.local")
    ledger.create_log(SYSTEM_LOG, EventDraft(AUTHOR, "runtime.init", "runtime/test"))
    Tenants(store, ledger).create("acme", AUTHOR)
    yield Env(tmp, Artifacts(store, ledger, tmp / "blobs"))
    ledger.close()
    store.close()


def submit_and_materialize(env: Env, root: Path, **limits: int) -> None:
    """Submit ``root`` as the API does after unpacking; an accepted artifact must come
    back out of ``materialize`` as exactly the files that went in."""
    entries = list(root.iterdir())
    if not (root / "proctor.toml").exists() and len(entries) == 1 and entries[0].is_dir():
        root = entries[0]
    blobs_before = _blob_files(env)
    try:
        artifact = env.arts.submit("acme", root, AUTHOR, **limits)
    except ProctorError as exc:
        assert exc.message.strip()
        assert _blob_files(env) == blobs_before, "a refused submission left blobs"
        return
    out = env.base() / "out"
    env.arts.materialize("acme", artifact.digest, out)
    check_inside(out)
    assert _tree(out) == _tree(root, skip=True), "materialized is not what was submitted"


def _blob_files(env: Env) -> set[str]:
    root = env.tmp / "blobs" / "sha256"
    return {p.name for p in root.rglob("*") if p.is_file()} if root.exists() else set()


def _tree(root: Path, *, skip: bool = False) -> dict[str, Any]:
    from proctor.governance._artifacts import SKIPPED_NAMES

    out: dict[str, Any] = {}
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        if skip:
            dirnames[:] = [d for d in dirnames if d not in SKIPPED_NAMES]
        for name in filenames + dirnames:
            if skip and name in SKIPPED_NAMES:
                continue
            path = Path(dirpath) / name
            rel = str(path.relative_to(root))
            if path.is_symlink():
                out[rel] = ("link", os.readlink(path))
            elif path.is_file():
                out[rel] = ("file", path.read_bytes(), bool(path.stat().st_mode & 0o111))
    return out


LIMITS = st.sampled_from([(100, 3), (10_000, 10), (10_000, 100), (10_000, 100)])


@fuzz_settings(400)
@given(data=st.one_of(archives(), archives(), archives(), st.binary(max_size=600)), limits=LIMITS)
@example(data=build(CHAINS[0], tarfile.PAX_FORMAT), limits=(10_000, 100))
@example(data=build(CHAINS[1], tarfile.PAX_FORMAT), limits=(10_000, 100))
@example(data=build(CHAINS[2], tarfile.PAX_FORMAT), limits=(10_000, 100))
def test_an_archive_is_refused_or_unpacked_safely(
    env: Env, data: bytes, limits: tuple[int, int]
) -> None:
    max_bytes, max_files = limits
    dest = check_extract(data, env.base(), max_bytes=max_bytes, max_files=max_files)
    if dest is not None and any(dest.rglob("proctor.toml")):
        submit_and_materialize(env, dest, max_bytes=max_bytes, max_files=max_files)


def _cve_2025_4517(dest: Path) -> bytes:
    """The published archive (python/cpython gh-135034), sized for ``dest``'s path."""
    steps = "abcdefghijklmnop"
    length = (os.pathconf(dest, "PC_PATH_MAX") - len(str(dest)) - 1) // (len(steps) + 1)
    component = "d" * length
    entries: list[Entry] = []
    path = ""
    for step in steps:
        entries.append(Entry(os.path.join(path, component), tarfile.DIRTYPE, mode=0o777))
        entries.append(Entry(os.path.join(path, step), tarfile.SYMTYPE, link=component))
        path = os.path.join(path, component)
    linkpath = os.path.join(*steps, "l" * 254)
    entries.append(Entry(linkpath, tarfile.SYMTYPE, link=os.path.join(*[".."] * len(steps))))
    entries.append(Entry("escape", tarfile.SYMTYPE, link=os.path.join(linkpath, "..")))
    entries.append(Entry("escape/pwned", tarfile.REGTYPE, b"pwned\n"))
    data = build(entries, tarfile.PAX_FORMAT)
    assert data is not None
    return data


def test_the_published_tarfile_filter_bypass_writes_nothing_outside(env: Env) -> None:
    base = env.base()
    data = _cve_2025_4517(base / "p1" / "p2" / "dest")
    assert check_extract(data, base, max_bytes=1 << 20, max_files=1000) is None
    assert not (base / "p1" / "p2" / "pwned").exists()


def test_a_gzip_bomb_stops_at_the_limit(env: Env) -> None:
    """64 MiB of zeros in a 64 KiB gzip: refused once 1 MiB (plus headers) is inflated,
    whatever the tar header claims, with no more than that written; accepted whole
    under a limit above it."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        info = tarfile.TarInfo("zeros")
        info.size = 64 << 20
        tar.addfile(info, io.BytesIO(bytes(64 << 20)))
    bomb = gzip.compress(buf.getvalue(), compresslevel=9, mtime=0)
    assert len(bomb) < (1 << 20) // 8
    base = env.base()
    assert check_extract(bomb, base, max_bytes=1 << 20, max_files=10) is None
    assert sum(p.stat().st_size for p in (base / "p1/p2/dest").rglob("*")) <= 1 << 20
    dest = env.base() / "dest"
    dest.mkdir()
    with pytest.raises(ApiError, match="larger than the limit"):
        extract_artifact(io.BytesIO(bomb), dest, max_bytes=1 << 20, max_files=10)
    assert check_extract(bomb, env.base(), max_bytes=65 << 20, max_files=10) is not None


def test_many_files_and_deep_nesting_stop_at_the_limits(env: Env) -> None:
    many = build([Entry(f"f{i}", tarfile.REGTYPE, b"x") for i in range(200)], tarfile.PAX_FORMAT)
    deep = build([Entry("a/" * 80 + "x", tarfile.REGTYPE, b"x")], tarfile.PAX_FORMAT)
    assert many is not None and deep is not None
    assert check_extract(many, env.base(), max_bytes=10_000, max_files=100) is None
    assert check_extract(deep, env.base(), max_bytes=10_000, max_files=100) is None


# -- directories ------------------------------------------------------------------------


@dataclass(frozen=True)
class Node:
    path: str
    kind: str  # file, dir, link, fifo, socket, hardlink, setuid
    data: bytes = b""
    link: str = ""


SAFE_NODE_S = st.builds(
    Node,
    path=st.lists(st.sampled_from(["a", "b", "lib", "main.py", "é"]), min_size=1, max_size=3).map(
        "/".join
    ),
    kind=st.sampled_from(["file", "file", "file", "dir", "link"]),
    data=st.binary(max_size=60),
    link=st.sampled_from(["main.py", "../main.py", "a", "lib/../main.py", "."]),
)
NODE_S = st.builds(
    Node,
    path=st.lists(
        st.sampled_from(["a", "b", "d", "é", "x y", "\\", ".git", "__pycache__"]),
        min_size=1,
        max_size=3,
    ).map("/".join),
    kind=st.sampled_from(
        ["file", "file", "dir", "link", "link", "fifo", "socket", "hardlink", "setuid"]
    ),
    data=st.binary(max_size=60),
    link=TARGET_S | st.sampled_from(["../outside.txt", "../victim", "../../p1", "/etc/passwd"]),
)


@contextlib.contextmanager
def watchdog(seconds: int) -> Iterator[None]:
    """A FIFO opened the blocking way would hang the walk: fail instead."""

    def expired(signum: int, frame: object) -> None:
        raise AssertionError(f"no answer within {seconds} s: the walk hangs")

    old = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def make_tree(root: Path, nodes: list[Node], outside: Path) -> None:
    for node in nodes:
        path = root / node.path
        if os.path.lexists(path):
            continue  # taken (and writing into a FIFO made here would block this test)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            if node.kind == "dir":
                path.mkdir(exist_ok=True)
            elif node.kind == "link":
                if node.link and "\x00" not in node.link:
                    os.symlink(node.link, path)
            elif node.kind == "fifo":
                os.mkfifo(path)
            elif node.kind == "socket":
                with socket.socket(socket.AF_UNIX) as sock:
                    sock.bind(str(path))
            elif node.kind == "hardlink":
                os.link(outside, path)
            else:
                path.write_bytes(node.data)
                if node.kind == "setuid":
                    os.chmod(path, 0o4755)
        except OSError:
            continue  # the tree cannot hold this one (a name taken, a path through a file)


@fuzz_settings(200)
@given(
    nodes=st.tuples(st.lists(SAFE_NODE_S, max_size=6), st.lists(NODE_S, max_size=2)).map(
        lambda pair: pair[0] + pair[1]
    ),
    manifest=st.sampled_from([MANIFEST, MANIFEST, b"", b"[artifact]\n"]),
    limits=LIMITS,
)
def test_a_directory_is_refused_or_stored_faithfully(
    env: Env, nodes: list[Node], manifest: bytes, limits: tuple[int, int]
) -> None:
    base = env.base()
    root = base / "p1" / "p2" / "dir"
    root.mkdir(parents=True)
    (base / "outside.txt").write_text("outside\n")
    (base / "victim").mkdir()
    (base / "victim" / "secret").write_text("secret\n")
    if manifest:
        (root / "proctor.toml").write_bytes(manifest)
    make_tree(root, nodes, base / "outside.txt")
    before = snapshot(base, root)
    with watchdog(20):
        submit_and_materialize(env, root, max_bytes=limits[0], max_files=limits[1])
    assert snapshot(base, root) == before


def test_a_fifo_named_like_the_manifest_is_refused_not_waited_on(env: Env) -> None:
    root = env.base() / "dir"
    root.mkdir()
    os.mkfifo(root / "proctor.toml")
    with watchdog(10), pytest.raises(UsageError, match="FIFO"):
        env.arts.submit("acme", root, AUTHOR)
    assert stat.S_ISFIFO(os.lstat(root / "proctor.toml").st_mode)


def test_an_archive_cut_inside_a_file_leaves_no_half_file(env: Env) -> None:
    """Found by fuzz/fuzz_artifact_tar.py: a file cut short was left behind, mode 0600."""
    data = build([Entry("proctor.toml", tarfile.REGTYPE, b"x" * 5000)], tarfile.PAX_FORMAT)
    assert data is not None
    base = env.base()
    assert check_extract(data[: 512 + 2000], base, max_bytes=10_000, max_files=10) is None
    assert not any((base / "p1" / "p2" / "dest").iterdir())
