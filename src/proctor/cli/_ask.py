"""`proctor ask list/show/approve/deny`: single calls a run waits on a person for."""

from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    """Add the commands to ``app``."""
