"""Runs: sandboxes whose only way out is the broker, the supervisor that starts
them and keeps services up, and the answer to "what ran here at time T?"."""

from proctor.errors import RunRefused
from proctor.governance import RunRecord, Runs
from proctor.lifecycle._brokered import GUEST_SOCKET, brokered_spec, run_brokered
from proctor.lifecycle._history import what_ran
from proctor.lifecycle._serve import Server
from proctor.lifecycle._supervisor import Interrupt, Supervisor
from proctor.lifecycle._throwaway import Throwaway

__all__ = [
    "GUEST_SOCKET",
    "Interrupt",
    "RunRecord",
    "RunRefused",
    "Runs",
    "Server",
    "Supervisor",
    "Throwaway",
    "brokered_spec",
    "run_brokered",
    "what_ran",
]
