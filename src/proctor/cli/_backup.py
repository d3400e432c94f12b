"""`proctor backup`, `proctor backup verify` and `proctor restore`: a home copied
consistently while it runs, checked offline, and made a working home again."""

from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    """Add the commands to ``app``."""
