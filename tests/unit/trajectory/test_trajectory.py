"""Whole trajectories through ``runtime.decide`` on the in-memory interpreter (fake clock, no event loop).

Ported from the harness's turn-loop tests: each rule that held for the harness holds for the decider.
"""

from __future__ import annotations

import pytest

from runtime.clock import FakeClock
from runtime.events import LateResultDropped, ToolCallTimedOut, ToolDispatchIntent, ToolResultAccepted
from runtime.fingerprint import call_digest
from runtime.fold import fold
from runtime.inputs import AdmissionDenied, ToolOutcomeReceived
from runtime.ports import ModelReply, OutcomeClass, Settlement, StopReason, ToolOutcome, Usage
from runtime.record import AuditKind, ControlAction
from runtime.states import ExitReason, TrajectoryState

from .sim import Sim, call, created, done, finish_after, policy, tool_results

S = TrajectoryState


def test_finish_after_two_calls_completes_and_the_log_folds_to_the_live_record() -> None:
    # Given a model that calls run_tests twice, then ends its turn
    clock = FakeClock()
    sim = Sim(finish_after(2), clock)
    sim.start(created(clock))
    # When it runs to the end
    rec = sim.run()
    # Then the completion check passed, each call was delivered once, and the log rebuilds the same record
    assert rec.state is S.COMPLETED and rec.exit_reason is ExitReason.COMPLETED and rec.check_passed
    assert rec.turn_count == 3
    assert sim.tools.delivered("run_tests") == 2 and sim.tools.duplicate_deliveries() == 0
    assert fold(sim.log, sim.policy) == rec
    assert rec.spend.get("tokens") == 3 * 100 + 20 + 20 + 5


def test_end_turn_without_evidence_fails_the_completion_check() -> None:
    clock = FakeClock()
    sim = Sim(lambda m: done(), clock)
    sim.start(created(clock))
    rec = sim.run()
    # the claim is only a request: the check fails and the trajectory ends FAILED
    assert rec.state is S.FAILED and rec.exit_reason is ExitReason.COMPLETION_CHECK_FAILED


def test_a_truncated_reply_is_never_dispatched() -> None:
    # Given a model whose first reply is cut at max_tokens in the middle of a tool call
    def script(messages):  # type: ignore[no-untyped-def]
        if not any("output-token ceiling" in str(m.get("content")) for m in messages):
            return ModelReply(StopReason.MAX_TOKENS, '{"suite": "a', [], Usage(100, 0, 256))
        return call("run_tests", {"suite": "a"}, 1) if tool_results(messages) == 0 else done()

    clock = FakeClock()
    sim = Sim(script, clock)
    sim.start(created(clock))
    rec = sim.run()
    # Then only the later, complete call reached the tool service
    assert sim.tools.delivered("run_tests") == 1
    assert len(sim.of(ToolDispatchIntent)) == 1 and rec.state is S.COMPLETED


def test_malformed_tool_json_is_refused_locally_and_never_dispatched() -> None:
    def script(messages):  # type: ignore[no-untyped-def]
        return call("run_tests", '{"suite": "a",', 0) if tool_results(messages) == 0 else done()

    clock = FakeClock()
    sim = Sim(script, clock)
    sim.start(created(clock))
    rec = sim.run()
    # nothing was dispatched; the model saw a structured refusal for that call id
    assert not sim.tools.deliveries
    assert [r["reason"] for r in sim.refusals()] == ["INVALID_ARGUMENTS"]
    assert rec.state is S.FAILED  # no tool result: the completion check fails


def test_a_tool_deadline_times_out_then_the_late_result_is_dropped_audited_and_settles() -> None:
    # Given a tool that hangs past its deadline
    clock = FakeClock()
    sim = Sim(finish_after(1), clock, pol=policy(tool_timeout_s=5.0))
    sim.tools.behaviour["run_tests"] = lambda inv: None
    sim.start(created(clock, check="always"))
    # When the clock passes the deadline, the trajectory moves on without the hung call
    rec = sim.run()
    assert sim.of(ToolCallTimedOut) and rec.state is S.COMPLETED
    # And when the late result finally arrives, it is dropped and audited, not appended as a result
    sim.release_tools()
    rec = sim.run()
    assert any(a.kind is AuditKind.LATE_RESULT_DROPPED for a in rec.audit)
    assert sim.of(LateResultDropped) and not sim.of(ToolResultAccepted)
    # and it still settles its operation (correlated evidence), so nothing stays in doubt
    op = next(iter(rec.operations.values()))
    assert op.settlement is Settlement.ESTABLISHED and not op.in_doubt


def _notify(args: dict[str, str]):  # type: ignore[no-untyped-def]
    def script(messages):  # type: ignore[no-untyped-def]
        return call("notify", args, 0) if tool_results(messages) == 0 else done()

    return script


def test_an_irreversible_call_waits_for_approval_then_dispatches_exactly_once() -> None:
    args = {"channel": "ops", "text": "deploying"}
    clock = FakeClock()
    sim = Sim(_notify(args), clock, pol=policy(approval_timeout_s=60.0))
    sim.start(created(clock))
    sim.run(until=clock.wall() + 1)
    # it is held, undispatched
    assert sim.rec.state is S.AWAITING_APPROVAL and not sim.tools.deliveries
    digest = call_digest("notify", args)
    assert sim.rec.held is not None and sim.rec.held.digest == digest
    # When an operator approves the exact digest
    assert sim.control("m1", ControlAction.APPROVE, payload={"call_digest": digest}) == "recorded"
    rec = sim.run()
    # Then it ran exactly once and the trajectory completed
    assert sim.tools.delivered("notify") == 1 and rec.state is S.COMPLETED


def test_an_approval_with_a_stale_digest_is_refused_audited_and_leaves_the_call_held() -> None:
    args = {"channel": "ops", "text": "deploying"}
    clock = FakeClock()
    sim = Sim(_notify(args), clock, pol=policy(approval_timeout_s=60.0))
    sim.start(created(clock))
    sim.run(until=clock.wall() + 1)
    # When the approval binds to a different call
    sim.control("m1", ControlAction.APPROVE, payload={"call_digest": "0" * 64})
    # Then it is audited, the call stays held and undispatched (only a deny or the expiry denies)
    assert sim.rec.state is S.AWAITING_APPROVAL and sim.rec.held is not None
    assert [(a.kind, a.reason) for a in sim.rec.audit] == [(AuditKind.CONTROL_REFUSED, "STALE_DIGEST")]
    assert not sim.tools.deliveries
    # and the genuine approval still goes through
    sim.control("m2", ControlAction.APPROVE, payload={"call_digest": call_digest("notify", args)})
    assert sim.run().state is S.COMPLETED and sim.tools.delivered("notify") == 1


def test_an_approval_without_a_digest_approves_nothing() -> None:
    args = {"channel": "ops", "text": "x"}
    clock = FakeClock()
    sim = Sim(_notify(args), clock, pol=policy(approval_timeout_s=60.0))
    sim.start(created(clock))
    sim.run(until=clock.wall() + 1)
    sim.control("m1", ControlAction.APPROVE, payload={})
    # an approval binds to one exact call, never to "whatever is held": refused, audited, held call waits
    assert sim.rec.audit[-1].reason == "MISSING_DIGEST" and sim.rec.state is S.AWAITING_APPROVAL
    rec = sim.run()  # nobody approves: silence is denial
    assert [r["reason"] for r in sim.refusals()] == ["APPROVAL_EXPIRED"]
    assert not sim.tools.deliveries and rec.is_terminal


def test_silence_until_expiry_is_denial() -> None:
    clock = FakeClock()
    sim = Sim(_notify({"channel": "ops", "text": "x"}), clock, pol=policy(approval_timeout_s=30.0))
    sim.start(created(clock))
    rec = sim.run()  # the expiry timer fires
    assert [r["reason"] for r in sim.refusals()] == ["APPROVAL_EXPIRED"]
    assert not sim.tools.deliveries and rec.is_terminal


def test_a_turn_budget_halts_with_its_binding_dimension() -> None:
    def script(messages):  # type: ignore[no-untyped-def]
        k = tool_results(messages)
        return call("run_tests", {"suite": f"s{k}"}, k)

    clock = FakeClock()
    sim = Sim(script, clock)
    sim.start(created(clock, ceilings={"turns": 4, "tokens": 1e6, "dollars": 10}))
    rec = sim.run()
    assert rec.state is S.FAILED and rec.exit_reason is ExitReason.BUDGET_EXCEEDED
    assert rec.binding_dimension == "turns" and rec.turn_count == 4
    assert rec.spend.get("turns") <= 4


def test_the_watchdog_stops_an_exact_repeat_loop_before_the_budget() -> None:
    clock = FakeClock()
    sim = Sim(lambda m: call("run_tests", {"suite": "same"}, tool_results(m)), clock)
    sim.start(created(clock))
    rec = sim.run(until=clock.wall() + 1)
    # the third identical call is withheld (inform), the fourth removes the tool (constrain), and the
    # trajectory is held far below the 20-turn budget; a loop is held, not ended as an ERROR
    assert rec.hold is not None and rec.hold.kind.value == "watchdog" and not rec.is_terminal
    assert rec.turn_count < 10 and sim.tools.delivered("run_tests") == 2


def test_kill_mid_model_call_aborts_the_stream_and_charges_the_emitted_tokens() -> None:
    clock = FakeClock()
    sim = Sim(finish_after(1), clock, hold_model=True)
    sim.start(created(clock))
    sim.run()
    assert sim.rec.state is S.CALLING_MODEL and sim.held_model
    # When an operator kills it
    assert sim.control("k1", ControlAction.KILL, reason="runaway") == "recorded"
    rec = sim.run()
    # Then the stream was aborted, its billed tokens charged, the processes killed, through FINALIZING
    assert rec.state is S.FAILED and rec.exit_reason is ExitReason.KILLED
    assert rec.spend.get("tokens") == 107 and sim.kills == 1
    assert any(t.to_state is S.FINALIZING for t in rec.history)


def test_pause_applies_at_the_boundary_and_resume_continues() -> None:
    clock = FakeClock()
    sim = Sim(finish_after(1), clock, hold_model=True)
    sim.start(created(clock))
    sim.run()
    # When a pause arrives mid-call, the stream is aborted and the pause applies at the boundary
    sim.control("p1", ControlAction.PAUSE, reason="lunch")
    assert sim.run(until=clock.wall() + 60).state is S.PAUSED
    # And resume continues it to completion
    sim.hold_model = False
    sim.control("r1", ControlAction.RESUME, reason="back")
    assert sim.run().state is S.COMPLETED


def test_a_duplicate_control_delivery_changes_the_record_once() -> None:
    clock = FakeClock()
    sim = Sim(finish_after(1), clock, hold_model=True)
    sim.start(created(clock))
    sim.run()
    first = sim.control("m1", ControlAction.INTERRUPT, payload={"message": "try suite b"})
    second = sim.control("m1", ControlAction.INTERRUPT, payload={"message": "try suite b"})
    assert (first, second) == ("recorded", "duplicate")
    assert len(sim.rec.pending_control) == 1


def test_a_restart_mid_tool_call_does_not_repeat_a_never_repeat_effect() -> None:
    # Given an approved irreversible call in flight when the actor died
    args = {"channel": "ops", "text": "x"}
    clock = FakeClock()
    sim = Sim(_notify(args), clock, pol=policy(approval_timeout_s=60.0))
    sim.tools.behaviour["notify"] = lambda inv: None  # delivered, never answers
    sim.start(created(clock, check="always"))
    sim.run(until=clock.wall() + 1)
    sim.control("m1", ControlAction.APPROVE, payload={"call_digest": call_digest("notify", args)})
    sim.run(until=clock.wall() + 1)
    assert sim.tools.delivered("notify") == 1 and sim.rec.state is S.WAITING_TOOL
    # When a new incarnation recovers from the log (the hung call died with the old one)
    sim.tools.behaviour.clear()
    rec = sim.restart()
    rec = sim.run()
    # Then the in-doubt operation was not re-dispatched: one delivery, unknown, owned (handed off at the end)
    op = next(iter(rec.operations.values()))
    assert op.attempts == 1 and op.in_doubt and op.owner == "operator" and rec.handoff is not None
    assert sim.tools.delivered("notify") == 1 and rec.is_terminal


@pytest.mark.parametrize(
    ("predicate", "times", "state", "exit_reason"),
    [
        ("shutdown", 2, S.COMPLETED, ExitReason.COMPLETED),  # transient: backs off and tries again
        ("exceeds_capacity", 1, S.FAILED, ExitReason.ERROR),  # waiting can never help
        ("deadline", 1, S.FAILED, ExitReason.DEADLINE_EXCEEDED),
    ],
)
def test_admission_refusals_back_off_or_finalize(predicate, times, state, exit_reason) -> None:  # type: ignore[no-untyped-def]
    left = [times]

    def admit(effect):  # type: ignore[no-untyped-def]
        if left[0] > 0:
            left[0] -= 1
            return AdmissionDenied(effect.request_id, predicate, "test refusal")
        return None

    clock = FakeClock()
    sim = Sim(finish_after(1), clock, admit=admit)
    sim.start(created(clock))
    rec = sim.run()
    assert (rec.state, rec.exit_reason) == (state, exit_reason)


def test_a_restart_mid_model_call_charges_the_whole_reservation() -> None:
    clock = FakeClock()
    sim = Sim(finish_after(0), clock, hold_model=True)
    sim.start(created(clock, check="always"))
    sim.run()
    call_in_flight = sim.rec.model_call
    assert call_in_flight is not None and call_in_flight.prompt_tokens > 0
    reserved = call_in_flight.prompt_tokens + call_in_flight.max_tokens
    # When a new incarnation recovers (the call's outcome died with the old one) and continues
    sim.hold_model = False
    sim.restart()
    rec = sim.run(until=clock.wall() + 1)
    # Then the lost call was charged its prompt estimate plus its output ceiling, then the next call's usage
    assert rec.spend.get("tokens") == reserved + 105
    assert rec.state is S.COMPLETED
    assert sim.settled_grants[call_in_flight.grant_id] == reserved  # the scheduler was told too


def test_a_restart_does_not_reset_loop_detection() -> None:
    clock = FakeClock()
    sim = Sim(lambda m: call("run_tests", {"suite": "same"}, tool_results(m)), clock, hold_model=True)
    sim.start(created(clock))
    # two identical calls, then the process dies while the third turn's model call is in flight
    for _ in range(2):
        sim.run()
        sim.release_model()
    sim.run()
    assert sim.rec.turn_count == 3 and sim.rec.state is S.CALLING_MODEL
    sim.hold_model = False
    sim.restart()
    rec = sim.run()
    # the watchdog window survived the restart: the next identical call is withheld
    assert sim.tools.delivered("run_tests") == 2 and rec.hold is not None


def test_a_locally_refused_call_is_absent_and_never_enters_the_breaker_window() -> None:
    # Given a tool adapter that refuses before sending (e.g. its deadline already passed)
    clock = FakeClock()
    sim = Sim(finish_after(1), clock)
    sim.tools.behaviour["run_tests"] = lambda inv: ToolOutcome(
        Settlement.ESTABLISHED_ABSENT, OutcomeClass.CLIENT_REJECTION, error="not sent: deadline passed"
    )
    sim.start(created(clock, check="always"))
    rec = sim.run()
    # Then it is not stranded: settled established-absent, the trajectory ended normally, and the permit was
    # released without recording the outcome in the breaker's window
    op = next(iter(rec.operations.values()))
    assert op.settlement is Settlement.ESTABLISHED_ABSENT and rec.state is S.COMPLETED
    assert [r.outcome for r in sim.released] == [None]


def test_a_result_for_an_older_attempt_is_ignored_while_a_newer_one_is_pending() -> None:
    clock = FakeClock()
    sim = Sim(finish_after(1), clock)
    sim.tools.behaviour["run_tests"] = lambda inv: None
    sim.start(created(clock, check="always"))
    sim.run(until=clock.wall() + 1)
    pending = next(iter(sim.rec.pending_calls.values()))
    stale = ToolOutcomeReceived(
        pending.call_id,
        pending.operation_id,
        "op-x#a0",
        ToolOutcome(Settlement.ESTABLISHED, OutcomeClass.SUCCESS, {}),
    )
    decision = sim.feed(stale)
    assert decision.events == () and sim.rec.pending_calls


def test_a_refused_message_is_audited_and_never_spends_its_id() -> None:
    clock = FakeClock()
    sim = Sim(finish_after(1), clock, hold_model=True)
    sim.start(created(clock))
    sim.run()
    # When the shell refuses a tampered copy twice (a redelivery), then the genuine message arrives
    first = sim.refuse("m-1", "BAD_SIGNATURE", "signature of 'mallory' does not verify")
    again = sim.refuse("m-1", "BAD_SIGNATURE")
    genuine = sim.control("m-1", ControlAction.PAUSE, reason="the operator's own message")
    # Then both refusals are audited, the genuine message is recorded (verify before dedupe: a tampered
    # copy cannot cancel it), and a replay of the genuine one is a duplicate that is not audited again
    assert (first, again, genuine) == ("rejected", "rejected", "recorded")
    assert sim.refuse("m-1", "REPLAYED") == "duplicate"
    audits = [(a.subject, a.reason) for a in sim.rec.audit if a.kind is AuditKind.CONTROL_REJECTED]
    assert audits == [("m-1", "BAD_SIGNATURE")] * 2
    assert fold(sim.log, sim.policy) == sim.rec
