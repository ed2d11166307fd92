"""The trajectory actor on a real local Ray, a real redis-server, the simulated provider and the testbed tool
services: runs to completion, never dispatches a malformed or truncated call, drops late results, verifies
signed control messages, hibernates and wakes. The testbed's own ledger and the durable log are the judges."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import ray

from actors.launch import load_launch
from actors.trajectory import actor_name, ensure_actor
from cluster.adapters import ClusterAdapters
from cluster.control import ControlMessage, encode_message
from cluster.signing import Role, create_key, load_private_key, sign
from runtime.events import (
    LateResultDropped,
    ModelCallIntent,
    ModelCallSettled,
    ObservationAppended,
    ToolCallTimedOut,
    ToolDispatchIntent,
    ToolResultAccepted,
)
from runtime.record import AuditKind
from testbed.provider import ProviderConfig, ProviderThread, start_provider_thread
from testbed.tools import Testbed, TestbedClient, start_testbed

from .trajectory_kit import MODEL, events_of, make_launch, record_of, start, wait_for_status

pytestmark = [pytest.mark.integration, pytest.mark.timeout(360)]
TOOLS = ("run_tests", "send_notification", "search_packages")


@pytest.fixture(scope="module")
def provider() -> Iterator[ProviderThread]:
    handle = start_provider_thread(ProviderConfig(ttft_ms=5.0, models=(MODEL,)))
    try:
        yield handle
    finally:
        handle.stop()


@pytest.fixture
async def testbed() -> AsyncIterator[Testbed]:
    bed = await start_testbed(0)
    try:
        yield bed
    finally:
        await bed.stop()


async def ledger(bed: Testbed):  # type: ignore[no-untyped-def]
    async with TestbedClient(bed.address) as client:
        return await client.ledger()


def routes(bed: Testbed) -> dict[str, str]:
    return dict.fromkeys(TOOLS, bed.address)


async def test_actor_completes_and_its_log_folds_to_the_same_summary(
    ray_local: None, redis_url: str, provider: ProviderThread, testbed: Testbed
) -> None:
    # Given a trajectory scripted to run the tests twice, then claim it is done
    launch = make_launch(
        "t-complete",
        base_url=provider.base_url,
        redis_url=redis_url,
        scenario="finish_after:2",
        grants=["run_tests"],
        check="min_tool_results",
        check_params={"count": 2},
        tool_routes=routes(testbed),
    )
    # When its actor runs it (twice: the second call must not run anything again)
    handle = start(launch)
    summary = await handle.run.remote()
    again = await handle.run.remote()
    # Then it completed after three turns, the tests ran exactly twice, and the log rebuilds the summary
    assert summary["state"] == "COMPLETED" and summary["turns"] == 3 and again == summary
    assert (await ledger(testbed)).test_runs == 2
    record = await record_of(redis_url, launch.trajectory_id)
    assert (record.state.value, record.turn_count, int(record.spend.get("tokens"))) == (
        "COMPLETED",
        3,
        summary["tokens"],
    )
    status = await wait_for_status(redis_url, launch.trajectory_id, {"COMPLETED"})
    assert status["turns"] == "3" and status["hibernated"] == "0"


async def test_each_turn_reserves_close_to_what_the_provider_counts_and_never_less(
    ray_local: None, redis_url: str, provider: ProviderThread, testbed: Testbed
) -> None:
    # Given a trajectory that runs the tests four times (five turns, each prompt the last one plus a call)
    launch = make_launch(
        "t-reserve",
        base_url=provider.base_url,
        redis_url=redis_url,
        scenario="finish_after:4",
        grants=["run_tests"],
        check="min_tool_results",
        check_params={"count": 4},
        tool_routes=routes(testbed),
    )
    # When it runs
    summary = await start(launch).run.remote()
    assert summary["state"] == "COMPLETED" and summary["turns"] == 5
    # Then the prompts the log says the provider counted are the provider's own tally for this trajectory
    events = await events_of(redis_url, launch.trajectory_id)
    intents = [e for e in events if isinstance(e, ModelCallIntent)]
    counts = [e.counted_prompt for e in events if isinstance(e, ModelCallSettled)]
    assert len(intents) == len(counts) == 5
    assert provider.stats()["trajectories"][launch.trajectory_id]["prompt_tokens"] == sum(counts)
    # and every turn after the first reserved at least its prompt and at most 1.6 times it (here the prompts
    # grow 57 tokens a turn; the reservation's excess is the character estimate of that growth). The plain
    # character estimate each turn started from, what it reserved before anchoring, exceeds that bound on
    # every turn (the control) and grows with the transcript (2.3 times the prompt by the fifth turn)
    turns = list(zip(intents, counts, strict=True))[1:]
    assert all(count <= intent.prompt_tokens <= 1.6 * count for intent, count in turns), turns
    assert all(intent.prompt_basis > 1.6 * count for intent, count in turns), turns
    assert intents[0].prompt_tokens == intents[0].prompt_basis >= counts[0]


@pytest.mark.parametrize(
    ("scenario", "evidence"),
    [
        ("malformed_json:1", "INVALID_ARGUMENTS"),  # refused locally, before any dependency contact
        ("truncate:1", "output-token ceiling"),  # quarantined: a cut reply is never parsed into calls
    ],
)
async def test_malformed_or_truncated_calls_are_never_dispatched(
    ray_local: None,
    redis_url: str,
    provider: ProviderThread,
    testbed: Testbed,
    scenario: str,
    evidence: str,
) -> None:
    # Given a model whose first reply carries a call that must not run, then a final answer
    launch = make_launch(
        f"t-{scenario.split(':')[0]}",
        base_url=provider.base_url,
        redis_url=redis_url,
        scenario=scenario,
        grants=["run_tests"],
        tool_routes=routes(testbed),
    )
    # When it runs
    summary = await start(launch).run.remote()
    # Then the test runner never saw a call, nothing was logged as dispatched, and the model was told why
    events = await events_of(redis_url, launch.trajectory_id)
    assert (await ledger(testbed)).test_runs == 0
    assert not [e for e in events if isinstance(e, ToolDispatchIntent)]
    told = [e.content for e in events if isinstance(e, ObservationAppended) and evidence in e.content]
    assert told and summary["state"] == "COMPLETED"


async def test_late_result_is_dropped_and_audited(
    ray_local: None, redis_url: str, provider: ProviderThread
) -> None:
    # Given a tool that answers after its deadline (sleeps 1 s, 2 s; the deadline is 0.8 s)
    launch = make_launch(
        "t-late",
        base_url=provider.base_url,
        redis_url=redis_url,
        scenario="finish_after:2",
        grants=["sleep"],
        local_tools=["sleep"],
        tool_timeout_s=0.8,
    )
    # When the trajectory runs
    summary = await start(launch).run.remote()
    # Then the first call timed out, its result arrived while the second call was pending and was dropped
    events = await events_of(redis_url, launch.trajectory_id)
    record = await record_of(redis_url, launch.trajectory_id)
    timed_out = [e.call_id for e in events if isinstance(e, ToolCallTimedOut)]
    dropped = [e.call_id for e in events if isinstance(e, LateResultDropped)]
    accepted = {e.call_id for e in events if isinstance(e, ToolResultAccepted)}
    assert timed_out and dropped and dropped[0] == timed_out[0]
    assert not accepted & set(dropped)  # a late result never becomes an observation
    assert any(a.kind is AuditKind.LATE_RESULT_DROPPED for a in record.audit)
    assert summary["state"] == "COMPLETED"


def _signed(keyring: Path, identity: str, message: ControlMessage) -> bytes:
    return encode_message(sign(message, identity, load_private_key(identity, keyring)))


async def test_signed_approval_dispatches_once_and_forgeries_are_audited(
    ray_local: None, redis_url: str, provider: ProviderThread, testbed: Testbed, tmp_path: Path
) -> None:
    # Given a trajectory holding an irreversible notification for approval, and a keyring with alice
    keyring = tmp_path / "keyring.yaml"
    create_key("alice", [Role.OPERATOR], keyring)
    create_key("bot", [Role.POLICY], keyring)
    launch = make_launch(
        "t-approve",
        base_url=provider.base_url,
        redis_url=redis_url,
        scenario="irreversible:send_notification",
        grants=["send_notification"],
        check="tool_succeeded",
        check_params={"tool": "send_notification"},
        tool_routes=routes(testbed),
        approval_timeout_s=120.0,
        keyring_path=str(keyring),
    )
    handle = start(launch)
    running = handle.run.remote()
    status = await wait_for_status(redis_url, launch.trajectory_id, {"AWAITING_APPROVAL"})
    tid, digest = launch.trajectory_id, status["held_digest"]

    def approve(**kw: object) -> ControlMessage:
        return ControlMessage.create(
            tid, "approve", "alice", now=time.time(), payload={"call_digest": digest}, **kw
        )  # type: ignore[arg-type]

    # When an unsigned approval, a policy bot's approval and alice's signed approval arrive (twice)
    unsigned = approve()
    by_bot = ControlMessage.create(tid, "approve", "bot", now=time.time(), payload={"call_digest": digest})
    genuine = approve(reason="looks right")
    answers = [
        await handle.deliver.remote(encode_message(unsigned)),
        await handle.deliver.remote(_signed(keyring, "bot", by_bot)),
        await handle.deliver.remote(_signed(keyring, "alice", genuine)),
        await handle.deliver.remote(_signed(keyring, "alice", genuine)),
    ]
    summary = await running
    # Then only alice's approval counted, once; the notification was sent exactly once
    assert answers == ["rejected:UNSIGNED", "rejected:WRONG_ROLE", "recorded", "duplicate"]
    assert summary["state"] == "COMPLETED"
    snapshot = await ledger(testbed)
    assert len(snapshot.notifications) == 1 and not snapshot.duplicate_effects()
    # And both refusals are in the trajectory's own audit trail
    record = await record_of(redis_url, tid)
    rejected = {a.subject: a.reason for a in record.audit if a.kind is AuditKind.CONTROL_REJECTED}
    assert rejected == {unsigned.message_id: "UNSIGNED", by_bot.message_id: "WRONG_ROLE"}


async def test_hibernated_actor_exits_and_a_message_wakes_it(
    ray_local: None, redis_url: str, provider: ProviderThread, testbed: Testbed, tmp_path: Path
) -> None:
    # Given a trajectory that hibernates after one idle second while its call awaits approval
    keyring = tmp_path / "keyring.yaml"
    create_key("alice", [Role.OPERATOR], keyring)
    launch = make_launch(
        "t-hibernate",
        base_url=provider.base_url,
        redis_url=redis_url,
        scenario="irreversible:send_notification",
        grants=["send_notification"],
        check="tool_succeeded",
        check_params={"tool": "send_notification"},
        tool_routes=routes(testbed),
        approval_timeout_s=120.0,
        hibernate_after_s=1.0,
        keyring_path=str(keyring),
    )
    # When it runs until it hibernates
    first = await start(launch).run.remote()
    # Then run() says so, the actor is gone, and the status snapshot keeps what a waker needs
    assert first["hibernated"] is True and first["state"] == "AWAITING_APPROVAL"
    for _ in range(200):
        try:
            ray.get_actor(actor_name(launch.trajectory_id), namespace="tether")
        except ValueError:
            break
        await asyncio.sleep(0.05)
    else:
        pytest.fail("the hibernated actor did not exit")
    status = await wait_for_status(redis_url, launch.trajectory_id, {"AWAITING_APPROVAL"})
    assert status["hibernated"] == "1" and status["held_tool"] == "send_notification"
    # When an approval arrives for it: re-created from its stored launch, it folds its log and records it
    stored = load_launch(redis_url, launch.trajectory_id)
    assert stored == launch
    woken = ensure_actor(stored, ClusterAdapters())
    message = ControlMessage.create(
        launch.trajectory_id,
        "approve",
        "alice",
        now=time.time(),
        payload={"call_digest": status["held_digest"]},
    )
    assert await woken.deliver.remote(_signed(keyring, "alice", message)) == "recorded"
    summary = await woken.run.remote()
    # Then it completed, with the notification sent once and the turn count carried over
    assert summary["state"] == "COMPLETED" and summary["turns"] == 2
    assert len((await ledger(testbed)).notifications) == 1
    assert json.loads(json.dumps(summary))["hibernated"] is False
