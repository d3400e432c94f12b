"""The ``proctor`` command: a thin layer over the library."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path

from rich.console import Console
from rich.markup import escape

from proctor.errors import ProctorError

#: What a corrupted or half-written home raises from below the library's own checks.
_CORRUPTION = ("sqlite3.DatabaseError", "sqlite3.OperationalError", "tomllib.TOMLDecodeError",
               "UnicodeDecodeError", "json.decoder.JSONDecodeError")  # fmt: skip


def _print_error(message: str, hint: str | None) -> None:
    err = Console(stderr=True, highlight=False, soft_wrap=True)
    # Messages quote user input and TOML keys ("[artifact]"): never markup.
    err.print(f"[bold red]error:[/] {escape(message)}", markup=True)
    if hint:
        err.print(f"[dim]hint:[/] {escape(hint)}", markup=True)


def _outside_home(exc: Exception) -> Path | None:
    """The file an OSError is about, when it lies outside every Proctor home this
    process opened or would open: then the file is the matter, not the home."""
    name = exc.filename if isinstance(exc, OSError) else None
    if not isinstance(name, (str, bytes)):
        return None
    from proctor.cli._common import OPENED
    from proctor.runtime import default_home

    path = Path(os.path.abspath(os.fsdecode(name)))
    homes = [Path(os.path.abspath(h)) for h in [*OPENED, default_home()]]
    return None if any(path.is_relative_to(h) for h in homes) else path


def main() -> None:
    from proctor.cli._app import for_command

    guarded(for_command(sys.argv[1:]))


def guarded(entry: Callable[[], object]) -> None:
    """Run the command line: a ProctorError is its message and hint, anything else one
    line and a hint, never a traceback (unless PROCTOR_DEBUG is set). Tests hand in
    the built command to run many commands in one process."""
    try:
        entry()
    except ProctorError as exc:
        _print_error(exc.message, exc.hint)
        sys.exit(exc.exit_code)
    except (SystemExit, KeyboardInterrupt):
        raise
    except Exception as exc:
        # A person gets one line and what to do; the traceback is for whoever debugs it.
        if os.environ.get("PROCTOR_DEBUG"):
            raise
        kind = f"{type(exc).__module__}.{type(exc).__qualname__}"
        name = type(exc).__name__ if type(exc).__module__ == "builtins" else kind
        message = " ".join(str(exc).split()) or "(no message)"
        hint = "re-run with PROCTOR_DEBUG=1 for the traceback"
        path = _outside_home(exc)
        if isinstance(exc, FileNotFoundError) and path is not None:
            # A path given on the command line, most often: name what is missing
            # (`audit verify --from-export /nope` has no directory /nope).
            missing = path
            while missing.parent != missing and not missing.parent.exists():
                missing = missing.parent
            looked = f" (looking for {path})" if missing != path else ""
            _print_error(f"{missing} does not exist{looked}", "check the path")
            sys.exit(1)
        if path is None and (kind in _CORRUPTION or isinstance(exc, (OSError, ValueError))):
            hint = (
                "the Proctor home may be damaged or unreadable (its store, key or config): "
                "restore it from a backup or point --home/PROCTOR_HOME at another; " + hint
            )
        _print_error(f"internal error: {name}: {message}", hint)
        sys.exit(1)


__all__ = ["guarded", "main"]
