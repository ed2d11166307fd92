"""The ``Recovered`` input, row by row (``runtime._decide_recover``), plus lost replies and probes.

Each row: a trajectory driven into a state, its actor lost (everything in flight dies with it), then a new
incarnation folds the log and decides ``Recovered``. Judged by the folded record and the tool service's
own delivery record.
"""

from __future__ import annotations

import pytest

from runtime._decide_cleanup import FORWARD_PROBE_ASKS
from runtime.clock import FakeClock
from runtime.decider import decide
from runtime.effects import ProbeTool, RequestAdmission, SettleAdmission, StartTimer
from runtime.events import ModelCallFailed, OperationMarkedInDoubt, ToolCallCancelled, TurnAbandoned
from runtime.fingerprint import call_digest
from runtime.fold import fold
from runtime.inputs import Recovered
from runtime.ports import OutcomeClass, ProbeResult, Settlement, ToolOutcome
from runtime.record import ControlAction, QueueStage
from runtime.states import TrajectoryState
from runtime.tools import RepeatContract

from .sim import (
    HOLD,
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


def _provision(repeat: RepeatContract) -> tuple[Sim, FakeClock]:
    clock = FakeClock()
    probe = repeat is not RepeatContract.NEVER_REPEAT

    def script(messages):  # type: ignore[no-untyped-def]
        return call("provision_env", {"name": "e1"}, 0) if tool_results(messages) == 0 else done()

    contracts = provision_contracts(repeat, probe=probe)
    sim = Sim(script, clock, pol=policy(registry(*contracts), tool_timeout_s=5.0))
    sim.start(created(clock, check="always", tools=frozenset({"provision_env", "release_env"})))
    return sim, clock


def _decide_recovered(sim: Sim, clock: FakeClock):  # type: ignore[no-untyped-def]
    return decide(fold(sim.log, sim.policy), Recovered(), clock.wall())


def test_row_ready_a_lost_admission_request_is_abandoned_and_asked_again() -> None:
    clock = FakeClock()
    sim = Sim(finish_after(1), clock, admit=lambda effect: AdmissionHeld)  # type: ignore[arg-type,return-value]
    sim.start(created(clock))
    assert sim.rec.turn_request is not None
    decision = _decide_recovered(sim, clock)
    assert isinstance(decision.events[0], TurnAbandoned)
    assert [type(e) for e in decision.effects if not isinstance(e, StartTimer)] == [RequestAdmission]


class AdmissionHeld:  # never answered: the admission request is in flight when the actor dies
    pass


def test_row_calling_model_the_lost_call_is_charged_its_reservation() -> None:
    clock = FakeClock()
    sim = Sim(finish_after(0), clock, hold_model=True)
    sim.start(created(clock, check="always"))
    sim.run()
    call_in_flight = sim.rec.model_call
    assert call_in_flight is not None
    decision = _decide_recovered(sim, clock)
    failed = next(e for e in decision.events if isinstance(e, ModelCallFailed))
    assert failed.usage.total == call_in_flight.prompt_tokens + call_in_flight.max_tokens
    assert SettleAdmission(call_in_flight.grant_id, failed.usage.total) in decision.effects


@pytest.mark.parametrize(
    ("repeat", "expect"),
    [
        (RepeatContract.IDEMPOTENT, "resent"),  # repeat-safe: sent again under the same effect key
        (RepeatContract.PROBE_THEN_RETRY, "probed"),  # ask the endpoint before anything else
        (RepeatContract.NEVER_REPEAT, "unknown"),  # left unknown, owned by the trajectory
    ],
)
def test_row_waiting_tool_dispatched_calls_follow_their_repeat_contract(
    repeat: RepeatContract, expect: str
) -> None:
    sim, clock = _provision(repeat)
    sim.tools.behaviour["provision_env"] = lambda inv: None
    sim.run(until=clock.wall() + 1)
    assert sim.rec.state is S.WAITING_TOOL
    decision = _decide_recovered(sim, clock)
    cancelled = [e for e in decision.events if isinstance(e, ToolCallCancelled)]
    assert len(cancelled) == 1  # in doubt first, whatever follows
    rec = fold([*sim.log, *decision.events], sim.policy)
    queued = list(rec.queued.values())
    if expect == "resent":
        assert [q.stage for q in queued] == [QueueStage.PERMIT] and queued[0].operation_id is not None
    elif expect == "probed":
        assert [q.stage for q in queued] == [QueueStage.PROBING]
        assert any(isinstance(e, ProbeTool) for e in decision.effects)
    else:
        assert not queued and any(isinstance(e, OperationMarkedInDoubt) for e in decision.events)
        op = next(iter(rec.operations.values()))
        assert op.in_doubt and op.owner == "t1"


def test_row_waiting_tool_a_queued_call_asks_for_its_permit_again() -> None:
    clock = FakeClock()
    sim = Sim(finish_after(1), clock, guard=lambda effect: HOLD)
    sim.start(created(clock))
    sim.run(until=clock.wall() + 1)
    assert sim.rec.queued
    sim.guard = None
    sim.restart()
    rec = sim.run()
    assert rec.state is S.COMPLETED and sim.tools.delivered("run_tests") == 1


def test_row_awaiting_approval_the_held_call_stays_held_and_its_timers_are_armed_again() -> None:
    args = {"channel": "ops", "text": "x"}

    def script(messages):  # type: ignore[no-untyped-def]
        return call("notify", args, 0) if tool_results(messages) == 0 else done()

    clock = FakeClock()
    sim = Sim(script, clock, pol=policy(approval_timeout_s=60.0))
    sim.start(created(clock, check="always"))
    sim.run(until=clock.wall() + 1)
    decision = _decide_recovered(sim, clock)
    assert decision.events == ()  # nothing changes in the record
    armed = {e.timer.kind.value for e in decision.effects if isinstance(e, StartTimer)}
    assert armed == {"deadline", "approval_expiry"}
    sim.restart()
    sim.control("a1", ControlAction.APPROVE, payload={"call_digest": call_digest("notify", args)})
    assert sim.run().state is S.COMPLETED and sim.tools.delivered("notify") == 1


@pytest.mark.parametrize(
    ("answer", "settled", "in_doubt"),
    [
        (Settlement.ESTABLISHED, True, False),  # the probe found the effect: settled established
        (Settlement.UNKNOWN, False, True),  # the probe could not tell: unknown, owned by the trajectory
    ],
)
def test_restart_mid_call_probes_and_never_redispatches(
    answer: Settlement, settled: bool, in_doubt: bool
) -> None:
    # Given a provisioning call dispatched and in flight when the process died
    sim, clock = _provision(RepeatContract.PROBE_THEN_RETRY)
    sim.tools.behaviour["provision_env"] = lambda inv: None
    sim.run(until=clock.wall() + 1)
    # When a fresh incarnation recovers and the dependency answers the probe with ``answer``
    sim.tools.behaviour.clear()
    sim.tools.probe_answers["provision_env"] = ProbeResult(answer, {"env_id": "env-1"} if settled else None)
    sim.restart()
    rec = sim.run()
    # Then it was probed once (and, still unknown at the exit, asked again a bounded number of times before
    # its obligation was given up), never dispatched again, and its operation is settled or owned
    op = next(op for op in rec.operations.values() if op.tool == "provision_env")
    assert sim.tools.probes.count(op.effect_key) == (1 if settled else 1 + FORWARD_PROBE_ASKS)
    assert op.attempts == 1 and sim.tools.delivered("provision_env") == 1
    assert (op.settled, op.in_doubt) == (settled, in_doubt)
    if settled:  # the probe's stored reply bound the cleanup: the environment was released on the way out
        assert sim.tools.delivered("release_env") == 1
    if in_doubt:  # owned all along; at the exit, handed off with the packet, never dropped
        assert op.owner == "operator" and rec.handoff is not None
        assert [u["operation_id"] for u in rec.handoff["pending"]["unknown_operations"]] == [op.operation_id]
    assert rec.is_terminal


def test_a_lost_reply_is_settled_by_a_probe_with_its_own_deadline() -> None:
    # Given a probe-then-retry tool whose reply is lost after the effect was applied
    sim, clock = _provision(RepeatContract.PROBE_THEN_RETRY)

    def applied_then_lost(inv):  # type: ignore[no-untyped-def]
        clock.advance(inv.deadline - clock.wall() + 1)  # the reply never came: its deadline is spent
        sim.tools.applied[inv.effect_key] += 1
        sim.tools.results[inv.effect_key] = {"env_id": "env-1"}
        return ToolOutcome(Settlement.UNKNOWN, OutcomeClass.INFRASTRUCTURE_FAILURE, error="deadline exceeded")

    sim.tools.behaviour["provision_env"] = applied_then_lost
    rec = sim.run()
    probes = [e for e in sim.effects if isinstance(e, ProbeTool)]
    # Then the probe was asked with a fresh deadline, settled the operation, and nothing repeated
    assert probes and probes[0].deadline > clock.wall() - 1
    op = next(iter(rec.operations.values()))
    assert op.settlement is Settlement.ESTABLISHED and op.attempts == 1
    assert sim.tools.duplicate_deliveries() == 0 and rec.state is S.COMPLETED
