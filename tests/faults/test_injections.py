"""The reliability guide's fault injections (§13.3), one test per row, through the product: trajectory actors
on Ray, the durable log on a real redis-server, the simulated provider, the gRPC testbed applying every
delivery.

Each row is judged by what the world saw (the testbed's deliveries and effects, the provider's own counts)
and by the folded record; each passing row has a control run with the protection it proves switched off
(``mutations.py``), asserted to fail the same judge. The rows that needed the containment or cleanup issues
were strict xfails until those issues landed; none is left.

Rows (reliability guide, §13.3):

1. Tool succeeds but the response is lost
2. Tool returns a malformed or unexpected payload
3. Tool hangs past the step timeout
4. Process is killed mid-step, then resumed  -> ``test_crash_recovery.py``
5. The same tool result is delivered twice
6. A human never answers an escalation
7. A sub-agent returns a confident but wrong report (delegation, issue 12)
8. Budget is set very low (and its usable partial result, issues 11/12)
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
import ray

from cluster.redis_server import RedisServer
from runtime.budget import Dimension
from runtime.codec import decode
from runtime.events import (
    ApprovalDecided,
    ObservationAppended,
    ObservationKind,
    ToolCallHeld,
    ToolResultAccepted,
)
from runtime.ports import Settlement
from runtime.record import ApprovalDecision
from runtime.states import ExitReason, TrajectoryState
from testbed.provider import ProviderConfig, ProviderThread, start_provider_thread
from testbed.tools import MALFORMED_PAYLOAD, FaultMode, FaultPlan, Testbed, TestbedClient, start_testbed
from tests.faults.fault_kit import (
    announced,
    book,
    dispatched,
    ended,
    handed_off,
    in_tool_call,
    launch,
    results,
    unique,
    until_logged,
)
from tests.integration.redis_proxy import ReplyEater
from tests.integration.trajectory_kit import MODEL, events_of, record_of

pytestmark = [pytest.mark.faults, pytest.mark.integration, pytest.mark.timeout(300)]

PROVISIONER = "env-provisioner"


@pytest.fixture(scope="module")
def provider() -> Iterator[ProviderThread]:
    handle = start_provider_thread(ProviderConfig(ttft_ms=5.0, tokens_per_s=5000.0, models=(MODEL,)))
    try:
        yield handle
    finally:
        handle.stop()


@pytest.fixture
async def testbed() -> AsyncIterator[Testbed]:
    bed = await start_testbed(0, provision_s=0.05)
    try:
        yield bed
    finally:
        await bed.stop()


async def set_faults(testbed: Testbed, plan: FaultPlan, service: str) -> None:
    async with TestbedClient(testbed.address) as client:
        await client.set_faults(plan, service)


# ------------------------------------------------------------------------------------------------ row 1


@pytest.mark.parametrize("mutation", [None, "blind-retry"], ids=["runtime", "control-blind-retry"])
async def test_tool_succeeds_but_the_response_is_lost_and_the_retry_does_not_duplicate_the_effect(
    ray_local: None, redis_url: str, provider: ProviderThread, testbed: Testbed, mutation: str | None
) -> None:
    # Given every provisioning reply of the run is lost after the effect
    await set_faults(testbed, FaultPlan(mode=FaultMode.DROP_REPLY, count=2), PROVISIONER)
    tid = unique("i1-lost")
    # When a trajectory provisions twice
    handle = launch(
        tid,
        provider,
        testbed,
        redis_url,
        scenario="finish_after:2",
        grants=["provision_env"],
        mutation=mutation,
        tool_timeout_s=2.0,
    )
    run = await ended(handle, tid, redis_url, testbed)
    if mutation is not None:
        # (control) a client that retries what timed out duplicates the effect
        assert run.book.duplicate_deliveries() != [] and run.book.duplicate_effects() != []
        return
    # Then each provisioning was delivered once and applied once: one environment per announced key
    keys = run.keys("provision_env")
    assert len(keys) == 2
    assert run.book.duplicate_deliveries() == [] and run.book.duplicate_effects() == []
    assert sorted(env.effect_key for env in run.book.environments) == sorted(keys)
    # And the record settles neither from the timeout: each is settled by the endpoint's evidence or in doubt,
    # handed off with the packet when the trajectory ended
    for op in run.record.operations.values():
        assert op.settled or handed_off(run.record, op.operation_id), op


# ------------------------------------------------------------------------------------------------ row 2


@pytest.mark.parametrize("mutation", [None, "trusting-parser"], ids=["runtime", "control-trusting-parser"])
async def test_tool_returns_a_malformed_payload_and_garbage_is_never_taken_as_success(
    ray_local: None, redis_url: str, provider: ProviderThread, testbed: Testbed, mutation: str | None
) -> None:
    # Given the provisioner applies its next call and answers it with a payload that is not JSON
    await set_faults(testbed, FaultPlan(mode=FaultMode.MALFORMED, count=1), PROVISIONER)
    tid = unique("i2-malformed")
    handle = launch(
        tid,
        provider,
        testbed,
        redis_url,
        scenario="finish_after:2",
        grants=["provision_env"],
        mutation=mutation,
        tool_timeout_s=2.0,
    )
    # When a trajectory provisions twice
    run = await ended(handle, tid, redis_url, testbed)
    accepted = [r.result for r in results(run.events) if r.settlement is Settlement.ESTABLISHED]
    if mutation is not None:
        # (control) a client without the reply check records the garbage as the call's result
        assert MALFORMED_PAYLOAD in accepted
        return
    # Then no established result is anything but a well-formed reply: the garbage was never a success ...
    assert MALFORMED_PAYLOAD not in accepted and all(isinstance(r, dict) for r in accepted)
    # ... the applied effect behind it is known to the record only through the endpoint's evidence or as
    # unknown, and it was not provisioned again
    assert run.book.duplicate_deliveries() == []
    [garbled] = [d.effect_key for d in run.book.deliveries if d.tool == "provision_env"][:1]
    [op] = [op for op in run.record.operations.values() if op.effect_key == garbled]
    assert op.settled or handed_off(run.record, op.operation_id), op


# ------------------------------------------------------------------------------------------------ row 3


@pytest.mark.parametrize(
    "mutation", [None, "no-deadline-on-the-wire"], ids=["runtime", "control-no-deadline-on-the-wire"]
)
async def test_tool_hangs_past_the_step_timeout_and_cancellation_reaches_the_endpoint(
    ray_local: None, redis_url: str, provider: ProviderThread, testbed: Testbed, mutation: str | None
) -> None:
    # Given the provisioner holds its next call past whatever deadline the call carries
    await set_faults(testbed, FaultPlan(mode=FaultMode.HANG, hang_s=0.5, count=1), PROVISIONER)
    tid = unique("i3-hang")
    handle = launch(
        tid,
        provider,
        testbed,
        redis_url,
        scenario="finish_after:2",
        grants=["provision_env"],
        mutation=mutation,
        tool_timeout_s=1.5,
    )
    # When a trajectory provisions twice (its step timeout: 1.5 s)
    run = await ended(handle, tid, redis_url, testbed)
    # (every attempt the log announced, the runtime's own releases in FINALIZING included)
    attempts = {e.attempt_id: e for e in announced(run.events)}
    hung = run.book.deliveries[0]
    assert hung.tool == "provision_env"
    # Then the endpoint was told the deadline the runtime enforces (the attempt's own), so the held call
    # was given up there too: refused, never applied, and done with before the trajectory finished
    assert {d.attempt_id for d in run.book.deliveries} <= set(attempts)
    told_in_time = all(d.deadline <= attempts[d.attempt_id].deadline + 0.01 for d in run.book.deliveries)
    if mutation is not None:
        assert not told_in_time  # (control) the endpoint was told a later deadline than the runtime's
        return
    assert told_in_time
    # And the held call is given up at the endpoint (it holds it half a second past the deadline it was
    # told; polled, bounded): refused there, never applied, not repeated
    hung = await _disposed(testbed, hung.seq)
    assert hung.disposition == "refused" and run.book.environments_for(hung.effect_key) == []
    assert run.book.duplicate_deliveries() == []
    assert run.summary["state"] in {"COMPLETED", "FAILED"}


async def _disposed(testbed: Testbed, seq: int, timeout_s: float = 10.0) -> Any:
    give_up = asyncio.get_running_loop().time() + timeout_s
    while True:
        delivery = (await book(testbed)).deliveries[seq]
        if delivery.disposed_at is not None or asyncio.get_running_loop().time() > give_up:
            return delivery
        await asyncio.sleep(0.05)


# ------------------------------------------------------------------------------------------------ row 5


@pytest.mark.parametrize(
    "mutation", [None, "at-least-once-log"], ids=["runtime", "control-at-least-once-log"]
)
async def test_the_same_tool_result_delivered_twice_is_observed_once(
    ray_local: None,
    redis_server: RedisServer,
    provider: ProviderThread,
    testbed: Testbed,
    mutation: str | None,
) -> None:
    # Given the trajectory's log writes pass through a link that loses the reply to the write carrying its
    # first tool result (the write is applied; the runtime does not know), so that result reaches the log
    # a second time if the runtime writes it again
    upstream = redis_server.port
    async with ReplyEater(upstream) as link:
        link.arm(lambda request: b"tool_result_accepted" in request)
        tid = unique("i5-twice")
        handle = launch(
            tid,
            provider,
            testbed,
            redis_server.url,
            scenario="finish_after:2",
            grants=["run_tests"],
            mutation=mutation,
            actor_redis_url=link.url,
        )
        # When the trajectory runs to its end
        summary = await asyncio.wait_for(_run(handle), 120)
    events = [decode(p) for _, p in await _raw(redis_server.url, tid)]
    per_call = Counter(e.call_id for e in events if isinstance(e, ToolResultAccepted))
    ledger = await book(testbed)
    assert link.eaten == 1, "the lost reply was never injected"
    if mutation is not None:
        # (control) a log that appends again what it could not confirm holds the result twice
        assert max(per_call.values()) == 2
        return
    # Then the log holds each result once, the model was shown it once (it asked for exactly the two
    # runs its script needs, no more and no fewer), and the trajectory completed
    assert set(per_call.values()) == {1} and len(per_call) == 2
    assert ledger.test_runs == 2
    assert summary["state"] == "COMPLETED"


async def _raw(redis_url: str, tid: str) -> list[tuple[str, bytes]]:
    from cluster.log_store import RedisLogStore

    async with RedisLogStore.from_url(redis_url) as store:
        return await store.read(tid)


async def _run(handle: Any) -> dict[str, Any]:
    summary: dict[str, Any] = await handle.run.remote()
    return summary


# ------------------------------------------------------------------------------------------------ row 6


@pytest.mark.parametrize(
    ("approval_timeout_s", "expires"), [(2.0, True), (86_400.0, False)], ids=["runtime", "control-no-expiry"]
)
async def test_a_human_never_answers_an_escalation_and_the_pending_state_expires(
    ray_local: None,
    redis_url: str,
    provider: ProviderThread,
    testbed: Testbed,
    approval_timeout_s: float,
    expires: bool,
) -> None:
    # Given a trajectory whose irreversible call needs a person's approval, and nobody answers
    tid = unique("i6-silence")
    handle = launch(
        tid,
        provider,
        testbed,
        redis_url,
        scenario="irreversible:send_notification",
        grants=["send_notification"],
        approval_timeout_s=approval_timeout_s,
    )
    running = asyncio.ensure_future(_run(handle))
    await until_logged(redis_url, tid, lambda evs: any(isinstance(e, ToolCallHeld) for e in evs))
    # When the approval's expiry passes (control: an expiry a day away, observed for 20 s)
    done, _ = await asyncio.wait({running}, timeout=20.0 if not expires else 90.0)
    record = await record_of(redis_url, tid)
    if not expires:
        running.cancel()
        with contextlib.suppress(BaseException):
            ray.kill(handle)
        # (control) without expiry the pending state blocks: the judge below would fail
        assert not done and record.state is TrajectoryState.AWAITING_APPROVAL
        return
    # Then the pending state expired as a denial, nothing was sent, nothing is held, and the trajectory
    # went on to its end
    assert done
    ledger = await book(testbed)
    events = await events_of(redis_url, tid)
    decisions = [e.decision for e in events if isinstance(e, ApprovalDecided)]
    assert decisions == [ApprovalDecision.EXPIRED]
    assert [d for d in ledger.deliveries if d.tool == "send_notification"] == []
    assert record.is_terminal and not record.pending_calls and record.held is None


# ------------------------------------------------------------------------------------------------ row 7


@pytest.mark.parametrize("mutation", [None, "trusting-parent"], ids=["runtime", "control-trusting-parent"])
async def test_a_sub_agent_returning_a_confident_but_wrong_report_is_caught_by_the_parent(
    ray_local: None, redis_url: str, provider: ProviderThread, testbed: Testbed, mutation: str | None
) -> None:
    # Given a parent that delegates a sub-task to a child that claims it is done without running anything
    # (its own bar, "always", lets it end COMPLETED), and whose contract needs a passing test run
    from actors.supervision_config import ChildCheckSpec, ChildCompletionSpec, DelegationSpec, SupervisionSpec
    from runtime.delegation import ChildCheckKind, OnFailure

    delegation = DelegationSpec(
        budget={"turns": 3, "tokens": 8_000, "dollars": 0.05},
        grants=("run_tests",),
        scenario="finish_after:0",
        check=ChildCheckSpec(kind=ChildCheckKind.TOOL_RESULT, tool="run_tests", field="passed", equals=True),
        completion_check=ChildCompletionSpec(name="always", params={}),
        on_failure=OnFailure.ABORT_PARENT,
    )
    tid = unique("i7-parent")
    handle = launch(
        tid,
        provider,
        testbed,
        redis_url,
        scenario="finish_after:1",
        grants=["delegate"],
        mutation=mutation,
        supervision=SupervisionSpec(delegation=delegation),
    )
    run = await ended(handle, tid, redis_url, testbed)
    record = run.record
    (child,) = record.supervision.children.values()
    child_events = await events_of(redis_url, child.child_id)
    child_claim = [
        e.content
        for e in child_events
        if isinstance(e, ObservationAppended) and e.observation is ObservationKind.ASSISTANT and e.content
    ]
    if mutation is not None:
        # (control) a parent that believes the report builds on it and completes: the judge below fails
        assert child.verified and run.summary["state"] == "COMPLETED"
        return
    # Then the child did claim success, ran nothing, and the parent's own check (not the claim) judged it:
    # the report is marked unverified, and the contract's on_failure ended the parent, not a completion
    assert child_claim and "Done" in child_claim[-1]
    assert not [d for d in run.book.deliveries if d.trajectory_id == child.child_id]
    assert child.verified is False and run.summary["state"] != "COMPLETED"
    assert record.exit_reason is ExitReason.DELEGATION_FAILED


# ------------------------------------------------------------------------------------------------ row 8


@pytest.mark.parametrize("mutation", [None, "no-budget-halt"], ids=["runtime", "control-no-budget-halt"])
async def test_budget_set_very_low_winds_down_within_it(
    ray_local: None, redis_url: str, provider: ProviderThread, testbed: Testbed, mutation: str | None
) -> None:
    # Given a trajectory whose script wants nine tool turns, on a budget of three turns
    tid = unique("i8-budget")
    ceilings = {"turns": 3, "tokens": 60_000, "wall_seconds": 300, "dollars": 1.0}
    handle = launch(
        tid,
        provider,
        testbed,
        redis_url,
        scenario="finish_after:9",
        grants=["run_tests"],
        mutation=mutation,
        ceilings=ceilings,
    )
    # When it runs
    run = await ended(handle, tid, redis_url, testbed)
    served = provider.stats()["trajectories"].get(tid, {})
    if mutation is not None:
        # (control) without the halt the provider serves it past its ceiling
        assert served.get("accepted", 0) > ceilings["turns"]
        return
    # Then the provider, counting for itself, served no more model calls than the ceiling allows, the record's
    # spend stays within every ceiling, and the trajectory ended through the budget's wind-down, not an error
    assert served.get("accepted", 0) <= ceilings["turns"]
    record = run.record
    for dimension, ceiling in ceilings.items():
        assert record.spend.get(Dimension(dimension)) <= ceiling, dimension
    assert (record.state, record.exit_reason) == (TrajectoryState.FAILED, ExitReason.BUDGET_EXCEEDED)
    assert run.book.test_runs == len(dispatched(run.events, "run_tests"))


@pytest.mark.parametrize("mutation", [None, "no-budget-halt"], ids=["runtime", "control-no-budget-halt"])
async def test_budget_set_very_low_produces_a_usable_partial_result(
    ray_local: None, redis_url: str, provider: ProviderThread, testbed: Testbed, mutation: str | None
) -> None:
    # Given nine tool turns wanted on a budget of three
    tid = unique("i8-partial")
    handle = launch(
        tid,
        provider,
        testbed,
        redis_url,
        scenario="finish_after:9",
        grants=["run_tests"],
        mutation=mutation,
        ceilings={"turns": 3, "tokens": 60_000, "wall_seconds": 300, "dollars": 1.0},
    )
    run = await ended(handle, tid, redis_url, testbed)
    if mutation is not None:
        # (control) without the wind-down it runs past its three turns (its tool calls refused at admission
        # once the ceiling is spent) and ends COMPLETED: nobody is told the budget ran out, no packet
        assert run.summary["turns"] > 3 and run.summary["state"] == "COMPLETED", run.summary
        assert "budget_exhausted" not in run.summary["escalations"].values()
        return
    # Then the result is machine-readable partial work: what was done (each run the testbed saw), what was
    # not, and the next action (a person, with its escalation and the handoff packet)
    partial = run.summary["result"]
    assert partial["status"] == "partial" and partial["next_action"].startswith("queued for a person")
    assert len(partial["done"]) == run.book.test_runs >= 1
    assert "budget_exhausted" in run.summary["escalations"].values()
    assert any(type(e).__name__ == "HandoffWritten" for e in run.events)


__all__ = ["in_tool_call"]
