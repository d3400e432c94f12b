"""Issue 35's loop, driven through the official MCP client by an agent principal: over
streamable HTTP against a real `proctor serve` (subprocess), and, shorter, over stdio
(`proctor mcp` in a subprocess on the local home). Real sandboxes, three runs and one.

describe the data, submit, run in the sandbox and meet a refusal, read it, have the
manifest suggested, resubmit, run clean, ask for approval; the agent's own token is
refused approving and deploying to production; a person approves with the CLI and a
person deploys to production; the agent runs it there and reads the result. Every step
is an event with the agent's identity and its MCP client (read with `proctor audit
events --json`), and the evidence pack of the period verifies and holds the chain."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import zipfile
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import httpx
import httpx2
import pytest
from mcp import ClientSession
from mcp.client.stdio import StdioServerParameters, stdio_client
from mcp.client.streamable_http import streamable_http_client
from mcp_types import CallToolResult, Implementation, TextContent

from proctor.client import Client
from proctor.errors import ControlDenied, ProctorError
from proctor.ledger import utc_now
from tests.conftest import PROCTOR, run_cli, wait_until
from tests.e2e.conftest_gov import Gov, build_gov, make_crm
from tests.sandbox_conftest_helpers import working

pytestmark = pytest.mark.host
BACKEND = ([b for b in ("bubblewrap", "gvisor") if b in working()] or ["bubblewrap"])[0]
T = TypeVar("T")

JOB = """\
import json
import proctor_guest

out = {}
try:
    rows = proctor_guest.sql("crm", "SELECT id, country, plan FROM customers WHERE id <= 3")
    out["rows"] = len(rows["rows"])
except proctor_guest.Denied as exc:
    out["denied"] = {"seq": exc.seq, "reason": exc.reason}
print(json.dumps(out))
"""
MANIFEST = """\
[artifact]
name = "churn"
entrypoint = ["python3", "main.py"]
purpose = "Churn by country and plan for the retention team"

[datasets.crm.tables.customers]
columns = ["id", "country"]
access = "read"
"""
AGENT = {"type": "agent", "id": "acme/coder"}
CLIENT = {"name": "loop-agent", "version": "1.0"}


@dataclass
class Home:
    gov: Gov
    tmp: Path


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Home]:
    tmp = tmp_path_factory.mktemp("mcp-loop")
    gov = build_gov(tmp)
    rt, op = gov.rt, gov.op
    make_crm(tmp / "crm-twin.db", 40)
    rt.resources.add_dataset("acme", "crm_twin", tmp / "crm-twin.db", op, synthetic=True,
                             twin_of="crm")  # fmt: skip
    gov.people["coder"] = rt.principals.create("acme", "coder", "agent", [], op,
                                               responsible="acme/dev")  # fmt: skip
    yield Home(gov, tmp)
    rt.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def serve(home: Home) -> Iterator[str]:
    port = _free_port()
    env = dict(os.environ, PROCTOR_HOME=str(home.gov.home))
    with (home.tmp / "serve.stderr").open("wb") as err:
        proc = subprocess.Popen([PROCTOR, "serve", "--backend", BACKEND, "--api-port", str(port)],
                                env=env, stdout=subprocess.DEVNULL, stderr=err)  # fmt: skip
    url = f"http://127.0.0.1:{port}"

    def up() -> bool:
        try:
            return proc.poll() is not None or httpx.get(f"{url}/healthz", timeout=2).is_success
        except httpx.HTTPError:
            return False

    try:
        wait_until(up, "serve's API")
        assert proc.poll() is None, (home.tmp / "serve.stderr").read_text()
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def text(res: CallToolResult) -> str:
    first = res.content[0]
    assert isinstance(first, TextContent)
    return first.text


def ok(res: CallToolResult) -> Any:
    assert not res.is_error, text(res)
    return json.loads(text(res))


def cli(home: Home, *args: str, url: str | None = None, who: str | None = None) -> Any:
    full = (["--server", url] if url else []) + list(args)
    if who is not None:
        full += ["--token", home.gov.token(who)]
    return json.loads(run_cli(*full, "--json", home=home.gov.home).out)


@asynccontextmanager
async def over_http(url: str, token: str) -> AsyncIterator[ClientSession]:
    async with (
        httpx2.AsyncClient(headers={"Authorization": f"Bearer {token}"}, timeout=300) as http,
        streamable_http_client(url + "/mcp", http_client=http) as (r, w),
        ClientSession(r, w, client_info=Implementation(**CLIENT)) as s,
    ):
        await s.initialize()
        yield s


def agent_events(home: Home, since_seq: int) -> list[dict[str, Any]]:
    """The agent's events, read as an auditor would: `proctor audit events --json`."""
    evs = cli(home, "audit", "events", "-t", "acme", "--actor", "acme/coder", "--limit", "1000")
    return [e for e in evs if e["seq"] >= since_seq]


def test_the_loop_over_streamable_http(home: Home, serve: str) -> None:
    gov, rt = home.gov, home.gov.rt
    start, started_at = rt.ledger.head("acme").size, utc_now()
    seen: dict[str, Any] = {}

    async def sandbox_part(s: ClientSession) -> None:
        datasets = ok(await s.call_tool("describe_datasets", {"name": "crm"}))
        seen["columns"] = [c["name"] for c in datasets["datasets"][0]["tables"][0]["columns"]]
        await s.call_tool("describe_manifest_format", {})
        first = ok(await s.call_tool("submit_artifact",
                                     {"files": {"main.py": JOB}, "manifest": MANIFEST}))  # fmt: skip
        run1 = ok(await s.call_tool("run_in_sandbox", {"digest": first["digest"], "name": "churn"}))
        shown1 = ok(await s.call_tool("show_run", {"run_id": run1["run_id"]}))
        suggested = ok(await s.call_tool("suggest_manifest", {"run_id": run1["run_id"]}))
        second = ok(await s.call_tool("submit_artifact", {"files": {"main.py": JOB},
                                                          "manifest": suggested["manifest"]}))  # fmt: skip
        run2 = ok(
            await s.call_tool("run_in_sandbox", {"digest": second["digest"], "name": "churn"})
        )
        shown2 = ok(await s.call_tool("show_run", {"run_id": run2["run_id"]}))
        asked = ok(await s.call_tool("request_approval", {
            "digest": second["digest"], "comment": f"reads plan too; sandbox run {run2['run_id']}",
        }))  # fmt: skip
        state = ok(await s.call_tool("approval_state", {"digest": second["digest"]}))
        seen.update(first=first, run1=run1, shown1=shown1, suggested=suggested, second=second,
                    run2=run2, shown2=shown2, asked=asked, state=state)  # fmt: skip

    async def production_part(s: ClientSession) -> None:
        state = ok(await s.call_tool("approval_state", {"digest": seen["second"]["digest"]}))
        run3 = ok(await s.call_tool("run_deployment", {"name": "churn-prod"}))
        shown3 = ok(await s.call_tool("show_run", {"run_id": run3["run_id"]}))
        seen.update(state_after=state, run3=run3, shown3=shown3)

    def session(part: Callable[[ClientSession], Awaitable[None]]) -> None:
        async def go() -> None:
            async with over_http(serve, gov.token("coder")) as s:
                await part(s)

        asyncio.run(go())

    session(sandbox_part)
    assert seen["columns"] == ["id", "name", "email", "country", "plan", "mrr"]
    # The first sandbox run met a refusal: the guest saw its seq and reason, show_run too.
    guest = json.loads(seen["run1"]["stdout_tail"].strip().splitlines()[-1])
    assert seen["run1"]["status"] == "succeeded" and seen["run1"]["environment"] == "sandbox"
    (refusal,) = seen["shown1"]["refusals"]
    assert (
        refusal["seq"] == guest["denied"]["seq"] and refusal["reason"] == guest["denied"]["reason"]
    )
    (ev,) = list(rt.ledger.entries("acme", refusal["seq"], refusal["seq"] + 1))
    ev = json.loads(ev)
    assert ev["decision"] == "deny" and ev["run"] == seen["run1"]["run_id"]
    assert refusal["action"] == ev["action"] == "sql.select"
    # The suggestion adds exactly the column the refusal named, with that event as reason.
    assert '"plan"' in seen["suggested"]["manifest"] and "+" in seen["suggested"]["diff"]
    assert refusal["seq"] in {line["seq"] for line in seen["suggested"]["lines"]}
    assert seen["second"]["digest"] != seen["first"]["digest"]
    assert json.loads(seen["run2"]["stdout_tail"].strip().splitlines()[-1]) == {"rows": 3}
    assert seen["shown2"]["refusals"] == [] and seen["shown2"]["calls"]
    assert seen["asked"]["principal"] == "acme/coder" and seen["state"]["approved"] is False
    digest = seen["second"]["digest"]

    # The agent's token straight at the API: no approving, no production deployment.
    agent = Client(serve, gov.token("coder"))
    with pytest.raises(ControlDenied):
        agent.approve("acme", digest, comment="looks fine to me")
    with pytest.raises(ProctorError):
        agent.deploy("acme", digest, "churn-prod", instruction="ship it", environment="production")
    # A person approves with the CLI, and a person deploys to production.
    approval = cli(home, "approve", digest, "-t", "acme", "--yes", url=serve, who="alice")
    assert approval["digest"] == digest and approval["principal"] == "acme/alice"
    cli(home, "deploy", digest, "-t", "acme", "--name", "churn-prod", "--env", "production",
        "--instruction", "monthly churn report, approved", url=serve, who="dev")  # fmt: skip

    session(production_part)
    assert seen["state_after"]["approved"] is True
    run3 = seen["run3"]
    assert run3["environment"] == "production" and run3["status"] == "succeeded"
    assert json.loads(run3["stdout_tail"].strip().splitlines()[-1]) == {"rows": 3}
    assert seen["shown3"]["run_id"] == run3["run_id"]

    # Every step of the agent's is an event with its identity and its MCP client.
    mine = agent_events(home, start)
    assert all(e["actor"] == AGENT for e in mine)
    by_action: dict[str, list[dict[str, Any]]] = {}
    for e in mine:
        by_action.setdefault(e["action"], []).append(e)
    assert len(by_action["artifact.submit"]) == 2
    assert len(by_action["approval.request"]) == 1
    assert {e["details"]["environment"] for e in by_action["deployment.create"]} == {"sandbox"}
    assert {e["run"] for e in by_action["run.start"]} == {
        seen["run1"]["run_id"], seen["run2"]["run_id"], run3["run_id"],
    }  # fmt: skip
    # Each API request a tool made names the MCP client (all but the endpoint's own
    # authentication of each request, GET /whoami, made before the session is known),
    # and so do the agent's own actions that carry it (asking, describing).
    through_mcp = [e for e in mine if e["decision"] == "allow" and not (
        e["action"] == "api.request" and e["details"]["path"] == "/whoami")]  # fmt: skip
    assert {"artifact.submit", "deployment.create", "run.start", "run.end"} <= {
        e["action"] for e in through_mcp}  # fmt: skip
    assert len(through_mcp) > 15
    lacking = [(e["action"], e["details"].get("path")) for e in through_mcp
               if e["details"].get("client") != CLIENT]  # fmt: skip
    assert not lacking, lacking
    denied = [e for e in mine if e["decision"] == "deny"]
    assert {e["details"]["path"] for e in denied} == {
        f"/tenants/acme/artifacts/{digest}/approvals", "/tenants/acme/deployments",
    }  # fmt: skip
    # The people's steps are theirs.
    everyone = [json.loads(e) for e in rt.ledger.entries("acme", start)]
    grants = [e for e in everyone if e["action"] == "approval.grant" and e["decision"] == "allow"]
    assert [e["actor"]["id"] for e in grants] == ["acme/alice"]
    prod = [e for e in everyone if e["action"] == "deployment.create"
            and e["details"].get("environment") == "production"]  # fmt: skip
    assert [e["actor"]["id"] for e in prod] == ["acme/dev"]

    # The evidence pack of the period verifies, and holds the chain.
    pack = home.tmp / "loop-pack.zip"
    cli(home, "evidence", "export", "-t", "acme", "--from", started_at, "--to", "now",
        "-o", str(pack))  # fmt: skip
    report = cli(home, "evidence", "verify", str(pack), "--key", rt.ledger.vkey())
    assert report["events"] > 0 and report["production_runs"] >= 1, report
    assert report["approvals_checked"] >= 1, report
    with zipfile.ZipFile(pack) as z:
        packed = [json.loads(line) for line in z.read("events/events.jsonl").splitlines()]
    chain = [(e["action"], e["actor"]["id"]) for e in packed if e["action"] in (
        "artifact.submit", "approval.request", "approval.grant", "deployment.create", "run.start",
    ) and e["decision"] == "allow"]  # fmt: skip
    order = [chain.index(step) for step in (
        ("artifact.submit", "acme/coder"), ("approval.request", "acme/coder"),
        ("approval.grant", "acme/alice"), ("deployment.create", "acme/dev"),
    )]  # fmt: skip
    assert order == sorted(order), chain
    assert [e["run"] for e in packed if e["action"] == "run.start"][-1] == run3["run_id"]


def test_the_loop_over_stdio_on_the_local_home(home: Home) -> None:
    gov, rt = home.gov, home.gov.rt
    start = rt.ledger.head("acme").size
    env = dict(os.environ, PROCTOR_HOME=str(gov.home), PROCTOR_TOKEN=gov.token("coder"))
    env.pop("PROCTOR_SERVER", None)
    params = StdioServerParameters(command=PROCTOR, args=["mcp", "--backend", BACKEND], env=env)

    async def go() -> tuple[Any, Any]:
        with (home.tmp / "mcp.stderr").open("a") as errlog:
            async with (
                stdio_client(params, errlog=errlog) as (r, w),
                ClientSession(r, w, client_info=Implementation(**CLIENT)) as s,
            ):
                await s.initialize()
                art = ok(await s.call_tool("submit_artifact", {
                    "files": {"main.py": JOB}, "manifest": MANIFEST.replace("churn", "local"),
                }))  # fmt: skip
                run = ok(await s.call_tool("run_in_sandbox",
                                           {"digest": art["digest"], "name": "local-churn"}))  # fmt: skip
                return run, ok(await s.call_tool("show_run", {"run_id": run["run_id"]}))

    run, shown = asyncio.run(go())
    assert run["environment"] == "sandbox" and run["status"] == "succeeded"
    (refusal,) = shown["refusals"]
    guest = json.loads(run["stdout_tail"].strip().splitlines()[-1])
    assert refusal["seq"] == guest["denied"]["seq"] and "plan" in refusal["reason"]
    mine = agent_events(home, start)
    assert {e["action"] for e in mine} >= {"artifact.submit", "deployment.create", "run.start"}
    assert all(e["actor"] == AGENT for e in mine)
    everyone = [json.loads(e) for e in rt.ledger.entries("acme", start)]
    assert not [e for e in everyone if e["actor"]["type"] == "operator"]
