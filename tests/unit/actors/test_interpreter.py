"""The actor's interpreter (``actors.interpreter.Interpreter``) on in-memory ports, in one event loop.

What only the interpreter decides, beyond the pure rules: when effects start relative to the durable
append. A stop (kill) must not wait behind a slow append; every other effect must.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Any

import pytest

from actors.interpreter import Interpreter, InterpreterPorts
from breakers import InProcessGuard
from runtime.clock import FakeClock
from runtime.inputs import ControlReceived
from runtime.memstore import MemoryLogStore
from runtime.ports import (
    CancelToken,
    ModelReply,
    ModelRequest,
    ProbeResult,
    RateLimitInfo,
    SandboxPermit,
    Settlement,
    ToolInvocation,
    ToolOutcome,
    TurnGrant,
    TurnRequest,
)
from runtime.record import ControlAction, TrajectoryRecord
from runtime.states import ExitReason, TrajectoryState

from ..trajectory.sim import call, created, policy

S = TrajectoryState


class GatedLog(MemoryLogStore):
    """A log whose appends wait while ``closed`` (a disk whose fsync stalls)."""

    def __init__(self) -> None:
        super().__init__()
        self.open = asyncio.Event()
        self.open.set()
        self.waiting = 0

    async def append_many(self, trajectory_id: str, payloads: Sequence[bytes]) -> list[str]:
        self.waiting += 1
        try:
            await self.open.wait()
        finally:
            self.waiting -= 1
        return await super().append_many(trajectory_id, payloads)


class OneCallModel:
    async def complete(self, request: ModelRequest, cancel: CancelToken) -> ModelReply:
        return call("run_tests", {"suite": "unit"}, 1)


class HangingTools:
    """Every call hangs until cancelled; probes know nothing."""

    def __init__(self) -> None:
        self.invoked: list[str] = []

    async def invoke(self, invocation: ToolInvocation) -> ToolOutcome:
        self.invoked.append(invocation.tool)
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    async def probe(self, tool: str, effect_key: str, deadline: float) -> ProbeResult:
        return ProbeResult(Settlement.UNKNOWN, None, "no record")

    async def cancel(self, tool: str, effect_key: str) -> None:
        return None


class OpenAdmission:
    async def admit_turn(self, request: TurnRequest) -> TurnGrant:
        return TurnGrant("g", request.estimated_tokens, 1e12)

    async def settle_turn(self, grant_id: str, actual_tokens: int) -> None:
        return None

    async def report_rate_limited(
        self, provider_key: str, retry_after: float | None, remaining: Mapping[str, float]
    ) -> None:
        return None

    async def report_limits(
        self, provider_key: str, info: RateLimitInfo, rate_limited: bool, grant_id: str | None = None
    ) -> None:
        return None

    async def acquire_sandbox(
        self, trajectory_id: str, pool: str, priority_class: str, deadline: float
    ) -> SandboxPermit:
        return SandboxPermit("p", pool, 1e12)

    async def release_sandbox(self, permit_id: str) -> None:
        return None


class KillWatch:
    """Hooks that note when the processes were torn down, relative to the log's gate."""

    def __init__(self, log: GatedLog) -> None:
        self.log = log
        self.kills_while_append_waited: list[bool] = []

    def on_event(self, record: TrajectoryRecord, event: Any) -> None:
        return None

    async def on_kill(self, record: TrajectoryRecord) -> None:
        self.kills_while_append_waited.append(self.log.waiting > 0)


async def _until(predicate: Any, what: str, steps: int = 2000) -> None:
    for _ in range(steps):
        if predicate():
            return
        await asyncio.sleep(0)
    raise AssertionError(f"never happened: {what}")


async def _waiting_on_a_tool() -> tuple[Interpreter, GatedLog, KillWatch, HangingTools]:
    clock = FakeClock()
    log = GatedLog()
    tools = HangingTools()
    ports = InterpreterPorts(
        model=OneCallModel(), tools=tools, log=log, admission=OpenAdmission(), clock=clock
    )
    hooks = KillWatch(log)
    interp = Interpreter("t1", policy(), ports, hooks)
    await interp.create(created(clock))
    await _until(lambda: tools.invoked and interp.record.state is S.WAITING_TOOL, "the call in flight")
    return interp, log, hooks, tools


def _kill() -> ControlReceived:
    roles = {"alice": frozenset({"operator"})}
    return ControlReceived("k1", ControlAction.KILL, "alice", "runaway", {}, roles)


async def test_a_kill_tears_the_processes_down_while_its_append_is_still_waiting() -> None:
    # Given a trajectory waiting on a tool call, and a log whose next append stalls
    interp, log, hooks, tools = await _waiting_on_a_tool()
    assert tools.invoked == ["run_tests"]
    log.open.clear()
    # When a kill is delivered
    delivery = asyncio.ensure_future(interp.deliver(_kill()))
    await _until(lambda: hooks.kills_while_append_waited, "the processes torn down")
    # Then the processes went while the kill was not yet durable, and the answer waits for the log
    assert hooks.kills_while_append_waited == [True]
    assert not delivery.done()
    log.open.set()
    assert await delivery == "recorded"
    assert interp.record.exit_reason is ExitReason.KILLED or interp.record.state is S.FINALIZING
    await interp.close()


async def test_other_effects_wait_for_the_append() -> None:
    # Given a new trajectory whose first append after creation stalls
    clock = FakeClock()
    log = GatedLog()
    tools = HangingTools()
    ports = InterpreterPorts(
        model=OneCallModel(), tools=tools, log=log, admission=OpenAdmission(), clock=clock
    )
    interp = Interpreter("t1", policy(), ports, KillWatch(log))
    await interp.create(created(clock))
    log.open.clear()
    # When the model's reply is decided (a dispatch follows), nothing reaches the tool before the log
    await _until(lambda: log.waiting > 0, "an append waiting")
    for _ in range(200):
        await asyncio.sleep(0)
    assert tools.invoked == []
    log.open.set()
    await _until(lambda: tools.invoked == ["run_tests"], "the dispatch after the append")
    await interp.close()


class CancelLosingTools(HangingTools):
    """A call that, cancelled, raises the client's own error instead (as redis-py and gRPC clients can)."""

    async def invoke(self, invocation: ToolInvocation) -> ToolOutcome:
        self.invoked.append(invocation.tool)
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            raise ConnectionError("closed while cancelled") from None
        raise AssertionError("unreachable")


class FailingOnce(GatedLog):
    """A log whose next append fails (Redis away for one write)."""

    fail = False

    async def append_many(self, trajectory_id: str, payloads: Sequence[bytes]) -> list[str]:
        if self.fail:
            self.fail = False
            raise ConnectionError("log unreachable")
        return await super().append_many(trajectory_id, payloads)


class Events:
    def __init__(self) -> None:
        self.seen: list[Any] = []

    def on_event(self, record: TrajectoryRecord, event: Any) -> None:
        self.seen.append(event)

    async def on_kill(self, record: TrajectoryRecord) -> None:
        return None


async def test_an_effect_stopped_for_recovery_never_has_its_result_decided() -> None:
    # Given a tool call in flight whose client turns a cancel into its own error
    clock = FakeClock()
    log, tools, hooks = FailingOnce(), CancelLosingTools(), Events()
    ports = InterpreterPorts(
        model=OneCallModel(), tools=tools, log=log, admission=OpenAdmission(), clock=clock
    )
    interp = Interpreter("t1", policy(), ports, hooks)
    await interp.create(created(clock))
    await _until(lambda: tools.invoked and interp.record.state is S.WAITING_TOOL, "the call in flight")
    before = len(hooks.seen)
    # When a write fails and the interpreter recovers from the log (stopping everything in flight)
    log.fail = True
    roles = {"alice": frozenset({"operator"})}
    approve = ControlReceived("a1", ControlAction.APPROVE, "alice", "ok", {"call_digest": "x"}, roles)
    with pytest.raises(ConnectionError):
        await interp.submit(approve)  # nothing of this decision happened: its caller is told so
    await _until(lambda: len(tools.invoked) == 2, "the call dispatched again after the recovery")
    # Then the stopped call's "result" (the client's error) was never decided: no late result was recorded
    after = [type(e).__name__ for e in hooks.seen[before:]]
    assert "ToolCallCancelled" in after and "LateResultDropped" not in after, after
    await interp.close()


async def _recovered(log: MemoryLogStore) -> TrajectoryRecord:
    """The record a new incarnation has after folding ``log`` and deciding ``Recovered``."""
    ports = InterpreterPorts(
        model=OneCallModel(), tools=HangingTools(), log=log, admission=OpenAdmission(), clock=FakeClock()
    )
    woken = Interpreter("t1", policy(), ports)
    record = await woken.recover()
    await woken.close()
    return record


async def test_a_compacted_log_wakes_to_the_record_the_whole_log_gives() -> None:
    # Given a trajectory with a tool call in flight (spend charged, an operation unsettled), and a copy of
    # its whole log
    interp, log, _, _ = await _waiting_on_a_tool()
    whole = MemoryLogStore()
    await whole.append_many("t1", [payload for _, payload in await log.read("t1")])
    before = interp.record
    # When it compacts its log (as a hibernating actor does) and a new incarnation recovers from each log
    assert await interp.compact()
    await interp.close()
    entries = await log.read("t1")
    from_snapshot = await _recovered(log)
    from_whole = await _recovered(whole)
    # Then one snapshot entry is left, it holds the live record, and both incarnations decide the same
    assert len(entries) == 1
    assert from_snapshot == from_whole
    assert from_snapshot.spend == before.spend and from_snapshot.turn_count == before.turn_count
    assert from_snapshot.operations.keys() == before.operations.keys()


# ----------------------------------------------------------------------------- permits of stopped attempts
#
# Judged by the real guard (``breakers.InProcessGuard``): its bulkhead's own count of slots held. Found by
# benchmarks.retry_storm: 100 trajectories in one process, each a call in flight when it ended; 41 slots
# stayed held (the guard's lease is 300 s), the scope's bulkhead filled and traffic stalled after the heal.


def _guarded(log: MemoryLogStore, tools: HangingTools) -> tuple[Interpreter, InProcessGuard]:
    clock = FakeClock()
    guard = InProcessGuard(clock)
    ports = InterpreterPorts(
        model=OneCallModel(), tools=tools, log=log, admission=OpenAdmission(), clock=clock, guard=guard
    )
    return Interpreter("t1", policy(), ports), guard


def _slots_held(guard: InProcessGuard) -> int:
    return sum(guard.snapshot(scope).in_flight for scope in guard.scopes())


async def test_closing_with_a_call_in_flight_gives_its_permit_back() -> None:
    # Given a trajectory whose tool call holds a guard slot and hangs at the dependency
    tools = HangingTools()
    interp, guard = _guarded(MemoryLogStore(), tools)
    await interp.create(created(FakeClock()))
    await _until(lambda: tools.invoked and interp.record.state is S.WAITING_TOOL, "the call in flight")
    assert _slots_held(guard) == 1
    # When the interpreter closes (its actor goes away) before the call's result is decided
    await interp.close()
    # Then the slot is free at once, not when its lease lapses
    assert _slots_held(guard) == 0


async def test_a_call_stopped_for_recovery_gives_its_permit_back() -> None:
    # Given a tool call in flight, holding a guard slot
    log, tools = FailingOnce(), HangingTools()
    interp, guard = _guarded(log, tools)
    await interp.create(created(FakeClock()))
    await _until(lambda: tools.invoked and interp.record.state is S.WAITING_TOOL, "the call in flight")
    # When a write fails and the interpreter recovers (stopping the call) and dispatches the call again
    log.fail = True
    roles = {"alice": frozenset({"operator"})}
    approve = ControlReceived("a1", ControlAction.APPROVE, "alice", "ok", {"call_digest": "x"}, roles)
    with pytest.raises(ConnectionError):
        await interp.submit(approve)
    await _until(lambda: len(tools.invoked) == 2, "the call dispatched again after the recovery")
    # Then only the new attempt holds a slot
    assert _slots_held(guard) == 1
    await interp.close()
    assert _slots_held(guard) == 0
