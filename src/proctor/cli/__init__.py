"""The ``proctor`` command: a thin layer over the library."""

from __future__ import annotations

import sys

from rich.console import Console
from rich.markup import escape

from proctor.errors import ProctorError


def main() -> None:
    from proctor.cli._app import app

    try:
        app()
    except ProctorError as exc:
        err = Console(stderr=True, highlight=False, soft_wrap=True)
        # Messages quote user input and TOML keys ("[artifact]"): never markup.
        err.print(f"[bold red]error:[/] {escape(exc.message)}", markup=True)
        if exc.hint:
            err.print(f"[dim]hint:[/] {escape(exc.hint)}", markup=True)
        sys.exit(exc.exit_code)


__all__ = ["main"]
