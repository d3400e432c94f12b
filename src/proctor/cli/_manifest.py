"""`proctor manifest suggest`: the least-privilege manifest a sandbox run called for."""

from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    """Add the commands to ``app``."""
