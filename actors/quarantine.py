"""The quarantine at the dispatch boundary (recovery chapter §12.8.2, issue 12).

"Quarantine policies must intervene at every interface where held artifacts could influence subsequent
decisions." An artifact an incident quarantined (a note, an environment, any id a member trajectory's tool
results carried) is refused as input to every trajectory until it is released: ``QuarantineGate`` wraps a
trajectory's ``ToolPort`` and, before anything is sent, looks every string its call's arguments carry up in
the quarantine. A hit is a local refusal (``ArtifactQuarantined``, a ``PolicyRefusal``): nothing is sent,
the operation is known absent, and the model is told which artifact and which incident.

Fail-safe default (Saltzer and Schroeder): when the quarantine cannot be consulted, the call is refused too.

Registered cleanup is not refused (§12.8.3): releasing an environment an incident quarantined is exactly the
residual settlement containment wants, run under the cleanup grant, not by the model's choice.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Protocol

from runtime._decide_cleanup import is_cleanup
from runtime.errors import PolicyRefusal
from runtime.ports import ProbeResult, ToolInvocation, ToolOutcome, ToolPort

__all__ = ["ArtifactQuarantined", "QuarantineGate", "QuarantineLookup", "argument_strings"]


class QuarantineLookup(Protocol):
    async def quarantined(self, values: Sequence[str]) -> dict[str, str]: ...


class ArtifactQuarantined(PolicyRefusal):
    """A call named a quarantined artifact (or the quarantine could not be consulted): not sent."""

    def __init__(self, tool: str, hits: Mapping[str, str], detail: str = "") -> None:
        self.tool = tool
        self.hits = dict(hits)
        named = ", ".join(f"{a} (incident {i})" for a, i in sorted(hits.items()))
        super().__init__(detail or f"QUARANTINED: {tool} names quarantined artifact(s) {named}; not sent")


def argument_strings(value: Any) -> Iterable[str]:
    """Every string in a call's arguments, at any depth (an artifact id may be nested)."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, Mapping):
        for v in value.values():
            yield from argument_strings(v)
    elif isinstance(value, list | tuple):
        for v in value:
            yield from argument_strings(v)


class QuarantineGate:
    """A ``ToolPort`` that refuses, before sending, any call naming a quarantined artifact."""

    def __init__(self, inner: ToolPort, lookup: QuarantineLookup) -> None:
        self._inner = inner
        self._lookup = lookup

    async def invoke(self, invocation: ToolInvocation) -> ToolOutcome:
        if is_cleanup(invocation.call_id):
            return await self._inner.invoke(invocation)  # registered cleanup settles residuals; never held
        values = [v for v in argument_strings(invocation.arguments) if len(v) <= 200]
        try:
            hits = await self._lookup.quarantined(values) if values else {}
        except Exception as e:  # fail closed: an unknown disposition is not a clean one
            raise ArtifactQuarantined(
                invocation.tool, {}, f"the quarantine could not be consulted ({type(e).__name__}); not sent"
            ) from e
        if hits:
            raise ArtifactQuarantined(invocation.tool, hits)
        return await self._inner.invoke(invocation)

    async def probe(self, tool: str, effect_key: str, deadline: float) -> ProbeResult:
        return await self._inner.probe(tool, effect_key, deadline)

    async def cancel(self, tool: str, effect_key: str) -> None:
        await self._inner.cancel(tool, effect_key)
