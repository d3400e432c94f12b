"""The one exception root of Proctor.

Every error a user can see derives from :class:`ProctorError`. Its message is
written for people; the CLI prints it without a traceback and exits non-zero.
Errors from libraries underneath are translated at each component's boundary
(``raise LedgerError(...) from exc``).
"""

from __future__ import annotations


class ProctorError(Exception):
    """Root of every error Proctor raises on purpose."""

    #: Process exit code the CLI uses for this kind of error.
    exit_code: int = 1

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def diagnostics(self) -> str:
        """Text for a person: what went wrong and, where known, what to do."""
        if self.hint:
            return f"{self.message}\nhint: {self.hint}"
        return self.message


class UsageError(ProctorError):
    """Bad input from the user: a malformed argument, an unknown name."""

    exit_code = 2


class NotFound(UsageError):
    """A named thing (tenant, index, artifact) does not exist."""


class AlreadyExists(UsageError):
    """A thing with this name exists already."""


class NotInitialized(ProctorError):
    """The Proctor home has not been initialised."""


class StoreError(ProctorError):
    """The store cannot be read or written (corrupt, locked, disk full)."""


class LedgerError(ProctorError):
    """The ledger cannot record or serve an event. Callers must refuse the call."""


class VerificationFailed(ProctorError):
    """A log, proof, checkpoint or signature does not verify."""

    exit_code = 3


class SandboxError(ProctorError):
    """A sandbox could not be created, run or cleaned up."""


class PolicyError(ProctorError):
    """A policy is invalid or cannot be evaluated."""
