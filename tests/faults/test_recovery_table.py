"""The recovery chapter's fault-test plan (table 10), one test per row, through the product: trajectory actors
on Ray, the durable log on a real redis-server, the simulated provider, and the gRPC testbed whose services
apply every delivery (no effect-key dedupe to hide a re-dispatch).

Each row is judged by the testbed's deliveries and effects and by the folded record (``fault_kit``). Each
row's property has a control: the same run with that protection switched off by a mutation
(``mutations.py``), asserted to fail the same judge. The rows that needed the cleanup issue (11) or the
containment issue (12) were strict xfails until those issues landed; none is left.

Rows (recovery chapter, §12.9.3, table 10):

1. Storage acknowledgment unavailable before dispatch
2. Reply lost after endpoint provisioning
3. Worker and local volume lost with provisioning unresolved
4. Release executes but its reply is lost (issue 11)
5. Candidate changes after a check
6. Dependency slows while retries and late probes arrive
7. Suspect content induces a forbidden proposal during unresolved work (containment, issue 12)
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import ray
import redis.asyncio as aioredis

from breakers.guard import NAMESPACE as GUARD_NAMESPACE
from breakers.guard import GuardHandle, actor_name
from breakers.scope_guard import GuardSnapshot
from cluster.redis_server import RedisServer
from runtime.events import OperationSettled, ToolCallCancelled
from runtime.obligations import ObligationState
from runtime.ports import Settlement
from runtime.states import TrajectoryState
from testbed.provider import ProviderConfig, ProviderThread, start_provider_thread
from testbed.tools import FaultMode, FaultPlan, Testbed, TestbedClient, start_testbed
from tests.faults.fault_kit import (
    announced,
    book,
    dispatched,
    ended,
    handed_off,
    in_model_call,
    in_tool_call,
    launch,
    results,
    unique,
    until_delivered,
    until_logged,
)
from tests.integration.trajectory_kit import MODEL, events_of

pytestmark = [pytest.mark.faults, pytest.mark.integration, pytest.mark.timeout(300)]

PROVISIONER = "env-provisioner"
FAST = {"ttft_ms": 5.0, "tokens_per_s": 5000.0}
# A tool-call reply of ~20 tokens takes ~1.7 s: wide enough to land a fault inside it on a busy machine.
SLOW = {"ttft_ms": 1200.0, "tokens_per_s": 40.0}


@pytest.fixture(scope="module")
def provider() -> Iterator[ProviderThread]:
    handle = start_provider_thread(ProviderConfig(models=(MODEL,), **FAST))
    try:
        yield handle
    finally:
        handle.stop()


@pytest.fixture
def fast(provider: ProviderThread) -> ProviderThread:
    provider.configure(**FAST)
    return provider


@pytest.fixture
def slow(provider: ProviderThread) -> Iterator[ProviderThread]:
    provider.configure(**SLOW)
    yield provider
    provider.configure(**FAST)


@pytest.fixture
async def testbed() -> AsyncIterator[Testbed]:
    bed = await start_testbed(0, provision_s=0.05)
    try:
        yield bed
    finally:
        await bed.stop()


async def set_faults(testbed: Testbed, plan: FaultPlan, service: str) -> None:
    async with TestbedClient(testbed.address) as client:
        await client.set_faults(plan, service)


# ------------------------------------------------------------------------------------------------ row 1


@pytest.mark.parametrize(
    "mutation", [None, "unacknowledged-log"], ids=["runtime", "control-unacknowledged-log"]
)
async def test_storage_acknowledgment_unavailable_before_dispatch_releases_no_request(
    ray_local: None, redis_server: RedisServer, slow: ProviderThread, testbed: Testbed, mutation: str | None
) -> None:
    # Given a trajectory in its first model call, whose reply will ask to provision an environment
    tid = unique("r1-store")
    handle = launch(
        tid,
        slow,
        testbed,
        redis_server.url,
        scenario="finish_after:1",
        grants=["provision_env"],
        mutation=mutation,
        tool_timeout_s=10.0,
    )
    running = asyncio.ensure_future(_run(handle))
    await until_logged(redis_server.url, tid, in_model_call(1))
    # When the log store goes away (redis-server SIGKILLed) while the reply streams in, for 4 s
    down_at = time.time()
    redis_server.kill()
    await asyncio.sleep(4.0)  # the outage itself: what is judged is what happened during it
    await asyncio.to_thread(redis_server.restart)
    up_at = time.time()
    summary = await asyncio.wait_for(running, 120)
    events = await events_of(redis_server.url, tid)
    ledger = await book(testbed)
    # Then no request reached the provisioner while its intent could not be acknowledged ...
    during = [d for d in ledger.deliveries if down_at <= d.arrived_at <= up_at]
    # ... and every request that did reach it (the runtime's own release in FINALIZING included) was
    # announced by an intent the log still holds
    keys = {e.effect_key for e in announced(events)}
    unannounced = [d for d in ledger.deliveries if d.effect_key not in keys]
    if mutation is None:
        assert during == [] and unannounced == []
        assert summary["state"] == "COMPLETED" and len(ledger.environments) == 1
    else:
        # (control) a runtime that goes on without its store (appends not acknowledged, the quarantine taken
        # as clear when it cannot be read) sends the request while nothing durable announces it
        assert during != [] or unannounced != [], "the control should have dispatched while Redis was down"


async def _run(handle: Any) -> dict[str, Any]:
    summary: dict[str, Any] = await handle.run.remote()
    return summary


# ------------------------------------------------------------------------------------------------ row 2


@pytest.mark.parametrize("mutation", [None, "blind-retry"], ids=["runtime", "control-blind-retry"])
async def test_reply_lost_after_endpoint_provisioning_is_never_provisioned_twice(
    ray_local: None, redis_url: str, fast: ProviderThread, testbed: Testbed, mutation: str | None
) -> None:
    # Given the provisioner applies the next provisioning and never answers it
    await set_faults(testbed, FaultPlan(mode=FaultMode.DROP_REPLY, count=1), PROVISIONER)
    tid = unique("r2-lost")
    # When a trajectory provisions twice, its first reply lost
    handle = launch(
        tid,
        fast,
        testbed,
        redis_url,
        scenario="finish_after:2",
        grants=["provision_env"],
        mutation=mutation,
        tool_timeout_s=2.0,
    )
    run = await ended(handle, tid, redis_url, testbed)
    keys = run.keys("provision_env")
    if mutation is not None:
        # (control) a client that sends again after the timeout: the judge sees the duplicate delivery
        assert run.book.duplicate_deliveries() != []
        return
    # Then no provisioning was delivered twice, and no environment exists that no intent announced
    assert run.book.duplicate_deliveries() == []
    assert [len(run.book.deliveries_for(k)) for k in sorted(keys)] == [1] * len(keys)
    assert {env.effect_key for env in run.book.environments} == keys
    # And the lost one (the ledger's dropped reply) is bound by correlated evidence (the endpoint's probe)
    # or stays unresolved with its owner
    [lost_key] = [d.effect_key for d in run.book.deliveries if d.reply == "dropped"]
    record = run.record
    [op] = [op for op in record.operations.values() if op.effect_key == lost_key]
    probed = [e for e in run.events if isinstance(e, OperationSettled) and e.operation_id == op.operation_id]
    assert (op.settlement is Settlement.ESTABLISHED and probed) or handed_off(record, op.operation_id), op
    # And where the record holds an environment id, it is the one the ledger made for that key
    for result in established(run.events):
        intent = next(e for e in dispatched(run.events) if e.call_id == result.call_id)
        [env] = run.book.environments_for(intent.effect_key)
        assert isinstance(result.result, dict) and result.result["env_id"] == env.env_id


def established(events: list[Any]) -> list[Any]:
    return [r for r in results(events) if r.settlement is Settlement.ESTABLISHED]


@pytest.mark.parametrize("mutation", [None, "unbound-probe"], ids=["runtime", "control-unbound-probe"])
async def test_compensation_after_a_lost_provisioning_reply_leaves_no_orphan(
    ray_local: None, redis_url: str, fast: ProviderThread, testbed: Testbed, mutation: str | None
) -> None:
    # Given a provisioning whose reply is lost after the effect
    await set_faults(testbed, FaultPlan(mode=FaultMode.DROP_REPLY, count=1), PROVISIONER)
    tid = unique("r2-comp")
    handle = launch(
        tid,
        fast,
        testbed,
        redis_url,
        scenario="finish_after:2",
        grants=["provision_env"],
        mutation=mutation,
        tool_timeout_s=2.0,
    )
    # When the trajectory runs to its end (through FINALIZING)
    run = await ended(handle, tid, redis_url, testbed)
    if mutation is not None:
        # (control) a probe that settles without binding its result: the lost one stays billed
        assert run.book.orphaned_environments() != []
        return
    # Then the runtime itself released every environment it made, the lost one included: no orphan, and
    # each release was delivered for an environment the ledger holds
    assert run.book.environments and run.book.orphaned_environments() == []
    released = {d.effect_key for d in run.book.deliveries if d.tool == "release_env"}
    assert len(released) == len(run.book.environments)
    # And every release was the runtime's own compensation (announced in FINALIZING before it was sent),
    # not anyone else's: nothing in this test releases anything
    assert released == {e.effect_key for e in announced(run.events, "release_env")}
    assert all(
        d.trajectory_id == tid and d.call_id.startswith("cleanup:")
        for d in run.book.deliveries
        if d.tool == "release_env"
    )
    # And the lost one was bound by the probe's recovered result, not guessed
    [lost_key] = [d.effect_key for d in run.book.deliveries if d.reply == "dropped"]
    [op] = [op for op in run.record.operations.values() if op.effect_key == lost_key]
    [env] = run.book.environments_for(lost_key)
    assert isinstance(op.result, dict) and op.result["env_id"] == env.env_id


# ------------------------------------------------------------------------------------------------ row 3


@pytest.fixture
async def slow_testbed() -> AsyncIterator[Testbed]:
    bed = await start_testbed(0, provision_s=4.0)  # a provisioning takes 4 s: long enough to crash inside
    try:
        yield bed
    finally:
        await bed.stop()


@pytest.mark.parametrize("mutation", [None, "forgetful-log"], ids=["runtime", "control-forgetful-log"])
async def test_worker_and_local_volume_lost_with_provisioning_unresolved_keep_the_obligation(
    ray_local: None,
    redis_url: str,
    fast: ProviderThread,
    slow_testbed: Testbed,
    tmp_path: Path,
    mutation: str | None,
) -> None:
    # Given a trajectory (with a sandbox workspace on local disk) whose provisioning is in flight
    tid = unique("r3-lost")
    volume = tmp_path / "volume"
    handle = launch(
        tid,
        fast,
        slow_testbed,
        redis_url,
        scenario="finish_after:1",
        grants=["provision_env"],
        mutation=mutation,
        tool_timeout_s=20.0,
        workspace_root=str(volume),
    )
    pid = await handle.pid.remote()
    running = asyncio.ensure_future(_run(handle))
    at_kill = await until_logged(redis_url, tid, in_tool_call("provision_env"))
    await until_delivered(slow_testbed, dispatched(at_kill, "provision_env")[0].effect_key)
    # When the worker dies (SIGKILL) while the endpoint works on the provisioning, and its local volume too
    os.kill(pid, signal.SIGKILL)
    shutil.rmtree(volume, ignore_errors=True)
    summary = await asyncio.wait_for(running, 180)  # Ray restarts the actor and retries run()
    events = await events_of(redis_url, tid)
    ledger = await book(slow_testbed)
    [intent] = dispatched(at_kill, "provision_env")
    if mutation is not None:
        # (control) a runtime without its log starts over: the provisioning is delivered again
        assert ledger.duplicate_deliveries() != [], (summary, [type(e).__name__ for e in events])
        return
    # Then the reconstruction kept the operation, its cleanup template and its liability, owned ...
    record = await _fold(redis_url, tid)
    op = record.operations[intent.operation_id]
    assert (op.effect_key, op.compensation, op.attempts) == (intent.effect_key, "release_env", 1)
    assert op.settled or (handed_off(record, op.operation_id) and op.liability == intent.liability)
    assert any(isinstance(e, ToolCallCancelled) and "restarted" in e.reason for e in events)
    # ... and the dead incarnation's attempt authorised nothing new: one delivery, at most one environment
    assert ledger.duplicate_deliveries() == []
    assert len(ledger.deliveries_for(intent.effect_key)) == 1
    assert len(ledger.environments_for(intent.effect_key)) <= 1
    assert summary["state"] in {"COMPLETED", "FAILED"}


async def _fold(redis_url: str, tid: str) -> Any:
    from runtime.fold import fold

    return fold(await events_of(redis_url, tid))


# ------------------------------------------------------------------------------------------------ row 4


@pytest.mark.parametrize("mutation", [None, "trusting-cleanup"], ids=["runtime", "control-trusting-cleanup"])
async def test_release_executed_with_its_reply_lost_is_not_marked_clean(
    ray_local: None, redis_url: str, fast: ProviderThread, testbed: Testbed, mutation: str | None
) -> None:
    # Given the release of an environment is applied and its reply lost
    await set_faults(
        testbed, FaultPlan(mode=FaultMode.DROP_REPLY, count=1, tools=frozenset({"release_env"})), PROVISIONER
    )
    tid = unique("r4-release")
    handle = launch(
        tid,
        fast,
        testbed,
        redis_url,
        scenario="finish_after:1",
        grants=["provision_env"],
        mutation=mutation,
        tool_timeout_s=2.0,
    )
    # When the trajectory ends and the runtime cleans up (FINALIZING; nothing in this test releases)
    run = await ended(handle, tid, redis_url, testbed)
    # Then the runtime's own release was delivered for the environment, and the environment is released ...
    [env] = run.book.environments
    releases = [d for d in run.book.deliveries if d.tool == "release_env"]
    assert releases and env.released_at is not None
    assert all(d.trajectory_id == tid and d.call_id.startswith("cleanup:") for d in releases)
    assert releases[0].reply == "dropped"
    # ... while the record calls the release clean only on evidence: its own operation settled by an
    # answered attempt (the idempotent contract allows the repeat) that the ledger holds, never because it
    # was attempted; otherwise the obligation and its operation stay open, owned and in the packet
    [ob] = [o for o in run.record.obligations.values() if o.tool == "release_env"]
    assert ob.cleanup_operation is not None
    release = run.record.operations[ob.cleanup_operation]
    answered = [d for d in run.book.deliveries_for(release.effect_key) if d.reply == "answered"]
    if ob.state is ObligationState.DISCHARGED and not ob.accepted_risk:
        if mutation is not None:
            # (control) a runtime that takes "sent" for "done" records it clean without evidence
            assert release.settlement is not Settlement.ESTABLISHED or answered == []
            return
        assert release.settlement is Settlement.ESTABLISHED and answered, (ob, release)
    else:
        assert mutation is None, f"the control should have recorded the release clean: {ob}"
        assert ob.state is ObligationState.HANDED_OFF and ob.owner, ob
        assert release.settled or (release.in_doubt and release.owner), release


# ------------------------------------------------------------------------------------------------ row 5


def _script(*calls: tuple[str, dict[str, str]]) -> str:
    return "script:" + json.dumps([[tool, args] for tool, args in calls])


FIRST = ("write_note", {"title": "fix", "body": "first version"})
TESTED = ("run_tests", {"suite": "unit", "commit": "v2"})  # the testbed's verdict for these: passed
SECOND = ("write_note", {"title": "fix", "body": "second version"})
RETESTED = ("run_tests", {"suite": "unit", "commit": "r2"})  # passed too


@pytest.mark.parametrize(
    ("calls", "mutation"),
    [
        ((FIRST, TESTED, SECOND), None),
        ((FIRST, TESTED, SECOND, RETESTED), None),
        ((FIRST, TESTED, SECOND), "stale-evidence"),
    ],
    ids=["changed-after-check", "checked-again", "control-stale-evidence"],
)
async def test_candidate_changes_after_a_check_and_its_checks_are_not_skipped(
    ray_local: None,
    redis_url: str,
    fast: ProviderThread,
    testbed: Testbed,
    calls: tuple[tuple[str, dict[str, str]], ...],
    mutation: str | None,
) -> None:
    # Given a trajectory that writes its candidate (a note), runs its check (run_tests, passing), changes
    # the candidate, and then claims it is done — with or without checking the change
    tid = unique("r5-candidate")
    handle = launch(
        tid,
        fast,
        testbed,
        redis_url,
        scenario=_script(*calls),
        grants=["write_note", "run_tests"],
        check="candidate_checked",
        check_params={"tools": ["run_tests"]},
        mutation=mutation,
    )
    run = await ended(handle, tid, redis_url, testbed)
    # Judged by the deliveries: was the last change of the candidate followed by a run of its check?
    delivered = sorted((d for d in run.book.deliveries if d.trajectory_id == tid), key=lambda d: d.seq)
    last_write = max(d.seq for d in delivered if d.tool == "write_note")
    checked_after = [d for d in delivered if d.tool == "run_tests" and d.seq > last_write]
    completed = run.summary["state"] == TrajectoryState.COMPLETED.value
    if mutation is not None:
        # (control) a runtime whose evidence has no scope completes on the first version's passing test
        assert completed and not checked_after, run.summary
        return
    # Then completion was admitted only when the changed candidate had its own passing check ...
    assert completed == bool(checked_after), (run.summary, run.record.revisions)
    # ... and the record keeps each check with the revision it checked, each revision opened by its write
    revisions = run.record.revisions
    writes = [op for op in run.record.operations.values() if op.tool == "write_note"]
    assert [r.operation_id for r in revisions] == [None, *(op.operation_id for op in writes)]
    assert [[c.tool for c in r.checks] for r in revisions] == [
        [],
        ["run_tests"],
        ["run_tests"] if checked_after else [],
    ]
    assert all(c.passed for r in revisions for c in r.checks)
    if not completed:
        assert run.record.check_passed is False and run.summary["state"] == TrajectoryState.FAILED.value


# ------------------------------------------------------------------------------------------------ row 6


def guard_snapshot(scope: str) -> GuardSnapshot:
    guard: Any = ray.get_actor(actor_name(scope), namespace=GUARD_NAMESPACE)
    snapshot: GuardSnapshot = ray.get(guard.snapshot.remote())
    return snapshot


@pytest.mark.parametrize("mutation", [None, "blind-retry"], ids=["runtime", "control-blind-retry"])
async def test_dependency_slowing_while_retries_and_late_probes_arrive_keeps_every_bound(
    ray_local: None, redis_url: str, fast: ProviderThread, testbed: Testbed, mutation: str | None
) -> None:
    # Given the provisioner answers later than callers wait (1.5 s against 1 s) for its next six calls,
    # behind one shared guard actor (breaker + bulkhead) for its scope
    await set_faults(testbed, FaultPlan(mode=FaultMode.SLOW, delay_s=1.5, count=6), PROVISIONER)
    guards = GuardHandle()
    guards.actor(PROVISIONER)
    retry = {"max_attempts": 3, "base_backoff_s": 0.05, "max_backoff_s": 0.2}
    # When three trajectories provision through it at once
    tids = [unique(f"r6-slow{i}") for i in range(3)]
    handles = [
        launch(
            tid,
            fast,
            testbed,
            redis_url,
            scenario="finish_after:2",
            grants=["provision_env"],
            mutation=mutation,
            tool_timeout_s=1.0,
            guard="actor",
            retry=retry,
        )
        for tid in tids
    ]
    try:
        runs = await asyncio.gather(
            *(ended(h, t, redis_url, testbed, 180) for h, t in zip(handles, tids, strict=True))
        )
        snapshot = guard_snapshot(PROVISIONER)
    finally:
        ray.kill(guards.actor(PROVISIONER))
    ledger = await book(testbed)
    per_operation: dict[tuple[str, str], int] = {}
    for d in ledger.deliveries:
        if d.tool == "provision_env":
            per_operation[(d.trajectory_id, d.operation_id)] = (
                per_operation.get((d.trajectory_id, d.operation_id), 0) + 1
            )
    if mutation is not None:
        # (control) a retry layer under the retry owner: deliveries repeat an effect still in flight
        assert ledger.duplicate_deliveries() != [] or max(per_operation.values()) > retry["max_attempts"]
        return
    # Then the dependency really was slow (some deliveries were refused for want of time) ...
    assert any(d.disposition == "refused" for d in ledger.deliveries), ledger.deliveries
    # ... and across every retry layer an operation was delivered at most max_attempts times, each repeat
    # only after the endpoint had refused the earlier one (late results never counted as absence)
    assert max(per_operation.values()) <= retry["max_attempts"]
    assert ledger.duplicate_deliveries() == []
    # And each environment answers to one announced key; the slot and queue bounds were released
    announced = set().union(*(run.keys("provision_env") for run in runs))
    assert {env.effect_key for env in ledger.environments} <= announced
    assert (snapshot.in_flight, snapshot.queued) == (0, 0)
    for run in runs:
        ops = run.record.operations.values()
        assert all(op.attempts <= retry["max_attempts"] for op in ops)


# ------------------------------------------------------------------------------------------------ row 7


@pytest.mark.parametrize("mutation", [None, "no-disclosure-rule"], ids=["runtime", "control-no-rule"])
async def test_suspect_content_inducing_a_forbidden_proposal_during_unresolved_work_is_withheld_and_held(
    ray_local: None, redis_url: str, fast: ProviderThread, testbed: Testbed, mutation: str | None
) -> None:
    # Given a trajectory whose provisioning reply is lost (its outcome unresolved when the next reply comes),
    # whose model is then induced to send a notification carrying fixture data a disclosure rule forbids
    # for that tool
    from actors.supervision_config import DisclosureSpec, SupervisionSpec
    from cluster.supervision_store import RedisSupervisionStore

    await set_faults(testbed, FaultPlan(mode=FaultMode.DROP_REPLY, count=1), PROVISIONER)
    tid = unique("r7-incident")
    script = (
        'script:[["provision_env",{"tenant":"acme"}],'
        '["send_notification",{"recipient":"ops","message":"rows like FIXTURE-042 fail"}]]'
    )
    rule = DisclosureSpec(data_class="fixtures", pattern="FIXTURE-[0-9]{3}", tools=("send_notification",))
    handle = launch(
        tid,
        fast,
        testbed,
        redis_url,
        scenario=script,
        grants=["send_notification", "provision_env", "release_env"],
        approval_required=(),
        mutation=mutation,
        tool_timeout_s=2.0,
        hibernate_after_s=1.0,  # held PAUSED, it lets its actor go: run() answers
        supervision=SupervisionSpec(disclosure=(rule,)),
    )
    run = await ended(handle, tid, redis_url, testbed)
    sent = [d for d in run.book.deliveries if d.tool == "send_notification"]
    # (send_notification is irreversible: it waits at the approval gate first; one click would send it)
    # Judged on the record: the trajectory hibernates, and its log is compacted to a record snapshot
    held, operations = run.record.held, run.record.operations.values()
    forwarded = [h for h in (held,) if h is not None and h.tool == "send_notification"] + [
        op for op in operations if op.tool == "send_notification"
    ]
    if mutation is not None:
        # (control) without the rule the proposal goes on to the approval gate: the judge below fails
        assert forwarded
        return
    # Then the proposal went nowhere: withheld before the approval gate and dispatch, structurally
    assert forwarded == [] and sent == []
    # and the trajectory is held PAUSED by an incident it opened itself, not finished
    record = run.record
    assert record.state is TrajectoryState.PAUSED and record.hold is not None
    assert record.supervision.incidents and record.hold.incident_ids == record.supervision.incidents
    # the incident record keeps the pre-dispatch decision apart from the suspected cause, names the member's
    # operations with their owners, and says blocking this call proves nothing about earlier disclosure
    client = aioredis.Redis.from_url(redis_url)
    try:
        incident = await RedisSupervisionStore(client).incident(record.supervision.incidents[0])
    finally:
        await client.aclose()
    assert incident is not None and incident["symptom"] != incident["suspected_cause"]
    member = incident["members"][tid]
    assert [op["tool"] for op in member["operations"]] == ["provision_env"]
    assert "no evidence that no earlier disclosure" in incident["evidence"]["caveat"]
