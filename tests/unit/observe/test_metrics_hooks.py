"""MetricsHooks on whole trajectories (the decider on the in-memory interpreter, fake clock): each §12.5
mapping on its metric."""

from __future__ import annotations

from typing import Any

import pytest

from runtime.clock import FakeClock
from runtime.events import ModelCallIntent
from runtime.fingerprint import call_digest
from runtime.metrics import InMemoryBackend, Metrics
from runtime.observe import MetricsHooks, StateCensus
from runtime.ports import ModelReply, OutcomeClass, Settlement, StopReason, ToolOutcome, Usage
from runtime.record import ControlAction, TrajectoryRecord
from runtime.states import ExitReason, TrajectoryState
from tests.unit.trajectory.sim import Script, Sim, call, created, done, finish_after, policy, tool_results

S = TrajectoryState


def observed(script: Script, clock: FakeClock, **settings: Any) -> tuple[Sim, InMemoryBackend]:
    """A trajectory on the in-memory interpreter with MetricsHooks over an in-memory backend."""
    backend = InMemoryBackend()
    hold = settings.pop("hold_model", False)
    sim = Sim(script, clock, pol=policy(**settings), hold_model=hold)
    sim.hooks = MetricsHooks(Metrics(backend), clock)
    return sim, backend


def run(sim: Sim, clock: FakeClock, **created_kw: Any) -> TrajectoryRecord:
    sim.start(created(clock, **created_kw))
    return sim.run()


def counters(backend: InMemoryBackend, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    return {labels: v for (n, labels), v in backend.counters.items() if n == name}


def actor_gauges(backend: InMemoryBackend) -> dict[str, float]:
    return {
        dict(labels)["state"]: v
        for (n, labels), v in backend.gauges.items()
        if n == "tether_actor_trajectories"
    }


def test_completed_run_records_outcome_steps_and_one_attempt_per_operation() -> None:
    # Given a model that calls run_tests twice and then ends its turn
    clock = FakeClock()
    sim, backend = observed(finish_after(2), clock)
    # When it runs to completion
    rec = run(sim, clock)
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


def test_budget_halt_records_binding_dimension_and_partial_outcome() -> None:
    def script(messages):  # type: ignore[no-untyped-def]
        k = tool_results(messages)
        return call("run_tests", {"suite": f"s{k}"}, k)

    clock = FakeClock()
    sim, backend = observed(script, clock)
    rec = run(sim, clock, ceilings={"turns": 4, "tokens": 1e6, "dollars": 10})
    # the exhaustion counts under the binding dimension, and established effects make it partial
    assert rec.exit_reason is ExitReason.BUDGET_EXCEEDED
    assert counters(backend, "tether_budget_exhausted") == {(("dimension", "turns"),): 1.0}
    assert counters(backend, "tether_trajectories_finished") == {(("outcome", "partial"),): 1.0}
    assert ("tether_steps_to_completion", ()) not in backend.observations  # not a completion


def test_watchdog_records_the_guard_that_fired() -> None:
    clock = FakeClock()
    sim, backend = observed(lambda m: call("run_tests", {"suite": "same"}, tool_results(m)), clock)
    rec = run(sim, clock)
    # the exact-repeat guard fired three times, once per rung of its ladder (the third is the hold, which
    # waits until the deadline ends it); after the constrain rung took the tool away, the calls that kept
    # coming were refused by the grant; the two calls that ran make the failure partial
    assert rec.exit_reason is ExitReason.DEADLINE_EXCEEDED
    assert counters(backend, "tether_guard_fired") == {
        (("guard", "exact_repeat"),): 3.0,
        (("guard", "grant"),): 1.0,
    }
    assert counters(backend, "tether_watchdog_rungs") == {
        (("guard", "exact_repeat"), ("rung", rung)): 1.0 for rung in ("inform", "constrain", "hold")
    }
    assert counters(backend, "tether_holds") == {(("kind", "watchdog"),): 1.0}
    assert counters(backend, "tether_trajectories_finished") == {(("outcome", "partial"),): 1.0}


@pytest.mark.parametrize(
    ("raw_args", "tool", "tools", "guard"),
    [
        ('{"suite": "a",', "run_tests", frozenset({"run_tests", "notify"}), "schema"),
        ('{"suite": "a"}', "no_such_tool", frozenset({"run_tests", "notify"}), "unknown_tool"),
        ('{"suite": "a"}', "run_tests", frozenset({"notify"}), "grant"),
    ],
)
def test_local_rejections_count_as_guard_firings(
    raw_args: str, tool: str, tools: frozenset[str], guard: str
) -> None:
    def script(messages):  # type: ignore[no-untyped-def]
        rejected = any(m.get("role") == "tool" or "REJECTED" in str(m.get("content")) for m in messages)
        return done() if rejected else call(tool, raw_args, 0)

    clock = FakeClock()
    sim, backend = observed(script, clock)
    run(sim, clock, tools=tools)
    # the rejecting guard is counted, nothing was attempted
    assert counters(backend, "tether_guard_fired") == {(("guard", guard),): 1.0}
    assert backend.value("tether_step_attempts") == 0.0


def test_failed_completion_check_is_a_verification_escalation_and_a_plain_failure() -> None:
    clock = FakeClock()
    sim, backend = observed(lambda m: done(), clock)
    rec = run(sim, clock)
    assert rec.exit_reason is ExitReason.COMPLETION_CHECK_FAILED
    assert counters(backend, "tether_escalations") == {(("trigger", "verification"),): 1.0}
    assert counters(backend, "tether_trajectories_finished") == {(("outcome", "failed"),): 1.0}


def test_model_refusals_are_escalations() -> None:
    clock = FakeClock()
    refuse = ModelReply(StopReason.REFUSAL, "I won't.", [], Usage(50, 0, 5))
    sim, backend = observed(lambda m: refuse, clock, max_refusals=2)
    rec = run(sim, clock)
    # each refusal was one escalation (max_refusals + 1 of them end the trajectory)
    assert rec.exit_reason is ExitReason.REFUSED
    assert counters(backend, "tether_escalations") == {(("trigger", "refusal"),): 3.0}


def test_approval_request_escalates_and_the_approval_latency_is_timed() -> None:
    args = {"channel": "ops", "text": "deploying"}

    def script(messages):  # type: ignore[no-untyped-def]
        return call("notify", args, 0) if tool_results(messages) == 0 else done()

    clock = FakeClock()
    sim, backend = observed(script, clock, approval_timeout_s=600.0)
    sim.start(created(clock))
    sim.run(until=clock.wall() + 1)
    assert sim.rec.state is S.AWAITING_APPROVAL
    assert actor_gauges(backend)["AWAITING_APPROVAL"] == 1.0
    # When an operator approves the digest
    sim.control("m1", ControlAction.APPROVE, payload={"call_digest": call_digest("notify", args)})
    sim.run()
    # Then one approval-request escalation, the approval applied with a latency, and the call ran once
    assert counters(backend, "tether_escalations") == {(("trigger", "approval_request"),): 1.0}
    assert len(backend.observations[("tether_control_latency_seconds", (("kind", "approve"),))]) == 1
    assert counters(backend, "tether_trajectories_finished") == {(("outcome", "completed"),): 1.0}
    assert actor_gauges(backend)["AWAITING_APPROVAL"] == 0.0


def test_pause_latency_is_the_time_until_the_boundary_applies_it() -> None:
    # Given a model call in flight that a pause request will abort
    clock = FakeClock()
    sim, backend = observed(finish_after(1), clock, hold_model=True)
    sim.start(created(clock))
    sim.run()
    # When a pause is recorded, 2.5 s pass on the clock, then the stream ends and the boundary applies it
    assert sim.control("p1", ControlAction.PAUSE, reason="lunch") == "recorded"
    clock.advance(2.5)  # the aborted stream's answer is queued; it is decided only now
    assert sim.run(until=clock.wall() + 1).state is S.PAUSED
    sim.hold_model = False
    sim.control("r1", ControlAction.RESUME, reason="back")
    sim.run()
    # Then the pause escalated once and its latency is exactly the clock time between record and apply
    assert counters(backend, "tether_escalations") == {(("trigger", "pause"),): 1.0}
    latencies = backend.observations[("tether_control_latency_seconds", (("kind", "pause"),))]
    assert latencies == [2.5]
    assert len(backend.observations[("tether_control_latency_seconds", (("kind", "resume"),))]) == 1


def test_kill_without_effects_counts_as_killed() -> None:
    clock = FakeClock()
    sim, backend = observed(finish_after(1), clock, hold_model=True)
    sim.start(created(clock))
    sim.run()
    sim.control("k1", ControlAction.KILL, reason="runaway")
    sim.run()
    assert counters(backend, "tether_escalations") == {(("trigger", "kill"),): 1.0}
    assert counters(backend, "tether_trajectories_finished") == {(("outcome", "killed"),): 1.0}
    assert len(backend.observations[("tether_control_latency_seconds", (("kind", "kill"),))]) == 1


def test_retries_are_attempts_of_one_operation() -> None:
    # Given a tool whose first two attempts fail transiently (the decider's retry rule retries them)
    clock = FakeClock()
    sim, backend = observed(finish_after(1), clock)
    failures = [2]

    def flaky(inv):  # type: ignore[no-untyped-def]
        if failures[0] > 0:
            failures[0] -= 1
            return ToolOutcome(
                Settlement.ESTABLISHED_ABSENT, OutcomeClass.INFRASTRUCTURE_FAILURE, error="503"
            )
        return ToolOutcome(Settlement.ESTABLISHED, OutcomeClass.SUCCESS, {"ok": True})

    sim.tools.behaviour["run_tests"] = flaky
    rec = run(sim, clock)
    # Then three attempts of one operation, one completed step: retry ratio 3
    assert rec.state is S.COMPLETED
    assert backend.value("tether_step_attempts") == 3.0
    assert backend.value("tether_tool_operations") == 1.0
    assert backend.value("tether_steps_completed") == 1.0


def test_a_shared_census_counts_several_trajectories_by_state() -> None:
    args = {"channel": "ops", "text": "x"}

    def script(messages):  # type: ignore[no-untyped-def]
        return call("notify", args, 0) if tool_results(messages) == 0 else done()

    clock, backend, census = FakeClock(), InMemoryBackend(), StateCensus()
    for tid in ("a", "b"):
        sim = Sim(script, clock, pol=policy(approval_timeout_s=600.0))
        sim.hooks = MetricsHooks(Metrics(backend), clock, census)
        sim.start(created(clock, tid=tid))
        sim.run(until=clock.wall())
    # both reached the approval gate: the gauge shows both there, and nothing left in earlier states
    assert actor_gauges(backend) == {"READY": 0.0, "CALLING_MODEL": 0.0, "AWAITING_APPROVAL": 2.0}


def test_each_reported_prompt_is_observed_against_what_its_call_reserved() -> None:
    # Given a model whose replies report prompts of 130, 175 and 221 tokens, then one unreported reply
    counts = [130, 175, 221]

    def script(messages):  # type: ignore[no-untyped-def]
        k = tool_results(messages)
        if k < 3:
            reply = call("run_tests", {"suite": f"s{k}"}, k)
            return ModelReply(reply.stop_reason, "", reply.tool_calls, Usage(counts[k], 0, 20))
        return ModelReply(StopReason.END_TURN, "done", [], Usage(999, 0, 5), usage_estimated=True)

    clock = FakeClock()
    sim, backend = observed(script, clock)
    run(sim, clock)
    # Then one ratio per reported call: what its intent reserved over what the provider counted (the
    # first from characters, well above 1; the next two anchored to the count before them); the
    # adapter's estimate (unreported usage) is not a count and is not observed
    reserved = [e.prompt_tokens for e in sim.log if isinstance(e, ModelCallIntent)]
    assert len(reserved) == 4
    ratios = backend.observations[("tether_prompt_reservation_ratio", ())]
    assert ratios == [r / c for r, c in zip(reserved, counts, strict=False)]
    assert ratios[0] > 1.5 and all(1.0 <= r < ratios[0] for r in ratios[1:])
