"""The run report's world view (ledger summary, operator steps' conditions) and the workload's
``operator`` step: what each reads and what it refuses; operator steps that fail beside a run."""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import pytest

from cluster.run_actions import alongside, condition_holds
from cluster.run_report import ledger_summary
from cluster.workload import OperatorStep, WorkloadError, parse_workload
from testbed.tools.ledger import Ledger


def _owed(*rows: dict[str, str]) -> dict[str, str]:
    return {"state": "RUNNING_TOOL", "owed": json.dumps(list(rows))}


def test_started_holds_once_a_status_exists() -> None:
    step = OperatorStep(action="kill", when="started")
    assert not condition_holds(step, {})
    assert condition_holds(step, {"state": "READY"})


def test_owing_needs_a_bound_obligation_not_a_planned_one_or_an_unknown_operation() -> None:
    step = OperatorStep(action="cancel")
    assert step.when == "owing"
    planned = {"kind": "compensation", "state": "planned"}
    unknown_op = {"kind": "operation", "state": "bound"}
    bound = {"kind": "compensation", "state": "bound"}
    assert not condition_holds(step, {"state": "READY", "owed": ""})
    assert not condition_holds(step, _owed(planned))
    assert not condition_holds(step, _owed(unknown_op))
    assert condition_holds(step, _owed(planned, bound))
    assert not condition_holds(step, {"state": "READY", "owed": "{not json"})


def test_ledger_summary_counts_the_services_own_record() -> None:
    ledger = Ledger()
    kept = ledger.allocate("a", "k1")
    gone = ledger.allocate("b", "k2")
    again = ledger.allocate("b", "k2")  # the same effect key applied twice: a duplicate effect
    assert ledger.release(gone, "r1") is not None
    assert ledger.release(again, "r2") is not None
    summary = ledger_summary(ledger.snapshot())
    assert summary["environments_allocated"] == 3
    assert summary["environments_released"] == 2
    assert summary["orphaned"] == 1
    assert summary["orphaned_ids"] == [kept]
    assert summary["duplicate_effects"] == 1
    assert summary["deliveries"] == 0  # nothing arrived over the wire: effects alone are not deliveries
    ledger.arrived(
        tool="provision_env",
        effect_key="k3",
        call_id="c",
        attempt_id="a1",
        operation_id="op",
        trajectory_id="t",
        prior="new",
    )
    assert ledger_summary(ledger.snapshot())["deliveries"] == 1


_BASE = """
name: w
tools: [{name: provision_env, source: testbed}, {name: release_env, source: testbed}]
trajectories:
  - id: t
    grants: [provision_env]
"""


def test_a_workload_declares_an_operator_step() -> None:
    wl = parse_workload(_BASE + "    operator: {action: kill, when: owing, after_s: 0.5}\n")
    step = wl.trajectories[0].operator
    assert step is not None and (step.action, step.when, step.after_s) == ("kill", "owing", 0.5)


@pytest.mark.parametrize(
    ("line", "named"),
    [
        ("    operator: {action: explode}\n", "action"),
        ("    operator: {action: kill, when: later}\n", "when"),
        ("    operator: {action: kill, after_s: -1}\n", "after_s"),
        ("    operator: {action: kill, by: mallory}\n", "by"),
    ],
)
def test_a_bad_operator_step_is_refused_naming_the_field(line: str, named: str) -> None:
    with pytest.raises(WorkloadError) as e:
        parse_workload(_BASE + line)
    assert named in str(e.value) and "operator" in str(e.value)


class _Steps:
    """Operator steps that fail at once, or that outlast the run and lose their cancel on the way out."""

    def __init__(self, fail: bool) -> None:
        self.fail = fail

    async def run(self) -> None:
        if self.fail:
            raise ValueError("no keyring at /nowhere")
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            raise ConnectionError("closed while cancelled") from None


@pytest.mark.parametrize("fail", [True, False], ids=["failed-early", "failed-while-stopped"])
def test_operator_steps_that_fail_are_logged_and_never_fail_the_run(
    fail: bool, caplog: pytest.LogCaptureFixture
) -> None:
    async def main() -> str:
        await asyncio.sleep(0.05)
        return "results"

    steps: Any = _Steps(fail)
    with caplog.at_level(logging.ERROR, logger="cluster.run_actions"):
        assert asyncio.run(alongside(main(), steps)) == "results"
    assert any("operator steps failed" in r.getMessage() for r in caplog.records)
