"""Harness.reject_control: the shell's verification refusals are audited once, in the durable log."""

from __future__ import annotations

from runtime.clock import FakeClock
from runtime.codec import decode
from runtime.fold import fold
from runtime.memstore import MemoryLogStore
from runtime.record import AuditKind, ControlAction

from .fakes import FakeTools, ScriptedModel, created, finish_after, harness


async def test_a_refused_message_is_audited_and_never_spends_its_id() -> None:
    # Given a live trajectory
    clock, log = FakeClock(), MemoryLogStore()
    h = harness(ScriptedModel(finish_after(1)), FakeTools(), clock, log)
    await h.create(created(clock))
    # When the shell refuses a tampered copy twice (a redelivery), then the genuine message arrives
    first = await h.reject_control("m-1", "BAD_SIGNATURE", "signature of 'mallory' does not verify")
    again = await h.reject_control("m-1", "BAD_SIGNATURE")
    genuine = await h.deliver_control("m-1", ControlAction.PAUSE, "alice", "the operator's own message")
    # Then both refusals are audited, the genuine message is recorded (verify before dedupe: a tampered
    # copy cannot cancel it), and the record survives a fold of the log
    assert (first, again, genuine) == (True, True, "recorded")
    audits = [a for a in h.record.audit if a.kind is AuditKind.CONTROL_REJECTED]
    assert [(a.subject, a.reason) for a in audits] == [("m-1", "BAD_SIGNATURE")] * 2
    assert fold([decode(p) for _, p in await log.read("t1")]) == h.record
    assert [p.message_id for p in h.record.pending_control] == ["m-1"]
