"""The turn loop end to end against in-process fakes (no Ray, no Redis, fake clock)."""

from __future__ import annotations

import asyncio
import json

import pytest

from runtime.clock import FakeClock
from runtime.codec import decode
from runtime.dispatch import UnlimitedAdmission
from runtime.errors import AdmissionRefused
from runtime.events import LateResultDropped, ObservationAppended, ObservationKind, ToolDispatchIntent
from runtime.fingerprint import call_digest
from runtime.fold import fold
from runtime.memstore import MemoryLogStore
from runtime.ports import ModelReply, Settlement, StopReason, Usage
from runtime.record import AuditKind, ControlAction
from runtime.states import ExitReason, TrajectoryState

from .fakes import (
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


async def _run(h, clock):  # type: ignore[no-untyped-def]
    task = asyncio.ensure_future(h.run())
    await settle_loop(clock, task)
    return task.result().record


async def _folded(log: MemoryLogStore, tid: str = "t1"):  # type: ignore[no-untyped-def]
    return fold([decode(p) for _, p in await log.read(tid)])


async def test_finish_after_two_calls_completes_and_log_folds_to_live_record() -> None:
    # Given a model that calls run_tests twice, then ends its turn
    clock, log, tools = FakeClock(), MemoryLogStore(), FakeTools()
    h = harness(ScriptedModel(finish_after(2)), tools, clock, log)
    await h.create(created(clock))
    # When the harness runs it to the end
    rec = await _run(h, clock)
    # Then the completion check passed, each call had one effect, and the log rebuilds the same record
    assert rec.state is S.COMPLETED and rec.exit_reason is ExitReason.COMPLETED and rec.check_passed
    assert rec.turn_count == 3
    assert tools.ledger.by_tool["run_tests"] == 2 and tools.ledger.duplicates() == 0
    assert await _folded(log) == rec
    assert rec.spend.get("tokens") == 3 * 100 + 20 + 20 + 5


async def test_end_turn_without_evidence_fails_the_completion_check() -> None:
    # Given a model that claims to be done at once, under a check that needs one tool result
    clock, tools = FakeClock(), FakeTools()
    h = harness(ScriptedModel(lambda m: done()), tools, clock)
    await h.create(created(clock))
    rec = await _run(h, clock)
    # Then the claim is only a request: the check fails and the trajectory ends FAILED
    assert rec.state is S.FAILED and rec.exit_reason is ExitReason.COMPLETION_CHECK_FAILED


async def test_truncated_reply_is_never_dispatched() -> None:
    # Given a model whose first reply is cut at max_tokens in the middle of a tool call
    def script(messages):  # type: ignore[no-untyped-def]
        if not any("output-token ceiling" in str(m.get("content")) for m in messages):
            return ModelReply(StopReason.MAX_TOKENS, '{"suite": "a', [], Usage(100, 0, 256))
        return call("run_tests", {"suite": "a"}, 1) if tool_results(messages) == 0 else done()

    clock, tools = FakeClock(), FakeTools()
    h = harness(ScriptedModel(script), tools, clock)
    await h.create(created(clock))
    rec = await _run(h, clock)
    # Then only the later, complete call reached the tool service
    assert tools.ledger.by_tool["run_tests"] == 1
    intents = [e for e in h.events if isinstance(e, ToolDispatchIntent)]
    assert len(intents) == 1 and rec.state is S.COMPLETED


async def test_malformed_tool_json_is_refused_locally_and_never_dispatched() -> None:
    # Given a model that proposes a call whose arguments are not JSON, then ends
    def script(messages):  # type: ignore[no-untyped-def]
        return call("run_tests", '{"suite": "a",', 0) if tool_results(messages) == 0 else done()

    clock, tools = FakeClock(), FakeTools()
    h = harness(ScriptedModel(script), tools, clock)
    await h.create(created(clock))
    rec = await _run(h, clock)
    # Then nothing was dispatched, the model saw a structured refusal for that call id
    assert sum(tools.ledger.by_tool.values()) == 0
    refusals = [
        e for e in h.events if isinstance(e, ObservationAppended) and e.observation is ObservationKind.REFUSAL
    ]
    assert len(refusals) == 1 and refusals[0].call_id == "call-0"
    assert rec.state is S.FAILED  # no tool result: the completion check fails


async def test_tool_deadline_times_out_then_late_result_is_dropped_and_audited() -> None:
    # Given a tool that hangs past its deadline
    clock, tools = FakeClock(), FakeTools()
    tools.hang["run_tests"] = asyncio.Event()
    h = harness(ScriptedModel(finish_after(1)), tools, clock, tool_timeout_s=5.0)
    await h.create(created(clock, check="always"))
    task = asyncio.ensure_future(h.run())
    # When the clock passes the deadline
    for _ in range(200):
        await asyncio.sleep(0)
    clock.advance(6.0)
    for _ in range(200):
        await asyncio.sleep(0)
    # Then the call timed out and the trajectory moved on while the tool still hangs
    assert any(e.kind == "tool_call_timed_out" for e in h.events)
    # And when the late result finally arrives, it is dropped and audited, not appended as a result
    await settle_loop(clock, task)
    tools.hang["run_tests"].set()
    for _ in range(200):
        await asyncio.sleep(0)
    rec = h.record
    assert rec.state is S.COMPLETED  # the trajectory did not wait for the hung call
    assert any(a.kind is AuditKind.LATE_RESULT_DROPPED for a in rec.audit)
    assert not any(e.kind == "tool_result_accepted" for e in h.events)
    assert any(isinstance(e, LateResultDropped) for e in h.events)
    # And the late result still settles its operation (correlated evidence), so nothing stays in doubt
    op = next(iter(rec.operations.values()))
    assert op.settlement is Settlement.ESTABLISHED and not op.in_doubt


async def test_irreversible_call_waits_for_approval_then_dispatches_exactly_once() -> None:
    # Given a model that proposes an irreversible notify call
    args = {"channel": "ops", "text": "deploying"}

    def script(messages):  # type: ignore[no-untyped-def]
        return call("notify", args, 0) if tool_results(messages) == 0 else done()

    clock, tools = FakeClock(), FakeTools()
    h = harness(ScriptedModel(script), tools, clock, approval_timeout_s=60.0)
    await h.create(created(clock))
    task = asyncio.ensure_future(h.run())
    for _ in range(200):
        await asyncio.sleep(0)
    # Then it is held, undispatched
    assert h.record.state is S.AWAITING_APPROVAL and sum(tools.ledger.by_tool.values()) == 0
    # When an operator approves the exact digest
    digest = call_digest("notify", args)
    assert h.record.held is not None and h.record.held.digest == digest
    await h.deliver_control("m1", ControlAction.APPROVE, "alice", "ok", {"digest": digest})
    await settle_loop(clock, task)
    # Then it ran exactly once and the trajectory completed
    assert tools.ledger.by_tool["notify"] == 1 and task.result().record.state is S.COMPLETED


async def test_approval_with_stale_digest_is_refused_and_never_dispatched() -> None:
    args = {"channel": "ops", "text": "deploying"}

    def script(messages):  # type: ignore[no-untyped-def]
        return call("notify", args, 0) if tool_results(messages) == 0 else done()

    clock, tools = FakeClock(), FakeTools()
    h = harness(ScriptedModel(script), tools, clock)
    await h.create(created(clock))
    task = asyncio.ensure_future(h.run())
    for _ in range(200):
        await asyncio.sleep(0)
    # When the approval binds to a different call
    await h.deliver_control("m1", ControlAction.APPROVE, "alice", "ok", {"digest": "0" * 64})
    await settle_loop(clock, task)
    # Then the model received a REFUSED observation and nothing was dispatched
    refusal = next(
        e for e in h.events if isinstance(e, ObservationAppended) and e.observation is ObservationKind.REFUSAL
    )
    assert json.loads(refusal.content)["reason"] == "STALE_DIGEST"
    assert sum(tools.ledger.by_tool.values()) == 0


async def test_silence_until_expiry_is_denial() -> None:
    args = {"channel": "ops", "text": "x"}

    def script(messages):  # type: ignore[no-untyped-def]
        return call("notify", args, 0) if tool_results(messages) == 0 else done()

    clock, tools = FakeClock(), FakeTools()
    h = harness(ScriptedModel(script), tools, clock, approval_timeout_s=30.0)
    await h.create(created(clock))
    rec = await _run(h, clock)  # settle_loop advances the clock past the expiry
    refusal = next(
        e for e in h.events if isinstance(e, ObservationAppended) and e.observation is ObservationKind.REFUSAL
    )
    assert json.loads(refusal.content)["reason"] == "APPROVAL_EXPIRED"
    assert sum(tools.ledger.by_tool.values()) == 0 and rec.is_terminal


async def test_turn_budget_halts_with_binding_dimension() -> None:
    # Given a model that never stops calling tools, under a 4-turn budget
    def script(messages):  # type: ignore[no-untyped-def]
        k = tool_results(messages)
        return call("run_tests", {"suite": f"s{k}"}, k)

    clock, tools = FakeClock(), FakeTools()
    h = harness(ScriptedModel(script), tools, clock)
    await h.create(created(clock, ceilings={"turns": 4, "tokens": 1e6, "dollars": 10}))
    rec = await _run(h, clock)
    # Then it halts at the ceiling, FAILED with BUDGET_EXCEEDED and turns as the binding dimension
    assert rec.state is S.FAILED and rec.exit_reason is ExitReason.BUDGET_EXCEEDED
    assert rec.binding_dimension == "turns" and rec.turn_count == 4
    assert rec.spend.get("turns") <= 4


async def test_watchdog_stops_an_exact_repeat_loop_before_the_budget() -> None:
    # Given a model that repeats one identical call forever
    clock, tools = FakeClock(), FakeTools()
    h = harness(ScriptedModel(lambda m: call("run_tests", {"suite": "same"}, tool_results(m))), tools, clock)
    await h.create(created(clock))
    rec = await _run(h, clock)
    # Then the watchdog stops it on the third identical call, far below the 20-turn budget
    assert rec.state is S.FAILED and rec.exit_reason is ExitReason.ERROR
    assert rec.turn_count == 3


async def test_kill_mid_model_call_aborts_stream_and_charges_emitted_tokens() -> None:
    # Given a model call in flight
    clock, tools = FakeClock(), FakeTools()
    model = ScriptedModel(finish_after(1), gate=asyncio.Event())
    h = harness(model, tools, clock)
    await h.create(created(clock))
    task = asyncio.ensure_future(h.run())
    await model.started.wait()
    # When an operator kills it
    await h.deliver_control("k1", ControlAction.KILL, "alice", "runaway")
    await settle_loop(clock, task)
    rec = task.result().record
    # Then the stream was aborted, its billed tokens charged, and it went through FINALIZING to FAILED
    assert rec.state is S.FAILED and rec.exit_reason is ExitReason.KILLED
    assert rec.spend.get("tokens") == 107
    assert any(t.to_state is S.FINALIZING for t in rec.history)


async def test_pause_applies_at_boundary_and_resume_continues() -> None:
    clock, tools = FakeClock(), FakeTools()
    model = ScriptedModel(finish_after(1), gate=asyncio.Event())
    h = harness(model, tools, clock)
    await h.create(created(clock))
    task = asyncio.ensure_future(h.run())
    await model.started.wait()
    # When a pause arrives mid-call, the stream is aborted and the pause applies at the boundary
    await h.deliver_control("p1", ControlAction.PAUSE, "alice", "lunch")
    for _ in range(200):
        await asyncio.sleep(0)
    assert h.record.state is S.PAUSED
    # And resume continues it to completion
    model.gate.set()  # type: ignore[union-attr]
    await h.deliver_control("r1", ControlAction.RESUME, "alice", "back")
    await settle_loop(clock, task)
    assert task.result().record.state is S.COMPLETED


async def test_duplicate_control_delivery_changes_the_record_once() -> None:
    clock, tools = FakeClock(), FakeTools()
    h = harness(ScriptedModel(finish_after(1)), tools, clock)
    await h.create(created(clock))
    first = await h.deliver_control(
        "m1", ControlAction.INTERRUPT, "alice", "hint", {"message": "try suite b"}
    )
    second = await h.deliver_control(
        "m1", ControlAction.INTERRUPT, "alice", "hint", {"message": "try suite b"}
    )
    assert (first, second) == ("recorded", "duplicate")
    assert len(h.record.pending_control) == 1


async def test_restart_mid_tool_call_does_not_repeat_a_never_repeat_effect() -> None:
    # Given an approved irreversible call whose result was never logged (the actor died mid-call)
    args = {"channel": "ops", "text": "x"}

    def script(messages):  # type: ignore[no-untyped-def]
        return call("notify", args, 0) if tool_results(messages) == 0 else done()

    clock, log, tools = FakeClock(), MemoryLogStore(), FakeTools()
    tools.hang["notify"] = asyncio.Event()
    h1 = harness(ScriptedModel(script), tools, clock, log)
    await h1.create(created(clock, check="always"))
    t1 = asyncio.ensure_future(h1.run())
    for _ in range(200):
        await asyncio.sleep(0)
    await h1.deliver_control(
        "m1", ControlAction.APPROVE, "alice", "ok", {"digest": call_digest("notify", args)}
    )
    await tools.invoked.wait()
    # the process dies: nothing it does after the intent reaches the log
    log.unavailable = "process died"
    t1.cancel()
    tools.hang["notify"].set()
    for _ in range(200):
        await asyncio.sleep(0)
    await h1.close()
    log.unavailable = None
    # When a new harness recovers from the same log
    fresh_tools = FakeTools()
    fresh_tools.ledger = tools.ledger
    h2 = harness(ScriptedModel(script), fresh_tools, clock, log)
    await h2.recover()
    assert h2.record.state is S.WAITING_TOOL
    task = asyncio.ensure_future(h2.run())
    await settle_loop(clock, task)
    rec = task.result().record
    # Then the in-doubt operation was not re-dispatched and the ledger holds at most one effect
    op = next(iter(rec.operations.values()))
    assert op.attempts == 1 and op.in_doubt
    assert tools.ledger.duplicates() == 0 and rec.is_terminal


class _RefusingAdmission(UnlimitedAdmission):
    """Refuses the first ``times`` turns with ``predicate``, then admits."""

    def __init__(self, clock: FakeClock, predicate: str, times: int) -> None:
        super().__init__(clock)
        self.predicate, self.times = predicate, times

    async def admit_turn(self, request):  # type: ignore[no-untyped-def]
        if self.times > 0:
            self.times -= 1
            raise AdmissionRefused(self.predicate, "test refusal")
        return await super().admit_turn(request)


@pytest.mark.parametrize(
    ("predicate", "times", "state", "exit_reason"),
    [
        ("shutdown", 2, S.COMPLETED, ExitReason.COMPLETED),  # transient: backs off and tries again
        ("exceeds_capacity", 1, S.FAILED, ExitReason.ERROR),  # waiting can never help
        ("deadline", 1, S.FAILED, ExitReason.DEADLINE_EXCEEDED),
    ],
)
async def test_admission_refusals_back_off_or_finalize(predicate, times, state, exit_reason) -> None:  # type: ignore[no-untyped-def]
    clock, tools = FakeClock(), FakeTools()
    h = harness(ScriptedModel(finish_after(1)), tools, clock)
    h.ports.admission = _RefusingAdmission(clock, predicate, times)
    await h.create(created(clock))
    rec = await _run(h, clock)
    assert (rec.state, rec.exit_reason) == (state, exit_reason)


async def test_approval_without_a_digest_approves_nothing() -> None:
    # Given a held irreversible call
    args = {"channel": "ops", "text": "x"}

    def script(messages):  # type: ignore[no-untyped-def]
        return call("notify", args, 0) if tool_results(messages) == 0 else done()

    clock, tools = FakeClock(), FakeTools()
    h = harness(ScriptedModel(script), tools, clock)
    await h.create(created(clock))
    task = asyncio.ensure_future(h.run())
    for _ in range(200):
        await asyncio.sleep(0)
    # When an approval arrives that names no digest
    await h.deliver_control("m1", ControlAction.APPROVE, "alice", "ok", {})
    await settle_loop(clock, task)
    # Then it is refused: an approval binds to one exact call, never to "whatever is held"
    refusal = next(
        e for e in h.events if isinstance(e, ObservationAppended) and e.observation is ObservationKind.REFUSAL
    )
    assert json.loads(refusal.content)["reason"] == "MISSING_DIGEST"
    assert sum(tools.ledger.by_tool.values()) == 0


async def test_restart_mid_model_call_charges_the_whole_reservation() -> None:
    # Given a model call whose intent is logged when the process dies
    clock, log, tools = FakeClock(), MemoryLogStore(), FakeTools()
    model = ScriptedModel(finish_after(0), gate=asyncio.Event())
    h1 = harness(model, tools, clock, log)
    await h1.create(created(clock, check="always"))
    t1 = asyncio.ensure_future(h1.run())
    await model.started.wait()
    log.unavailable = "process died"
    t1.cancel()
    await h1.close()
    log.unavailable = None
    # When a new harness recovers and continues
    h2 = harness(ScriptedModel(finish_after(0)), tools, clock, log)
    rec = await h2.recover()
    assert rec.state is S.CALLING_MODEL and rec.model_call is not None
    reserved = rec.model_call.prompt_tokens + rec.model_call.max_tokens
    task = asyncio.ensure_future(h2.run())
    await settle_loop(clock, task)
    final = task.result().record
    # Then the lost call was charged its prompt estimate plus its output ceiling, then the next call's usage
    assert rec.model_call.prompt_tokens > 0
    assert final.spend.get("tokens") == reserved + 105
    assert final.state is S.COMPLETED


async def test_restart_does_not_reset_loop_detection() -> None:
    # Given a trajectory that made the same call twice, then lost its process between turns
    repeat = ScriptedModel(lambda m: call("run_tests", {"suite": "same"}, tool_results(m)))
    clock, log, tools = FakeClock(), MemoryLogStore(), FakeTools()
    h1 = harness(repeat, tools, clock, log)
    await h1.create(created(clock))
    t1 = asyncio.ensure_future(h1.run())
    for _ in range(2000):
        await asyncio.sleep(0)
        if h1.record.turn_count == 2 and h1.record.state is S.READY:
            break
    log.unavailable = "process died"
    t1.cancel()
    await h1.close()
    log.unavailable = None
    # When a new harness recovers and the model repeats the call once more
    h2 = harness(repeat, tools, clock, log)
    await h2.recover()
    assert h2.record.turn_count == 2
    rec = await _run(h2, clock)
    # Then the watchdog still counts the two calls before the crash and stops it on the third
    assert rec.exit_reason is ExitReason.ERROR and rec.turn_count == 3
