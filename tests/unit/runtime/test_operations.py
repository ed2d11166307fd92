"""The settlement rule (recovery chapter): unknown until correlated evidence, settled is final, a retry
only when the evidence or the repeat contract makes re-execution safe."""

from __future__ import annotations

import pytest

from runtime import (
    ExitReason,
    IllegalEvent,
    Operation,
    OperationSettled,
    ToolCallCancelled,
    ToolCallTimedOut,
    TrajectoryState,
    may_redispatch,
    outstanding_liability,
    settle,
    unsettled,
)
from runtime.ports import Settlement
from tests.unit.runtime.scenario import in_state, intent

S = TrajectoryState
U, E, A = Settlement.UNKNOWN, Settlement.ESTABLISHED, Settlement.ESTABLISHED_ABSENT


def op(settlement: Settlement = U, *, repeat_safe: bool = False, liability: float = 1.0) -> Operation:
    return Operation("op-1", "c1", "write_file", "ek-1", 1, "at-1", settlement, liability=liability,
                     repeat_safe=repeat_safe)  # fmt: skip


@pytest.mark.parametrize(
    ("before", "evidence", "after"),
    [(U, U, U), (U, E, E), (U, A, A), (E, E, E), (A, A, A), (E, A, None), (A, E, None), (E, U, None)],
)
def test_settlement_moves_only_from_unknown(
    before: Settlement, evidence: Settlement, after: Settlement | None
) -> None:
    if after is None:
        with pytest.raises(ValueError, match="cannot become"):
            settle(op(before), evidence)
    else:
        assert settle(op(before), evidence).settlement is after


@pytest.mark.parametrize(
    ("settlement", "repeat_safe", "allowed"),
    [(U, False, False), (U, True, True), (A, False, True), (E, False, False), (E, True, False)],
)
def test_settlement_before_retry(settlement: Settlement, repeat_safe: bool, allowed: bool) -> None:
    assert may_redispatch(op(settlement, repeat_safe=repeat_safe)) is allowed


def test_unsettled_operations_keep_their_liability_reserved() -> None:
    ops = [op(U, liability=2.0), op(E, liability=5.0), op(A, liability=7.0)]
    assert outstanding_liability(ops) == 2.0
    assert [o.settlement for o in unsettled(ops)] == [U]


def test_a_timed_out_write_is_not_redispatched_until_settled() -> None:
    # Given a non-idempotent write that timed out (its outcome is unknown)
    log = in_state(S.READY)
    log.call_model()
    log.dispatch("c1", "write_file")
    log.add(ToolCallTimedOut("c1"))
    retry = intent("c1", "write_file", attempt_id="at-c1-2")
    # When a retry is attempted, then it is refused: a timeout settles nothing
    with pytest.raises(IllegalEvent) as info:
        log.add(retry)
    assert info.value.rule == "settlement_before_retry"
    # And once a probe establishes the effect is absent, the same operation may be attempted again
    log.add(OperationSettled("op-c1", A, "probe: no row for ek-c1"))
    record = log.add(retry)
    assert record.operations["op-c1"].attempts == 2
    assert record.operations["op-c1"].settlement is U
    with pytest.raises(IllegalEvent) as info:
        log.add(ToolCallTimedOut("c1"), intent("c1", "write_file", attempt_id="at-c1-2"))
    assert info.value.rule in {"attempt_id_reused", "settlement_before_retry"}


def test_kill_leaves_inflight_operations_in_doubt_with_an_owner() -> None:
    log = in_state(S.WAITING_TOOL)
    log.finalize(ExitReason.KILLED)
    record = log.add(ToolCallCancelled("c1", "kill"))
    operation = record.operations["op-c1"]
    assert (operation.settlement, operation.in_doubt, operation.owner) == (U, True, "traj-1")


def test_the_operation_of_a_call_is_its_latest_dispatch_found_from_either_lookup() -> None:
    # Given a record whose calls c1 and c2 each have operations, c1 a second one dispatched later
    from runtime._replace import replace

    ops = {
        "op-a": Operation("op-a", "c1", "read", "ek-a", 1, "at-a"),
        "op-b": Operation("op-b", "c2", "read", "ek-b", 1, "at-b"),
        "op-c": Operation("op-c", "c1", "read", "ek-c", 2, "at-c"),
        "op-d": Operation("op-d", "c3", "read", "ek-d", 1, "at-d"),
    }
    record = replace(in_state(S.READY).record, operations=ops)
    # Then both lookups name the latest operation of each call, and nothing for a call never dispatched
    assert record.operation_for_call("c1") is ops["op-c"]
    assert record.operation_for_call("c2") is ops["op-b"]
    assert record.operation_for_call("c9") is None
    assert record.operations_by_call() == {"c1": ops["op-c"], "c2": ops["op-b"], "c3": ops["op-d"]}
