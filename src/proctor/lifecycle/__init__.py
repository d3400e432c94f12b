"""Runs: sandboxes whose only way out is the broker, the supervisor that starts
them and keeps services up, and the answer to "what ran here at time T?"."""

from proctor.errors import RunRefused
from proctor.governance import RunRecord, Runs
from proctor.lifecycle._brokered import GUEST_SOCKET, brokered_spec, run_brokered
from proctor.lifecycle._health import CHECKS, DOCTOR_HINT, Check, Health, Readiness
from proctor.lifecycle._history import effective_policy, what_ran
from proctor.lifecycle._jsonlog import REQUEST, JsonFormatter, log_event, log_json, scrub
from proctor.lifecycle._nodes import Node, NodeInfo, NodeLost, nodes
from proctor.lifecycle._receipt import run_receipt
from proctor.lifecycle._serve import Server
from proctor.lifecycle._supervisor import Interrupt, Supervisor
from proctor.lifecycle._throwaway import Throwaway

__all__ = [
    "CHECKS",
    "DOCTOR_HINT",
    "GUEST_SOCKET",
    "REQUEST",
    "Check",
    "Health",
    "Interrupt",
    "JsonFormatter",
    "Node",
    "NodeInfo",
    "NodeLost",
    "Readiness",
    "RunRecord",
    "RunRefused",
    "Runs",
    "Server",
    "Supervisor",
    "Throwaway",
    "brokered_spec",
    "effective_policy",
    "log_event",
    "log_json",
    "nodes",
    "run_brokered",
    "run_receipt",
    "scrub",
    "what_ran",
]
