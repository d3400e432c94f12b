"""`proctor doctor`: the readiness checks of a home, each failure with its fix."""

from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    """Add the commands to ``app``."""
