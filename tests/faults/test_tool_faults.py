"""Fault injection against the testbed tool services, judged by the testbed's own ledger (read over
gRPC from a separate process), never by what the runtime believes.

Recovery chapter, fault-test plan: "Lose the provisioning reply" -> the effect stays unknown, the
endpoint's result-recovery contract settles it, and no second environment is provisioned blindly.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest

from actors.tools_grpc import GrpcToolPort
from cluster.redis_server import free_port
from runtime.ports import OutcomeClass, Settlement, ToolInvocation
from testbed.tools import FaultMode, FaultPlan, TestbedClient, TestbedProcess

pytestmark = pytest.mark.faults

PROVISIONER = "env-provisioner"


def provision(effect_key: str, attempt: int, budget_s: float) -> ToolInvocation:
    # A retry keeps the logical operation and the effect key, and gets a fresh attempt id.
    return ToolInvocation(
        trajectory_id="traj-r18",
        call_id="call-provision",
        tool="provision_env",
        arguments={"tenant": "tenant-a", "size": "small"},
        effect_key=effect_key,
        operation_id="provision_test_env_r18",
        attempt_id=f"attempt-{attempt}",
        deadline=time.time() + budget_s,
    )


@pytest.fixture
def testbed() -> Iterator[TestbedProcess]:
    with TestbedProcess(free_port(), provision_s=0.05) as proc:
        yield proc


@pytest.mark.parametrize(
    ("honour_effect_keys", "environments_for_the_key"),
    [
        (True, 1),  # the endpoint's dedupe contract holds: no duplicate effect
        (False, 2),  # control: with effect keys ignored the duplicate appears, so this test can fail
    ],
)
async def test_a_reply_dropped_after_the_effect_leaves_no_duplicate_environment(
    testbed: TestbedProcess, honour_effect_keys: bool, environments_for_the_key: int
) -> None:
    async with (
        GrpcToolPort({}, default_address=testbed.address) as port,
        TestbedClient(testbed.address) as ledger,
    ):
        # Given the provisioner applies the effect and then drops its reply (once)
        await ledger.set_faults(
            FaultPlan(mode=FaultMode.DROP_REPLY, count=1, honour_effect_keys=honour_effect_keys), PROVISIONER
        )
        # When the first attempt times out
        first = await port.invoke(provision("ek-env-r18", attempt=1, budget_s=0.5))
        # Then the client knows nothing: a timeout settles nothing
        assert (first.settlement, first.outcome_class) == (
            Settlement.UNKNOWN,
            OutcomeClass.INFRASTRUCTURE_FAILURE,
        )
        # And the endpoint's probe recovers the established effect with its resource id
        probe = await port.probe_result("provision_env", "ek-env-r18", time.time() + 2)
        assert probe.settlement is Settlement.ESTABLISHED
        # When the retry owner re-invokes with the same effect key (fresh attempt id)
        retry = await port.invoke(provision("ek-env-r18", attempt=2, budget_s=2.0))
        assert retry.settlement is Settlement.ESTABLISHED
        # Then the independent ledger decides: one environment per effect key, or the visible duplicate
        book = await ledger.ledger()
    created = book.environments_for("ek-env-r18")
    assert len(created) == environments_for_the_key
    assert probe.result["env_id"] == created[0].env_id
    if honour_effect_keys:
        assert retry.result == probe.result
        assert book.duplicate_effects() == []
    else:
        assert [(d.effect_key, d.applications) for d in book.duplicate_effects()] == [("ek-env-r18", 2)]


async def test_compensation_after_a_lost_reply_leaves_no_orphaned_environment(
    testbed: TestbedProcess,
) -> None:
    async with (
        GrpcToolPort({}, default_address=testbed.address) as port,
        TestbedClient(testbed.address) as ledger,
    ):
        # Given a provisioning reply lost after the effect
        await ledger.set_faults(FaultPlan(mode=FaultMode.DROP_REPLY, count=1), PROVISIONER)
        lost = await port.invoke(provision("ek-env-1", attempt=1, budget_s=0.5))
        assert lost.settlement is Settlement.UNKNOWN
        # When the runtime settles it by probe and runs the registered compensation with the recovered id
        probe = await port.probe_result("provision_env", "ek-env-1", time.time() + 2)
        release = await port.invoke(
            ToolInvocation(
                trajectory_id="traj-r18",
                call_id="call-release",
                tool="release_env",
                arguments={"env_id": probe.result["env_id"]},
                effect_key="ek-release-1",
                operation_id="release_test_env_r18",
                attempt_id="attempt-1",
                deadline=time.time() + 2,
            )
        )
        book = await ledger.ledger()
    # Then the ledger holds no orphaned environment and its billing stopped
    assert release.settlement is Settlement.ESTABLISHED
    assert book.orphaned_environments() == []
    assert len(book.environments) == 1


async def test_a_hung_call_is_settled_absent_by_probe_and_the_retry_creates_exactly_one(
    testbed: TestbedProcess,
) -> None:
    async with (
        GrpcToolPort({}, default_address=testbed.address) as port,
        TestbedClient(testbed.address) as ledger,
    ):
        # Given the provisioner holds the first call past its deadline
        await ledger.set_faults(FaultPlan(mode=FaultMode.HANG, hang_s=0.1, count=1), PROVISIONER)
        hung = await port.invoke(provision("ek-env-2", attempt=1, budget_s=0.3))
        assert hung.settlement is Settlement.UNKNOWN
        # When a probe (repeated while the endpoint still holds the call) settles it
        settlement = Settlement.UNKNOWN
        for _ in range(200):
            settlement = (await port.probe("provision_env", "ek-env-2", time.time() + 2)).settlement
            if settlement is not Settlement.UNKNOWN:
                break
            await asyncio.sleep(0.02)
        assert settlement is Settlement.ESTABLISHED_ABSENT
        # And the retry is dispatched only after absence is established
        retry = await port.invoke(provision("ek-env-2", attempt=2, budget_s=2.0))
        book = await ledger.ledger()
    # Then exactly one environment exists for the key
    assert retry.settlement is Settlement.ESTABLISHED
    assert len(book.environments_for("ek-env-2")) == 1
