"""Recovery of a probe-then-retry call in flight when the actor died: the probe decides, and an outcome the
probe cannot settle stays unknown with the trajectory named as its owner (never silently unowned)."""

from __future__ import annotations

import asyncio

import pytest
from pydantic import BaseModel, ConfigDict

from runtime.clock import FakeClock
from runtime.dispatch import UnlimitedAdmission
from runtime.harness import Harness, HarnessConfig, HarnessPorts
from runtime.memstore import MemoryLogStore
from runtime.ports import ProbeResult, Settlement
from runtime.states import TrajectoryState
from runtime.tools import Compensation, RepeatContract, SideEffect, ToolContract, ToolRegistry

from .fakes import PRICES, FakeTools, ScriptedModel, call, created, done, settle_loop, tool_results

S = TrajectoryState


class EnvArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")
    tenant: str


class ReleaseArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")
    env_id: str


def _registry() -> ToolRegistry:
    provision = ToolContract(
        name="provision",
        description="allocate",
        arguments=EnvArgs,
        side_effect=SideEffect.REVERSIBLE,
        repeat=RepeatContract.PROBE_THEN_RETRY,
        probe=True,
        dependency_scope="envs",
        compensation=Compensation("release", from_result={"env_id": "env_id"}),
    )
    release = ToolContract(
        name="release",
        description="release",
        arguments=ReleaseArgs,
        side_effect=SideEffect.IRREVERSIBLE,
        repeat=RepeatContract.IDEMPOTENT,
        needs_approval=False,
        dependency_scope="envs",
    )
    return ToolRegistry([provision, release])


class ProbingTools(FakeTools):
    """The dependency answers probes with a fixed settlement (e.g. UNKNOWN: still in progress)."""

    def __init__(self, answer: Settlement) -> None:
        super().__init__()
        self.answer = answer
        self.probes = 0

    async def probe(self, tool: str, effect_key: str, deadline: float) -> ProbeResult:
        self.probes += 1
        return ProbeResult(self.answer)


def _harness(tools: FakeTools, clock: FakeClock, log: MemoryLogStore) -> Harness:
    def script(messages):  # type: ignore[no-untyped-def]
        return call("provision", {"tenant": "acme"}, 0) if tool_results(messages) == 0 else done()

    ports = HarnessPorts(
        model=ScriptedModel(script), tools=tools, log=log, admission=UnlimitedAdmission(clock), clock=clock
    )
    return Harness("t1", ports, _registry(), HarnessConfig(provider_key="sim", prices=PRICES))


@pytest.mark.parametrize(
    ("answer", "settled", "in_doubt"),
    [
        (Settlement.ESTABLISHED, True, False),  # the probe found the effect: settled established
        (Settlement.UNKNOWN, False, True),  # the probe could not tell: unknown, owned by the trajectory
    ],
)
async def test_restart_mid_call_probes_and_never_redispatches(
    answer: Settlement, settled: bool, in_doubt: bool
) -> None:
    # Given a provisioning call dispatched and in flight when the process died
    clock, log, tools = FakeClock(), MemoryLogStore(), FakeTools()
    tools.hang["provision"] = asyncio.Event()
    h1 = _harness(tools, clock, log)
    await h1.create(created(clock, check="always", tools=frozenset({"provision", "release"})))
    t1 = asyncio.ensure_future(h1.run())
    await tools.invoked.wait()
    log.unavailable = "process died"
    t1.cancel()
    for _ in range(50):
        await asyncio.sleep(0)
    await h1.close()
    log.unavailable = None
    # When a fresh harness recovers from the log and the dependency answers the probe with ``answer``
    fresh = ProbingTools(answer)
    h2 = _harness(fresh, clock, log)
    await h2.recover()
    assert h2.record.state is S.WAITING_TOOL
    task = asyncio.ensure_future(h2.run())
    await settle_loop(clock, task)
    rec = task.result().record
    # Then the call was probed once, never dispatched again, and its operation is settled or owned
    op = next(iter(rec.operations.values()))
    assert fresh.probes == 1 and op.attempts == 1 and sum(fresh.ledger.by_tool.values()) == 0
    assert (op.settled, op.in_doubt) == (settled, in_doubt)
    if in_doubt:
        assert op.owner == "t1"
    assert rec.is_terminal
