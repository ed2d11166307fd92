"""The gRPC tool protocol end to end on loopback: real grpc.aio servers, the real client adapter,
the testbed's independent ledger as the judge."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import AsyncIterator, Mapping
from typing import Any

import grpc
import pytest

from actors.tools_grpc import (
    STATUS_RULES,
    CancelState,
    DeadlinePassed,
    GrpcToolPort,
    NoToolRoute,
    ToolContext,
    ToolError,
    ToolServer,
    ToolSpec,
)
from runtime.ports import OutcomeClass, Settlement, ToolInvocation, ToolPort
from testbed.tools import FaultMode, FaultPlan, Testbed, TestbedClient, TestbedProcess, start_testbed

pytestmark = pytest.mark.integration

PROVISIONER = "env-provisioner"


def invocation(
    tool: str, arguments: Mapping[str, Any], effect_key: str, budget_s: float = 2.0
) -> ToolInvocation:
    return ToolInvocation(
        trajectory_id="traj-1",
        call_id=f"call-{effect_key}",
        tool=tool,
        arguments=arguments,
        effect_key=effect_key,
        operation_id=f"op-{effect_key}",
        attempt_id=f"att-{time.monotonic_ns()}",
        deadline=time.time() + budget_s,
    )


def provision(effect_key: str, budget_s: float = 2.0) -> ToolInvocation:
    return invocation("provision_env", {"tenant": "tenant-a"}, effect_key, budget_s)


@pytest.fixture
async def testbed() -> AsyncIterator[Testbed]:
    bed = await start_testbed(provision_s=0.05)
    try:
        yield bed
    finally:
        await bed.stop()


@pytest.fixture
async def port(testbed: Testbed) -> AsyncIterator[GrpcToolPort]:
    async with GrpcToolPort(testbed.routes()) as p:
        yield p


@pytest.fixture
async def control(testbed: Testbed) -> AsyncIterator[TestbedClient]:
    async with TestbedClient(testbed.address) as c:
        yield c


async def settled_probe(port: GrpcToolPort, tool: str, effect_key: str) -> Settlement:
    """Probe until the endpoint stops saying UNKNOWN because the effect is still running (bounded)."""
    for _ in range(200):
        settlement = (await port.probe(tool, effect_key, time.time() + 2)).settlement
        if settlement is not Settlement.UNKNOWN:
            return settlement
        await asyncio.sleep(0.02)
    return Settlement.UNKNOWN


# ------------------------------------------------------------------ invoke / probe / cancel


async def test_the_adapter_is_a_tool_port(port: GrpcToolPort) -> None:
    assert isinstance(port, ToolPort)


async def test_invoke_establishes_the_effect_and_the_ledger_records_it(
    port: GrpcToolPort, control: TestbedClient
) -> None:
    # When a provisioning call succeeds
    outcome = await port.invoke(provision("ek-1"))
    # Then it is established with the endpoint's result, and the ledger holds exactly that environment
    assert (outcome.settlement, outcome.outcome_class) == (Settlement.ESTABLISHED, OutcomeClass.SUCCESS)
    ledger = await control.ledger()
    assert [e.env_id for e in ledger.environments_for("ek-1")] == [outcome.result["env_id"]]


async def test_repeating_an_effect_key_returns_the_first_result_without_a_second_effect(
    port: GrpcToolPort, control: TestbedClient
) -> None:
    # Given a provisioner that honours effect keys (the testbed's default applies every delivery)
    await control.set_faults(FaultPlan(honour_effect_keys=True), PROVISIONER)
    first = await port.invoke(provision("ek-1"))
    again = await port.invoke(provision("ek-1"))
    other = await port.invoke(provision("ek-2"))
    ledger = await control.ledger()
    assert again.result == first.result
    assert other.result["env_id"] != first.result["env_id"]
    assert len(ledger.environments) == 2
    assert ledger.duplicate_effects() == []


async def test_concurrent_attempts_with_one_effect_key_join_the_running_effect(
    port: GrpcToolPort, control: TestbedClient
) -> None:
    # Given a provisioner that honours effect keys (the testbed's default applies every delivery)
    await control.set_faults(FaultPlan(honour_effect_keys=True), PROVISIONER)
    outcomes = await asyncio.gather(*(port.invoke(provision("ek-join")) for _ in range(5)))
    ledger = await control.ledger()
    assert {o.result["env_id"] for o in outcomes} == {ledger.environments[0].env_id}
    assert len(ledger.environments) == 1


@pytest.mark.parametrize(
    ("tool", "arguments", "error"),
    [
        ("release_env", {"env_id": "env-missing"}, "NOT_FOUND"),
        ("provision_env", {"tenant": ""}, "INVALID_ARGUMENT"),
        ("provision_env", {"tenant": "a", "size": "huge"}, "INVALID_ARGUMENT"),
    ],
)
async def test_domain_rejections_are_established_absent_client_rejections(
    port: GrpcToolPort, control: TestbedClient, tool: str, arguments: dict[str, Any], error: str
) -> None:
    outcome = await port.invoke(invocation(tool, arguments, "ek-bad"))
    assert (outcome.settlement, outcome.outcome_class) == (
        Settlement.ESTABLISHED_ABSENT,
        OutcomeClass.CLIENT_REJECTION,
    )
    assert outcome.error is not None and outcome.error.startswith(error)
    assert (await control.ledger()).environments == ()


async def test_every_testbed_tool_answers(port: GrpcToolPort, control: TestbedClient) -> None:
    tests = await port.invoke(invocation("run_tests", {"suite": "unit"}, "ek-t"))
    tests_again = await port.invoke(invocation("run_tests", {"suite": "unit"}, "ek-t2"))
    search = await port.invoke(invocation("search_packages", {"query": "pytest", "limit": 1}, "ek-s"))
    note = await port.invoke(invocation("send_notification", {"recipient": "ops", "message": "hi"}, "ek-n"))
    env = await port.invoke(provision("ek-p"))
    released = await port.invoke(invocation("release_env", {"env_id": env.result["env_id"]}, "ek-r"))
    ledger = await control.ledger()
    assert tests.result == tests_again.result  # deterministic from the arguments
    assert [p["name"] for p in search.result["packages"]] == ["pytest"]
    assert [n.notification_id for n in ledger.notifications] == [note.result["notification_id"]]
    assert released.result["released"] is True
    assert ledger.orphaned_environments() == []
    assert (ledger.test_runs, ledger.searches) == (2, 1)


async def test_probe_returns_the_stored_result_of_an_applied_effect(port: GrpcToolPort) -> None:
    applied = await port.invoke(provision("ek-1"))
    probe = await port.probe_result("provision_env", "ek-1", time.time() + 2)
    assert (probe.settlement, probe.result) == (Settlement.ESTABLISHED, applied.result)


async def test_probe_of_an_unseen_key_fences_late_attempts_but_not_the_prober(
    testbed: Testbed, port: GrpcToolPort, control: TestbedClient
) -> None:
    # Given a probe finds nothing for a key (the original request may still be in transit)
    assert (
        await port.probe("provision_env", "ek-late", time.time() + 2)
    ).settlement is Settlement.ESTABLISHED_ABSENT
    # When that original attempt arrives late (a client that never saw the fence)
    async with GrpcToolPort(testbed.routes()) as stale:
        late = await stale.invoke(provision("ek-late"))
    # Then it is refused, so "absent" stayed true; the prober's own retry is accepted
    assert late.settlement is Settlement.ESTABLISHED_ABSENT
    assert late.error is not None and late.error.startswith("FAILED_PRECONDITION")
    retry = await port.invoke(provision("ek-late"))
    assert retry.settlement is Settlement.ESTABLISHED
    assert len((await control.ledger()).environments_for("ek-late")) == 1


async def test_cancel_stops_a_pending_effect_before_it_commits(
    testbed: Testbed, port: GrpcToolPort, control: TestbedClient
) -> None:
    # Given a provisioning call held by a slow service
    await control.set_faults(FaultPlan(mode=FaultMode.SLOW, delay_s=1.0), PROVISIONER)
    pending = asyncio.create_task(port.invoke(provision("ek-c", budget_s=5)))
    for _ in range(500):  # until the call is in flight at the server (a probe now would fence it)
        if testbed.server.effects.get("provision_env", "ek-c") is not None:
            break
        await asyncio.sleep(0.01)
    # When it is cancelled
    cancelled = await port.cancel_result("provision_env", "ek-c")
    outcome = await pending
    # Then nothing was created and the key is established absent
    assert cancelled.state is CancelState.CANCELLED
    assert (outcome.settlement, outcome.error and outcome.error.split(":")[0]) == (
        Settlement.ESTABLISHED_ABSENT,
        "ABORTED",
    )
    assert (
        await port.probe("provision_env", "ek-c", time.time() + 2)
    ).settlement is Settlement.ESTABLISHED_ABSENT
    assert (await control.ledger()).environments == ()


async def test_cancel_after_the_effect_or_before_any_attempt(
    port: GrpcToolPort, control: TestbedClient
) -> None:
    await port.invoke(provision("ek-done"))
    assert (await port.cancel_result("provision_env", "ek-done")).state is CancelState.ALREADY_APPLIED
    assert (await port.cancel_result("provision_env", "ek-never")).state is CancelState.FENCED
    assert len((await control.ledger()).environments) == 1


async def test_unrouted_tool_and_past_deadline_are_local_refusals(
    port: GrpcToolPort, control: TestbedClient
) -> None:
    with pytest.raises(NoToolRoute, match="no_such_tool"):
        await port.invoke(invocation("no_such_tool", {}, "ek-x"))
    with pytest.raises(DeadlinePassed):
        await port.invoke(provision("ek-late", budget_s=-1))
    assert (await control.ledger()).environments == ()


async def test_unreachable_service_is_not_sent_and_counts_as_infrastructure_failure() -> None:
    # a port held bound but never listening: a connection is refused, and no other process can take it
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        async with GrpcToolPort({"provision_env": f"127.0.0.1:{held.getsockname()[1]}"}) as p:
            outcome = await p.invoke(provision("ek-1", budget_s=5))
    assert (outcome.settlement, outcome.outcome_class) == (
        Settlement.ESTABLISHED_ABSENT,
        OutcomeClass.INFRASTRUCTURE_FAILURE,
    )
    assert outcome.error is not None and "not sent" in outcome.error


# ------------------------------------------------------------------ deadlines and retries


async def _echo_remaining(arguments: Mapping[str, Any], ctx: ToolContext) -> dict[str, Any]:
    return {"remaining": ctx.time_remaining()}


async def test_deadline_propagates_to_the_tool() -> None:
    async with (
        ToolServer([ToolSpec("echo", _echo_remaining)]) as server,
        GrpcToolPort({"echo": server.address}) as p,
    ):
        long = await p.invoke(invocation("echo", {}, "ek-1", budget_s=30))
        short = await p.invoke(invocation("echo", {}, "ek-2", budget_s=1.5))
    assert 0 < short.result["remaining"] <= 1.5
    assert 1.5 < long.result["remaining"] <= 30


async def test_the_client_never_retries_a_failed_call() -> None:
    attempts: list[str] = []

    def flaky(arguments: Mapping[str, Any], ctx: ToolContext) -> None:
        attempts.append(ctx.call.attempt_id)
        raise ToolError(grpc.StatusCode.UNAVAILABLE, "down", retry_after=0.25)

    server = ToolServer([ToolSpec("flaky", flaky)], dedupe_effect_keys=False)
    async with server, GrpcToolPort({"flaky": server.address}) as p:
        outcome = await p.invoke(invocation("flaky", {}, "ek-1"))
    assert (outcome.settlement, outcome.retry_after) == (Settlement.UNKNOWN, 0.25)
    assert len(attempts) == 1


# ------------------------------------------------------------------ fault knobs


FAIL_STATUSES = [
    "UNAVAILABLE",
    "INTERNAL",
    "RESOURCE_EXHAUSTED",
    "INVALID_ARGUMENT",
    "NOT_FOUND",
    "PERMISSION_DENIED",
    "FAILED_PRECONDITION",
]


@pytest.mark.parametrize("status", FAIL_STATUSES)
async def test_fail_knob_answers_with_the_status_and_applies_nothing(
    port: GrpcToolPort, control: TestbedClient, status: str
) -> None:
    # Given the provisioner fails every call with `status` (retry-after 1.5s)
    await control.set_faults(FaultPlan(mode=FaultMode.FAIL, status=status, retry_after_s=1.5), PROVISIONER)
    # When a call is made
    outcome = await port.invoke(provision("ek-f"))
    # Then the client classifies it by the table, the advice arrives, and no environment exists
    rule = STATUS_RULES[grpc.StatusCode[status]]
    assert (outcome.settlement, outcome.outcome_class) == (rule.settlement, rule.outcome_class)
    assert outcome.retry_after == 1.5
    assert (await control.ledger()).environments == ()
    assert (
        await port.probe("provision_env", "ek-f", time.time() + 2)
    ).settlement is Settlement.ESTABLISHED_ABSENT


async def test_fail_knob_is_scoped_to_its_service(port: GrpcToolPort, control: TestbedClient) -> None:
    await control.set_faults(FaultPlan(mode=FaultMode.FAIL, status="UNAVAILABLE"), PROVISIONER)
    tests = await port.invoke(invocation("run_tests", {"suite": "unit"}, "ek-t"))
    env = await port.invoke(provision("ek-p"))
    assert tests.settlement is Settlement.ESTABLISHED
    assert env.settlement is Settlement.UNKNOWN


async def test_drop_reply_knob_applies_the_effect_but_the_caller_hears_nothing(
    port: GrpcToolPort, control: TestbedClient
) -> None:
    await control.set_faults(FaultPlan(mode=FaultMode.DROP_REPLY, count=1), PROVISIONER)
    outcome = await port.invoke(provision("ek-d", budget_s=0.5))
    assert (outcome.settlement, outcome.outcome_class) == (
        Settlement.UNKNOWN,
        OutcomeClass.INFRASTRUCTURE_FAILURE,
    )
    assert outcome.error is not None and outcome.error.startswith("DEADLINE_EXCEEDED")
    assert len((await control.ledger()).environments_for("ek-d")) == 1


async def test_hang_knob_holds_past_the_deadline_and_never_commits(
    port: GrpcToolPort, control: TestbedClient
) -> None:
    await control.set_faults(FaultPlan(mode=FaultMode.HANG, hang_s=0.2), PROVISIONER)
    outcome = await port.invoke(provision("ek-h", budget_s=0.3))
    assert outcome.settlement is Settlement.UNKNOWN  # a timeout settles nothing...
    # ...the endpoint's evidence does: the hung call refused to commit after its deadline
    assert await settled_probe(port, "provision_env", "ek-h") is Settlement.ESTABLISHED_ABSENT
    assert (await control.ledger()).environments == ()


@pytest.mark.parametrize(
    ("delay_s", "budget_s", "expected"), [(0.2, 3.0, Settlement.ESTABLISHED), (1.0, 0.3, None)]
)
async def test_slow_knob_answers_late_and_commits_only_within_the_deadline(
    port: GrpcToolPort, control: TestbedClient, delay_s: float, budget_s: float, expected: Settlement | None
) -> None:
    await control.set_faults(FaultPlan(mode=FaultMode.SLOW, delay_s=delay_s), PROVISIONER)
    outcome = await port.invoke(provision("ek-s", budget_s=budget_s))
    if expected is Settlement.ESTABLISHED:
        assert outcome.settlement is Settlement.ESTABLISHED
        assert len((await control.ledger()).environments) == 1
    else:
        assert outcome.settlement is Settlement.UNKNOWN
        assert await settled_probe(port, "provision_env", "ek-s") is Settlement.ESTABLISHED_ABSENT
        assert (await control.ledger()).environments == ()


async def test_malformed_knob_applies_the_effect_and_the_result_is_recovered_by_probe(
    port: GrpcToolPort, control: TestbedClient
) -> None:
    await control.set_faults(FaultPlan(mode=FaultMode.MALFORMED), PROVISIONER)
    outcome = await port.invoke(provision("ek-m"))
    assert (outcome.settlement, outcome.outcome_class) == (
        Settlement.UNKNOWN,
        OutcomeClass.INFRASTRUCTURE_FAILURE,
    )
    assert outcome.error is not None and "malformed" in outcome.error
    probe = await port.probe_result("provision_env", "ek-m", time.time() + 2)
    [env] = (await control.ledger()).environments
    assert (probe.settlement, probe.result["env_id"]) == (Settlement.ESTABLISHED, env.env_id)


@pytest.mark.parametrize(("honour", "applications"), [(True, 1), (False, 2)])
async def test_duplicate_delivery_knob_is_absorbed_only_when_effect_keys_are_honoured(
    port: GrpcToolPort, control: TestbedClient, honour: bool, applications: int
) -> None:
    await control.set_faults(FaultPlan(mode=FaultMode.DUPLICATE, honour_effect_keys=honour), PROVISIONER)
    outcome = await port.invoke(provision("ek-dup"))
    ledger = await control.ledger()
    assert outcome.settlement is Settlement.ESTABLISHED
    assert len(ledger.environments_for("ek-dup")) == applications


async def test_ignore_effect_keys_knob_applies_every_repeat(
    port: GrpcToolPort, control: TestbedClient
) -> None:
    await control.set_faults(FaultPlan(honour_effect_keys=False), PROVISIONER)
    first = await port.invoke(provision("ek-i"))
    second = await port.invoke(provision("ek-i"))
    ledger = await control.ledger()
    assert first.result["env_id"] != second.result["env_id"]
    assert [(d.effect_key, d.applications) for d in ledger.duplicate_effects()] == [("ek-i", 2)]


async def test_faults_set_at_start_and_cleared_over_rpc() -> None:
    bed = await start_testbed(faults={PROVISIONER: FaultPlan(mode=FaultMode.FAIL, status="UNAVAILABLE")})
    try:
        async with GrpcToolPort(bed.routes()) as p, TestbedClient(bed.address) as c:
            failed = await p.invoke(provision("ek-1"))
            await c.set_faults(FaultPlan(), PROVISIONER)
            healed = await p.invoke(provision("ek-2"))
    finally:
        await bed.stop()
    assert (failed.settlement, healed.settlement) == (Settlement.UNKNOWN, Settlement.ESTABLISHED)


async def test_testbed_runs_as_a_subprocess_with_faults_from_the_command_line() -> None:
    # Given `python -m testbed.tools` started with a malformed-payload fault on the notifier
    with TestbedProcess(faults={"notifier": FaultPlan(mode=FaultMode.MALFORMED)}) as proc:
        async with GrpcToolPort({}, default_address=proc.address) as p, TestbedClient(proc.address) as c:
            # When one call goes to the faulty service and one to a healthy one
            note = await p.invoke(invocation("send_notification", {"recipient": "a", "message": "b"}, "ek-n"))
            env = await p.invoke(provision("ek-p"))
            ledger = await c.ledger()
    # Then the fault shows only where configured, and the ledger (read over gRPC) has both effects
    assert (note.settlement, env.settlement) == (Settlement.UNKNOWN, Settlement.ESTABLISHED)
    assert (len(ledger.notifications), len(ledger.environments)) == (1, 1)
