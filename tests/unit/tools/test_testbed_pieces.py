"""Pure pieces of the testbed and the effect table: fault plan validation, ledger bookkeeping,
settling effect entries, sandbox configuration checks."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest

from actors.sandbox import ResourceLimits, Sandbox
from actors.tools_grpc.effects import EffectOutcome, EffectState, EffectTable
from runtime.clock import FakeClock
from runtime.errors import InputError
from testbed.tools.faults import FaultInjector, FaultMode, FaultPlan
from testbed.tools.host import parse_fault_plans
from testbed.tools.ledger import Ledger


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"mode": "fail"}, "needs a status"),
        ({"mode": "fail", "status": "OK"}, "non-OK"),
        ({"mode": "fail", "status": "NOPE"}, "non-OK"),
        ({"mode": "explode"}, "mode"),
        ({"delay_s": -1}, "delay_s"),
        ({"count": 0}, "count"),
        ({"surprise": 1}, "surprise"),
    ],
)
def test_bad_fault_plans_are_rejected_with_the_field(raw: dict[str, object], message: str) -> None:
    with pytest.raises(InputError, match=message):
        parse_fault_plans(f'{{"notifier": {__import__("json").dumps(raw)}}}')


def test_fault_plan_status_is_normalised() -> None:
    plan = FaultPlan(mode=FaultMode.FAIL, status="unavailable")
    assert plan.status_code is grpc.StatusCode.UNAVAILABLE


def test_fault_count_is_consumed_per_call_and_scoped_to_the_service() -> None:
    # Given a drop-reply fault for the next two notifier calls
    injector = FaultInjector(
        {"send_notification": "notifier", "run_tests": "test-runner"},
        {"notifier": FaultPlan(mode=FaultMode.DUPLICATE, count=2)},
    )
    from actors.tools_grpc.codec import ToolCall

    def call(tool: str) -> ToolCall:
        return ToolCall(tool, {}, "k", "op", "a", 0.0, "t", "c", 0)

    # When calls arrive for both services
    seen = [injector.deliveries(call("send_notification")) for _ in range(3)]
    other = injector.deliveries(call("run_tests"))
    # Then only the first two notifier calls are affected
    assert seen == [2, 2, 1]
    assert other == 1


def test_rules_aimed_at_trajectories_hit_only_them_each_with_its_own_count() -> None:
    # Given two drop-reply rules on one service: one trajectory loses a provisioning reply, another a release
    injector = FaultInjector(
        {"provision_env": "env-provisioner", "release_env": "env-provisioner"},
        {
            "env-provisioner": [
                FaultPlan(
                    mode=FaultMode.DUPLICATE,
                    tools=frozenset({"provision_env"}),
                    trajectories=frozenset({"lost-provision"}),
                    count=1,
                ),
                FaultPlan(
                    mode=FaultMode.DUPLICATE,
                    tools=frozenset({"release_env"}),
                    trajectories=frozenset({"lost-release"}),
                    count=1,
                ),
            ]
        },
    )
    from actors.tools_grpc.codec import ToolCall

    def call(tool: str, tid: str) -> ToolCall:
        return ToolCall(tool, {}, "k", "op", "a", 0.0, tid, "c", 0)

    # When each trajectory (ids as a run prefixes them) calls both tools twice
    hits = {
        (tid, tool): [injector.deliveries(call(tool, f"run-1.{tid}")) for _ in range(2)]
        for tid in ("lost-provision", "lost-release", "bystander")
        for tool in ("provision_env", "release_env")
    }
    # Then each rule hit its own trajectory's tool once, and nothing else
    assert hits == {
        ("lost-provision", "provision_env"): [2, 1],
        ("lost-provision", "release_env"): [1, 1],
        ("lost-release", "provision_env"): [1, 1],
        ("lost-release", "release_env"): [2, 1],
        ("bystander", "provision_env"): [1, 1],
        ("bystander", "release_env"): [1, 1],
    }


def test_fault_rules_parse_as_a_plan_or_a_list_and_errors_name_the_rule() -> None:
    plans = parse_fault_plans('{"notifier": {"mode": "drop_reply"}, "test-runner": [{}, {"mode": "slow"}]}')
    assert [p.mode for p in plans["notifier"]] == [FaultMode.DROP_REPLY]
    assert [p.mode for p in plans["test-runner"]] == [FaultMode.NONE, FaultMode.SLOW]
    with pytest.raises(InputError) as e:
        parse_fault_plans('{"notifier": [{}, {"mode": "explode"}]}')
    assert "--faults.notifier[1]" in str(e.value)


def test_unknown_service_is_an_input_error() -> None:
    injector = FaultInjector({"run_tests": "test-runner"})
    with pytest.raises(InputError, match="unknown service"):
        injector.set_plan("nope", FaultPlan())


def test_ledger_bills_until_release_and_reports_orphans_and_duplicates() -> None:
    # Given a ledger on a fake clock with two environments under one effect key
    clock = FakeClock()
    ledger = Ledger(clock)
    first = ledger.allocate("tenant-a", "ek-1")
    ledger.allocate("tenant-a", "ek-1")
    clock.advance(10)
    # When the first is released and time moves on
    assert ledger.release(first, "ek-rel") == pytest.approx(10)
    assert ledger.release(first, "ek-rel") == pytest.approx(10)  # releasing twice changes nothing
    clock.advance(5)
    snap = ledger.snapshot()
    # Then billing, orphans and duplicate effects are what happened
    assert snap.billed_seconds == pytest.approx(10 + 15)
    assert [e.env_id for e in snap.orphaned_environments()] == ["env-00002"]
    assert [(d.tool, d.effect_key, d.applications) for d in snap.duplicate_effects()] == [
        ("provision_env", "ek-1", 2)
    ]
    assert ledger.release("env-99999", "x") is None


async def _outcome(state: EffectState, result: str = "") -> EffectOutcome:
    await asyncio.sleep(0)
    return EffectOutcome(state, result_json=result, code=grpc.StatusCode.INTERNAL)


async def test_an_applied_effect_is_never_overwritten_by_a_later_refusal() -> None:
    # Given a key applied once (dedupe off, so a second attempt runs too)
    table = EffectTable()
    await table.start("t", "k", _outcome(EffectState.APPLIED, '{"a":1}'), cancellable=False)
    # When a later attempt for the same key is refused
    await table.start("t", "k", _outcome(EffectState.ABSENT), cancellable=False)
    entry = table.get("t", "k")
    # Then the evidence of the applied effect stands
    assert entry is not None
    assert (entry.state, entry.result_json, entry.applications) == (EffectState.APPLIED, '{"a":1}', 1)


async def test_cancelling_an_effect_before_it_starts_records_absence() -> None:
    table = EffectTable()
    task = table.start("t", "k", _outcome(EffectState.APPLIED, "{}"), cancellable=True)
    assert table.cancel_work("t", "k")
    outcome = await task
    entry = table.get("t", "k")
    assert outcome.state is EffectState.ABSENT
    assert entry is not None and entry.state is EffectState.ABSENT and entry.applications == 0


def test_fences_only_go_up() -> None:
    table = EffectTable()
    assert table.fence("t", "k") == 0
    assert [table.raise_fence("t", "k") for _ in range(3)] == [1, 2, 3]
    assert table.fence("t", "other") == 0


@pytest.mark.parametrize("field", ["cpu_seconds", "memory_bytes", "open_files"])
def test_resource_limits_must_be_positive(field: str) -> None:
    with pytest.raises(InputError, match=field):
        ResourceLimits(**{field: 0})


@pytest.mark.parametrize("trajectory_id", ["", "../escape", "a/b", ".hidden", "x" * 200])
def test_sandbox_refuses_unsafe_trajectory_ids(tmp_path: Path, trajectory_id: str) -> None:
    with pytest.raises(InputError, match="trajectory_id"):
        Sandbox(trajectory_id, tmp_path)
