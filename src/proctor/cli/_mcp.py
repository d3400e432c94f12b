"""`proctor mcp`: the MCP server over stdio, for a coding agent on this machine."""

from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    """Add the commands to ``app``."""
