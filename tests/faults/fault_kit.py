"""What the fault tests through the product share (not a test module): launching real trajectory actors on the
shared local Ray against the simulated provider and the in-process gRPC testbed, and reading the judges.

The judges, in the order a test consults them:

- the testbed's deliveries and effects (``LedgerSnapshot``, read over gRPC): what the runtime sent, how
  often, and what the services applied;
- the simulated provider's own counters (tokens billed per trajectory);
- the durable log, folded (what the runtime recorded: intents, settlements, who owns what is in doubt),
  which names what the ledger must contain and is never the proof that an effect did or did not happen.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from actors.trajectory import ensure_actor
from cluster.adapters import ClusterAdapters
from runtime.events import (
    CleanupDispatched,
    Event,
    ModelCallIntent,
    ModelCallSettled,
    ObservationAppended,
    ToolDispatchIntent,
    ToolResultAccepted,
)
from runtime.fold import fold
from runtime.record import TrajectoryRecord
from testbed.provider import ProviderThread
from testbed.tools import LedgerSnapshot, Testbed, TestbedClient
from tests.faults.mutations import MutatedAdapters
from tests.integration.trajectory_kit import events_of, make_launch, record_of

__all__ = [
    "Run",
    "announced",
    "book",
    "dispatched",
    "finish",
    "handed_off",
    "launch",
    "results",
    "unique",
    "until_delivered",
    "until_logged",
]


def unique(name: str) -> str:
    """A trajectory id no other test on the shared Ray uses."""
    return f"{name}-{uuid.uuid4().hex[:8]}"


def launch(
    name: str,
    provider: ProviderThread,
    testbed: Testbed,
    redis_url: str,
    *,
    scenario: str,
    grants: Iterable[str],
    mutation: str | None = None,
    actor_redis_url: str | None = None,
    **overrides: Any,
) -> Any:
    """Start the actor of a new trajectory (``mutation``: a control, see ``tests.faults.mutations``;
    ``actor_redis_url``: where the actor reaches Redis, when not where the test does)."""
    routes = {tool: testbed.address for tool in testbed.server.tools}
    spec = make_launch(
        name,
        base_url=provider.base_url,
        redis_url=redis_url,
        scenario=scenario,
        grants=grants,
        tool_routes=overrides.pop("tool_routes", routes),
        **overrides,
    )
    if actor_redis_url is not None:
        spec = spec.model_copy(update={"redis_url": actor_redis_url})
    adapters = ClusterAdapters() if mutation is None else MutatedAdapters(mutation=mutation)
    return ensure_actor(spec, adapters)


async def finish(handle: Any, timeout_s: float = 120.0) -> dict[str, Any]:
    """Run the trajectory to its end (or hibernation); the bound only turns a hang into a failure."""

    async def run() -> dict[str, Any]:
        summary: dict[str, Any] = await handle.run.remote()
        return summary

    return await asyncio.wait_for(run(), timeout_s)


async def book(testbed: Testbed) -> LedgerSnapshot:
    """The testbed's ledger, read over gRPC like any outside observer."""
    async with TestbedClient(testbed.address) as client:
        return await client.ledger()


async def until_logged(
    redis_url: str, trajectory_id: str, found: Callable[[list[Event]], bool], timeout_s: float = 120.0
) -> list[Event]:
    """Poll the durable log until ``found(events)``: used to time a fault, never to judge."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        events = await events_of(redis_url, trajectory_id)
        if found(events):
            return events
        await asyncio.sleep(0.02)
    raise AssertionError(f"{trajectory_id}: the awaited entry never appeared within {timeout_s}s")


async def until_delivered(testbed: Testbed, effect_key: str, timeout_s: float = 60.0) -> None:
    """Poll the testbed until a request carrying ``effect_key`` has reached it (the call is then in flight
    at the endpoint, not merely announced): used to time a fault, never to judge."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if (await book(testbed)).deliveries_for(effect_key):
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"no request for {effect_key} reached the testbed within {timeout_s}s")


def dispatched(events: Iterable[Event], tool: str | None = None) -> list[ToolDispatchIntent]:
    """Forward calls announced (intents); the runtime's cleanup is in ``announced``."""
    return [e for e in events if isinstance(e, ToolDispatchIntent) and (tool is None or e.tool == tool)]


def announced(
    events: Iterable[Event], tool: str | None = None
) -> list[ToolDispatchIntent | CleanupDispatched]:
    """Every attempt the log announced before sending it: forward calls (``ToolDispatchIntent``) and the
    runtime's own compensations in FINALIZING (``CleanupDispatched``: call id ``cleanup:obl-...``, operation
    ``cop-obl-...``). Both name the tool, effect key, operation, attempt and deadline a delivery carries."""
    return [
        e
        for e in events
        if isinstance(e, ToolDispatchIntent | CleanupDispatched) and (tool is None or e.tool == tool)
    ]


def handed_off(record: TrajectoryRecord, operation_id: str) -> bool:
    """An operation still unknown when its trajectory ended: in doubt, owned by the escalation owner the
    handoff packet is addressed to (``Policy.escalation_owner``), and listed among the packet's unknown
    operations with what to decide (the decider's ``finish_cleanup``)."""
    operation = record.operations[operation_id]
    packet: Any = record.handoff
    if packet is None:
        return False
    unknown = [u for u in packet["pending"]["unknown_operations"] if u["operation_id"] == operation_id]
    return operation.in_doubt and operation.owner == packet["owner"] and len(unknown) == 1


def results(events: Iterable[Event]) -> list[ToolResultAccepted]:
    return [e for e in events if isinstance(e, ToolResultAccepted)]


def in_model_call(nth: int) -> Callable[[list[Event]], bool]:
    """The ``nth`` model call is announced and not yet answered."""

    def check(events: list[Event]) -> bool:
        intents = [i for i, e in enumerate(events) if isinstance(e, ModelCallIntent)]
        return len(intents) >= nth and not any(
            isinstance(e, ModelCallSettled) for e in events[intents[nth - 1] :]
        )

    return check


def in_tool_call(tool: str, nth: int = 1) -> Callable[[list[Event]], bool]:
    """The ``nth`` dispatch of ``tool`` is announced and not yet answered."""

    def check(events: list[Event]) -> bool:
        intents = [i for i, e in enumerate(events) if isinstance(e, ToolDispatchIntent) and e.tool == tool]
        if len(intents) < nth:
            return False
        call = events[intents[nth - 1]]
        assert isinstance(call, ToolDispatchIntent)
        return not any(
            isinstance(e, ToolResultAccepted | ObservationAppended)
            and getattr(e, "call_id", None) == call.call_id
            for e in events[intents[nth - 1] :]
        )

    return check


@dataclass(frozen=True)
class Run:
    """One trajectory's end, as the judges see it."""

    summary: dict[str, Any]
    events: list[Event]  # after the record snapshot, if the trajectory hibernated (and compacted its log)
    book: LedgerSnapshot
    folded: TrajectoryRecord | None = None  # the record of the whole log, snapshot or not

    @property
    def record(self) -> TrajectoryRecord:
        return self.folded if self.folded is not None else fold(self.events)

    def keys(self, tool: str) -> set[str]:
        """Effect keys the log says were dispatched for ``tool``."""
        return {e.effect_key for e in dispatched(self.events, tool)}


async def ended(
    handle: Any, trajectory_id: str, redis_url: str, testbed: Testbed, timeout_s: float = 120.0
) -> Run:
    summary = await finish(handle, timeout_s)
    events = await events_of(redis_url, trajectory_id)
    return Run(summary, events, await book(testbed), await record_of(redis_url, trajectory_id))
