"""``examples/cleanup.yaml`` through ``tether run``'s own services and driver on a local Ray (issue 11).

Seven trajectories provision a billed environment and leave by seven doors: completion, an operator's kill,
an operator's cancel, a budget halt, the deadline, a lost provisioning reply and a lost release reply. The
judge is the environment service's own record (the testbed ledger, which applies every delivery and never
deduplicates): every environment allocated is released exactly once, and nothing was delivered twice. The
trajectories' logs say how: each release is its own operation, retired on the service's evidence, inside
the deadline where there is one, and every exit but a clean completion leaves a handoff packet.

The control runs the killed trajectory again with the cleanup graph switched off in its worker
(``tests/faults/mutations.py``: ``no-cleanup``): the same judge then finds its environment orphaned.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from cluster.runner import RunOptions, RunResult, Services, run_driver
from cluster.workload import Workload, load_workload
from runtime.events import Event, HandoffWritten
from runtime.fold import fold
from runtime.obligations import ObligationState
from runtime.record import TrajectoryRecord
from testbed.tools.host import TestbedClient
from testbed.tools.ledger import LedgerSnapshot
from tests.faults.mutations import MutatedAdapters
from tests.integration.trajectory_kit import events_of

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(600)]

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "cleanup.yaml"


@dataclass
class Run:
    """What one run left: the driver's result, the testbed's ledger, and every trajectory's log."""

    result: RunResult
    ledger: LedgerSnapshot
    logs: dict[str, list[Event]]  # workload name -> its log

    def record(self, name: str) -> TrajectoryRecord:
        return fold(self.logs[name])


def _run(workload: Workload, run_id: str, mutation: str | None, home: Path) -> Run:
    from cluster.redis_server import RedisServer

    server = RedisServer(data_dir=home / "redis").start()
    mp = pytest.MonkeyPatch()
    mp.setenv("TETHER_REDIS_URL", server.url)
    mp.setenv("TETHER_HOME", str(home))
    mp.setenv("TETHER_KEYRING", str(home / "keyring.yaml"))
    try:
        with Services(workload, RunOptions()) as services:
            assert services.testbed_address is not None
            if mutation is not None:
                services.adapters = MutatedAdapters(mutation=mutation)
            result = run_driver(workload, services, RunOptions(run_id=run_id, poll_s=0.2))

            async def collect() -> tuple[LedgerSnapshot, dict[str, list[Event]]]:
                async with TestbedClient(services.testbed_address) as client:
                    ledger = await client.ledger()
                logs = {r.name: await events_of(services.redis_url, r.id) for r in result.results}
                return ledger, logs

            ledger, logs = asyncio.run(collect())
            return Run(result, ledger, logs)
    finally:
        mp.undo()
        server.stop()


@pytest.fixture(scope="module")
def example(ray_local: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Run]:
    yield _run(load_workload(EXAMPLE), "cleanup", None, tmp_path_factory.mktemp("cleanup"))


def _envs_of(run: Run, name: str) -> list[Any]:
    """The environments the service allocated for one trajectory (its provisioning deliveries' keys)."""
    tid = next(r.id for r in run.result.results if r.name == name)
    provisions = [d for d in run.ledger.deliveries if d.trajectory_id == tid and d.tool == "provision_env"]
    keys = {d.effect_key for d in provisions}
    return [e for e in run.ledger.environments if e.effect_key in keys]


def test_every_door_ends_as_the_workload_expects(example: Run) -> None:
    states = {r.name: (r.state, r.exit_reason) for r in example.result.results}
    assert states == {
        "completes": ("COMPLETED", "COMPLETED"),
        "killed": ("FAILED", "KILLED"),
        "cancelled": ("CANCELED", "CANCELED"),
        "budget-halt": ("FAILED", "BUDGET_EXCEEDED"),
        "deadline": ("FAILED", "DEADLINE_EXCEEDED"),
        "lost-provision-reply": ("COMPLETED", "COMPLETED"),
        "lost-release-reply": ("COMPLETED", "COMPLETED"),
    }
    assert sorted(example.result.operator_actions.values()) == ["cancel", "kill"]


def test_every_environment_is_released_once_by_the_services_own_record(example: Run) -> None:
    ledger = example.ledger
    assert ledger.effect_keys == "ignore"  # the service applies every delivery: a repeat would show
    # Each trajectory provisioned exactly one environment (a lost reply was recovered, never re-sent) ...
    for r in example.result.results:
        envs = _envs_of(example, r.name)
        assert len(envs) == 1, f"{r.name}: {len(envs)} environments"
        # ... and the service released it
        assert envs[0].released_at is not None, f"{r.name}: {envs[0].env_id} still allocated"
    assert ledger.orphaned_environments() == []
    assert ledger.duplicate_effects() == [] and ledger.duplicate_deliveries() == []
    # and the report says what the service says
    assert example.result.ledger is not None
    assert example.result.ledger["orphaned"] == 0 and example.result.ledger["environments_allocated"] == 7


def test_each_release_is_its_own_operation_retired_on_evidence(example: Run) -> None:
    for r in example.result.results:
        rec = example.record(r.name)
        obligations = list(rec.obligations.values())
        assert len(obligations) == 1, f"{r.name}: {obligations}"
        ob = obligations[0]
        assert ob.state is ObligationState.DISCHARGED and not ob.accepted_risk, f"{r.name}: {ob}"
        assert ob.cleanup_operation is not None and ob.cleanup_operation in rec.operations
        assert ob.evidence, f"{r.name}: discharged without evidence"
    # the release whose reply was lost was not retired because a call returned: it timed out, was sent again
    # under its key (release_env is idempotent), and was retired once the endpoint's own record showed it
    lost = example.record("lost-release-reply")
    (ob,) = lost.obligations.values()
    assert any("timed out" in e for e in ob.evidence), ob.evidence
    assert ob.evidence[-1] == "verified by the endpoint's record: established", ob.evidence


def test_the_deadline_door_released_before_the_absolute_deadline(example: Run) -> None:
    rec = example.record("deadline")
    assert rec.deadline is not None
    (env,) = _envs_of(example, "deadline")
    assert env.released_at is not None and env.released_at <= rec.deadline


def test_every_exit_but_a_clean_completion_leaves_a_handoff_packet(example: Run) -> None:
    for r in example.result.results:
        packets = [e.packet for e in example.logs[r.name] if isinstance(e, HandoffWritten)]
        if r.name in ("completes", "lost-provision-reply", "lost-release-reply"):
            continue
        assert len(packets) == 1, f"{r.name}: {len(packets)} packets"
        packet = packets[0]
        assert packet["stopped"]["exit_reason"] == r.exit_reason
        # what was done (the release included) and nothing still pending: the leases went first
        assert "release_env" in [d["tool"] for d in packet["done"]]
        pending = packet["pending"]
        assert pending["leases"] == [] and pending["obligations"] == [] and pending["approval"] is None
        # a test run cut short by the kill is in doubt and handed on; nothing that allocates or releases is
        assert {u["tool"] for u in pending["unknown_operations"]} <= {"run_tests"}, pending
        assert r.id in example.result.handoff


def test_control_without_the_cleanup_graph_the_same_judge_finds_an_orphan(
    example: Run, tmp_path_factory: pytest.TempPathFactory
) -> None:
    workload = load_workload(EXAMPLE)
    killed = workload.model_copy(
        update={"trajectories": [t for t in workload.trajectories if t.id == "killed"]}
    )
    control = _run(killed, "cleanup-control", "no-cleanup", tmp_path_factory.mktemp("control"))
    assert [(r.name, r.state) for r in control.result.results] == [("killed", "FAILED")]
    (env,) = _envs_of(control, "killed")
    assert env.released_at is None and control.ledger.orphaned_environments() != []
    # (what the judges above assert fails: the obligation was handed off, not discharged)
    (ob,) = control.record("killed").obligations.values()
    assert ob.state is ObligationState.HANDED_OFF
