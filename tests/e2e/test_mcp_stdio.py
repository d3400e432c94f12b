"""`proctor mcp` over stdio, a real subprocess driven by the official MCP client, on a
local home and no server: the API is served in the process, and every call is the
agent's (its PROCTOR_TOKEN), never the operator's. No sandbox here (the loop with
sandbox runs is tests/e2e/test_mcp_loop.py)."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, TypeVar

import pytest
from mcp import ClientSession
from mcp.client.stdio import StdioServerParameters, stdio_client
from mcp_types import CallToolResult, Implementation, TextContent

from proctor.governance import parse_manifest
from proctor.mcp._files import MAX_BYTES
from tests.conftest import PROCTOR
from tests.e2e.conftest_gov import Gov, build_gov

T = TypeVar("T")
MANIFEST = '[artifact]\nname = "probe"\nentrypoint = ["python3", "main.py"]\npurpose = "test"\n'


@pytest.fixture(scope="module")
def gov(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gov]:
    g = build_gov(tmp_path_factory.mktemp("mcp-stdio"))
    yield g
    g.rt.close()


def over_stdio(gov: Gov, token: str, fn: Callable[[ClientSession], Awaitable[T]]) -> T:
    env = dict(os.environ, PROCTOR_HOME=str(gov.home), PROCTOR_TOKEN=token)
    env.pop("PROCTOR_SERVER", None)
    params = StdioServerParameters(command=PROCTOR, args=["mcp"], env=env)

    async def go() -> T:
        with (gov.home.parent / "mcp.stderr").open("a") as errlog:
            async with (
                stdio_client(params, errlog=errlog) as (r, w),
                ClientSession(r, w, client_info=Implementation(name="stdio-agent", version="2.0"))
                as s,
            ):  # fmt: skip
                await s.initialize()
                return await fn(s)

    return asyncio.run(go())


def text(res: CallToolResult) -> str:
    first = res.content[0]
    assert isinstance(first, TextContent)
    return first.text


def events(gov: Gov, start: int = 0) -> list[dict[str, Any]]:
    return [json.loads(e) for e in gov.rt.ledger.entries("acme", start)]


@pytest.mark.parametrize(
    ("token", "code", "message"),
    [
        ("", 2, "error: proctor mcp needs the agent's token in PROCTOR_TOKEN"),
        ("pt_not-a-token", 4, "error: "),
    ],
)
def test_it_will_not_serve_without_a_valid_agent_token(
    gov: Gov, token: str, code: int, message: str
) -> None:
    env = dict(os.environ, PROCTOR_HOME=str(gov.home), PROCTOR_TOKEN=token)
    env.pop("PROCTOR_SERVER", None)
    before = gov.rt.ledger.head("acme").size
    proc = subprocess.run([PROCTOR, "mcp"], env=env, input=b"", capture_output=True, timeout=60)
    err = proc.stderr.decode()
    assert proc.returncode == code, err
    assert proc.stdout == b""  # stdout is the protocol's: nothing else is ever written there
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines[0].startswith(message) and len(lines) <= 2 and "Traceback" not in err, err
    assert gov.rt.ledger.head("acme").size == before


def test_a_local_agent_acts_as_itself_never_as_the_operator(gov: Gov) -> None:
    start = gov.rt.ledger.head("acme").size

    async def calls(s: ClientSession) -> list[CallToolResult]:
        return [
            await s.call_tool("describe_datasets", {}),
            await s.call_tool(
                "submit_artifact", {"files": {"main.py": "print(2)\n"}, "manifest": MANIFEST}
            ),
            await s.call_tool("show_run", {"run_id": "r-nothing-here"}),
        ]

    datasets, submitted, missing = over_stdio(gov, gov.token("dev"), calls)
    assert not datasets.is_error and not submitted.is_error, text(submitted)
    assert json.loads(text(datasets))["tenant"] == "acme"
    digest = json.loads(text(submitted))["digest"]
    assert gov.rt.artifacts.get("acme", digest).author == "acme/dev"
    assert missing.is_error and "nothing-here" in text(missing) and "\n" not in text(missing)
    later = events(gov, start)
    assert later and all(e["actor"]["id"] == "acme/dev" for e in later)
    paths = [e["details"].get("path") for e in later if e["action"] == "api.request"]
    assert "/tenants/acme/datasets" in paths and "/tenants/acme/artifacts" in paths
    tools = [e for e in later if e["action"] == "api.request" and e["details"]["path"] != "/whoami"]
    assert all(e["details"]["client"] == {"name": "stdio-agent", "version": "2.0"} for e in tools)


def test_a_submission_past_the_apis_size_bound_is_refused_in_one_line(gov: Gov) -> None:
    """The bound is the API's (64 MiB of content); over stdio no HTTP body limit comes
    first, so the tool's own check is what answers."""
    before = (len(gov.rt.artifacts.list("acme")), gov.rt.ledger.head("acme").size)
    half = MAX_BYTES // 2

    async def call(s: ClientSession) -> CallToolResult:
        files = {"a.txt": "a" * half, "b.txt": "b" * (half + 1 - len(MANIFEST))}
        return await s.call_tool("submit_artifact", {"files": files, "manifest": MANIFEST + "#"})

    res = over_stdio(gov, gov.token("dev"), call)
    assert res.is_error and f"more than the {MAX_BYTES} bytes an artifact may hold" in text(res)
    assert "\n" not in text(res)
    assert len(gov.rt.artifacts.list("acme")) == before[0]
    later = events(gov, before[1])
    assert {e["details"].get("path") for e in later} <= {"/whoami"}


def test_the_manifest_format_is_text_for_a_model(gov: Gov) -> None:
    async def call(s: ClientSession) -> tuple[CallToolResult, Any]:
        return await s.call_tool("describe_manifest_format", {}), await s.list_tools()

    fmt, tools = over_stdio(gov, gov.token("dev"), call)
    body = text(fmt)
    for needle in ("[artifact]", "entrypoint", "purpose", "[datasets.", "columns", "access",
                   "proctor_guest.sql", "Denied"):  # fmt: skip
        assert needle in body, needle
    assert {t.name for t in tools.tools} >= {"submit_artifact", "run_in_sandbox", "show_run"}
    # Its example is a manifest the submission accepts, capabilities and asks included.
    example = re.search(r"```toml\n(.*?)```", body, re.DOTALL)
    assert example is not None
    caps = parse_manifest(example.group(1)).to_json()["capabilities"]
    assert caps["ask"]["egress"] == ["enrich.example.com:443"] and caps["secrets"]
