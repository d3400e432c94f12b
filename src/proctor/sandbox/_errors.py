"""Errors of the sandbox component, all below :class:`proctor.errors.SandboxError`."""

from __future__ import annotations

from proctor.errors import SandboxError, UsageError


class SandboxSpecInvalid(UsageError, SandboxError):
    """The spec asks for something a sandbox cannot be built from (bad path, bad limit)."""


class SandboxUnavailable(SandboxError):
    """The backend cannot work on this machine (tool missing, kernel feature absent)."""


class SandboxStartFailed(SandboxError):
    """The isolation tool refused to start the sandbox; its own message is attached."""


class SandboxCleanupFailed(SandboxError):
    """Something the run created (process, cgroup, state directory) could not be removed."""
