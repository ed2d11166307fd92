"""How many durable batches a turn costs, and what a crash between any two of them leaves.

The interpreter holds the events of a decision whose effects touch nothing outside (admission, permits,
settlement, local timers) and writes them with the next intent, so a plain tool-using turn is two batches:
one ending in the model call's intent, one holding the dispatch's. The judges here are the log itself (the
batches the store acknowledged) and the fakes standing in for the world, which read the log at the moment
an effect reaches them: an effect whose intent is not yet on disk is counted, whatever happens after.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import pytest

from actors.interpreter import Interpreter, InterpreterPorts
from runtime.clock import FakeClock
from runtime.codec import decode
from runtime.events import Event, ModelCallIntent, ToolDispatchIntent, ToolResultAccepted
from runtime.fold import fold
from runtime.memstore import MemoryLogStore
from runtime.ports import (
    CancelToken,
    ModelReply,
    ModelRequest,
    OutcomeClass,
    ProbeResult,
    Settlement,
    ToolInvocation,
    ToolOutcome,
    TurnGrant,
    TurnRequest,
)
from runtime.states import ExitReason, TrajectoryState
from runtime.tools import RepeatContract, SideEffect, ToolContract

from ..trajectory.sim import SuiteArgs, created, finish_after, policy, registry
from .test_interpreter import OpenAdmission

S = TrajectoryState
TID = "t1"
TOOL_TURNS = 3
INTENTS = (ModelCallIntent, ToolDispatchIntent)


class BatchLog(MemoryLogStore):
    """A memory log that keeps each acknowledged batch as it was written."""

    def __init__(self, batches: Sequence[Sequence[bytes]] = ()) -> None:
        super().__init__()
        self.batches: list[list[bytes]] = []
        for batch in batches:  # a log that survived a crash: what the disk held
            for payload in batch:
                self._seq += 1
                self._logs.setdefault(TID, []).append(((0, self._seq), payload))

    async def append_many(self, trajectory_id: str, payloads: Sequence[bytes]) -> list[str]:
        ids = await super().append_many(trajectory_id, payloads)
        self.batches.append(list(payloads))
        return ids

    def events(self) -> list[Event]:
        return [decode(p) for _, p in self._logs.get(TID, [])]


class World:
    """The model and the tool service: each checks, when an effect reaches it, that the log announces it.
    The tool service outlives the trajectory's incarnations (it is the world), and answers probes from
    what it applied."""

    def __init__(self, tool: str = "run_tests") -> None:
        self.log = BatchLog()
        self.unannounced: list[str] = []
        self.applied: dict[str, Any] = {}
        self.script = finish_after(TOOL_TURNS, tool)

    async def complete(self, request: ModelRequest, cancel: CancelToken) -> ModelReply:
        record = fold(self.log.events(), policy())
        if record.state is not S.CALLING_MODEL or record.model_call is None or record.model_call.outcome:
            self.unannounced.append("model call")
        return self.script(request.messages)

    async def invoke(self, invocation: ToolInvocation) -> ToolOutcome:
        announced = {e.effect_key for e in self.log.events() if isinstance(e, ToolDispatchIntent)}
        if invocation.effect_key not in announced:
            self.unannounced.append(f"dispatch {invocation.effect_key}")
        self.applied[invocation.effect_key] = {"passed": True}
        return ToolOutcome(Settlement.ESTABLISHED, OutcomeClass.SUCCESS, {"passed": True})

    async def probe(self, tool: str, effect_key: str, deadline: float) -> ProbeResult:
        if effect_key in self.applied:
            return ProbeResult(Settlement.ESTABLISHED, self.applied[effect_key], "applied")
        return ProbeResult(Settlement.ESTABLISHED_ABSENT, None, "never applied")

    async def cancel(self, tool: str, effect_key: str) -> None:
        return None

    def interpreter(self, clock: FakeClock) -> Interpreter:
        ports = InterpreterPorts(model=self, tools=self, log=self.log, admission=OpenAdmission(), clock=clock)
        return Interpreter(TID, policy(), ports)


async def _run_fresh() -> tuple[World, Interpreter]:
    clock = FakeClock()
    world = World()
    interp = world.interpreter(clock)
    await interp.create(created(clock))
    await interp.run()
    return world, interp


async def test_a_plain_tool_turn_is_two_durable_batches_one_per_intent() -> None:
    # Given a trajectory that calls one tool per turn for three turns, then ends its turn
    # When it runs to the end on an in-memory log
    world, interp = await _run_fresh()
    # Then it completed, and no effect reached the world before the log announced it
    assert interp.record.exit_reason is ExitReason.COMPLETED
    assert world.unannounced == []
    # and the log took two batches per tool turn: creation, the first request, 2 per tool turn, the last
    # turn's model call and its reply (which completes the trajectory); four per tool turn before
    batches = [[decode(p) for p in batch] for batch in world.log.batches]
    assert len(batches) == 2 + 2 * TOOL_TURNS + 2, [[type(e).__name__ for e in b] for b in batches]
    assert interp.appends == len(batches)
    # each batch of the turns holds exactly one intent (the last one ends the trajectory instead)
    intents = [sum(isinstance(e, INTENTS) for e in batch) for batch in batches[2:]]
    assert intents == [1] * (2 * TOOL_TURNS + 1) + [0]


async def test_a_crash_between_any_two_batches_recovers_to_the_same_end() -> None:
    # Given the batches a whole trajectory wrote
    world, interp = await _run_fresh()
    written = world.log.batches
    assert len(written) > 4
    for crash_after in range(1, len(written)):
        # When the actor died with only the first batches on disk, and a new incarnation folds them
        clock = FakeClock()
        again = World()
        again.applied = dict(world.applied)  # the tool service remembers what it applied
        again.log = BatchLog(written[:crash_after])
        survivor = again.interpreter(clock)
        fold(again.log.events(), policy())  # what the disk held folds as it is
        await survivor.recover()
        await survivor.run()
        # Then it completes, every effect of the new incarnation was announced before it started, and its
        # record is what its log folds to
        where = f"crash after batch {crash_after} of {len(written)}"
        assert survivor.record.exit_reason is ExitReason.COMPLETED, where
        assert again.unannounced == [], where
        assert fold(again.log.events(), policy()) == survivor.record, where
        await survivor.close()
    await interp.close()


class QueuedAdmission(OpenAdmission):
    """Admits the first turn; every later one queues until the test lets it through."""

    def __init__(self) -> None:
        self.admitted = 0
        self.gate = asyncio.Event()

    async def admit_turn(self, request: TurnRequest) -> TurnGrant:
        self.admitted += 1
        if self.admitted > 1:
            await self.gate.wait()
        return await super().admit_turn(request)


async def test_a_result_held_behind_a_queued_admission_is_written_within_the_hold() -> None:
    # Given a trajectory whose second turn queues at the scheduler
    clock = FakeClock()
    world = World()
    admission = QueuedAdmission()
    ports = InterpreterPorts(model=world, tools=world, log=world.log, admission=admission, clock=clock)
    interp = Interpreter(TID, policy(), ports, hold_s=0.05)
    await interp.create(created(clock))
    for _ in range(200):
        if admission.admitted == 2:
            break
        await asyncio.sleep(0)
    # When the tool's outcome has been decided and the next request waits in the queue
    assert admission.admitted == 2
    assert not any(isinstance(e, ToolResultAccepted) for e in world.log.events())  # held, not lost yet
    clock.advance(0.05)
    for _ in range(50):
        await asyncio.sleep(0)
    # Then the held result is on disk once the hold is over, though no intent followed it
    assert any(isinstance(e, ToolResultAccepted) for e in world.log.events())
    admission.gate.set()
    await interp.run()
    assert interp.record.exit_reason is ExitReason.COMPLETED and world.unannounced == []
    await interp.close()


# A tool with a side effect that may not be sent twice (no approval, so the turn is as plain as run_tests').
DEPLOY = ToolContract(
    name="deploy",
    description="Deploy a build (never repeated).",
    arguments=SuiteArgs,
    side_effect=SideEffect.IRREVERSIBLE,
    repeat=RepeatContract.NEVER_REPEAT,
    needs_approval=False,
    dependency_scope="deployer",
)


@pytest.mark.parametrize(("tool", "held"), [("deploy", False), ("run_tests", True)])
async def test_the_result_of_a_call_that_may_not_be_repeated_is_written_at_once(
    tool: str, held: bool
) -> None:
    # Given a trajectory whose second turn queues at the scheduler, calling a never-repeat tool (control:
    # the idempotent run_tests, whose result may wait for the next batch: recovery may send it again)
    clock = FakeClock()
    world = World(tool)
    admission = QueuedAdmission()
    ports = InterpreterPorts(model=world, tools=world, log=world.log, admission=admission, clock=clock)
    reg = registry(DEPLOY)
    interp = Interpreter(TID, policy(reg), ports, hold_s=0.05)
    await interp.create(created(clock, tools=frozenset({"run_tests", "deploy"})))
    for _ in range(200):
        if admission.admitted == 2:
            break
        await asyncio.sleep(0)
    # When the tool's outcome has been decided and the next request waits in the queue (the hold not over)
    assert admission.admitted == 2
    on_disk = any(isinstance(e, ToolResultAccepted) for e in world.log.events())
    # Then a result only the world could tell again is already durable; a repeat-safe one may still wait
    assert on_disk is not held
    admission.gate.set()
    await interp.run()
    assert interp.record.exit_reason is ExitReason.COMPLETED and world.unannounced == []
    await interp.close()
