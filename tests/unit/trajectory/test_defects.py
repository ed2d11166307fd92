"""Regression tests for the defects the harness/decider split hid (issue 10), and the model-path rules the
decider owns (issue 15: a 429 is admission feedback; failed calls are billed what they carried).

Each test drives whole trajectories through ``runtime.decide`` on the in-memory interpreter, judged by the
tool service's own delivery record and the folded record.
"""

from __future__ import annotations

from runtime.clock import FakeClock
from runtime.effects import CancelToolCall, Hibernate, ProbeTool, ReportLimits, SettleAdmission
from runtime.events import CallObserved, TimerStarted
from runtime.fingerprint import call_digest
from runtime.fold import fold
from runtime.inputs import PermitRefused
from runtime.ports import Settlement, Usage
from runtime.record import ControlAction, TimerKind
from runtime.states import ExitReason, TrajectoryState
from runtime.tools import RepeatContract

from .sim import (
    HOLD,
    ModelError,
    Sim,
    call,
    created,
    done,
    finish_after,
    policy,
    provision_contracts,
    registry,
    tool_results,
)

S = TrajectoryState


# --------------------------------------------------------------------------- 1. deadlines in every state


def test_a_paused_trajectory_still_ends_at_its_absolute_deadline() -> None:
    clock = FakeClock()
    sim = Sim(finish_after(3), clock, hold_model=True)
    sim.start(created(clock, deadline_s=120.0))
    sim.run()
    sim.control("p1", ControlAction.PAUSE)
    assert sim.run(until=clock.wall() + 60).state is S.PAUSED
    # When nobody resumes it, the deadline timer fires while it is paused
    rec = sim.run()
    assert rec.state is S.FAILED and rec.exit_reason is ExitReason.DEADLINE_EXCEEDED
    assert clock.wall() == created(FakeClock()).created_at + 120.0


def test_a_hibernated_trajectory_is_woken_by_its_durable_deadline_and_ends() -> None:
    # Given a paused trajectory that hibernates after 30 s idle
    clock = FakeClock()
    sim = Sim(finish_after(3), clock, hold_model=True, pol=policy(idle_hibernate_s=30.0))
    start = clock.wall()
    sim.start(created(clock, deadline_s=600.0))
    sim.run()
    sim.control("p1", ControlAction.PAUSE)
    sim.run()
    assert sim.hibernated and any(isinstance(e, Hibernate) for e in sim.effects)
    # only the durable timers outlive the actor: the deadline is one of them
    assert [t.kind for t in sim.durable_timers.values()] == [TimerKind.DEADLINE]
    # When the deadline passes with nobody around, the timer service wakes a new incarnation
    clock.advance(start + 600.0 - clock.wall())
    sim.restart()
    sim.fire_durable()
    rec = sim.run()
    # Then it ends DEADLINE_EXCEEDED (it used to re-hibernate forever)
    assert rec.state is S.FAILED and rec.exit_reason is ExitReason.DEADLINE_EXCEEDED


# --------------------------------------------------------------------------- 2. cancel does not wait


def test_cancel_cancels_calls_in_flight_instead_of_waiting_them_out() -> None:
    # Given a probe-able provisioning call that hangs (its own deadline is 600 s away)
    clock = FakeClock()
    pol = policy(registry(*provision_contracts()), tool_timeout_s=600.0)

    def script(messages):  # type: ignore[no-untyped-def]
        return call("provision_env", {"name": "e1"}, 0) if tool_results(messages) == 0 else done()

    sim = Sim(script, clock, pol=pol)
    sim.tools.behaviour["provision_env"] = lambda inv: None
    sim.start(created(clock, check="always", tools=frozenset({"provision_env", "release_env"})))
    sim.run(until=clock.wall() + 1)
    assert sim.rec.state is S.WAITING_TOOL
    t0 = clock.wall()
    # When an operator cancels
    sim.control("c1", ControlAction.CANCEL, reason="not needed")
    rec = sim.run()
    # Then it ends at once: the call was cancelled at its endpoint, probed, and its outcome settled from
    # the probe's evidence; nothing waited for the 600 s deadline
    assert rec.state is S.CANCELED and clock.wall() == t0
    assert any(isinstance(e, CancelToolCall) for e in sim.effects)
    assert any(isinstance(e, ProbeTool) for e in sim.effects)
    op = next(iter(rec.operations.values()))
    assert op.settlement is Settlement.ESTABLISHED_ABSENT  # the probe's evidence: it never took effect


# --------------------------------------------------------------------------- 3. nothing not yet sent is sent


def test_a_pause_while_a_call_waits_at_the_bulkhead_stops_that_dispatch() -> None:
    clock = FakeClock()
    sim = Sim(finish_after(1), clock, guard=lambda effect: HOLD)
    sim.start(created(clock))
    sim.run(until=clock.wall() + 1)
    assert sim.rec.state is S.WAITING_TOOL and sim.parked_permits
    # When a pause arrives while the call waits for its permit, and then the permit comes
    sim.control("p1", ControlAction.PAUSE)
    sim.grant_permits()
    rec = sim.run(until=clock.wall() + 1)
    # Then the call is never sent, the model is told why, the permit is given back, and it pauses
    assert not sim.tools.deliveries and rec.state is S.PAUSED
    assert [r["reason"] for r in sim.refusals()] == ["DEFERRED"]
    assert len(sim.released) == 1 and sim.released[0].outcome is None


def test_cancel_while_a_call_waits_for_a_sandbox_permit_sends_nothing() -> None:
    clock = FakeClock()
    sim = Sim(finish_after(1), clock, guard=lambda effect: HOLD)
    sim.start(created(clock))
    sim.run(until=clock.wall() + 1)
    sim.control("c1", ControlAction.CANCEL)
    sim.grant_permits()
    rec = sim.run()
    assert not sim.tools.deliveries and rec.state is S.CANCELED


def test_a_breaker_refusal_tells_the_model_why_and_sends_nothing() -> None:
    clock = FakeClock()
    refuse = lambda effect: PermitRefused(  # noqa: E731
        effect.call_id, effect.request_id, "BreakerOpen", "breaker for 'test-service' is open", 12.0
    )
    sim = Sim(finish_after(1), clock, guard=refuse)
    sim.start(created(clock, check="always"))
    rec = sim.run()
    assert not sim.tools.deliveries and rec.state is S.COMPLETED
    (refusal,) = sim.refusals()
    assert refusal["reason"] == "BreakerOpen" and refusal["retry_after_s"] == 12.0


# --------------------------------------------------------------------------- 4. approval wait and budget


def test_time_awaiting_approval_is_not_charged_to_the_compute_budget() -> None:
    # Given a 600 s wall-clock budget and an approval that takes 550 s to arrive
    args = {"channel": "ops", "text": "x"}

    def script(messages):  # type: ignore[no-untyped-def]
        return call("notify", args, 0) if tool_results(messages) == 0 else done()

    clock = FakeClock()
    sim = Sim(script, clock, pol=policy(approval_timeout_s=900.0))
    sim.start(created(clock, check="always"))
    sim.run(until=clock.wall() + 550)
    assert sim.rec.state is S.AWAITING_APPROVAL
    sim.control("a1", ControlAction.APPROVE, payload={"call_digest": call_digest("notify", args)})
    rec = sim.run()
    # Then it completes: the wait counted against the request's expiry, not the compute budget
    assert rec.state is S.COMPLETED and rec.excluded_wait_s == 550.0
    assert rec.spend.get("wall_seconds") < 50 and rec.budget_stage.value == "nominal"


# ----------------------------------------------------------------------- 5. quorum accumulates, roles count


def _held_notify(pol_kwargs: dict[str, object]) -> tuple[Sim, FakeClock, str]:
    args = {"channel": "ops", "text": "deploy"}

    def script(messages):  # type: ignore[no-untyped-def]
        return call("notify", args, 0) if tool_results(messages) == 0 else done()

    clock = FakeClock()
    sim = Sim(script, clock, pol=policy(approval_timeout_s=600.0, **pol_kwargs))
    sim.start(created(clock, check="always"))
    sim.run(until=clock.wall() + 1)
    return sim, clock, call_digest("notify", args)


def test_two_single_signature_approvals_accumulate_to_a_quorum_of_two() -> None:
    sim, _, digest = _held_notify({"approval_quorum": 2})
    sim.control("a1", ControlAction.APPROVE, "alice", payload={"call_digest": digest})
    # one signer of two: still held, not discarded
    assert sim.rec.state is S.AWAITING_APPROVAL and len(sim.rec.held.votes) == 1  # type: ignore[union-attr]
    # the same signer again does not count twice (signer uniqueness)
    sim.control("a2", ControlAction.APPROVE, "alice", payload={"call_digest": digest})
    assert sim.rec.state is S.AWAITING_APPROVAL
    sim.control("a3", ControlAction.APPROVE, "bob", payload={"call_digest": digest})
    rec = sim.run()
    assert rec.state is S.COMPLETED and sim.tools.delivered("notify") == 1


def test_a_quorum_must_cover_the_required_roles() -> None:
    sim, _, digest = _held_notify({"approval_quorum": 2, "approval_roles": frozenset({"secops", "sre"})})
    ops = {"alice": frozenset({"operator", "secops"})}
    sim.control("a1", ControlAction.APPROVE, "alice", payload={"call_digest": digest}, roles=ops)
    sim.control(
        "a2",
        ControlAction.APPROVE,
        "bob",
        payload={"call_digest": digest},
        roles={"bob": frozenset({"operator"})},
    )
    # two distinct signers, but nobody covers "sre": held
    assert sim.rec.state is S.AWAITING_APPROVAL and not sim.tools.deliveries
    sim.control(
        "a3",
        ControlAction.APPROVE,
        "carol",
        payload={"call_digest": digest},
        roles={"carol": frozenset({"sre"})},
    )
    rec = sim.run()
    assert rec.state is S.COMPLETED and sim.tools.delivered("notify") == 1


def test_an_explicit_deny_of_the_held_call_denies_it() -> None:
    sim, _, digest = _held_notify({"approval_quorum": 2})
    sim.control("a1", ControlAction.APPROVE, "alice", payload={"call_digest": digest})
    sim.control("d1", ControlAction.DENY, "bob", payload={"call_digest": digest})
    rec = sim.run()
    assert [r["reason"] for r in sim.refusals()] == ["APPROVAL_DENIED"]
    assert not sim.tools.deliveries and rec.is_terminal


# ----------------------------------------------------------------------- 6. invalid calls reach the watchdog


def test_an_identical_invalid_call_repeated_every_turn_is_stopped_by_the_watchdog() -> None:
    clock = FakeClock()
    sim = Sim(lambda m: call("run_tests", '{"suite": ', tool_results(m)), clock)
    sim.start(created(clock))
    rec = sim.run(until=clock.wall() + 1)
    # Then the ladder answers the third, fourth and fifth identical (invalid) calls: inform, constrain,
    # hold; it is held at turn 5, not run to the 20-turn ceiling
    assert rec.hold is not None and rec.turn_count == 5
    assert len(sim.of(CallObserved)) == 5 and not sim.tools.deliveries


# --------------------------------------------------------------------------- issue 15: the model path


def test_429s_are_admission_feedback_not_failures_and_give_their_turn_back() -> None:
    # Given a provider that answers 429 to the first six calls (more than the 4 consecutive failures
    # that end a trajectory as MODEL_ERROR)
    left = [6]

    def script(messages):  # type: ignore[no-untyped-def]
        if left[0] > 0:
            left[0] -= 1
            raise ModelError("429 Too Many Requests", rate_limited=True, retry_after=2.0)
        return finish_after(1)(messages)

    clock = FakeClock()
    sim = Sim(script, clock)
    sim.start(created(clock))
    rec = sim.run()
    # Then it completes, the 429s consumed no turn and counted as no failure, and each was reported
    assert rec.state is S.COMPLETED and rec.turn_count == 2 and rec.spend.get("turns") == 2
    reports = [e for e in sim.effects if isinstance(e, ReportLimits)]
    assert len(reports) == 6 and all(r.rate_limited for r in reports)
    assert reports[0].info.retry_after_s == 2.0
    # And each report names the grant of the call it answers (the scheduler dates the 429 by it)
    settled = [e.grant_id for e in sim.effects if isinstance(e, SettleAdmission)]
    assert [r.grant_id for r in reports] == settled[:6] and len(set(settled[:6])) == 6
    assert fold(sim.log, sim.policy) == rec


def test_a_failed_call_is_billed_the_usage_it_carried() -> None:
    left = [1]

    def script(messages):  # type: ignore[no-untyped-def]
        if left[0] > 0:
            left[0] -= 1
            raise ModelError("stream reset", usage=Usage(100, 0, 40))
        return done()

    clock = FakeClock()
    sim = Sim(script, clock)
    sim.start(created(clock, check="always"))
    rec = sim.run()
    assert rec.state is S.COMPLETED
    assert rec.spend.get("tokens") == 140 + 105  # the broken stream's partial usage, then the reply


def test_repeated_real_failures_still_end_the_trajectory() -> None:
    def script(messages):  # type: ignore[no-untyped-def]
        raise ModelError("HTTP 503")

    clock = FakeClock()
    sim = Sim(script, clock)
    sim.start(created(clock))
    rec = sim.run()
    assert rec.exit_reason is ExitReason.MODEL_ERROR and rec.model_failures == 4


def test_admission_waits_are_bounded_by_the_trajectorys_deadline_not_the_calls() -> None:
    clock = FakeClock()
    sim = Sim(finish_after(1), clock, admit=lambda effect: _record(effect))
    seen.clear()
    sim.start(created(clock, deadline_s=240.0))
    # the turn may queue until the trajectory's own deadline; the call deadline is fixed at the grant
    assert seen and seen[0].request.deadline == created(FakeClock()).created_at + 240.0


seen: list[object] = []


def _record(effect):  # type: ignore[no-untyped-def]
    seen.append(effect)
    return None


def test_timers_are_armed_as_events_so_a_new_incarnation_knows_them() -> None:
    clock = FakeClock()
    sim = Sim(finish_after(1), clock, hold_model=True)
    sim.start(created(clock))
    started = sim.of(TimerStarted)
    assert [t.timer_kind for t in started] == [TimerKind.DEADLINE]
    assert fold(sim.log, sim.policy).timers.keys() == sim.rec.timers.keys()


def test_a_repeat_safe_call_lost_with_the_actor_is_sent_again_under_the_same_effect_key() -> None:
    clock = FakeClock()
    pol = policy(registry(*provision_contracts(RepeatContract.IDEMPOTENT)))

    def script(messages):  # type: ignore[no-untyped-def]
        return call("provision_env", {"name": "e1"}, 0) if tool_results(messages) == 0 else done()

    sim = Sim(script, clock, pol=pol)
    sim.tools.behaviour["provision_env"] = lambda inv: None
    sim.start(created(clock, check="always", tools=frozenset({"provision_env", "release_env"})))
    sim.run(until=clock.wall() + 1)
    sim.tools.behaviour.clear()
    sim.restart()
    rec = sim.run()
    keys = [d.effect_key for d in sim.tools.deliveries]
    assert len(keys) == 2 and keys[0] == keys[1]  # the same effect key: the endpoint's contract dedupes it
    op = next(iter(rec.operations.values()))
    assert op.attempts == 2 and op.settled and rec.state is S.COMPLETED
