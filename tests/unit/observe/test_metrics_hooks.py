"""MetricsHooks on real harness runs (fake clock, in-process fakes): each §12.5 mapping on its metric."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from runtime.clock import FakeClock
from runtime.dispatch import RetryVerdict, SingleAttempt, Verdict
from runtime.fingerprint import call_digest
from runtime.harness import Harness
from runtime.metrics import InMemoryBackend, Metrics
from runtime.observe import MetricsHooks, StateCensus
from runtime.ports import ModelReply, OutcomeClass, Settlement, StopReason, ToolOutcome, Usage
from runtime.record import ControlAction, TrajectoryRecord
from runtime.states import ExitReason, TrajectoryState
from tests.unit.harness.fakes import (
    FakeTools,
    ScriptedModel,
    call,
    created,
    done,
    finish_after,
    harness,
    settle_loop,
    tool_results,
)

S = TrajectoryState


def observed(
    model: ScriptedModel, tools: FakeTools, clock: FakeClock, **config: Any
) -> tuple[Harness, InMemoryBackend]:
    """A harness from the shared fakes with MetricsHooks over an in-memory backend."""
    backend = InMemoryBackend()
    h = harness(model, tools, clock, **config)
    h.hooks = MetricsHooks(Metrics(backend), clock)
    return h, backend


async def run(h: Harness, clock: FakeClock, **created_kw: Any) -> TrajectoryRecord:
    await h.create(created(clock, **created_kw))
    task = asyncio.ensure_future(h.run())
    await settle_loop(clock, task)
    return task.result().record


async def spin() -> None:
    for _ in range(200):
        await asyncio.sleep(0)


def counters(backend: InMemoryBackend, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    return {labels: v for (n, labels), v in backend.counters.items() if n == name}


def actor_gauges(backend: InMemoryBackend) -> dict[str, float]:
    return {
        dict(labels)["state"]: v
        for (n, labels), v in backend.gauges.items()
        if n == "tether_actor_trajectories"
    }


async def test_completed_run_records_outcome_steps_and_one_attempt_per_operation() -> None:
    # Given a model that calls run_tests twice and then ends its turn
    clock = FakeClock()
    h, backend = observed(ScriptedModel(finish_after(2)), FakeTools(), clock)
    # When it runs to completion
    rec = await run(h, clock)
    # Then one completed outcome, its turns in the histogram, two attempts of two operations, both completed
    assert rec.state is S.COMPLETED
    assert counters(backend, "tether_trajectories_finished") == {(("outcome", "completed"),): 1.0}
    assert backend.observations[("tether_steps_to_completion", ())] == [float(rec.turn_count)]
    assert backend.value("tether_step_attempts") == 2.0
    assert backend.value("tether_tool_operations") == 2.0
    assert backend.value("tether_steps_completed") == 2.0
    # and nothing else fired, and the process holds no unfinished trajectory any more
    assert counters(backend, "tether_escalations") == {}
    assert counters(backend, "tether_guard_fired") == {}
    assert counters(backend, "tether_budget_exhausted") == {}
    assert set(actor_gauges(backend).values()) == {0.0}


async def test_budget_halt_records_binding_dimension_and_partial_outcome() -> None:
    # Given a model that never stops calling tools, under a 4-turn budget
    def script(messages):  # type: ignore[no-untyped-def]
        k = tool_results(messages)
        return call("run_tests", {"suite": f"s{k}"}, k)

    clock = FakeClock()
    h, backend = observed(ScriptedModel(script), FakeTools(), clock)
    # When it halts at the ceiling
    rec = await run(h, clock, ceilings={"turns": 4, "tokens": 1e6, "dollars": 10})
    # Then the exhaustion counts under the binding dimension, and established effects make it partial
    assert rec.exit_reason is ExitReason.BUDGET_EXCEEDED
    assert counters(backend, "tether_budget_exhausted") == {(("dimension", "turns"),): 1.0}
    assert counters(backend, "tether_trajectories_finished") == {(("outcome", "partial"),): 1.0}
    assert ("tether_steps_to_completion", ()) not in backend.observations  # not a completion


async def test_watchdog_records_the_guard_that_fired() -> None:
    # Given a model that repeats one identical call forever
    clock = FakeClock()
    model = ScriptedModel(lambda m: call("run_tests", {"suite": "same"}, tool_results(m)))
    h, backend = observed(model, FakeTools(), clock)
    # When the watchdog stops it
    rec = await run(h, clock)
    # Then the exact-repeat guard fired once, and the two calls that ran make the failure partial
    assert rec.exit_reason is ExitReason.ERROR
    assert counters(backend, "tether_guard_fired") == {(("guard", "exact_repeat"),): 1.0}
    assert counters(backend, "tether_trajectories_finished") == {(("outcome", "partial"),): 1.0}


@pytest.mark.parametrize(
    ("raw_args", "tool", "tools", "guard"),
    [
        ('{"suite": "a",', "run_tests", frozenset({"run_tests", "notify"}), "schema"),
        ('{"suite": "a"}', "no_such_tool", frozenset({"run_tests", "notify"}), "unknown_tool"),
        ('{"suite": "a"}', "run_tests", frozenset({"notify"}), "grant"),
    ],
)
async def test_local_rejections_count_as_guard_firings(
    raw_args: str, tool: str, tools: frozenset[str], guard: str
) -> None:
    # Given a model whose only call is rejected before it reaches any dependency
    def script(messages):  # type: ignore[no-untyped-def]
        rejected = any(m.get("role") == "tool" or "REJECTED" in str(m.get("content")) for m in messages)
        return done() if rejected else call(tool, raw_args, 0)

    clock = FakeClock()
    h, backend = observed(ScriptedModel(script), FakeTools(), clock)
    # When it runs
    await run(h, clock, tools=tools)
    # Then the rejecting guard is counted, nothing was attempted
    assert counters(backend, "tether_guard_fired") == {(("guard", guard),): 1.0}
    assert backend.value("tether_step_attempts") == 0.0


async def test_failed_completion_check_is_a_verification_escalation_and_a_plain_failure() -> None:
    # Given a model that claims to be done with no evidence
    clock = FakeClock()
    h, backend = observed(ScriptedModel(lambda m: done()), FakeTools(), clock)
    # When the completion check rejects the claim
    rec = await run(h, clock)
    # Then it escalates as a verification failure and ends failed (no effect established)
    assert rec.exit_reason is ExitReason.COMPLETION_CHECK_FAILED
    assert counters(backend, "tether_escalations") == {(("trigger", "verification"),): 1.0}
    assert counters(backend, "tether_trajectories_finished") == {(("outcome", "failed"),): 1.0}


async def test_model_refusals_are_escalations() -> None:
    # Given a model that refuses every turn
    clock = FakeClock()
    refuse = ModelReply(StopReason.REFUSAL, "I won't.", [], Usage(50, 0, 5))
    h, backend = observed(ScriptedModel(lambda m: refuse), FakeTools(), clock, max_refusals=2)
    # When the harness gives up on it
    rec = await run(h, clock)
    # Then each refusal was one escalation (max_refusals + 1 of them end the trajectory)
    assert rec.exit_reason is ExitReason.REFUSED
    assert counters(backend, "tether_escalations") == {(("trigger", "refusal"),): 3.0}


async def test_approval_request_escalates_and_the_approval_latency_is_timed() -> None:
    # Given an irreversible call held for approval
    args = {"channel": "ops", "text": "deploying"}

    def script(messages):  # type: ignore[no-untyped-def]
        return call("notify", args, 0) if tool_results(messages) == 0 else done()

    clock = FakeClock()
    h, backend = observed(ScriptedModel(script), FakeTools(), clock, approval_timeout_s=600.0)
    await h.create(created(clock))
    task = asyncio.ensure_future(h.run())
    await spin()
    assert h.record.state is S.AWAITING_APPROVAL
    assert actor_gauges(backend)["AWAITING_APPROVAL"] == 1.0
    # When an operator approves the digest (recorded at once, applied by the waiting gate)
    await h.deliver_control(
        "m1", ControlAction.APPROVE, "alice", "ok", {"digest": call_digest("notify", args)}
    )
    await settle_loop(clock, task)
    # Then one approval-request escalation, the approval applied with a latency, and the call ran once
    assert counters(backend, "tether_escalations") == {(("trigger", "approval_request"),): 1.0}
    assert len(backend.observations[("tether_control_latency_seconds", (("kind", "approve"),))]) == 1
    assert counters(backend, "tether_trajectories_finished") == {(("outcome", "completed"),): 1.0}
    assert actor_gauges(backend)["AWAITING_APPROVAL"] == 0.0


async def test_pause_latency_is_the_time_until_the_boundary_applies_it() -> None:
    # Given a model call in flight that a pause request will abort
    clock = FakeClock()
    model = ScriptedModel(finish_after(1), gate=asyncio.Event())
    h, backend = observed(model, FakeTools(), clock)
    await h.create(created(clock))
    task = asyncio.ensure_future(h.run())
    await model.started.wait()
    # When a pause is recorded, 2.5 s pass on the clock, then the stream ends and the boundary applies it
    await h.deliver_control("p1", ControlAction.PAUSE, "alice", "lunch")
    clock.advance(2.5)
    await spin()
    assert h.record.state is S.PAUSED
    model.gate.set()  # type: ignore[union-attr]
    await h.deliver_control("r1", ControlAction.RESUME, "alice", "back")
    await settle_loop(clock, task)
    # Then the pause escalated once and its latency is exactly the clock time between record and apply
    assert counters(backend, "tether_escalations") == {(("trigger", "pause"),): 1.0}
    latencies = backend.observations[("tether_control_latency_seconds", (("kind", "pause"),))]
    assert latencies == [2.5]
    assert len(backend.observations[("tether_control_latency_seconds", (("kind", "resume"),))]) == 1


async def test_kill_without_effects_counts_as_killed() -> None:
    # Given a model call in flight
    clock = FakeClock()
    model = ScriptedModel(finish_after(1), gate=asyncio.Event())
    h, backend = observed(model, FakeTools(), clock)
    await h.create(created(clock))
    task = asyncio.ensure_future(h.run())
    await model.started.wait()
    # When an operator kills it
    await h.deliver_control("k1", ControlAction.KILL, "alice", "runaway")
    await settle_loop(clock, task)
    # Then a kill escalation, a killed outcome and one kill latency
    assert counters(backend, "tether_escalations") == {(("trigger", "kill"),): 1.0}
    assert counters(backend, "tether_trajectories_finished") == {(("outcome", "killed"),): 1.0}
    assert len(backend.observations[("tether_control_latency_seconds", (("kind", "kill"),))]) == 1


class RetryTwiceOnFailure(SingleAttempt):
    """Retries an infrastructure failure up to twice, immediately."""

    def __init__(self) -> None:
        super().__init__()
        self.retries: dict[str, int] = {}

    def decide(self, operation_id: str, outcome: ToolOutcome) -> RetryVerdict:
        n = self.retries.get(operation_id, 0)
        if outcome.outcome_class is OutcomeClass.INFRASTRUCTURE_FAILURE and n < 2:
            self.retries[operation_id] = n + 1
            return RetryVerdict(Verdict.RETRY, "transient", 0.0)
        return super().decide(operation_id, outcome)


async def test_retries_are_attempts_of_one_operation() -> None:
    # Given a tool whose first two attempts fail transiently, and a retry owner that retries them
    clock, tools = FakeClock(), FakeTools()
    failure = ToolOutcome(Settlement.ESTABLISHED_ABSENT, OutcomeClass.INFRASTRUCTURE_FAILURE, error="503")
    tools.fail_next = [failure, failure]
    h, backend = observed(ScriptedModel(finish_after(1)), tools, clock)
    h.ports.retry = RetryTwiceOnFailure()
    # When the call finally succeeds and the trajectory completes
    rec = await run(h, clock)
    # Then three attempts of one operation, one completed step: retry ratio 3
    assert rec.state is S.COMPLETED
    assert backend.value("tether_step_attempts") == 3.0
    assert backend.value("tether_tool_operations") == 1.0
    assert backend.value("tether_steps_completed") == 1.0


async def test_a_shared_census_counts_several_trajectories_by_state() -> None:
    # Given two trajectories held for approval in one process, sharing one census
    args = {"channel": "ops", "text": "x"}

    def script(messages):  # type: ignore[no-untyped-def]
        return call("notify", args, 0) if tool_results(messages) == 0 else done()

    clock, backend, census = FakeClock(), InMemoryBackend(), StateCensus()
    harnesses = []
    for tid in ("a", "b"):
        h = harness(ScriptedModel(script), FakeTools(), clock, tid=tid, approval_timeout_s=600.0)
        h.hooks = MetricsHooks(Metrics(backend), clock, census)
        await h.create(created(clock, tid=tid))
        harnesses.append(asyncio.ensure_future(h.run()))
    # When both reach the approval gate
    await spin()
    # Then the gauge shows both there, and nothing left behind in earlier states
    assert actor_gauges(backend) == {"READY": 0.0, "CALLING_MODEL": 0.0, "AWAITING_APPROVAL": 2.0}
    for task in harnesses:
        task.cancel()
    await asyncio.gather(*harnesses, return_exceptions=True)
