"""Throwaway sandbox runs, for the build loop (``proctor sandbox run``).

Not governed (synthetic data, no broker), but still recorded, in the ``sandbox``
tenant's log: a start event before anything runs (if the ledger cannot take it,
nothing runs) and an end event with the result.
"""

from __future__ import annotations

import hashlib
from contextlib import suppress
from pathlib import Path
from typing import Any

from proctor.errors import AlreadyExists
from proctor.governance import Home
from proctor.ledger import Action, EventDraft
from proctor.lifecycle._supervisor import Interrupt
from proctor.sandbox import Reason, SandboxDriver, SandboxResult, SandboxSpec, Sink

SANDBOX_TENANT = "sandbox"


def code_digest(root: Path) -> str:
    """SHA-256 over the sorted relative paths and contents of a directory's files."""
    h = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.is_file() and not p.is_symlink()):
        rel = path.relative_to(root).as_posix().encode()
        h.update(len(rel).to_bytes(4, "big") + rel)
        data = path.read_bytes()
        h.update(len(data).to_bytes(8, "big") + data)
    return "sha256:" + h.hexdigest()


class Throwaway:
    """One throwaway run: ``start`` records its start, ``run`` runs it and records its end.

    Two steps, so that a caller can stop between them (a signal that came before
    the sandbox did) with the start on record and nothing run.
    """

    def __init__(self, rt: Home, driver: SandboxDriver, spec: SandboxSpec, start_seq: int,
                 common: dict[str, Any]) -> None:  # fmt: skip
        self._rt = rt
        self._driver = driver
        self._spec = spec
        self._start_seq = start_seq
        self._common = common

    @classmethod
    def start(
        cls, rt: Home, driver: SandboxDriver, spec: SandboxSpec, code: Path | None
    ) -> Throwaway:
        """Record the start of running ``spec`` (``code`` is its code directory, for the
        digest); raises if the ledger cannot take it, and then nothing runs."""
        _ensure_tenant(rt)
        limits = spec.limits
        common = {
            "backend": driver.name,
            "program": spec.argv[0],
            # The digest, not the arguments: they may hold things that must not be logged.
            "argv_sha256": hashlib.sha256("\0".join(spec.argv).encode()).hexdigest(),
            "code": code_digest(code) if code else None,
            "limits": {
                "memory_bytes": limits.memory_bytes,
                "pids": limits.pids,
                "cpu": str(limits.cpu),
                "wall_seconds": str(limits.wall_seconds),
                "output_bytes": limits.output_bytes,
                "scratch_bytes": spec.scratch_bytes,
            },
        }
        start = rt.ledger.append(
            SANDBOX_TENANT,
            EventDraft(
                rt.operator,
                Action.SANDBOX_RUN,
                "sandbox/ephemeral",
                reason="started",
                details={"phase": "start", **common},
            ),
        )
        return cls(rt, driver, spec, start.seq, common)

    def run(self, on_stdout: Sink, on_stderr: Sink, stop: Interrupt) -> SandboxResult:
        """Run it to its end (``stop`` ends it early, its signal then named as the
        reason) and record the end with the result."""
        result = self._driver.run(self._spec, on_stdout=on_stdout, on_stderr=on_stderr, cancel=stop)
        interrupted = result.reason is Reason.STOPPED and stop.reason is not None
        self._rt.ledger.append(
            SANDBOX_TENANT,
            EventDraft(
                self._rt.operator,
                Action.SANDBOX_RUN,
                f"sandbox/{result.run_id}",
                reason=f"interrupted: {stop.reason}" if interrupted else result.reason.value,
                run=result.run_id,
                details={
                    "phase": "end",
                    **self._common,
                    "start_seq": self._start_seq,
                    "platform": result.platform,
                    "exit_code": result.exit_code,
                    "duration_ms": round(result.duration_seconds * 1000),
                    "setup_ms": round(result.setup_seconds * 1000),
                    "stdout_bytes": result.stdout_bytes,
                    "stderr_bytes": result.stderr_bytes,
                    "dropped_bytes": result.stdout_dropped + result.stderr_dropped,
                    "memory_peak_bytes": result.memory_peak_bytes,
                },
            ),
        )
        return result


def _ensure_tenant(rt: Home) -> None:
    if rt.tenants.find(SANDBOX_TENANT) is None:
        # Another process may make it meanwhile; either way it then exists.
        with suppress(AlreadyExists):
            rt.tenants.create(SANDBOX_TENANT, rt.operator)
