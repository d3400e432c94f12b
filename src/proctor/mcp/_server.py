"""The tools: each one SDK call (or a few reads) made as the agent's principal.

The server decides nothing: the API authenticates the agent's token, Cedar decides
with the tenant's role policy, and the ledger records, exactly as for the CLI. What
is checked here is only the shape of the arguments, with the API's bounds, so that a
model gets one clear line before anything is sent; the API checks everything again.

How a tool reaches the API is a ``Gateway``: over stdio, the agent's token and a
server URL or the API application in this process; over streamable HTTP, the
bearer token of the request that carries the call.
"""

from __future__ import annotations

import functools
import json
import logging
import re
from collections.abc import Callable
from typing import Annotated, Any, Protocol, TypeVar

import anyio
import anyio.to_thread
from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp_types import ToolAnnotations
from pydantic import Field

from proctor.client import Client
from proctor.errors import ControlDenied, ProctorError, UsageError
from proctor.mcp._files import MAX_BYTES, MAX_FILES, pack
from proctor.mcp._format import INSTRUCTIONS, MANIFEST_FORMAT

_log = logging.getLogger("proctor.mcp")

#: The API's rules for the names a tool takes (governance: tenants, deployments).
_TENANT_RE = re.compile(r"^[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?$")
_DEPLOYMENT_RE = re.compile(r"^[a-z][a-z0-9-]{0,62}$")
#: ``sha256:<64 hex>`` or a unique prefix of the hex part, at least 4 digits.
_DIGEST_RE = re.compile(r"^(?:sha256:)?[0-9a-f]{4,64}$")
_RUN_RE = re.compile(r"^[A-Za-z0-9_-]{4,64}$")
_DATASET_RE = re.compile(r"^[a-z][a-z0-9_]{0,62}$")
#: The datasets describe_datasets describes in one answer.
MAX_DATASETS = 100
_DATASET_KEYS = ("name", "kind", "synthetic", "twin_of")
_ASK_STATES = ("pending", "approved", "denied", "timed_out", "abandoned")
#: What a tool's answer carries of a run's output: its end, where errors are.
TAIL_BYTES = 8192
#: The calls show_run lists (the newest); refusals are all listed up to the same bound.
MAX_CALLS = 200
_TEXT_MAX = 2048  # an instruction, as the API bounds it
_COMMENT_MAX = 2000  # an approval request's comment, as the API bounds it

CLIENT_HEADER = "X-Proctor-Client"

Json = Any
F = TypeVar("F", bound=Callable[..., Any])


class Gateway(Protocol):
    """How a tool call reaches the API as the agent."""

    def client(self, ctx: Context, headers: dict[str, str]) -> Client:
        """An SDK client that acts as the agent (closed by the caller)."""

    def tenant(self, ctx: Context, client: Client) -> str:
        """The agent's own tenant."""


def client_header(ctx: Context) -> dict[str, str]:
    """``X-Proctor-Client: name/version`` from the MCP client's ``initialize``
    (clientInfo), printable ASCII and bounded; nothing when the client sent none."""
    try:
        params = ctx.request_context.session.client_params
    except (ValueError, AttributeError):
        return {}
    info = params.client_info if params is not None else None
    if info is None:
        return {}

    def clean(text: object, most: int) -> str:
        s = "".join(c if 32 < ord(c) < 127 and c != "/" else "_" for c in str(text or ""))
        return s[:most] or "unknown"

    return {CLIENT_HEADER: f"{clean(info.name, 64)}/{clean(info.version, 32)}"}


def one_line(exc: ProctorError) -> str:
    """A ProctorError as the one line a model reads: the message and the hint."""
    text = exc.message if not exc.hint else f"{exc.message} (hint: {exc.hint})"
    return " ".join(text.split())


def _guarded(limiter: anyio.CapacityLimiter) -> Callable[[F], F]:
    """A tool: its body in a worker thread of ``limiter`` (the SDK is synchronous), and
    its failures as one line (an MCP tool error, isError): a ProctorError's message and
    hint, anything else named by its type only, never a traceback.

    The tools' own threads, not the process's shared pool: a tool's thread waits on an
    API request that the API serves in a thread of that pool, so tools taking the whole
    pool would wait forever for requests that cannot start."""

    def wrap(fn: F) -> F:
        def body(kwargs: dict[str, Any]) -> Any:
            try:
                return fn(**kwargs)
            except ToolError:
                raise
            except ProctorError as exc:
                raise ToolError(one_line(exc)) from None
            except Exception as exc:
                _log.exception("tool %s failed", fn.__name__)
                raise ToolError(
                    f"internal error in Proctor's MCP server ({type(exc).__name__}); "
                    "the call may be retried, and the server's log says more"
                ) from None

        @functools.wraps(fn)
        async def run(**kwargs: Any) -> Any:
            return await anyio.to_thread.run_sync(body, kwargs, limiter=limiter)

        return run  # type: ignore[return-value]

    return wrap


def _check(value: str | None, rule: re.Pattern[str], what: str) -> None:
    if value is not None and not rule.match(value):
        raise UsageError(f"{what} {value[:80]!r} is not valid")


def _text(value: str, what: str) -> str:
    if len(json.dumps(value, ensure_ascii=False)) > _TEXT_MAX:
        raise UsageError(f"{what} is longer than {_TEXT_MAX} bytes: say it shorter")
    return value


def _tail(data: bytes | str) -> str:
    raw = data.encode() if isinstance(data, str) else data
    cut = raw[-TAIL_BYTES:]
    text = cut.decode("utf-8", "replace")
    return ("[...]\n" if len(raw) > TAIL_BYTES else "") + text


def _event_row(doc: dict[str, Any]) -> dict[str, Any]:
    row = {k: doc.get(k) for k in ("seq", "action", "resource", "decision", "reason")}
    return {k: v for k, v in row.items() if v not in (None, "")}


TenantArg = Annotated[
    str | None,
    Field(description="Leave it out: you act in your own tenant (the token's), and only there."),
]
DigestArg = Annotated[
    str,
    Field(description="The artifact's digest as submit_artifact returned it ('sha256:<64 hex>')."),
]
RunArg = Annotated[str, Field(description="The run's id, as a run tool returned it.")]


def _run_answer(run: Json, out: list[str], err: list[str]) -> dict[str, Any]:
    return {
        "run_id": run.get("id"), "deployment": run.get("deployment"),
        "environment": run.get("environment"), "digest": run.get("digest"),
        "status": run.get("status"), "exit_code": run.get("exit_code"),
        "reason": run.get("reason"),
        "stdout_tail": _tail("".join(out)), "stderr_tail": _tail("".join(err)),
        "next": "show_run with this run_id lists its calls and every refusal with its reason",
    }  # fmt: skip


Call = Callable[[Context], tuple[Client, Callable[[str | None], str]]]
Guard = Callable[[F], F]
#: For clients that show or gate tools: nothing here destroys anything; reads change
#: nothing; a submission of the same content is the same artifact.
_READ = ToolAnnotations(read_only_hint=True, destructive_hint=False, open_world_hint=False)
_ADD = ToolAnnotations(read_only_hint=False, destructive_hint=False, idempotent_hint=True,
                       open_world_hint=False)  # fmt: skip
_ASK = ToolAnnotations(read_only_hint=False, destructive_hint=False, idempotent_hint=False,
                       open_world_hint=False)  # fmt: skip
_RUN = ToolAnnotations(read_only_hint=False, destructive_hint=False, idempotent_hint=False,
                       open_world_hint=True)  # fmt: skip
#: Tool calls served at once (each in its own worker thread); more wait their turn.
TOOL_THREADS = 16


def build_server(gateway: Gateway, *, name: str = "proctor") -> MCPServer:
    """The MCP server whose tools reach the API through ``gateway``."""
    server: MCPServer = MCPServer(name, instructions=INSTRUCTIONS, log_level="WARNING")

    def call(ctx: Context) -> tuple[Client, Callable[[str | None], str]]:
        client = gateway.client(ctx, client_header(ctx))

        def tenant_of(given: str | None) -> str:
            _check(given, _TENANT_RE, "the tenant")
            return given if given is not None else gateway.tenant(ctx, client)

        return client, tenant_of

    guarded: Guard[Any] = _guarded(anyio.CapacityLimiter(TOOL_THREADS))
    _add_artifact_tools(server, call, guarded)
    _add_run_tools(server, call, guarded)
    _add_approval_tools(server, call, guarded)
    _add_ask_tools(server, call, guarded)
    _flatten_argument_errors(server)
    return server


def _add_artifact_tools(server: MCPServer, call: Call, guarded: Guard[Any]) -> None:
    @guarded
    def describe_datasets(
        ctx: Context,
        name: Annotated[
            str | None, Field(description="One dataset's name; leave it out for all of them.")
        ] = None,
        tenant: TenantArg = None,
    ) -> dict[str, Any]:
        _check(name, _DATASET_RE, "the dataset name")
        client, tenant_of = call(ctx)
        with client:
            t = tenant_of(tenant)
            listed = [d for d in client.datasets(t) if name is None or d.get("name") == name]
            if name is not None and not listed:
                raise UsageError(f"no dataset {name!r} in tenant {t!r}",
                                 hint="describe_datasets without a name lists them")  # fmt: skip
            datasets = []
            for d in listed[:MAX_DATASETS]:
                row: dict[str, Any] = {
                    k: d.get(k) for k in ("name", "kind", "synthetic", "twin_of")
                }
                try:
                    schema = client.describe_dataset(t, str(d["name"]))
                    row["tables"] = schema.get("tables", [])
                except ProctorError as exc:  # one dataset's catalog unreadable: say so, go on
                    row["error"] = one_line(exc)
                datasets.append(row)
        return {
            "tenant": t,
            "datasets": datasets,
            "note": "A manifest names a real dataset (synthetic false) and the columns its "
            "statements touch; sandbox runs read its synthetic twin (twin_of) under the same "
            "name. No row is ever shown here.",
        }

    server.add_tool(
        describe_datasets,
        annotations=_READ,
        description=(
            "The datasets your tenant has registered: name, kind (sqlite or postgresql), "
            "whether it is synthetic (and which real dataset it stands in for in the "
            "sandbox), and each table's columns with their types, from the database's own "
            "catalog. Never returns a row of data. Write the manifest's "
            "[datasets.<name>.tables.<table>] from it, naming only the columns your code "
            "touches. Each description is recorded. Another tenant's datasets are refused "
            "(it does not exist for you)."
        ),
    )

    @guarded
    def describe_manifest_format() -> str:
        return MANIFEST_FORMAT

    server.add_tool(
        describe_manifest_format,
        annotations=_READ,
        description=(
            "The format of proctor.toml, the manifest every artifact needs: its keys, "
            "rules and an example, written for you. Read it before submit_artifact."
        ),
    )

    @guarded
    def submit_artifact(
        ctx: Context,
        files: Annotated[
            dict[str, str],
            Field(
                description="The code: {relative path: file text}, like "
                "{'main.py': '...', 'lib/util.py': '...'}. Text files only; no proctor.toml "
                "here (that is 'manifest')."
            ),
        ],
        manifest: Annotated[str, Field(description="The text of proctor.toml.")],
        executable: Annotated[
            list[str], Field(description="Paths among 'files' to mark executable.")
        ] = [],  # noqa: B006 - the SDK reads the default; it is never mutated
        tenant: TenantArg = None,
    ) -> dict[str, Any]:
        data = pack(files, manifest, executable, max_bytes=MAX_BYTES, max_files=MAX_FILES)
        client, tenant_of = call(ctx)
        with client:
            doc = client.submit_artifact(tenant_of(tenant), data)
        return {
            "digest": doc.get("digest"), "name": doc.get("name"),
            "capabilities": (doc.get("manifest") or {}).get("capabilities"),
            "capabilities_hash": doc.get("capabilities_hash"),
            "file_count": doc.get("file_count"), "size": doc.get("size"),
            "warnings": doc.get("warnings", []),
            "next": "run_in_sandbox with this digest; identical content gives the same digest",
        }  # fmt: skip

    server.add_tool(
        submit_artifact,
        annotations=_ADD,
        description=(
            "Submit your code and its manifest as an artifact; returns its digest (the id "
            "approvals and deployments name). Refused: paths that are absolute, hold '.' "
            "or '..' or a backslash (no path may leave the artifact; no links are made), "
            f"more than {MAX_FILES} files or {MAX_BYTES >> 20} MiB, and a manifest with any "
            "mistake (the message names the key: read describe_manifest_format). "
            "'warnings' are what a production deployment would refuse today. Next: "
            "run_in_sandbox."
        ),
    )


def _add_run_tools(server: MCPServer, call: Call, guarded: Guard[Any]) -> None:
    @guarded
    def run_in_sandbox(
        ctx: Context,
        digest: DigestArg,
        name: Annotated[
            str,
            Field(
                description="A deployment name for the sandbox: a lowercase letter, then "
                "up to 62 of a-z 0-9 -. Reuse it for the next version of the same code."
            ),
        ],
        instruction: Annotated[
            str | None,
            Field(
                description="Why this runs, in a sentence (recorded as the deployment's "
                "instruction)."
            ),
        ] = None,
        tenant: TenantArg = None,
    ) -> dict[str, Any]:
        _check(digest, _DIGEST_RE, "the digest")
        _check(name, _DEPLOYMENT_RE, "the deployment name")
        said = _text(instruction or "a trial run in the sandbox by a coding agent", "instruction")
        client, tenant_of = call(ctx)
        out: list[str] = []
        err: list[str] = []
        with client:
            t = tenant_of(tenant)
            client.deploy(t, digest, name, instruction=said, environment="sandbox")
            run = client.run(t, name, on_stdout=out.append, on_stderr=err.append)
        return _run_answer(run, out, err)

    server.add_tool(
        run_in_sandbox,
        annotations=_RUN,
        description=(
            "Deploy an artifact (by digest) to the SANDBOX environment under a name and run "
            "it once, waiting for the end; returns the run id, status, exit code and the "
            "end of its output. The sandbox reads synthetic twins of the datasets and test "
            "twins of the secrets, never real data; it needs no approval. A call the "
            "manifest does not allow is refused and recorded: then read show_run, fix the "
            "code or the manifest, submit again and run again. Only job artifacts run here."
        ),
    )

    @guarded
    def run_deployment(
        ctx: Context,
        name: Annotated[str, Field(description="The deployment's name.")],
        tenant: TenantArg = None,
    ) -> dict[str, Any]:
        _check(name, _DEPLOYMENT_RE, "the deployment name")
        client, tenant_of = call(ctx)
        out: list[str] = []
        err: list[str] = []
        with client:
            run = client.run(tenant_of(tenant), name, on_stdout=out.append, on_stderr=err.append)
        return _run_answer(run, out, err)

    server.add_tool(
        run_deployment,
        annotations=_RUN,
        description=(
            "Start one run of an existing job deployment and wait for its end: one that "
            "run_in_sandbox made, or a production deployment a person made after your "
            "artifact was approved (you cannot deploy to production yourself: a person "
            "gives that instruction). Returns the run id, status, exit code and the end of "
            "its output; show_run gives the rest."
        ),
    )

    @guarded
    def show_run(ctx: Context, run_id: RunArg, tenant: TenantArg = None) -> dict[str, Any]:
        _check(run_id, _RUN_RE, "the run id")
        client, tenant_of = call(ctx)
        with client:
            t = tenant_of(tenant)
            run = client.get_run(t, run_id)
            rid = str(run.get("id") or run_id)
            stdout = b"".join(client.run_logs(t, rid, stream="stdout"))
            stderr = b"".join(client.run_logs(t, rid, stream="stderr"))
            answer: dict[str, Any] = {
                "run_id": rid, "deployment": run.get("deployment"),
                "environment": run.get("environment"), "digest": run.get("digest"),
                "status": run.get("status"), "exit_code": run.get("exit_code"),
                "reason": run.get("reason"), "started_at": run.get("started_at"),
                "ended_at": run.get("ended_at"),
                "stdout_tail": _tail(stdout), "stderr_tail": _tail(stderr),
            }  # fmt: skip
            try:
                # The newest calls, and the refusals from the first: each its own read,
                # so a long run's refusals are not lost behind its allowed calls.
                newest = client.events(t, run=rid, limit=MAX_CALLS + 2, newest=True)
                denied = client.events(t, run=rid, decision="deny", limit=MAX_CALLS)
            except ControlDenied as exc:
                answer["calls"] = []
                answer["refusals"] = []
                answer["calls_note"] = one_line(exc)
                return answer
        # A run's calls are its workload's events (the run's start and end are its
        # starter's and the runtime's): told apart by who acted, not by action names.
        docs = [json.loads(line) for line in newest]
        calls = sorted((_event_row(d) for d in docs
                        if (d.get("actor") or {}).get("type") == "workload"),
                       key=lambda c: int(c.get("seq", 0)))  # fmt: skip
        answer["calls"] = calls[-MAX_CALLS:]
        answer["refusals"] = [_event_row(json.loads(line)) for line in denied]
        if len(newest) > MAX_CALLS:
            answer["calls_note"] = f"the newest {MAX_CALLS} calls are listed"
        return answer

    server.add_tool(
        show_run,
        annotations=_READ,
        description=(
            "One of your runs: status, exit code, the end of stdout and stderr, every call "
            "it made at the broker (seq, action, resource, decision) and each refusal with "
            "its ledger seq and the reason, which names what the manifest lacked. Fix the "
            "manifest or the code from the reasons; never widen it beyond what the code "
            "needs. Runs of other principals' deployments may show no calls (you may read "
            "only your own runs' events)."
        ),
    )


def _add_approval_tools(server: MCPServer, call: Call, guarded: Guard[Any]) -> None:
    @guarded
    def suggest_manifest(ctx: Context, run_id: RunArg, tenant: TenantArg = None) -> Json:
        _check(run_id, _RUN_RE, "the run id")
        client, tenant_of = call(ctx)
        with client:
            doc = client.suggest_manifest(tenant_of(tenant), run_id)
        keep = ("run", "digest", "environment", "status", "partial", "manifest", "diff", "lines",
                "not_suggestable", "notes")  # fmt: skip
        return {k: doc.get(k) for k in keep}

    server.add_tool(
        suggest_manifest,
        annotations=_READ,
        description=(
            "From one run's recorded calls and refusals (a sandbox run, usually), the "
            "least-privilege manifest that would have allowed exactly them: the tables and "
            "columns read, hosts called, buckets and modes, secrets. Returns the suggested "
            "proctor.toml, a diff against the run's manifest, each line's reason and the "
            "ledger seq of the event that needed it, and the refusals no manifest line can "
            "lift (why). Nothing is widened beyond a recorded call. Check the diff, then "
            "submit_artifact with the suggested manifest and run_in_sandbox again."
        ),
    )

    @guarded
    def request_approval(
        ctx: Context,
        digest: DigestArg,
        comment: Annotated[
            str,
            Field(
                description="For the approvers: what the code does, what to look at, and "
                "the sandbox run that shows it works (at most 2000 characters)."
            ),
        ] = "",
        tenant: TenantArg = None,
    ) -> Json:
        _check(digest, _DIGEST_RE, "the digest")
        if len(comment) > _COMMENT_MAX:
            raise UsageError(
                f"the comment is longer than {_COMMENT_MAX} characters: say it shorter"
            )
        client, tenant_of = call(ctx)
        with client:
            doc = client.request_approval(tenant_of(tenant), digest, comment)
        return {
            **doc,
            "next": "a person approves (you cannot); approval_state shows where it "
            "stands, and after a person deploys it to production, run_deployment runs it",
        }

    server.add_tool(
        request_approval,
        annotations=_ASK,
        description=(
            "Ask your tenant's approvers to approve an artifact (by digest) for production, "
            "with a comment for them. It approves nothing: a person who is not its author "
            "approves, and a person deploys it to production; you can neither approve nor "
            "deploy to production (the role policy forbids agents both, and refuses and "
            "records every attempt). Recorded as an approval.request event. Next: "
            "approval_state."
        ),
    )

    @guarded
    def approval_state(ctx: Context, digest: DigestArg, tenant: TenantArg = None) -> Json:
        _check(digest, _DIGEST_RE, "the digest")
        client, tenant_of = call(ctx)
        with client:
            doc: Json = client.approval_state(tenant_of(tenant), digest)
        return doc

    server.add_tool(
        approval_state,
        annotations=_READ,
        description=(
            "Where an artifact's approval stands: who asked and when, the approvals and "
            "rejections in force and by whom, which of them count, the quorum your tenant "
            "needs, and whether production would run it now (and if not, why). An approval "
            "covers exactly this digest: a changed byte is a new digest to approve."
        ),
    )


def _add_ask_tools(server: MCPServer, call: Call, guarded: Guard[Any]) -> None:
    @guarded
    def asked_calls(
        ctx: Context,
        run_id: Annotated[str | None, Field(description="Only this run's asked calls.")] = None,
        state: Annotated[
            str | None,
            Field(
                description="Only those in this state: pending, approved, denied, "
                "timed_out or abandoned."
            ),
        ] = None,
        tenant: TenantArg = None,
    ) -> dict[str, Any]:
        _check(run_id, _RUN_RE, "the run id")
        if state is not None and state not in _ASK_STATES:
            raise UsageError(
                f"the state must be one of {', '.join(_ASK_STATES)}, not {state[:40]!r}"
            )
        client, tenant_of = call(ctx)
        with client:
            asks = client.asked_calls(tenant_of(tenant), run=run_id, state=state)
        return {"asked_calls": asks[:MAX_CALLS], "count": len(asks)}

    server.add_tool(
        asked_calls,
        annotations=_READ,
        description=(
            "The calls your runs made of a capability the manifest marks ask = true (a "
            "write to a production bucket, a host, a table's write access): each waits for "
            "a person, and is listed with its run, the call and its exact arguments (a "
            "digest of a body), its state (pending, approved, denied, timed_out, abandoned) "
            "and the ledger seqs of the ask and its answer. You cannot answer one: an "
            "approver who is not the code's author does; a call not answered in time is "
            "refused. Pending first."
        ),
    )


def _flatten_argument_errors(server: MCPServer) -> None:
    """An argument that fails the tool's schema (pydantic's several-line report) as
    one line: the tool, each field and what was wrong, no echo of the value."""

    async def flatten(ctx: Any, call_next: Any) -> Any:
        result = await call_next(ctx)
        if ctx.method != "tools/call" or not isinstance(result, dict):
            return result
        content = result.get("content")
        if not result.get("isError") or not isinstance(content, list) or not content:
            return result
        first = content[0]
        text = first.get("text") if isinstance(first, dict) else None
        if not isinstance(text, str) or "validation error for" not in text:
            return result
        return {**result, "content": [{"type": "text", "text": flat_validation(text)}]}

    server.middleware.append(flatten)


def flat_validation(text: str) -> str:
    """pydantic's report (a title, then a field line and an indented problem line per
    error) as one line."""
    lines = text.splitlines()
    tool = lines[0].split(":", 1)[0].removeprefix("Error executing tool ").strip()
    problems = []
    for i, line in enumerate(lines[1:], start=1):
        if line and not line.startswith(" ") and i + 1 < len(lines):
            what = lines[i + 1].strip().split(" [type=")[0]
            problems.append(f"{line.strip()}: {what}")
    return f"invalid arguments for {tool}: " + "; ".join(problems or ["see the tool's schema"])
