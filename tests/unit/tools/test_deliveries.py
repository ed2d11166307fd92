"""The testbed ledger's record of physical deliveries, and the duplicate-delivery judge built on it."""

from __future__ import annotations

import pytest

from runtime.clock import FakeClock
from testbed.tools.faults import EffectKeys, FaultInjector, FaultPlan
from testbed.tools.ledger import NOT_REPEATABLE, Ledger, LedgerSnapshot


def deliver(ledger: Ledger, tool: str, key: str, prior: str, disposition: str, attempt: str = "a1") -> int:
    seq = ledger.arrived(
        tool=tool,
        effect_key=key,
        call_id="call-1",
        attempt_id=attempt,
        operation_id="op-1",
        trajectory_id="t-1",
        prior=prior,
    )
    ledger.disposed(seq, disposition, "answered")
    return seq


@pytest.mark.parametrize(
    ("prior", "disposition", "duplicate"),
    [
        ("new", "applied", False),  # the first delivery of a key
        ("absent", "applied", False),  # a retry after the service refused: established absent first
        ("applied", "applied", True),  # a re-dispatch of an applied effect, applied again
        ("applied", "deduplicated", True),  # ...still a re-dispatch when the service answered from memory
        ("in_flight", "deduplicated", True),  # sent again while the first was still being applied
        ("unknown", "applied", True),  # sent again after a half-done attempt
        ("applied", "fenced", False),  # an old attempt arriving late, refused by the probe's fence
        ("applied", "late", False),  # arrived past its deadline: refused before any look at the key
    ],
)
def test_a_duplicate_delivery_is_a_repeat_of_an_effect_nobody_established_absent(
    prior: str, disposition: str, duplicate: bool
) -> None:
    # Given one delivery of a provisioning key arriving with ``prior`` and disposed as ``disposition``
    ledger = Ledger(FakeClock())
    deliver(ledger, "provision_env", "ek-1", prior, disposition)
    # When the ledger is judged
    found = ledger.snapshot().duplicate_deliveries()
    # Then it is a duplicate exactly when it asked again for an effect that happened or might have
    assert (len(found) == 1) is duplicate


@pytest.mark.parametrize("tool", ["release_env", "run_tests", "search_packages"])
def test_repeats_of_idempotent_or_read_only_tools_are_no_defect(tool: str) -> None:
    # Given a second delivery of an applied key of a tool whose repeat changes nothing
    ledger = Ledger(FakeClock())
    deliver(ledger, tool, "ek-1", "new", "applied")
    deliver(ledger, tool, "ek-1", "applied", "applied", attempt="a2")
    # Then the judge of non-repeatable effects does not count it, but the deliveries are all there
    snap = ledger.snapshot()
    assert tool not in NOT_REPEATABLE
    assert snap.duplicate_deliveries() == []
    assert [d.attempt_id for d in snap.deliveries_for("ek-1")] == ["a1", "a2"]


def test_deliveries_are_recorded_apart_from_what_was_applied() -> None:
    # Given a service that deduplicated a repeat (one environment applied, two deliveries)
    clock = FakeClock()
    ledger = Ledger(clock, effect_keys=EffectKeys.HONOUR.value)
    ledger.allocate("tenant-a", "ek-1")
    deliver(ledger, "provision_env", "ek-1", "new", "applied")
    clock.advance(2.0)
    deliver(ledger, "provision_env", "ek-1", "applied", "deduplicated", attempt="a2")
    snap = ledger.snapshot()
    # Then the applied effects show no duplicate, while the deliveries show the re-dispatch, with times
    assert snap.duplicate_effects() == []
    [dup] = snap.duplicate_deliveries()
    assert (dup.attempt_id, dup.prior, dup.disposition, dup.reply) == (
        "a2",
        "applied",
        "deduplicated",
        "answered",
    )
    first, second = snap.deliveries_for("ek-1")
    assert second.arrived_at - first.arrived_at == pytest.approx(2.0)
    assert snap.effect_keys == "honour"


def test_a_delivery_not_yet_disposed_counts_by_its_arrival() -> None:
    # Given a repeat still being handled (no disposition yet)
    ledger = Ledger(FakeClock())
    ledger.arrived(
        tool="send_notification",
        effect_key="ek-n",
        call_id="c",
        attempt_id="a2",
        operation_id="op",
        trajectory_id="t",
        prior="applied",
    )
    # Then it already counts: arriving for an applied key is the defect, whatever comes of it
    [pending] = ledger.snapshot().duplicate_deliveries()
    assert (pending.disposition, pending.reply) == ("pending", "pending")


def test_the_snapshot_survives_the_wire_format() -> None:
    # Given a ledger with deliveries
    ledger = Ledger(FakeClock(), effect_keys="honour")
    deliver(ledger, "provision_env", "ek-1", "new", "applied")
    deliver(ledger, "provision_env", "ek-1", "applied", "deduplicated", attempt="a2")
    # When it travels as the LedgerService reply
    back = LedgerSnapshot.from_proto(ledger.to_proto())
    # Then nothing is lost
    assert back == ledger.snapshot()


@pytest.mark.parametrize(("honour", "expected"), [(None, None), (True, True), (False, False)])
def test_a_fault_plan_names_key_honouring_or_leaves_it_to_the_testbed(
    honour: bool | None, expected: bool | None
) -> None:
    from actors.tools_grpc.codec import ToolCall

    injector = FaultInjector({"provision_env": "env-provisioner"})
    injector.set_plan("env-provisioner", FaultPlan(honour_effect_keys=honour))
    call = ToolCall("provision_env", {}, "k", "op", "a", 0.0, "t", "c", 0)
    assert injector.honour_effect_keys(call) is expected
    assert FaultPlan().honour_effect_keys is None  # by default the testbed's mode decides
