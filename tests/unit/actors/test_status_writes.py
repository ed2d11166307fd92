"""The status view's writer (``actors.status.StatusPublisher``): how many Redis writes a burst of state
changes costs. A turn is several durable batches a few milliseconds apart; the view must not cost a round
trip per change. Judged by what the fake client and sink were asked to write, on a fake clock."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Any

from actors.status import StatusPublisher
from runtime.clock import FakeClock
from runtime.events import StateChanged
from runtime.fold import fold
from runtime.states import TrajectoryState

from ..trajectory.sim import created, policy

S = TrajectoryState


class Client:
    def __init__(self) -> None:
        self.writes: list[dict[str, Any]] = []

    async def hset(self, key: str, mapping: Mapping[str, Any]) -> int:
        self.writes.append(dict(mapping))
        return 1


class Sink:
    def __init__(self) -> None:
        self.round_trips: list[list[str]] = []

    async def publish(self, trajectory_id: str, kind: str, at: float, data: Mapping[str, Any]) -> None:
        self.round_trips.append([data["to"]])

    async def publish_many(
        self, trajectory_id: str, kind: str, items: Sequence[tuple[float, Mapping[str, Any]]]
    ) -> None:
        if items:
            self.round_trips.append([data["to"] for _, data in items])

    async def close(self) -> None:
        return None


async def _settle() -> None:
    for _ in range(20):
        await asyncio.sleep(0)


async def test_a_burst_of_state_changes_is_two_writes_and_every_change_is_published_in_order() -> None:
    # Given a status view over a trajectory's record
    clock = FakeClock()
    client, sink = Client(), Sink()
    status = StatusPublisher(client, sink, "t1", clock, min_interval_s=0.05)  # type: ignore[arg-type]
    record = fold([created(clock)], policy())
    moves = [
        StateChanged(S.READY, S.CALLING_MODEL, "admitted"),
        StateChanged(S.CALLING_MODEL, S.WAITING_TOOL, "tool call"),
        StateChanged(S.WAITING_TOOL, S.READY, "settled"),
        StateChanged(S.READY, S.CALLING_MODEL, "admitted"),
    ]
    # When the first change comes to an idle view, and three more within the interval
    status.on_event(record, moves[0])
    await _settle()
    for move in moves[1:]:
        status.on_event(record, move)
        await _settle()
    # Then the first was written at once and the rest wait for the interval ...
    assert len(client.writes) == 1 and sink.round_trips == [["CALLING_MODEL"]]
    clock.advance(0.05)
    await _settle()
    # ... and go out as one snapshot and one batch of live events, in order
    assert len(client.writes) == 2
    assert sink.round_trips == [["CALLING_MODEL"], ["WAITING_TOOL", "READY", "CALLING_MODEL"]]
    await status.flush(timeout_s=1.0)
    await status.close()
