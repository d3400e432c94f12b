"""The MCP server over streamable HTTP at /mcp of a real API server on loopback, driven
by the official MCP client: every request authenticated by the agent's bearer token,
each tool call made as the agent (the API decides and records it, with the MCP
client's name), and each refusal a clear one-line tool error with nothing changed.
No sandbox here (tests/e2e/test_mcp_loop.py runs the loop)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import httpx
import httpx2
import pytest
from mcp import ClientSession
from mcp.client.stdio import StdioServerParameters, stdio_client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError
from mcp_types import CallToolResult, Implementation, TextContent

from proctor.api import serve_api
from proctor.client import Client
from proctor.errors import ControlDenied, NotFound, ProctorError
from tests.conftest import PROCTOR
from tests.e2e.conftest_gov import Gov, build_gov

T = TypeVar("T")
TOOLS = {
    "describe_datasets", "describe_manifest_format", "submit_artifact", "run_in_sandbox",
    "run_deployment", "show_run", "suggest_manifest", "request_approval", "approval_state",
    "asked_calls",
}  # fmt: skip
MANIFEST = '[artifact]\nname = "probe"\nentrypoint = ["python3", "main.py"]\npurpose = "test"\n'
INIT = {
    "jsonrpc": "2.0", "id": 1, "method": "initialize",
    "params": {"protocolVersion": "2025-06-18", "capabilities": {},
               "clientInfo": {"name": "raw", "version": "1"}},
}  # fmt: skip
ACCEPT = {"Accept": "application/json, text/event-stream", "Content-Type": "application/json"}


@dataclass
class Served:
    gov: Gov
    url: str


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    gov = build_gov(tmp_path_factory.mktemp("mcp-http"))
    gov.people["coder"] = gov.rt.principals.create(
        "acme", "coder", "agent", [], gov.op, responsible="acme/dev"
    )
    server = serve_api(gov.rt, "127.0.0.1", 0)
    yield Served(gov, server.url)
    server.stop()
    gov.rt.close()


@asynccontextmanager
async def session(url: str, token: str, name: str = "test-agent") -> AsyncIterator[ClientSession]:
    headers = {"Authorization": f"Bearer {token}"}
    async with (
        httpx2.AsyncClient(headers=headers, timeout=60) as http,
        streamable_http_client(url + "/mcp", http_client=http) as (r, w),
        ClientSession(r, w, client_info=Implementation(name=name, version="0.9")) as s,
    ):
        await s.initialize()
        yield s


def with_session(served: Served, token: str, fn: Callable[[ClientSession], Awaitable[T]]) -> T:
    async def go() -> T:
        async with session(served.url, token) as s:
            return await fn(s)

    return asyncio.run(go())


def text(res: CallToolResult) -> str:
    first = res.content[0]
    assert isinstance(first, TextContent)
    return first.text


def events(served: Served, tenant: str = "acme", start: int = 0) -> list[dict[str, Any]]:
    return [json.loads(e) for e in served.gov.rt.ledger.entries(tenant, start)]


def test_a_request_without_a_valid_token_is_401_before_any_mcp_is_read(served: Served) -> None:
    before = served.gov.rt.ledger.head("acme").size
    for headers in ({}, {"Authorization": "Bearer not-a-token"}, {"Authorization": "Basic eA=="}):
        resp = httpx.post(served.url + "/mcp", json=INIT, headers={**ACCEPT, **headers})
        assert resp.status_code == 401, resp.text
        assert resp.headers["www-authenticate"].startswith("Bearer")
        assert resp.json()["error"]["code"] == "unauthenticated"
        assert "mcp-session-id" not in resp.headers
    assert served.gov.rt.ledger.head("acme").size == before


def test_the_tools_are_described_for_a_model(served: Served) -> None:
    async def listed(s: ClientSession) -> Any:
        return (await s.list_tools()).tools

    tools = with_session(served, served.gov.token("dev"), listed)
    assert {t.name for t in tools} >= TOOLS
    for t in tools:
        assert t.description and len(t.description) > 80, t.name
    hints = {t.name: t.annotations.read_only_hint for t in tools if t.annotations}
    assert hints["describe_datasets"] is True and hints["show_run"] is True
    assert hints["submit_artifact"] is False and hints["run_in_sandbox"] is False
    submit = next(t for t in tools if t.name == "submit_artifact")
    assert "'..'" in (submit.description or "") and "MiB" in (submit.description or "")


def test_each_call_is_the_agents_own_request_with_its_mcp_client(served: Served) -> None:
    start = served.gov.rt.ledger.head("acme").size

    async def calls(s: ClientSession) -> tuple[CallToolResult, CallToolResult, CallToolResult]:
        return (await s.call_tool("describe_datasets", {}),
                await s.call_tool("describe_datasets", {"name": "crm"}),
                await s.call_tool("describe_manifest_format", {}))  # fmt: skip

    every, one, fmt = with_session(served, served.gov.token("coder"), calls)
    assert not every.is_error and not one.is_error and not fmt.is_error
    doc = json.loads(text(every))
    assert doc["tenant"] == "acme"
    assert {d["name"] for d in doc["datasets"]} == {"crm", "fake"}
    (crm,) = json.loads(text(one))["datasets"]
    (customers,) = crm["tables"]
    assert customers["name"] == "customers"
    assert [c["name"] for c in customers["columns"]] == [
        "id", "name", "email", "country", "plan", "mrr",
    ]  # fmt: skip
    # The catalog, never a row (build_gov's rows are "Name 1", "user1@example.com", ...).
    assert "example.com" not in text(every) + text(one) and "Name 1" not in text(every)
    assert "[artifact]" in text(fmt) and "entrypoint" in text(fmt)
    later = events(served, start=start)
    described = [e for e in later if e["action"] == "dataset.describe"]
    assert sorted(e["resource"] for e in described) == [
        "dataset/crm",
        "dataset/crm",
        "dataset/fake",
    ]
    read = [e for e in later if e["action"] == "api.request"
            and e["details"].get("path") == "/tenants/acme/datasets"]  # fmt: skip
    assert len(read) == 2
    for ev in read + described:
        assert ev["actor"] == {"type": "agent", "id": "acme/coder"} and ev["decision"] == "allow"
        assert ev["details"]["client"] == {"name": "test-agent", "version": "0.9"}


def test_an_agent_asks_for_approval_and_reads_where_it_stands_but_cannot_approve(
    served: Served,
) -> None:
    """Approving is not a tool; the API refuses the agent's own token all the same."""
    rt = served.gov.rt
    start = rt.ledger.head("acme").size

    async def calls(s: ClientSession) -> tuple[CallToolResult, ...]:
        sub = await s.call_tool("submit_artifact", {"files": {"main.py": "print('ok')\n"},
                                                    "manifest": MANIFEST.replace("probe", "asks")})  # fmt: skip
        digest = json.loads(text(sub))["digest"]
        asked = await s.call_tool("request_approval", {"digest": digest, "comment": "please"})
        state = await s.call_tool("approval_state", {"digest": digest})
        long = await s.call_tool("request_approval", {"digest": digest, "comment": "x" * 2001})
        bad = await s.call_tool("approval_state", {"digest": "sha256:../../x"})
        asks = await s.call_tool("asked_calls", {"state": "pending"})
        bad_state = await s.call_tool("asked_calls", {"state": "all"})
        return sub, asked, state, long, bad, asks, bad_state

    sub, asked, state, long, bad, asks, bad_state = with_session(
        served, served.gov.token("coder"), calls
    )
    assert json.loads(text(asks)) == {"asked_calls": [], "count": 0}
    assert bad_state.is_error and "the state must be one of pending," in text(bad_state)
    digest = json.loads(text(sub))["digest"]
    req = json.loads(text(asked))
    assert (
        req["digest"] == digest and req["principal"] == "acme/coder" and req["comment"] == "please"
    )
    st = json.loads(text(state))
    assert st["approved"] is False and st["requests"][0]["principal"] == "acme/coder"
    assert long.is_error and "longer than 2000" in text(long)
    assert bad.is_error and "the digest 'sha256:../../x' is not valid" in text(bad)
    (ev,) = [e for e in events(served, start=start) if e["action"] == "approval.request"]
    assert ev["actor"] == {"type": "agent", "id": "acme/coder"} and ev["seq"] == req["seq"]
    # The agent's token straight at the API: approving, deploying to production.
    agent = Client(served.url, served.gov.token("coder"))
    with pytest.raises(ControlDenied):
        agent.approve("acme", digest, comment="lgtm")
    with pytest.raises(ProctorError):
        agent.deploy("acme", digest, "asks-prod", instruction="x", environment="production")
    assert rt.approvals.for_artifact("acme", digest) == []
    with pytest.raises(NotFound):
        rt.deployments.versions("acme", "asks-prod")
    denied = [e for e in events(served, start=start)
              if e["decision"] == "deny" and e["actor"]["id"] == "acme/coder"]  # fmt: skip
    assert [e["details"]["path"] for e in denied] == [
        f"/tenants/acme/artifacts/{digest}/approvals", "/tenants/acme/deployments",
    ]  # fmt: skip
    assert all(e["action"] == "api.request" and e["reason"] for e in denied), denied


def test_a_submission_is_the_agents_and_bad_paths_change_nothing(served: Served) -> None:
    rt = served.gov.rt
    bad = {
        "/etc/passwd": "the file path '/etc/passwd' is absolute",
        "../up.py": "has an empty, '.' or '..' part",
        "lib/./x.py": "has an empty, '.' or '..' part",
        "lib//x.py": "has an empty, '.' or '..' part",
        "lib\\x.py": "holds a backslash",
        ".git/config": "which a submission leaves out",
        "a\x1bb": "holds a control character",
        "proctor.toml": "give the manifest as the 'manifest' argument",
    }

    async def calls(
        s: ClientSession,
    ) -> tuple[list[CallToolResult], CallToolResult, CallToolResult]:
        refused = [
            await s.call_tool("submit_artifact", {"files": {"main.py": "print(1)", p: "x"},
                                                  "manifest": MANIFEST})
            for p in bad
        ]  # fmt: skip
        many = {f"f{i}.py": "" for i in range(10_000)}
        too_many = await s.call_tool("submit_artifact", {"files": many, "manifest": MANIFEST})
        typed = await s.call_tool("submit_artifact", {"files": 3, "manifest": MANIFEST})
        return refused, too_many, typed

    before = (len(rt.artifacts.list("acme")), rt.ledger.head("acme").size)
    refused, too_many, typed = with_session(served, served.gov.token("dev"), calls)
    for res, why in zip(refused, bad.values(), strict=True):
        assert res.is_error and why in text(res), text(res)
        assert "\n" not in text(res) and "Traceback" not in text(res)
    assert too_many.is_error and "more than the 10000 an artifact may hold" in text(too_many)
    assert typed.is_error
    assert (
        text(typed)
        == "invalid arguments for submit_artifact: files: Input should be a valid dictionary"
    )
    # Nothing reached the API but the MCP requests' own authentication (whoami).
    assert len(rt.artifacts.list("acme")) == before[0]
    later = events(served, start=before[1])
    assert {e["details"].get("path") for e in later} == {"/whoami"}

    async def good(s: ClientSession) -> CallToolResult:
        return await s.call_tool("submit_artifact", {
            "files": {"main.py": "print('hi')\n", "lib/util.py": "X = 1\n"},
            "manifest": MANIFEST,
        })  # fmt: skip

    res = with_session(served, served.gov.token("dev"), good)
    assert not res.is_error, text(res)
    doc = json.loads(text(res))
    art = rt.artifacts.get("acme", doc["digest"])
    assert art.author == "acme/dev" and doc["file_count"] == 3
    assert [f.path for f in rt.artifacts.files("acme", art.digest)] == [
        "lib/util.py", "main.py", "proctor.toml",
    ]  # fmt: skip


def test_a_message_over_the_apis_body_limit_is_refused_whole(served: Served) -> None:
    rt = served.gov.rt
    before = (len(rt.artifacts.list("acme")), rt.ledger.head("acme").size)
    call = {"jsonrpc": "2.0", "id": 2, "method": "tools/call",
            "params": {"name": "submit_artifact",
                       "arguments": {"files": {"big.py": "#" * (2 << 20)}, "manifest": MANIFEST}}}  # fmt: skip
    resp = httpx.post(served.url + "/mcp", json=call, timeout=60,
                      headers={**ACCEPT, "Authorization": f"Bearer {served.gov.token('dev')}"})  # fmt: skip
    assert resp.status_code == 413
    assert (len(rt.artifacts.list("acme")), rt.ledger.head("acme").size) == before


def test_another_tenant_is_refused_and_the_refusal_recorded(served: Served) -> None:
    start = served.gov.rt.ledger.head("acme").size

    async def calls(s: ClientSession) -> tuple[CallToolResult, CallToolResult]:
        return (await s.call_tool("describe_datasets", {"tenant": "globex"}),
                await s.call_tool("describe_datasets", {"tenant": "../globex"}))  # fmt: skip

    other, malformed = with_session(served, served.gov.token("dev"), calls)
    assert other.is_error and "globex" in text(other) and "\n" not in text(other)
    assert malformed.is_error and "the tenant '../globex' is not valid" in text(malformed)
    denied = [e for e in events(served, start=start) if e["decision"] == "deny"]
    assert [e["details"].get("path") for e in denied] == ["/tenants/globex/datasets"]
    assert denied[0]["actor"]["id"] == "acme/dev"
    assert all(e["actor"]["id"] != "acme/dev" for e in events(served, "globex"))


def test_a_session_belongs_to_the_principal_that_opened_it(served: Served) -> None:
    dev, alice = served.gov.token("dev"), served.gov.token("alice")
    with httpx.Client(base_url=served.url, headers=ACCEPT, timeout=30) as http:
        opened = http.post("/mcp", json=INIT, headers={"Authorization": f"Bearer {dev}"})
        assert opened.status_code == 200
        sid = opened.headers["mcp-session-id"]
        listing = {"jsonrpc": "2.0", "id": 3, "method": "tools/list"}
        stolen = http.post("/mcp", json=listing,
                           headers={"Authorization": f"Bearer {alice}", "Mcp-Session-Id": sid})  # fmt: skip
        assert stolen.status_code == 404
        http.delete("/mcp", headers={"Authorization": f"Bearer {dev}", "Mcp-Session-Id": sid})


@pytest.mark.parametrize("how", ["disabled", "rotated"])
def test_a_revoked_token_is_refused_at_the_next_request_of_its_session(
    served: Served, how: str
) -> None:
    rt, op = served.gov.rt, served.gov.op
    name = f"dev-{how}"
    _, token = rt.principals.create("acme", name, "agent", [], op, responsible="acme/dev")
    seen: dict[str, Any] = {}

    async def go() -> None:
        async with session(served.url, token) as s:
            first = await s.call_tool("describe_datasets", {})
            seen["first"] = first.is_error
            if how == "disabled":
                rt.principals.set_disabled("acme", name, True, op)
            else:
                rt.principals.rotate("acme", name, op)
            seen["revoked_at"] = rt.ledger.head("acme").size
            try:
                await s.call_tool("describe_datasets", {})
            except MCPError as exc:
                seen["refused"] = str(exc)

    # The official client may fail to close a session whose token no longer works.
    with contextlib.suppress(BaseExceptionGroup):
        asyncio.run(go())
    assert seen["first"] is False
    assert "refused" in seen
    after = events(served, start=seen["revoked_at"])
    assert all(e["actor"]["id"] != f"acme/{name}" for e in after)


def test_an_mcp_client_name_the_api_would_refuse_is_made_printable(served: Served) -> None:
    """clientInfo is the client's to say: spaces, '/', non-ASCII and length would make
    the API refuse the header (400), so they are replaced, never passed on or dropped."""
    start = served.gov.rt.ledger.head("acme").size

    async def go() -> CallToolResult:
        async with session(
            served.url, served.gov.token("coder"), name="My Agent/ü" + "x" * 80
        ) as s:
            return await s.call_tool("describe_datasets", {"name": "fake"})

    res = asyncio.run(go())
    assert not res.is_error, text(res)
    (ev,) = [e for e in events(served, start=start) if e["action"] == "dataset.describe"]
    assert ev["details"]["client"] == {"name": "My_Agent__" + "x" * 54, "version": "0.9"}


def test_proctor_mcp_over_stdio_talks_to_a_running_api_with_the_agents_token(
    served: Served,
) -> None:
    """`proctor --server URL mcp`: the stdio server as a client of a remote API."""
    start = served.gov.rt.ledger.head("acme").size
    env = dict(os.environ, PROCTOR_SERVER=served.url, PROCTOR_TOKEN=served.gov.token("coder"))
    env.pop("PROCTOR_HOME", None)
    params = StdioServerParameters(command=PROCTOR, args=["mcp"], env=env)

    async def go() -> CallToolResult:
        async with (
            stdio_client(params) as (r, w),
            ClientSession(r, w, client_info=Implementation(name="remote", version="3")) as s,
        ):
            await s.initialize()
            return await s.call_tool("describe_datasets", {"name": "crm"})

    res = asyncio.run(go())
    assert not res.is_error, text(res)
    assert json.loads(text(res))["datasets"][0]["tables"][0]["name"] == "customers"
    (ev,) = [e for e in events(served, start=start) if e["action"] == "dataset.describe"]
    assert ev["actor"] == {"type": "agent", "id": "acme/coder"}
    assert ev["details"]["client"] == {"name": "remote", "version": "3"}


def test_tool_calls_beyond_the_apis_threads_do_not_starve_it(served: Served) -> None:
    """A tool's thread waits on an API request that needs one of the API's own threads:
    tools in that same pool, more of them at once than it has, would wait forever. With
    4 API threads, 12 calls at once, on one session, all come back."""
    server = serve_api(served.gov.rt, "127.0.0.1", 0, worker_threads=4)
    try:

        async def go() -> list[CallToolResult]:
            async with session(server.url, served.gov.token("coder")) as s:
                calls = [s.call_tool("describe_datasets", {"name": "crm"}) for _ in range(12)]
                return await asyncio.wait_for(asyncio.gather(*calls), timeout=90)

        results = asyncio.run(go())
    finally:
        server.stop()
    assert len(results) == 12 and not any(r.is_error for r in results)
