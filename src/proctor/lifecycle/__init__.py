"""Runs: starting sandboxes whose only way out is the broker (the supervisor,
schedules and services come with the governance issue)."""

from proctor.lifecycle._brokered import GUEST_SOCKET, brokered_spec, run_brokered

__all__ = ["GUEST_SOCKET", "brokered_spec", "run_brokered"]
