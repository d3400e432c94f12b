"""`audit export` writes a complete static C2SP tlog-tiles tree next to the native
files: a plain `http.server` on loopback serves it to a tlog client of the test's
own, which proves the latest checkpoint and every older one from the tiles; the
offline verifier checks the tree too, and catches a bundle or an older partial
tile that was altered or removed."""

from __future__ import annotations

import functools
import json
import shutil
import threading
from collections.abc import Iterator
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from proctor.errors import VerificationFailed
from proctor.ledger import Actor, EventDraft, Verifier, open_checkpoint, verify_export
from proctor.runtime import Runtime
from tests.conftest import run_cli
from tests.integration.tlog_client import mth, path, read_log, read_tree


class _Quiet(SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def exported(demo_home: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    home = tmp_path_factory.mktemp("static") / "home"
    shutil.copytree(demo_home, home, symlinks=True)
    config = json.loads((home / "config.json").read_text())
    config["store"] = f"sqlite:///{home / 'proctor.db'}"
    (home / "config.json").write_text(json.dumps(config))
    with Runtime.open(home) as rt:
        actor = Actor("operator", "test")
        # Many checkpoint sizes: one per append, some inside tile 0, some past it.
        for i in range(5):
            rt.ledger.append("acme", EventDraft(actor, "test.event", f"a/{i}"))
        rt.ledger.append_many(
            "acme", [EventDraft(actor, "test.event", f"b/{i}") for i in range(250)]
        )
        for i in range(5):
            rt.ledger.append("acme", EventDraft(actor, "test.event", f"c/{i}"))
    out = home.parent / "export"
    run_cli("audit", "export", "--tenant", "acme", "--out", str(out), home=home)
    yield out


@pytest.fixture(scope="module")
def static_server(exported: Path) -> Iterator[str]:
    handler = functools.partial(_Quiet, directory=str(exported))
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/"
    server.shutdown()
    server.server_close()
    thread.join()


def test_a_static_server_serves_the_export_to_a_tlog_client(
    exported: Path, static_server: str
) -> None:
    meta = json.loads((exported / "log.json").read_text())
    verifier = Verifier.parse((exported / "verifier.key").read_text())
    with httpx.Client(base_url=static_server, timeout=30) as http:

        def fetch(p: str) -> bytes | None:
            r = http.get(p)
            if r.status_code == 404:
                return None
            assert r.status_code == 200, f"{p}: {r.status_code}"
            return r.content

        got = read_log(fetch, verifier, meta["origin"])
        assert got.checkpoint.size == meta["size"] > 256
        events = (exported / "events.jsonl").read_bytes().splitlines()
        assert got.entries == events
        # A client holding any older checkpoint proves against it from the tree too.
        olds = [json.loads(x)["note"] for x in (exported / "checkpoints.jsonl").open()]
        sizes = [json.loads(x)["size"] for x in (exported / "checkpoints.jsonl").open()]
        assert len(olds) > 10
        for note in olds:
            cp = open_checkpoint(note, verifier, meta["origin"])
            if cp.size == 0:
                continue
            entries, leaves, _ = read_tree(fetch, cp.size)
            assert mth(leaves) == cp.root, cp.size
            assert entries == events[: cp.size]
        # Paths the tree does not have are not there (a static server's 404); an
        # older size's partial bundle in a bundle now full is read from the full one.
        assert http.get(path(0, 1, 255)).status_code == 404
        older = next(s for s in sizes if 0 < s < 256)
        assert http.get(path(0, 0, older)).status_code == 200
        assert http.get(path("entries", 0, older)).status_code == 404
    # And the offline verifier, through the CLI, checks the same tree.
    res = run_cli("audit", "verify", "--from-export", str(exported), "--key", verifier.vkey())
    assert "verified" in res.out


def test_the_offline_verifier_catches_an_altered_or_missing_tree_file(
    exported: Path, tmp_path: Path
) -> None:
    notes = [json.loads(x) for x in (exported / "checkpoints.jsonl").open()]
    size = json.loads((exported / "log.json").read_text())["size"]
    old = next(n["size"] for n in notes if 256 > n["size"] > 0)
    # An older size in the bundle still partial: its own partial bundle is there.
    edge = next(n["size"] for n in notes if 256 < n["size"] < size)
    cases = {
        "an altered full bundle": (path("entries", 0), "flip"),
        "a missing full bundle": (path("entries", 0), "remove"),
        "an older partial bundle altered": (path("entries", 1, edge % 256), "flip"),
        "an older partial bundle missing": (path("entries", 1, edge % 256), "remove"),
        "an older partial tile altered": (path(0, 0, old), "flip"),
        "an older partial tile missing": (path(0, 0, old), "remove"),
        "an older partial level-1 tile altered": (path(1, 0, 1), "flip"),
    }
    for what, (rel, how) in cases.items():
        copy = tmp_path / what.replace(" ", "-")
        shutil.copytree(exported, copy)
        target = copy / rel
        assert target.is_file(), (what, rel)
        if how == "remove":
            target.unlink()
        else:
            data = bytearray(target.read_bytes())
            data[-1] ^= 1
            target.write_bytes(bytes(data))
        with pytest.raises(VerificationFailed, match=r"export's|was altered"):
            verify_export(copy)
    # An export written before the static tree (no "tree" in log.json, no bundles)
    # still verifies.
    legacy = tmp_path / "legacy"
    shutil.copytree(exported, legacy)
    meta = json.loads((legacy / "log.json").read_text())
    del meta["tree"]
    (legacy / "log.json").write_text(json.dumps(meta))
    shutil.rmtree(legacy / "tile" / "entries")
    assert verify_export(legacy).size == meta["size"]
