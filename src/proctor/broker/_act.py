"""The act stage: the call carried out, by its kind.

Before its record, an act does only what can be held back or undone (bytes
read and held, a write staged beside its target); :func:`settle` then makes
it visible once the event is durable, or removes it if it cannot be. After its
record (a kind whose act cannot be held back: a connection dialed), the act is
done only once the decision is durable.
"""

from __future__ import annotations

import inspect
from typing import Any

from proctor.broker._calls import ACT, Acted, Call, CallKind, Ruling


async def act(call: Call, kind: CallKind, request: Any, ruling: Ruling | None) -> Acted:
    call.passed(ACT)
    return await kind.act(call, request, ruling)


async def settle(acted: Acted, recorded: bool) -> None:
    """Make a held act visible (its event is durable) or take it back (it is not)."""
    step = acted.commit if recorded else acted.discard
    if step is not None:
        result = step()
        if inspect.isawaitable(result):
            await result
