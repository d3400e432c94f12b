"""The whoami call: a run may always ask who it is (``GET /v1/whoami``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from proctor.broker._calls import Acted, Call, Ruling, register
from proctor.broker._scope import WHOAMI_RULE
from proctor.ledger import Action
from proctor.policy import Decision


@dataclass(frozen=True)
class Whoami:
    name: str = "whoami"
    method: str = "GET"
    path: str = "/v1/whoami"
    records_first: bool = False

    async def parse(self, call: Call) -> None:
        return None

    async def decide(self, call: Call, request: None) -> Ruling:
        scope = call.scope
        # No Cedar question: the broker's own rule permits it, and names itself.
        allowed = Decision(True, (WHOAMI_RULE,), scope.policies.version)
        return Ruling(Action.BROKER_WHOAMI, f"run/{scope.run_id}", allowed,
                      "the run's own identity", {})  # fmt: skip

    async def done(self, call: Call, request: object) -> None:
        return None

    async def act(self, call: Call, request: None, ruling: Ruling | None) -> Acted:
        scope = call.scope
        identity: dict[str, Any] = {
            "tenant": scope.tenant,
            "run": scope.run_id,
            "workload": scope.workload,
            "deployment": scope.deployment,
            "artifact": scope.artifact,
            "environment": scope.environment,
        }
        return Acted(answer=identity)


WHOAMI = register(Whoami())
