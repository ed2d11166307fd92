"""The chaos suite's pure parts: the seeded schedule and the judges, each shown to fail on bad evidence."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from benchmarks.chaos import (
    ChaosConfig,
    explain_orphans,
    judge_acked,
    orphans_handed_off,
    plan_faults,
    sized,
    workload_yaml,
)
from cluster.workload import parse_workload
from runtime.obligations import ObligationState
from runtime.ports import Settlement
from testbed.tools.ledger import DeliveryRecord, EnvironmentRecord, LedgerSnapshot


def test_the_same_seed_gives_the_same_schedule_and_another_seed_another() -> None:
    config = ChaosConfig(window_s=60.0)
    assert plan_faults(3, 100, config) == plan_faults(3, 100, config)
    assert plan_faults(3, 100, config) != plan_faults(4, 100, config)


def test_a_schedule_hits_every_part_inside_its_window() -> None:
    # Given the schedule of 100 trajectories over a 60 s window
    plan = plan_faults(0, 100, ChaosConfig(window_s=60.0))
    kinds = [f.kind for f in plan]
    # Then it kills one actor in ten, a relay, the scheduler and a guard, restarts Redis once and disturbs
    # the provisioner's replies twice, all within the window, in time order
    assert kinds.count("trajectory_sigkill") == 10
    assert {"relay_sigkill", "scheduler_sigkill", "guard_sigkill", "redis_restart", "drop_replies"} <= set(
        kinds
    )
    assert all(0 < f.at_s <= 60.0 for f in plan) and plan == sorted(plan)
    [restart] = [f for f in plan if f.kind == "redis_restart"]
    assert 2.0 <= restart.arg <= 4.0


@pytest.mark.parametrize(
    ("after", "lost"),
    [
        ({"t": [(b"1-0", b"a"), (b"2-0", b"b"), (b"3-0", b"c")]}, 0),  # all there, and a later entry
        ({"t": [(b"1-0", b"a")]}, 1),  # an acknowledged entry missing
        ({"t": [(b"1-0", b"a"), (b"2-0", b"B")]}, 1),  # one changed
        ({}, 2),  # the whole log gone
    ],
)
def test_an_acknowledged_entry_missing_or_changed_after_the_crash_is_counted(
    after: dict[str, list[tuple[bytes, bytes]]], lost: int
) -> None:
    acked = {"t": [(b"1-0", b"a"), (b"2-0", b"b")]}
    assert judge_acked(acked, after) == lost


def test_the_workload_is_a_valid_tether_workload_of_the_asked_size() -> None:
    wl = parse_workload(workload_yaml("chaos-s0", 20, "http://127.0.0.1:1/v1", "127.0.0.1:2"), "chaos.yaml")
    assert len(wl.expanded()) == 20
    assert {t.address for t in wl.tools} == {"127.0.0.1:2"}


def test_the_run_is_sized_down_to_the_memory_available() -> None:
    fits, why = sized(1_000_000)
    assert fits < 1_000_000 and why is not None and "sized down" in why
    assert sized(2) == (2, None)


def _env(env_id: str, key: str, released: bool) -> EnvironmentRecord:
    return EnvironmentRecord(
        env_id=env_id, tenant="t", effect_key=key, allocated_at=1.0, released_at=2.0 if released else None
    )


def _provisioned(key: str, tid: str) -> DeliveryRecord:
    return DeliveryRecord(
        seq=1,
        tool="provision_env",
        effect_key=key,
        call_id="c",
        attempt_id="a",
        operation_id=f"op-{key}",
        trajectory_id=tid,
        arrived_at=1.0,
        prior="new",
    )


def _record(key: str, state: ObligationState) -> Any:
    op = SimpleNamespace(
        operation_id=f"op-{key}", effect_key=key, settlement=Settlement.ESTABLISHED, attempts=1
    )
    ob = SimpleNamespace(
        operation_id=f"op-{key}", state=state, owner="operator", resource=None, evidence=("handed off",)
    )
    return SimpleNamespace(
        operations={op.operation_id: op},
        obligations={"ob": ob},
        state=SimpleNamespace(value="FAILED"),
        exit_reason="DEADLINE_EXCEEDED",
    )


def test_an_orphan_handed_off_with_the_packet_is_told_apart_from_one_nobody_owns() -> None:
    # Given three environments still allocated and one released: one release handed off with the packet,
    # one stuck in the trajectory (nobody was told), one whose trajectory left no record
    ledger = LedgerSnapshot(
        environments=(
            _env("e1", "k1", False),
            _env("e2", "k2", False),
            _env("e3", "k3", False),
            _env("e4", "k4", True),
        ),
        deliveries=tuple(_provisioned(k, f"t{k[1]}") for k in ("k1", "k2", "k3", "k4")),
    )
    records = {
        "t1": _record("k1", ObligationState.HANDED_OFF),
        "t2": _record("k2", ObligationState.STUCK),
        "t4": _record("k4", ObligationState.HANDED_OFF),  # released after all: not an orphan
    }
    # Then only the first counts as handed off, and every orphan is explained
    assert orphans_handed_off(ledger, records) == 1
    notes = explain_orphans(ledger, records)
    assert [n.split(":")[0] for n in notes] == ["orphan e1", "orphan e2", "orphan e3"]
    assert "handed_off" in notes[0] and "stuck" in notes[1] and "does not fold" in notes[2]
