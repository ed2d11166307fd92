"""Dependency isolation on Ray with the real gRPC testbed (issue 6, integration; reliability guide §5-§7).

Every run here goes through ``tether run``'s own driver (``cluster.runner.Services`` + ``run_driver``): a
simulated provider and the testbed tool services as subprocesses, one guard actor per dependency scope,
one trajectory actor per trajectory. Faults are set on the running testbed over gRPC (``FaultControl``).

The judges are independent of the runtime under test:

- the guard actors' own snapshots (breaker state and generation per scope), read straight from Ray;
- the testbed's ledger, kept by the simulated dependency itself and read over gRPC: every delivery it
  received (its services apply every delivery, so a re-dispatch cannot hide behind effect-key dedupe),
  environments allocated, effect keys applied, what is still allocated;
- the durable logs only say what the runtime *meant* to do (which effect keys it dispatched, which
  operations it left in doubt); whether an effect happened, and how often, is the ledger's word.

Controls: the isolation test runs once more with every testbed tool in one shared dependency scope (the
breaker's scoping switched off), and the lost-reply judge runs once more with a tool client that sends a
timed-out call again (``tests.faults.mutations``); both must fail their judges.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import ray

from breakers.breaker import BreakerState
from breakers.guard import NAMESPACE, GuardHandle, actor_name
from breakers.scope_guard import GuardSnapshot
from cluster.redis_server import RedisServer
from cluster.runner import RunOptions, RunResult, Services, run_driver
from cluster.workload import Workload, parse_workload
from runtime.events import (
    CleanupDispatched,
    ObservationAppended,
    OperationSettled,
    ToolDispatchIntent,
    ToolResultAccepted,
)
from runtime.fold import fold
from runtime.operations import Operation
from runtime.ports import Settlement
from runtime.record import TrajectoryRecord
from testbed.tools import FaultMode, FaultPlan, LedgerSnapshot, TestbedClient
from tests.faults.mutations import MutatedAdapters
from tests.integration.trajectory_kit import events_of

# 600 s: each test runs `tether run`'s services and two workloads of several trajectories through a breaker
# that must trip; the module-scoped lost-reply run shares its budget with the tests that read it.
pytestmark = [pytest.mark.faults, pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(600)]

TEST_RUNNER = "test-runner"
PROVISIONER = "env-provisioner"

_HEADER = """\
name: {name}
provider:
  kind: simulated
  model: sim-small
  limits: {{tpm: 1000000, rpm: 6000}}
  latency: {{ttft_ms: 5, tokens_per_s: 5000}}
tools:
  - {{name: run_tests}}
  - {{name: provision_env}}
  - {{name: release_env}}
guard: actor                 # one shared guard actor (breaker + bulkhead) per dependency scope
scheduler: false             # turn admission is not under test here
tool_timeout_s: {tool_timeout_s}
retry: {{max_attempts: 3, base_backoff_s: 0.05, max_backoff_s: 0.2}}
trajectories:
"""

# Each flaky-tests trajectory makes 8 run_tests operations; with every attempt failing, the default breaker
# policy (20 samples, 50 % failures) trips well before the 4 trajectories run out of operations.
_TESTS = """\
  - id: {id}
    count: {count}
    scenario: "finish_after:{steps}"
    grants: [run_tests]
    completion_check: {{kind: min_tool_results, count: {steps}}}
"""

_ENVS = """\
  - id: {id}
    count: {count}
    scenario: "finish_after:2"
    grants: [provision_env]
    completion_check: {{kind: min_tool_results, count: 2}}
"""


def workload(
    name: str, *, tool_timeout_s: float, tests: int = 0, test_steps: int = 8, envs: int = 0
) -> Workload:
    body = _HEADER.format(name=name, tool_timeout_s=tool_timeout_s)
    if tests:
        body += _TESTS.format(id=f"{name}-tests", count=tests, steps=test_steps)
    if envs:
        body += _ENVS.format(id=f"{name}-envs", count=envs)
    return parse_workload(body, f"{name}.yaml")


# ----------------------------------------------------------------------------------------------- helpers


@contextlib.contextmanager
def tether_services(wl: Workload, redis_url: str, home: Path) -> Iterator[Services]:
    """``tether run``'s services for ``wl`` on our Redis and a private home.

    The guard actors are killed afterwards: they are named per scope, and one test's breaker state must
    not leak into the next test on the same Ray.
    """
    with pytest.MonkeyPatch.context() as env:
        env.setenv("TETHER_REDIS_URL", redis_url)
        env.setenv("TETHER_HOME", str(home))
        try:
            with Services(wl, RunOptions()) as services:
                assert services.testbed_address is not None
                yield services
        finally:
            for scope in (TEST_RUNNER, PROVISIONER, "testbed"):  # testbed: the one-scope control's
                with contextlib.suppress(ValueError):  # ValueError: never created
                    ray.kill(ray.get_actor(actor_name(scope), namespace=NAMESPACE))


def guard_snapshot(scope: str) -> GuardSnapshot:
    """The scope's breaker and bulkhead as its guard actor sees them."""
    guard: Any = ray.get_actor(actor_name(scope), namespace=NAMESPACE)
    snapshot: GuardSnapshot = ray.get(guard.snapshot.remote())
    return snapshot


def run(wl: Workload, services: Services, run_id: str) -> RunResult:
    return run_driver(wl, services, RunOptions(run_id=run_id, poll_s=0.1))


def set_faults(address: str, plan: FaultPlan, service: str) -> None:
    async def go() -> None:
        async with TestbedClient(address) as client:
            await client.set_faults(plan, service)

    asyncio.run(go())


def ledger(address: str) -> LedgerSnapshot:
    async def go() -> LedgerSnapshot:
        async with TestbedClient(address) as client:
            return await client.ledger()

    return asyncio.run(go())


def refusals(events: list[Any]) -> list[dict[str, Any]]:
    """REJECTED observations the trajectory was told (nothing was dispatched for these calls)."""
    found = []
    for event in events:
        if isinstance(event, ObservationAppended) and event.call_id is not None:
            try:
                body = json.loads(event.content)
            except ValueError:
                continue
            if isinstance(body, dict) and body.get("status") == "REJECTED":
                found.append(body)
    return found


def logs(redis_url: str, result: RunResult) -> dict[str, list[Any]]:
    async def go() -> dict[str, list[Any]]:
        return {r.id: await events_of(redis_url, r.id) for r in result.results}

    return asyncio.run(go())


# ------------------------------------------------------------------------------------- (a) isolation


@pytest.mark.parametrize(
    ("fault", "tool_timeout_s", "mutation"),
    [
        # every run_tests attempt is refused UNAVAILABLE before any effect (an infrastructure failure)
        (FaultPlan(mode=FaultMode.FAIL, status="UNAVAILABLE"), 5.0, None),
        # every run_tests call is held far past its deadline: DEADLINE_EXCEEDED at the caller
        (FaultPlan(mode=FaultMode.SLOW, delay_s=30.0), 1.5, None),
        # control: every testbed tool in one dependency scope, so one breaker guards them all
        (FaultPlan(mode=FaultMode.FAIL, status="UNAVAILABLE"), 5.0, "one-scope"),
    ],
    ids=["test-runner-fails", "test-runner-slows-down", "control-one-scope"],
)
def test_a_degraded_dependency_trips_its_own_breaker_and_no_other_dependency_is_affected(
    ray_local: None,
    redis_url: str,
    tmp_path: Path,
    fault: FaultPlan,
    tool_timeout_s: float,
    mutation: str | None,
) -> None:
    tripping = workload("trip", tool_timeout_s=tool_timeout_s, tests=4)
    mixed = workload("mixed", tool_timeout_s=tool_timeout_s, tests=2, test_steps=2, envs=3)
    with tether_services(mixed, redis_url, tmp_path / "home") as services:
        assert services.testbed_address is not None
        if mutation is not None:
            services.adapters = MutatedAdapters(mutation=mutation)
            # the one scope is not among the workload's declared scopes, whose guards the driver creates
            # and owns: created (and referenced) here, the test being the driver, it does not die with the
            # first trajectory actor that used it
            shared_guard = GuardHandle().actor("testbed")
        # Given the test runner degrades (the fault stays on for the whole test)
        set_faults(services.testbed_address, fault, TEST_RUNNER)

        # When trajectories keep calling it
        first = run(tripping, services, "p1")
        if mutation is not None:
            # (control) with one breaker for every dependency, the breaker that guards the provisioning
            # calls counts the test runner's failures: the judge below (the provisioner's breaker never
            # opened and has no failure in its window) fails
            run(mixed, services, "p2")
            shared = ray.get(shared_guard.snapshot.remote())
            assert shared.generation >= 1 or shared.window_failures > 0, shared
            return

        # Then its breaker tripped (generation > 0) and is still withholding calls
        tripped = guard_snapshot(TEST_RUNNER)
        assert tripped.state is BreakerState.OPEN and tripped.generation >= 1, tripped
        # And later calls were refused at admission with a structured observation naming the scope
        first_logs = logs(redis_url, first)
        refused = [r for events in first_logs.values() for r in refusals(events)]
        assert refused and all(r["reason"] == "BreakerOpen" for r in refused), refused
        assert all(TEST_RUNNER in r["message"] for r in refused)
        # And no trajectory got a passing test run out of it: their completion checks failed
        assert {(r.state, r.exit_reason) for r in first.results} == {("FAILED", "COMPLETION_CHECK_FAILED")}

        # When, with the test runner's breaker open, trajectories use both dependencies at once
        before = ledger(services.testbed_address)
        second = run(mixed, services, "p2")
        after = ledger(services.testbed_address)
        provisioner = guard_snapshot(PROVISIONER)
        runner = guard_snapshot(TEST_RUNNER)

    # Then every provisioning trajectory completed, untouched by the test runner's trouble
    envs = [r for r in second.results if r.name.startswith("mixed-envs")]
    tests = [r for r in second.results if r.name.startswith("mixed-tests")]
    assert [(r.state, r.exit_reason, r.error) for r in envs] == [("COMPLETED", "COMPLETED", None)] * 3
    assert {r.state for r in tests} == {"FAILED"}
    second_logs = logs(redis_url, second)
    for r in envs:
        events = second_logs[r.id]
        assert refusals(events) == [], f"{r.name} was refused a call"
        results = [e for e in events if isinstance(e, ToolResultAccepted)]
        assert [e.settlement for e in results] == [Settlement.ESTABLISHED] * 2, [
            type(e).__name__ for e in events
        ]
    # And the environment provisioner's breaker never saw a failure, while the test runner's never closed
    assert runner.state is not BreakerState.CLOSED and runner.generation >= tripped.generation
    assert (provisioner.state, provisioner.generation, provisioner.window_failures) == (
        BreakerState.CLOSED,
        0,
        0,
    )
    # And by the testbed's own ledger: exactly one environment per provisioning call, all made in phase 2
    assert before.environments == ()
    dispatched = {
        e.effect_key
        for r in envs
        for e in second_logs[r.id]
        if isinstance(e, ToolDispatchIntent) and e.tool == "provision_env"
    }
    assert len(dispatched) == 6
    assert sorted(env.effect_key for env in after.environments) == sorted(dispatched)
    assert after.duplicate_deliveries() == [] and after.duplicate_effects() == []
    assert sorted(d.effect_key for d in after.deliveries if d.tool == "provision_env") == sorted(dispatched)


# ------------------------------------------------------------------ (b) a lost reply, judged by the ledger


@dataclass(frozen=True)
class LostReplyRun:
    """One run of three provisioning trajectories whose first two provisionings lost their replies."""

    result: RunResult
    records: dict[str, TrajectoryRecord]
    events: dict[str, list[Any]]
    book: LedgerSnapshot  # the ledger once the run (the runtime's own cleanup in FINALIZING included) ended


@pytest.fixture(scope="module")
def lost_reply(ray_local: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LostReplyRun]:
    home = tmp_path_factory.mktemp("lost-reply")
    redis = RedisServer(data_dir=home / "redis").start()
    wl = workload("lost", tool_timeout_s=3.0, envs=3)  # generous: only the dropped replies may time out
    try:
        with tether_services(wl, redis.url, home / "home") as services:
            address = services.testbed_address
            assert address is not None
            # The provisioner applies the next two provisionings, then never answers them.
            set_faults(address, FaultPlan(mode=FaultMode.DROP_REPLY, count=2), PROVISIONER)
            result = run(wl, services, "lost")
            events = asyncio.run(_events(redis.url, [r.id for r in result.results]))
            records = {tid: fold(evs) for tid, evs in events.items()}
            book = ledger(address)
        yield LostReplyRun(result, records, events, book)
    finally:
        redis.stop()


async def _events(redis_url: str, ids: list[str]) -> dict[str, list[Any]]:
    return {tid: await events_of(redis_url, tid) for tid in ids}


def known_environments(record: TrajectoryRecord) -> dict[str, str]:
    """effect key -> env id, for every provisioning the record holds as established with its result (a
    reply, or the result a probe recovered)."""
    return {
        op.effect_key: str(op.result["env_id"])
        for op in record.operations.values()
        if op.tool == "provision_env"
        and op.settlement is Settlement.ESTABLISHED
        and isinstance(op.result, dict)
    }


def forward(events: list[Any]) -> list[ToolDispatchIntent]:
    """The trajectory's own calls (its compensations in FINALIZING are ``CleanupDispatched``)."""
    return [e for e in events if isinstance(e, ToolDispatchIntent)]


def in_doubt(run: LostReplyRun) -> dict[str, Operation]:
    """effect key -> operation, for every operation a record leaves unknown (in doubt, with an owner)."""
    return {
        op.effect_key: op
        for record in run.records.values()
        for op in record.operations.values()
        if not op.settled
    }


def probe_settled(run_: LostReplyRun) -> dict[str, Operation]:
    """Operations settled ESTABLISHED by the endpoint's result recovery, by effect key."""
    out: dict[str, Operation] = {}
    for tid, evs in run_.events.items():
        for e in evs:
            if (
                isinstance(e, OperationSettled)
                and e.settlement is Settlement.ESTABLISHED
                and "probe" in e.evidence
            ):
                op = run_.records[tid].operations[e.operation_id]
                out[op.effect_key] = op
    return out


def test_a_reply_dropped_after_the_effect_leaves_no_duplicate_and_no_unaccounted_environment(
    lost_reply: LostReplyRun,
) -> None:
    run_ = lost_reply
    dispatched = {e.effect_key for evs in run_.events.values() for e in forward(evs)}
    # Given the two lost replies really happened after their effects: the endpoint's result recovery settled
    # both operations established (nothing left in doubt), each attempted once, one environment each
    recovered = probe_settled(run_)
    assert len(recovered) == 2 and in_doubt(run_) == {}
    for key, op in recovered.items():
        assert op.attempts == 1, op
        assert len(run_.book.environments_for(key)) == 1
    # Then by the testbed's own deliveries no provisioning was sent twice, no effect applied twice, no
    # environment made per provisioning beyond one; every environment answers to a key some trajectory
    # dispatched
    assert run_.book.duplicate_deliveries() == [] and run_.book.duplicate_effects() == []
    provisions = [d.effect_key for d in run_.book.deliveries if d.tool == "provision_env"]
    assert sorted(provisions) == sorted(dispatched)
    assert sorted(env.effect_key for env in run_.book.environments) == sorted(dispatched)
    # And no provisioning was ever dispatched twice (a trajectory that lost a reply may stop short of its
    # second provisioning, depending on timing; that is the harness's business, not the ledger's)
    intents = [e for evs in run_.events.values() for e in forward(evs)]
    assert len(intents) == len(dispatched) >= 4
    # And where a record holds an environment's id, it is the id the ledger holds for that effect key
    for record in run_.records.values():
        for key, env_id in known_environments(record).items():
            assert [env.env_id for env in run_.book.environments_for(key)] == [env_id]
    # And every trajectory that lost no reply completed (the others: see the result-recovery test below)
    for r in run_.result.results:
        ops = run_.records[r.id].operations.values()
        if all(op.settled and op.effect_key not in recovered for op in ops):
            assert (r.state, r.exit_reason, r.error) == ("COMPLETED", "COMPLETED", None)


def test_an_environment_recovered_by_probe_is_known_to_the_record_and_not_orphaned(
    lost_reply: LostReplyRun,
) -> None:
    # Given the run above: two provisioning replies lost, both settled established by the endpoint's probe
    recovered = probe_settled(lost_reply)
    assert len(recovered) == 2
    # Then the records know every environment, the recovered ones included (the probe's result is bound)
    known = {key for record in lost_reply.records.values() for key in known_environments(record)}
    assert set(recovered) <= known
    # And the runtime's own cleanup (FINALIZING; a test environment is released on completion too) released
    # every environment: nothing stays allocated, and nothing in this test released anything
    assert lost_reply.book.environments and lost_reply.book.orphaned_environments() == []
    releases = [d for d in lost_reply.book.deliveries if d.tool == "release_env"]
    assert releases and all(d.call_id.startswith("cleanup:") for d in releases)
    for tid, evs in lost_reply.events.items():
        announced = {e.effect_key for e in evs if isinstance(e, CleanupDispatched)}
        assert {d.effect_key for d in releases if d.trajectory_id == tid} == announced


def test_a_reply_dropped_after_the_effect_control_blind_retry_shows_the_duplicate(
    ray_local: None, tmp_path: Path
) -> None:
    # (control for the lost-reply judge) Given the same fault, and a tool client that sends a call again
    # when it timed out
    redis = RedisServer(data_dir=tmp_path / "redis").start()
    wl = workload("lostctl", tool_timeout_s=3.0, envs=1)
    try:
        with tether_services(wl, redis.url, tmp_path / "home") as services:
            address = services.testbed_address
            assert address is not None
            services.adapters = MutatedAdapters(mutation="blind-retry")
            set_faults(address, FaultPlan(mode=FaultMode.DROP_REPLY, count=1), PROVISIONER)
            # When the run goes through the same driver
            run(wl, services, "lostctl")
            book = ledger(address)
    finally:
        redis.stop()
    # Then the deliveries judge sees what the runtime's judge above must never see
    assert book.duplicate_deliveries() != [] and book.duplicate_effects() != []


def test_the_endpoints_result_recovery_settles_a_lost_reply(lost_reply: LostReplyRun) -> None:
    # Given the same run: two provisioning replies were lost after their effects
    settled_by_probe = [
        e
        for evs in lost_reply.events.values()
        for e in evs
        if isinstance(e, OperationSettled)
        and e.settlement is Settlement.ESTABLISHED
        and "probe" in e.evidence
    ]
    # Then the probe-then-retry contract settled both from the endpoint's evidence, nothing is in doubt
    assert len(settled_by_probe) == 2
    assert in_doubt(lost_reply) == {}
    # And every trajectory ran to a terminal state through FINALIZING, its actor's run() never failing
    ended = [(r.name, r.state, r.error) for r in lost_reply.result.results]
    assert all(state in {"COMPLETED", "FAILED"} and error is None for _, state, error in ended), ended
