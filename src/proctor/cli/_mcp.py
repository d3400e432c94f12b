"""`proctor mcp`: the MCP server over stdio, for a coding agent on this machine."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Annotated

import typer

from proctor.cli._common import REMOTE, HomeOpt, open_runtime


def register(app: typer.Typer) -> None:
    """Add the commands to ``app``."""

    @app.command("mcp")
    def mcp(
        token: Annotated[
            str | None,
            typer.Option(
                "--token",
                envvar="PROCTOR_TOKEN",
                help="The agent principal's token (PROCTOR_TOKEN): every tool call is made "
                "as that principal, never as the operator",
                show_default=False,
            ),
        ] = None,
        home: HomeOpt = None,
        backend: Annotated[
            str | None,
            typer.Option(help="gvisor or bubblewrap, for runs on the local home"),
        ] = None,
    ) -> None:
        """Serve Proctor's tools to a coding agent over MCP on stdin/stdout (docs/agents.md).

        With --server URL (or PROCTOR_SERVER) the tools call that API; without it they
        call the API over the local home in this process. Either way every call is the
        agent's (its token), decided by the role policy and recorded in the ledger. It
        writes only MCP messages to stdout, and serves until the client closes stdin.
        """
        from proctor.mcp import LocalGateway, serve_stdio

        url = REMOTE["url"]
        if url is not None:
            gateway = LocalGateway(token or "", url=url, verify=REMOTE["ca"] or True)
            _run(lambda: serve_stdio(gateway))
            return
        LocalGateway(token or "", url="-")  # the token's absence is refused before the home opens
        from proctor.api import create_app

        rt = open_runtime(home)
        try:
            api = create_app(rt, backend=backend)
            local = LocalGateway(token or "", app=api)

            async def main() -> None:
                # The API's own lifespan: its worker threads, and at the end its runs
                # stopped and recorded.
                async with api.router.lifespan_context(api):
                    await serve_stdio(local)

            _run(main)
        finally:
            rt.close()


def _run(main: Callable[[], Awaitable[None]]) -> None:
    """Run ``main``; a Proctor error raised inside a task group (the token refused at
    start, say) comes out as itself, so that the CLI prints its one line."""
    import anyio

    try:
        anyio.run(main)
    except BaseExceptionGroup as group:
        inner: BaseException = group
        while isinstance(inner, BaseExceptionGroup) and len(inner.exceptions) == 1:
            inner = inner.exceptions[0]
        if inner is not group:
            raise inner from None
        raise
