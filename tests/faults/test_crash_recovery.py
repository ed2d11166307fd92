"""Crash recovery: SIGKILL the trajectory actor's worker process mid-model-call and mid-tool-call (the
reliability guide's §13.3 row "Process is killed mid-step, then resumed").

Ray restarts the actor (unlimited restarts) and retries the pending ``run()`` on the new incarnation, which
folds the durable log and continues. The judges are the folded record (budget and spend carried over, never
above the ceilings) and the testbed's deliveries: its services apply every delivery, so a resumed
trajectory that replayed a side effect shows a duplicate delivery (and effect). Each test has a control:
the same crash with a log that forgets (``forgetful-log``: no checkpoint, every incarnation starts over),
asserted to fail the same judge.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import AsyncIterator, Iterator

import pytest

from runtime.budget import Dimension
from runtime.events import (
    ModelCallCancelled,
    ModelCallFailed,
    ModelCallIntent,
    ModelCallSettled,
    ToolCallCancelled,
    ToolCallTimedOut,
    ToolResultAccepted,
)
from runtime.events import ToolDispatchIntent as Intent
from runtime.fold import fold
from runtime.record import TrajectoryRecord
from testbed.provider import ProviderConfig, ProviderThread, start_provider_thread
from testbed.tools import Testbed, TestbedClient, start_testbed
from tests.faults.fault_kit import handed_off, unique, until_delivered
from tests.faults.mutations import MutatedAdapters
from tests.integration.trajectory_kit import MODEL, events_of, make_launch, record_of, start

# 480 s: each test waits for a real actor restart (a new worker process) and a slow provider (1.7 s per call)
# on a shared 2-core machine; the bound only turns a hang into a failure.
pytestmark = [pytest.mark.faults, pytest.mark.timeout(480)]

CEILINGS = {"turns": 12, "tokens": 20_000, "wall_seconds": 300, "dollars": 0.25}
MAX_TOKENS = 256


@pytest.fixture(scope="module")
def slow_provider() -> Iterator[ProviderThread]:
    # A tool-call reply is ~20 tokens: 1.2 s to the first token, then 40 tokens/s, so ~1.7 s per call: wide
    # enough for the kill to land inside it on a busy machine.
    handle = start_provider_thread(ProviderConfig(ttft_ms=1200.0, tokens_per_s=40.0, models=(MODEL,)))
    try:
        yield handle
    finally:
        handle.stop()


@pytest.fixture
async def slow_testbed() -> AsyncIterator[Testbed]:
    bed = await start_testbed(0, provision_s=4.0)  # provisioning an environment takes 4 s
    try:
        yield bed
    finally:
        await bed.stop()


def assert_within_budget(record: TrajectoryRecord) -> None:
    for dim, ceiling in CEILINGS.items():
        assert record.spend.get(dim) <= ceiling, f"{dim}: {record.spend.get(dim)} > {ceiling}"


async def _launch_and_kill(
    name: str,
    provider: ProviderThread,
    bed: Testbed,
    redis_url: str,
    kill_in: str,
    min_turns: int,
    mutation: str | None = None,
) -> tuple[list[object], dict[str, object], int]:
    """Run a two-provision trajectory, SIGKILL its worker once it is in ``kill_in``; return the log as it
    was at the kill, the run summary and the killed pid."""
    launch = make_launch(
        name,
        base_url=provider.base_url,
        redis_url=redis_url,
        scenario="finish_after:2",
        grants=["provision_env"],
        tool_routes={"provision_env": bed.address, "release_env": bed.address},
        ceilings=dict(CEILINGS),
        max_tokens=MAX_TOKENS,
        tool_timeout_s=20.0,
    )
    from actors.trajectory import ensure_actor

    handle = start(launch) if mutation is None else ensure_actor(launch, MutatedAdapters(mutation=mutation))
    pid = await handle.pid.remote()  # asked first: nothing but the log poll stands between seeing and killing
    running = handle.run.remote()
    at_kill = await _until_in_flight(redis_url, name, kill_in, nth=min_turns)
    if kill_in == "WAITING_TOOL":
        # in flight at the endpoint, not merely announced: the kill must land while the effect runs
        [intent] = [e for e in at_kill if isinstance(e, Intent)][-1:]
        await until_delivered(bed, intent.effect_key)
    os.kill(pid, signal.SIGKILL)
    summary = await running  # Ray retries run() on the restarted actor
    assert await handle.pid.remote() != pid  # a new worker process carried on
    return at_kill, summary, pid


async def _until_in_flight(
    redis_url: str, name: str, kind: str, nth: int, timeout_s: float = 180.0
) -> list[object]:
    """Wait until the ``nth`` model call (``CALLING_MODEL``) or tool dispatch (``WAITING_TOOL``) is durably
    announced in the log and not yet answered: the effect is then in flight, whatever the status snapshot
    says (a state change is logged before the intent, and on a busy machine a kill can land between them)."""
    intent: type
    answers: tuple[type, ...]
    if kind == "CALLING_MODEL":
        intent, answers = ModelCallIntent, (ModelCallSettled, ModelCallCancelled, ModelCallFailed)
    else:
        intent, answers = Intent, (ToolResultAccepted, ToolCallTimedOut, ToolCallCancelled)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        events = await events_of(redis_url, name)
        at = [i for i, e in enumerate(events) if isinstance(e, intent)]
        if len(at) >= nth:
            if any(isinstance(e, answers) for e in events[at[nth - 1] + 1 :]):
                raise AssertionError(f"{name}: call {nth} was answered before the poll saw it in flight")
            return list(events)
        await asyncio.sleep(0.02)
    raise AssertionError(f"{name}: call {nth} was never announced within {timeout_s}s")


@pytest.mark.parametrize("mutation", [None, "forgetful-log"], ids=["runtime", "control-forgetful-log"])
async def test_sigkill_mid_model_call_recovers_without_resetting_the_budget(
    ray_local: None,
    redis_url: str,
    slow_provider: ProviderThread,
    slow_testbed: Testbed,
    mutation: str | None,
) -> None:
    # Given a trajectory in its second model call (one environment already provisioned)
    # When its worker process is killed with SIGKILL
    name = unique("crash-model")
    at_kill_events, summary, _ = await _launch_and_kill(
        name, slow_provider, slow_testbed, redis_url, "CALLING_MODEL", min_turns=2, mutation=mutation
    )
    async with TestbedClient(slow_testbed.address) as client:
        ledger = await client.ledger()
    if mutation is not None:
        # (control) a runtime that does not resume from its log provisions the first environment again
        assert ledger.duplicate_deliveries() != [] and ledger.duplicate_effects() != []
        return
    events = await events_of(redis_url, name)
    at_kill = fold(at_kill_events)  # type: ignore[arg-type]
    after = await record_of(redis_url, name)
    # Then the restarted actor charged the lost call's reservation and went on to a terminal state
    lost = [e for e in events if isinstance(e, ModelCallFailed) and "restarted" in e.error]
    assert len(lost) == 1, "the kill did not land mid-model-call"
    assert summary["state"] == "COMPLETED" and after.is_terminal
    # And the budget carried over: spend only grew (by at least the reservation), turns continued
    assert after.turn_count > at_kill.turn_count >= 2
    tokens_at_kill = at_kill.spend.get(Dimension.TOKENS)
    assert after.spend.get(Dimension.TOKENS) >= tokens_at_kill + MAX_TOKENS
    assert_within_budget(after)
    # And the testbed received each provisioning exactly once: nothing was replayed on resume
    assert ledger.duplicate_deliveries() == [] and not ledger.duplicate_effects()
    dispatched = {e.effect_key for e in events if isinstance(e, Intent) and e.tool == "provision_env"}
    provisions = [d for d in ledger.deliveries if d.tool == "provision_env"]
    assert len(provisions) == len(ledger.environments) == len(dispatched) == 2
    # And the runtime's own cleanup (FINALIZING; temporary environments are released on completion too)
    # released both: nothing left billed
    assert ledger.orphaned_environments() == []


@pytest.mark.parametrize("mutation", [None, "forgetful-log"], ids=["runtime", "control-forgetful-log"])
async def test_sigkill_mid_tool_call_never_repeats_the_effect(
    ray_local: None,
    redis_url: str,
    slow_provider: ProviderThread,
    slow_testbed: Testbed,
    mutation: str | None,
) -> None:
    # Given a trajectory whose provisioning call (4 s) is in flight
    # When its worker process is killed with SIGKILL
    name = unique("crash-tool")
    at_kill_events, summary, _ = await _launch_and_kill(
        name, slow_provider, slow_testbed, redis_url, "WAITING_TOOL", min_turns=1, mutation=mutation
    )
    async with TestbedClient(slow_testbed.address) as client:
        ledger = await client.ledger()
    if mutation is not None:
        # (control) a runtime that does not resume from its log sends the in-flight provisioning again
        assert ledger.duplicate_deliveries() != []
        return
    events = await events_of(redis_url, name)
    at_kill = fold(at_kill_events)  # type: ignore[arg-type]
    after = await record_of(redis_url, name)
    # Then the in-flight call became in doubt on restart, and was settled by a probe or left unknown
    # with an owner -- never dispatched a second time (probe-then-retry only repeats what is absent)
    cancelled = [e for e in events if isinstance(e, ToolCallCancelled) and "restarted" in e.reason]
    assert len(cancelled) == 1, "the kill did not land mid-tool-call"
    in_flight = next(e for e in events if isinstance(e, Intent) and e.call_id == cancelled[0].call_id)
    operation = after.operations[in_flight.operation_id]
    assert operation.attempts == 1
    assert operation.settled or handed_off(after, operation.operation_id)
    assert summary["state"] == "COMPLETED" and after.turn_count > at_kill.turn_count
    assert_within_budget(after)
    # And the testbed's deliveries show no effect asked for twice: one delivery for the in-flight key
    assert ledger.duplicate_deliveries() == [] and not ledger.duplicate_effects()
    assert len(ledger.deliveries_for(in_flight.effect_key)) == 1
    assert len(ledger.environments_for(in_flight.effect_key)) <= 1
    assert len(ledger.environments) <= len({e.effect_key for e in events if isinstance(e, Intent)})
