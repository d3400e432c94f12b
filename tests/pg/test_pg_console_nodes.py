"""Issue 19, item 3: the console needs no node affinity.

Two homes of one PostgreSQL store (the same keys), each with its own API and
console, as two nodes behind a load balancer would be: a person signs in on one
and goes on on the other, signs out on the second and is signed out on the
first. What the store holds of a session is sealed: no credential in the clear,
and a home with another runtime key opens none of it.
"""

from __future__ import annotations

import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from proctor.api import serve_api
from proctor.api._console_shelf import StoreShelf
from proctor.console import ConsoleConfig
from proctor.runtime import Runtime
from tests.e2e.conftest_gov import Gov, build_gov

pytestmark = pytest.mark.postgres


@pytest.fixture
def two(
    pg_dsn: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[Gov, Runtime]]:
    monkeypatch.setenv("PROCTOR_STORE", pg_dsn)
    gov = build_gov(tmp_path / "a")
    other = tmp_path / "b" / "home"
    shutil.copytree(gov.home, other)
    rt_b = Runtime.open(other)
    try:
        yield gov, rt_b
    finally:
        rt_b.close()
        gov.rt.close()


def _sign_in(base: str, token: str) -> tuple[httpx.Client, str]:
    c = httpx.Client(base_url=base)
    csrf = re.search(r'name="csrf" value="([^"]+)"', c.get("/signin").text)
    assert csrf
    r = c.post("/signin", data={"csrf": csrf.group(1), "token": token})
    assert r.status_code == 303, r.text[:300]
    cookie = next(h for h in r.headers.get_list("set-cookie") if h.startswith("proctor_session="))
    return c, cookie.split(";")[0].split("=", 1)[1]


def test_a_session_opened_on_one_node_is_good_on_the_other(two: tuple[Gov, Runtime]) -> None:
    gov, rt_b = two
    a = serve_api(gov.rt, "127.0.0.1", 0, console=ConsoleConfig())
    b = serve_api(rt_b, "127.0.0.1", 0, console=ConsoleConfig())
    try:
        _, sid = _sign_in(a.url + "/ui", gov.token("alice"))
        on_b = httpx.Client(base_url=b.url + "/ui", cookies={"proctor_session": sid})
        page = on_b.get("/t/acme/approvals")
        assert page.status_code == 200 and "alice" in page.text
        # A form of B's page, posted to B, with the session A opened: sign-out.
        csrf = re.search(r'name="csrf" value="([^"]+)"', page.text)
        assert csrf
        assert on_b.post("/signout", data={"csrf": csrf.group(1)}).status_code == 303
        on_a = httpx.Client(base_url=a.url + "/ui", cookies={"proctor_session": sid})
        r = on_a.get("/t/acme/approvals")
        assert r.status_code == 303 and "/signin" in r.headers["location"]
        # What the store held was sealed: the token never in the clear.
        _, sid2 = _sign_in(a.url + "/ui", gov.token("alice"))
        with gov.rt.store.read() as conn:
            rows = conn.query("SELECT key, doc FROM console_sessions")
        assert rows and all(gov.token("alice").encode() not in bytes(d) for _, d in rows)
        assert all(sid2 not in str(k) for k, _ in rows)  # only its hash is a key
    finally:
        a.stop()
        b.stop()


def test_a_home_with_another_key_opens_no_session(two: tuple[Gov, Runtime], tmp_path: Path) -> None:
    gov, _ = two
    shelf = StoreShelf(gov.rt)
    shelf.save("k", {"seen_at": 1.0, "expires_at": 2.0, "x": "y"})
    assert shelf.load("k") == {"seen_at": 1.0, "expires_at": 2.0, "x": "y"}
    shelf.put_pending("state-1", {"created": 5.0, "issuer": "i"})
    assert shelf.pending_count(0.0) == 1
    assert shelf.pop_pending("state-1") == {"created": 5.0, "issuer": "i"}
    assert shelf.pop_pending("state-1") is None  # once
    # Another home (its own runtime key) on the same store reads nothing of it.
    from proctor.governance import KeyRing

    class Other:
        store = gov.rt.store
        keys = KeyRing.load_or_create(tmp_path / "other.key")

    assert StoreShelf(Other()).load("k") is None  # type: ignore[arg-type]
