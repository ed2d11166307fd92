"""Harness.reject_control: the shell's verification refusals are audited once, in the durable log."""

from __future__ import annotations

from runtime.clock import FakeClock
from runtime.codec import decode
from runtime.fold import fold
from runtime.memstore import MemoryLogStore
from runtime.record import AuditKind, ControlAction

from .fakes import FakeTools, ScriptedModel, created, finish_after, harness


async def test_a_refused_message_is_audited_once_and_its_id_is_then_spent() -> None:
    # Given a live trajectory
    clock, log = FakeClock(), MemoryLogStore()
    h = harness(ScriptedModel(finish_after(1)), FakeTools(), clock, log)
    await h.create(created(clock))
    # When the shell refuses a message twice (a redelivery), then the same id arrives again as valid
    first = await h.reject_control("m-forged", "BAD_SIGNATURE", "signature of 'mallory' does not verify")
    again = await h.reject_control("m-forged", "BAD_SIGNATURE")
    replay = await h.deliver_control("m-forged", ControlAction.KILL, "alice", "reuse of a refused id")
    # Then exactly one audit entry exists, it survives a fold of the log, and the id cannot be reused
    assert (first, again, replay) == (True, False, "duplicate")
    audits = [a for a in h.record.audit if a.kind is AuditKind.CONTROL_REJECTED]
    assert [(a.subject, a.reason) for a in audits] == [("m-forged", "BAD_SIGNATURE")]
    assert fold([decode(p) for _, p in await log.read("t1")]) == h.record
    assert h.record.pending_control == ()
