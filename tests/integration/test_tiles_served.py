"""The log as other people's tools read it over HTTP: a tlog-tiles client of the
test's own reads a populated demo home's whole log (checkpoint, tiles at every
level, every entry bundle) and proves it against the signed checkpoint; the
headers C2SP tlog-tiles asks for, gzip when asked; non-canonical paths refused;
reads that do not grow the log read (the system log counts them); the public
mirror option, both ways."""

from __future__ import annotations

import gzip
import json
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from proctor.api import ApiServer, serve_api
from proctor.ledger import SYSTEM_LOG, Actor, EventDraft, Verifier
from proctor.runtime import Runtime
from tests.integration.tlog_client import Fetch, path, read_log

IMMUTABLE = "max-age=31536000, immutable"


@dataclass
class Served:
    rt: Runtime
    server: ApiServer  # acme's log mirrored publicly
    private: ApiServer  # no public log
    counting: ApiServer  # like ``server``, stopped by a test to see its counts written
    aud: str  # an auditor's token (acme)
    dev: str  # a developer's token (acme): no audit.read

    def http(self, token: str | None = None, server: ApiServer | None = None) -> httpx.Client:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        return httpx.Client(base_url=(server or self.server).url, headers=headers, timeout=30)


@pytest.fixture(scope="module")
def served(demo_home: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    home = tmp_path_factory.mktemp("served") / "home"
    shutil.copytree(demo_home, home, symlinks=True)
    config = json.loads((home / "config.json").read_text())
    config["store"] = f"sqlite:///{home / 'proctor.db'}"
    (home / "config.json").write_text(json.dumps(config))
    rt = Runtime.open(home)
    # Past a full tile: full and partial tiles at level 0, a partial one at level 1.
    actor = Actor("operator", "test")
    rt.ledger.append_many("acme", [EventDraft(actor, "test.event", f"t/{i}") for i in range(300)])
    _, aud = rt.principals.create("acme", "tiles-aud", "user", ["auditor"], rt.operator)
    _, dev = rt.principals.create("acme", "tiles-dev", "user", ["developer"], rt.operator)
    server = serve_api(rt, "127.0.0.1", 0, public_logs=("acme",))
    private = serve_api(rt, "127.0.0.1", 0)
    counting = serve_api(rt, "127.0.0.1", 0, public_logs=("acme",))
    yield Served(rt, server, private, counting, aud, dev)
    counting.stop()  # stopped by its test already; twice is harmless
    private.stop()
    server.stop()
    rt.close()


def _fetcher(http: httpx.Client, prefix: str = "/tenants/acme/log/") -> Fetch:
    def fetch(p: str) -> bytes | None:
        r = http.get(prefix + p)
        assert r.status_code == 200, f"{p}: {r.status_code} {r.text}"
        return r.content

    return fetch


def test_a_tlog_client_reads_and_proves_the_whole_served_log(served: Served) -> None:
    rt = served.rt
    verifier = Verifier.parse(rt.ledger.vkey())
    origin = rt.ledger.origin("acme")
    before = rt.ledger.head("acme").size
    assert 256 + 3 < before < 512
    with served.http(served.aud) as http:
        got = read_log(_fetcher(http), verifier, origin)
        # Every entry is the event as stored, byte for byte.
        assert got.entries == list(rt.ledger.entries("acme", 0, got.checkpoint.size))
        # The served reads (a few hundred) appended nothing to the log read.
        assert rt.ledger.head("acme").size == before == got.checkpoint.size
        for _ in range(50):
            assert http.get("/tenants/acme/log/checkpoint").status_code == 200
        assert rt.ledger.head("acme").size == before

        # Headers: the checkpoint is mutable, tiles and bundles are not (partial ones
        # are prefixes of their full tile); a token's answers only in private caches.
        r = http.get("/tenants/acme/log/checkpoint")
        assert r.headers["content-type"] == "text/plain; charset=utf-8"
        assert r.headers["cache-control"] == "private, no-cache"
        for p in (path(0, 0), path(0, 1, before % 256), path("entries", 0)):
            r = http.get(f"/tenants/acme/log/{p}")
            assert r.headers["content-type"] == "application/octet-stream"
            assert r.headers["cache-control"] == f"private, {IMMUTABLE}", p
        # Entry bundles: gzip when the client accepts it, the same bytes once decoded.
        plain = http.get(
            "/tenants/acme/log/tile/entries/000", headers={"Accept-Encoding": "identity"}
        )
        assert "content-encoding" not in plain.headers
        zipped = http.get("/tenants/acme/log/tile/entries/000", headers={"Accept-Encoding": "gzip"})
        assert zipped.headers["content-encoding"] == "gzip"
        assert zipped.headers["vary"] == "Accept-Encoding"
        assert zipped.content == plain.content  # httpx decoded it
        assert int(zipped.headers["content-length"]) < len(plain.content)
        with httpx.stream("GET", f"{served.server.url}/tenants/acme/log/tile/entries/000",
                          headers={"Authorization": f"Bearer {served.aud}",
                                   "Accept-Encoding": "gzip"}) as raw:  # fmt: skip
            assert gzip.decompress(b"".join(raw.iter_raw())) == plain.content

        # A tile or bundle the tree does not have yet: 404, and no cache keeps it.
        for p in (path(0, 1, 255), path(0, 9), path("entries", 1, 255), path(1, 0)):
            r = http.get(f"/tenants/acme/log/{p}")
            assert r.status_code == 404, p
            assert r.headers["cache-control"] == "no-store"
        # Non-canonical spellings of real tiles: refused, whatever the tree holds.
        for bad in ("0/000.p/01", "00/000", "0/0", "0/00", "0/0000", "0/x000/001", "0/000.p/0",
                    "0/000.p/256", "0/001.p/1000", "64/000", "entries/000.p/01", "entries/1",
                    "0/x1/000", "0/000.p/", "0/000/", "-1/000", "0/+01"):  # fmt: skip
            r = http.get(f"/tenants/acme/log/tile/{bad}")
            assert r.status_code == 400, (bad, r.status_code)
            assert "canonical" in r.json()["error"]["message"]
        assert rt.ledger.head("acme").size == before

    # A refused read is decided by Cedar and recorded at once, in the system log.
    sys_before = rt.ledger.head(SYSTEM_LOG).size
    with served.http(served.dev) as http:
        assert http.get("/tenants/acme/log/tile/0/000").status_code == 403
    refusal = json.loads(list(rt.ledger.entries(SYSTEM_LOG, sys_before))[-1])
    assert refusal["action"] == "api.request" and refusal["decision"] == "deny"
    assert refusal["actor"]["id"].endswith("tiles-dev")
    assert refusal["details"]["target_tenant"] == "acme"
    assert rt.ledger.head("acme").size == before


def test_reads_are_counted_in_the_system_log_and_the_mirror_is_public(
    served: Served, tmp_path: Path
) -> None:
    rt = served.rt
    before = rt.ledger.head("acme").size
    # Without a token: the mirrored tenant's tlog-tiles paths only, nothing else.
    with served.http() as anon:
        r = anon.get("/tenants/acme/log/tile/0/000")
        assert r.status_code == 200
        assert r.headers["cache-control"] == f"public, {IMMUTABLE}"
        assert anon.get("/tenants/acme/log/checkpoint").headers["cache-control"] == (
            "public, no-cache"
        )
        for other in ("/tenants/acme/events", "/tenants/acme/checkpoints", "/tenants/acme",
                      "/tenants/acme/proofs/inclusion?index=0", "/tenants/acme/export"):  # fmt: skip
            assert anon.get(other).status_code == 401, other
    with served.http(server=served.private) as anon:
        assert anon.get("/tenants/acme/log/tile/0/000").status_code == 401
        assert anon.get("/tenants/acme/log/checkpoint").status_code == 401
    # A token sent to the mirror is still that principal's, decided so.
    with served.http(served.dev) as http:
        assert http.get("/tenants/acme/log/checkpoint").status_code == 403
    # Another tenant is not mirrored.
    rt.tenants.create("initech", rt.operator)
    with served.http() as anon:
        assert anon.get("/tenants/initech/log/checkpoint").status_code == 401
    with served.http(served.aud) as http:
        for _ in range(5):
            assert http.get("/tenants/acme/log/tile/entries/000").status_code == 200
    assert rt.ledger.head("acme").size == before

    # The counts are one event per reader, tenant and minute, written when the minute
    # is over or the API stops: stop a server of its own to see them.
    server = served.counting
    sys_before = rt.ledger.head(SYSTEM_LOG).size
    with httpx.Client(base_url=server.url, timeout=30) as anon:
        for _ in range(7):
            anon.get("/tenants/acme/log/checkpoint")
        anon.get("/tenants/acme/log/tile/0/000")
        anon.get("/tenants/acme/log/tile/entries/001.p/3")
    with httpx.Client(base_url=server.url, timeout=30,
                      headers={"Authorization": f"Bearer {served.aud}"}) as http:  # fmt: skip
        for _ in range(4):
            http.get("/tenants/acme/log/tile/0/000")
    assert rt.ledger.head(SYSTEM_LOG).size == sys_before  # counted, not yet written
    server.stop()
    assert rt.ledger.head("acme").size == before
    events = [json.loads(e) for e in rt.ledger.entries(SYSTEM_LOG, sys_before)]
    reads = [e for e in events if e["action"] == "api.log_reads"]
    assert all(e["tenant"] == SYSTEM_LOG and e["details"]["tenant"] == "acme" for e in reads)
    assert all(e["details"]["period_seconds"] == 60 for e in reads)
    # (Summed: the reads may straddle a minute.)
    mirror = _summed([e for e in reads if e["actor"]["id"] == "public-log-mirror"])
    assert mirror == (9, {"checkpoint": 7, "partial_entries": 1, "tile": 1}, {None})
    aud = _summed([e for e in reads if e["actor"]["id"].endswith("tiles-aud")])
    assert aud == (4, {"tile": 4}, {"acme"})


def _summed(events: list[dict[str, Any]]) -> tuple[int, dict[str, int], set[str | None]]:
    kinds: dict[str, int] = {}
    for e in events:
        for k, n in e["details"]["kinds"].items():
            kinds[k] = kinds.get(k, 0) + n
    readers = {e["details"]["reader_tenant"] for e in events}
    return sum(e["details"]["reads"] for e in events), kinds, readers
